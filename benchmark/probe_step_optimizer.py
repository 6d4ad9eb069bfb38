"""Why memory-bound kernels run slower inside the e2e step than alone:
``python -m benchmark.probe_step_optimizer [--mode bf16] [--layers 4] [--json PATH]``.

The e2e model's optimizer update (``benchmark.e2e_model.update``: grad norm, AdamW,
expert bias) took 33-35 ms inside the bf16 step, while ``benchmark.probe_adamw`` moves
the same bytes in ~25 ms. This probe times the *same* update on the *same* tensors of
one process (CUDA events, no profiler) in different surroundings:

- ``in step``: right after forward + backward, as the step runs it;
- ``alone``: back to back, after the forward + backward of one step (the gradients stay);
- ``after idle``: after the GPU sat idle for ``--idle-s`` seconds;
- ``after GEMMs``: right after ``--heat-s`` seconds of bf16 8192^3 matmuls;
- ``--fresh-copies``: ``AdamW.step`` over copies of the same parameters and gradients in
  fresh back-to-back allocations, against the model's own tensors;

and a 1 GiB device copy in the same surroundings (its bytes are fixed, so its rate is a
bandwidth probe). Clocks, power and temperatures are sampled every 20 ms
(``harness.GpuClockLog``) and averaged over each timed window. What it tells apart: if
``alone`` is as slow as ``in step``, the tensors' placement is the cause (the probe's
allocation is not the step's); if ``alone`` is fast and ``after GEMMs`` slow, the GPU's
state after compute-heavy work is (clocks, power, temperature).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from .e2e import config_from_args, parse_args
from .e2e_model import (
    ByteBatches,
    build_model,
    corpus_bytes_needed,
    forward_backward,
    make_optimizer,
    stdlib_corpus,
    update,
)
from .harness import GpuClockLog, print_columns


def _timed(fn) -> tuple[float, float, float]:
    """``(ms, t0, t1)``: ``fn``'s GPU time between two events, and its wall window."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b), t0, time.time()


def _mean(summaries: list[dict], key: str) -> float | None:
    vals = [s[key] for s in summaries if s.get(key) is not None]
    return statistics.mean(vals) if vals else None


def _heat(seconds: float, x: torch.Tensor) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            x @ x
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_step_optimizer")
    p.add_argument("--mode", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--layers", default="4")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--heat-s", type=float, default=3.0)
    p.add_argument("--fresh-copies", action="store_true",
                   help="also time an AdamW over fresh copies of the parameters and "
                        "gradients (needs ~8 bytes per parameter more GPU memory)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_step_optimizer needs a GPU", file=sys.stderr)
        return 2
    device = "cuda"
    e2e_args = parse_args(["--layers", args.layers, "--mode", args.mode])
    cfg = config_from_args(e2e_args, device)
    data = stdlib_corpus(corpus_bytes_needed(cfg, 64))
    model = build_model(cfg, device=device)
    opt = make_optimizer(model, 1e-4, mode=args.mode)
    batches = ByteBatches(data, cfg.batch, cfg.seq, device)
    n_params = sum(q.numel() for q in model.parameters())
    print(f"[probe] {torch.cuda.get_device_name()}: {cfg.layers} layers, "
          f"{n_params / 1e9:.2f} B parameters, mode {args.mode}", flush=True)
    clocks = GpuClockLog(period_ms=20, fields=GpuClockLog.FIELDS + ("temperature.memory",))
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    heat_x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    i = 0
    tpes = None

    def fwd_bwd():
        nonlocal i, tpes
        tok, lab = batches(i)
        i += 1
        _, tpes = forward_backward(model, opt, tok, lab, args.mode)

    def upd():
        update(model, opt, tpes, args.mode)

    def copy():
        dst.copy_(src)

    for _ in range(3):  # warm-up: compiles, optimizer state, pointer tables
        fwd_bwd()
        upd()
    torch.cuda.synchronize()
    samples: dict[str, list] = {}

    def record(name, fn):
        ms, t0, t1 = _timed(fn)
        samples.setdefault(name, []).append((ms, clocks.summary(t0, t1)))

    for _ in range(args.reps):
        fwd_bwd()
        record("update, in step", upd)
        torch.cuda.synchronize()
        for _ in range(2):
            record("update, alone (back to back)", upd)
        time.sleep(args.idle_s)
        record("update, after idle", upd)
        _heat(args.heat_s, heat_x)
        record("update, after GEMMs", upd)
        fwd_bwd()
        record("1 GiB copy, after fwd+bwd", copy)
        time.sleep(args.idle_s)
        record("1 GiB copy, after idle", copy)
        _heat(args.heat_s, heat_x)
        record("1 GiB copy, after GEMMs", copy)
        torch.cuda.synchronize()
    if args.fresh_copies:
        # The same parameter and gradient values in fresh allocations made back to back
        # (parameters, then gradients, then the moments at the first step), as
        # benchmark.probe_adamw allocates them, and an optimizer of the same settings.
        import linghe

        fwd_bwd()
        torch.cuda.synchronize()
        params = [q for q in model.parameters() if q.grad is not None]
        copies = [q.detach().clone().requires_grad_(True) for q in params]
        for c, q in zip(copies, params):
            c.grad = q.grad.clone()
        fresh = linghe.optim.AdamW(copies, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01,
                                   max_grad_norm=1.0)
        fresh.step()
        torch.cuda.synchronize()
        for _ in range(args.reps):
            record("fresh copies: AdamW step, alone", fresh.step)
            record("model's tensors: AdamW step, alone", opt.step)
        del fresh, copies
    clocks.close()

    rows, out = [], {"device": torch.cuda.get_device_name(), "layers": cfg.layers,
                     "mode": args.mode, "params": n_params, "rows": {}}
    for name, got in samples.items():
        ms = [g[0] for g in got]
        clk = [g[1] for g in got if g[1]]
        row = {"median_ms": statistics.median(ms), "all_ms": ms,
               **{k: _mean(clk, key) for k, key in (
                   ("sm_mhz", "sm_mhz"), ("power_w", "power_w"), ("temp_c", "temp_c_max"),
                   ("mem_temp_c", "mem_temp_c_max"))}}
        out["rows"][name] = row
        gbps = (2 << 30) / (row["median_ms"] * 1e6) if "copy" in name else None
        rows.append([name, f"{row['median_ms']:.2f}",
                     " ".join(f"{v:.1f}" for v in ms),
                     "-" if gbps is None else f"{gbps:.0f}",
                     *(("-" if row[k] is None else f"{row[k]:.0f}")
                       for k in ("sm_mhz", "power_w", "temp_c", "mem_temp_c"))])
    print_columns(["what", "median ms", "each ms", "GB/s", "SM MHz", "W", "GPU C",
                   "HBM C"], rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
