"""Probe of the 1x128 FP8 quantization kernels ``quantize_1x128`` and ``rms_norm_quant``:
``python -m benchmark.probe_tilequant [--json PATH] [--cpu] [--quick] [--old-rev REV |
--old DIR]``, or ``--sass`` (no GPU: an offline sm_90 compile of every variant's kernels,
registers / spills / shared memory / SASS instructions).

At the standard shape (``x [8192, 2048]`` bf16, weight bf16, eps 1e-6) it times, per op,
main's launcher (``old``: git ``--old-rev``, default :data:`OLD_REV`, loaded into
temporary modules, or from ``--old DIR`` holding main's ``quantize.py`` and ``norm.py``)
and the new launchers at several values of their module knobs (``*`` = the defaults):

- ``quantize rc`` / ``rc pow2`` / ``r`` / ``c``:
  :func:`linghe.fp8.quantize.quantize_1x128_launch` with both copies, the rowwise copy,
  the columnwise copy. Knobs: ``TILE_CONFIGS`` entries (tile, warps, tile order
  ``k_fast``; the persistent tile loops of the first H200 run lost and were removed),
  ``ROW_MODE`` /
  ``ROWCOL_MODE`` (the rows kernel; "rows_cols": rows then columnwise tiles, two
  launches; "split": both kinds of programs in one launch), ``ROWS_CONFIG``;
- ``norm_quant rc`` / ``rc pow2`` / ``r``: :func:`linghe.fwd.norm.rms_norm_quant_fwd`.
  Knobs: ``QUANT_MODE`` ("rows_cols": rows kernel with rstd + rowwise copy, then the
  columnwise tiles; "rstd_tiles": rows kernel with rstd only, then tiles writing both
  copies), ``QUANT_ROWS_CONFIG``, ``QUANT_TILE_COLS`` / ``QUANT_TILE_ROWCOL``,
  ``QUANT_TILE_REVERSE``.

Ceilings timed the same way: a device-to-device copy of 1 GiB (``% copy``: an op's GB/s
from the fewest bytes it must move, against that copy) and, per op, a size-matched copy
moving the same number of bytes (``% size``: a uint8 ``copy_`` of half the op's bytes).

Times: ``kernel µs`` is the profiler's kernel time per call, summed over the kernels one
call launches, each call after an L2 flush (as :func:`benchmark.harness.device_time_us`,
the flush kernels left out by name); ``host µs`` (old and default rows of the rc ops) the
launcher's host time behind a GPU spin.

Checks, every row, in the same run: outputs NaN-poisoned before the kernel
(:func:`linghe.utils.set_poison_outputs`); against :mod:`linghe.reference` in float32
(fp8 data more than one e4m3 step off, scales off: exactly for quantize, by more than
1e-5 relative for rms_norm_quant, whose rstd sums in another order; rstd relative error);
against main's kernels (elements that differ, bit for bit).

``--cpu`` runs a small shape through the Triton interpreter (a smoke test of this
script, not a measurement). The table is printed last; ``--json`` gets every row.
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

if __name__ == "__main__" and "--sass" not in sys.argv and (
        "--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402

from linghe import reference as ref  # noqa: E402
from linghe.testing import e4m3_step, rel_err  # noqa: E402
from linghe.utils import INTERPRET, cdiv, set_poison_outputs  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    fmt,
    host_us,
    interpreter_matches,
    load_module_at,
    print_columns,
    profile_flushed,
    size_matched_copy_us,
)

#: main when this probe was written (quantize_1x128: one [128, 128] tile per program;
#: rms_norm_quant: rstd kernel, then [128, 128] tiles quantized both ways).
OLD_REV = "5f8e0f4"
EPS = 1e-6

# --------------------------------------------------------------------------- variants
# A variant is a dict of knob overrides. quantize: "rc" / "r" / "c" (merged into that
# TILE_CONFIGS entry), "rows" (merged into ROWS_CONFIG), "ROW_MODE", "ROWCOL_MODE".
# rms_norm_quant: "rows" (QUANT_ROWS_CONFIG), "cols" (QUANT_TILE_COLS), "rowcol"
# (QUANT_TILE_ROWCOL), "mode" (QUANT_MODE), "reverse" (QUANT_TILE_REVERSE).
R8 = dict(rows=8, elems=16384)  # 8 rows of 2048 per rows-kernel program
QUANT_RC = [
    {"ROWCOL_MODE": "tiles"},
    {"ROWCOL_MODE": "tiles", "rc": dict(k_fast=True)},
    {"ROWCOL_MODE": "tiles", "rc": dict(warps=8)},
    {"ROWCOL_MODE": "rows_cols", "c": dict(k_fast=True)},
    {"ROWCOL_MODE": "rows_cols", "c": dict(bn=64, k_fast=True)},
    {"split": dict(bn=128)},
    {"split": dict(bn=32)},
    {"split": dict(warps=8), "rows": R8},
    {"rows": dict(rows=2)},
]
QUANT_RC_POW2 = [
    {"ROWCOL_MODE": "tiles"},
    {"ROWCOL_MODE": "tiles", "rc": dict(k_fast=True)},
    {"split": dict(bn=128)},
]
QUANT_R = [
    {"r": dict(bm=64)},
    {"r": dict(bm=16, warps=4)},
    {"ROW_MODE": "rows"},
    {"ROW_MODE": "rows", "rows": R8},
    {"ROW_MODE": "rows", "rows": dict(rows=2, warps=4)},
]
QUANT_C = [
    {"c": dict(k_fast=True)},
    {"c": dict(warps=8)},
    {"c": dict(bn=64)},
    {"c": dict(bn=64, k_fast=True)},
    {"c": dict(bn=64, warps=2)},
]
NORM_RC = [
    {"reverse": False},
    {"cols": dict(k_fast=False)},
    {"cols": dict(warps=8)},
    {"cols": dict(bn=64)},
    {"cols": dict(bn=64, warps=2)},
    {"rows": R8},
    {"rows": dict(per_sm=3)},
    {"mode": "rstd_tiles"},
]
NORM_RC_POW2 = [{"cols": dict(bn=64)}, {"mode": "rstd_tiles"}]
NORM_R = [
    {"rows": R8},
    {"rows": dict(rows=2, warps=4)},
    {"rows": dict(warps=4)},
    {"rows": dict(per_sm=3)},
    {"rows": dict(per_sm=2)},
    {"rows": dict(rows=2, warps=4, per_sm=6)},
]
#: Variant rows (not old / default rows) are skipped once the probe has run this long.
MAX_SECONDS = 80.0


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_tilequant",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--cpu", action="store_true", help="small shape, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="old and default rows only")
    p.add_argument("--sass", action="store_true",
                   help="no GPU: compile every variant's kernels for sm_90 and print "
                        "registers, spills, shared memory, SASS instructions")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS,
                   help="skip the remaining variant rows after this many seconds")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of main's kernels")
    p.add_argument("--old", default=None, metavar="DIR",
                   help="directory holding main's quantize.py (linghe/fp8) and norm.py "
                        "(linghe/fwd) instead of git, for a copy of the tree without .git")
    return p.parse_args(argv)


def _load_old(rev, old_dir=None):
    """main's linghe/fp8/quantize.py and linghe/fwd/norm.py (the old norm imports the old
    quantize), from git ``rev`` or from ``old_dir``."""
    q = load_module_at(rev, "linghe/fp8/quantize.py", "linghe.fp8._quantize_old",
                       src_dir=old_dir)
    n = load_module_at(rev, "linghe/fwd/norm.py", "linghe.fwd._norm_old", src_dir=old_dir,
                       replace=[("from ..fp8.quantize import", "from ..fp8._quantize_old import")])
    return q, n


# --------------------------------------------------------------------------- knobs
_NORM_ATTR = {"rows": "QUANT_ROWS_CONFIG", "cols": "QUANT_TILE_COLS",
              "rowcol": "QUANT_TILE_ROWCOL", "mode": "QUANT_MODE",
              "reverse": "QUANT_TILE_REVERSE"}


@contextlib.contextmanager
def _knobs(Q, N, op, kn):
    """Apply the variant ``kn`` of ``op`` ("quantize ..." / "norm_quant ...")."""
    saved = []

    def put(mod, attr, val):
        saved.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, val)

    try:
        for k, v in kn.items():
            if op.startswith("quantize"):
                if k in ("rc", "r", "c", "split"):
                    put(Q, "TILE_CONFIGS", dict(Q.TILE_CONFIGS, **{k: dict(
                        Q.TILE_CONFIGS[k], **v)}))
                elif k == "rows":
                    put(Q, "ROWS_CONFIG", dict(Q.ROWS_CONFIG, **v))
                else:
                    put(Q, k, v)
            else:
                attr = _NORM_ATTR[k]
                cur = getattr(N, attr)
                put(N, attr, dict(cur, **v) if isinstance(cur, dict) else v)
        yield
    finally:
        for mod, attr, val in reversed(saved):
            setattr(mod, attr, val)


def _kn_str(kn, default=False):
    def one(k, v):
        if isinstance(v, dict):
            return f"{k}(" + " ".join(f"{a}={b}" for a, b in v.items()) + ")"
        return f"{k}={v}"
    s = " ".join(one(k, v) for k, v in kn.items()) if kn else "defaults"
    return s + (" *" if default else "")


# --------------------------------------------------------------------------- ops
def _ops(Q, N, oldQ, oldN, x, w, quick):
    """``[(op, old fn, new fn, variants, outputs)]``: the launchers, called with the shape's
    inputs; ``outputs`` names what they return."""
    def qz(mod, row, col, pow2):
        return lambda: mod.quantize_1x128_launch(x, row, col, pow2)

    def nq(mod, col, pow2):
        return lambda: mod.rms_norm_quant_fwd(x, w, EPS, columnwise=col, pow2_scale=pow2)

    ops = [
        ("quantize rc", qz(oldQ, True, True, False), qz(Q, True, True, False), QUANT_RC),
        ("norm_quant rc", nq(oldN, True, False), nq(N, True, False), NORM_RC),
        ("norm_quant r", nq(oldN, False, False), nq(N, False, False), NORM_R),
        ("quantize r", qz(oldQ, True, False, False), qz(Q, True, False, False), QUANT_R),
        ("quantize c", qz(oldQ, False, True, False), qz(Q, False, True, False), QUANT_C),
        ("quantize rc pow2", qz(oldQ, True, True, True), qz(Q, True, True, True),
         QUANT_RC_POW2),
        ("norm_quant rc pow2", nq(oldN, True, True), nq(N, True, True), NORM_RC_POW2),
    ]
    if quick:
        ops = [(o, f_old, f_new, []) for o, f_old, f_new, _ in ops]
    return ops


def _op_bytes(op, M, K):
    """The fewest bytes ``op`` moves: x read once (and the weight), each output written
    once (fp8 data, fp32 scales, rstd)."""
    rows, cols = "r" in op.split()[1], "c" in op.split()[1]
    n = M * K * 2
    if rows:
        n += M * K + M * cdiv(K, 128) * 4
    if cols:
        n += M * K + K * cdiv(M, 128) * 4
    if op.startswith("norm_quant"):
        n += K * 2 + M * 4
    return n


def _reference(op, x, w):
    """``{name: tensor}`` of what ``op`` must return (float32 math on the device)."""
    pow2 = op.endswith("pow2")
    rows, cols = "r" in op.split()[1], "c" in op.split()[1]
    y = x.float()
    out = {}
    if op.startswith("norm_quant"):
        out["rstd"] = torch.rsqrt(y.pow(2).mean(-1) + EPS)
        y = ref.rms_norm_f32(y, w.float(), EPS)
    if rows:
        out["q"], out["s"] = ref.quantize_1x128(y, pow2)
    if cols:
        out["qt"], out["st"] = ref.quantize_1x128_columnwise(y, pow2)
    return out


def _named(op, out):
    names = ("q", "s", "qt", "st", "rstd")
    return {n: t for n, t in zip(names, out) if t is not None}


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _check(got, want, exact_scales):
    """Counts of fp8 elements more than one e4m3 step off (NaN against a number counts),
    scales off, rstd relative error; ``ok``."""
    res = {}
    for n, v in want.items():
        g = got.get(n)
        if g is None or g.shape != v.shape:
            res[n + "_off"] = -1
            continue
        if n in ("q", "qt"):
            a, b = g.float(), v.float()
            one = a.isnan() ^ b.isnan()
            both = a.isnan() & b.isnan()
            res[n + "_off"] = int((one | (~both & ((a - b).abs() > e4m3_step(b)))).sum())
        elif n in ("s", "st"):
            tol = 0.0 if exact_scales else 1e-5
            res[n + "_off"] = int((~((g - v).abs() <= tol * v.abs())).sum())
        else:
            res[n + "_rel_err"] = rel_err(g, v)
    res["ok"] = not any(v for k, v in res.items() if k.endswith("_off")) and \
        res.get("rstd_rel_err", 0.0) <= 1e-5
    return res


def _vs_old(got, old):
    return {n: -1 if got[n].shape != old[n].shape else int((_bits(got[n]) != _bits(old[n])).sum())
            for n in got if n in old}


def _kernel_us(fn, reps=10):
    """Kernel µs per call of ``fn``: the profiler's CUDA kernel time over ``reps`` calls,
    each after an L2 flush whose (fill) kernels are left out by name."""
    prof = profile_flushed(fn, reps, _kernel_us.flush)
    tot = sum(e.self_device_time_total for e in prof.key_averages()
              if getattr(e.device_type, "name", "CUDA") == "CUDA"
              and "FillFunctor" not in e.key)
    return tot / reps


def _copy_row(nbytes, dev):
    """Size-matched copy (read + written = nbytes), timed like the kernels."""
    us = size_matched_copy_us(nbytes, dev, timer=_kernel_us)
    return {"kernel_us": us, "bytes": nbytes, "gbps": nbytes / us / 1e3 if us else None}


# --------------------------------------------------------------------------- the probe
def main(argv=None) -> int:
    args = _parse(argv)
    if args.sass:
        return sass_table(args)
    cpu = args.cpu or not torch.cuda.is_available()
    if not interpreter_matches(cpu, "benchmark.probe_tilequant"):
        return 2
    dev = "cpu" if cpu else "cuda"
    from linghe.fp8 import quantize as Q
    from linghe.fwd import norm as N

    t_start = time.perf_counter()
    try:
        oldQ, oldN = _load_old(args.old_rev, args.old)
    except Exception as e:  # e.g. no .git in a copy of the tree: pass --old DIR
        print(f"main's kernels not loaded ({type(e).__name__}: {e}); pass --old DIR",
              file=sys.stderr)
        return 2
    M, K = (300, 384) if cpu else (8192, 2048)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(M, K, generator=g) * 2).to(dev, torch.bfloat16)
    w = (torch.rand(K, generator=g) + 0.5).to(dev, torch.bfloat16)
    copy = None if cpu else copy_bandwidth_gbps(Config("cuda", quick=False))
    if not cpu:
        _kernel_us.flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; copy {copy or 0:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", file=sys.stderr, flush=True)

    rows, sizes = [], {}
    for op, f_old, f_new, variants in _ops(Q, N, oldQ, oldN, x, w, args.quick):
        nbytes = _op_bytes(op, M, K)
        if not cpu and nbytes not in sizes:
            sizes[nbytes] = _copy_row(nbytes, dev)
        size_gbps = None if cpu else sizes[nbytes]["gbps"]
        want = _reference(op, x, w)
        old_out = None
        host = op.endswith(" rc")
        for impl, kn, fn, default in ([("old", {}, f_old, False), ("new", {}, f_new, True)]
                                      + [("new", v, f_new, False) for v in variants]):
            r = {"op": op, "shape": f"[{M},{K}]", "impl": impl, "knobs": kn,
                 "default": default, "bytes": nbytes, "ok": False, "error": None}
            if kn and not cpu and time.perf_counter() - t_start > args.max_seconds:
                r.update(ok=True, skipped=True)  # over the time budget: not run
                rows.append(r)
                continue
            try:
                with _knobs(Q, N, op, kn):
                    set_poison_outputs(True)  # the checked call only
                    try:
                        got = _named(op, fn())
                        if not cpu:
                            torch.cuda.synchronize()
                    finally:
                        set_poison_outputs(False)
                    r["check"] = _check(got, want, exact_scales=op.startswith("quantize"))
                    r["ok"] = r["check"]["ok"]
                    if impl == "old":
                        old_out = got
                    elif old_out is not None:
                        r["vs_old"] = _vs_old(got, old_out)
                    del got
                    if not cpu:
                        r["kernel_us"] = t = _kernel_us(fn)
                        r["gbps"] = nbytes / t / 1e3 if t else None
                        r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] else None
                        r["pct_size"] = 100 * r["gbps"] / size_gbps if r["gbps"] else None
                        if host and (default or impl == "old"):
                            r["host_us"], r["host_waited"] = host_us(fn)
            except Exception as e:  # one failing row must not stop the probe
                msg = str(e).splitlines()[0][:300] if str(e) else ""
                r["error"] = f"{type(e).__name__}: {msg}"
            print(f"  {op} {impl:<4} {_kn_str(kn, default):<60} kernel "
                  f"{fmt(r.get('kernel_us'), '.1f')} µs {'ok' if r['ok'] else 'FAIL'} "
                  f"{r.get('check', '')} {r['error'] or ''} "
                  f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
            rows.append(r)

    report = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
              "interpreter": cpu, "copy_gbps": copy, "size_matched_copies": sizes,
              "old_rev": None if args.old else args.old_rev, "shape": [M, K], "rows": rows,
              "seconds": time.perf_counter() - t_start}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr, flush=True)
    _print_table(rows, dev_name, copy, sizes)
    return 1 if any(not r["ok"] for r in rows) else 0



def _print_table(rows, dev_name, copy, sizes):
    best = []
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op and r.get("kernel_us")]
        old = [r for r in rs if r["impl"] == "old"]
        new = [r for r in rs if r["impl"] == "new" and r["ok"]]
        dflt = [r for r in new if r["default"]]
        if old and new:
            b = min(new, key=lambda r: r["kernel_us"])
            best.append(f"{op}: old {old[0]['kernel_us']:.1f} µs, default "
                        f"{dflt[0]['kernel_us'] if dflt else float('nan'):.1f}, best "
                        f"{b['kernel_us']:.1f} ({_kn_str(b['knobs'], b['default'])})")
    for line in best:
        print(line)
    head = ["op", "impl", "knobs", "kernel µs", "GB/s", "% copy", "% size", "host µs",
            "vs old (differing)", "check"]
    lines = []
    for r in rows:
        vo = r.get("vs_old")
        vs = "" if vo is None else ("same" if not any(vo.values()) else
                                    " ".join(f"{k}:{v}" for k, v in vo.items() if v))
        c = r.get("check") or {}
        bad = {k: v for k, v in c.items() if k.endswith("_off") and v}
        chk = ("skipped" if r.get("skipped") else "ok" if r["ok"] else "FAIL") + (
            f" {bad}" if bad else "") + (
            f" {r['error'][:60]}" if r["error"] else "")
        lines.append([r["op"], r["impl"], _kn_str(r["knobs"], r["default"]),
                      fmt(r.get("kernel_us"), ".1f"), fmt(r.get("gbps"), ".0f"),
                      fmt(r.get("pct_copy"), ".0f"), fmt(r.get("pct_size"), ".0f"),
                      fmt(r.get("host_us"), ".1f"), vs, chk])
    sz = "; ".join(f"{v['bytes'] / 1e6:.1f} MB {fmt(v['kernel_us'], '.1f')} µs "
                   f"({fmt(v['gbps'], '.0f')} GB/s)" for v in sizes.values())
    print(f"{dev_name}; copy 1 GiB {copy or 0:.0f} GB/s; size-matched copies: {sz or '-'}")
    print("GB/s from the fewest bytes over kernel µs; % copy vs the 1 GiB copy, % size vs "
          "the size-matched copy of the op's bytes")
    print_columns(head, lines)


# --------------------------------------------------------------------------- offline sm_90
def _record_launches(mods, fn):
    """The kernel launches ``fn`` makes through ``linghe.utils.launch`` in ``mods``
    (``[(kernel, args by name, num_warps, num_stages)]``), without running them."""
    calls = []

    def fake(kernel, grid, *a, **kw):
        kw = dict(kw)
        warps = kw.pop("num_warps", 4)
        stages = kw.pop("num_stages", 3)
        names = [p.name for p in kernel.params]
        args = dict(zip(names, a))
        args.update({k: v for k, v in kw.items()})
        calls.append((kernel, args, warps, stages))

    saved = [(m, m.launch) for m in mods]
    try:
        for m in mods:
            m.launch = fake
        fn()
    finally:
        for m, f in saved:
            m.launch = f
    return calls


def sass_table(args) -> int:
    """Offline sm_90 compile of the old and new kernels of every variant (meta tensors
    of the standard shape, so no GPU): registers, spill stack, shared memory, SASS."""
    if INTERPRET:
        print("--sass compiles for sm_90: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    from benchmark.probe_rope import compile_sm90, recorded_args, sass_stats
    from linghe.fp8 import quantize as Q
    from linghe.fwd import norm as N

    oldQ, oldN = _load_old(args.old_rev, args.old)
    M, K = 8192, 2048
    x = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
    w = torch.empty(K, dtype=torch.bfloat16, device="meta")
    print(f"triton {triton.__version__}, sm_90 offline, x [{M},{K}] bf16")
    seen = {}
    for op, f_old, f_new, variants in _ops(Q, N, oldQ, oldN, x, w, args.quick):
        for impl, kn, fn in ([("old", {}, f_old), ("new", {}, f_new)]
                             + [("new", v, f_new) for v in variants]):
            with _knobs(Q, N, op, kn):
                calls = _record_launches([Q, oldQ, N, oldN], fn)
            parts = []
            for kernel, kargs, warps, stages in calls:
                sig, const = recorded_args(kernel, kargs)
                key = (kernel.fn.__name__, id(kernel), tuple(sorted(const.items())),
                       tuple(sorted((k, str(v)) for k, v in sig.items())), warps)
                if key not in seen:
                    try:
                        st = sass_stats(compile_sm90(kernel, sig, const, warps, stages))
                        seen[key] = (f"{kernel.fn.__name__}/{warps}w regs {st['regs']} "
                                     f"stack {st['stack']} smem {st['smem']} "
                                     f"sass {st['sass']}")
                    except Exception as e:
                        seen[key] = f"{kernel.fn.__name__}: {type(e).__name__} {e}"[:200]
                parts.append(seen[key])
            print(f"{op:<18} {impl:<4} {_kn_str(kn):<60} " + " + ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
