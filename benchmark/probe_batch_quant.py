"""Probe of the batch SwiGLU + FP8 quantization forward (``batch_silu_mul_quant_fwd``):
``python -m benchmark.probe_batch_quant --out DIR [--cpu] [--quick] [--old-rev REV | --old FILE]``.

Inputs as the FP8 MoE step holds them (``benchmark.cases.activation.moe_grouped_inputs``):
65536 routed rows with random expert ids over E = 32 and E = 256 experts, segments padded
to 16 in a buffer of ``max_grouped_rows`` rows (R = 66016 / 69376), zero padding/tail
rows, ``h [R, 2048]`` bf16, ``probs [R]`` fp32, pow2 scales, columnwise copy (and once
without it, as the step runs with a bf16 wgrad).

Rows: the kernel before the tile-map rewrite (``old``: ``linghe/fwd/activation.py`` at
git ``--old-rev``, default :data:`OLD_REV`, or the file ``--old FILE`` for a tree without
``.git``), then the new launcher at every launch-knob value (``BATCH_QUANT_NUM_WARPS`` x
``BATCH_QUANT_MAXNREG`` x ``BATCH_QUANT_ORDER`` x ``BATCH_QUANT_COLS``; ``*`` = the
module's defaults).

Times per call: ``graph µs`` = median of ``triton.testing.do_bench_cudagraph`` (host time
hidden; the working set is ~5x the L2), ``kernel µs`` = the profiler's kernel time (sum
of the kernels one call launches: the new launcher's tile map and quantizer), ``bench
µs`` = median of ``triton.testing.do_bench`` (L2 flushed, host launch included). GB/s
count the fewest bytes (real rows of h and probs read once; q, qt, their scales written
once), % copy is against a measured device-to-device copy of 1 GiB.

Checks in the same run: every new row bit for bit against the old kernel (q, s, qt, st,
g_off, seg_off: ``same``, else the number of differing elements), and the default row
against :func:`linghe.reference.batch_silu_mul_quant` in float32 (fp8 data within one
e4m3 step, scales within 1e-5, the group offsets equal).

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

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    # The interpreter is chosen when a kernel is decorated: before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from linghe.utils import INTERPRET  # noqa: E402

from .cases.activation import moe_grouped_inputs  # noqa: E402
from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    device_time_us,
    graph_time_us,
    load_module_at,
    print_columns,
)

#: The commit whose batch forward the rewrite replaced (in-kernel expert lookup per
#: program, libdevice-style exp/division).
OLD_REV = "0acaaa3a78bf5eb4925e1824f42680cc10183768"

# (num_warps, maxnreg, order, cols): ptxas (triton 3.6) gives 4 warps 168 registers
# (3 programs per SM), 8 warps 127 (2), 8 warps capped at 80 (3, 80 B of spills), 16 warps
# 64 (2).
_KNOBS = [(w, r, o, 1) for w, r in ((4, None), (8, None), (8, 80), (16, None))
          for o in ("rows", "cols")] + [(8, None, "cols", 2), (16, None, "cols", 2),
                                        (4, 128, "rows", 1)]
_CPU_KNOBS = [(4, None, "rows", 1), (4, None, "cols", 2)]
_KNOB_NAMES = ("BATCH_QUANT_NUM_WARPS", "BATCH_QUANT_MAXNREG", "BATCH_QUANT_ORDER",
               "BATCH_QUANT_COLS")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_batch_quant",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for probe_batch_quant.json")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="default knobs only")
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
    old = {k: getattr(mod, k) for k in _KNOB_NAMES}
    for k, v in zip(_KNOB_NAMES, values):
        setattr(mod, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mod, k, v)


# ------------------------------------------------------------------------ timing
def _bench_us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


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
        print(f"old kernel not loaded ({type(e).__name__}: {e}); pass --old FILE",
              file=sys.stderr)
        old = None
    dflt = tuple(getattr(A, k) for k in _KNOB_NAMES)
    knobs = [dflt] if args.quick else [dflt] + [k for k in (_CPU_KNOBS if cpu else _KNOBS)
                                                if k != dflt]
    routed, n, experts = (256, 256, (8, 3)) if cpu else (65536, 1024, (32, 256))
    copy = None if cpu else copy_bandwidth_gbps(Config("cuda", quick=False))
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; copy {copy or 0:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", file=sys.stderr, flush=True)

    rows = []

    def row(E, colwise, impl, kn, fn, nbytes, old_out=None, want=None):
        r = {"E": E, "columnwise": colwise, "impl": impl, "knobs": kn,
             "default": kn == dflt, "ok": False, "error": None}
        out = None
        try:
            t0 = time.perf_counter()
            out = fn()
            if not cpu:
                torch.cuda.synchronize()
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
                r["graph_us"] = graph_time_us(fn, rep=100)
                r["bench_us"] = _bench_us(fn)
                t = r["kernel_us"] or r["graph_us"]
                r["gbps"] = nbytes / t / 1e3 if t else None
                r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] and copy else None
        except Exception as e:  # one failing row must not stop the probe
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"  E{E} {'col' if colwise else 'row'} {impl:<4} {str(kn):<28} kernel "
              f"{_f(r.get('kernel_us'), '.1f')} µs graph {_f(r.get('graph_us'), '.1f')} µs "
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
            want = None
            if colwise:
                want = ref.batch_silu_mul_quant(x.float(), p, inp["counts_host"],
                                                inp["align"], pow2_scale=True)

            def call(mod, colwise=colwise, x=x, p=p, c=c, align=inp["align"]):
                return mod.batch_silu_mul_quant_fwd(x, p, c, align, columnwise=colwise,
                                                    pow2_scale=True)

            old_out = row(E, colwise, "old", None, lambda: call(old), nbytes, want=want) \
                if old is not None else None
            for kn in (knobs if colwise else [dflt]):
                with _knobs(A, kn):
                    row(E, colwise, "new", kn, lambda: call(A), nbytes, old_out=old_out,
                        want=want if kn == dflt else None)
            del want

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
    head = ["E", "copy", "impl", "knobs (warps maxnreg order cols)", "kernel µs", "graph µs",
            "bench µs", "GB/s", "% copy", "vs old", "vs ref"]
    lines = []
    for r in rows:
        k = r["knobs"]
        kn = (f"w{k[0]} r{k[1] or '-'} {k[2]} c{k[3]}" if k else "before") + (
            " *" if r["default"] and r["impl"] == "new" else "")
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
        lines.append([f"E{r['E']}", "col+row" if r["columnwise"] else "row", r["impl"], kn,
                      _f(r.get("kernel_us"), ".1f"), _f(r.get("graph_us"), ".1f"),
                      _f(r.get("bench_us"), ".1f"), _f(r.get("gbps"), ".0f"),
                      _f(r.get("pct_copy"), ".0f"), vo, vr])
    print(f"{dev_name}; copy {copy or 0:.0f} GB/s; GB/s and % copy from kernel µs")
    print_columns(head, lines)


if __name__ == "__main__":
    sys.exit(main())
