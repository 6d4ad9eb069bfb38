"""Probe of the ``qk_norm_rope`` kernels (split + qk-norm + half RoPE + transpose):
``python -m benchmark.probe_rope [--json PATH | --out DIR] [--cpu] [--quick]
[--old-rev REV | --old DIR]`` (GPU, or ``--cpu``: the interpreter), or ``python -m
benchmark.probe_rope --sass`` (no GPU: an offline sm_90 compile of every variant,
registers / spills / shared memory / SASS instructions per token).

At the standard shape (seq 4096 x batch 2, 16 q / 4 kv heads, head_dim 128, rotary_dim
64, bf16 qk-norm weights, layout "sbh", Megatron-interleaved qkv, bf16) it times the
forward and backward launchers of :mod:`linghe.fwd.rope` / :mod:`linghe.bwd.rope` against
main's (the "main" rows: ``--old DIR``, a folder holding main's ``linghe/fwd/rope.py`` and
``linghe/bwd/rope.py`` as ``DIR/fwd/rope.py`` and ``DIR/bwd/rope.py`` (or under
``DIR/linghe/``), for a copy of the tree without git; else git ``--old-rev``, default
:data:`OLD_REV`) and, for the new kernels, the knobs worth trying (rows marked ``*`` are
the defaults): ``FWD_TOKENS`` / ``FWD_NUM_WARPS``, ``BWD_STAGES`` / ``BWD_TOKENS`` /
``BWD_NUM_WARPS``, ``ROW_ORDER`` (token blocks in the "sbh" projection's row order, or
the output order), ``COS_SIN_APPROX`` and the weight-gradient reduction's ``DW_BLOCK_P``
/ ``DW_BLOCK_N``. Variant rows are skipped once the run passes ``--max-seconds`` (default
70).

Times per call: ``kernel µs`` is the profiler's kernel time (sum of the kernels one call
launches, each call after an L2 flush: the number the benchmark reports), ``graph µs``
(main and default rows) the median of ``triton.testing.do_bench_cudagraph``, ``host µs``
(main and default rows) the launcher's host time per call behind a GPU spin. GB/s count
the fewest bytes (forward: read qkv, write q/k/v; backward: read dq/dk/dv and the q/k part
of qkv, write dqkv; plus the angle table), ``% copy`` is against a 1 GiB device-to-device
copy, ``% size`` against a copy of the same number of bytes (a uint8 ``copy_`` of half
of them: what moving that many bytes costs at this size).

Checks, in the same run: every output of every row against main's kernels (elements that
differ, max abs difference) and against :func:`linghe.reference.qk_norm_rope` in float32
(forward outputs, and dqkv/dweights by autograd through the reference); outputs are
NaN-poisoned before each checked launch (``linghe.utils.set_poison_outputs``), so an
unwritten element fails.

``--cpu`` runs tiny shapes through the Triton interpreter (a smoke test of this script,
not a measurement). The table is printed last.
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
    # The interpreter is chosen when a kernel is decorated: before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

import linghe  # noqa: E402
from linghe import reference as ref  # noqa: E402
from linghe.testing import rel_err  # noqa: E402
from linghe.utils import INTERPRET, set_poison_outputs  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    device_time_us,
    fmt,
    graph_time_us,
    host_us,
    interpreter_matches,
    load_module_at,
    print_columns,
    profile_flushed,
    size_matched_copy_us,
)

#: main when this probe was extended (the 3-D [heads, tokens, pieces] tiles with the chunk
#: bit on lanes, MUFU cos/sin, the 3-stage backward loop: H200 fwd 29.4 µs, bwd 44.2).
OLD_REV = "8ff0efd"

# Knob sets, each applied over the defaults. Forward: tokens, warps, approx, row
# (ROW_ORDER). Backward: tokens, warps, stages, approx, row, dw (DW_BLOCK_P, DW_BLOCK_N).
# In order of interest (the probe alternates forward and backward rows): the time
# budget may cut the tail.
_FWD_KNOBS = [dict(row=False), dict(warps=2), dict(tokens=2)]
_BWD_KNOBS = [dict(row=False), dict(prefetch=False), dict(stages=1), dict(stages=4),
              dict(stages=2), dict(warps=8, stages=2), dict(dw=(1024, 4))]
_CPU_FWD_KNOBS = [dict(row=False), dict(tokens=2, approx=False)]
_CPU_BWD_KNOBS = [dict(stages=1), dict(prefetch=False), dict(row=False),
                  dict(tokens=2, stages=2, approx=False)]
_TOL = 1e-2  # bf16 vs the float32 reference (relative error)
#: Variant rows (not main / default rows) are skipped once the probe has run this long.
MAX_SECONDS = 70.0


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_rope",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the report to this JSON file")
    p.add_argument("--out", default=None, help="directory for probe_rope.json")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="main and default rows only")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS,
                   help="skip variant rows once the run has taken this long")
    p.add_argument("--sass", action="store_true",
                   help="no GPU: compile main's and the new kernels for sm_90 and print "
                        "registers, spills, shared memory, SASS instructions")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of main's kernels")
    p.add_argument("--old", default=None, metavar="DIR",
                   help="directory with main's kernels instead of git (a copy without "
                        ".git): fwd/rope.py and bwd/rope.py, under DIR or DIR/linghe")
    return p.parse_args(argv)


# ------------------------------------------------------------------------ old kernels
def _old_dir(old_dir: str, part: str) -> str:
    """The folder holding main's ``part``/rope.py under ``old_dir``."""
    for d in (os.path.join(old_dir, part), os.path.join(old_dir, "linghe", part)):
        if os.path.isfile(os.path.join(d, "rope.py")):
            return d
    raise FileNotFoundError(f"no {part}/rope.py under {old_dir} (nor {old_dir}/linghe)")


def _load_old(old_dir: str | None, rev: str):
    """main's linghe/fwd/rope.py and linghe/bwd/rope.py (at git ``rev``, or from
    ``old_dir``) as modules ``linghe.fwd._rope_old`` / ``linghe.bwd._rope_old`` (the old
    backward imports the old forward's helpers)."""
    def src(part):
        return _old_dir(old_dir, part) if old_dir else None

    fwd = load_module_at(rev, "linghe/fwd/rope.py", "linghe.fwd._rope_old", src_dir=src("fwd"))
    bwd = load_module_at(rev, "linghe/bwd/rope.py", "linghe.bwd._rope_old", src_dir=src("bwd"),
                         replace=[("from ..fwd.rope import", "from ..fwd._rope_old import")])
    return fwd, bwd


# ------------------------------------------------------------------------ knobs
def _defaults(F, B):
    return (dict(tokens=F.FWD_TOKENS, warps=F.FWD_NUM_WARPS, approx=F.COS_SIN_APPROX,
                 row=F.ROW_ORDER),
            dict(tokens=F.BWD_TOKENS, warps=F.BWD_NUM_WARPS, stages=F.BWD_STAGES,
                 prefetch=F.BWD_PREFETCH, approx=F.COS_SIN_APPROX, row=F.ROW_ORDER,
                 dw=(B.DW_BLOCK_P, B.DW_BLOCK_N)))


_NAMES = {"fwd": dict(tokens="FWD_TOKENS", warps="FWD_NUM_WARPS", approx="COS_SIN_APPROX",
                      row="ROW_ORDER"),
          "bwd": dict(tokens="BWD_TOKENS", warps="BWD_NUM_WARPS", stages="BWD_STAGES",
                      prefetch="BWD_PREFETCH", approx="COS_SIN_APPROX", row="ROW_ORDER")}


@contextlib.contextmanager
def _knobs(F, B, op, kn):
    """Set the module knobs of ``op`` ("fwd"/"bwd") to ``kn`` for the block."""
    names = _NAMES[op]
    saved = [(F, a, getattr(F, a)) for a in names.values()]
    saved += [(B, "DW_BLOCK_P", B.DW_BLOCK_P), (B, "DW_BLOCK_N", B.DW_BLOCK_N)]
    try:
        for k, v in kn.items():
            if k == "dw":
                B.DW_BLOCK_P, B.DW_BLOCK_N = v
            else:
                setattr(F, names[k], v)
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


def _knob_str(kn):
    if kn is None:
        return "main"
    s = f"t{kn['tokens']} w{kn['warps']}"
    if "stages" in kn:
        s += f" s{kn['stages']}"
    if kn.get("prefetch") and kn.get("stages") == 1:
        s += " pf"
    s += " mufu" if kn["approx"] else " poly"
    if kn.get("row"):
        s += " row"
    if "dw" in kn:
        s += f" dw{kn['dw'][0]}x{kn['dw'][1]}"
    return s


# ------------------------------------------------------------------------ the probe
def _shape(cpu):
    if cpu:
        return dict(B=2, S=5, H=4, Hkv=2, D=16, R=8)
    return dict(B=2, S=4096, H=16, Hkv=4, D=128, R=64)


def _inputs(p, dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    B, S, H, Hkv, D = p["B"], p["S"], p["H"], p["Hkv"], p["D"]
    W = (H + 2 * Hkv) * D
    dt = torch.bfloat16
    qkv = torch.randn(S, B, W, generator=g).to(dev, dt)
    freqs = linghe.rope_freqs(S, p["R"], device=dev)
    qw = (torch.rand(D, generator=g) + 0.5).to(dev, dt)
    kw = (torch.rand(D, generator=g) + 0.5).to(dev, dt)
    grads = [torch.randn(B, S, n, D, generator=g).to(dev, dt) for n in (H, Hkv, Hkv)]
    return qkv, freqs, qw, kw, grads


def _reference(qkv, freqs, qw, kw, grads, opts):
    x = qkv.float().requires_grad_()
    w = [qw.float().requires_grad_(), kw.float().requires_grad_()]
    out = ref.qk_norm_rope(x, freqs, q_norm_weight=w[0], k_norm_weight=w[1],
                           num_heads=opts["num_heads"], num_kv_heads=opts["num_kv_heads"],
                           rotary_dim=opts["rotary_dim"], layout=opts["layout"],
                           interleaved=opts["interleaved"], eps=opts["eps"])
    dx, dqw, dkw = torch.autograd.grad(out, [x] + w, [gr.float() for gr in grads])
    return [o.detach() for o in out], [dx, dqw, dkw]


def _compare(outs, refs, names):
    """Max relative error vs ``refs`` (NaN anywhere: inf) and per-output errors."""
    errs = {}
    for o, r, n in zip(outs, refs, names):
        errs[n] = float("inf") if o.isnan().any() else rel_err(o, r)
    return max(errs.values()), errs


def _vs_old(outs, olds, names):
    """Elements that differ from main's output, and the max abs difference."""
    res = {}
    for o, r, n in zip(outs, olds, names):
        d = (o.float() - r.float()).abs()
        res[n] = {"differ": int((d > 0).sum()), "max_abs": float(d.max()) if d.numel() else 0.0,
                  "rel_err": rel_err(o, r)}
    return res


def _kernel_breakdown(fn, reps: int = 10) -> dict | None:
    """µs per call of each CUDA kernel ``fn`` launches (profiler, each call after an L2
    flush, the flush's own kernel left out): e.g. the backward's weight-gradient
    reduction beside its main kernel. ``None`` if profiling fails."""
    try:
        prof = profile_flushed(fn, reps)
        # (the flush is a fill kernel; none of the rope launchers fills)
        return {e.key[:60]: e.self_device_time_total / reps for e in prof.key_averages()
                if e.self_device_time_total > 0 and "fill" not in e.key.lower()}
    except Exception:
        return None


def main(argv=None) -> int:
    args = _parse(argv)
    if args.sass:
        return sass_table(args)
    cpu = args.cpu or not torch.cuda.is_available()
    if not interpreter_matches(cpu, "benchmark.probe_rope"):
        return 2
    t_start = time.perf_counter()
    dev = "cpu" if cpu else "cuda"
    from linghe.bwd import rope as B
    from linghe.fwd import rope as F

    try:
        oldF, oldB = _load_old(args.old, args.old_rev)
    except Exception as e:  # e.g. no .git in a copy of the tree: pass --old DIR
        print(f"main's kernels not loaded ({type(e).__name__}: {e}); pass --old DIR",
              file=sys.stderr)
        oldF = oldB = None
    p = _shape(cpu)
    T, W = p["B"] * p["S"], (p["H"] + 2 * p["Hkv"]) * p["D"]
    opts = dict(num_heads=p["H"], num_kv_heads=p["Hkv"], head_dim=p["D"], rotary_dim=p["R"],
                layout="sbh", interleaved=True, eps=1e-6)
    qkv, freqs, qw, kw, grads = _inputs(p, dev)
    table = p["S"] * p["R"] // 2 * 4
    fwd_bytes = 2 * T * W * 2 + table
    bwd_bytes = 2 * T * W * 2 + T * (p["H"] + p["Hkv"]) * p["D"] * 2 + table
    copy = None if cpu else copy_bandwidth_gbps(Config("cuda", quick=False))
    size_us = {} if cpu else {op: size_matched_copy_us(n, dev) for op, n in
                              (("fwd", fwd_bytes), ("bwd", bwd_bytes))}
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; copy {copy or 0:.0f} GB/s; size-matched copies "
          f"{size_us}; torch {torch.__version__}, triton {triton.__version__}",
          file=sys.stderr, flush=True)
    ref_fwd, ref_bwd = _reference(qkv, freqs, qw, kw, grads, opts)

    def fwd_of(mod):
        return lambda: mod.qk_norm_rope_fwd(qkv, freqs, None, qw, kw, **opts)

    def bwd_of(mod):
        return lambda: mod.qk_norm_rope_bwd(*grads, qkv, freqs, None, qw, kw, **opts)

    rows = []
    old_out = {}

    def row(op, kn, fn, nbytes, refs, names, default=False):
        r = {"op": op, "impl": "main" if kn is None else "new", "knobs": kn,
             "default": default, "ok": False, "error": None}
        main_or_default = default or kn is None
        if not main_or_default and not cpu and time.perf_counter() - t_start > args.max_seconds:
            r.update(ok=True, skipped=True)  # over the time budget: not run
            print(f"  {op} {_knob_str(kn):<32} skipped (time budget)", file=sys.stderr)
            rows.append(r)
            return
        try:
            set_poison_outputs(True)  # for the checked call only (fills are kernels)
            t0 = time.perf_counter()
            try:
                out = [o for o in fn() if o is not None]
                if not cpu:
                    torch.cuda.synchronize()
            finally:
                set_poison_outputs(False)
            first = (time.perf_counter() - t0) * 1e6
            r["ref_rel_err"], r["ref_errs"] = _compare(out, refs, names)
            r["ok"] = r["ref_rel_err"] <= _TOL
            if kn is None:
                old_out[op] = out
            elif op in old_out:
                r["vs_old"] = _vs_old(out, old_out[op], names)
            if cpu:
                r["interp_us"] = first
            else:
                r["kernel_us"] = device_time_us(fn)
                if main_or_default:
                    r["kernels_us"] = _kernel_breakdown(fn)
                    r["graph_us"] = graph_time_us(fn, rep=100)
                    r["host_us"], r["host_waited"] = host_us(fn)
                t = r["kernel_us"] or r.get("graph_us")
                r["gbps"] = nbytes / t / 1e3 if t else None
                r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] and copy else None
                r["pct_size"] = 100 * size_us[op] / t if t and size_us.get(op) else None
        except Exception as e:  # one failing row must not stop the probe
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"  {op} {_knob_str(kn):<32} kernel {fmt(r.get('kernel_us'), '.1f')} µs "
              f"{'ok' if r['ok'] else 'FAIL ' + str(r['error'] or r.get('ref_errs'))} "
              f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        rows.append(r)

    fnames, bnames = ["q", "k", "v"], ["dqkv", "dq_norm_weight", "dk_norm_weight"]
    if oldF is not None:
        row("fwd", None, fwd_of(oldF), fwd_bytes, ref_fwd, fnames)
        row("bwd", None, bwd_of(oldB), bwd_bytes, ref_bwd, bnames)
    dflt_f, dflt_b = _defaults(F, B)
    for kind, dflt, make, mod, nbytes, want, names in (
            ("fwd", dflt_f, fwd_of, F, fwd_bytes, ref_fwd, fnames),
            ("bwd", dflt_b, bwd_of, B, bwd_bytes, ref_bwd, bnames)):
        with _knobs(F, B, kind, dflt):
            row(kind, dflt, make(mod), nbytes, want, names, default=True)
    fk, bk = (_CPU_FWD_KNOBS, _CPU_BWD_KNOBS) if cpu else (_FWD_KNOBS, _BWD_KNOBS)
    sweep = [] if args.quick else [  # forward and backward variants alternate
        (kind, kn) for i in range(max(len(fk), len(bk)))
        for kind, ks in (("fwd", fk), ("bwd", bk)) if i < len(ks) for kn in [ks[i]]]
    for kind, kn in sweep:
        dflt, make, mod, nbytes, want, names = (
            (dflt_f, fwd_of, F, fwd_bytes, ref_fwd, fnames) if kind == "fwd" else
            (dflt_b, bwd_of, B, bwd_bytes, ref_bwd, bnames))
        kn = dict(dflt, **kn)
        if kn == dflt:
            continue
        with _knobs(F, B, kind, kn):
            row(kind, kn, make(mod), nbytes, want, names)

    report = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
              "interpreter": cpu, "copy_gbps": copy, "size_matched_copy_us": size_us,
              "old": args.old or args.old_rev, "shape": p, "fwd_bytes": fwd_bytes,
              "bwd_bytes": bwd_bytes, "seconds": time.perf_counter() - t_start,
              "rows": rows}
    _print_table(rows, dev_name, copy, size_us, fwd_bytes, bwd_bytes)
    paths = [args.json] if args.json else []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        paths.append(os.path.join(args.out, "probe_rope.json"))
    for path in paths:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}", file=sys.stderr)
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"{len(bad)} row(s) failed", file=sys.stderr)
    return 1 if bad else 0



def _print_table(rows, dev_name, copy, size_us, fwd_bytes, bwd_bytes):
    head = ["op", "knobs", "kernel µs", "graph µs", "host µs", "GB/s", "% copy", "% size",
            "vs main (elems differ / max abs)", "ref rel err"]
    lines = []
    for r in rows:
        kn = _knob_str(r["knobs"]) + (" *" if r["default"] else "")
        vo = r.get("vs_old")
        vs = ("; ".join(f"{n} {d['differ']}/{d['max_abs']:.2g}" for n, d in vo.items())
              if vo else "")
        if r.get("skipped"):
            chk = "skipped (time budget)"
        else:
            chk = (f"{r['ref_rel_err']:.1e}" if r.get("ref_rel_err") is not None else "") + (
                "" if r["ok"] else " FAIL " + (r["error"] or "")[:60])
        lines.append([r["op"], kn, fmt(r.get("kernel_us"), ".1f"), fmt(r.get("graph_us"), ".1f"),
                      fmt(r.get("host_us"), ".1f"), fmt(r.get("gbps"), ".0f"),
                      fmt(r.get("pct_copy"), ".1f"), fmt(r.get("pct_size"), ".1f"), vs, chk])
    print(f"{dev_name}; copy 1 GiB {copy or 0:.0f} GB/s; size-matched copies: fwd "
          f"{fwd_bytes / 1e6:.1f} MB {fmt(size_us.get('fwd'), '.1f')} µs, bwd "
          f"{bwd_bytes / 1e6:.1f} MB {fmt(size_us.get('bwd'), '.1f')} µs; GB/s from the "
          "fewest bytes over kernel µs")
    print_columns(head, lines)
    for r in rows:
        if r.get("kernels_us"):
            ks = "; ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items())
            print(f"kernels of {r['op']} {_knob_str(r['knobs'])}: {ks}")


# ------------------------------------------------------------------------ offline sm_90
#: Triton's names of the torch dtypes a kernel argument may have.
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv",
                torch.uint8: "u8", torch.int8: "i8"}


def compile_sm90(kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int = 3,
                 **options):
    """Compile ``kernel`` for sm_90 without a GPU. ``args``: every non-constexpr parameter
    by name (extra names are ignored), as a Triton pointer dtype string (``"bf16"``: a
    16-byte aligned pointer), a ``TensorDescriptor`` (typed by its dtype and block) or an example
    int / float (ints divisible by 16 get the divisibility hint, 1 becomes a constant, as
    a launch would specialize them); ``constexprs``: the constexpr parameters (extra names
    are ignored; one left out takes the parameter's default); ``options``: more compile
    options (e.g. ``maxnreg``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.tools.tensor_descriptor import TensorDescriptor

    sig, attrs, consts = {}, {}, {}
    for i, prm in enumerate(kernel.params):
        n = prm.name
        if prm.is_constexpr:
            sig[n] = "constexpr"
            consts[n] = (prm.default if n not in constexprs and prm.has_default
                         else constexprs[n])
            continue
        v = args[n]
        if isinstance(v, TensorDescriptor):
            block = ", ".join(map(str, v.block_shape))
            sig[n] = f"tensordesc<{TRITON_TYPES[v.base.dtype]}[{block}]>"
        elif isinstance(v, str):
            sig[n] = "*" + v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool) or v is None:
            sig[n] = "constexpr"
            consts[n] = v
        elif isinstance(v, int):
            if v == 1:
                sig[n] = "constexpr"
                consts[n] = 1
                continue
            sig[n] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   **options})


def recorded_args(kernel, kargs: dict) -> tuple[dict, dict]:
    """A recorded launch's arguments (``kargs`` by name, e.g. from
    ``probe_tilequant._record_launches``) as :func:`compile_sm90` takes them: ``(args,
    constexprs)``, tensors as their Triton dtype names, parameters not passed at their
    defaults."""
    args, consts = {}, {}
    for prm in kernel.params:
        v = kargs.get(prm.name, prm.default if hasattr(prm, "default") else None)
        if prm.is_constexpr:
            consts[prm.name] = v
        elif isinstance(v, torch.Tensor):
            args[prm.name] = TRITON_TYPES[v.dtype]
        else:
            args[prm.name] = v
    return args, consts


def sass_stats(compiled) -> dict:
    """Registers, stack (spill) bytes and shared memory of a :func:`compile_sm90` result,
    its SASS instruction count, and that of its largest loop (a backward branch) with
    the loop's shared-memory barriers (``cuobjdump`` from Triton's bundled CUDA tools)."""
    import re
    import subprocess
    import tempfile

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as fh:
        fh.write(compiled.asm["cubin"])
    try:
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", fh.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", fh.name],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(fh.name)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loop = None
    for addr, txt in ins:
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            span = (int(m.group(1), 16), addr)
            if loop is None or span[1] - span[0] > loop[1] - loop[0]:
                loop = span
    body = [t for a, t in ins if loop and loop[0] <= a <= loop[1]]
    return {"regs": int(regs[1]) if regs else None, "stack": int(stack[1]) if stack else None,
            "smem": compiled.metadata.shared, "sass": len(ins), "loop": len(body),
            "loop_bar": sum(1 for t in body if re.search(r"\bBAR\b", t)),
            "loop_lds": sum(1 for t in body if re.search(r"\bLDS\b", t))}


def kernel_args(new: bool = True) -> tuple[dict, dict, dict]:
    """``(fwd args, bwd args, constexprs)`` of the kernels at the standard shape for
    :func:`compile_sm90` (both kernel generations' parameter names)."""
    p = _shape(False)
    T, S, H, HKV, D, R = p["B"] * p["S"], p["S"], p["H"], p["Hkv"], p["D"], p["R"]
    W = (H + 2 * HKV) * D
    common = dict(freqs_ptr="fp32", pos_ptr="fp32", qw_ptr="bf16", kw_ptr="bf16", T=T, S=S,
                  NBATCH=p["B"], H=H, HKV=HKV, D=D, HALF=R // 2, R=R, NPOS=S, stride_b=W,
                  stride_s=2 * W, eps=1e-6)
    fargs = dict(common, qkv_ptr="bf16", q_ptr="bf16", k_ptr="bf16", v_ptr="bf16")
    bargs = dict(common, qkv_ptr="bf16", dq_ptr="bf16", dk_ptr="bf16", dv_ptr="bf16",
                 dqkv_ptr="bf16", dw_ptr="fp32", dstride_b=W, dstride_s=2 * W)
    base = dict(INTERLEAVED=True, HAS_POS=False, NORM_Q=True, NORM_K=True)
    return fargs, bargs, base


def sass_table(args) -> int:
    """Offline sm_90 compile of main's and the new kernels at the standard shape."""
    if INTERPRET:
        print("--sass compiles for sm_90: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    from linghe.bwd import rope as B
    from linghe.fwd import rope as F

    oldF, oldB = _load_old(args.old, args.old_rev)
    p = _shape(False)
    T, H, HKV, D, R = p["B"] * p["S"], p["H"], p["Hkv"], p["D"], p["R"]
    fargs, bargs, base = kernel_args()

    def new_cfg(kn, op):
        cfg = F.launch_config(H, HKV, D, R, T, kn["tokens"], kn["warps"], kn["approx"],
                              "sbh", p["B"])
        cfg["ROW_ORDER"] = bool(kn.get("row"))
        if op == "bwd":
            cfg["STAGES"] = kn["stages"]
            cfg["PREFETCH"] = bool(kn.get("prefetch")) and kn["stages"] == 1
        return cfg

    jobs = [("fwd", None, oldF._qk_norm_rope_fwd_kernel,
             oldF.launch_config(H, HKV, D, R, T, oldF.FWD_TOKENS, oldF.FWD_NUM_WARPS,
                                oldF.COS_SIN_APPROX, "sbh", p["B"])),
            ("bwd", None, oldB._qk_norm_rope_bwd_kernel,
             dict(oldF.launch_config(H, HKV, D, R, T, oldF.BWD_TOKENS, oldF.BWD_NUM_WARPS,
                                     oldF.COS_SIN_APPROX, "sbh", p["B"]),
                  STAGES=oldF.BWD_STAGES,
                  PREFETCH=bool(getattr(oldF, "BWD_PREFETCH", False))
                  and oldF.BWD_STAGES == 1))]
    dflt_f, dflt_b = _defaults(F, B)
    for op, dflt, sweep, kernel in (("fwd", dflt_f, _FWD_KNOBS, F._qk_norm_rope_fwd_kernel),
                                    ("bwd", dflt_b, _BWD_KNOBS, B._qk_norm_rope_bwd_kernel)):
        for i, kn in enumerate([{}] + sweep):
            kn = dict(dflt, **kn)
            if i and kn == dflt:
                continue
            jobs.append((op, kn, kernel, new_cfg(kn, op)))
    print(f"triton {triton.__version__}, sm_90 offline; per token: (loop or whole kernel) "
          "SASS x warps / tokens per step")
    for op, kn, kernel, cfg in jobs:
        cfg = dict(cfg)
        nw = cfg.pop("num_warps")
        st = sass_stats(compile_sm90(kernel, fargs if op == "fwd" else bargs,
                                     dict(base, **cfg), nw))
        n = st["loop"] or st["sass"]
        per_token = n * nw / cfg["BLOCK_T"]
        fit = 65536 // (-(-st["regs"] * 32 // 256) * 256 * nw) if st["regs"] else None
        print(f"{op} {_knob_str(kn):<32} regs {st['regs']:>3} stack {st['stack']:>3} "
              f"smem {st['smem']:>6}  programs/SM (regs) {fit}  sass {st['sass']:>5} "
              f"loop {st['loop']:>5} (BAR {st['loop_bar']}, LDS {st['loop_lds']})  "
              f"warp-instr/token {per_token:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
