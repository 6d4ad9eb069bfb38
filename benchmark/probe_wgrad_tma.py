"""Probe of the TMA grouped wgrad (``linghe.bwd.grouped_mm.launch_wgrad_tma``) against
``torch._grouped_mm`` and main's TMA wgrad:
``python -m benchmark.probe_wgrad_tma [--json PATH] [--old DIR] [--cpu] [--max-seconds S]``,
or ``--ptxas`` (no GPU: an offline sm_90 compile of every candidate: registers, spills,
shared memory, programs per SM).

``dW_e = d_out_e^T @ rows_e`` over each expert's segment at the MoE shapes of
``benchmark/probe_grouped_bf16.py`` (8192 tokens, top-8, balanced random routing as
``benchmark/cases/grouped_mm.py`` builds it): layout ``b`` (E = 256, align 16, 215-307
rows per expert: the e2e step) and ``a`` (E = 32, align 128, ~2K rows per expert), GEMMs
``gate_up`` (N = 2048, K = 2048) and ``down`` (N = 2048, K = 1024); bf16 operands (zero
padding rows) and bf16 dW. Rows, fresh (``dW =``) and accumulating (``dW +=``, the
default when a ``.grad`` exists):

- ``torch``: ``torch._grouped_mm`` (CUTLASS) through ``grouped_mm_wgrad(backend="torch")``;
  ``torch+add``: the same plus ``dw.add_(...)`` into an existing dW (what accumulating a
  gradient costs without a fused epilogue);
- ``old``: main's ``launch_wgrad_tma`` at its default tiles (``--old DIR/grouped_mm.py``,
  main's ``linghe/bwd/grouped_mm.py``; without ``--old`` this tree's defaults, the same
  kernel path);
- the candidates of :data:`FRESH` / :data:`ACC`: this tree's ``launch_wgrad_tma`` with a
  pinned config. Names: ``P``/``NP`` persistent or one program per tile, ``BNxBK``,
  ``BR`` box rows, warps/stages, ``T`` the tail form, ``xN`` at most N programs per SM
  (fewer where the compiled kernel does not fit: the ``/SM`` column), ``st`` the TMA
  store epilogue, ``rdN`` how an accumulating tile adds the old dW (0 pointer loads in
  the epilogue, 1 a TMA box there, 2 pointer loads prefetched, 3 a TMA reduce-add in L2).

Every row is checked in the same run against per-expert float32 products of the same
bf16 operands (TF32 off): relative error ``<= 1e-2``; fresh outputs NaN-filled first;
accumulate rows against the existing dW plus the reference. ``µs``:
``triton.testing.do_bench`` medians (L2 flushed before each call; the kernels run
0.4-3 ms, far above the launch's host time); ``kernel µs``: the profiler
(``benchmark.harness.device_time_us``: the CUDA kernels of one call; ``torch+add``
counts both kernels) for the bars. GB/s from the fewest bytes: ``d_out`` and ``rows``
read once (all ``R`` rows), dW written once (and read once when accumulating); ``%
copy`` of the 1 GiB device copy; TFLOP/s of the routed rows only (65536 x N x K x 2).
``vs torch`` = torch µs / row µs (accumulate rows: against ``torch+add``), ``vs old``
likewise against main's kernel. Candidate rows stop after ``--max-seconds``. ``--cpu``
runs a tiny shape through the Triton interpreter (a smoke test of this script, not a
measurement). The table is printed last.
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
    copy_bandwidth_gbps,
    device_time_us,
    fmt,
    interpreter_matches,
    load_module_at,
    print_columns,
    random_routing,
)


def _cfg(bn, bk, br, warps, stages, tail, persistent=1, per_sm=1, epi=1, acc_read=0):
    return dict(BN=bn, BK=bk, BR=br, num_warps=warps, num_stages=stages, TAIL=tail,
                PERSISTENT=persistent, PER_SM=per_sm, EPI_TMA=epi, ACC_READ=acc_read)


#: Fresh (``dW =``) candidates, the likely winners first. ``--ptxas`` prints the
#: registers, shared memory and programs per SM of each (sm_90, triton 3.6 and 3.9 alike
#: within ~20 registers, no spills: 128x128 8 warps 94-123 registers, 88-112 KiB, two
#: programs per SM; 128x256 / 256x128 167-212, 184-200 KiB, one).
FRESH = [
    _cfg(128, 128, 64, 8, 2, 3, per_sm=2),
    _cfg(128, 256, 64, 8, 2, 3),                 # 1/3 less L2 traffic per output, 1/SM
    _cfg(128, 128, 64, 8, 2, 0, per_sm=2),       # every box masked in registers, 1 MMA
    _cfg(128, 128, 64, 4, 2, 3, per_sm=2),
    _cfg(128, 256, 64, 8, 2, 2, persistent=0),   # ~2K rows per expert (E=32): no 16-row
    _cfg(128, 256, 64, 8, 3, 0),                 # boxes in the long K loops
    _cfg(256, 128, 64, 8, 2, 3),
    _cfg(128, 128, 32, 8, 3, 3, per_sm=2),
    _cfg(128, 128, 64, 8, 2, 3, per_sm=2, epi=0),  # pointer-store epilogue
    _cfg(128, 128, 64, 8, 2, 2, persistent=0),   # main's schedule + TMA store
]
#: Accumulating (``dW +=``) candidates.
ACC = [
    _cfg(128, 128, 64, 8, 2, 3, per_sm=2, acc_read=3),
    _cfg(128, 128, 64, 4, 3, 1, persistent=0, acc_read=3),  # main's acc default + reduce
    _cfg(128, 256, 64, 8, 2, 3, acc_read=3),
    _cfg(128, 128, 64, 8, 2, 0, per_sm=2, acc_read=3),
    _cfg(128, 256, 64, 8, 2, 2, persistent=0, acc_read=3),
    _cfg(128, 128, 64, 4, 2, 3, per_sm=2, acc_read=3),
    _cfg(128, 128, 64, 8, 2, 3, per_sm=2, acc_read=1),     # the old tile by TMA, then store
    _cfg(128, 128, 64, 8, 2, 3, per_sm=2, epi=0, acc_read=2),  # prefetched into registers
    _cfg(128, 128, 64, 8, 2, 2, persistent=0, acc_read=3),
    _cfg(256, 128, 64, 8, 2, 3, acc_read=3),
]
#: E = 32 (GEMM-heavy) runs the first FRESH_A / ACC_A candidates only (time budget).
FRESH_A, ACC_A = 6, 5
CPU_FRESH = [_cfg(32, 32, 32, 4, 1, 3), _cfg(32, 64, 16, 4, 1, 0, per_sm=2),
             _cfg(32, 32, 32, 4, 1, 2, persistent=0)]
CPU_ACC = [_cfg(32, 32, 32, 4, 1, 3, acc_read=3), _cfg(32, 32, 16, 4, 1, 0, acc_read=2),
           _cfg(32, 32, 32, 4, 1, 1, persistent=0, acc_read=1)]

LAYOUTS = {"b": dict(T=8192, topk=8, E=256, align=16),
           "a": dict(T=8192, topk=8, E=32, align=128)}
GEMMS = {"gate_up": (2048, 2048), "down": (2048, 1024)}  # (N, K)
CPU_LAYOUTS = {"tiny": dict(T=40, topk=2, E=3, align=16)}
CPU_GEMMS = {"tiny": (64, 96)}
TOL = 1e-2  # bf16 outputs vs the float32 reference
MAX_SECONDS = 100.0


def cfg_name(c: dict, acc: bool = False) -> str:
    s = (f"{'P' if c['PERSISTENT'] else 'NP'} {c['BN']}x{c['BK']} BR{c['BR']} "
         f"{c['num_warps']}w/{c['num_stages']}s T{c['TAIL']}")
    if c["PERSISTENT"]:
        s += f" x{c['PER_SM']}"
    if c["EPI_TMA"] and not (acc and c["ACC_READ"] == 3):
        s += " st"
    return s + (f" rd{c['ACC_READ']}" if acc else "")


def fit_per_sm(regs: int, shared: int, warps: int) -> int:
    """Programs of a compiled kernel that fit one Hopper SM (registers, shared memory,
    warps), as ``linghe.bwd.resident`` counts them."""
    per_warp = -(-regs * 32 // 256) * 256
    n = min(65536 // (per_warp * warps), 64 // warps)
    return max(0, min(n, 232448 // (shared + 1024)))


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


def _impls(cpu: bool, lname: str) -> list[tuple[str, dict | None, bool]]:
    """``(impl, config, accumulate)`` in the order they run (the bars first)."""
    rows = [("torch", None, False), ("old", None, False), ("torch+add", None, True),
            ("old", None, True)]
    fresh, acc = (CPU_FRESH, CPU_ACC) if cpu else (FRESH, ACC)
    if lname == "a":
        fresh, acc = fresh[:FRESH_A], acc[:ACC_A]
    for i in range(max(len(fresh), len(acc))):  # interleaved: both modes get time
        rows += [("tma", c, False) for c in fresh[i:i + 1]]
        rows += [("tma", c, True) for c in acc[i:i + 1]]
    return rows


def make_call(impl: str, cfg, acc: bool, d: dict, old, base: torch.Tensor):
    """``(fn, out)``: a zero-argument callable and the dW it leaves its result in (None:
    the callable returns it)."""
    g, x, off, E = d["g"], d["x"], d["layout"].offsets, d["E"]
    N, K = g.shape[1], x.shape[1]
    if impl in ("torch", "torch+add") and not x.is_cuda:
        return None, None
    if impl == "torch":
        return (lambda: bwd_gm.grouped_mm_wgrad(g, x, off, backend="torch")), None
    if impl == "torch+add":
        dw = base.clone()
        return (lambda: dw.add_(bwd_gm.grouped_mm_wgrad(g, x, off, backend="torch"))), dw
    mod = (old or bwd_gm) if impl == "old" else bwd_gm
    if acc:
        dw = base.clone()
        return (lambda: mod.launch_wgrad_tma(g, x, dw, off, accumulate=True,
                                             config=cfg)), dw
    dw = torch.full((E, N, K), float("nan"), device=x.device, dtype=torch.bfloat16)
    return (lambda: mod.launch_wgrad_tma(g, x, dw, off, config=cfg)), dw


def _binaries(mods) -> list:
    out = []
    for mod in mods:
        try:
            for cache in mod._wgrad_tma_kernel.device_caches.values():
                out.extend(v for v in cache[0].values() if hasattr(v, "n_regs"))
        except Exception:
            pass
    return out


def time_us(fn, cpu: bool) -> float:
    """``triton.testing.do_bench`` median (L2 flushed before each call); on CPU one
    wall-clock call (interpreter)."""
    if cpu:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def probe_case(lname, gname, d, cpu, old, t0, max_s, copy_gbps, rows):
    E, R, used = d["E"], d["R"], d["used"]
    N, K = d["g"].shape[1], d["x"].shape[1]
    flops = 2 * used * N * K
    fresh_bytes = 2 * R * (N + K) + 2 * E * N * K
    base_dw = torch.randn(E, N, K, device=d["x"].device).to(torch.bfloat16)
    expect_acc = None
    case_rows = []
    mods = [m for m in (bwd_gm, old) if m is not None]
    for impl, cfg, acc in _impls(cpu, lname):
        name = impl if cfg is None else cfg_name(cfg, acc)
        r = dict(layout=lname, gemm=gname, E=E, R=R, N=N, K=K, used_rows=used, flops=flops,
                 impl=impl, config=name, tiles=cfg, accumulate=acc, ok=False, error=None)
        rows.append(r)
        case_rows.append(r)
        if impl == "tma" and not cpu and time.perf_counter() - t0 > max_s:
            r["skipped"] = f"time budget ({max_s:.0f} s) used up"
            continue
        fn, dw = make_call(impl, cfg, acc, d, old, base_dw)
        if fn is None:
            r["skipped"] = "torch._grouped_mm needs a GPU"
            continue
        try:
            before = {id(b) for b in _binaries(mods)}
            set_poison_outputs(True)  # the checked call only
            try:
                out = fn()
                out = dw if dw is not None else out
                if not cpu:
                    torch.cuda.synchronize()
            finally:
                set_poison_outputs(False)
            new = [b for b in _binaries(mods) if id(b) not in before]
            if len(new) == 1:
                b = new[0]
                r["n_regs"], r["n_spills"] = b.n_regs, b.n_spills
                r["smem"] = b.metadata.shared
                r["per_sm"] = fit_per_sm(b.n_regs, b.metadata.shared, b.metadata.num_warps)
            if acc:
                if expect_acc is None:
                    expect_acc = d["expect"] + base_dw.float()
                r["rel_err"] = err = rel_err(out, expect_acc)
                out.copy_(base_dw)  # the timed calls keep adding: keep it finite
            else:
                r["rel_err"] = err = rel_err(out, d["expect"])
            r["ok"] = bool(err <= TOL)
            del out
            r["us"] = time_us(fn, cpu)
            if not cpu and impl != "tma":  # kernel-only µs (profiler) for the bars
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
        print(f"  {lname} {gname:7s} {'acc  ' if acc else 'fresh'} {name:40s} "
              f"{fmt(r.get('us'), '9.1f')} µs (kernel {fmt(r.get('kernel_us'), '.1f')}) "
              f"{fmt(r.get('tflops'), '5.0f')} TFLOP/s err {fmt(r.get('rel_err'), '.2e')} "
              f"regs {fmt(r.get('n_regs'), 'd')} smem {fmt(r.get('smem'), 'd')} "
              f"{'ok' if r['ok'] else 'FAIL'} {r['error'] or ''} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    bars = {}
    for r in case_rows:
        if r["impl"] != "tma" and r.get("us"):
            bars[(r["impl"] if r["impl"] != "torch+add" else "torch", r["accumulate"])] = r["us"]
    for r in case_rows:
        if r.get("us"):
            t, o = bars.get(("torch", r["accumulate"])), bars.get(("old", r["accumulate"]))
            r["vs_torch"] = t / r["us"] if t else None
            r["vs_old"] = o / r["us"] if o else None
    del base_dw, expect_acc


def print_table(rows, dev_name, copy_gbps):
    head = ["layout", "gemm", "mode", "impl", "µs", "kernel µs", "GB/s", "% copy", "TFLOP/s",
            "vs torch", "vs old", "rel err", "regs", "smem KiB", "/SM", "check"]
    lines = []
    for r in rows:
        chk = ("skipped" if r.get("skipped") else "ok" if r["ok"] else "FAIL") + (
            f" {r['error'][:60]}" if r.get("error") else "")
        lines.append([r["layout"], r["gemm"], "acc" if r["accumulate"] else "fresh",
                      r["config"], fmt(r.get("us"), ".1f"), fmt(r.get("kernel_us"), ".1f"),
                      fmt(r.get("gbps"), ".0f"), fmt(r.get("pct_copy"), ".0f"),
                      fmt(r.get("tflops"), ".0f"), fmt(r.get("vs_torch"), ".2f"),
                      fmt(r.get("vs_old"), ".2f"), fmt(r.get("rel_err"), ".1e"),
                      fmt(r.get("n_regs"), "d"),
                      fmt(r["smem"] / 1024 if r.get("smem") is not None else None, ".0f"),
                      fmt(r.get("per_sm"), "d"), chk])
    print(f"{dev_name}; µs: do_bench median (L2 flushed); kernel µs: profiler (bars); "
          f"GB/s, % copy ({fmt(copy_gbps, '.0f')} GB/s) and TFLOP/s from kernel µs where "
          f"measured, else µs: d_out + rows read, dW written (+ read: acc); TFLOP/s of the "
          f"routed rows; vs torch: torch._grouped_mm (acc: + add_) µs / row µs; vs old: "
          f"main's launch_wgrad_tma; /SM: programs that fit an SM (regs, smem)")
    print_columns(head, lines)
    print("best per case (checked rows):")
    for key in dict.fromkeys((r["layout"], r["gemm"]) for r in rows):
        rs = [r for r in rows if (r["layout"], r["gemm"]) == key and r.get("us")]
        for acc in (False, True):
            bars = {r["impl"]: r for r in rs if r["impl"] != "tma" and r["accumulate"] == acc}
            cand = [r for r in rs if r["impl"] == "tma" and r["ok"] and r["accumulate"] == acc]
            if not cand:
                continue
            b = min(cand, key=lambda r: r["us"])
            t = bars.get("torch+add" if acc else "torch")
            o = bars.get("old")
            print(f"  {key[0]} {key[1]:7s} {'acc  ' if acc else 'fresh'} torch"
                  f"{'+add' if acc else ''} {fmt(t and t['us'], '.1f')} µs, old "
                  f"{fmt(o and o['us'], '.1f')}, best {b['us']:.1f} {b['config']} "
                  f"({fmt(b.get('vs_torch'), '.2f')}x torch, {fmt(b.get('vs_old'), '.2f')}x "
                  f"old, {fmt(b.get('pct_copy'), '.0f')}% copy, {b['tflops']:.0f} TFLOP/s)")


# --------------------------------------------------------------------------- offline sm_90


def compile_sm90(c: dict, acc: bool, w_dtype: str = "bf16"):
    """Compile ``_wgrad_tma_kernel`` at config ``c`` for sm_90 without a GPU (the
    launcher's constexprs and descriptor block shapes); returns the compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = bwd_gm._wgrad_tma_kernel
    br16 = 16 if c["TAIL"] in (2, 3) else c["BR"]
    acc_read = c["ACC_READ"] if acc else 0
    w_tma = c["EPI_TMA"] or acc_read in (1, 3)
    types = dict(g_desc=f"tensordesc<bf16[{c['BR']}, {c['BN']}]>",
                 x_desc=f"tensordesc<bf16[{c['BR']}, {c['BK']}]>",
                 g16_desc=f"tensordesc<bf16[{br16}, {c['BN']}]>",
                 x16_desc=f"tensordesc<bf16[{br16}, {c['BK']}]>",
                 w_desc=(f"tensordesc<{w_dtype}[1, {c['BN']}, {c['BK']}]>" if w_tma
                         else f"tensordesc<bf16[{c['BR']}, {c['BN']}]>"),
                 w_ptr=f"*{w_dtype}", offsets_ptr="*i32")
    sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32")
           for p in kernel.params}
    div = ("N", "K", "R", "E", "stride_we", "stride_wn")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or n in div}
    consts = dict(BN=c["BN"], BK=c["BK"], BR=c["BR"], TAIL=c["TAIL"], ACCUMULATE=acc,
                  PERSISTENT=bool(c["PERSISTENT"]), EPI_TMA=bool(c["EPI_TMA"]),
                  ACC_READ=acc_read, EP2=256 if c["PERSISTENT"] else 16)
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts,
                                    attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": c["num_warps"],
                                   "num_stages": c["num_stages"]})


def ptxas_table() -> int:
    """Compile main's defaults and every candidate for sm_90 without a GPU; print
    registers, spill bytes, shared memory, programs per SM and the wgmma / TMA
    instruction counts, and whether the K loop is pipelined (TMA copies before it)."""
    import re

    from .fp8_gemm_sweep import _ptxas_usage

    print(f"triton {triton.__version__}, sm_90")
    dflt = bwd_gm._wgrad_tma_default_config
    jobs = ([(dict(dflt(False)), False), (dict(dflt(True)), True)]
            + [(c, False) for c in FRESH] + [(c, True) for c in ACC])
    for c, acc in jobs:
        t = time.perf_counter()
        try:
            k = compile_sm90(c, acc)
        except Exception as exc:
            print(f"{cfg_name(c, acc):40s} compile error: {exc}"[:300])
            continue
        ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
        regs, spill = _ptxas_usage(ptx)
        loop = ttgir.find("scf.for")
        pre = ttgir[:loop].count("async_tma_copy_global_to_local") if loop >= 0 else 0
        print(f"{cfg_name(c, acc):40s} regs {fmt(regs, '3d')} spill {fmt(spill, '4d')} B "
              f"smem {k.metadata.shared // 1024:3d} KiB /SM "
              f"{fit_per_sm(regs or 255, k.metadata.shared, c['num_warps'])} "
              f"wgmma {len(re.findall('wgmma.mma_async', ptx))} "
              f"TMA {len(re.findall('cp.async.bulk.tensor', ptx))} "
              f"reduce {len(re.findall('cp.reduce.async.bulk', ptx))} "
              f"prologue loads {pre} ({time.perf_counter() - t:.1f} s)", flush=True)
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
