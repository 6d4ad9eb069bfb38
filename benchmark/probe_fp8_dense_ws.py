"""Probe: the warp-specialized FP8 rows GEMM as a *dense* GEMM (one group) against
``torch._scaled_mm`` (cuBLAS blockwise) and bf16 ``torch.mm``, at the e2e model's dense
shapes: ``python -m benchmark.probe_fp8_dense_ws [--json PATH]``.

Why: the FP8 step's dense GEMMs (attention qkv / output, the shared expert, the LM head)
run on cuBLAS through ``torch._scaled_mm``, which costs 40-100 µs of host time a call
(its own layout checks, a memset, the heuristic query; more on the autograd engine's
thread) for 225 calls a step, while the FP8 micro-batch's host time is near its GPU
time. The WS rows kernel (:mod:`linghe.fwd.grouped_mm_ws`) multiplies the same
operands (rows 1x128, weight 128x128) at 1.67-1.72x of bf16 in the grouped case. For
each shape and direction (fprop ``Y = X W^T``; dgrad ``dX = dY W`` from the weight's
columnwise copy) the probe prints kernel µs (profiler, L2 flushed), host µs a call
(back-to-back, behind a GPU spin; on the calling thread and inside an autograd
backward, i.e. on the engine's thread) and each FP8 output's error against the float32
product of the dequantized operands. GPU (sm_90) only; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

import linghe
from linghe.bwd.grouped_mm import grouped_mm_fp8_dgrad
from linghe.fp8.gemm import _gemm
from linghe.fwd.grouped_mm import grouped_mm_fp8_fwd, quantize_grouped_weight
from linghe.fwd.grouped_mm_ws import ws_capable

from .harness import _spin, device_time_us, host_us, print_columns

#: (name, M, N, K) of ``Y [M, N] = X [M, K] W^T`` (dgrad: ``dX [M, K]`` from ``dY [M,
#: N]``): one micro-batch's 8192 tokens; the LM head also as the loss runs it, in chunks
#: of 2048 rows (:func:`linghe.functional.loss._chunk_rows` at a 157184 vocabulary).
SHAPES = [("qkv", 8192, 3072, 2048), ("attn_out", 8192, 2048, 2048),
          ("shared_gate_up", 8192, 2048, 2048), ("shared_down", 8192, 2048, 1024),
          ("lm_head", 8192, 157184, 2048), ("lm_head_chunk", 2048, 157184, 2048)]
#: The WS kernel at 128x256 tiles (the default picks its tiles by shape).
KEYS = ("bf16", "cublas", "ws", "ws256")
WS_256 = dict(BM=128, BN=256, num_warps=4, num_stages=3, WS=True)


class _InBackward(torch.autograd.Function):
    """Identity whose backward calls ``fn`` ``n`` times (on the autograd engine's thread)."""

    @staticmethod
    def forward(ctx, x, fn, n):
        ctx.fn, ctx.n = fn, n
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        for _ in range(ctx.n):
            ctx.fn()
        return g, None, None


def engine_host_us(fn, calls: int = 50, repeats: int = 5) -> float:
    """Host µs a call of ``fn`` run ``calls`` times in one autograd backward, less the
    same backward with ``calls = 0`` (behind a GPU spin: the host never waits)."""
    x = torch.zeros(8, device="cuda", requires_grad=True)

    def run(n):
        torch.cuda.synchronize()
        _spin(200_000.0)
        t0 = time.perf_counter()
        _InBackward.apply(x, fn, n).sum().backward()
        t = time.perf_counter() - t0
        torch.cuda.synchronize()
        return t

    run(2)
    base = sorted(run(0) for _ in range(repeats))[repeats // 2]
    full = sorted(run(calls) for _ in range(repeats))[repeats // 2]
    return (full - base) / calls * 1e6


def _row(name: str, M: int, N: int, K: int) -> list[dict]:
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
    xq = linghe.quantize_1x128(x, pow2_scale=True)
    dyq = linghe.quantize_1x128(dy, pow2_scale=True)
    wq = quantize_grouped_weight(w[None], columnwise=True, pow2_scale=True)  # [1, N, K]
    offsets = torch.tensor([0, M], dtype=torch.int32, device=dev)
    rows = []
    for direction in ("fprop", "dgrad"):
        if direction == "fprop":
            a, sa, b, sb = xq.rowwise_data, xq.rowwise_scale, wq.rowwise_data, wq.rowwise_scale
            bf16 = partial(torch.mm, x, w.t())
            ws = partial(grouped_mm_fp8_fwd, xq, wq, offsets)
            ws256 = partial(grouped_mm_fp8_fwd, xq, wq, offsets, config=WS_256)
            aq, bdq = xq, w
        else:
            a, sa = dyq.rowwise_data, dyq.rowwise_scale
            b, sb = wq.columnwise_data, wq.columnwise_scale  # [K, N], [K/128, N/128]
            bf16 = partial(torch.mm, dy, w)
            ws = partial(grouped_mm_fp8_dgrad, dyq, wq, offsets)
            ws256 = partial(grouped_mm_fp8_dgrad, dyq, wq, offsets, config=WS_256)
            aq, bdq = dyq, w.t()
        # cuBLAS wants the 1x128 A scales outer-dim-major: made once here, as the step's
        # own quantizations write them (group-major), so the call below copies nothing.
        sa_gm = sa.t().contiguous().t()
        cublas = partial(_gemm, a, sa_gm, "1x128", b, sb, "128x128", torch.bfloat16, None,
                         "torch")
        # the reference: the float32 product of the dequantized operands
        wdq = wq.dequantize().reshape(N, K).float()
        ref = aq.dequantize().float() @ (wdq.t() if direction == "fprop" else wdq)
        del bdq
        row = dict(gemm=name, dir=direction, M=M, N=N, K=K)
        flops = 2.0 * M * N * K
        for key, fn in zip(KEYS, (bf16, cublas, ws, ws256)):
            y = fn()
            row[key + "_err"] = ((y.float() - ref).norm() / ref.norm()).item()
            us = device_time_us(fn)
            row[key + "_us"] = us
            row[key + "_tflops"] = flops / us / 1e6 if us else None
            row[key + "_host_us"] = host_us(fn, calls=50)[0]
            row[key + "_engine_host_us"] = engine_host_us(fn)
        rows.append(row)
        print(f"{name} M={M} {direction}: " + ", ".join(
            f"{k} {row[k + '_us']:.1f} µs host {row[k + '_host_us']:.1f}/"
            f"{row[k + '_engine_host_us']:.1f}" for k in KEYS), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_fp8_dense_ws")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not ws_capable(torch.empty(1, device="cuda")):
        raise SystemExit("probe_fp8_dense_ws needs an sm_90 GPU and Gluon")
    want = args.shapes.split(",") if args.shapes else None
    rows = [r for s in SHAPES if want is None or s[0] in want for r in _row(*s)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)

    def cell(r, k):
        return (f"{r[k + '_us']:.1f} ({r[k + '_tflops']:.0f} TF) "
                f"host {r[k + '_host_us']:.0f}/{r[k + '_engine_host_us']:.0f}")

    print_columns(["gemm", "M", "dir", "bf16 µs", "cuBLAS fp8 µs", "WS fp8 µs", "WS 128x256 µs",
                   "cuBLAS/WS", "err cuBLAS / WS"],
                  [[r["gemm"], r["M"], r["dir"], cell(r, "bf16"), cell(r, "cublas"), cell(r, "ws"),
                    cell(r, "ws256"), f"{r['cublas_us'] / min(r['ws_us'], r['ws256_us']):.2f}x",
                    f"{r['cublas_err']:.1e} / {r['ws_err']:.1e}"] for r in rows])
    print("(host µs: calling thread / autograd engine thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
