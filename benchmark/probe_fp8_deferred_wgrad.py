"""Probe: would an FP8 *deferred* expert wgrad pay? ``python -m benchmark.probe_fp8_deferred_wgrad
[--json PATH]``.

The e2e step defers the routed experts' weight gradients over its 4 micro-batches and
computes them in bf16 with the multi-part warp-specialized kernel
(:func:`linghe.fwd.grouped_mm_ws.launch_hp_wgrad_ws`, 4 operand pairs summed into one
``dW`` write). An FP8 form would contract the same rows from token-grouped columnwise FP8
copies. Its best case is timed here without building it: the FP8 warp-specialized wgrad
over one buffer holding all 4 micro-batches' rows (32768 tokens top-8 over 256 experts:
the same rows per expert as the 4 parts, one ``dW`` write, no producer costs), against
the bf16 kernel over the 4 parts (what the step runs) and over one buffer. Also the
one-micro-batch pair (8192 tokens), where the FP8 kernel is bound by its ``dW`` write.
Shapes: gate_up ``dW [256, 2048, 2048]``, down ``[256, 2048, 1024]``; profiler kernel µs
(L2 flushed); ``err``: the FP8 result against the bf16 one. GPU (sm_90) only."""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from linghe.bwd.grouped_mm import grouped_mm_fp8_wgrad
from linghe.functional.grouped_mm import quantize_grouped_1x128
from linghe.fwd.grouped_mm_ws import launch_hp_wgrad_ws, ws_capable

from .harness import device_time_us, print_columns, random_routing

E, TOPK, MICRO = 256, 8, 4


def _pair(tokens: int, N: int, K: int, seed: int):
    layout, real, _, _ = random_routing(tokens, TOPK, E, 16, "cuda", seed=seed,
                                        exact_rows=True)
    R = real.numel()
    g = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    g[~real] = 0  # padding rows are zero, as unpermute's backward leaves them
    x[~real] = 0
    return g, x, layout


def _fp8(g, x, layout):
    gs = quantize_grouped_1x128(g, layout, rowwise=False)
    xs = quantize_grouped_1x128(x, layout, rowwise=False)
    return partial(grouped_mm_fp8_wgrad, gs, xs, layout.offsets, segments=True, align=16)


def _row(name: str, N: int, K: int) -> dict:
    dw = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16)
    parts = [_pair(8192, N, K, seed=s) for s in range(MICRO)]
    bf16_parts = device_time_us(partial(launch_hp_wgrad_ws,
                                        [(g, x, lay.offsets) for g, x, lay in parts], dw))
    g, x, big = _pair(8192 * MICRO, N, K, seed=MICRO)
    bf16_one = device_time_us(partial(launch_hp_wgrad_ws, [(g, x, big.offsets)], dw))
    fp8 = _fp8(g, x, big)
    fp8_one = device_time_us(fp8)
    launch_hp_wgrad_ws([(g, x, big.offsets)], dw)
    ref = dw.float()
    err = ((fp8().float() - ref).norm() / ref.norm()).item()
    g1, x1, l1 = parts[0]
    bf16_mb = device_time_us(partial(launch_hp_wgrad_ws, [(g1, x1, l1.offsets)], dw))
    fp8_mb = device_time_us(_fp8(g1, x1, l1))
    return dict(gemm=name, N=N, K=K, bf16_4parts_us=bf16_parts, bf16_one_buffer_us=bf16_one,
                fp8_one_buffer_us=fp8_one, fp8_err=err, bf16_one_mb_us=bf16_mb,
                fp8_one_mb_us=fp8_mb, deferred_speedup=bf16_parts / fp8_one,
                one_mb_speedup=bf16_mb / fp8_mb)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_fp8_deferred_wgrad")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not ws_capable(torch.empty(1, device="cuda")):
        raise SystemExit("probe_fp8_deferred_wgrad needs an sm_90 GPU and Gluon")
    rows = [_row("gate_up", 2048, 2048), _row("down", 2048, 1024)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    print_columns(["gemm", "bf16 4 parts µs", "bf16 one buffer", "FP8 one buffer",
                   "FP8 vs bf16 4 parts", "FP8 err", "1 micro-batch: bf16 / FP8"],
                  [[r["gemm"], f"{r['bf16_4parts_us']:.0f}", f"{r['bf16_one_buffer_us']:.0f}",
                    f"{r['fp8_one_buffer_us']:.0f}", f"{r['deferred_speedup']:.2f}x",
                    f"{r['fp8_err']:.1e}",
                    f"{r['bf16_one_mb_us']:.0f} / {r['fp8_one_mb_us']:.0f} "
                    f"({r['one_mb_speedup']:.2f}x)"] for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
