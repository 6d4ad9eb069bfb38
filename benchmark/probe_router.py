"""Probe of the fp32-exact router GEMM (``linghe.router_logits``):
``python -m benchmark.probe_router --json PATH [--cpu] [--full] [--budget S]``.

At the standard shape (T=8192 tokens, K=2048 hidden, E=256 experts; bf16 ``x``, fp32
weight ``w``) it times the forward ``logits [T, E] fp32 = x @ w^T`` as main had it (git
``--old-rev``: the pointer kernel ``_mm_kernel``, 3 bf16 weight parts, 128x128 tiles, one
accumulator per part product) against the TMA kernel ``_logits_kernel`` of
:mod:`linghe.fwd.router` at its default and at other launch configs
(``FWD_TMA_CONFIG``), plus:

- ``gemm`` rows get the weight's bf16 parts (as the autograd Function does: it splits the
  weight once and saves the parts), ``fwd`` rows split the weight too;
- ``ptr ...``: the pointer kernel of this tree (``FWD_TMA=False``) at main's tiles and
  at 256x128 with K split in two (partials summed by a second kernel);
- ``2 parts``: the TMA kernel with the weight's ``hi + mid`` only (16 of fp32's 24
  significand bits: NOT fp32-exact, a rel. error ~2.4e-6 from the dropped part alone);
- ``cublas``: ``torch.mm(..., out_dtype=float32)`` on the parts stacked along N
  (``[T, 3E]``, then the three slices summed, smallest first), the one bf16 pass of the
  hi part (the cuBLAS floor of one pass, not exact), and ``torch fp32`` (TF32 off);
- ``bf16 w``: a bf16 weight (one part), main vs new.

Every row is checked in the same run against a float64 matmul of the same inputs (NaN-
poisoned outputs): ``rel`` = ``||y - ref|| / ||ref||``, ``max`` = ``max|y - ref| /
max|ref|``; ``ok`` = ``rel`` under the test suite's bound (``3e-6 * K / 256`` on a GPU:
Hopper's MMA accumulation is not IEEE round-to-nearest). For scale: main's kernel
measured 2.1e-6, cuBLAS fp32 5.7e-7, TF32 ~3e-4.

Times: ``kern us`` is the profiler's kernel time per call (every kernel the call
launches, after an L2 flush: :func:`benchmark.harness.device_time_us`); ``graph us`` the
median of ``do_bench_cudagraph`` (host hidden, L2 warm). GB/s count the fewest bytes (read
x and w once, write the logits), ``% copy`` is against a measured device copy,
``TFLOP/s`` the useful ``2*T*K*E``. The table is printed last. ``--full`` adds main's
backward against this tree's and the old launch-config sweeps of ``dx``/``dw``.
The kernels are compiled first by ``--jobs`` worker processes (default 8; they fill
Triton's on-disk cache, the timing pass loads the binaries); ``--budget S`` (default 80,
the warm-up included): optional rows are skipped once S seconds have passed. ``--cpu``
runs tiny shapes through the Triton interpreter (a smoke test of this script, no timing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv[1:] or not torch.cuda.is_available()):
    # the interpreter is chosen when a kernel is decorated: before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from linghe.bwd import router as B  # noqa: E402
from linghe.fwd import router as F  # noqa: E402
from linghe.utils import INTERPRET, set_poison_outputs  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    device_time_us,
    graph_time_us,
    load_module_at,
)

#: main before the TMA forward kernel.
OLD_REV = "4c2dfc3"


class _Old:
    """The router GEMM launchers at ``rev`` (the old forward, and the old backward
    importing it)."""

    def __init__(self, rev: str, src_dir: str | None):
        def d(part):
            return os.path.join(src_dir, part) if src_dir else None

        f = load_module_at(rev, "linghe/fwd/router.py", "linghe.fwd._router_old",
                           src_dir=d("fwd"))
        b = load_module_at(rev, "linghe/bwd/router.py", "linghe.bwd._router_old",
                           src_dir=d("bwd"),
                           replace=[("from ..fwd.router import", "from ..fwd._router_old import")])
        self.router_logits_fwd = f.router_logits_fwd
        self.weight_parts = f.weight_parts
        self.router_logits_bwd = b.router_logits_bwd


def _tma(BM, BN, BK, nw, ns, split, nacc, fixup=True, lo_first=False, areg=False):
    return dict(BM=BM, BN=BN, BK=BK, num_warps=nw, num_stages=ns, SPLIT=split, NACC=nacc,
                FIXUP=fixup, LO_FIRST=lo_first, AREG=areg)


def _tma_name(c) -> str:
    s = f"tma {c['BM']}x{c['BN']}x{c['BK']} w{c['num_warps']} s{c['num_stages']}"
    if c["SPLIT"] > 1:
        s += f" k{c['SPLIT']}{'' if c['FIXUP'] else ' sum'}"
    s += f" acc{c['NACC']}"
    return s + (" lo1st" if c.get("LO_FIRST") else "") + (" areg" if c.get("AREG") else "")


#: TMA forward configs, most informative first (the budget may cut the tail). ``lo1st``:
#: the small weight parts over the K chunk first, then the hi part (two loops; one
#: accumulator as accurate as one per part); ``areg``: x through registers.
_TMA_GPU = [
    _tma(256, 128, 64, 8, 2, 2, 1),                    # one loop, 3 chained dots
    _tma(256, 128, 32, 8, 6, 2, 1, lo_first=True),
    _tma(256, 128, 64, 8, 3, 2, 1, lo_first=True, areg=True),
    _tma(128, 128, 64, 8, 3, 1, 3),                    # main's tiles and accumulators
    _tma(128, 128, 64, 8, 4, 1, 1, lo_first=True),
    _tma(128, 256, 64, 8, 2, 2, 1, lo_first=True),
    _tma(256, 128, 64, 16, 3, 2, 1, lo_first=True),
    _tma(256, 128, 64, 8, 3, 2, 1, fixup=False, lo_first=True),
    _tma(256, 128, 32, 8, 4, 2, 1),
    _tma(256, 64, 64, 8, 3, 2, 2),
    _tma(128, 128, 64, 8, 3, 1, 2, areg=True),
]
_TMA_CPU = [_tma(16, 16, 16, 4, 1, 1, 3), _tma(32, 16, 16, 4, 1, 2, 1, lo_first=True),
            _tma(16, 32, 16, 4, 1, 3, 2, fixup=False, areg=True)]
#: pointer-kernel configs ``(BM, BN, BK, num_warps, num_stages, split_k)``
_PTR_GPU = [(256, 128, 64, 8, 2, 2)]
_PTR_CPU = [(32, 16, 16, 4, 1, 2)]

# --full: the backward's launch-config sweep per GEMM role (pointer kernel)
_SWEEP = {
    "dx": [(128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1)],
    "dw": [(128, 128, 64, 8, 3, 4), (128, 256, 32, 8, 3, 8), (256, 128, 32, 8, 3, 8)],
}
_SWEEP_CPU = {"dx": [(16, 16, 16, 4, 1, 1)], "dw": [(16, 32, 16, 4, 1, 3)]}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_router",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--out", default=None, help="directory for probe_router.json (old form)")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--full", action="store_true", help="also the backward and its sweeps")
    p.add_argument("--budget", type=float, default=80.0,
                   help="seconds after which optional rows are skipped")
    p.add_argument("--jobs", type=int, default=None,
                   help="compile warm-up processes before the timing pass (default: 8 on a "
                   "GPU, 0 with --cpu)")
    p.add_argument("--warm-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of main's kernels")
    p.add_argument("--old", default=None, help="directory with the old kernels (fwd's and "
                   "bwd's router.py under fwd/ and bwd/) instead of git (a copy without .git)")
    return p.parse_args(argv)


def _err(out, ref):
    if out is None or ref is None:
        return float("nan"), float("nan")
    d = out.double() - ref
    den = float(ref.norm()) or 1.0
    mx = float(ref.abs().max()) or 1.0
    return float(d.norm()) / den, float(d.abs().max()) / mx


class _Probe:
    def __init__(self, cpu: bool, budget: float, warm: bool = False):
        self.cpu = cpu
        self.warm = warm  # a compile warm-up worker: run each case once, no checks
        self.budget = budget
        self.t0 = time.perf_counter()
        self.dev = "cpu" if cpu else "cuda"
        self.T, self.K, self.E = (40, 72, 24) if cpu else (8192, 2048, 256)
        g = torch.Generator(device="cpu").manual_seed(0)
        T, K, E = self.T, self.K, self.E
        self.x = torch.randn(T, K, generator=g).to(self.dev, torch.bfloat16)
        self.w = (torch.randn(E, K, generator=g) * 0.02).to(self.dev)
        self.dl = torch.randn(T, E, generator=g).to(self.dev)
        self.wb = self.w.to(torch.bfloat16)
        self.ref_y = self.ref_y_b = None
        if not warm:
            xd = self.x.double()
            self.ref_y = xd @ self.w.double().t()
            self.ref_y_b = xd @ self.wb.double().t()
        self.tol = 5e-7 if cpu else 3e-6 * max(1.0, K / 256)
        self.copy = None if cpu or warm else copy_bandwidth_gbps(Config("cuda", quick=False))
        self.case_index = 0
        self.warm_slot: tuple[int, int] | None = None  # (worker, workers)
        self.flops = 2 * T * K * E
        self.rows: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, group, name, fn, ref, *, nbytes, exact=True, default=False, cfg=None,
            optional=True, tol=None):
        """Check ``fn()`` (NaN-poisoned outputs) against ``ref``, then time it. ``exact``:
        held to the fp32-exact bound (else the error is only reported)."""
        i = self.case_index
        self.case_index += 1
        if self.warm:
            if i % self.warm_slot[1] == self.warm_slot[0]:
                try:
                    fn()
                except Exception as e:  # the timing pass reports it
                    print(f"warm-up {group}/{name}: {type(e).__name__}", flush=True)
            return None
        row = {"group": group, "name": name, "config": cfg, "default": default,
               "exact_expected": exact}
        if optional and self.elapsed() > self.budget:
            row.update(ok=None, skipped=f"budget {self.budget:.0f} s")
            self.rows.append(row)
            print(_fmt(row), flush=True)
            return row
        try:
            t = time.perf_counter()
            set_poison_outputs(True)
            try:
                y = fn()
            finally:
                set_poison_outputs(False)
            if not self.cpu:
                torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t
            rel, mx = _err(y, ref)
            tol = self.tol if tol is None else tol
            row.update(rel=rel, max=mx, tol=tol, ok=bool(rel < tol) if exact else None)
            del y
            if self.cpu:
                row.update(kern_us=None, graph_us=None)
            else:
                row["graph_us"] = graph_time_us(fn, rep=100)
                row["kern_us"] = device_time_us(fn, reps=10)
            us = row["kern_us"] or row["graph_us"]
            if us:
                row["gbps"] = nbytes / us / 1e3
                row["pct_copy"] = 100 * row["gbps"] / self.copy if self.copy else None
                row["tflops"] = self.flops / us / 1e6
        except Exception as e:  # a config that does not fit, or a missing torch feature
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                       if str(e) else type(e).__name__)
        self.rows.append(row)
        print(_fmt(row), flush=True)
        return row

    # ------------------------------------------------------------------ cases
    def run(self, old: _Old, full: bool):
        T, K, E = self.T, self.K, self.E
        x, w, wb, ry = self.x, self.w, self.wb, self.ref_y
        nbytes = T * K * 2 + E * K * 4 + T * E * 4
        wp = F.weight_parts(w)
        wp_old = old.weight_parts(w)
        self.add("fwd", "main gemm", lambda: old.router_logits_fwd(x, w, wp_old), ry,
                 nbytes=nbytes, optional=False)
        self.add("fwd", "new gemm", lambda: F.router_logits_fwd(x, w, wp), ry, nbytes=nbytes,
                 default=True, optional=False,
                 cfg=F._logits_config(T, E, K, 3, torch.device(self.dev)))
        self.add("fwd", "main fwd (+split w)", lambda: old.router_logits_fwd(x, w), ry,
                 nbytes=nbytes, optional=False)
        self.add("fwd", "new fwd (+split w)", lambda: F.router_logits_fwd(x, w), ry,
                 nbytes=nbytes, optional=False)
        nb_b = T * K * 2 + E * K * 2 + T * E * 4
        self.add("bf16 w", "main", lambda: old.router_logits_fwd(x, wb), self.ref_y_b,
                 nbytes=nb_b, optional=False)
        self.add("bf16 w", "new", lambda: F.router_logits_fwd(x, wb), self.ref_y_b,
                 nbytes=nb_b, default=True, optional=False)
        if not self.cpu:
            self.add("cublas", "torch fp32 (no TF32)", self._torch_fp32, ry, nbytes=nbytes)
            wcat = wp.reshape(3 * E, K)
            self.add("cublas", "bf16 mm, 3 parts along N + sum", lambda: self._cublas_stack(wcat),
                     ry, nbytes=nbytes)
            self.add("cublas", "bf16 mm, hi part only (floor)",
                     lambda: torch.mm(x, wp[0].t(), out_dtype=torch.float32), ry,
                     nbytes=nbytes, exact=False)

        # the TMA kernel at other configs
        for cfg in _TMA_CPU if self.cpu else _TMA_GPU:
            self.add("tma cfg", _tma_name(cfg), lambda c=cfg: F.logits_tma(x, wp, config=c), ry,
                     nbytes=nbytes, cfg=cfg)
        # 2 weight parts (not fp32-exact): at the default and at 128x128 with 2 accumulators
        wp2 = wp[:2]
        for cfg in (None, _tma(32, 16, 16, 4, 1, 1, 2) if self.cpu
                    else _tma(128, 128, 64, 8, 3, 1, 2)):
            name = "2 parts " + ("default" if cfg is None else _tma_name(cfg))
            self.add("2 parts", name, lambda c=cfg: F.logits_tma(x, wp2, config=c), ry,
                     nbytes=nbytes, exact=False, cfg=cfg)
        # the pointer kernel of this tree (FWD_TMA off)
        for cfg in [None] + (_PTR_CPU if self.cpu else _PTR_GPU):
            name = "ptr " + ("main's tiles" if cfg is None else str(cfg))
            self.add("ptr cfg", name, lambda c=cfg: self._ptr(x, w, wp, c), ry, nbytes=nbytes,
                     cfg=list(cfg) if cfg else None)
        if full:
            self._bwd(old)
        return self.rows

    def _torch_fp32(self):
        allow = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return torch.nn.functional.linear(self.x.float(), self.w)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allow

    def _cublas_stack(self, wcat):
        E = self.E
        y = torch.mm(self.x, wcat.t(), out_dtype=torch.float32)
        return (y[:, 2 * E:] + y[:, E:2 * E]) + y[:, :E]

    @staticmethod
    def _ptr(x, w, wp, cfg):
        saved = F.FWD_TMA, F.CONFIG["fwd"]
        F.FWD_TMA, F.CONFIG["fwd"] = False, (tuple(cfg) if cfg else None)
        try:
            return F.router_logits_fwd(x, w, wp)
        finally:
            F.FWD_TMA, F.CONFIG["fwd"] = saved

    def _bwd(self, old: _Old):
        """main's backward against this tree's (unchanged kernels) and the dx/dw sweeps."""
        T, K, E = self.T, self.K, self.E
        x, w, dl = self.x, self.w, self.dl
        ref_dx = dl.double() @ w.double()
        ref_dw = dl.double().t() @ x.double()  # (small next to the compiles)
        tol_dw = 5e-7 if self.cpu else 3e-6 * max(1.0, T / 256)
        nbytes = T * E * 4 + T * K * 2 + E * K * 4 + T * K * 2 + E * K * 4
        wp = F.weight_parts(w)

        def both(fn):
            def run():
                dx, dw = fn()
                return torch.cat([dx.double().flatten() / float(ref_dx.norm()),
                                  dw.double().flatten() / float(ref_dw.norm())])
            return run
        ref = torch.cat([ref_dx.flatten() / float(ref_dx.norm()),
                         ref_dw.flatten() / float(ref_dw.norm())])
        self.add("bwd", "main", both(lambda: old.router_logits_bwd(dl, x, w)), ref,
                 nbytes=nbytes, tol=1e-2)
        self.add("bwd", "new", both(lambda: B.router_logits_bwd(dl, x, w, w_parts=wp)), ref,
                 nbytes=nbytes, tol=1e-2)
        for role, cfgs in (_SWEEP_CPU if self.cpu else _SWEEP).items():
            for cfg in cfgs:
                if role == "dx":
                    fn, r, tol = (lambda: B.router_logits_bwd(dl, x, w, need_dw=False,
                                                              w_parts=wp)[0]), ref_dx, 1e-2
                else:
                    fn, r, tol = (lambda: B.router_logits_bwd(dl, x, w, need_dx=False,
                                                              w_parts=wp)[1]), ref_dw, tol_dw

                def run(fn=fn, role=role, cfg=cfg):
                    F.CONFIG[role] = tuple(cfg)
                    try:
                        return fn()
                    finally:
                        F.CONFIG[role] = None
                self.add(f"sweep {role}", str(cfg), run, r, nbytes=nbytes, cfg=list(cfg),
                         tol=tol)

    def report(self):
        dev = "cpu (interpreter)" if self.cpu else torch.cuda.get_device_name()
        main_us = next((_us(r) for r in self.rows if r["name"] == "main gemm"), None)
        fast = [r for r in self.rows if r.get("ok") and _us(r) and r["group"] != "bwd"
                and not r["group"].startswith("sweep")]
        best = min(fast, key=_us) if fast else None
        return {"device": dev, "shape": {"T": self.T, "K": self.K, "E": self.E},
                "torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version(), "copy_gbps": self.copy,
                "main_gemm_us": main_us, "rows": self.rows,
                "best_exact": None if best is None else
                {"group": best["group"], "name": best["name"], "config": best["config"],
                 "us": _us(best), "rel": best["rel"]}}


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


def _fmt(r, main_us=None) -> str:
    head = f"{r['group']:8s} {r['name']:40s}{'*' if r.get('default') else ' '}"
    if "skipped" in r:
        return head + f" skipped ({r['skipped']})"
    if "error" in r:
        return head + f" ERROR {r['error']}"
    chk = {True: "ok ", False: "BAD", None: "n/a"}[r["ok"]]
    line = (f"{head} {_f(r.get('kern_us'), '.1f', 7)} {_f(r.get('graph_us'), '.1f', 7)} "
            f"{_f(r.get('gbps'), '.0f', 6)} {_f(r.get('pct_copy'), '.0f', 5)} "
            f"{_f(r.get('tflops'), '.0f', 5)}  {chk} {r['rel']:.1e} {r['max']:.1e}")
    if main_us and _us(r):
        line += f"  x{main_us / _us(r):.2f}"
    return line


def _table(rows):
    main_us = next((_us(r) for r in rows if r["name"] == "main gemm"), None)
    print("\n" + f"{'group':8s} {'variant':41s} {'kern us':>7s} {'graph':>7s} {'GB/s':>6s} "
          f"{'%copy':>5s} {'TF/s':>5s}  chk rel     max      vs main gemm")
    for r in rows:
        print(_fmt(r, main_us))


def _warm_up(jobs: int, args) -> float:
    """Compile every case's kernels in ``jobs`` worker processes first (they fill
    Triton's on-disk cache; the timing pass then loads the binaries): wall seconds."""
    import subprocess

    t0 = time.perf_counter()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    extra = (["--full"] if args.full else []) + (["--cpu"] if args.cpu else []) + [
        "--old-rev", args.old_rev]
    if args.old:
        extra += ["--old", args.old]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmark.probe_router",
                               "--warm-worker", f"{i}/{jobs}"] + extra, cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(jobs)]
    for p in procs:
        try:
            out = p.communicate(timeout=max(1.0, 75 - (time.perf_counter() - t0)))[0]
        except subprocess.TimeoutExpired:
            p.kill()  # ours; the timing pass compiles what is missing itself
            out = p.communicate()[0]
        if p.returncode:
            print(f"warm-up worker exit {p.returncode}: {(out or '')[-800:]}", flush=True)
    secs = time.perf_counter() - t0
    print(f"compile warm-up: {jobs} processes, {secs:.0f} s", file=sys.stderr, flush=True)
    return secs


def main(argv=None) -> int:
    args = _parse(argv)
    if args.cpu != INTERPRET:
        print("--cpu needs TRITON_INTERPRET=1 before triton is imported (and a GPU run "
              "needs it unset): run as python -m benchmark.probe_router", file=sys.stderr)
        return 2
    if args.warm_worker:
        i, n = (int(v) for v in args.warm_worker.split("/"))
        probe = _Probe(args.cpu, 1e9, warm=True)
        probe.warm_slot = (i, n)
        probe.run(_Old(args.old_rev, args.old), args.full)
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
          f"copy {probe.copy or 0:.0f} GB/s; torch {torch.__version__}, triton "
          f"{triton.__version__}", file=sys.stderr, flush=True)
    rows = probe.run(_Old(args.old_rev, args.old), args.full)
    rep = probe.report()
    paths = [args.json] if args.json else []
    if args.out:
        paths.append(os.path.join(args.out, "probe_router.json"))
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(_clean(rep), f, indent=1)
        print(f"wrote {path}", file=sys.stderr)
    print(f"total {probe.elapsed():.0f} s; best fp32-exact: "
          f"{json.dumps(_clean(rep['best_exact']))}")
    _table(rows)
    # wrong results anywhere, or an error in main's / the default rows (a config that
    # does not compile is reported, not failed)
    bad = [r for r in rows if r.get("ok") is False and r.get("exact_expected")
           and r["group"] != "cublas" and ("error" not in r or r["group"] in ("fwd", "bf16 w"))]
    if bad:
        print(f"{len(bad)} row(s) failed: " + ", ".join(f"{r['group']}/{r['name']}"
                                                       for r in bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
