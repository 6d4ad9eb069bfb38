"""Probe of the ``qk_norm_rope`` kernels (split + qk-norm + half RoPE + transpose):
``python -m benchmark.probe_rope --out DIR [--cpu] [--quick] [--old-rev REV | --old DIR]``
(GPU, or ``--cpu``: the interpreter), or ``python -m benchmark.probe_rope --sass`` (no GPU:
an offline sm_90 compile of every variant, registers / spills / shared memory / SASS
instructions per token).

At the standard shape (seq 4096 x batch 2, 16 q / 4 kv heads, head_dim 128, rotary_dim
64, bf16 qk-norm weights, layout "sbh", Megatron-interleaved qkv, bf16) it times the
forward and backward launchers of :mod:`linghe.fwd.rope` / :mod:`linghe.bwd.rope` against
main's (the "main" rows: git ``--old-rev``, default :data:`OLD_REV`, loaded into temporary
modules, or from ``--old DIR`` holding ``rope.py`` files under ``fwd/`` and ``bwd/``) and,
for the new kernels, the launch knobs worth trying (rows marked ``*`` are the defaults):
``FWD_TOKENS`` / ``FWD_NUM_WARPS``, ``BWD_TOKENS`` / ``BWD_NUM_WARPS`` / ``BWD_STAGES``
(the backward's software-pipelined token loop), ``COS_SIN_APPROX`` (MUFU cos/sin or the
polynomial) and the weight-gradient reduction's ``DW_BLOCK_P`` / ``DW_BLOCK_N`` (128 / 16
is main's ``sum_partials_tall``).

Times per call: ``kernel µs`` is the profiler's kernel time (sum of the kernels one call
launches, each call after an L2 flush: the number the benchmark reports), ``graph µs``
the median of ``triton.testing.do_bench_cudagraph`` (host time hidden), ``host µs`` (the
default rows) the launcher's host time per call behind a GPU spin (and, for the backward,
the autograd backward of ``linghe.qk_norm_rope`` as the benchmark calls it). GB/s count
the fewest bytes (forward: read qkv, write q/k/v; backward: read dq/dk/dv and the q/k part
of qkv, write dqkv), % copy is against a measured device-to-device copy.

Checks, in the same run: every output of every row against main's kernels (elements that
differ, max abs difference) and against :func:`linghe.reference.qk_norm_rope` in float32
(forward outputs, and dqkv/dweights by autograd through the reference); outputs are
NaN-poisoned before each launch (``linghe.utils.set_poison_outputs``), so an unwritten
element fails.

``--cpu`` runs tiny shapes through the Triton interpreter (a smoke test of this script,
not a measurement). The table is printed last; ``DIR/probe_rope.json`` gets the rows.
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
    graph_time_us,
    host_us,
    load_module_at,
)

#: main when this probe was extended (the kernels the 3-D tile / pipelined rewrite
#: replaced: 42e0718's chunk-first 4-D tiles, polynomial cos/sin, unpipelined backward).
OLD_REV = "4c2dfc3c541cb7c1ff4ac7861a41892e2bf4c104"

# Knob sets: forward (tokens, warps, approx); backward (tokens, warps, stages, approx,
# (DW_BLOCK_P, DW_BLOCK_N)). None: the module's default.
_FWD_KNOBS = [dict(approx=False), dict(tokens=2, warps=4), dict(tokens=2, warps=8)]
_BWD_KNOBS = [dict(stages=1), dict(stages=2), dict(stages=3), dict(approx=False),
              dict(warps=8, stages=2), dict(tokens=2, warps=8, stages=1),
              dict(dw=(128, 16))]
_CPU_FWD_KNOBS = [dict(approx=False), dict(tokens=2, warps=4)]
_CPU_BWD_KNOBS = [dict(stages=1), dict(approx=False), dict(tokens=2, stages=1)]
_TOL = 1e-2  # bf16 vs the float32 reference (relative error)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_rope",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for probe_rope.json")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="default knobs only")
    p.add_argument("--sass", action="store_true",
                   help="no GPU: compile main's and the new kernels for sm_90 and print "
                        "registers, spills, shared memory, SASS instructions")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of main's kernels")
    p.add_argument("--old", default=None, help="directory with main's kernels (fwd's and "
                   "bwd's rope.py under fwd/ and bwd/) instead of git (a copy without .git)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------ old kernels
def _load_old(old_dir: str | None, rev: str):
    """main's linghe/fwd/rope.py and linghe/bwd/rope.py (at git ``rev``, or from
    ``old_dir``/fwd and ``old_dir``/bwd) as modules ``linghe.fwd._rope_old`` /
    ``linghe.bwd._rope_old`` (the old backward imports the old forward's helpers)."""
    def src(part):
        return os.path.join(old_dir, part) if old_dir else None

    fwd = load_module_at(rev, "linghe/fwd/rope.py", "linghe.fwd._rope_old", src_dir=src("fwd"))
    bwd = load_module_at(rev, "linghe/bwd/rope.py", "linghe.bwd._rope_old", src_dir=src("bwd"),
                         replace=[("from ..fwd.rope import", "from ..fwd._rope_old import")])
    return fwd, bwd


# ------------------------------------------------------------------------ knobs
def _defaults(F, B):
    return dict(tokens=F.FWD_TOKENS, warps=F.FWD_NUM_WARPS, approx=F.COS_SIN_APPROX), dict(
        tokens=F.BWD_TOKENS, warps=F.BWD_NUM_WARPS, stages=F.BWD_STAGES,
        approx=F.COS_SIN_APPROX, dw=(B.DW_BLOCK_P, B.DW_BLOCK_N))


@contextlib.contextmanager
def _knobs(F, B, op, kn):
    """Set the module knobs of ``op`` ("fwd"/"bwd") to ``kn`` for the block."""
    names = {"fwd": dict(tokens=(F, "FWD_TOKENS"), warps=(F, "FWD_NUM_WARPS"),
                         approx=(F, "COS_SIN_APPROX")),
             "bwd": dict(tokens=(F, "BWD_TOKENS"), warps=(F, "BWD_NUM_WARPS"),
                         stages=(F, "BWD_STAGES"), approx=(F, "COS_SIN_APPROX"))}[op]
    saved = [(m, a, getattr(m, a)) for m, a in names.values()]
    saved += [(B, "DW_BLOCK_P", B.DW_BLOCK_P), (B, "DW_BLOCK_N", B.DW_BLOCK_N)]
    try:
        for k, v in kn.items():
            if k == "dw":
                B.DW_BLOCK_P, B.DW_BLOCK_N = v
            else:
                m, a = names[k]
                setattr(m, a, v)
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
    s += " mufu" if kn["approx"] else " poly"
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


def main(argv=None) -> int:
    args = _parse(argv)
    if args.sass:
        return sass_table(args)
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu != INTERPRET:
        print("--cpu needs TRITON_INTERPRET=1 before triton is imported: run it as its own "
              "process (python -m benchmark.probe_rope --cpu)", file=sys.stderr)
        return 2
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
    fwd_bytes = 2 * T * W * 2 + p["S"] * p["R"] // 2 * 4
    bwd_bytes = 2 * T * W * 2 + T * (p["H"] + p["Hkv"]) * p["D"] * 2 + p["S"] * p["R"] // 2 * 4
    copy = None if cpu else copy_bandwidth_gbps(Config("cuda", quick=False))
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; copy {copy or 0:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", file=sys.stderr, flush=True)
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
                r["graph_us"] = graph_time_us(fn, rep=100)
                if default or kn is None:
                    r["host_us"], r["host_waited"] = host_us(fn)
                t = r["kernel_us"] or r["graph_us"]
                r["gbps"] = nbytes / t / 1e3 if t else None
                r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] and copy else None
        except Exception as e:  # one failing row must not stop the probe
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"  {op} {_knob_str(kn):<26} kernel {_f(r.get('kernel_us'), '.1f')} µs "
              f"{'ok' if r['ok'] else 'FAIL ' + str(r['error'] or r.get('ref_errs'))}",
              file=sys.stderr, flush=True)
        rows.append(r)

    fnames, bnames = ["q", "k", "v"], ["dqkv", "dq_norm_weight", "dk_norm_weight"]
    if oldF is not None:
        row("fwd", None, fwd_of(oldF), fwd_bytes, ref_fwd, fnames)
        row("bwd", None, bwd_of(oldB), bwd_bytes, ref_bwd, bnames)
    dflt_f, dflt_b = _defaults(F, B)
    fk = [] if args.quick else (_CPU_FWD_KNOBS if cpu else _FWD_KNOBS)
    bk = [] if args.quick else (_CPU_BWD_KNOBS if cpu else _BWD_KNOBS)
    for kind, dflt, sweep, make, mod, nbytes, want, names in (
            ("fwd", dflt_f, fk, fwd_of, F, fwd_bytes, ref_fwd, fnames),
            ("bwd", dflt_b, bk, bwd_of, B, bwd_bytes, ref_bwd, bnames)):
        for i, kn in enumerate([{}] + sweep):
            kn = dict(dflt, **kn)
            if i and kn == dflt:
                continue
            with _knobs(F, B, kind, kn):
                row(kind, kn, make(mod), nbytes, want, names, default=i == 0)
    autograd_host = None
    if not cpu:  # the benchmark's host path: autograd backward of linghe.qk_norm_rope
        from benchmark.harness import backward_of

        x, w1, w2 = (qkv.clone().requires_grad_(), qw.clone().requires_grad_(),
                     kw.clone().requires_grad_())
        bw = backward_of(lambda: linghe.qk_norm_rope(
            x, freqs, q_norm_weight=w1, k_norm_weight=w2, num_heads=p["H"],
            num_kv_heads=p["Hkv"], rotary_dim=p["R"], layout="sbh"), [x, w1, w2], grads)
        autograd_host = host_us(bw)
        print(f"  autograd backward host {autograd_host[0]:.1f} µs/call", file=sys.stderr)

    report = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
              "interpreter": cpu, "copy_gbps": copy, "old_rev": None if args.old else
              args.old_rev, "shape": p, "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes,
              "autograd_bwd_host_us": autograd_host, "rows": rows}
    _print_table(rows, dev_name, copy)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "probe_rope.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}", file=sys.stderr)
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"{len(bad)} row(s) failed", file=sys.stderr)
    return 1 if bad else 0


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def _print_table(rows, dev_name, copy):
    head = ["op", "knobs", "kernel µs", "graph µs", "host µs", "GB/s", "% copy",
            "vs main (elems differ / max abs)", "ref rel err"]
    lines = []
    for r in rows:
        kn = _knob_str(r["knobs"]) + (" *" if r["default"] else "")
        vo = r.get("vs_old")
        vs = ("; ".join(f"{n} {d['differ']}/{d['max_abs']:.2g}" for n, d in vo.items())
              if vo else "")
        chk = (f"{r['ref_rel_err']:.1e}" if r.get("ref_rel_err") is not None else "") + (
            "" if r["ok"] else " FAIL " + (r["error"] or "")[:60])
        lines.append([r["op"], kn, _f(r.get("kernel_us"), ".1f"), _f(r.get("graph_us"), ".1f"),
                      _f(r.get("host_us"), ".1f"), _f(r.get("gbps"), ".0f"),
                      _f(r.get("pct_copy"), ".1f"), vs, chk])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    print(f"{dev_name}; copy {copy or 0:.0f} GB/s; GB/s and % copy from kernel µs")
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(str(c).ljust(w) for c, w in zip(line, widths)))


# ------------------------------------------------------------------------ offline sm_90
def compile_sm90(kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int = 3,
                 **options):
    """Compile ``kernel`` for sm_90 without a GPU. ``args``: every non-constexpr parameter
    by name, as a Triton pointer dtype string (``"bf16"``: a 16-byte aligned pointer) or
    an example int / float (ints divisible by 16 get the divisibility hint, 1 becomes a
    constant, as a launch would specialize them); ``options``: more compile options
    (e.g. ``maxnreg``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs, consts = {}, {}, dict(constexprs)
    for i, prm in enumerate(kernel.params):
        n = prm.name
        if prm.is_constexpr:
            sig[n] = "constexpr"
            continue
        v = args[n]
        if isinstance(v, str):
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


def sass_table(args) -> int:
    """Offline sm_90 compile of main's and the new kernels at the standard shape."""
    if INTERPRET:
        print("--sass compiles for sm_90: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    from linghe.bwd import rope as B
    from linghe.fwd import rope as F

    oldF, oldB = _load_old(args.old, args.old_rev)
    p = _shape(False)
    T, S, H, HKV, D, R = p["B"] * p["S"], p["S"], p["H"], p["Hkv"], p["D"], p["R"]
    W = (H + 2 * HKV) * D
    common = dict(freqs_ptr="fp32", pos_ptr="fp32", qw_ptr="bf16", kw_ptr="bf16", T=T, S=S,
                  H=H, HKV=HKV, D=D, HALF=R // 2, R=R, NPOS=S, stride_b=W, stride_s=2 * W,
                  eps=1e-6)
    fargs = dict(common, qkv_ptr="bf16", q_ptr="bf16", k_ptr="bf16", v_ptr="bf16")
    bargs = dict(common, qkv_ptr="bf16", dq_ptr="bf16", dk_ptr="bf16", dv_ptr="bf16",
                 dqkv_ptr="bf16", dw_ptr="fp32", dstride_b=W, dstride_s=2 * W)
    base = dict(INTERLEAVED=True, HAS_POS=False, NORM_Q=True, NORM_K=True)
    dflt_f, dflt_b = _defaults(F, B)
    jobs = [("fwd", None, oldF._qk_norm_rope_fwd_kernel,
             oldF.rope_config(H, HKV, D, R, oldF.FWD_TOKENS, oldF.FWD_NUM_WARPS,
                              oldF.TILE_CAP), fargs, {}),
            ("bwd", None, oldB._qk_norm_rope_bwd_kernel,
             oldF.rope_config(H, HKV, D, R, oldF.BWD_TOKENS, oldF.BWD_NUM_WARPS,
                              oldF.TILE_CAP), bargs, {})]
    for i, kn in enumerate([{}] + _FWD_KNOBS):
        kn = dict(dflt_f, **kn)
        if i and kn == dflt_f:
            continue
        jobs.append(("fwd", kn, F._qk_norm_rope_fwd_kernel,
                     F.rope_config(H, HKV, D, R, kn["tokens"], kn["warps"], F.TILE_CAP,
                                   kn["approx"]), fargs, {}))
    for i, kn in enumerate([{}] + [k for k in _BWD_KNOBS if "dw" not in k]):
        kn = dict(dflt_b, **kn)
        if i and kn == dflt_b:
            continue
        jobs.append(("bwd", kn, B._qk_norm_rope_bwd_kernel,
                     F.rope_config(H, HKV, D, R, kn["tokens"], kn["warps"], F.TILE_CAP,
                                   kn["approx"]), bargs, dict(STAGES=kn["stages"])))
    print(f"triton {triton.__version__}, sm_90 offline; per token: loop SASS x warps / "
          "tokens per step")
    for op, kn, kernel, cfg, kargs, extra in jobs:
        cfg = dict(cfg)
        nw = cfg.pop("num_warps")
        st = sass_stats(compile_sm90(kernel, kargs, dict(base, **cfg, **extra), nw))
        n = st["loop"] if op == "bwd" else st["sass"]
        per_token = n * nw / cfg["BLOCK_T"]
        fit = 65536 // (-(-st["regs"] * 32 // 256) * 256 * nw) if st["regs"] else None
        print(f"{op} {_knob_str(kn):<26} regs {st['regs']:>3} stack {st['stack']:>3} "
              f"smem {st['smem']:>6}  programs/SM (regs) {fit}  sass {st['sass']:>5} "
              f"loop {st['loop']:>5} (BAR {st['loop_bar']}, LDS {st['loop_lds']})  "
              f"warp-instr/token {per_token:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
