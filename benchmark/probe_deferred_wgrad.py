"""Probe of the deferred expert wgrad (``linghe.bwd.grouped_mm.launch_wgrad_tma_parts``):
``python -m benchmark.probe_deferred_wgrad [--json PATH] [--micro-batches 4] [--cpu]``.

The routed experts' weight gradients of ``M`` micro-batches (E = 256, top-8, 8192 tokens
each, align 16, balanced random routing; GEMMs ``gate_up`` N = K = 2048 and ``down`` N =
2048, K = 1024; bf16) computed three ways:

- ``today``: what a step does without deferral: one fresh ``torch._grouped_mm`` wgrad
  and ``M - 1`` accumulating TMA wgrads into it (fused accumulation); ``today, acc at
  parts tiles``: the same with the accumulating launches at the multi-part kernel's
  default tiles;
- ``torch concat``: one ``torch._grouped_mm`` over all ``M`` micro-batches' rows in one
  expert-ordered buffer (the bar: what a single GEMM with ``M`` times the contraction
  costs when its operands need no gathering; the buffer is built outside the timing);
- ``parts ...``: :func:`launch_wgrad_tma_parts` over the ``M`` separate buffers (what
  the deferred wgrad launches), at its default tiles and at :data:`CANDIDATES`.

Each ``parts`` row is checked in the same run against the sum of the ``M`` per-part
``torch._grouped_mm`` wgrads (float32 sum of their bf16 outputs): relative error
``<= 1e-2``. Times: profiler kernel µs (``benchmark.harness.device_time_us``, L2 flushed).
``vs today`` = today µs / row µs. ``--cpu``: tiny shapes through the Triton interpreter
(a smoke test, not a measurement). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402

from linghe.bwd import grouped_mm as bwd_gm  # noqa: E402
from linghe.testing import rel_err  # noqa: E402

from .harness import device_time_us, fmt, print_columns, random_routing, wall_us  # noqa: E402


def _cfg(bn, bk, br, warps, stages, tail=1):
    return dict(BN=bn, BK=bk, BR=br, num_warps=warps, num_stages=stages, TAIL=tail)


#: Tiles tried besides the default (GPU only).
CANDIDATES = [_cfg(128, 128, 64, 4, 3, 1), _cfg(128, 128, 32, 4, 4, 2), _cfg(128, 128, 32, 8, 3, 2)]


def _operands(T, k, E, align, N, K, M, dev, seed):
    parts = []
    for s in range(M):
        layout, real, _, _ = random_routing(T, k, E, align, dev, seed=seed + s)
        R = real.numel()
        g = torch.randn(R, N, device=dev, dtype=torch.bfloat16)
        x = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
        g[~real] = 0
        x[~real] = 0
        parts.append((g, x, layout.offsets))
    return parts


def _measure(parts, E, N, K, M, T, k, align, gpu, timer):
    """``({path: µs}, {path: rel err})`` of one GEMM's wgrad over ``parts``."""
    dev = parts[0][0].device
    torch_ok = gpu and hasattr(torch, "_grouped_mm")
    backend = "torch" if torch_ok else "triton"
    ref = sum(bwd_gm.grouped_mm_wgrad(g, x, o, backend=backend).float() for g, x, o in parts)

    def today():
        g, x, o = parts[0]
        d = bwd_gm.grouped_mm_wgrad(g, x, o, backend=backend)
        for g, x, o in parts[1:]:
            bwd_gm.grouped_mm_wgrad_accumulate_(d, g, x, o)
        return d

    rows = {"today": timer(today)}
    if gpu and M > 1:  # the accumulating launches at the multi-part kernel's tiles
        acc_cfg = bwd_gm._wgrad_tma_parts_default_config()

        def today_parts_tiles():
            g, x, o = parts[0]
            d = bwd_gm.grouped_mm_wgrad(g, x, o, backend=backend)
            for g, x, o in parts[1:]:
                bwd_gm.launch_wgrad_tma(g, x, d, o, accumulate=True, config=acc_cfg)
            return d

        rows["today, acc at parts tiles"] = timer(today_parts_tiles)
    if torch_ok:  # one expert-ordered buffer of all parts' rows (built untimed)
        big, real, _, _ = random_routing(M * T, k, E, align, dev, seed=99)
        g4 = torch.randn(real.numel(), N, device=dev, dtype=torch.bfloat16)
        x4 = torch.randn(real.numel(), K, device=dev, dtype=torch.bfloat16)
        rows["torch concat"] = timer(
            lambda: bwd_gm.grouped_mm_wgrad(g4, x4, big.offsets, backend="torch"))
        del g4, x4
    dw = torch.empty(E, N, K, device=dev, dtype=torch.bfloat16)
    errs = {}
    candidates = [(f"parts {c['BN']}x{c['BK']} BR{c['BR']} w{c['num_warps']} "
                   f"s{c['num_stages']} T{c['TAIL']}", c) for c in CANDIDATES] if gpu else []
    if gpu:  # the default tiles also summing the squares (linghe.bwd.grad_norms)
        sq = torch.empty(bwd_gm.wgrad_sq_size(dw), dtype=torch.float32, device=dev)
        bwd_gm.launch_wgrad_tma_parts(parts, dw, sq_out=sq)
        errs["parts default + sq"] = rel_err(dw.float(), ref)
        errs["parts default + sq (norm^2)"] = rel_err(sq.sum(), dw.float().square().sum())
        rows["parts default + sq"] = timer(
            lambda: bwd_gm.launch_wgrad_tma_parts(parts, dw, sq_out=sq))
    for label, cfg in [("parts default", None)] + candidates:
        try:
            dw.fill_(float("nan"))
            bwd_gm.launch_wgrad_tma_parts(parts, dw, config=cfg)
            errs[label] = rel_err(dw.float(), ref)
            rows[label] = timer(lambda c=cfg: bwd_gm.launch_wgrad_tma_parts(parts, dw, config=c))
        except (triton.runtime.errors.OutOfResources, RuntimeError) as exc:
            rows[label] = None
            errs[label] = type(exc).__name__
    return rows, errs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    dev = "cuda" if gpu else "cpu"
    M = args.micro_batches
    if gpu:
        T, k, E, align, shapes = 8192, 8, 256, 16, (("gate_up", 2048, 2048), ("down", 2048, 1024))
    else:
        T, k, E, align, shapes = 40, 2, 5, 16, (("gate_up", 64, 48), ("down", 48, 32))
    timer = device_time_us if gpu else wall_us
    table, result = [], {"micro_batches": M, "T": T, "topk": k, "E": E, "align": align,
                         "rows": {}}
    for name, N, K in shapes:
        rows, errs = _measure(_operands(T, k, E, align, N, K, M, dev, seed=11), E, N, K, M,
                              T, k, align, gpu, timer)
        result["rows"][name] = {"us": rows, "rel_err": errs}
        for label, us in rows.items():
            err = errs.get(label)
            ok = "-" if err is None else (f"{err:.1e}" if isinstance(err, float) else err)
            if isinstance(err, float) and not err <= 1e-2:
                ok += " FAIL"
            table.append([name, label, fmt(us, ".0f"),
                          fmt(rows["today"] / us if us else None, ".2f") + "x", ok])
    result["env"] = {"device": torch.cuda.get_device_name() if gpu else "cpu",
                     "torch": torch.__version__, "triton": triton.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\nExpert wgrad of {M} micro-batches (E={E}, top-{k}, {T} tokens each; "
          f"{'kernel' if gpu else 'interpreter wall'} us)")
    print_columns(["gemm", "path", "us", "vs today", "rel err"], table)


if __name__ == "__main__":
    main()
