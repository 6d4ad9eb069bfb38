"""AdamW over rows without gradients: ``python -m benchmark.probe_sparse_adamw [--json PATH]``.

An embedding's unseen tokens (the e2e model's byte-level corpus touches ~256 of its
157184 rows) and experts no token reached keep zero gradients, so their moments are zero
(or decay into subnormals): the update's square root and quotient then take the
hardware's slow paths unless the kernel avoids them (``multi_tensor._sqrt_rn_fast``).
Rows (kernel µs from ``torch.profiler``, L2 flushed; GB/s from the fewest bytes, 14 B
per bf16 parameter, 16 with the FP8 copies; % of a size-matched copy): linghe's AdamW and
torch's fused AdamW on the e2e embedding ``[157184, 2048]`` bf16 with a dense random
gradient, and with only 256 rows of gradient (the rest zero, after one step: zero
moments); an expert weight ``[256, 2048, 2048]``; the quantizing update over the LM
head's shape. GPU only.
"""

from __future__ import annotations

import argparse
import json

import torch

import linghe
from linghe.optim import fp8_weights as W

from .e2e import environment
from .harness import device_time_us, size_matched_copy_us

V, H = 157184, 2048


def _param(shape, device, rows_with_grad=None):
    p = (torch.randn(shape, device=device) * 0.02).to(torch.bfloat16)
    p.grad = (torch.randn(shape, device=device) * 1e-3).to(torch.bfloat16)
    if rows_with_grad is not None:
        p.grad[rows_with_grad:] = 0
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.probe_sparse_adamw")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_sparse_adamw needs a CUDA GPU")
    dev = "cuda"
    rows = []
    cases = (("embedding, dense gradient", (V, H), None),
             ("embedding, 256 rows of gradient", (V, H), 256),
             ("expert gate_up [256, 2048, 2048]", (256, 2048, 2048), None))
    for name, shape, live in cases:
        for lib in ("linghe", "torch fused"):
            p = _param(shape, dev, live)
            if lib == "linghe":
                opt = linghe.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
            else:
                opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01,
                                        fused=True)
            opt.step()  # the moments exist (zero where there is no gradient)
            us = device_time_us(opt.step)
            nbytes = 14 * p.numel()
            rows.append(dict(case=name, lib=lib, us=us, bytes=nbytes,
                             copy_us=size_matched_copy_us(nbytes, dev)))
            del opt, p
    p = _param((V, H), dev)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    bias = torch.ones(4, 2, device=dev)

    def quant_step():
        W.adamw_quant_128_(p, p.grad, m, v, bias, 0, lr=1e-4, beta1=0.9, beta2=0.95,
                           eps=1e-8, weight_decay=0.01, maximize=False, coef=None,
                           pow2_scale=True, shape2d=(V, H))

    quant_step()
    rows.append(dict(case="adamw_quant_128, LM head [157184, 2048]", lib="linghe",
                     us=device_time_us(quant_step), bytes=16 * V * H,
                     copy_us=size_matched_copy_us(16 * V * H, dev)))
    env = environment()
    print(f"{env['device']}; torch {env['torch']}, triton {env['triton']}")
    print(f"{'case':42} {'lib':12} {'kernel us':>10} {'copy us':>9} {'GB/s':>7} {'% copy':>7}")
    for r in rows:
        print(f"{r['case']:42} {r['lib']:12} {r['us']:10.1f} {r['copy_us']:9.1f} "
              f"{r['bytes'] / r['us'] / 1e3:7.0f} {100 * r['copy_us'] / r['us']:7.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(env=env, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
