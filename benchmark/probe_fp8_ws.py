"""Probe: the warp-specialized FP8 grouped GEMM (Gluon, :mod:`linghe.fwd.grouped_mm_ws`)
against the Triton rows kernel and ``torch._grouped_mm`` bf16:
``python -m benchmark.probe_fp8_ws [--json PATH] [--quick]``.

The MoE experts' forward and dgrad GEMMs (gate_up: N = K = 2048; down: N = 2048, K =
1024; 8192 tokens top-8 at random over E experts, segments padded to 16) and their
weight gradients (FP8 from segment-group columnwise copies, the MoE path) at E = 256 and
32, each timed as: ``bf16`` (``torch._grouped_mm``), ``triton`` (the Triton FP8 rows
kernel: promoting, TMA, 64x128 tiles), ``default`` (what the launcher picks: the
warp-specialized kernel with :func:`~linghe.fwd.grouped_mm_ws.ws_config`'s tiles on
sm_90) and the warp-specialized kernel at fixed tiles / stages / groups. Every FP8
output is checked in the same run: ``= triton`` (bit-equal to the Triton kernel; the
promotion arithmetic is the same) and ``rel err`` against the float32 product of the
bf16 operands. An untimed edge pass first (zero-token experts, partial tiles, K = 384,
N = 384 with 256-column tiles, a tail) compares every variant with the Triton kernel
bit for bit. Times: profiler kernel
µs (L2 flushed). GPU (sm_90) only; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import linghe
from linghe.bwd.grouped_mm import (
    grouped_mm_fp8_dgrad,
    grouped_mm_fp8_wgrad,
    grouped_mm_wgrad,
)
from linghe.fwd.grouped_mm import grouped_mm_fp8_fwd
from linghe.fwd.grouped_mm_ws import ws_capable
from linghe.layout import make_expert_layout

from .harness import device_time_us, print_columns, random_routing

#: (experts, gemm, N, K): out [R, N] from rows [R, K] (fwd) / d_out [R, N] (dgrad, K out)
CASES = [(E, name, N, K) for E in (256, 32)
         for name, N, K in (("gate_up", 2048, 2048), ("down", 2048, 1024))]
VARIANTS = {
    "triton": dict(BM=64, BN=128, num_warps=4, num_stages=3, WS=False),
    "default": None,
    "ws_128x128": dict(BM=128, BN=128, num_warps=4, num_stages=4, WS=True),
    "ws_128x256": dict(BM=128, BN=256, num_warps=4, num_stages=3, WS=True),
}


def _operands(layout, R, N, K, dev):
    x = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(layout.num_experts, N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
    xq = linghe.quantize_1x128(x, pow2_scale=True)
    wq = linghe.quantize_grouped_weight(w, columnwise=True, pow2_scale=True)
    dy = torch.randn(R, N, device=dev, dtype=torch.bfloat16)
    dyq = linghe.quantize_1x128(dy, pow2_scale=True)
    return x, w, xq, wq, dy, dyq


#: The wgrad (segment groups: the MoE path): the Triton kernel at its default tiles, the
#: launcher's default (warp-specialized on sm_90), and WS tiles and settings.
WGRAD_VARIANTS = {
    "triton": dict(BN=128, BK=128, num_warps=8, num_stages=4),
    "default": None,
    "ws_128x128": dict(WS=True, BKW=128),
    "ws_scales_loaded": dict(WS=True, SCALES_TMA=False),
    "ws_r232": dict(WS=True, CONSUMER_REGS=232, LOADER_REGS=40),
}


def _gemm(direction, xq, wq, dyq, offsets, config):
    if direction == "fwd":
        return grouped_mm_fp8_fwd(xq, wq, offsets, config=config)
    return grouped_mm_fp8_dgrad(dyq, wq, offsets, config=config)


def _wgrad(gs, xs, offsets, config):
    return grouped_mm_fp8_wgrad(gs, xs, offsets, segments=True, align=16, config=config)


def _wgrad_operands(layout, R, N, K, dev, real=None):
    x = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
    g = torch.randn(R, N, device=dev, dtype=torch.bfloat16)
    if real is not None:
        x[~real] = 0
        g[~real] = 0
    qg = linghe.functional.grouped_mm.quantize_grouped_1x128
    return x, g, qg(x, layout, rowwise=False), qg(g, layout, rowwise=False)


def _wgrad_row(E, name, N, K, quick) -> dict:
    layout, real, bounds, _ = random_routing(8192, 8, E, 16, "cuda")
    R = real.numel()
    x, g, xs, gs = _wgrad_operands(layout, R, N, K, "cuda", real)
    ref = torch.stack([g[bounds[e]:bounds[e + 1]].float().t() @ x[bounds[e]:bounds[e + 1]]
                       .float() for e in range(E)])
    row = dict(E=E, gemm=name, dir="wgrad", R=R, N=N, K=K)
    row["bf16_us"] = device_time_us(partial(grouped_mm_wgrad, g, x, layout.offsets,
                                            backend="torch"))
    base = _wgrad(gs, xs, layout.offsets, WGRAD_VARIANTS["triton"])
    for key, cfg in WGRAD_VARIANTS.items():
        if quick and key not in ("triton", "default"):
            continue
        y = _wgrad(gs, xs, layout.offsets, cfg)
        row[key + "_err"] = ((y.float() - ref).norm() / ref.norm()).item()
        row[key + "_same"] = bool(torch.equal(y, base))
        row[key + "_us"] = device_time_us(partial(_wgrad, gs, xs, layout.offsets, cfg))
    return row


def _edge_pass(dev) -> list:
    """WS vs the Triton kernel, bit for bit, on awkward segments (untimed)."""
    fails = []
    counts = torch.tensor([0, 37, 300, 0, 129, 1, 64], dtype=torch.int32)
    for R_extra, K, N in ((0, 384, 256), (48, 256, 384)):
        R = int(((counts + 15) // 16 * 16).sum()) + R_extra
        layout = make_expert_layout(counts.to(dev), 16, R)
        _, _, xs, gs = _wgrad_operands(layout, R, N, K, dev)
        want = _wgrad(gs, xs, layout.offsets, WGRAD_VARIANTS["triton"])
        for key, cfg in WGRAD_VARIANTS.items():
            got = _wgrad(gs, xs, layout.offsets, cfg)
            if key != "triton" and not torch.equal(want, got):
                fails.append(dict(R=R, K=K, N=N, gemm="wgrad", variant=key,
                                  max_diff=(want.float() - got.float()).abs().max().item(),
                                  nan=bool(got.isnan().any())))
        x, w, xq, wq, dy, dyq = _operands(layout, R, N, K, dev)
        for name in ("fwd", "dgrad"):
            ref = _gemm(name, xq, wq, dyq, layout.offsets, VARIANTS["triton"])
            for key, cfg in VARIANTS.items():
                if key == "triton":
                    continue
                got = _gemm(name, xq, wq, dyq, layout.offsets, cfg)
                if not torch.equal(ref, got):
                    fails.append(dict(R=R, K=K, N=N, gemm=name, variant=key,
                                      max_diff=(ref.float() - got.float()).abs().max().item(),
                                      nan=bool(got.isnan().any())))
    return fails


def _row(E: int, name: str, N: int, K: int, quick: bool) -> list[dict]:
    layout, real, bounds, _ = random_routing(8192, 8, E, 16, "cuda")
    R = real.numel()
    rows = []
    for direction in ("fwd", "dgrad"):
        # fwd: out [R, N] = x [R, K] @ W^T; dgrad: d_rows [R, K] = d_out [R, N] @ W
        x, w, xq, wq, dy, dyq = _operands(layout, R, N, K, "cuda")
        off = layout.offsets
        offs = off[1:].to(torch.int32)
        a, b = (x, w.transpose(1, 2)) if direction == "fwd" else (dy, w)
        run = partial(_gemm, direction, xq, wq, dyq, off)
        ref = torch.zeros(R, b.shape[2], device="cuda")
        for e in range(E):
            ref[bounds[e]:bounds[e + 1]] = a[bounds[e]:bounds[e + 1]].float() @ b[e].float()
        row = dict(E=E, gemm=name, dir=direction, R=R, N=N, K=K)
        row["bf16_us"] = device_time_us(partial(torch._grouped_mm, a, b, offs=offs))
        base = run(VARIANTS["triton"])
        for key, cfg in VARIANTS.items():
            if quick and key not in ("triton", "default"):
                continue
            y = run(cfg)
            row[key + "_err"] = ((y.float() - ref)[real].norm() / ref[real].norm()).item()
            row[key + "_same"] = bool(torch.equal(y[real], base[real]))
            row[key + "_us"] = device_time_us(partial(run, cfg))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_fp8_ws")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="triton and default only")
    p.add_argument("--wgrad-only", action="store_true", help="the wgrad rows only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not ws_capable(torch.empty(1, device="cuda")):
        raise SystemExit("probe_fp8_ws needs an sm_90 GPU and Gluon")
    edge = _edge_pass("cuda")
    print(f"edge pass (WS vs Triton, bit for bit): {'ok' if not edge else edge}", flush=True)
    rows = [r for c in CASES
            for r in ([] if args.wgrad_only else _row(*c, args.quick))
            + [_wgrad_row(*c, args.quick)]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "edge_failures": edge, "rows": rows}, f, indent=1)
    keys = [k for k in {**VARIANTS, **WGRAD_VARIANTS} if any(k + "_us" in r for r in rows)]

    def cell(r, k):
        us = r.get(k + "_us")
        if us is None:
            return "-"
        same = "=" if r[k + "_same"] else "~"
        return f"{us:.0f} {r['bf16_us'] / us:.2f}x {same} {r[k + '_err']:.1e}"

    print_columns(["E", "gemm", "dir", "bf16 µs"] + [f"{k} (µs, vs bf16, =triton, err)"
                                                    for k in keys],
                  [[r["E"], r["gemm"], r["dir"], f"{r['bf16_us']:.0f}"]
                   + [cell(r, k) for k in keys] for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
