"""Probe of the bf16 grouped GEMM rows kernels (forward and dgrad) against
``torch._grouped_mm``:
``python -m benchmark.probe_grouped_bf16 [--json PATH] [--cpu] [--max-seconds S]``, or
``--ptxas`` (no GPU: an offline sm_90 compile of every candidate, registers / spills /
shared memory).

At the MoE shapes of ``benchmark/fp8_gemm_sweep.py`` (8192 tokens, top-8, balanced
random routing as ``benchmark/cases/grouped_mm.py`` builds it) -- layout ``a`` (E = 32,
align 128, 69600 rows) and ``b`` (E = 256, align 16, 69376 rows), GEMMs ``gate_up`` (N =
2048, K = 2048) and ``down`` (N = 2048, K = 1024) -- it times, for the forward
(``out = x_e @ W_e^T``) and the dgrad (``dx = g_e @ W_e``):

- ``torch``: ``torch._grouped_mm`` bf16 through linghe's ``backend="torch"`` (plus its
  tail-zeroing kernel), the bar;
- ``main``: main's Triton path, the pointer-load rows kernel at its heuristic tiles
  (``linghe.fwd.grouped_mm.BF16_TMA = False``: the same code as main, no ``--old``);
- ``default``: the Triton path now (the TMA rows kernel at :func:`_mm_config`'s tiles);
- ``tma ...``: the TMA rows kernel at pinned tiles (:data:`CANDIDATES`) through
  ``launch_grouped_rows(config=...)``;
- ``dense``: one cuBLAS bf16 matmul with the routed rows' FLOPs (a ceiling, no check).

Every row but ``dense`` is checked in the same run against :func:`linghe.reference.
grouped_mm` on float32 copies (TF32 off): relative error ``<= 1e-2`` (bf16 outputs), the
output NaN-filled before the checked call (``set_poison_outputs``; ``torch`` allocates its
own). Times are ``triton.testing.do_bench`` medians (L2 flushed before every call; the
kernels run 0.3-2 ms, far above the launch's host time); ``kernel µs`` re-times the
``torch``, ``main`` and fastest rows with the profiler (``benchmark.harness.
device_time_us``, kernels only) while the time budget lasts. TFLOP/s count the routed
rows only (65536 x N x K x 2): padding is overhead. ``vs torch`` = torch µs / row µs
(> 1: faster than ``torch._grouped_mm``).

Compiles run first in ``--jobs`` worker processes (each compiles a share of the
candidates at 512 tokens, whose launches have the same compile keys), so the probe stays
under ~90 s with cold caches. ``--cpu`` runs a tiny shape through the Triton interpreter
(a smoke test of this script, not a measurement). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

if __name__ == "__main__" and "--ptxas" not in sys.argv and (
        "--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402

from linghe import reference as ref  # noqa: E402
from linghe.bwd import grouped_mm as bwd_gm  # noqa: E402
from linghe.fwd import grouped_mm as fwd_gm  # noqa: E402
from linghe.layout import max_grouped_rows  # noqa: E402
from linghe.testing import rel_err  # noqa: E402
from linghe.utils import set_poison_outputs  # noqa: E402

from .harness import (  # noqa: E402
    bench_us,
    compiled_binaries,
    device_time_us,
    fmt,
    interpreter_matches,
    print_columns,
    random_routing,
)


def _tma(bm, bn, warps, stages, group_m=8, bk=64):
    return dict(BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages,
                TMA=True)


#: TMA candidates (sm_90 ptxas, triton 3.9 / 3.6 registers; shared memory; programs per
#: SM by shared memory and registers): 64x128/4w 95/94 regs (3 stages 72 KiB: 3 per SM;
#: 4: 96 KiB, 2; 5: 120 KiB, 1), 128x128/8w 91/92 (3: 96 KiB, 2; 4: 128 KiB, 1; 5: 160
#: KiB, 1), 128x256/8w 154-192 (3: 144 KiB; 4: 192 KiB; 1), 64x256/4w 182-183 (3: 120
#: KiB, 1); ``--ptxas`` prints them per layout and GEMM direction.
CANDIDATES = [
    _tma(64, 128, 4, 3), _tma(64, 128, 4, 4), _tma(64, 128, 4, 5), _tma(64, 128, 4, 4, 16),
    _tma(128, 128, 8, 3), _tma(128, 128, 8, 4), _tma(128, 128, 8, 5),
    _tma(128, 256, 8, 3), _tma(128, 256, 8, 4), _tma(64, 256, 4, 3),
    _tma(64, 128, 4, 3, bk=128),  # half the K steps (barrier waits); 144 KiB: 1 per SM
]
CPU_CANDIDATES = [_tma(16, 64, 4, 1, 4, 32), _tma(32, 64, 4, 1, 4, 32)]

LAYOUTS = {"a": dict(T=8192, topk=8, E=32, align=128),
           "b": dict(T=8192, topk=8, E=256, align=16)}
GEMMS = {"gate_up": (2048, 2048), "down": (2048, 1024)}  # (N, K)
CPU_LAYOUTS = {"tiny": dict(T=40, topk=2, E=3, align=16)}
CPU_GEMMS = {"tiny": (64, 96)}
OPS = ("fwd", "dgrad")
TOL = 1e-2  # bf16 outputs vs the float32 reference (as tests/test_grouped_mm.py)
#: Candidate rows are skipped (and profiler re-timing stops) after this many seconds.
MAX_SECONDS = 75.0
#: Tokens of the compile workers' layouts (row counts keep their divisibility by 16).
WARM_TOKENS = 512


def cfg_name(c: dict) -> str:
    g = f"/g{c['GROUP_M']}" if c.get("GROUP_M", 8) != 8 else ""
    return f"tma {c['BM']}x{c['BN']}x{c['BK']}/{c['num_warps']}w/{c['num_stages']}s{g}"


# --------------------------------------------------------------------------- inputs


def build_inputs(lay: dict, N: int, K: int, device: str, tokens: int | None = None) -> dict:
    """Layout, ``x [R, K]``, ``w [E, N, K]``, ``g [R, N]`` (bf16, zero padding rows) as
    ``benchmark/cases/grouped_mm.py`` builds them."""
    layout, real, _, _ = random_routing(tokens or lay["T"], lay["topk"], lay["E"],
                                        lay["align"], device)
    E, R = layout.num_experts, layout.num_rows
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(R, K, generator=gen, device=device).to(torch.bfloat16)
    x[~real] = 0
    w = (torch.randn(E, N, K, generator=gen, device=device) / K**0.5).to(torch.bfloat16)
    g = torch.randn(R, N, generator=gen, device=device).to(torch.bfloat16)
    g[~real] = 0
    return dict(layout=layout, x=x, w=w, g=g, used=int(real.sum()))


def reference(op: str, d: dict) -> torch.Tensor:
    off = d["layout"].offsets
    if op == "fwd":
        return ref.grouped_mm(d["x"].float(), d["w"].float(), off)
    return ref.grouped_mm(d["g"].float(), d["w"].float().transpose(1, 2), off)


def call(op: str, d: dict, impl: str, cfg: dict | None = None):
    """A zero-argument callable running ``op`` with ``impl`` ("torch", "main", "default",
    "tma"), or None where it cannot run here."""
    x, w, g, off = d["x"], d["w"], d["g"], d["layout"].offsets
    E, N, K = w.shape
    if impl == "torch":
        if not hasattr(torch, "_grouped_mm") or (x.is_cuda and not
                                                 fwd_gm.torch_grouped_mm_ok(x, w)):
            return None
        if op == "fwd":
            return lambda: fwd_gm.grouped_mm_fwd(x, w, off, backend="torch")
        return lambda: bwd_gm.grouped_mm_dgrad(g, w, off, backend="torch")
    if impl in ("main", "default"):
        def run():
            saved = fwd_gm.BF16_TMA
            fwd_gm.BF16_TMA = impl == "default"  # main: the pointer kernel, main's tiles
            try:
                if op == "fwd":
                    return fwd_gm.grouped_mm_fwd(x, w, off, backend="triton")
                return bwd_gm.grouped_mm_dgrad(g, w, off, backend="triton")
            finally:
                fwd_gm.BF16_TMA = saved
        return run
    if op == "fwd":
        return lambda: fwd_gm.launch_grouped_rows(
            x, w, fwd_gm.empty(x.shape[0], N, dtype=x.dtype, device=x.device), off,
            stride_be=N * K, stride_bi=1, stride_bj=K, config=cfg)
    return lambda: fwd_gm.launch_grouped_rows(
        g, w, fwd_gm.empty(g.shape[0], K, dtype=g.dtype, device=g.device), off,
        stride_be=N * K, stride_bi=K, stride_bj=1, config=cfg)


def _impls(cpu: bool) -> list[tuple[str, dict | None]]:
    return ([("torch", None), ("main", None), ("default", None)]
            + [("tma", c) for c in (CPU_CANDIDATES if cpu else CANDIDATES)])


# --------------------------------------------------------------------------- helpers


#: The rows kernels whose binaries give a row's ``n_regs`` / ``n_spills``.
_ROWS_KERNELS = (fwd_gm._grouped_rows_kernel, fwd_gm._grouped_rows_tma_kernel)
_RES: dict = {}  # (layout, op, impl name) -> (n_regs, n_spills)


# --------------------------------------------------------------------------- the probe


def probe_op(op, lname, gname, d, cpu, t0, max_s, rows):
    used, (E, N, K) = d["used"], d["w"].shape
    flops = 2 * used * N * K
    base = dict(layout=lname, gemm=gname, op=op, E=E, R=d["layout"].num_rows, N=N, K=K,
                used_rows=used, flops=flops)
    expect = reference(op, d)
    for impl, cfg in _impls(cpu):
        name = impl if cfg is None else cfg_name(cfg)
        r = dict(base, impl=impl, config=name, tiles=cfg, ok=False, error=None)
        rows.append(r)
        if impl == "tma" and not cpu and time.perf_counter() - t0 > max_s:
            r.update(skipped=f"time budget ({max_s:.0f} s) used up")
            continue
        fn = call(op, d, impl, cfg)
        if fn is None:
            r.update(skipped="torch._grouped_mm cannot run these operands here")
            continue
        try:
            before = {id(b) for b in compiled_binaries(*_ROWS_KERNELS)}
            set_poison_outputs(True)  # the checked call only
            try:
                out = fn()
                if not cpu:
                    torch.cuda.synchronize()
            finally:
                set_poison_outputs(False)
            new = [b for b in compiled_binaries(*_ROWS_KERNELS) if id(b) not in before]
            if len(new) == 1:
                _RES[(lname, op, name)] = (new[0].n_regs, new[0].n_spills)
            r["n_regs"], r["n_spills"] = _RES.get((lname, op, name), (None, None))
            r["rel_err"] = err = rel_err(out, expect)
            r["ok"] = bool(err <= TOL)
            del out
            r["us"] = us = bench_us(fn, not cpu, rep=30)
            r["tflops"] = flops / us / 1e6
        except Exception as exc:  # one failing row must not stop the probe
            msg = str(exc).splitlines()[0][:300] if str(exc) else ""
            if impl == "torch" and cpu:  # e.g. no CPU kernel for torch._grouped_mm
                r.update(skipped=f"{type(exc).__name__}: {msg}")
            else:
                r["error"] = f"{type(exc).__name__}: {msg}"
        print(f"  {lname} {gname:7s} {op:5s} {name:28s} {fmt(r.get('us'), '9.1f')} µs "
              f"{fmt(r.get('tflops'), '6.0f')} TFLOP/s err {fmt(r.get('rel_err'), '.2e')} "
              f"regs {fmt(r.get('n_regs'), 'd')} {'ok' if r['ok'] else 'FAIL'} "
              f"{r['error'] or ''} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)
    del expect
    torch_us = next((r["us"] for r in rows[-len(_impls(cpu)):]
                     if r["impl"] == "torch" and r.get("us")), None)
    for r in rows[-len(_impls(cpu)):]:
        if torch_us and r.get("us"):
            r["vs_torch"] = torch_us / r["us"]
    if not cpu:  # a dense GEMM of the same FLOPs (cuBLAS), no check
        a = torch.randn(used, K if op == "fwd" else N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(a.shape[1], N if op == "fwd" else K, device="cuda",
                        dtype=torch.bfloat16)
        us = bench_us(lambda: a @ b, not cpu, rep=30)
        rows.append(dict(base, impl="dense", config=f"dense [{used},{a.shape[1]}]x"
                         f"[{b.shape[0]},{b.shape[1]}]", ok=True, error=None, us=us,
                         tflops=flops / us / 1e6,
                         vs_torch=torch_us / us if torch_us else None))
        del a, b


def profile_rows(rows, datas, t0, max_s):
    """Kernel-only µs (profiler) of the torch, main and fastest checked row per case."""
    for key, d in datas.items():
        rs = [r for r in rows if (r["layout"], r["gemm"], r["op"]) == key and r.get("us")
              and r["ok"] and r["impl"] != "dense"]
        tr = [r for r in rs if r["impl"] in ("torch", "main")]
        best = min((r for r in rs if r["impl"] in ("tma", "default")),
                   key=lambda r: r["us"], default=None)
        for r in tr + ([best] if best else []):
            if time.perf_counter() - t0 > max_s:
                return
            cfg = r["tiles"]
            r["kernel_us"] = device_time_us(call(key[2], d, r["impl"], cfg), reps=5)


def warm_worker(task: str) -> int:
    """Compile (and run once, unchecked) a share of one layout's launches: ``layout:op``
    or ``layout:op:i/n`` (every n-th launch from the i-th)."""
    lname, op, *part = task.split(":")
    i, n = map(int, part[0].split("/")) if part else (0, 1)
    lay = LAYOUTS[lname]
    # N = K = 256: the MoE GEMMs' launches have the same compile keys (dims and strides
    # multiples of 16, the dgrad's contraction a multiple of BK)
    d = build_inputs(lay, 256, 256, "cuda", tokens=WARM_TOKENS)
    # main / default: the tiles that the full-size launches pick (they depend on R / E)
    R = max_grouped_rows(lay["T"], lay["topk"], lay["E"], lay["align"])
    jobs = [("tma", dict(fwd_gm._mm_config(R, lay["E"], 256, False, None, tma=tma), TMA=tma))
            for tma in (False, True)] + [(i_, c) for i_, c in _impls(False) if i_ == "tma"]
    for impl, c in jobs[i::n]:
        try:
            call(op, d, impl, c)()
        except Exception as exc:  # the probe itself reports it
            print(f"warm-up {task} {impl} {c}: {type(exc).__name__}: {exc}"[:300])
    torch.cuda.synchronize()
    return 0


def warm_up(layouts, ops, jobs: int, timeout_s: float) -> float:
    """Run the compile workers (``jobs`` processes); returns the wall seconds."""
    t0 = time.perf_counter()
    tasks = [f"{lname}:{op}" for lname in layouts for op in ops]
    if jobs <= 0:
        return 0.0
    n = max(1, jobs // len(tasks))
    tasks = [f"{t}:{i}/{n}" for t in tasks for i in range(n)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [(t, subprocess.Popen([sys.executable, "-m", "benchmark.probe_grouped_bf16",
                                   "--warm-worker", t], cwd=root, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)) for t in tasks]
    for t, p in procs:
        try:
            out = p.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))[0]
        except subprocess.TimeoutExpired:
            p.kill()  # ours; the probe compiles what is missing itself
            out = p.communicate()[0]
        if p.returncode or (out and "warm-up" in out):
            print(f"warm-up {t}: exit {p.returncode}\n{(out or '')[-1500:]}", file=sys.stderr)
    secs = time.perf_counter() - t0
    print(f"compile warm-up: {len(tasks)} workers, {secs:.0f} s", file=sys.stderr, flush=True)
    return secs


def print_table(rows, dev_name):
    head = ["layout", "gemm", "op", "impl", "µs", "kernel µs", "TFLOP/s", "vs torch",
            "rel err", "regs", "spills", "check"]
    lines = []
    for r in rows:
        chk = ("skipped" if r.get("skipped") else "ok" if r["ok"] else "FAIL") + (
            f" {r['error'][:60]}" if r.get("error") else "")
        lines.append([r["layout"], r["gemm"], r["op"], r["config"], fmt(r.get("us"), ".1f"),
                      fmt(r.get("kernel_us"), ".1f"), fmt(r.get("tflops"), ".0f"),
                      fmt(r.get("vs_torch"), ".2f"), fmt(r.get("rel_err"), ".1e"),
                      fmt(r.get("n_regs"), "d"), fmt(r.get("n_spills"), "d"), chk])
    print(f"{dev_name}; µs: do_bench median (L2 flushed); kernel µs: profiler; TFLOP/s "
          f"of the routed rows; vs torch: torch._grouped_mm µs / row µs")
    print_columns(head, lines)
    print("best per case (checked rows):")
    for key in dict.fromkeys((r["layout"], r["gemm"], r["op"]) for r in rows):
        rs = [r for r in rows if (r["layout"], r["gemm"], r["op"]) == key and r.get("us")
              and r["ok"] and r["impl"] in ("tma", "default")]
        tr = next((r for r in rows if (r["layout"], r["gemm"], r["op"]) == key
                   and r["impl"] == "torch" and r.get("us")), None)
        mn = next((r for r in rows if (r["layout"], r["gemm"], r["op"]) == key
                   and r["impl"] == "main" and r.get("us")), None)
        if rs:
            b = min(rs, key=lambda r: r["us"])
            print(f"  {key[0]} {key[1]:7s} {key[2]:5s} torch {fmt(tr and tr['us'], '.1f')} "
                  f"µs, main {fmt(mn and mn['us'], '.1f')} ({fmt(mn and mn.get('vs_torch'), '.2f')}"
                  f"x), best {b['us']:.1f} {b['config']} ({fmt(b.get('vs_torch'), '.2f')}x "
                  f"torch, {b['tflops']:.0f} TFLOP/s)")


# --------------------------------------------------------------------------- offline sm_90


def ptxas_table() -> int:
    """Compile every candidate (forward: weights K-major; dgrad: N-major) and main's
    pointer tiles for sm_90 without a GPU; print registers, spill bytes, shared memory,
    and whether the K loop keeps one wgmma group in flight (``wait_group 1``)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .fp8_gemm_sweep import _ptxas_usage

    def compile_one(kernel, types, consts, div, warps, stages):
        sig = {p.name: "constexpr" if p.is_constexpr or p.name in consts
               else types.get(p.name, "i32") for p in kernel.params}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
                 if sig[n].startswith("*") or n in div}
        src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})

    print(f"triton {triton.__version__}, sm_90")
    ptrs = dict(c_ptr="*bf16", as_ptr="*i32", bs_ptr="*i32", offsets_ptr="*i32")
    for op in OPS:
        for lname, lay in LAYOUTS.items():
            ep2 = max(16, triton.next_power_of_2(lay["E"]))
            main_cfg = fwd_gm._mm_config(69000, lay["E"], 2048, False, None)
            jobs = [("main", main_cfg)] + [("tma", c) for c in CANDIDATES]
            for impl, c in jobs:
                t = time.perf_counter()
                if impl == "main":
                    kernel = fwd_gm._grouped_rows_kernel
                    types = dict(ptrs, a_ptr="*bf16", b_ptr="*bf16")
                    # the unit stride is specialised to 1 (fwd: stride_bi, dgrad: stride_bj)
                    unit = "stride_bi" if op == "fwd" else "stride_bj"
                    consts = {"BM": c["BM"], "BN": c["BN"], "BK": c["BK"],
                              "GROUP_M": c["GROUP_M"], "FP8": False, "IEEE": False,
                              "B_KMAJOR": op == "fwd", "EP2": ep2, "RESCALE": False, unit: 1}
                    div = ("R", "I", "J", "E", "R_BUCKET", "stride_am", "stride_be",
                           "stride_bj" if op == "fwd" else "stride_bi", "stride_cm")
                    name = (f"main {c['BM']}x{c['BN']}x{c['BK']}/{c['num_warps']}w/"
                            f"{c['num_stages']}s")
                else:
                    kernel = fwd_gm._grouped_rows_tma_kernel
                    box = (f"[{c['BN']}, {c['BK']}]" if op == "fwd"
                           else f"[{c['BK']}, {c['BN']}]")
                    types = dict(ptrs, a_desc=f"tensordesc<bf16[{c['BM']}, {c['BK']}]>",
                                 b_desc=f"tensordesc<bf16{box}>")
                    consts = dict(BM=c["BM"], BN=c["BN"], BK=c["BK"], GROUP_M=c["GROUP_M"],
                                  EP2=ep2, B_NMAJOR=op == "dgrad", RESCALE=False)
                    div = ("R", "I", "J", "E", "R_BUCKET", "b_row_e", "stride_cm")
                    name = cfg_name(c)
                try:
                    k = compile_one(kernel, types, consts, div, c["num_warps"],
                                    c["num_stages"])
                except Exception as exc:
                    print(f"{op:5s} {lname} {name:30s} compile error: {exc}"[:300])
                    continue
                ptx = k.asm["ptx"]
                regs, spill = _ptxas_usage(ptx)
                head = re.search(r"(\$L__BB\d+_\d+):\s*// =>This Inner Loop Header", ptx)
                loop = (ptx[head.end():ptx.find(f"bra \t{head[1]};", head.end())]
                        if head else "")
                waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", loop)
                print(f"{op:5s} {lname} {name:30s} regs {fmt(regs, '3d')} spill "
                      f"{fmt(spill, '4d')} B smem {k.metadata.shared // 1024:3d} KiB  TMA "
                      f"{'cp.async.bulk.tensor' in ptx}  loop waits {waits} "
                      f"({time.perf_counter() - t:.1f} s)", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_grouped_bf16",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write every row to this JSON file")
    p.add_argument("--cpu", action="store_true", help="tiny shape, Triton interpreter")
    p.add_argument("--ptxas", action="store_true",
                   help="no GPU: compile the candidates for sm_90, print registers")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS,
                   help="skip candidate rows and profiler re-timing after this many s")
    p.add_argument("--layouts", default="a,b")
    p.add_argument("--gemms", default="gate_up,down")
    p.add_argument("--ops", default="fwd,dgrad")
    p.add_argument("--jobs", type=int, default=8, help="compile worker processes (0: none)")
    p.add_argument("--warm-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm_worker:
        return warm_worker(args.warm_worker)
    if args.ptxas:
        return ptxas_table()
    cpu = args.cpu or not torch.cuda.is_available()
    if not interpreter_matches(cpu, "benchmark.probe_grouped_bf16"):
        return 2
    t0 = time.perf_counter()
    dev = "cpu" if cpu else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references
    layouts = CPU_LAYOUTS if cpu else {k: LAYOUTS[k] for k in args.layouts.split(",")}
    gemms = CPU_GEMMS if cpu else {k: GEMMS[k] for k in args.gemms.split(",")}
    ops = [o for o in args.ops.split(",") if o in OPS]
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; torch {torch.__version__}, triton {triton.__version__}",
          file=sys.stderr, flush=True)
    warm_s = 0.0 if cpu else warm_up(layouts, ops, args.jobs, 0.5 * args.max_seconds)
    rows, datas = [], {}
    for lname, lay in layouts.items():
        for gname, (N, K) in gemms.items():
            d = build_inputs(lay, N, K, dev)
            for op in ops:
                probe_op(op, lname, gname, d, cpu, t0, args.max_seconds, rows)
                datas[(lname, gname, op)] = d
    if not cpu:
        profile_rows(rows, datas, t0, args.max_seconds + 10)
    report = dict(device=dev_name, torch=torch.__version__, triton=triton.__version__,
                  interpreter=cpu, warm_up_s=warm_s, seconds=time.perf_counter() - t0,
                  rows=rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}", file=sys.stderr, flush=True)
    print_table(rows, dev_name)
    print(f"{report['seconds']:.0f} s (compile warm-up {warm_s:.0f} s)")
    return 1 if any(not r["ok"] and not r.get("skipped") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
