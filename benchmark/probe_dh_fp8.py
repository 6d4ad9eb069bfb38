"""Probe of the FP8 MoE backward's SwiGLU step with a high-precision expert wgrad:
``python -m benchmark.probe_dh_fp8 [--json PATH]``.

The backward needs ``dh`` twice: in bf16 (the weight gradient) and as its rowwise 1x128
FP8 copy (the dgrad GEMM). Two ways, on 8192 tokens top-8 routed at random over ``E``
experts (segments padded to 16, pow2 scales, probs, dprobs):

- ``two kernels``: ``silu_mul_bwd`` then ``quantize_grouped_fwd(dh)`` (before);
- ``one kernel``: :func:`linghe.bwd.activation.silu_mul_bwd_rowwise_fp8` (now);
- ``silu_mul_bwd`` alone, for scale.

``same bits``: dh, the FP8 data and the scales equal between the two (dprobs is a row sum
in another order). Times: profiler kernel µs (``benchmark.harness.device_time_us``, L2
flushed). GPU only.
"""

from __future__ import annotations

import argparse
import json

import torch

from linghe.bwd.activation import silu_mul_bwd, silu_mul_bwd_rowwise_fp8
from linghe.fwd.grouped_mm import quantize_grouped_fwd

from .harness import device_time_us, print_columns, random_routing

#: (experts, moe intermediate): Ling-mini (256, 1024), 32 experts, Qwen3-30B-A3B (128, 768)
SHAPES = [(256, 1024), (32, 1024), (128, 768)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _row(E: int, inter: int) -> dict:
    layout, real, _, counts = random_routing(8192, 8, E, 16, "cuda")
    R = real.numel()
    c = counts.cuda()
    x = torch.randn(R, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    dy = torch.randn(R, inter, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(R, device="cuda")

    def bwd():
        return silu_mul_bwd(dy, x, probs, need_dprobs=True, counts=c, align=16)

    def two():
        dx, dp = bwd()
        q, s, _, _ = quantize_grouped_fwd(dx, c, 16, rowwise=True, columnwise=False,
                                          pow2_scale=True)
        return dx, q, s, dp

    def one():
        return silu_mul_bwd_rowwise_fp8(dy, x, probs, need_dprobs=True, counts=c,
                                        align=16, pow2_scale=True)

    same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(two()[:3], one()[:3]))
    return dict(E=E, I=inter, R=R, two_kernels_us=device_time_us(two),
                one_kernel_us=device_time_us(one), silu_mul_bwd_us=device_time_us(bwd),
                same_bits=same)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_dh_fp8")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_dh_fp8 times GPU kernels: no GPU here")
    rows = [_row(E, inter) for E, inter in SHAPES]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print_columns(["E", "I", "R", "two kernels µs", "one kernel µs", "silu_mul_bwd µs",
                   "saved µs", "same bits"],
                  [[r["E"], r["I"], r["R"], f"{r['two_kernels_us']:.1f}",
                    f"{r['one_kernel_us']:.1f}", f"{r['silu_mul_bwd_us']:.1f}",
                    f"{r['two_kernels_us'] - r['one_kernel_us']:.1f}",
                    "yes" if r["same_bits"] else "NO"] for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
