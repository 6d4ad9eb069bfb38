"""Probe of ``linghe.optim.AdamW``'s update kernel against the bytes it must move:
``python -m benchmark.probe_adamw [--json PATH] [--cpu] [--layers N]``.

Parameters shaped like ``N`` layers of the e2e model's experts (``[256, 2048, 2048]`` and
``[256, 2048, 1024]`` per layer) plus a few small tensors, bf16 parameters, gradients and
moments (what ``benchmark.e2e`` trains). Rows (kernel µs from ``torch.profiler`` per
step, the L2 flushed before each; GB/s from the fewest bytes; % of the 1 GiB copy and of
a size-matched copy):

- ``linghe AdamW`` (``max_grad_norm=1.0``: the norm kernel plus the update kernel) and
  the update alone (``max_grad_norm=None``);
- ``torch fused AdamW`` (``fused=True``) for comparison;
- ``copy`` of the same bytes (a uint8 buffer, read + written).

Fewest bytes of the update: parameter, gradient and both moments read, parameter and
moments written (14 B per bf16 parameter); the norm reads the gradients once more.
Checks: one linghe step against ``torch.optim.AdamW`` (float32 math) on the first 1M
elements of each tensor (relative error). ``--cpu``: tiny shapes on the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"

import linghe  # noqa: E402

from .harness import Config, copy_bandwidth_gbps, device_time_us, print_columns  # noqa: E402


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
    ap.add_argument("--layers", type=int, default=1)
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

    if device == "cpu":
        linghe.optim.AdamW(params, **hyper, max_grad_norm=1.0).step()
        print("cpu smoke run done (no timings)")
        return 0

    copy_gbps = copy_bandwidth_gbps(Config(device="cuda"))
    buf = torch.empty(upd_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    opt_clip = linghe.optim.AdamW(params, **hyper, max_grad_norm=1.0)
    opt = linghe.optim.AdamW(params, **hyper)
    topt = torch.optim.AdamW(params, **hyper, fused=True)
    rows = []
    size_copy = device_time_us(lambda: dst.copy_(buf), reps=5)
    for name, fn, nbytes in (
            ("copy (same bytes)", lambda: dst.copy_(buf), upd_bytes),
            ("linghe AdamW, clip (norm + update)", opt_clip.step, upd_bytes + 2 * n),
            ("linghe AdamW update", opt.step, upd_bytes),
            ("torch fused AdamW", topt.step, upd_bytes)):
        us = device_time_us(fn, reps=5)
        gbps = nbytes / us / 1e3
        rows.append({"row": name, "kernel_us": us, "gbps": gbps,
                     "pct_copy": 100 * gbps / copy_gbps,
                     "pct_size_copy": 100 * (nbytes / us) / (upd_bytes / size_copy)})
    print(f"1 GiB copy {copy_gbps:.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "params": n,
                       "copy_gbps": copy_gbps, "rel_err": max(errs), "rows": rows}, f,
                      indent=1)
    print_columns(["row", "kernel µs", "GB/s", "% copy", "% size-matched copy"],
                  [[r["row"], f"{r['kernel_us']:.0f}", f"{r['gbps']:.0f}",
                    f"{r['pct_copy']:.0f}", f"{r['pct_size_copy']:.0f}"] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
