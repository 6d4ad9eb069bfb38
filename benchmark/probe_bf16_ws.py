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
import linghe.fwd.grouped_mm_ws as W
from linghe.bwd import grouped_mm as bwd_gm
from linghe.bwd.grouped_mm import grouped_mm_dgrad
from linghe.fwd.grouped_mm_ws import ws_capable
from linghe.testing import rel_err

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


def _wgrad_parts(E: int, N: int, K: int, M: int, seed: int) -> list:
    """``M`` micro-batches' wgrad operands ``(g, x, offsets)`` (routed rows only non-zero)."""
    parts = []
    for m in range(M):
        layout, real, _, _ = random_routing(8192, 8, E, 16, "cuda", seed=seed + m)
        R = real.numel()
        g = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
        g[~real] = 0
        x[~real] = 0
        parts.append((g, x, layout.offsets))
    return parts


def _wgrad_rows(E: int, name: str, N: int, K: int, M: int) -> list[dict]:
    """The wgrad of one and of ``M`` micro-batches: ``torch._grouped_mm`` (one part; its
    ``M`` launches summed, and one launch over all parts' rows in one buffer: the bar),
    the Triton TMA kernels, and the warp-specialized kernel at its settings."""
    parts = _wgrad_parts(E, N, K, M, seed=7)
    ref1 = torch._grouped_mm(parts[0][0].t(), parts[0][1], offs=parts[0][2][1:]).float()
    refm = ref1 + sum(torch._grouped_mm(g.t(), x, offs=o[1:]).float() for g, x, o in parts[1:])
    dw = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16)
    old = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)

    def check(row, key, fn, ref, start=None, sq=None):
        if start is None:
            dw.fill_(float("nan"))
        else:
            dw.copy_(start)
        fn()
        want = ref if start is None else ref + start.float()
        row[key + "_err"] = rel_err(dw.float(), want)
        if sq is not None:
            row[key + "_sq_err"] = rel_err(sq.sum(), dw.float().square().sum())
        row[key + "_us"] = device_time_us(fn)

    out = []
    g, x, o = parts[0]
    row = dict(E=E, gemm=name, case="1 part", N=N, K=K)
    row["torch_us"] = device_time_us(partial(torch._grouped_mm, g.t(), x, offs=o[1:]))
    check(row, "triton_tma", partial(bwd_gm.launch_wgrad_tma, g, x, dw, o), ref1)
    for key, cfg in WGRAD_VARIANTS:
        check(row, key, partial(W.launch_hp_wgrad_ws, [parts[0]], dw, config=cfg), ref1)
    out.append(row)
    row = dict(E=E, gemm=name, case="1 part, accumulate", N=N, K=K)
    check(row, "triton_tma", partial(bwd_gm.launch_wgrad_tma, g, x, dw, o, accumulate=True),
          ref1, start=old)
    for key, cfg in WGRAD_VARIANTS[:2]:
        check(row, key, partial(W.launch_hp_wgrad_ws, [parts[0]], dw, accumulate=True,
                                config=cfg), ref1, start=old)
    out.append(row)
    row = dict(E=E, gemm=name, case=f"{M} parts + sq", N=N, K=K)
    row["torch_sum_us"] = sum(device_time_us(partial(torch._grouped_mm, g.t(), x, offs=o[1:]))
                              for g, x, o in parts)
    big, real, _, _ = random_routing(M * 8192, 8, E, 16, "cuda", seed=99)
    gb = torch.randn(real.numel(), N, device="cuda", dtype=torch.bfloat16)
    xb = torch.randn(real.numel(), K, device="cuda", dtype=torch.bfloat16)
    row["torch_concat_us"] = device_time_us(
        partial(torch._grouped_mm, gb.t(), xb, offs=big.offsets[1:]))
    del gb, xb
    sq = torch.empty(bwd_gm.wgrad_sq_size(dw), device="cuda")
    check(row, "triton_parts", partial(bwd_gm.launch_wgrad_tma_parts, parts, dw, sq_out=sq),
          refm, sq=sq)
    for key, cfg in WGRAD_VARIANTS:
        sq = torch.empty(W.hp_wgrad_ws_sq_size(dw, cfg), device="cuda")
        check(row, key, partial(W.launch_hp_wgrad_ws, parts, dw, sq_out=sq, config=cfg),
              refm, sq=sq)
    out.append(row)
    return out


#: (column, config) of the warp-specialized wgrad
WGRAD_VARIANTS = (("ws", None), ("ws_regstore", dict(TMA_STORE=False)),
                  ("ws_bt64", dict(BT=64, STAGES=3)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_bf16_ws")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--wgrad", action="store_true",
                   help="the wgrad (one part, accumulating, --micro-batches parts)")
    p.add_argument("--micro-batches", type=int, default=4)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not ws_capable(torch.empty(1, device="cuda")):
        raise SystemExit("probe_bf16_ws needs an sm_90 GPU and Gluon")
    if args.wgrad:
        wrows = [r for c in CASES for r in _wgrad_rows(*c, args.micro_batches)]
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": wrows}, f, indent=1)
        for r in wrows:
            print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()})
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
