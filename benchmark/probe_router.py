"""Probe of the fp32-exact router GEMM backward (``linghe.router_logits``):
``python -m benchmark.probe_router --json PATH [--old DIR | --old-rev REV] [--cpu]
[--quick] [--budget S]``, or ``--ptxas`` (no GPU: every variant's kernels compiled for
sm_90, registers / spills / shared memory).

At the standard shape (T=8192 tokens, H=2048 hidden, E=256 experts; bf16 ``x``, fp32
weight ``w`` and ``dlogits``) it times ``router_logits_bwd`` as ``_RouterLogits`` calls it
(the weight's bf16 parts from the forward): ``dx [T, H] bf16 = dlogits @ w`` (one bf16
pass, ``DX_ORDER`` 0) and ``dW [E, H] fp32 = dlogits^T @ x`` (fp32-exact: 3 bf16 parts of
dlogits, 3 passes), i.e. 4 x 8.6 = 34.4 GFLOP of bf16 MMA:

- ``main``: main's kernels (``--old DIR``: a folder holding main's ``fwd/router.py`` and
  ``bwd/router.py``; else git ``--old-rev``): split of dlogits, pointer-kernel dx, dW
  with a K split and a sum kernel;
- ``new``: this tree's default (TMA kernels :func:`linghe.bwd.router.dw_tma` /
  :func:`linghe.bwd.router.dx_tma`; ``*`` marks it), then one row per launch config
  (``DW_CONFIG``: tile, warps, stages, ``k<S>`` the token split whose partials a sum
  kernel adds; ``DX_CONFIG``: tile, warps, stages of the persistent, TMA-storing dx);
- ``bf16 w``: a bf16 weight (dW from 2 parts), main vs new.

Per row: ``kern us`` is the profiler's kernel time of one call (each call after an L2
flush; the flush's fill kernel left out), ``graph`` the median of ``do_bench_cudagraph``
(L2 warm), ``TF/s`` the executed bf16 MMA flops (``2*T*H*E`` per pass: 4 passes for an
fp32 weight, 3 for bf16) per kernel µs, then each launch of the call in order with its µs
(and the GEMMs' TFLOP/s). Every row is checked in the same run (NaN-poisoned outputs)
against float64: ``dx`` rel. error (bf16 output, ~3e-3; bound 1e-2) and ``dW`` rel. error
(``||dW - ref|| / ||ref||``; fp32-exact means ~2e-6 on Hopper, bound 1e-5; 1e-4 for the
bf16 weight's 2 parts). The table is printed last.

The kernels are compiled first by ``--jobs`` worker processes (default 8: they fill
Triton's on-disk cache); ``--budget S`` (default 80 s, the warm-up included): variant rows
are skipped once S seconds have passed. ``--cpu`` runs tiny shapes through the Triton
interpreter (a smoke test of this script, no timing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv[1:] or (
        not torch.cuda.is_available() and "--ptxas" not in sys.argv[1:])):
    # the interpreter is chosen when a kernel is decorated: before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from linghe.bwd import router as B  # noqa: E402
from linghe.fwd import router as F  # noqa: E402
from linghe.utils import INTERPRET, set_poison_outputs  # noqa: E402

from .harness import graph_time_us, load_module_at, profile_flushed  # noqa: E402

#: main's kernels when neither ``--old`` nor ``--old-rev`` is given.
OLD_REV = "main"


class _Old:
    """main's router launchers (the old forward, and the old backward importing it)."""

    def __init__(self, rev: str, src_dir: str | None):
        def d(part):
            return os.path.join(src_dir, part) if src_dir else None

        f = load_module_at(rev, "linghe/fwd/router.py", "linghe.fwd._router_old",
                           src_dir=d("fwd"))
        b = load_module_at(rev, "linghe/bwd/router.py", "linghe.bwd._router_old",
                           src_dir=d("bwd"),
                           replace=[("from ..fwd.router import", "from ..fwd._router_old import")])
        self.F, self.B = f, b
        self.weight_parts = f.weight_parts
        self.router_logits_bwd = b.router_logits_bwd


def _dw(BM, BN, BK, nw, ns, split):
    return dict(BM=BM, BN=BN, BK=BK, num_warps=nw, num_stages=ns, SPLIT=split)


def _dx(BM, BN, BK, nw, ns):
    return dict(BM=BM, BN=BN, BK=BK, num_warps=nw, num_stages=ns)


def _dw_name(c) -> str:
    return (f"dw {c['BM']}x{c['BN']}x{c['BK']} w{c['num_warps']} s{c['num_stages']}"
            f" k{c['SPLIT']}")


def _dx_name(c) -> str:
    return f"dx {c['BM']}x{c['BN']}x{c['BK']} w{c['num_warps']} s{c['num_stages']}"


#: Knob rows, most informative first (the budget may cut the tail): ``(name, settings)``,
#: the settings being attributes of :mod:`linghe.bwd.router` for the row (``DW_CONFIG``,
#: ``DX_CONFIG``). The removed forms' rows (one-accumulator dW, the partials summed by
#: the last program or by dx, dx writing the parts, non-persistent / pointer-store dx):
#: ``benchmark/results/h100_probe_router_bwd_2026-11-26_s5.txt``.
_GPU_VARIANTS = [
    # dW: 64x256 tiles (fewer operand bytes than 128x128: 42.3 µs with the last
    # program's sum), BK 32 at 4 stages (41.5 so), a K split of 8 (two waves, 8 partials)
    (None, dict(DW_CONFIG=_dw(64, 256, 64, 8, 3, 4))),
    (None, dict(DW_CONFIG=_dw(128, 128, 32, 8, 4, 4))),
    (None, dict(DW_CONFIG=_dw(128, 128, 64, 8, 3, 8))),
    # dx (persistent, TMA stores): 128x128 at 4 stages (25.5 with pointer stores),
    # 256x128 (28.2 one tile per program), 2 stages (K = 256: 4 K steps per tile)
    (None, dict(DX_CONFIG=_dx(128, 128, 64, 8, 4))),
    (None, dict(DX_CONFIG=_dx(256, 128, 64, 8, 3))),
    (None, dict(DX_CONFIG=_dx(128, 256, 64, 8, 2))),
]
_QUICK = 3  # --quick: the first variants only
_CPU_VARIANTS = [
    (None, dict(DW_CONFIG=_dw(16, 32, 16, 4, 1, 3))),
    (None, dict(DW_CONFIG=_dw(16, 16, 16, 4, 1, 2))),
    (None, dict(DX_CONFIG=_dx(16, 32, 16, 4, 1))),
    (None, dict(DW_CONFIG=_dw(32, 16, 16, 4, 1, 2), DX_CONFIG=_dx(16, 16, 16, 4, 1))),
]


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_router",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--out", default=None, help="directory for probe_router.json (old form)")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help=f"main, default and {_QUICK} variants")
    p.add_argument("--ptxas", action="store_true",
                   help="no GPU: compile every row's kernels for sm_90 and print registers, "
                   "spill bytes and shared memory")
    p.add_argument("--budget", type=float, default=80.0,
                   help="seconds after which variant rows are skipped")
    p.add_argument("--jobs", type=int, default=None,
                   help="compile warm-up processes before the timing pass (default: 8 on a "
                   "GPU, 0 with --cpu)")
    p.add_argument("--warm-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of main's kernels")
    p.add_argument("--old", default=None, metavar="DIR",
                   help="folder with main's fwd/router.py and bwd/router.py (a copy without "
                   ".git) instead of git")
    return p.parse_args(argv)


_KNOBS = ("DW_CONFIG", "DX_CONFIG")


@contextlib.contextmanager
def _knobs(settings: dict | None):
    """:mod:`linghe.bwd.router`'s knobs set to ``settings`` for the block."""
    settings = settings or {}
    bad = set(settings) - set(_KNOBS)
    if bad:
        raise ValueError(f"unknown knobs {sorted(bad)}")
    saved = {k: getattr(B, k) for k in settings}
    try:
        for k, v in settings.items():
            setattr(B, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(B, k, v)


def _label(name, settings, dflt) -> str:
    parts = []
    if "DW_CONFIG" in settings:
        parts.append(_dw_name(dict(dflt["dw"], **settings["DW_CONFIG"])))
    if "DX_CONFIG" in settings:
        parts.append(_dx_name(dict(dflt["dx"], **settings["DX_CONFIG"])))
    if name is None:
        return ", ".join(parts)
    return name + (f" ({', '.join(parts)})" if parts else "")


def _err(out, ref):
    if out is None or ref is None:
        return float("nan"), float("nan")
    d = out.double() - ref
    den = float(ref.norm()) or 1.0
    mx = float(ref.abs().max()) or 1.0
    return float(d.norm()) / den, float(d.abs().max()) / mx


def _is_flush(name: str) -> bool:
    return "fill" in name.lower()


def _kernels(fn, flush, reps: int = 10):
    """``[(kernel name, µs)]`` of one ``fn`` call, in launch order (the profiler over
    ``reps`` calls, each after an L2 flush whose fill kernel is left out by name); kernels
    of the same name summed instead if the per-call lists do not line up."""
    prof = profile_flushed(fn, reps, flush)
    evs = []
    try:
        for e in prof.events():
            if getattr(e.device_type, "name", "") == "CUDA" and not _is_flush(e.name):
                evs.append((e.time_range.start, e.name, e.time_range.elapsed_us()))
    except Exception:
        evs = []
    evs.sort()
    n = len(evs) // reps
    if evs and n * reps == len(evs) and all(evs[i][1] == evs[i % n][1] for i in range(len(evs))):
        return [(evs[i][1], sum(evs[i + j * n][2] for j in range(reps)) / reps)
                for i in range(n)]
    out: dict = {}
    for e in prof.key_averages():
        if e.self_device_time_total > 0 and not _is_flush(e.key):
            out[e.key] = out.get(e.key, 0.0) + e.self_device_time_total / reps
    return list(out.items())


#: bf16 MMA passes of a GEMM kernel (by name; main's ``_mm_kernel`` runs dx first, then dW)
def _passes(name: str, dw_passes: int, mm_seen: int) -> int | None:
    if name == "_dx_kernel" or (name == "_mm_kernel" and mm_seen == 0):
        return 1
    if name in ("_dw_kernel", "_mm_kernel"):
        return dw_passes
    return None


class _Probe:
    def __init__(self, cpu: bool, budget: float, warm: bool = False):
        self.cpu = cpu
        self.warm = warm  # a compile warm-up worker: run each case once, no checks
        self.budget = budget
        self.t0 = time.perf_counter()
        self.dev = "cpu" if cpu else "cuda"
        self.T, self.H, self.E = (40, 72, 24) if cpu else (8192, 2048, 256)
        g = torch.Generator(device="cpu").manual_seed(0)
        T, H, E = self.T, self.H, self.E
        self.x = torch.randn(T, H, generator=g).to(self.dev, torch.bfloat16)
        self.w = (torch.randn(E, H, generator=g) * 0.02).to(self.dev)
        self.dl = torch.randn(T, E, generator=g).to(self.dev)
        self.wb = self.w.to(torch.bfloat16)
        self.ref = {}
        if not warm:
            xd, dld = self.x.double(), self.dl.double()
            self.ref = {"dx": dld @ self.w.double(), "dx_b": dld @ self.wb.double(),
                        "dw": dld.t() @ xd}
        self.flush = None if cpu or warm else torch.empty(256 << 20, dtype=torch.uint8,
                                                          device="cuda")
        self.case_index = 0
        self.warm_slot: tuple[int, int] | None = None  # (worker, workers)
        self.pass_flops = 2 * T * H * E
        self.rows: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, group, name, fn, *, passes, bf16_w=False, default=False, cfg=None,
            optional=True):
        """Check ``fn()`` (-> ``(dx, dw)``; NaN-poisoned outputs) against float64, then
        time it; ``passes``: the bf16 MMA passes it executes."""
        i = self.case_index
        self.case_index += 1
        if self.warm:
            if i % self.warm_slot[1] == self.warm_slot[0]:
                try:
                    fn()
                except Exception as e:  # the timing pass reports it
                    print(f"warm-up {group}/{name}: {type(e).__name__}: {e}"[:300], flush=True)
            return None
        row = {"group": group, "name": name, "config": cfg, "default": default}
        if optional and self.elapsed() > self.budget:
            row.update(ok=None, skipped=f"budget {self.budget:.0f} s")
            self.rows.append(row)
            print(_fmt(row), flush=True)
            return row
        try:
            t = time.perf_counter()
            set_poison_outputs(True)
            try:
                dx, dw = fn()
            finally:
                set_poison_outputs(False)
            if not self.cpu:
                torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t
            dx_rel, dx_max = _err(dx, self.ref["dx_b" if bf16_w else "dx"])
            dw_rel, dw_max = _err(dw, self.ref["dw"])
            dw_tol = 1e-4 if bf16_w else (1e-5 if not self.cpu else 1e-6)
            row.update(dx_rel=dx_rel, dx_max=dx_max, dw_rel=dw_rel, dw_max=dw_max,
                       dw_tol=dw_tol, ok=bool(dx_rel < 1e-2 and dw_rel < dw_tol))
            del dx, dw
            if self.cpu:
                row.update(kern_us=None, graph_us=None, kernels=[])
            else:
                row["graph_us"] = graph_time_us(fn, rep=100)
                ks = _kernels(fn, self.flush)
                row["kernels"] = []
                mm_seen = 0
                for k, us in ks:
                    p = _passes(k, passes - 1, mm_seen)
                    mm_seen += k == "_mm_kernel"
                    row["kernels"].append({"name": k, "us": us, "tflops": (
                        p * self.pass_flops / us / 1e6 if p and us else None)})
                row["kern_us"] = sum(us for _, us in ks)
            us = row["kern_us"] or row["graph_us"]
            if us:
                row["tflops"] = passes * self.pass_flops / us / 1e6
        except Exception as e:  # a config that does not fit, or a bug
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                       if str(e) else type(e).__name__)
        self.rows.append(row)
        print(_fmt(row), flush=True)
        return row

    # ------------------------------------------------------------------ cases
    def run(self, old: _Old | None, quick: bool):
        x, w, dl, wb = self.x, self.w, self.dl, self.wb
        wp = F.weight_parts(w)
        if old is not None:
            wp_old = old.weight_parts(w)
            self.add("bwd", "main", lambda: old.router_logits_bwd(dl, x, w, w_parts=wp_old),
                     passes=4, optional=False)
        else:
            def ptr():
                saved = B.BWD_TMA
                B.BWD_TMA = False
                try:
                    return B.router_logits_bwd(dl, x, w, w_parts=wp)
                finally:
                    B.BWD_TMA = saved
            self.add("bwd", "this tree, BWD_TMA off (main's path)", ptr, passes=4,
                     optional=False)
        dev = torch.device(self.dev)
        dflt = {"dw": B._dw_config(self.E, self.H, self.T, 3, dev),
                "dx": B._dx_config(self.T, self.H, self.E, dev)}
        self.add("bwd", f"new: {_dw_name(dflt['dw'])}, {_dx_name(dflt['dx'])}",
                 lambda: B.router_logits_bwd(dl, x, w, w_parts=wp), passes=4, default=True,
                 optional=False, cfg={"dw": dflt["dw"], "dx": dflt["dx"]})
        variants = _CPU_VARIANTS if self.cpu else _GPU_VARIANTS
        if quick:
            variants = variants[:_QUICK]
        for name, settings in variants:
            def run(settings=settings):
                with _knobs(settings):
                    return B.router_logits_bwd(dl, x, w, w_parts=wp)
            self.add("knob", _label(name, settings, dflt), run, passes=4, cfg=dict(settings))
        # a bf16 weight: dW from 2 parts of dlogits (bf16-level accuracy suffices there)
        wpb = F.weight_parts(wb)
        if old is not None:
            wpb_old = old.weight_parts(wb)
            self.add("bf16 w", "main", lambda: old.router_logits_bwd(dl, x, wb, w_parts=wpb_old),
                     passes=3, bf16_w=True, optional=False)
        self.add("bf16 w", "new", lambda: B.router_logits_bwd(dl, x, wb, w_parts=wpb),
                 passes=3, bf16_w=True, default=True, optional=False)
        return self.rows

    def report(self):
        dev = "cpu (interpreter)" if self.cpu else torch.cuda.get_device_name()
        main_us = next((_us(r) for r in self.rows if r["group"] == "bwd"
                        and r["name"] == "main"), None)
        fast = [r for r in self.rows if r.get("ok") and _us(r) and r["group"] != "bf16 w"]
        best = min(fast, key=_us) if fast else None
        return {"device": dev, "shape": {"T": self.T, "H": self.H, "E": self.E},
                "torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version(), "main_us": main_us, "rows": self.rows,
                "best": None if best is None else
                {"group": best["group"], "name": best["name"], "config": best["config"],
                 "us": _us(best), "dw_rel": best["dw_rel"]}}


def _us(r):
    return r.get("kern_us") or r.get("graph_us")


def _clean(o):
    """NaN -> None (strict JSON)."""
    if isinstance(o, float) and o != o:
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def _f(v, spec, width):
    return f"{v:{width}{spec}}" if isinstance(v, (int, float)) and v == v else f"{'-':>{width}}"


_SHORT = {"_split_kernel": "split", "_mm_kernel": "mm", "_sum_splits_kernel": "sum",
          "_dx_kernel": "dx", "_dw_kernel": "dw"}


def _fmt(r, main_us=None) -> str:
    head = f"{r['group']:6s} {r['name'][:58]:58s}{'*' if r.get('default') else ' '}"
    if "skipped" in r:
        return head + f" skipped ({r['skipped']})"
    if "error" in r:
        return head + f" ERROR {r['error']}"
    chk = {True: "ok ", False: "BAD", None: "n/a"}[r["ok"]]
    line = (f"{head} {_f(r.get('kern_us'), '.1f', 6)} {_f(r.get('graph_us'), '.1f', 6)} "
            f"{_f(r.get('tflops'), '.0f', 4)}  {chk} {r['dx_rel']:.1e} {r['dw_rel']:.1e}")
    if main_us and _us(r):
        line += f"  x{main_us / _us(r):.2f}"
    ks = r.get("kernels") or []
    if ks:
        line += "  | " + " + ".join(
            f"{_SHORT.get(k['name'], k['name'][:16])} {k['us']:.1f}"
            + (f" ({k['tflops']:.0f} TF/s)" if k.get("tflops") else "") for k in ks)
    return line


def _table(rows):
    main_us = next((_us(r) for r in rows if r["group"] == "bwd" and r["name"] == "main"), None)
    print("\n" + f"{'group':6s} {'variant':59s} {'kern':>6s} {'graph':>6s} {'TF/s':>4s}  chk "
          f"dx rel  dw rel   vs main | kernels in launch order (µs)")
    for r in rows:
        print(_fmt(r, main_us if r["group"] != "bf16 w" else None))


def _warm_up(jobs: int, args) -> float:
    """Compile every case's kernels in ``jobs`` worker processes first (they fill
    Triton's on-disk cache; the timing pass then loads the binaries): wall seconds."""
    import subprocess

    t0 = time.perf_counter()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    extra = (["--quick"] if args.quick else []) + ["--old-rev", args.old_rev]
    if args.old:
        extra += ["--old", args.old]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmark.probe_router",
                               "--warm-worker", f"{i}/{jobs}"] + extra, cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(jobs)]
    for p in procs:
        try:
            out = p.communicate(timeout=max(1.0, 60 - (time.perf_counter() - t0)))[0]
        except subprocess.TimeoutExpired:
            p.kill()  # ours; the timing pass compiles what is missing itself
            out = p.communicate()[0]
        if p.returncode:
            print(f"warm-up worker exit {p.returncode}: {(out or '')[-800:]}", flush=True)
        elif out and out.strip():
            print(out.strip()[-800:], flush=True)
    secs = time.perf_counter() - t0
    print(f"compile warm-up: {jobs} processes, {secs:.0f} s", file=sys.stderr, flush=True)
    return secs


def _load_old(args) -> _Old | None:
    try:
        return _Old(args.old_rev, args.old)
    except Exception as e:
        print(f"main's kernels not loaded ({type(e).__name__}: {str(e)[:200]}); pass --old "
              f"DIR (main's fwd/router.py and bwd/router.py under DIR/fwd and DIR/bwd)",
              file=sys.stderr)
        return None


# ------------------------------------------------------------------ offline compile
def ptxas_table(args) -> int:
    """Every row's launches compiled for sm_90 (meta tensors of the standard shape, 132
    SMs): registers, spill bytes, shared memory and the wgmma shapes of each kernel."""
    import re

    from .fp8_gemm_sweep import _ptxas_usage
    from .probe_rope import compile_sm90, recorded_args
    from .probe_tilequant import _record_launches

    if INTERPRET:
        print("--ptxas compiles for sm_90: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    old = _load_old(args)
    T, H, E = 8192, 2048, 256
    meta = torch.device("meta")
    x = torch.empty(T, H, dtype=torch.bfloat16, device=meta)
    dl = torch.empty(T, E, dtype=torch.float32, device=meta)
    cases = []
    for wd in (torch.float32, torch.bfloat16):
        w = torch.empty(E, H, dtype=wd, device=meta)
        wp = torch.empty(3 if wd == torch.float32 else 1, E, H, dtype=torch.bfloat16,
                         device=meta)
        if old is not None:
            cases.append((f"main {'fp32' if wd == torch.float32 else 'bf16'} w", [old.F, old.B],
                          lambda w=w, wp=wp: old.router_logits_bwd(dl, x, w, w_parts=wp),
                          None))
        cases.append((f"new {'fp32' if wd == torch.float32 else 'bf16'} w", [F, B],
                      lambda w=w, wp=wp: B.router_logits_bwd(dl, x, w, w_parts=wp), None))
    w = torch.empty(E, H, dtype=torch.float32, device=meta)
    wp = torch.empty(3, E, H, dtype=torch.bfloat16, device=meta)
    for name, settings in _GPU_VARIANTS:
        cases.append((_label(name, settings, {"dw": {}, "dx": {}}), [F, B],
                      lambda: B.router_logits_bwd(dl, x, w, w_parts=wp), settings))
    print(f"triton {triton.__version__}, sm_90 offline, T={T} H={H} E={E}")
    seen = {}
    mods = [F, B] + ([old.F, old.B] if old is not None else [])
    saved = [(m, m.num_sms) for m in mods if hasattr(m, "num_sms")]
    saved_tma = B.tma_capable
    B.tma_capable = lambda t: True
    for m, _ in saved:
        m.num_sms = lambda d: 132
    B._DW_CFG.clear()
    B._DX_CFG.clear()
    try:
        for label, kmods, fn, knobs in cases:
            with _knobs(knobs):
                try:
                    calls = _record_launches(kmods, fn)
                except Exception as e:
                    print(f"{label:44s} ERROR {type(e).__name__}: {e}"[:300], flush=True)
                    continue
            parts = []
            for kernel, kargs, warps, stages in calls:
                key = (kernel.fn.__name__, id(kernel), warps, stages,
                       repr(sorted((k, v if isinstance(v, (int, bool, str, float)) else
                                    (str(getattr(v, "dtype", "")), tuple(getattr(
                                        v, "block_shape", ()) or ())))
                                   for k, v in kargs.items())))
                if key not in seen:
                    try:
                        c = compile_sm90(kernel, *recorded_args(kernel, kargs), warps, stages)
                        regs, spill = _ptxas_usage(c.asm["ptx"])
                        mma = sorted({m for m in re.findall(r"wgmma\.mma_async\.sync\.aligned"
                                                            r"\.(m64n\d+k16)", c.asm["ptx"])})
                        seen[key] = (f"{_SHORT.get(kernel.fn.__name__, kernel.fn.__name__)}"
                                     f"/{warps}w regs {regs} spill {spill} smem "
                                     f"{c.metadata.shared // 1024}K"
                                     + (f" {','.join(mma)}" if mma else ""))
                    except Exception as e:
                        seen[key] = f"{kernel.fn.__name__}: {type(e).__name__} {e}"[:200]
                parts.append(seen[key])
            print(f"{label[:44]:44s} " + " + ".join(parts), flush=True)
    finally:
        B.tma_capable = saved_tma
        for m, f in saved:
            m.num_sms = f
        B._DW_CFG.clear()
        B._DX_CFG.clear()
    return 0


def main(argv=None) -> int:
    args = _parse(argv)
    if args.ptxas:
        return ptxas_table(args)
    if args.cpu != INTERPRET:
        print("--cpu needs TRITON_INTERPRET=1 before triton is imported (and a GPU run "
              "needs it unset): run as python -m benchmark.probe_router", file=sys.stderr)
        return 2
    if args.warm_worker:
        i, n = (int(v) for v in args.warm_worker.split("/"))
        probe = _Probe(args.cpu, 1e9, warm=True)
        probe.warm_slot = (i, n)
        probe.run(_load_old(args), args.quick)
        if not args.cpu:
            torch.cuda.synchronize()
        return 0
    jobs = args.jobs
    if jobs is None:
        jobs = 0 if args.cpu else min(8, os.cpu_count() or 1)
    warm_s = _warm_up(jobs, args) if jobs > 0 else 0.0
    probe = _Probe(args.cpu, args.budget)
    probe.t0 -= warm_s  # the budget counts the warm-up
    print(f"device: {'cpu (interpreter)' if args.cpu else torch.cuda.get_device_name()}; "
          f"torch {torch.__version__}, triton {triton.__version__}", file=sys.stderr,
          flush=True)
    rows = probe.run(_load_old(args), args.quick)
    rep = probe.report()
    paths = [args.json] if args.json else []
    if args.out:
        paths.append(os.path.join(args.out, "probe_router.json"))
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(_clean(rep), f, indent=1)
        print(f"wrote {path}", file=sys.stderr)
    print(f"total {probe.elapsed():.0f} s; best: {json.dumps(_clean(rep['best']))}")
    _table(rows)
    # wrong results anywhere, or an error in main's / the default rows (a knob config
    # that does not compile is reported, not failed)
    bad = [r for r in rows if r.get("ok") is False and ("error" not in r or r["group"] != "knob")]
    if bad:
        print(f"{len(bad)} row(s) failed: " + ", ".join(f"{r['group']}/{r['name']}"
                                                       for r in bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
