"""Probe of ``linghe.optim.AdamW``'s update kernel against the bytes it must move:
``python -m benchmark.probe_adamw [--json PATH] [--cpu] [--layers N]``.

Parameters shaped like ``N`` layers of the e2e model's experts (``[256, 2048, 2048]`` and
``[256, 2048, 1024]`` per layer) plus a few small tensors, bf16 parameters, gradients and
moments (what ``benchmark.e2e`` trains). Rows (kernel µs from ``torch.profiler`` per
step, the L2 flushed before each; GB/s from the fewest bytes; % of the 1 GiB copy and of
a size-matched copy):

- ``linghe AdamW`` update (``max_grad_norm=None``): main's kernel (``--old DIR``, a
  folder holding main's ``multi_tensor.py``, ``adamw.py`` and ``fp8_weights.py``) and the
  new one at the knobs of ``multi_tensor.ADAMW_CONFIG``; with ``max_grad_norm=1.0`` (the
  norm kernel plus the update);
- ``adamw_quant_128`` (the update that also writes a weight's two FP8 copies) over every
  expert weight, main's and the new at each pipeline depth (16 B per parameter);
- ``torch fused AdamW`` (``fused=True``) for comparison;
- ``copy`` of the same bytes (a uint8 buffer, read + written).

Fewest bytes of the update: parameter, gradient and both moments read, parameter and
moments written (14 B per bf16 parameter); the norm reads the gradients once more.
Checks: one linghe step against ``torch.optim.AdamW`` (float32 math) on a slice of 8
elements along the last dim of each tensor (relative error), and main's and the new
kernel's step bit for bit (``--old``). ``--cpu``: tiny shapes on the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"

import linghe  # noqa: E402
from linghe.optim import fp8_weights as W  # noqa: E402
from linghe.optim import multi_tensor as K  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    GpuClockLog,
    copy_bandwidth_gbps,
    device_time_us,
    load_module_at,
    print_columns,
    size_matched_copy_us,
    wall_us,
)


def _load_old(old_dir: str):
    """main's AdamW modules (``--old``) beside the new ones."""
    class Old:
        pass
    old = Old()
    load = lambda path, name, rep=(): load_module_at("", path, name, src_dir=old_dir,
                                                      replace=rep)
    load("linghe/optim/multi_tensor.py", "linghe.optim._multi_tensor_old")
    old.fp8_weights = load("linghe/optim/fp8_weights.py", "linghe.optim._fp8_weights_old",
                           [("from .multi_tensor import", "from ._multi_tensor_old import")])
    mod = load("linghe/optim/adamw.py", "linghe.optim._adamw_old",
               [("from . import multi_tensor as K", "from . import _multi_tensor_old as K"),
                ("from .fp8_weights import", "from ._fp8_weights_old import")])
    old.AdamW = mod.AdamW
    return old


def _params(layers: int, small: bool, device: str) -> list[torch.Tensor]:
    E, H, In = (4, 64, 32) if small else (256, 2048, 1024)
    shapes = []
    for _ in range(layers):
        shapes += [(E, 2 * In, H), (E, H, In), (3072, H), (H, 2048), (E, H), (H,)]
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for s in shapes:
        p = (torch.randn(s, device=device, generator=g) * 0.02).to(torch.bfloat16)
        p.grad = (torch.randn(s, device=device, generator=g) * 1e-3).to(torch.bfloat16)
        out.append(p)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.probe_adamw")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--layers", type=int, default=4, help="expert layers (4: the e2e step)")
    ap.add_argument("--old", default=None, help="a folder holding main's multi_tensor.py, "
                    "adamw.py and fp8_weights.py (rows 'main')")
    ap.add_argument("--quant-only", action="store_true",
                    help="only the adamw_quant_128 rows (its launch variants)")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    params = _params(args.layers, device == "cpu", device)
    n = sum(p.numel() for p in params)
    upd_bytes = 14 * n
    print(f"{len(params)} bf16 tensors, {n / 1e9:.3f} B parameters; update moves "
          f"{upd_bytes / 1e9:.1f} GB")

    # Correctness: one step of each against torch.optim.AdamW in float32.
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    probe = [p[..., :8].detach().clone() if p.dim() > 1 else p[:8].detach().clone()
             for p in params]
    errs = []
    for p, q in zip(params, probe):
        q.grad = (p.grad[..., :8] if p.dim() > 1 else p.grad[:8]).clone()
    ref = [q.detach().float().requires_grad_() for q in probe]
    for r, q in zip(ref, probe):
        r.grad = q.grad.float()
    torch.optim.AdamW(ref, **hyper).step()
    mine = [q.detach().clone() for q in probe]
    for m, q in zip(mine, probe):
        m.grad = q.grad.clone()
    linghe.optim.AdamW(mine, **hyper).step()
    for m, r in zip(mine, ref):
        errs.append(((m.float() - r).norm() / r.norm()).item())
    print(f"one step vs torch.optim.AdamW (float32): max rel err {max(errs):.2e}")

    timer = device_time_us if device == "cuda" else wall_us
    copy_gbps = copy_bandwidth_gbps(Config(device=device, quick=False))
    big = min(upd_bytes, 16 << 30)  # (a copy of all the update's bytes would not fit)
    size_gbps = big / size_matched_copy_us(big, device,
                                           timer=lambda fn: timer(fn, reps=5)) / 1e3
    rows = []

    clocks = GpuClockLog() if device == "cuda" else None

    def row(name, fn, nbytes):  # (row.rows: the list)
        t0 = time.time()
        us = timer(fn, reps=5)
        gbps = nbytes / us / 1e3
        rows.append({"row": name, "kernel_us": us, "gbps": gbps,
                     "pct_copy": 100 * gbps / copy_gbps, "pct_size_copy": 100 * gbps / size_gbps,
                     "clocks": clocks.summary(t0, time.time()) if clocks else None})

    row.rows = rows
    rows.append({"row": f"copy ({big / 1e9:.0f} GB moved)", "kernel_us": big / size_gbps / 1e3,
                 "gbps": size_gbps,
                 "pct_copy": 100 * size_gbps / copy_gbps, "pct_size_copy": 100.0})
    old = _load_old(args.old) if args.old else None
    if old is not None and not args.quant_only:
        # The old and new kernels do the same math: their results must be bit-identical.
        a = [p.detach().clone() for p in params[:2]]
        b = [p.detach().clone() for p in params[:2]]
        for x, y, p in zip(a, b, params):
            x.grad, y.grad = p.grad, p.grad
        old.AdamW(a, **hyper).step()
        linghe.optim.AdamW(b, **hyper).step()
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        print(f"old vs new AdamW step bit-identical: {same}")
        del a, b
        opt_old = old.AdamW(params, **hyper)
        row("linghe AdamW update, main", opt_old.step, upd_bytes)
        del opt_old
        torch.cuda.empty_cache() if device == "cuda" else None
    if not args.quant_only:
        _update_rows(params, hyper, row, upd_bytes, n, device)
    _quant_rows(params, row, old)
    if clocks is not None:
        clocks.close()
    print(f"1 GiB copy {copy_gbps:.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "params": n,
                       "copy_gbps": copy_gbps, "rel_err": max(errs), "rows": rows}, f,
                      indent=1)
    clk = lambda r, k: f"{r['clocks'][k]:.0f}" if r.get("clocks") else "-"
    print_columns(["row", "kernel µs", "GB/s", "% copy", "% size-matched copy", "SM MHz",
                   "W", "vs default"],
                  [[r["row"], f"{r['kernel_us']:.0f}", f"{r['gbps']:.0f}",
                    f"{r['pct_copy']:.0f}", f"{r['pct_size_copy']:.0f}", clk(r, "sm_mhz"),
                    clk(r, "power_w"), r.get("vs_default", "")] for r in rows])
    return 0


def _update_rows(params, hyper, row, upd_bytes, n, device) -> None:
    """The plain update's rows: its knobs, with clipping, torch's fused AdamW."""
    opt = linghe.optim.AdamW(params, **hyper)
    base = dict(K.ADAMW_CONFIG)
    for knobs in ({}, {"piece": 16384}, {"piece": 262144}, {"stages": 2},
                  {"stages": 3}, {"vectors": 2}, {"programs_per_sm": 3}):
        K.ADAMW_CONFIG.update(base, **knobs)
        opt._groups = {}  # rebuild the plans (programs per SM)
        label = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "default"
        row(f"linghe AdamW update, {label}", opt.step, upd_bytes)
    K.ADAMW_CONFIG.update(base)
    opt._groups = {}
    opt.max_grad_norm = 1.0
    row("linghe AdamW, clip (norm + update)", opt.step, upd_bytes + 2 * n)
    del opt
    torch.cuda.empty_cache() if device == "cuda" else None
    topt = torch.optim.AdamW(params, **hyper, fused=True)
    row("torch fused AdamW", topt.step, upd_bytes)
    del topt
    torch.cuda.empty_cache() if device == "cuda" else None



def _quant_rows(params, row, old) -> None:
    """The update that also writes the FP8 copies, over every expert weight back to back
    (as the FP8 step's optimizer runs it), moments shared (timing only): main's (``old``)
    and this tree's at each launch variant (``(ROWS, NUM_WARPS, STAGES)``), each one's
    outputs compared bit for bit with the default's on the first expert weight."""
    device = params[0].device
    experts = [p for p in params if p.dim() == 3]
    big_n = max(p.numel() for p in experts)
    mbuf = torch.zeros(big_n, device=device, dtype=torch.bfloat16)
    vbuf = torch.zeros_like(mbuf)
    bias = torch.tensor([[0.1, 0.001]], device=device)
    qn = sum(p.numel() for p in experts)
    qbytes = 16 * qn

    def quant(mod):
        def run():
            for p in experts:
                w = p.view(-1, p.shape[-1])
                mod.adamw_quant_128_(w, p.grad.view_as(w), mbuf[:w.numel()].view_as(w),
                                     vbuf[:w.numel()].view_as(w), bias, 0, lr=1e-3,
                                     beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01,
                                     maximize=False, coef=None, pow2_scale=True,
                                     shape2d=tuple(w.shape))
        return run
    # the first expert weight as it is now (the timed runs update it in place)
    w0 = experts[0].detach().clone().view(-1, experts[0].shape[-1])
    g0 = experts[0].grad.detach().clone().view_as(w0)

    def once():  # its outputs from fresh copies of its state
        w = w0.clone()
        m = torch.full_like(w, 1e-4)
        v = torch.full_like(w, 1e-6)
        out = W.adamw_quant_128_(w, g0, m, v, bias, 0, lr=1e-3, beta1=0.9,
                                 beta2=0.95, eps=1e-8, weight_decay=0.01, maximize=False,
                                 coef=None, pow2_scale=True, shape2d=tuple(w.shape))
        return [t.view(torch.uint8) if t.element_size() == 1 else t for t in (w, m, v, *out)]

    if old is not None:
        row("adamw_quant_128 (experts), main", quant(old.fp8_weights), qbytes)
    default = (W.ROWS, W.NUM_WARPS, W.STAGES)
    want = once()
    # (not kept, s17: the whole block updated at once and quantized from registers, 128
    # rows at 8 / 16 warps: 82244 / 59906 µs against 31497 on an H200, ptxas spilled)
    for knobs in ((16, 8, 3), default, (32, 8, 3)):
        W.ROWS, W.NUM_WARPS, W.STAGES = knobs
        same = all(torch.equal(a, b) for a, b in zip(once(), want))
        row(f"adamw_quant_128 (experts), rows={knobs[0]} warps={knobs[1]} "
            f"stages={knobs[2]}" + (" *" if knobs == default else ""), quant(W), qbytes)
        row.rows[-1]["vs_default"] = "same bits" if same else "DIFFERENT"
    W.ROWS, W.NUM_WARPS, W.STAGES = default


if __name__ == "__main__":
    sys.exit(main())
