"""Probe of the fp32-exact router GEMM (``linghe.router_logits``) forward and backward:
``python -m benchmark.probe_router --out DIR [--cpu] [--quick]``.

At the standard shape (T=8192 tokens, H=2048 hidden, E=256 experts; bf16 ``x``, fp32
weight, fp32 ``dlogits``) it times, as ``_RouterLogits`` calls them:

- ``fwd``: ``logits [T, E] fp32 = x @ w^T``. ``old``: the kernels before the rewrite
  (git ``--old-rev``, default c56431e: swapped 128x128 tiles, 3-way split-K with a
  torch sum); ``new``: :func:`linghe.fwd.router.router_logits_fwd`, the weight's split into
  bf16 parts included (``new gemm``: parts given, the GEMM alone);
- ``bwd``: ``dx [T, H] bf16 = dlogits @ w`` (``DX_ORDER`` 0: one bf16 pass, as before) and
  ``dw [E, H] fp32 = dlogits^T @ x`` (fp32-exact, 3 passes). ``new`` gets the weight's
  parts from the forward (as the autograd Function does); ``new +split w`` splits them
  itself (the ``torch.compile`` custom-op path);
- a sweep of launch configs ``(BM, BN, BK, num_warps, num_stages, split_k)`` per GEMM role
  (``linghe.fwd.router.CONFIG``): ``fwd``, ``dx`` (bwd with ``need_dw=False``), ``dw`` (bwd
  with ``need_dx=False``), each with ``MULTI_ACC`` on (one accumulator per part product,
  where it fits in registers) and off (``1acc``: chained dots); ``*`` marks the default;
  the JSON's config lists end with MULTI_ACC; ``dx order 1/2`` rows time the more exact
  dx variants (``DX_ORDER``);
- the same fwd/bwd with a bf16 weight (old vs new) and ``torch fp32`` (cuBLAS with TF32 off,
  for scale).

Times: ``triton.testing.do_bench_cudagraph`` median (the call captured in a CUDA graph:
host overhead hidden), and the summed kernel time of ``torch.profiler`` per call (``kern``;
what the earlier 70.8 / 257.5 µs numbers were). TFLOP/s counts the useful ``2*T*H*E``
(fwd) or ``4*T*H*E`` (bwd) flops. Every row is checked in the same run against a float64
reference: ``rel`` = ``||out - ref|| / ||ref||``, ``max`` = ``max|out - ref| / max|ref|``;
fp32 outputs must be within the test suite's bound (``3e-6 * K / 256``; Hopper's MMA
accumulation is not IEEE round-to-nearest), bf16 ``dx`` within 1e-2.

``--cpu`` runs tiny shapes through the Triton interpreter (a smoke test of the script, no
timing). A GPU run takes about 3-4 minutes (about 40 kernel variants compile).
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
from linghe.utils import INTERPRET  # noqa: E402

from .harness import load_module_at  # noqa: E402

#: The commit before the router GEMM rewrite (pre-split bf16 parts, one accumulator per
#: part product, split-K only for dw).
OLD_REV = "c56431e"


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
        self.router_logits_bwd = b.router_logits_bwd

# (BM, BN, BK, num_warps, num_stages, split_k)
_SWEEP = {
    "fwd": [(128, 128, 64, 8, 3, 1), (128, 128, 32, 8, 4, 1), (64, 256, 32, 4, 3, 1),
            (64, 256, 32, 8, 3, 1), (128, 256, 32, 8, 3, 1), (128, 256, 32, 8, 3, 2),
            (64, 128, 64, 4, 3, 1), (128, 128, 64, 8, 3, 2)],
    "dx": [(128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 2, 1), (128, 256, 64, 8, 3, 1),
           (128, 128, 64, 4, 3, 1), (64, 128, 64, 4, 4, 1), (256, 128, 64, 8, 2, 1)],
    "dw": [(128, 128, 64, 8, 3, 2), (128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 3, 8),
           (128, 128, 32, 8, 4, 4), (256, 128, 32, 8, 3, 8), (128, 256, 32, 8, 3, 4),
           (128, 256, 32, 8, 3, 8)],
}
_SWEEP_QUICK = {k: v[:2] for k, v in _SWEEP.items()}
_SWEEP_CPU = {"fwd": [(16, 16, 16, 4, 1, 1), (16, 32, 16, 4, 1, 2)],
              "dx": [(16, 16, 16, 4, 1, 1)], "dw": [(16, 32, 16, 4, 1, 3)]}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_router",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for probe_router.json")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="two configs per role, no profiler")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the old kernels")
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
    def __init__(self, cpu: bool, quick: bool):
        self.cpu = cpu
        self.quick = quick
        self.dev = "cpu" if cpu else "cuda"
        self.T, self.H, self.E = (40, 72, 24) if cpu else (8192, 2048, 256)
        g = torch.Generator(device="cpu").manual_seed(0)
        T, H, E = self.T, self.H, self.E
        self.x = torch.randn(T, H, generator=g).to(self.dev, torch.bfloat16)
        self.w = (torch.randn(E, H, generator=g) * 0.02).to(self.dev)
        self.dl = torch.randn(T, E, generator=g).to(self.dev)
        xd, wd, dld = self.x.double(), self.w.double(), self.dl.double()
        self.ref_y = xd @ wd.t()
        self.ref_dx = dld @ wd
        self.ref_dw = dld.t() @ xd
        wb = self.w.to(torch.bfloat16).double()
        self.ref_y_b, self.ref_dx_b = xd @ wb.t(), dld @ wb
        self.tol_fwd = 5e-7 if cpu else 3e-6 * max(1.0, H / 256)
        self.tol_dw = 5e-7 if cpu else 3e-6 * max(1.0, T / 256)
        self.rows: list[dict] = []

    # ------------------------------------------------------------------ timing
    def _time(self, fn) -> tuple[float, float]:
        """(graph median µs, profiler kernel µs per call); NaN on CPU."""
        fn()
        if self.cpu:
            t0 = time.perf_counter()
            fn()
            return float("nan"), (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
        us = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
        kus = float("nan")
        if not self.quick:
            from torch.profiler import ProfilerActivity, profile
            n = 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
            tot = sum(e.device_time_total for e in prof.key_averages()
                      if e.device_time_total > 0 and e.key and not e.key.startswith("cuda"))
            kus = tot / n
        return us, kus

    def add(self, group, name, fn, flops, checks, cfg=None, default=False):
        """``checks``: fn's output -> list of (label, out, ref, tol)."""
        row = {"group": group, "name": name, "config": cfg, "default": default}
        try:
            out = fn()
            errs = {}
            ok = True
            for label, o, ref, tol in checks(out):
                rel, mx = _err(o, ref)
                errs[label] = {"rel": rel, "max": mx, "tol": tol}
                ok &= rel < tol
            us, kus = self._time(fn)
            row.update(ok=bool(ok), us=us, kernel_us=kus, err=errs,
                       tflops=flops / (us * 1e-6) / 1e12 if us == us else float("nan"))
        except Exception as e:  # a config that does not fit (shared memory) or fails
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
        self.rows.append(row)
        print(_fmt(row), flush=True)
        return row

    # ------------------------------------------------------------------ cases
    def run(self, old: _Old):
        T, H, E = self.T, self.H, self.E
        x, w, dl = self.x, self.w, self.dl
        ffl, bfl = 2 * T * H * E, 4 * T * H * E
        fwd_chk = lambda y, ref=self.ref_y: [("y", y, ref, self.tol_fwd)]  # noqa: E731

        def bwd_chk(r, rdx=self.ref_dx):
            out = []
            if r[0] is not None:
                out.append(("dx", r[0], rdx, 1e-2))
            if r[1] is not None:
                out.append(("dw", r[1], self.ref_dw, self.tol_dw))
            return out

        wp = F.weight_parts(w)
        self.add("fwd", "old", lambda: old.router_logits_fwd(x, w), ffl, fwd_chk)
        self.add("fwd", "new", lambda: F.router_logits_fwd(x, w), ffl, fwd_chk)
        self.add("fwd", "new gemm", lambda: F.router_logits_fwd(x, w, wp), ffl, fwd_chk)
        self.add("bwd", "old", lambda: old.router_logits_bwd(dl, x, w), bfl, bwd_chk)
        self.add("bwd", "new", lambda: B.router_logits_bwd(dl, x, w, w_parts=wp), bfl,
                 bwd_chk)
        self.add("bwd", "new +split w", lambda: B.router_logits_bwd(dl, x, w), bfl, bwd_chk)
        if not self.cpu:
            def tf():
                torch.backends.cuda.matmul.allow_tf32 = False
                return torch.nn.functional.linear(x.float(), w)
            self.add("fwd", "torch fp32", tf, ffl, fwd_chk)

        # bf16 weight
        wb = w.to(torch.bfloat16)
        fchk_b = lambda y: [("y", y, self.ref_y_b, self.tol_fwd)]  # noqa: E731

        def bchk_b(r):
            return [("dx", r[0], self.ref_dx_b, 1e-2), ("dw", r[1], self.ref_dw, 1e-2)]
        self.add("fwd bf16 w", "old", lambda: old.router_logits_fwd(x, wb), ffl, fchk_b)
        self.add("fwd bf16 w", "new", lambda: F.router_logits_fwd(x, wb), ffl, fchk_b)
        self.add("bwd bf16 w", "old", lambda: old.router_logits_bwd(dl, x, wb), bfl, bchk_b)
        self.add("bwd bf16 w", "new", lambda: B.router_logits_bwd(dl, x, wb), bfl, bchk_b)

        # config sweep per role
        sweep = _SWEEP_CPU if self.cpu else (_SWEEP_QUICK if self.quick else _SWEEP)
        dev = torch.device(self.dev)
        defaults = {"fwd": F._mm_config(T, E, H, 1, 3, dev),
                    "dx": F._mm_config(T, H, E, 1, 1, dev),
                    "dw": F._mm_config(E, H, T, 3, 1, dev)}
        fns = {"fwd": (lambda: F.router_logits_fwd(x, w, wp), ffl, fwd_chk),
               "dx": (lambda: B.router_logits_bwd(dl, x, w, need_dw=False, w_parts=wp),
                      2 * T * H * E, bwd_chk),
               "dw": (lambda: B.router_logits_bwd(dl, x, w, need_dx=False, w_parts=wp),
                      2 * T * H * E, bwd_chk)}
        for role, cfgs in sweep.items():
            fn, fl, chk = fns[role]
            cfgs = [defaults[role]] + [c for c in cfgs if tuple(c) != tuple(defaults[role])]
            for cfg in cfgs:
                for multi in ((True, False) if role != "dx" else (True,)):
                    F.CONFIG[role] = tuple(cfg)
                    F.MULTI_ACC = multi
                    try:
                        self.add(f"sweep {role}", f"{cfg}{'' if multi else ' 1acc'}", fn,
                                 fl, chk, cfg=list(cfg) + [multi],
                                 default=tuple(cfg) == tuple(defaults[role]) and multi)
                    finally:
                        F.CONFIG[role] = None
                        F.MULTI_ACC = True
        for order in (1, 2):
            saved = B.DX_ORDER
            B.DX_ORDER = order
            try:
                # order 2 is fp32-exact before the bf16 rounding: compare with bf16(ref)
                self.add("dx order", f"order {order}", fns["dx"][0], 2 * T * H * E,
                         lambda r: [("dx", r[0], self.ref_dx.to(torch.bfloat16).double(),
                                     1e-2)])
            finally:
                B.DX_ORDER = saved
        return self.rows

    def report(self):
        dev = "cpu (interpreter)" if self.cpu else torch.cuda.get_device_name()
        best = {}
        for r in self.rows:
            if r["group"].startswith("sweep") and r.get("ok"):
                b = best.get(r["group"])
                if b is None or _key(r) < _key(b):
                    best[r["group"]] = r
        return {"device": dev, "shape": {"T": self.T, "H": self.H, "E": self.E},
                "torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version(), "rows": self.rows,
                "best": {k: {"config": v["config"], "us": _key(v)} for k, v in best.items()}}


def _key(r) -> float:
    return r["us"] if r["us"] == r["us"] else r["kernel_us"]


def _clean(o):
    """NaN -> None (strict JSON)."""
    if isinstance(o, float) and o != o:
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_clean(v) for v in o]
    return o


def _fmt(r) -> str:
    if "error" in r:
        return f"{r['group']:12s} {r['name']:28s} ERROR {r['error']}"
    errs = " ".join(f"{k}:{v['rel']:.1e}/{v['max']:.1e}" for k, v in r["err"].items())
    mark = "*" if r.get("default") else " "
    return (f"{r['group']:12s} {r['name']:27s}{mark} {r['us']:8.1f} {r['kernel_us']:8.1f} "
            f"{r['tflops']:7.1f}  {'ok ' if r['ok'] else 'BAD'} {errs}")


def _table(rows):
    print("\n" + f"{'group':12s} {'variant':28s} {'us':>8s} {'kern us':>8s} {'TFLOP/s':>7s}  "
          "chk err rel/max")
    base = {r["group"]: r for r in rows if r["name"] == "old" and "us" in r}
    for r in rows:
        line = _fmt(r)
        b = base.get(r["group"])
        if b is not None and "us" in r and r is not b:
            key = "kernel_us" if r["kernel_us"] == r["kernel_us"] else "us"
            if b[key] == b[key] and r[key]:
                line += f"  x{b[key] / r[key]:.2f} vs old"
        print(line)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.cpu != INTERPRET:
        print("--cpu needs TRITON_INTERPRET=1 before triton is imported (and a GPU run "
              "needs it unset): run as python -m benchmark.probe_router", file=sys.stderr)
        return 2
    probe = _Probe(args.cpu, args.quick)
    rows = probe.run(_Old(args.old_rev, args.old))
    _table(rows)
    rep = probe.report()
    print("best per role:", json.dumps(_clean(rep["best"])))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "probe_router.json")
        with open(path, "w") as f:
            json.dump(_clean(rep), f, indent=1)
        print(f"wrote {path}", file=sys.stderr)
    bad = [r for r in rows if not r.get("ok") and not r["group"].startswith("sweep")]
    if bad:
        print(f"{len(bad)} row(s) failed: " + ", ".join(f"{r['group']}/{r['name']}"
                                                       for r in bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
