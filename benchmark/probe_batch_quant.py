"""Probe of the batch SwiGLU + FP8 quantization forward (``batch_silu_mul_quant_fwd``):
``python -m benchmark.probe_batch_quant [--json PATH] [--old DIR] [--quick] [--cpu]``, or
``--sass`` (no GPU: an offline sm_90 compile of the old and every variant's kernel).

Cases, in this order (variant rows are skipped once the probe has run ``--budget``
seconds; old and default rows always run):

- ``E32 rc pow2`` / ``rc exact``: both copies, power-of-two / exact scales, inputs as the
  FP8 MoE step holds them (``benchmark.cases.activation.moe_grouped_inputs``: 65536
  routed rows with random expert ids over 32 experts, segments padded to 16 in a buffer
  of ``max_grouped_rows`` rows, R = 66016, ``h [R, 2048]`` bf16, ``probs [R]`` fp32);
- ``E32 r pow2`` / ``r exact``: the rowwise copy only (what the FP8 MoE step calls);
- ``bench rc exact``: the ``batch_silu_mul_quant`` benchmark case's inputs
  (``benchmark.cases.activation._batch_inputs``: R = 65536, 32 experts, one empty);
- ``E256 rc pow2`` / ``r pow2``: 256 experts (R = 69376).

Rows: ``old`` (main's ``linghe/fwd/activation.py``: from ``--old DIR``, a folder holding
that file, for a copy of the tree without ``.git``; else git ``--old-rev``), the new
launcher at its defaults (``*``), and the variants of :data:`RC_VARIANTS` /
:data:`R_VARIANTS` (module knob overrides).

Times: ``kernel µs`` is the profiler's kernel time per call (the tile map and the
quantizer, each call after an L2 flush: :func:`benchmark.harness.device_time_us`);
``graph µs`` (old and default rows) the median of a CUDA-graph replay. GB/s count the
fewest bytes (real rows of h and probs read once; q, s and, with the columnwise copy, qt,
st written once); ``% copy`` is against a 1 GiB device-to-device copy measured in the run.

Checks, every row, in the same run, outputs NaN-poisoned before the checked call (not
the timed ones): against
:func:`linghe.reference.batch_silu_mul_quant` in float32 (fp8 data within one e4m3 step,
NaN never passes; scales within 1e-5 relative; group offsets equal) and bit for bit
against the old kernel. Before timing, every variant is also checked on a small input
with zero-token experts, segments that are not multiples of 128 (one over two tiles) and
a tail (R = 656), and the defaults on one whose R is not a multiple of 16 (163: the
unpacked store), against the reference and the old kernel; on the GPU at n = 1024, so that
the kernels compiled there are the ones timed.

``--cpu`` runs tiny shapes through the Triton interpreter (a smoke test of this script,
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

import torch

if __name__ == "__main__" and "--sass" not in sys.argv and (
        "--cpu" in sys.argv or not torch.cuda.is_available()):
    # The interpreter is chosen when a kernel is decorated: before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from linghe.utils import INTERPRET, set_poison_outputs  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    device_time_us,
    fmt,
    graph_time_us,
    interpreter_matches,
    load_module_at,
    print_columns,
)

#: main when this probe was last changed (its activation.py is the "old" kernel).
OLD_REV = "8ff0efd"
#: Variant rows are skipped once the probe has run this long (seconds).
BUDGET_S = 60.0

# A variant: knob overrides of linghe.fwd.activation. ptxas (sm_90, triton 3.6 / 3.9):
# main's row+col tile 180 / 187 registers (2 programs per SM, 128 STS.U8 per thread);
# packed 177 / 231 (2; exact scales 168 / 238), with maxnreg 168: 8 bytes of spills
# under 3.6 (3 per SM); 8 warps 124-128 (2). PACK=False compiles to main's SASS.
RC_VARIANTS = [
    {"BATCH_QUANT_BF16_BITS": False},  # Triton's bf16 -> fp32 cast (the default until s11)
    {"BATCH_QUANT_MAXNREG": 168},
    {"BATCH_QUANT_ORDER": "cols"},
    {"BATCH_QUANT_ORDER": "cols", "BATCH_QUANT_MAXNREG": 168},
    {"BATCH_QUANT_NUM_WARPS": 8},
    {"BATCH_QUANT_NUM_WARPS": 8, "BATCH_QUANT_ORDER": "cols"},
    {"BATCH_QUANT_PACK": False, "BATCH_QUANT_ORDER": "cols"},  # main's code, cols order
]
RC_EXACT_VARIANTS = RC_VARIANTS[:1] + RC_VARIANTS[2:6]
# rowwise only: 4 warps 168 registers (3 programs per SM), 8 warps 80 (3).
R_VARIANTS = [
    {"BATCH_QUANT_ROW_BF16_BITS": True},
    {"BATCH_QUANT_ROW_NUM_WARPS": 8},
    {"BATCH_QUANT_ROW_ORDER": "cols"},
    {"BATCH_QUANT_ROW_NUM_WARPS": 8, "BATCH_QUANT_ROW_ORDER": "cols"},
]
E256_VARIANTS = RC_VARIANTS[:3]
_CPU_RC = [{"BATCH_QUANT_NUM_WARPS": 8, "BATCH_QUANT_ORDER": "cols"},
           {"BATCH_QUANT_PACK": False}]
_CPU_R = [{"BATCH_QUANT_ROW_NUM_WARPS": 8}]

_NAMES = ("q", "s", "qt", "st", "g_off", "seg_off")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_batch_quant",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--out", default=None, help="(old form) directory for "
                   "probe_batch_quant.json")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="old and default rows only")
    p.add_argument("--variants", choices=("all", "rc", "r"), default="all",
                   help="which launch's knob variants to time: row+col, rowwise-only or "
                        "both (default)")
    p.add_argument("--old", default=None, help="folder holding main's activation.py (in it, "
                   "in fwd/ or in linghe/fwd/; or the file itself), for a copy of the tree "
                   "without .git")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the old kernel")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help="seconds after which variant rows are skipped")
    p.add_argument("--sass", action="store_true",
                   help="offline sm_90 compile of every row's kernel (no GPU needed)")
    return p.parse_args(argv)


def _load_old(old: str | None, rev: str):
    if old and os.path.isdir(old):
        # main's linghe/fwd/activation.py as DIR/linghe/fwd/, DIR/fwd/ or DIR/activation.py
        for sub in (os.path.join("linghe", "fwd"), "fwd", ""):
            if os.path.isfile(os.path.join(old, sub, "activation.py")):
                old = os.path.join(old, sub, "activation.py")
                break
        else:
            raise FileNotFoundError(f"no activation.py in {old}")
    src_dir = old
    if old and os.path.isfile(old):
        src_dir = os.path.dirname(os.path.abspath(old)) or "."
        if os.path.basename(old) != "activation.py":
            import shutil
            import tempfile

            src_dir = tempfile.mkdtemp(prefix="probe_batch_quant_old")
            shutil.copy(old, os.path.join(src_dir, "activation.py"))
    return load_module_at(rev, "linghe/fwd/activation.py", "linghe.fwd._activation_old",
                          src_dir=src_dir)


@contextlib.contextmanager
def _knobs(mod, kn: dict):
    old = {k: getattr(mod, k) for k in kn}
    for k, v in kn.items():
        if not hasattr(mod, k):
            raise AttributeError(k)
        setattr(mod, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mod, k, v)


def _kn_str(kn) -> str:
    if kn is None:
        return "main"
    if not kn:
        return "default *"
    return " ".join(f"{k.replace('BATCH_QUANT_', '').lower()}={v}" for k, v in kn.items())


# ------------------------------------------------------------------------ checks
def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _vs_old(out, old) -> dict:
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


def _vs_reference(out, want) -> dict:
    """Against the float32 reference: fp8 data more than one e4m3 step off (NaN where the
    reference is finite counts as off: the outputs were NaN-poisoned), scales off by more
    than 1e-5 relative, the group offsets equal."""
    from linghe.testing import e4m3_step

    q, s, qt, st, g_off, _ = out
    rq, rs, rqt, rst, rg = want
    res = {}
    for n, a, b in (("q", q, rq), ("qt", qt, rqt)):
        if a is None:
            continue
        a, b = a.float(), b.float()
        ok = (a.isnan() & b.isnan()) | ((a - b).abs() <= e4m3_step(b))
        res[n] = int((~ok).sum())
    for n, a, b in (("s", s, rs), ("st", st, rst)):
        if a is None:
            continue
        res[n] = int((~((a - b).abs() <= 1e-5 * b.abs())).sum())
    res["g_off"] = 0 if torch.equal(g_off.cpu(), rg.cpu()) else 1
    return res


# ------------------------------------------------------------------------ inputs
def _moe(E, cpu, dev, seed):
    from .cases.activation import moe_grouped_inputs

    routed, n = (256, 256) if cpu else (65536, 1024)
    inp = moe_grouped_inputs(E, routed, n, dev, seed=seed)
    inp["name"] = f"E{E}"
    return inp


def _bench_case(cpu, dev):
    from .cases.activation import _batch_inputs

    x, probs, counts, align, R, n, E = _batch_inputs(Config(dev, quick=False))
    c = counts.cpu()
    return dict(name="bench", E=E, R=R, n=n, align=align, routed=int(c.sum()), counts=counts,
                counts_host=c, x=x.detach(), probs=probs.detach())


def _edge_inputs(dev, n):
    """Small inputs for the correctness-only pass: zero-token experts, segments not
    multiples of 128 (and one over 128), a tail; R a multiple of 16 (packed store) and
    not (plain store)."""
    out = []
    # R = 656 (a multiple of 16) and 163
    for counts, tail in (([0, 37, 300, 0, 1, 129, 0, 90], 48), ([5, 0, 130], 3)):
        segs = []
        start = 0
        for c in counts:
            segs.append((start, c))
            start += -(-c // 16) * 16
        R = start + tail
        g = torch.Generator(device=dev).manual_seed(R)
        x = torch.randn(R, 2 * n, generator=g, device=dev).to(torch.bfloat16) * 3
        real = torch.zeros(R, dtype=torch.bool, device=dev)
        for s0, c in segs:
            real[s0:s0 + c] = True
        x[~real] = float("nan")  # padding and tail rows must not be read
        probs = torch.rand(R, generator=g, device=dev)
        out.append(dict(name=f"edge R{R}", E=len(counts), R=R, n=n, align=16,
                        routed=int(real.sum()), counts=torch.tensor(counts, device=dev,
                                                                     dtype=torch.int32),
                        counts_host=torch.tensor(counts), x=x, probs=probs))
    return out


def _nbytes(inp, colwise):
    """Fewest bytes: real rows of h and probs read, q (+ qt) and the scales written."""
    R, n, E, routed = inp["R"], inp["n"], inp["E"], inp["routed"]
    G = -(-R // 128) + E
    return (routed * (2 * n * 2 + 4) + R * n * (2 if colwise else 1)
            + 4 * R * -(-n // 128) + (4 * n * G if colwise else 0) + 8 * (E + 1))


def _want(ref, inp, pow2):
    return ref.batch_silu_mul_quant(inp["x"].float(), inp["probs"], inp["counts_host"],
                                    inp["align"], pow2_scale=pow2)


# ------------------------------------------------------------------------ the probe
def main(argv=None) -> int:
    args = _parse(argv)
    if args.sass:
        return sass_table(args)
    cpu = args.cpu or not torch.cuda.is_available()
    if not interpreter_matches(cpu, "benchmark.probe_batch_quant"):
        return 2
    t_start = time.perf_counter()
    dev = "cpu" if cpu else "cuda"
    from linghe import reference as ref
    from linghe.fwd import activation as A

    try:
        old = _load_old(args.old, args.old_rev)
    except Exception as e:  # e.g. no .git in a copy of the tree
        print(f"main's kernel not loaded ({type(e).__name__}: {e}); pass --old DIR",
              file=sys.stderr)
        return 2
    set_poison_outputs(True)  # the edge-input pass; the timed cases poison checked calls
    copy = None if cpu else copy_bandwidth_gbps(Config("cuda", quick=False))
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; copy {copy or 0:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", file=sys.stderr, flush=True)
    no_rc = args.quick or args.variants == "r"
    rc_v = [] if no_rc else (_CPU_RC if cpu else RC_VARIANTS)
    r_v = [] if args.quick or args.variants == "rc" else (_CPU_R if cpu else R_VARIANTS)
    rc_x = [] if no_rc else (_CPU_RC if cpu else RC_EXACT_VARIANTS)
    e256_v = [] if no_rc else (_CPU_RC[:1] if cpu else E256_VARIANTS)

    def call(mod, inp, colwise, pow2):
        return mod.batch_silu_mul_quant_fwd(inp["x"], inp["probs"], inp["counts"],
                                            inp["align"], columnwise=colwise,
                                            pow2_scale=pow2)

    rows = []
    failures = []

    # 1) correctness on edge inputs (not timed): every variant with pow2 scales on the
    #    input whose R is a multiple of 16 (packed store; on the GPU n = 1024, so the
    #    kernels compiled here are the timed ones), the defaults otherwise.
    for i, inp in enumerate(_edge_inputs(dev, 200 if cpu else 1024)):
        for pow2 in (True, False) if i == 0 else (True,):
            want = _want(ref, inp, pow2)
            base = call(old, inp, True, pow2)
            full = i == 0 and pow2
            for colwise, kns in ((True, [{}] + (rc_v if full else [])),
                                 (False, [{}] + (r_v if full else []))):
                w = want if colwise else (want[0], want[1], None, None, want[4])
                b = base if colwise else (base[0], base[1], None, None, base[4], base[5])
                for kn in kns:
                    with _knobs(A, kn):
                        out = call(A, inp, colwise, pow2)
                    vr, vo = _vs_reference(out, w), _vs_old(out, b)
                    if any(vr.values()) or any(vo.values()):
                        failures.append(dict(input=inp["name"], pow2=pow2, colwise=colwise,
                                             knobs=kn, vs_ref=vr, vs_old=vo))
            del want, base
    set_poison_outputs(False)
    print(f"edge-input checks: {'ok' if not failures else failures}", file=sys.stderr,
          flush=True)

    # 2) timed cases
    plan = [("E32", "rc", True, rc_v), ("E32", "r", True, r_v), ("E32", "rc", False, rc_x),
            ("bench", "rc", False, []), ("E32", "r", False, []),
            ("E256", "rc", True, e256_v), ("E256", "r", True, [])]
    inputs = {}
    for case, mode, pow2, variants in plan:
        if case not in inputs:
            inputs.clear()
            if case == "bench":
                inputs[case] = _bench_case(cpu, dev)
            else:  # (on the CPU: 16 and 32 experts; R = 496, 736: multiples of 16)
                E = int(case[1:]) if not cpu else 16 if case == "E32" else 32
                inputs[case] = _moe(E, cpu, dev, seed=0 if case == "E32" else 1)
        inp = inputs[case]
        colwise = mode == "rc"
        nbytes = _nbytes(inp, colwise)
        want = _want(ref, inp, pow2)
        if not colwise:
            want = (want[0], want[1], None, None, want[4])
        old_out = None
        for impl, kn in [("old", None), ("new", {})] + [("new", v) for v in variants]:
            if kn and time.perf_counter() - t_start > args.budget:
                print(f"  budget: skipped {case} {mode} {_kn_str(kn)}", file=sys.stderr)
                continue
            r = {"case": case, "E": inp["E"], "R": inp["R"], "copies": mode, "pow2": pow2,
                 "impl": impl, "knobs": kn, "ok": False, "error": None, "bytes": nbytes}
            with _knobs(A, kn or {}):  # whether the packed columnwise store ran
                r["packed"] = (impl == "new" and colwise and A.BATCH_QUANT_PACK
                               and inp["R"] % 16 == 0 and inp["align"] % 16 == 0)
            try:
                mod = old if impl == "old" else A
                with _knobs(A, kn or {}):
                    def fn(mod=mod, inp=inp, colwise=colwise, pow2=pow2):
                        return call(mod, inp, colwise, pow2)
                    set_poison_outputs(True)  # (checked call only: the fills are kernels)
                    try:
                        out = fn()
                    finally:
                        set_poison_outputs(False)
                    if not cpu:
                        torch.cuda.synchronize()
                    r["vs_ref"] = _vs_reference(out, want)
                    ok = not any(r["vs_ref"].values())
                    if impl == "old":
                        old_out = out
                    elif old_out is not None:
                        r["vs_old"] = _vs_old(out, old_out)
                        ok = ok and not any(r["vs_old"].values())
                    r["ok"] = ok
                    if impl == "new" and out is not old_out:
                        del out
                    if not cpu:
                        r["kernel_us"] = device_time_us(fn)
                        if kn is None or not kn:
                            r["graph_us"] = graph_time_us(fn, rep=100)
                        t = r["kernel_us"] or r.get("graph_us")
                        r["gbps"] = nbytes / t / 1e3 if t else None
                        r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] and copy else None
            except Exception as e:  # one failing row must not stop the probe
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            verdict = "ok" if r["ok"] else (f"FAIL {r['error'] or r.get('vs_ref')} "
                                            f"{r.get('vs_old')}")
            print(f"  {case} {mode} {'pow2' if pow2 else 'exact'} {impl} {_kn_str(kn):<40} "
                  f"kernel {fmt(r.get('kernel_us'), '.1f')} µs {verdict}", file=sys.stderr,
                  flush=True)
            rows.append(r)
        del want, old_out

    report = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
              "interpreter": cpu, "copy_gbps": copy, "old": args.old or args.old_rev,
              "edge_failures": failures, "seconds": time.perf_counter() - t_start,
              "rows": rows}
    path = args.json or (os.path.join(args.out, "probe_batch_quant.json") if args.out else None)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {path}", file=sys.stderr)
    _print_table(rows, dev_name, copy, failures, time.perf_counter() - t_start)
    bad = [r for r in rows if not r["ok"]]
    return 1 if bad or failures else 0



def _print_table(rows, dev_name, copy, failures, seconds):
    head = ["case", "copies", "scales", "impl", "knobs", "packed", "kernel µs", "x main",
            "graph µs", "GB/s", "% copy", "vs main", "vs ref"]
    lines = []
    base = {}
    for r in rows:
        key = (r["case"], r["copies"], r["pow2"])
        if r["impl"] == "old":
            base[key] = r.get("kernel_us")
        vo = r.get("vs_old")
        vo = "" if vo is None else ("same" if not any(vo.values()) else "DIFF " + " ".join(
            f"{n}:{v}" for n, v in vo.items() if v))
        vr = r.get("vs_ref")
        vr = "" if vr is None else ("ok" if not any(vr.values()) else "BAD " + " ".join(
            f"{n}:{v}" for n, v in vr.items() if v))
        if r["error"]:
            vr = "ERROR " + r["error"][:60]
        t, t0 = r.get("kernel_us"), base.get(key)
        lines.append([r["case"], "col+row" if r["copies"] == "rc" else "row",
                      "pow2" if r["pow2"] else "exact", r["impl"], _kn_str(r["knobs"]),
                      "yes" if r.get("packed") else "", fmt(t, ".1f"),
                      fmt(t0 / t if t and t0 else None, ".3f"), fmt(r.get("graph_us"), ".1f"),
                      fmt(r.get("gbps"), ".0f"), fmt(r.get("pct_copy"), ".1f"), vo, vr])
    print(f"{dev_name}; copy {copy or 0:.0f} GB/s; GB/s and % copy from kernel µs (fewest "
          f"bytes); edge-input checks {'ok' if not failures else 'FAILED: ' + str(len(failures))}; "
          f"{seconds:.0f} s")
    print_columns(head, lines)


# ------------------------------------------------------------------------ offline compile
def sass_table(args) -> int:
    """Offline sm_90 compile of the old and the new quantizing kernel of every row (meta
    tensors of the E32 shape, no GPU): registers, spill stack, shared memory, SASS
    instructions, and the shared-memory stores (byte stores are the transposed fp8 tile)."""
    if INTERPRET:
        print("--sass compiles for sm_90: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    import re
    import subprocess
    import tempfile

    from linghe.fwd import activation as A

    from .probe_rope import compile_sm90, recorded_args, sass_stats
    from .probe_tilequant import _record_launches

    old = _load_old(args.old, args.old_rev)
    R, n, E = 66016, 1024, 32
    x = torch.empty(R, 2 * n, dtype=torch.bfloat16, device="meta")
    p = torch.empty(R, dtype=torch.float32, device="meta")
    c = torch.empty(E, dtype=torch.int32, device="meta")
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    print(f"triton {triton.__version__}, sm_90 offline, h [{R},{2 * n}] bf16, {E} experts")
    jobs = []
    for mode, variants in (("rc", RC_VARIANTS), ("r", R_VARIANTS)):
        for pow2 in (True, False):
            for impl, kn in [("old", None), ("new", {})] + [("new", v) for v in variants]:
                jobs.append((mode, pow2, impl, kn))
    for mode, pow2, impl, kn in jobs:
        mod = old if impl == "old" else A
        with _knobs(A, kn or {}):
            calls = _record_launches([A, old], lambda mod=mod, cw=mode == "rc", p2=pow2:
                                     mod.batch_silu_mul_quant_fwd(x, p, c, 16, columnwise=cw,
                                                                  pow2_scale=p2))
        kernel, kargs, warps, stages = calls[-1]
        opts = {k: kargs.pop(k) for k in ("maxnreg",) if k in kargs}
        sig, const = recorded_args(kernel, kargs)
        try:
            comp = compile_sm90(kernel, sig, const, warps, stages, **opts)
            st = sass_stats(comp)
            with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as fh:
                fh.write(comp.asm["cubin"])
            try:
                sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", fh.name],
                                      capture_output=True, text=True).stdout
            finally:
                os.unlink(fh.name)
            sts8 = len(re.findall(r"\bSTS\.U8\b", sass))
            stsm = len(re.findall(r"\bSTSM\b|\bSTSM\.", sass))
            line = (f"regs {st['regs']} stack {st['stack']} smem {st['smem']} sass "
                    f"{st['sass']} STS.U8 {sts8} STSM {stsm}")
        except Exception as e:
            line = f"{type(e).__name__}: {e}"[:200]
        print(f"{mode:<3} {'pow2' if pow2 else 'exact':<6} {impl:<4} {_kn_str(kn):<45} "
              f"{warps}w {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
