"""Probe of the 1x128 FP8 quantizing kernels whose columnwise copy is a transposed store
(``quantize_1x128``, ``rms_norm_quant``, ``silu_mul_quant`` and its quantized-dx
backward): ``python -m benchmark.probe_tilequant [--json PATH] [--cpu] [--quick] [--old DIR
| --old-rev REV]``, or ``--sass`` (no GPU: an offline sm_90 compile of every row's kernels,
registers / spills / shared memory / SASS instructions, with the stores that tell the
transposed store's form: ``STS.U8`` byte stores to shared memory, ``STS``/``LDS``,
``STSM``, 16-byte global stores ``STG.128``).

What changed against main: the columnwise copy leaves as packed words of 4 (or 2) tokens
(``linghe.fp8.quantize.store_cols_packed``; knobs ``quantize.PACK_COLS``,
``activation.QUANT_PACK``) where ``M % 16 == 0``, instead of Triton's byte-wise layout
conversion (8-way bank-conflicted ``STS.U8``). Same bits.

Ops, at the standard shape (``x [8192, 2048]`` bf16; rms_norm weight bf16, eps 1e-6;
SwiGLU ``x [8192, 2048]`` -> ``y [8192, 1024]``, the ``silu_mul_quant`` benchmark case),
both copies:

- ``quantize rc`` / ``rc pow2`` / ``quantize c``: ``quantize_1x128_launch`` (default
  "split" kernel; the columnwise copy alone: the tile kernel);
- ``norm_quant rc`` / ``rc pow2``: ``rms_norm_quant_fwd`` (rows kernel, then columnwise
  tiles with the RMSNorm prologue);
- ``silu_quant rc``: ``silu_mul_quant_fwd`` (non-batch; no probs);
- ``silu_bwd_quant rc``: ``silu_mul_bwd_quant`` (non-batch quantized dx; no probs).

Rows per op: ``old`` (main's files, from ``--old DIR``: a folder holding them as
``linghe/fp8/quantize.py``, ``linghe/fwd/norm.py``, ``linghe/{fwd,bwd}/activation.py``, as
in a copy of main's tree, or the same without ``linghe/``; else git ``--old-rev``), ``new``
at the defaults (``*``), then knob variants round-robin over the ops (module attribute
overrides, the first one the packed store off: main's store in the new code; skipped past
``--max-seconds``).

Checks, every row, in the same run, outputs NaN-poisoned before the checked call (not the
timed ones): against :mod:`linghe.reference` in float32 (fp8 data more than one e4m3 step
off, NaN against a number counts; scales exactly for quantize, else within 1e-5
relative; rstd relative error) and bit for bit against main (``vs old``). Before timing, an
edge pass on odd shapes: ``M`` and ``K`` (``N``) not multiples of 128 with ``M % 16 ==
0`` (packed store with tails; shapes chosen so that the GPU compiles nothing new for it)
and ``M % 16 != 0`` (the fallback to the byte store), against the reference and main.

Times: ``kernel µs`` is the profiler's kernel time per call, summed over the kernels one
call launches, each call after an L2 flush (flush kernels left out by name); ``% copy``:
GB/s from the fewest bytes against a 1 GiB device-to-device copy measured in the run;
``% size``: against a copy of the op's own byte count; ``host µs`` (old and default rows of
``quantize rc`` / ``norm_quant rc``) the launcher's host time behind a GPU spin.

``--cpu`` runs small shapes through the Triton interpreter (a smoke test of this script,
not a measurement). The table is printed last; ``--json`` gets every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import types

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
    host_us,
    load_module_at,
    print_columns,
)

#: main when this probe was last changed (git ``--old-rev`` default).
OLD_REV = "dbf0a24"
EPS = 1e-6

# --------------------------------------------------------------------------- variants
# A variant: module knob overrides, "Q.NAME" (linghe.fp8.quantize), "N.NAME"
# (linghe.fwd.norm), "A.NAME" (linghe.fwd.activation); a dict value is merged into a dict
# knob, "Q.TILE_CONFIGS.split" into one entry of it. The first variant of each op turns
# the packed store off (main's store in the new code).
NOPACK_Q = {"Q.PACK_COLS": False}
NOPACK_A = {"A.QUANT_PACK": False}
QUANT_RC = [
    NOPACK_Q,
    {"Q.ROWCOL_MODE": "tiles"},
    {"Q.TILE_CONFIGS.split": dict(bn=128)},
    {"Q.ROWCOL_MODE": "rows_cols", "Q.TILE_CONFIGS.c": dict(k_fast=True)},
    {"Q.ROWCOL_MODE": "tiles", "Q.TILE_CONFIGS.rc": dict(k_fast=True)},
]
QUANT_RC_POW2 = [{"Q.ROWCOL_MODE": "tiles"}]
QUANT_C = [NOPACK_Q, {"Q.TILE_CONFIGS.c": dict(bn=128)}]
NORM_RC = [
    NOPACK_Q,
    {"N.QUANT_MODE": "rstd_tiles"},
    {"N.QUANT_TILE_COLS": dict(bn=128)},
    {"N.QUANT_MODE": "rstd_tiles", "N.QUANT_TILE_ROWCOL": dict(k_fast=True)},
]
NORM_RC_POW2 = [{"N.QUANT_MODE": "rstd_tiles"}]
SILU_RC = [NOPACK_A, {"A.QUANT_NUM_WARPS": 4}]
SILU_BWD = [NOPACK_A, {"A.QUANT_BWD_NUM_WARPS": 8}]
#: Variant rows (not old / default rows) are skipped once the probe has run this long.
MAX_SECONDS = 70.0


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_tilequant",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--cpu", action="store_true", help="small shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="old and default rows only")
    p.add_argument("--sass", action="store_true",
                   help="no GPU: compile every row's kernels for sm_90 and print registers, "
                        "spills, shared memory, SASS instructions and store counts")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS,
                   help="skip the remaining variant rows after this many seconds")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of main's kernels")
    p.add_argument("--old", default=None, metavar="DIR",
                   help="folder holding main's linghe/fp8/quantize.py, linghe/fwd/norm.py, "
                        "linghe/fwd/activation.py, linghe/bwd/activation.py (a copy of "
                        "main's tree; or without linghe/), instead of git")
    return p.parse_args(argv)


def _old_src(old_dir, sub):
    """The folder under ``old_dir`` holding main's ``sub`` ("fp8/quantize.py", ...)."""
    if old_dir is None:
        return None
    d, base = os.path.split(sub)
    cands = [os.path.join(old_dir, "linghe", d), os.path.join(old_dir, d)]
    if base != "activation.py":  # (fwd/ and bwd/ both have one: no flat layout)
        cands.append(old_dir)
    for cand in cands:
        if os.path.isfile(os.path.join(cand, base)):
            return cand
    raise FileNotFoundError(f"{sub} not in {old_dir} (as linghe/{sub} or {sub})")


def _load_old(rev, old_dir=None):
    """main's quantize, norm and activation (fwd, bwd) modules, each importing main's
    others, from git ``rev`` or from ``old_dir``."""
    def load(sub, name, replace=()):
        return load_module_at(rev, "linghe/" + sub, name, src_dir=_old_src(old_dir, sub),
                              replace=replace)

    q_imp = ("from ..fp8.quantize import", "from ..fp8._quantize_old import")
    Q = load("fp8/quantize.py", "linghe.fp8._quantize_old")
    N = load("fwd/norm.py", "linghe.fwd._norm_old", [q_imp])
    A = load("fwd/activation.py", "linghe.fwd._activation_old", [q_imp])
    B = load("bwd/activation.py", "linghe.bwd._activation_old", [
        q_imp, ("from ..fwd import activation as _fwd",
                "from ..fwd import _activation_old as _fwd"),
        ("from ..fwd.activation import", "from ..fwd._activation_old import")])
    return types.SimpleNamespace(Q=Q, N=N, A=A, B=B)


def _new_mods():
    from linghe.bwd import activation as B
    from linghe.fp8 import quantize as Q
    from linghe.fwd import activation as A
    from linghe.fwd import norm as N
    return types.SimpleNamespace(Q=Q, N=N, A=A, B=B)


# --------------------------------------------------------------------------- knobs
@contextlib.contextmanager
def _knobs(mods, kn):
    """Apply the variant ``kn`` to the modules ``mods`` (restored on exit)."""
    saved = []
    try:
        for key, v in kn.items():
            parts = key.split(".")
            mod, attr = getattr(mods, parts[0]), parts[1]
            cur = getattr(mod, attr)
            if len(parts) == 3:
                val = dict(cur, **{parts[2]: dict(cur[parts[2]], **v)})
            elif isinstance(cur, dict) and isinstance(v, dict):
                val = dict(cur, **v)
            else:
                val = v
            saved.append((mod, attr, cur))
            setattr(mod, attr, val)
        yield
    finally:
        for mod, attr, val in reversed(saved):
            setattr(mod, attr, val)


def _kn_str(kn, default=False):
    def one(k, v):
        k = k.split(".", 1)[1]
        if isinstance(v, dict):
            return f"{k}(" + " ".join(f"{a}={b}" for a, b in v.items()) + ")"
        return f"{k}={v}"
    s = " ".join(one(k, v) for k, v in kn.items()) if kn else "defaults"
    return s + (" *" if default else "")


# --------------------------------------------------------------------------- ops
OPS = ["quantize rc", "norm_quant rc", "silu_quant rc", "silu_bwd_quant rc", "quantize c",
       "quantize rc pow2", "norm_quant rc pow2"]
_VARIANTS = {"quantize rc": QUANT_RC, "quantize rc pow2": QUANT_RC_POW2,
             "quantize c": QUANT_C, "norm_quant rc": NORM_RC,
             "norm_quant rc pow2": NORM_RC_POW2, "silu_quant rc": SILU_RC,
             "silu_bwd_quant rc": SILU_BWD}


def _family(op):
    return op.split()[0]


def _inputs(op, M, K, dev):
    """The op's inputs at ``[M, K]`` (SwiGLU: ``x [M, K]``, ``y`` and ``dy [M, K // 2]``)."""
    g = torch.Generator(device="cpu").manual_seed(M * 7919 + K)
    x = (torch.randn(M, K, generator=g) * 2).to(dev, torch.bfloat16)
    if _family(op) == "norm_quant":
        return x, (torch.rand(K, generator=g) + 0.5).to(dev, torch.bfloat16)
    if _family(op) == "silu_bwd_quant":
        return x, torch.randn(M, K // 2, generator=g).to(dev, torch.bfloat16)
    return x, None


def _call(op, mods, x, extra):
    """The op's launcher in ``mods`` (old or new): ``(q, s, qt, st[, rstd])``."""
    pow2 = op.endswith("pow2")
    fam = _family(op)
    if fam == "quantize":
        return mods.Q.quantize_1x128_launch(x, "r" in op.split()[1], True, pow2)
    if fam == "norm_quant":
        return mods.N.rms_norm_quant_fwd(x, extra, EPS, columnwise=True, pow2_scale=pow2)
    if fam == "silu_quant":
        return mods.A.silu_mul_quant_fwd(x, None, columnwise=True, pow2_scale=pow2)
    dx, _ = mods.B.silu_mul_bwd_quant(extra, x, None, columnwise=True, pow2_scale=pow2,
                                      need_dprobs=False)
    return dx.rowwise_data, dx.rowwise_scale, dx.columnwise_data, dx.columnwise_scale


def _op_bytes(op, M, K):
    """The fewest bytes ``op`` moves: inputs read once (and the weight), each output
    written once (fp8 data, fp32 scales, rstd)."""
    fam = _family(op)
    n = M * K * 2
    rows = "r" in op.split()[1]
    Ko = K // 2 if fam == "silu_quant" else K
    if fam == "silu_bwd_quant":
        n += M * (K // 2) * 2  # dy
    if rows:
        n += M * Ko + M * cdiv(Ko, 128) * 4
    n += M * Ko + Ko * cdiv(M, 128) * 4
    if fam == "norm_quant":
        n += K * 2 + M * 4
    return n


def _reference(op, x, extra):
    """``{name: tensor}`` of what ``op`` must return (float32 math on the device)."""
    pow2 = op.endswith("pow2")
    fam = _family(op)
    y = x.float()
    out = {}
    if fam == "norm_quant":
        out["rstd"] = torch.rsqrt(y.pow(2).mean(-1) + EPS)
        y = ref.rms_norm_f32(y, extra.float(), EPS)
    elif fam == "silu_quant":
        y = ref.silu_mul(y)
    elif fam == "silu_bwd_quant":
        n = y.shape[1] // 2
        g, u, dy = y[:, :n], y[:, n:], extra.float()
        sg = torch.sigmoid(g)
        y = torch.cat([dy * u * (sg * (1.0 + g * (1.0 - sg))), dy * g * sg], 1)
    if "r" in op.split()[1]:
        out["q"], out["s"] = ref.quantize_1x128(y, pow2)
    out["qt"], out["st"] = ref.quantize_1x128_columnwise(y, pow2)
    return out


def _named(out):
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


def _run_checked(op, mods, x, extra, cpu):
    set_poison_outputs(True)  # the checked call only
    try:
        got = _named(_call(op, mods, x, extra))
        if not cpu:
            torch.cuda.synchronize()
    finally:
        set_poison_outputs(False)
    return got


def _kernel_us(fn, reps=10):
    """Kernel µs per call of ``fn``: the profiler's CUDA kernel time over ``reps`` calls,
    each after an L2 flush whose (fill) kernels are left out by name."""
    from torch.profiler import ProfilerActivity, profile

    flush = _kernel_us.flush
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    tot = sum(e.self_device_time_total for e in prof.key_averages()
              if getattr(e.device_type, "name", "CUDA") == "CUDA"
              and "FillFunctor" not in e.key)
    return tot / reps


def _copy_row(nbytes, dev):
    """Size-matched copy: a uint8 ``copy_`` of ``nbytes / 2`` (read + written = nbytes)."""
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = _kernel_us(lambda: dst.copy_(src))
    return {"kernel_us": us, "bytes": nbytes, "gbps": nbytes / us / 1e3 if us else None}


# --------------------------------------------------------------------------- edge pass
def _edge_shapes(cpu):
    """``[(M, K, packed)]``: tails in both dims with ``M % 16 == 0`` (the packed store),
    then ``M % 16 != 0`` (the byte store). On the GPU the packed shape keeps every
    integer argument's divisibility by 16 that the timed shape has (``M``, ``K``, the
    scale strides ``cdiv(M, 128)``, ``cdiv(K, 128)``), so it compiles nothing new."""
    if cpu:
        return [(144, 208, True), (142, 208, False)]
    return [(2032, 2000, True), (2030, 2000, False)]


def _edge_pass(new, old, dev, cpu):
    """Old and default rows of every op on the edge shapes: ``[row]`` (``ok``: against
    the reference and bit for bit against main)."""
    rows = []
    for M, K, packed in _edge_shapes(cpu):
        for op in OPS:
            if op.endswith("pow2") or (not packed and op == "quantize c"):
                continue  # (the same code as their exact / rc forms)
            Ke = K + 16 if _family(op).startswith("silu") else K  # (N = K/2 % 16 == 0)
            x, extra = _inputs(op, M, Ke, dev)
            want = _reference(op, x, extra)
            r = {"op": op, "shape": f"[{M},{Ke}]", "packed": packed, "ok": False,
                 "error": None}
            try:
                got_old = _run_checked(op, old, x, extra, cpu)
                got = _run_checked(op, new, x, extra, cpu)
                r["check"] = _check(got, want, exact_scales=_family(op) == "quantize")
                r["check_old"] = _check(got_old, want,
                                        exact_scales=_family(op) == "quantize")
                r["vs_old"] = _vs_old(got, got_old)
                r["ok"] = r["check"]["ok"] and not any(r["vs_old"].values())
            except Exception as e:  # reported, and the probe exits 1
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"  edge {op} [{M},{Ke}] {'packed' if packed else 'byte store'}: "
                  f"{'ok' if r['ok'] else 'FAIL'} {r.get('vs_old', '')} {r['error'] or ''}",
                  file=sys.stderr, flush=True)
            rows.append(r)
    return rows


# --------------------------------------------------------------------------- the probe
def main(argv=None) -> int:
    args = _parse(argv)
    if args.sass:
        return sass_table(args)
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu != INTERPRET:
        print("--cpu needs TRITON_INTERPRET=1 before triton is imported: run it as its own "
              "process (python -m benchmark.probe_tilequant --cpu)", file=sys.stderr)
        return 2
    dev = "cpu" if cpu else "cuda"
    new = _new_mods()
    t_start = time.perf_counter()
    try:
        old = _load_old(args.old_rev, args.old)
    except Exception as e:  # e.g. no .git in a copy of the tree: pass --old DIR
        print(f"main's kernels not loaded ({type(e).__name__}: {e}); pass --old DIR",
              file=sys.stderr)
        return 2
    M, K = (272, 384) if cpu else (8192, 2048)
    copy = None if cpu else copy_bandwidth_gbps(Config("cuda", quick=False))
    if not cpu:
        _kernel_us.flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; copy {copy or 0:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", file=sys.stderr, flush=True)

    edges = _edge_pass(new, old, dev, cpu)
    # Old and default rows of every op first, then the variants round-robin over the ops
    # (the first variant of each op, then the second, ...) until the time budget.
    state, sizes = {}, {}
    for op in OPS:
        x, extra = _inputs(op, M, K, dev)
        nbytes = _op_bytes(op, M, K)
        if not cpu and nbytes not in sizes:
            sizes[nbytes] = _copy_row(nbytes, dev)
        state[op] = dict(x=x, extra=extra, nbytes=nbytes, want=_reference(op, x, extra),
                         size_gbps=None if cpu else sizes[nbytes]["gbps"], old_out=None)
    jobs = [(op, impl, {}, impl == "new") for op in OPS for impl in ("old", "new")]
    nvar = 0 if args.quick else max(len(_VARIANTS[op]) for op in OPS)
    jobs += [(op, "new", _VARIANTS[op][i], False) for i in range(nvar) for op in OPS
             if i < len(_VARIANTS[op])]
    rows = []
    for op, impl, kn, default in jobs:
        st = state[op]
        mods = old if impl == "old" else new
        r = {"op": op, "shape": f"[{M},{K}]", "impl": impl,
             "knobs": {k: v for k, v in kn.items()}, "default": default,
             "bytes": st["nbytes"], "ok": False, "error": None}
        if kn and not cpu and time.perf_counter() - t_start > args.max_seconds:
            r.update(ok=True, skipped=True)  # over the time budget: not run
            rows.append(r)
            continue
        try:
            with _knobs(mods, kn):
                got = _run_checked(op, mods, st["x"], st["extra"], cpu)
                r["check"] = _check(got, st["want"], exact_scales=_family(op) == "quantize")
                r["ok"] = r["check"]["ok"]
                if impl == "old":
                    st["old_out"] = got
                elif st["old_out"] is not None:
                    r["vs_old"] = _vs_old(got, st["old_out"])
                del got
                if not cpu:
                    def fn(mods=mods, op=op, x=st["x"], extra=st["extra"]):
                        return _call(op, mods, x, extra)
                    r["kernel_us"] = t = _kernel_us(fn)
                    r["gbps"] = st["nbytes"] / t / 1e3 if t else None
                    r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] else None
                    r["pct_size"] = 100 * r["gbps"] / st["size_gbps"] if r["gbps"] else None
                    if op in ("quantize rc", "norm_quant rc") and not kn:
                        r["host_us"], r["host_waited"] = host_us(fn)
        except Exception as e:  # one failing row must not stop the probe
            msg = str(e).splitlines()[0][:300] if str(e) else ""
            r["error"] = f"{type(e).__name__}: {msg}"
        print(f"  {op} {impl:<4} {_kn_str(kn, default):<50} kernel "
              f"{_f(r.get('kernel_us'), '.1f')} µs {'ok' if r['ok'] else 'FAIL'} "
              f"{r.get('check', '')} {r.get('vs_old', '')} {r['error'] or ''} "
              f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        rows.append(r)
    rows.sort(key=lambda r: OPS.index(r["op"]))  # (stable: old, default, variants)

    report = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
              "interpreter": cpu, "copy_gbps": copy, "size_matched_copies": sizes,
              "old_rev": None if args.old else args.old_rev, "shape": [M, K], "rows": rows,
              "edge_rows": edges, "seconds": time.perf_counter() - t_start}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr, flush=True)
    _print_table(rows, edges, dev_name, copy, sizes, report["seconds"])
    bad = [r for r in rows if not r["ok"]] + [r for r in edges if not r["ok"]]
    # (main bit for bit: a default row that differs from main fails the probe too)
    bad += [r for r in rows if r.get("vs_old") and any(r["vs_old"].values())]
    return 1 if bad else 0


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def _print_table(rows, edges, dev_name, copy, sizes, seconds):
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op and r.get("kernel_us")]
        old = [r for r in rs if r["impl"] == "old"]
        new = [r for r in rs if r["impl"] == "new" and r["ok"]]
        dflt = [r for r in new if r["default"]]
        if old and new:
            b = min(new, key=lambda r: r["kernel_us"])
            print(f"{op}: old {old[0]['kernel_us']:.1f} µs, default "
                  f"{dflt[0]['kernel_us'] if dflt else float('nan'):.1f}, best "
                  f"{b['kernel_us']:.1f} ({_kn_str(b['knobs'], b['default'])})")
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
                      _f(r.get("kernel_us"), ".1f"), _f(r.get("gbps"), ".0f"),
                      _f(r.get("pct_copy"), ".0f"), _f(r.get("pct_size"), ".0f"),
                      _f(r.get("host_us"), ".1f"), vs, chk])
    sz = "; ".join(f"{v['bytes'] / 1e6:.1f} MB {_f(v['kernel_us'], '.1f')} µs "
                   f"({_f(v['gbps'], '.0f')} GB/s)" for v in sizes.values())
    bad_edges = [f"{r['op']} {r['shape']}" for r in edges if not r["ok"]]
    print(f"{dev_name}; copy 1 GiB {copy or 0:.0f} GB/s; size-matched copies: {sz or '-'}; "
          f"edge shapes (packed with tails, byte-store fallback) vs reference and main: "
          f"{'ok' if not bad_edges else 'FAILED ' + ', '.join(bad_edges)}; {seconds:.0f} s")
    print("GB/s from the fewest bytes over kernel µs; % copy vs the 1 GiB copy, % size vs "
          "the size-matched copy of the op's bytes")
    print_columns(head, lines)


# --------------------------------------------------------------------------- offline sm_90
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                 torch.float8_e4m3fn: "fp8e4nv", torch.int16: "i16", torch.int32: "i32",
                 torch.int64: "i64"}
#: SASS instructions counted by ``--sass`` (regular expressions).
_SASS_COUNTS = {"STS.U8": r"STS\.U8$", "STS": r"STS(\.|$)", "LDS": r"LDS(\.|$)",
                "STSM": r"STSM(\.|$)", "LDSM": r"LDSM(\.|$)", "STG.128": r"STG\.E\.128$",
                "STG.U8": r"STG\.E\.U8$", "BAR": r"BAR(\.|$)"}


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


def sass_counts(compiled) -> dict:
    """:func:`benchmark.probe_rope.sass_stats` of a compiled kernel plus the counts of
    :data:`_SASS_COUNTS` in its SASS."""
    import re
    import subprocess
    import tempfile

    from benchmark.probe_rope import sass_stats

    st = sass_stats(compiled)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as fh:
        fh.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", fh.name],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(fh.name)
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    for name, pat in _SASS_COUNTS.items():
        st[name] = sum(1 for i in ins if re.match(pat, i))
    return st


def sass_table(args) -> int:
    """Offline sm_90 compile of the old and new kernels of every row (meta tensors of the
    standard shape, so no GPU): registers, spill stack, shared memory, SASS counts."""
    if INTERPRET:
        print("--sass compiles for sm_90: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    from benchmark.probe_rope import compile_sm90

    new = _new_mods()
    old = _load_old(args.old_rev, args.old)
    M, K = 8192, 2048
    print(f"triton {triton.__version__}, sm_90 offline, x [{M},{K}] bf16; per kernel: "
          "regs, stack bytes, smem, SASS instructions, " + ", ".join(_SASS_COUNTS))
    seen = {}
    all_mods = [old.Q, old.N, old.A, old.B, new.Q, new.N, new.A, new.B]
    for op in OPS:
        x = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
        extra = {"norm_quant": torch.empty(K, dtype=torch.bfloat16, device="meta"),
                 "silu_bwd_quant": torch.empty(M, K // 2, dtype=torch.bfloat16,
                                               device="meta")}.get(_family(op))
        variants = [] if args.quick else _VARIANTS[op]
        for impl, kn in [("old", {}), ("new", {})] + [("new", v) for v in variants]:
            mods = old if impl == "old" else new
            with _knobs(mods, kn):
                try:
                    calls = _record_launches(all_mods, lambda o=op, m=mods, a=x, e=extra:
                                             _call(o, m, a, e))
                except Exception as e:
                    print(f"{op:<18} {impl:<4} {_kn_str(kn):<45} {type(e).__name__}: {e}")
                    continue
            parts = []
            for kernel, kargs, warps, stages in calls:
                sig, const = {}, {}
                for p in kernel.params:
                    v = kargs.get(p.name, p.default if hasattr(p, "default") else None)
                    if p.is_constexpr:
                        const[p.name] = v
                    elif isinstance(v, torch.Tensor):
                        sig[p.name] = _TRITON_TYPES[v.dtype]
                    else:
                        sig[p.name] = v
                key = (kernel.fn.__name__, id(kernel), tuple(sorted(const.items())),
                       tuple(sorted((k, str(v)) for k, v in sig.items())), warps)
                if key not in seen:
                    try:
                        st = sass_counts(compile_sm90(kernel, sig, const, warps, stages))
                        seen[key] = (f"{kernel.fn.__name__}/{warps}w regs {st['regs']} "
                                     f"stack {st['stack']} smem {st['smem']} "
                                     f"sass {st['sass']} " + " ".join(
                                         f"{n} {st[n]}" for n in _SASS_COUNTS))
                    except Exception as e:
                        seen[key] = f"{kernel.fn.__name__}: {type(e).__name__} {e}"[:200]
                parts.append(seen[key])
            print(f"{op:<18} {impl:<4} {_kn_str(kn):<45} " + " + ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
