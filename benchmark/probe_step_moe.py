"""Probe: the FP8 step's MoE data-movement kernels at the e2e shapes, each against a
device copy of its bytes: ``python -m benchmark.probe_step_moe [--json PATH]``.

Inputs as one micro-batch of the e2e step builds them (8192 tokens top-8 over 256
experts, segments padded to 16, the buffer's worst-case bound of rows, zero padding and
tail rows). Rows:

- the SwiGLU backward as the bf16 step runs it (:func:`linghe.bwd.activation.silu_mul_bwd`,
  batch form, dprobs) and as the FP8 step runs it
  (:func:`~linghe.bwd.activation.silu_mul_bwd_rowwise_fp8`: dh and its rowwise FP8 copy),
  the latter also at other program tiles (``ROWWISE_FP8_TILE``), each checked against
  the first tile's outputs (``same``: dx, the FP8 copy and its scales bit for bit;
  dprobs sums its columns in tile order);
- the permute scatters of both steps: bf16 tokens, FP8 tokens with their scales, the
  FP8 tokens dequantized into bf16 rows (``TokenRows.dequantized``, the deferred bf16
  wgrad's operand), and the unpermute backward of each step.

Profiler kernel µs (L2 flushed); "copy" is a size-matched device copy of the fewest
bytes each kernel must move (real rows read once, every output written once). GPU only.
"""

from __future__ import annotations

import argparse
import json

import torch

import linghe
from linghe.bwd import activation as act
from linghe.bwd.permute import unpermute_backward_fp8_copy
from linghe.fp8.quantize import FP8_DTYPE
from linghe.fwd import permute as perm

from .harness import device_time_us, print_columns, random_routing, size_matched_copy_us

T, TOPK, E, H, I = 8192, 8, 256, 2048, 1024
TILES = [(8, 256, 4), (4, 1024, 4), (2, 1024, 4), (8, 512, 4), (16, 256, 8), (16, 128, 4),
         (32, 128, 8)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_step_moe")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_step_moe needs a CUDA GPU")
    torch.manual_seed(0)
    layout, real, _, _ = random_routing(T, TOPK, E, 16, "cuda")
    R = real.numel()
    n_real = int(real.sum())
    counts = layout.tokens_per_expert
    h = torch.randn(R, 2 * I, device="cuda", dtype=torch.bfloat16)
    da = torch.randn(R, I, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(R, device="cuda")
    for t in (h, da, probs):
        t[~real] = 0
    rows = []

    def row(name, fn, nbytes, same=None):
        us = device_time_us(fn)
        copy = size_matched_copy_us(nbytes, "cuda")
        rows.append(dict(case=name, us=us, copy_us=copy, pct_copy=100 * copy / us,
                         gbs=nbytes / us / 1e3, same=same))

    bytes_bf16 = n_real * (2 * I * 2 + I * 2 + 4) + R * (2 * I * 2 + 4)
    bytes_fp8 = bytes_bf16 + R * (2 * I + 2 * I // 128 * 4)
    row("silu_mul_bwd, bf16 step", lambda: act.silu_mul_bwd(
        da, h, probs, need_dprobs=True, counts=counts, align=16), bytes_bf16)

    def rowwise_fp8():
        return act.silu_mul_bwd_rowwise_fp8(da, h, probs, need_dprobs=True, counts=counts,
                                            align=16)

    default = act.ROWWISE_FP8_TILE
    first = None
    try:
        for tile in TILES:  # (the launcher reads the tile at each call)
            act.ROWWISE_FP8_TILE = tile
            dx, q, sc, _dp = rowwise_fp8()
            first = first or (dx, q, sc)
            same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip((dx, q, sc), first))
            label = " (default)" if tile == default else ""
            row(f"silu_mul_bwd_rowwise_fp8, FP8 step, {tile[0]}x{tile[1]}/{tile[2]}w{label}",
                rowwise_fp8, bytes_fp8, same)
    finally:
        act.ROWWISE_FP8_TILE = default

    ids = torch.randn(T, E, generator=torch.Generator().manual_seed(0)).topk(TOPK, -1).indices
    layout = perm.build_index(ids.to(torch.int32).cuda(), E, 16, R)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    xq = linghe.quantize_1x128(x, pow2_scale=True)
    data, scale = xq.rowwise_data, xq.rowwise_scale
    tokens = perm.TokenRows(data, scale, layout)
    G = H // 128
    weights = torch.rand(T, TOPK, device="cuda")
    out_rows = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    row("permute scatter, bf16 tokens", lambda: perm.scatter_rows(x, layout),
        T * H * 2 + R * H * 2)
    row("permute scatter, FP8 tokens + scales", lambda: perm.scatter_rows(
        data, layout, x_scale=scale), T * (H + G * 4) + R * (H + G * 4))
    row("TokenRows.dequantized (bf16 rows, deferred wgrad)",
        lambda: tokens.dequantized(torch.bfloat16), T * (H + G * 4) + R * H * 2)
    row("unpermute backward, bf16 step (weights, dprobs)", lambda: perm.scatter_rows(
        x, layout, weights=weights, dot_rows=out_rows), T * H * 2 + R * H * 4)
    row("unpermute backward, FP8 step (bf16 + FP8 copy)", lambda: unpermute_backward_fp8_copy(
        x, layout, torch.bfloat16, pow2_scale=True), T * H * 2 + R * (H * 3 + G * 4))
    print(f"FP8 step MoE data movement ({torch.cuda.get_device_name()}; kernel µs, L2 "
          "flushed; copy: a size-matched device copy)")
    print_columns(["case", "µs", "copy µs", "% copy", "GB/s", "same bits"],
                  [[r["case"], f"{r['us']:.1f}", f"{r['copy_us']:.1f}", f"{r['pct_copy']:.1f}",
                    f"{r['gbs']:.0f}", "" if r["same"] is None else r["same"]] for r in rows])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
