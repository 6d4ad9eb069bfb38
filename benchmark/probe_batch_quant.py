"""Probe of the batch SwiGLU + FP8 quantization forward (``batch_silu_mul_quant_fwd``):
``python -m benchmark.probe_batch_quant --out DIR [--cpu] [--quick] [--old-rev REV | --old FILE]``
(GPU, or ``--cpu``: the interpreter), or ``--sass`` (no GPU: an offline sm_90 compile of
main's kernel and every knob value, registers / spills / shared memory / SASS
instructions, in both scale modes).

Inputs as the FP8 MoE step holds them (``benchmark.cases.activation.moe_grouped_inputs``):
65536 routed rows with random expert ids over E = 32 and E = 256 experts, segments padded
to 16 in a buffer of ``max_grouped_rows`` rows (R = 66016 / 69376), zero padding/tail
rows, ``h [R, 2048]`` bf16, ``probs [R]`` fp32, columnwise copy (and once without it, as
the step runs with a bf16 wgrad), in both scale modes: power-of-two scales (``pow2``) and
plain ``amax / 448`` (``exact``; the benchmark case's setting). Each knob is probed in both
modes (an 8-warp column-order row once looked faster with pow2 scales and was 36% slower
without them).

Rows: main's kernel (``main``: ``linghe/fwd/activation.py`` at git ``--old-rev``, default
:data:`OLD_REV`, or the file ``--old FILE`` for a tree without ``.git``), then the new
launcher at its defaults (``*``) and, at E = 32, the launch knobs worth trying
(``BATCH_QUANT_NUM_WARPS`` x ``BATCH_QUANT_MAXNREG`` x ``BATCH_QUANT_ORDER`` x
``BATCH_QUANT_COLS`` x ``BATCH_QUANT_LOCAL32``; order ``g<n>``: groups of n row tiles).

Times per call: ``kernel µs`` = the profiler's kernel time (sum of the kernels one call
launches: the tile map and the quantizer; each call after an L2 flush), ``graph µs`` (the
main and default rows) = median of ``triton.testing.do_bench_cudagraph`` (host time
hidden). GB/s count the fewest bytes (real rows of h and probs read once; q, qt, their
scales written once), % copy is against a measured device-to-device copy of 1 GiB.

Checks in the same run: every new row bit for bit against main's kernel in the same
scale mode (q, s, qt, st, g_off, seg_off: ``same``, else the number of differing
elements), and the default rows against :func:`linghe.reference.batch_silu_mul_quant` in
float32 (fp8 data within one e4m3 step, scales within 1e-5, the group offsets equal);
outputs are NaN-poisoned before each checked call, so an unwritten element fails.

``--cpu`` runs tiny shapes (8 and 3 experts, 256 routed rows, n = 256) through the Triton
interpreter: a smoke test of this script, not a measurement. The table is printed last;
``DIR/probe_batch_quant.json`` gets the rows.
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

from linghe.utils import INTERPRET, set_poison_outputs  # noqa: E402

from .cases.activation import moe_grouped_inputs  # noqa: E402
from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    device_time_us,
    graph_time_us,
    load_module_at,
)

#: main when this probe was extended: the tile-map kernel (660d1c5) with int64 row
#: offsets, the knobs of ee98d91.
OLD_REV = "4c2dfc3c541cb7c1ff4ac7861a41892e2bf4c104"

# (num_warps, maxnreg, order, cols, local32), varied from the defaults one or two at a
# time. ptxas (triton 3.6): 4 warps 168 registers (3 programs per SM), 8 warps 128 (2).
_KNOBS = [dict(order="cols"), dict(order=32), dict(warps=8, order="cols"),
          dict(local32=False)]
_CPU_KNOBS = [dict(order="cols", cols=2), dict(order=2), dict(local32=False)]
_KNOB_NAMES = ("BATCH_QUANT_NUM_WARPS", "BATCH_QUANT_MAXNREG", "BATCH_QUANT_ORDER",
               "BATCH_QUANT_COLS", "BATCH_QUANT_LOCAL32")
_KNOB_KEYS = ("warps", "maxnreg", "order", "cols", "local32")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_batch_quant",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for probe_batch_quant.json")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="default knobs only")
    p.add_argument("--sass", action="store_true",
                   help="no GPU: compile main's and the new kernel for sm_90 and print "
                        "registers, spills, shared memory, SASS instructions")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the old kernel")
    p.add_argument("--old", default=None, help="the old linghe/fwd/activation.py as a file "
                   "(instead of git: for a copy of the tree without .git)")
    return p.parse_args(argv)


def _load_old(old_file: str | None, rev: str):
    src_dir = None
    if old_file:
        import shutil
        import tempfile

        src_dir = tempfile.mkdtemp(prefix="probe_batch_quant_old")
        shutil.copy(old_file, os.path.join(src_dir, "activation.py"))
    return load_module_at(rev, "linghe/fwd/activation.py", "linghe.fwd._activation_old",
                          src_dir=src_dir)


@contextlib.contextmanager
def _knobs(mod, values):
    """Set the knobs ``values`` (a dict keyed as :data:`_KNOB_KEYS`) for the block."""
    old = {k: getattr(mod, k) for k in _KNOB_NAMES}
    for key, name in zip(_KNOB_KEYS, _KNOB_NAMES):
        if key in values:
            setattr(mod, name, values[key])
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mod, k, v)


def _defaults(mod):
    return {key: getattr(mod, name) for key, name in zip(_KNOB_KEYS, _KNOB_NAMES)}


def _knob_str(kn):
    if kn is None:
        return "main"
    order = kn["order"] if isinstance(kn["order"], str) else f"g{kn['order']}"
    return (f"w{kn['warps']} r{kn['maxnreg'] or '-'} {order} c{kn['cols']}"
            + ("" if kn["local32"] else " i64"))


# ------------------------------------------------------------------------ checks
_NAMES = ("q", "s", "qt", "st", "g_off", "seg_off")


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _vs_old(out, old):
    """``{output: elements that differ}`` (0 everywhere: bit-identical)."""
    res = {}
    for n, a, b in zip(_NAMES, out, old):
        if a is None or b is None:
            res[n] = 0 if a is None and b is None else -1
        elif a.shape != b.shape:
            res[n] = -1
        else:
            res[n] = int((_bits(a) != _bits(b)).sum())
    return res


def _vs_reference(out, want):
    """Against the float32 reference: fp8 data off by more than one e4m3 step, scales
    off by more than 1e-5 relative (NaN counts as off), group offsets equal."""
    from linghe.testing import e4m3_step

    q, s, qt, st, g_off, _ = out
    rq, rs, rqt, rst, rg = want
    res = {}
    for n, a, b in (("q", q, rq), ("qt", qt, rqt)):
        if a is None:
            continue
        a, b = a.float(), b.float()
        res[n + "_off_by_more_than_1_step"] = int(
            (~(a.isnan() & b.isnan()) & ((a - b).abs() > e4m3_step(b))).sum())
    for n, a, b in (("s", s, rs), ("st", st, rst)):
        if a is None:
            continue
        res[n + "_bad"] = int((~((a - b).abs() <= 1e-5 * b.abs())).sum())
    res["g_off_equal"] = bool(torch.equal(g_off.cpu(), rg.cpu()))
    res["ok"] = res["g_off_equal"] and not any(v for k, v in res.items()
                                               if k.endswith(("_step", "_bad")))
    return res


# ------------------------------------------------------------------------ the probe
def main(argv=None) -> int:
    args = _parse(argv)
    if args.sass:
        return sass_table(args)
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu != INTERPRET:
        print("--cpu needs TRITON_INTERPRET=1 before triton is imported: run it as its own "
              "process (python -m benchmark.probe_batch_quant --cpu)", file=sys.stderr)
        return 2
    dev = "cpu" if cpu else "cuda"
    from linghe import reference as ref
    from linghe.fwd import activation as A

    try:
        old = _load_old(args.old, args.old_rev)
    except Exception as e:  # e.g. no .git in a copy of the tree: pass --old FILE
        print(f"main's kernel not loaded ({type(e).__name__}: {e}); pass --old FILE",
              file=sys.stderr)
        old = None
    dflt = _defaults(A)
    knobs = [] if args.quick else [dict(dflt, **k) for k in (_CPU_KNOBS if cpu else _KNOBS)]
    knobs = [k for k in knobs if k != dflt]
    routed, n, experts = (256, 256, (8, 3)) if cpu else (65536, 1024, (32, 256))
    copy = None if cpu else copy_bandwidth_gbps(Config("cuda", quick=False))
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; copy {copy or 0:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", file=sys.stderr, flush=True)

    rows = []

    def row(E, colwise, pow2, kn, fn, nbytes, old_out=None, want=None):
        r = {"E": E, "columnwise": colwise, "pow2": pow2,
             "impl": "main" if kn is None else "new", "knobs": kn, "default": kn == dflt,
             "ok": False, "error": None}
        out = None
        try:
            set_poison_outputs(True)  # for the checked call only (fills are kernels)
            t0 = time.perf_counter()
            try:
                out = fn()
                if not cpu:
                    torch.cuda.synchronize()
            finally:
                set_poison_outputs(False)
            first = (time.perf_counter() - t0) * 1e6
            ok = True
            if old_out is not None:
                r["vs_old"] = _vs_old(out, old_out)
                r["same_as_old"] = all(v == 0 for v in r["vs_old"].values())
                ok = r["same_as_old"]
            if want is not None:
                r["vs_ref"] = _vs_reference(out, want)
                ok = ok and r["vs_ref"]["ok"]
            r["ok"] = ok
            if cpu:
                r["interp_us"] = first
            else:
                r["kernel_us"] = device_time_us(fn)
                if kn is None or r["default"]:
                    r["graph_us"] = graph_time_us(fn, rep=100)
                t = r["kernel_us"] or r.get("graph_us")
                r["gbps"] = nbytes / t / 1e3 if t else None
                r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] and copy else None
        except Exception as e:  # one failing row must not stop the probe
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"  E{E} {'col' if colwise else 'row'} {'pow2' if pow2 else 'exact'} "
              f"{_knob_str(kn):<22} kernel {_f(r.get('kernel_us'), '.1f')} µs "
              f"{'ok' if r['ok'] else 'FAIL ' + str(r['error'] or r.get('vs_old'))}",
              file=sys.stderr, flush=True)
        rows.append(r)
        return out

    for i, E in enumerate(experts):
        inp = moe_grouped_inputs(E, routed, n, dev, seed=i)
        x, p, c, R = inp["x"], inp["probs"], inp["counts"], inp["R"]
        G = -(-R // 128) + E
        for colwise in (True, False):
            # fewest bytes: real rows of h and probs read, q (+ qt) and scales written
            nbytes = (routed * (2 * n * 2 + 4) + R * n * (2 if colwise else 1)
                      + 4 * R * -(-n // 128) + (4 * n * G if colwise else 0) + 8 * (E + 1))
            for pow2 in (True, False):
                want = None
                if colwise:
                    want = ref.batch_silu_mul_quant(x.float(), p, inp["counts_host"],
                                                    inp["align"], pow2_scale=pow2)

                def call(mod, colwise=colwise, pow2=pow2, x=x, p=p, c=c,
                         align=inp["align"]):
                    return mod.batch_silu_mul_quant_fwd(x, p, c, align, columnwise=colwise,
                                                        pow2_scale=pow2)

                old_out = None
                if old is not None:
                    old_out = row(E, colwise, pow2, None, lambda: call(old), nbytes,
                                  want=want)
                # the knob sweep at the first (E = 32) shape with the columnwise copy
                for kn in [dflt] + (knobs if colwise and i == 0 else []):
                    with _knobs(A, kn):
                        row(E, colwise, pow2, kn, lambda: call(A), nbytes, old_out=old_out,
                            want=want if kn == dflt else None)
                del want, old_out

    report = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
              "interpreter": cpu, "copy_gbps": copy, "old_rev": None if args.old else
              args.old_rev, "old_file": args.old, "routed": routed, "n": n,
              "knob_names": _KNOB_NAMES, "rows": rows}
    _print_table(rows, dev_name, copy)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "probe_batch_quant.json")
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
    head = ["E", "copy", "scales", "knobs (warps maxnreg order cols)", "kernel µs",
            "graph µs", "GB/s", "% copy", "vs main", "vs ref"]
    lines = []
    for r in rows:
        kn = _knob_str(r["knobs"]) + (" *" if r["default"] else "")
        if "vs_old" in r:
            vo = "same" if r["same_as_old"] else "DIFF " + " ".join(
                f"{n}:{v}" for n, v in r["vs_old"].items() if v)
        else:
            vo = ""
        vr = r.get("vs_ref")
        vr = "" if vr is None else ("ok" if vr["ok"] else "BAD " + " ".join(
            f"{n}:{v}" for n, v in vr.items() if v and n != "ok" and n != "g_off_equal"))
        if r["error"]:
            vr = "ERROR " + r["error"][:60]
        lines.append([f"E{r['E']}", "col+row" if r["columnwise"] else "row",
                      "pow2" if r["pow2"] else "exact", kn, _f(r.get("kernel_us"), ".1f"),
                      _f(r.get("graph_us"), ".1f"), _f(r.get("gbps"), ".0f"),
                      _f(r.get("pct_copy"), ".1f"), vo, vr])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    print(f"{dev_name}; copy {copy or 0:.0f} GB/s; GB/s and % copy from kernel µs")
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(str(c).ljust(w) for c, w in zip(line, widths)))


def sass_table(args) -> int:
    """Offline sm_90 compile (no GPU) of main's batch forward and the new one at every
    knob value, both scale modes, at the E = 32 shape."""
    if INTERPRET:
        print("--sass compiles for sm_90: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    from linghe.fwd import activation as A

    from .probe_rope import compile_sm90, sass_stats

    old = _load_old(args.old, args.old_rev)
    R, N, E = 66016, 1024, 32
    G = -(-R // 128) + E
    base = dict(x_ptr="bf16", p_ptr="fp32", map_ptr="i32", q_ptr="fp8e4nv", s_ptr="fp32",
                qt_ptr="fp8e4nv", st_ptr="fp32", M=R, N=N, stride_x=2 * N, NG=G,
                NPC=N // 128)
    dflt = _defaults(A)
    print(f"triton {triton.__version__}, sm_90 offline; batch forward at E={E}, R={R}, "
          f"n={N}, columnwise, probs")
    for kn in [None, dflt] + [dict(dflt, **k) for k in _KNOBS]:
        for pow2 in (True, False):
            mod = old if kn is None else A
            k = kn or dict(warps=old.BATCH_QUANT_NUM_WARPS, maxnreg=old.BATCH_QUANT_MAXNREG,
                           order=old.BATCH_QUANT_ORDER, cols=old.BATCH_QUANT_COLS)
            consts = dict(COLWISE=True, POW2=pow2, HAS_P=True, ALIGN16=True,
                          NCOL=k["cols"], ROWS_FIRST=k["order"] == "rows")
            kargs = dict(base, NPC=-(-(N // 128) // k["cols"]))
            if kn is not None:
                consts["LOCAL32"] = k["local32"]
                kargs["GROUP_M"] = 1 if k["order"] in ("rows", "cols") else int(k["order"])
            opts = {} if k["maxnreg"] is None else {"maxnreg": k["maxnreg"]}
            st = sass_stats(compile_sm90(mod._batch_silu_mul_quant_fwd_kernel, kargs, consts,
                                         k["warps"], **opts))
            fit = 65536 // (-(-st["regs"] * 32 // 256) * 256 * k["warps"])
            print(f"{_knob_str(kn):<22} {'pow2 ' if pow2 else 'exact'} regs {st['regs']:>3} "
                  f"stack {st['stack']:>3} smem {st['smem']:>6} programs/SM (regs) {fit} "
                  f"sass {st['sass']:>5}  warp-instr/tile {st['sass'] * k['warps']}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
