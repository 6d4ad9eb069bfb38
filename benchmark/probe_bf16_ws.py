"""Probe: the bf16 grouped GEMMs' forward and dgrad, ``torch._grouped_mm`` against the
warp-specialized kernel (:func:`linghe.fwd.grouped_mm_ws.launch_hp_rows_ws`) and the
Triton TMA kernel: ``python -m benchmark.probe_bf16_ws [--json PATH]``.

The MoE experts' shapes (gate_up: N = K = 2048; down: N = 2048, K = 1024; 8192 tokens
top-8 at random over E = 256 and 32 experts, segments padded to 16). ``torch`` runs as
the dispatch runs it (with its tail zeroing); ``ws`` and ``triton_tma`` through
``backend="triton"`` with :data:`~linghe.fwd.grouped_mm.HP_WS` on / off. Every output is
checked in the same run: relative error against the fp32 product on the routed rows, and
the tail rows zero. Times: profiler kernel µs (L2 flushed). GPU (sm_90) only.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import linghe.fwd.grouped_mm as fgm
from linghe.bwd.grouped_mm import grouped_mm_dgrad
from linghe.fwd.grouped_mm_ws import ws_capable

from .harness import device_time_us, print_columns, random_routing

#: (experts, gemm, N, K): out [R, N] from rows [R, K] (fwd) / d_out [R, N] (dgrad, K out)
CASES = [(E, name, N, K) for E in (256, 32)
         for name, N, K in (("gate_up", 2048, 2048), ("down", 2048, 1024))]
#: (column, backend, HP_WS)
VARIANTS = (("torch", "torch", True), ("ws", "triton", True), ("triton_tma", "triton", False))


def _rows(E: int, name: str, N: int, K: int) -> list[dict]:
    layout, real, bounds, _ = random_routing(8192, 8, E, 16, "cuda")
    R = real.numel()
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
    dy = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
    off = layout.offsets
    tail = int(off[-1])
    out_rows = []
    for direction in ("fwd", "dgrad"):
        ref = torch.zeros(R, N if direction == "fwd" else K, device="cuda")
        for e in range(E):
            sl = slice(bounds[e], bounds[e + 1])
            ref[sl] = (x[sl].float() @ w[e].float().t() if direction == "fwd"
                       else dy[sl].float() @ w[e].float())
        if direction == "fwd":
            def run(b):
                return fgm.grouped_mm_fwd(x, w, off, backend=b)
        else:
            def run(b):
                return grouped_mm_dgrad(dy, w, off, backend=b)
        row = dict(E=E, gemm=name, dir=direction, R=R, N=N, K=K)
        for key, backend, hp_ws in VARIANTS:
            fgm.HP_WS = hp_ws
            try:
                y = run(backend)
                row[key + "_err"] = ((y.float() - ref)[real].norm() / ref[real].norm()).item()
                row[key + "_tail_zero"] = bool((y[tail:] == 0).all())
                row[key + "_us"] = device_time_us(partial(run, backend))
            finally:
                fgm.HP_WS = True
        out_rows.append(row)
    return out_rows


def _wgrad_row(E: int, name: str, N: int, K: int) -> dict:
    """WIP: the warp-specialized wgrad against ``torch._grouped_mm``'s (branch only)."""
    from linghe.fwd.grouped_mm_ws import launch_hp_wgrad_ws

    layout, real, bounds, _ = random_routing(8192, 8, E, 16, "cuda")
    R = real.numel()
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
    x[~real] = 0
    g[~real] = 0
    off = layout.offsets
    ref = torch.stack([g[bounds[e]:bounds[e + 1]].float().t() @ x[bounds[e]:bounds[e + 1]]
                       .float() for e in range(E)])
    offs = off[1:].to(torch.int32)
    row = dict(E=E, gemm=name, dir="wgrad", R=R, N=N, K=K)
    t = torch._grouped_mm(g.t(), x, offs=offs)
    row["torch_err"] = ((t.float() - ref).norm() / ref.norm()).item()
    row["torch_us"] = device_time_us(partial(torch._grouped_mm, g.t(), x, offs=offs))
    dw = torch.full((E, N, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    launch_hp_wgrad_ws(g, x, dw, off)
    row["ws_err"] = ((dw.float() - ref).norm() / ref.norm()).item()
    row["ws_nan"] = bool(dw.isnan().any())
    row["ws_us"] = device_time_us(partial(launch_hp_wgrad_ws, g, x, dw, off))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_bf16_ws")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--wgrad", action="store_true", help="WIP: the wgrad rows only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not ws_capable(torch.empty(1, device="cuda")):
        raise SystemExit("probe_bf16_ws needs an sm_90 GPU and Gluon")
    if args.wgrad:
        wrows = [_wgrad_row(*c) for c in CASES]
        for r in wrows:
            print(r, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": wrows}, f, indent=1)
        return 0
    rows = [r for c in CASES for r in _rows(*c)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    keys = [k for k, _, _ in VARIANTS]

    def cell(r, k):
        ok = "ok" if r[k + "_tail_zero"] else "TAIL!"
        return f"{r[k + '_us']:.0f} {r['torch_us'] / r[k + '_us']:.2f}x {r[k + '_err']:.1e} {ok}"

    print_columns(["E", "gemm", "dir"] + [f"{k} (µs, vs torch, err, tail)" for k in keys],
                  [[r["E"], r["gemm"], r["dir"]] + [cell(r, k) for k in keys] for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
