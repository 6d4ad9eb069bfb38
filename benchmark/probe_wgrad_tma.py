"""Probe of the TMA grouped wgrad (``linghe.bwd.grouped_mm.launch_wgrad_tma``) against
``torch._grouped_mm`` and main's pointer kernel:
``python -m benchmark.probe_wgrad_tma [--json PATH] [--old DIR] [--cpu] [--max-seconds S]``,
or ``--ptxas`` (no GPU: an offline sm_90 compile of every candidate: registers, spills,
shared memory).

``dW_e = d_out_e^T @ rows_e`` over each expert's segment at the MoE shapes of
``benchmark/probe_grouped_bf16.py`` (8192 tokens, top-8, balanced random routing as
``benchmark/cases/grouped_mm.py`` builds it): layout ``a`` (E = 32, align 128, 69600 rows)
and ``b`` (E = 256, align 16, ~256 rows per expert), GEMMs ``gate_up`` (N = 2048, K =
2048) and ``down`` (N = 2048, K = 1024); bf16 operands (zero padding rows) and bf16 dW.
Rows:

- ``torch``: ``torch._grouped_mm`` (CUTLASS) through ``grouped_mm_wgrad(backend="torch")``;
  ``torch+add``: the same plus ``dw.add_(...)`` into an existing dW (what accumulating a
  gradient costs without a fused epilogue);
- ``old``: main's pointer kernel ``_wgrad_kernel`` (``grouped_mm_wgrad(backend=
  "triton")`` of ``--old DIR/grouped_mm.py``, main's ``linghe/bwd/grouped_mm.py``;
  without ``--old`` this tree's pointer kernel, the same code when this branch was made);
- ``tma ...``: ``launch_wgrad_tma`` at the default tiles (fresh and ``accumulate=True``),
  at the other ``TAIL`` forms, and at the tiles of :data:`CANDIDATES`.

Every row is checked in the same run against per-expert float32 products of the same
bf16 operands (TF32 off; the definition in ``linghe.reference.grouped_mm``'s backward):
relative error ``<= 1e-2``; fresh outputs NaN-filled first; the accumulate rows against
the existing dW plus the reference. ``µs``: ``triton.testing.do_bench`` medians (L2
flushed before each call; the kernels run ~0.4-2 ms, far above the launch's host time);
``kernel µs``: the profiler (``benchmark.harness.device_time_us``: the CUDA kernels of
one call, launch overhead left out; ``torch+add`` counts both kernels) for the bars and
the default tiles, which the GB/s / TFLOP/s columns use where present. GB/s from the
fewest bytes: ``d_out`` and ``rows`` read once (all ``R`` rows), dW written once (and read once
when accumulating); ``% copy`` of the 1 GiB device copy; TFLOP/s of the routed rows only
(65536 x N x K x 2). ``vs torch`` = torch µs / row µs (accumulate rows: against
``torch+add``). Candidate rows stop after ``--max-seconds``. ``--cpu`` runs a tiny shape
through the Triton interpreter (a smoke test of this script, not a measurement). The
table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

if __name__ == "__main__" and "--ptxas" not in sys.argv and (
        "--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402

from linghe.bwd import grouped_mm as bwd_gm  # noqa: E402
from linghe.testing import rel_err  # noqa: E402
from linghe.utils import set_poison_outputs  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    bench_us,
    compiled_binaries,
    copy_bandwidth_gbps,
    device_time_us,
    fmt,
    interpreter_matches,
    load_module_at,
    print_columns,
    random_routing,
)


def _cfg(bn, bk, br, warps, stages, tail=2):
    return dict(BN=bn, BK=bk, BR=br, num_warps=warps, num_stages=stages, TAIL=tail)


#: The default tiles (``_wgrad_tma_default_config`` on a GPU), fresh and accumulating.
DEFAULT = _cfg(128, 128, 64, 8, 3)
ACC_DEFAULT = _cfg(128, 128, 64, 4, 3, tail=1)
#: Tile candidates. sm_90 ptxas (triton 3.9 and 3.6 alike), registers / shared memory:
#: 128x128 BR64 8w 3s 94 / 96 KiB (2 programs per SM), 4s 94 / 128 KiB (1); BR32 4s
#: 94 / 64 KiB (3); BR128 2s 94 / 128 KiB (1); BR16 6s 94 / 48 KiB (4 by memory, 2 by
#: registers); 128x256 BR64 8w 3s 158 / 144 KiB (1); 256x128 162 / 144 KiB (1);
#: 128x128 4w 3s 162 / 96 KiB (2); 64x128 4w 4s 94 / 96 KiB (2). TAIL=0 (every box
#: masked) 119, TAIL=1 106-110. ``accumulate``: 126 at 128x128/8w, 239 at 128x256/8w.
CANDIDATES = [
    _cfg(128, 128, 64, 8, 3, tail=0), _cfg(128, 128, 64, 8, 3, tail=1),
    _cfg(128, 128, 32, 8, 4), _cfg(128, 128, 64, 8, 4), _cfg(128, 128, 128, 8, 2),
    _cfg(128, 128, 16, 8, 6), _cfg(128, 256, 64, 8, 3), _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 4, 3), _cfg(64, 128, 64, 4, 4),
]
#: Accumulating candidates beside the default tiles.
ACC_CANDIDATES = [_cfg(128, 128, 64, 8, 3), _cfg(128, 128, 64, 8, 3, tail=1),
                  _cfg(128, 128, 32, 8, 3),
                  _cfg(128, 128, 64, 8, 2), _cfg(128, 128, 32, 4, 3),
                  _cfg(128, 128, 64, 4, 3), _cfg(128, 256, 64, 8, 3)]
CPU_DEFAULT = _cfg(32, 32, 32, 4, 1)
CPU_CANDIDATES = [_cfg(32, 32, 32, 4, 1, tail=0), _cfg(32, 32, 32, 4, 1, tail=1),
                  _cfg(32, 64, 16, 4, 1)]

LAYOUTS = {"a": dict(T=8192, topk=8, E=32, align=128),
           "b": dict(T=8192, topk=8, E=256, align=16)}
GEMMS = {"gate_up": (2048, 2048), "down": (2048, 1024)}  # (N, K)
CPU_LAYOUTS = {"tiny": dict(T=40, topk=2, E=3, align=16)}
CPU_GEMMS = {"tiny": (64, 96)}
TOL = 1e-2  # bf16 outputs vs the float32 reference
MAX_SECONDS = 80.0


def cfg_name(c: dict, acc: bool = False) -> str:
    return (f"tma {c['BN']}x{c['BK']} BR{c['BR']} {c['num_warps']}w/{c['num_stages']}s "
            f"T{c['TAIL']}" + (" acc" if acc else ""))


# --------------------------------------------------------------------------- inputs


def build_inputs(lay: dict, N: int, K: int, device: str) -> dict:
    """Layout (balanced random routing, seed 0), ``g [R, N]``, ``x [R, K]`` bf16 with zero
    padding/tail rows, and the float32 reference ``dW [E, N, K]``."""
    E = lay["E"]
    layout, real, offs, _ = random_routing(lay["T"], lay["topk"], E, lay["align"], device)
    R = real.numel()
    g = torch.randn(R, N, device=device, dtype=torch.bfloat16)
    x = torch.randn(R, K, device=device, dtype=torch.bfloat16)
    g[~real] = 0
    x[~real] = 0
    expect = torch.empty(E, N, K, device=device)
    for e in range(E):
        torch.matmul(g[offs[e]:offs[e + 1]].float().t(), x[offs[e]:offs[e + 1]].float(),
                     out=expect[e])
    return dict(layout=layout, g=g, x=x, expect=expect, used=int(real.sum()), R=R, E=E)


# --------------------------------------------------------------------------- rows


def _impls(cpu: bool, old) -> list[tuple[str, dict | None, bool]]:
    """``(impl, config, accumulate)`` in the order they run (the important rows first)."""
    dflt = CPU_DEFAULT if cpu else DEFAULT
    rows = [("torch", None, False), ("torch+add", None, True), ("old", None, False),
            ("tma", dflt, False), ("tma", dflt if cpu else ACC_DEFAULT, True)]
    rows += [("tma", c, False) for c in (CPU_CANDIDATES if cpu else CANDIDATES)]
    rows += [("tma", c, True) for c in ([] if cpu else ACC_CANDIDATES)]
    return rows


def make_call(impl: str, cfg, acc: bool, d: dict, old, base: torch.Tensor):
    """``(fn, out)``: a zero-argument callable and the dW it leaves its result in (None:
    the callable returns it)."""
    g, x, off, E = d["g"], d["x"], d["layout"].offsets, d["E"]
    N, K = g.shape[1], x.shape[1]
    if impl == "torch":
        if not x.is_cuda:
            return None, None
        return (lambda: bwd_gm.grouped_mm_wgrad(g, x, off, backend="torch")), None
    if impl == "torch+add":
        if not x.is_cuda:
            return None, None
        dw = base.clone()
        return (lambda: dw.add_(bwd_gm.grouped_mm_wgrad(g, x, off, backend="torch"))), dw
    if impl == "old":
        mod = old or bwd_gm

        def run():
            saved = getattr(mod, "WGRAD_TMA", None)
            if saved is not None:
                mod.WGRAD_TMA = False
            try:
                return mod.grouped_mm_wgrad(g, x, off, backend="triton")
            finally:
                if saved is not None:
                    mod.WGRAD_TMA = saved
        return run, None
    if acc:
        dw = base.clone()
        return (lambda: bwd_gm.launch_wgrad_tma(g, x, dw, off, accumulate=True,
                                                config=cfg)), dw
    dw = torch.full((E, N, K), float("nan"), device=x.device, dtype=torch.bfloat16)
    return (lambda: bwd_gm.launch_wgrad_tma(g, x, dw, off, config=cfg)), dw


def probe_case(lname, gname, d, cpu, old, t0, max_s, copy_gbps, rows):
    E, R, used = d["E"], d["R"], d["used"]
    N, K = d["g"].shape[1], d["x"].shape[1]
    flops = 2 * used * N * K
    fresh_bytes = 2 * R * (N + K) + 2 * E * N * K
    base_dw = torch.randn(E, N, K, device=d["x"].device).to(torch.bfloat16)
    expect_acc = None
    case_rows = []
    for impl, cfg, acc in _impls(cpu, old):
        name = (impl if cfg is None else cfg_name(cfg, acc))
        r = dict(layout=lname, gemm=gname, E=E, R=R, N=N, K=K, used_rows=used, flops=flops,
                 impl=impl, config=name, tiles=cfg, accumulate=acc, ok=False, error=None)
        rows.append(r)
        case_rows.append(r)
        if impl == "tma" and cfg not in (DEFAULT, CPU_DEFAULT) and not cpu \
                and time.perf_counter() - t0 > max_s:
            r["skipped"] = f"time budget ({max_s:.0f} s) used up"
            continue
        fn, dw = make_call(impl, cfg, acc, d, old, base_dw)
        if fn is None:
            r["skipped"] = "torch._grouped_mm needs a GPU"
            continue
        try:
            before = {id(b) for b in compiled_binaries(bwd_gm._wgrad_tma_kernel)}
            set_poison_outputs(True)  # the checked call only
            try:
                out = fn()
                out = dw if dw is not None else out
                if not cpu:
                    torch.cuda.synchronize()
            finally:
                set_poison_outputs(False)
            new = [b for b in compiled_binaries(bwd_gm._wgrad_tma_kernel) if id(b) not in before]
            if len(new) == 1:
                r["n_regs"], r["n_spills"] = new[0].n_regs, new[0].n_spills
            if acc:
                if expect_acc is None:
                    expect_acc = d["expect"] + base_dw.float()
                r["rel_err"] = err = rel_err(out, expect_acc)
            else:
                r["rel_err"] = err = rel_err(out, d["expect"])
            r["ok"] = bool(err <= TOL)
            del out
            r["us"] = bench_us(fn, not cpu, rep=25)
            # kernel-only µs (profiler) for the rows that decide: the bars and the defaults
            if not cpu and (impl != "tma" or cfg == DEFAULT):
                r["kernel_us"] = device_time_us(fn, reps=5)
            us = r.get("kernel_us") or r["us"]
            nbytes = fresh_bytes + (2 * E * N * K if acc else 0)
            r["bytes"] = nbytes
            r["gbps"] = nbytes / us / 1e3
            r["pct_copy"] = 100 * r["gbps"] / copy_gbps if copy_gbps else None
            r["tflops"] = flops / us / 1e6
        except Exception as exc:  # one failing row must not stop the probe
            msg = str(exc).splitlines()[0][:300] if str(exc) else ""
            r["error"] = f"{type(exc).__name__}: {msg}"
        finally:
            del fn, dw
        print(f"  {lname} {gname:7s} {name:32s} {fmt(r.get('us'), '9.1f')} µs "
              f"(kernel {fmt(r.get('kernel_us'), '.1f')}) "
              f"{fmt(r.get('tflops'), '5.0f')} TFLOP/s err {fmt(r.get('rel_err'), '.2e')} "
              f"regs {fmt(r.get('n_regs'), 'd')} {'ok' if r['ok'] else 'FAIL'} "
              f"{r['error'] or ''} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)
    t_fresh = next((r.get("us") for r in case_rows if r["impl"] == "torch"), None)
    t_acc = next((r.get("us") for r in case_rows if r["impl"] == "torch+add"), None)
    for r in case_rows:
        ref_us = t_acc if r["accumulate"] else t_fresh
        if ref_us and r.get("us"):
            r["vs_torch"] = ref_us / r["us"]
    del base_dw, expect_acc


def print_table(rows, dev_name, copy_gbps):
    head = ["layout", "gemm", "impl", "µs", "kernel µs", "GB/s", "% copy", "TFLOP/s",
            "vs torch", "rel err", "regs", "check"]
    lines = []
    for r in rows:
        chk = ("skipped" if r.get("skipped") else "ok" if r["ok"] else "FAIL") + (
            f" {r['error'][:60]}" if r.get("error") else "")
        lines.append([r["layout"], r["gemm"], r["config"], fmt(r.get("us"), ".1f"),
                      fmt(r.get("kernel_us"), ".1f"),
                      fmt(r.get("gbps"), ".0f"), fmt(r.get("pct_copy"), ".0f"),
                      fmt(r.get("tflops"), ".0f"), fmt(r.get("vs_torch"), ".2f"),
                      fmt(r.get("rel_err"), ".1e"), fmt(r.get("n_regs"), "d"), chk])
    print(f"{dev_name}; µs: do_bench median (L2 flushed); kernel µs: profiler (bars and "
          f"default tiles); GB/s, % copy ({fmt(copy_gbps, '.0f')} GB/s) and TFLOP/s from "
          f"kernel µs where measured, else µs: d_out + rows read, dW written (+ read: "
          f"acc); TFLOP/s of the routed rows; vs torch: torch._grouped_mm (acc: + add_) "
          f"µs / row µs")
    print_columns(head, lines)
    print("best per case (checked rows):")
    for key in dict.fromkeys((r["layout"], r["gemm"]) for r in rows):
        rs = [r for r in rows if (r["layout"], r["gemm"]) == key and r.get("us")]
        by_impl = {r["impl"]: r for r in rs if r["impl"] != "tma"}
        for acc in (False, True):
            cand = [r for r in rs if r["impl"] == "tma" and r["ok"] and r["accumulate"] == acc]
            if not cand:
                continue
            b = min(cand, key=lambda r: r["us"])
            t = by_impl.get("torch+add" if acc else "torch")
            o = by_impl.get("old")
            print(f"  {key[0]} {key[1]:7s} {'acc  ' if acc else 'fresh'} torch"
                  f"{'+add' if acc else ''} {fmt(t and t['us'], '.1f')} µs, old "
                  f"{fmt(o and o['us'], '.1f')}, best {b['us']:.1f} "
                  f"{b['config']} ({fmt(b.get('vs_torch'), '.2f')}x torch, "
                  f"{fmt(b.get('pct_copy'), '.0f')}% copy, {b['tflops']:.0f} TFLOP/s)")


# --------------------------------------------------------------------------- offline sm_90


def ptxas_table() -> int:
    """Compile the default tiles and every candidate (fresh; the default and the
    accumulating candidates with ``ACCUMULATE``) for sm_90 without a GPU; print
    registers, spill bytes, shared memory and the wgmma / TMA instruction counts."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .fp8_gemm_sweep import _ptxas_usage

    kernel = bwd_gm._wgrad_tma_kernel
    print(f"triton {triton.__version__}, sm_90")
    jobs = ([(DEFAULT, False), (DEFAULT, True)] + [(c, False) for c in CANDIDATES]
            + [(c, True) for c in ACC_CANDIDATES])
    for c, acc in jobs:
        br16 = 16 if c["TAIL"] == 2 else c["BR"]
        types = dict(g_desc=f"tensordesc<bf16[{c['BR']}, {c['BN']}]>",
                     x_desc=f"tensordesc<bf16[{c['BR']}, {c['BK']}]>",
                     g16_desc=f"tensordesc<bf16[{br16}, {c['BN']}]>",
                     x16_desc=f"tensordesc<bf16[{br16}, {c['BK']}]>",
                     w_ptr="*bf16", offsets_ptr="*i32")
        sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32")
               for p in kernel.params}
        div = ("N", "K", "stride_we", "stride_wn")
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
                 if sig[n].startswith("*") or n in div}
        consts = dict(BN=c["BN"], BK=c["BK"], BR=c["BR"], TAIL=c["TAIL"], ACCUMULATE=acc)
        t = time.perf_counter()
        try:
            k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts,
                                         attrs=attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": c["num_warps"],
                                        "num_stages": c["num_stages"]})
        except Exception as exc:
            print(f"{cfg_name(c, acc):34s} compile error: {exc}"[:300])
            continue
        ptx = k.asm["ptx"]
        regs, spill = _ptxas_usage(ptx)
        print(f"{cfg_name(c, acc):34s} regs {fmt(regs, '3d')} spill {fmt(spill, '4d')} B smem "
              f"{k.metadata.shared // 1024:3d} KiB wgmma {len(re.findall('wgmma.mma_async', ptx))}"
              f" TMA {len(re.findall('cp.async.bulk.tensor', ptx))} "
              f"({time.perf_counter() - t:.1f} s)", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_wgrad_tma",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write every row to this JSON file")
    p.add_argument("--old", default=None,
                   help="folder holding main's linghe/bwd/grouped_mm.py (as grouped_mm.py)")
    p.add_argument("--cpu", action="store_true", help="tiny shape, Triton interpreter")
    p.add_argument("--ptxas", action="store_true",
                   help="no GPU: compile the candidates for sm_90, print registers")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS,
                   help="skip candidate rows after this many s")
    p.add_argument("--layouts", default="b,a")
    p.add_argument("--gemms", default="gate_up,down")
    args = p.parse_args(argv)
    if args.ptxas:
        return ptxas_table()
    cpu = args.cpu or not torch.cuda.is_available()
    if not interpreter_matches(cpu, "benchmark.probe_wgrad_tma"):
        return 2
    t0 = time.perf_counter()
    dev = "cpu" if cpu else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references
    old = None
    if args.old:
        old = load_module_at("", "linghe/bwd/grouped_mm.py", "linghe.bwd._grouped_mm_old",
                             src_dir=args.old)
    layouts = CPU_LAYOUTS if cpu else {k: LAYOUTS[k] for k in args.layouts.split(",")}
    gemms = CPU_GEMMS if cpu else {k: GEMMS[k] for k in args.gemms.split(",")}
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; torch {torch.__version__}, triton {triton.__version__}; "
          f"old: {args.old or 'this tree'}", file=sys.stderr, flush=True)
    copy_gbps = copy_bandwidth_gbps(Config(dev, True))
    rows = []
    for lname, lay in layouts.items():
        for gname, (N, K) in gemms.items():
            d = build_inputs(lay, N, K, dev)
            probe_case(lname, gname, d, cpu, old, t0, args.max_seconds, copy_gbps, rows)
            del d
            if not cpu:
                torch.cuda.empty_cache()
    report = dict(device=dev_name, torch=torch.__version__, triton=triton.__version__,
                  interpreter=cpu, old=args.old, copy_gbps=copy_gbps,
                  seconds=time.perf_counter() - t0, rows=rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}", file=sys.stderr, flush=True)
    print_table(rows, dev_name, copy_gbps)
    print(f"{report['seconds']:.0f} s")
    return 1 if any(not r["ok"] and not r.get("skipped") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
