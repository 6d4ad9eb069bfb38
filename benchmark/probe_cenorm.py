"""Probe of the cross-entropy backward (dlogits) and the multi-tensor grad norm:
``python -m benchmark.probe_cenorm [--json PATH] [--cpu] [--quick] [--only ce|norm]
[--old-rev REV | --old DIR]``.

Cross entropy: ``dlogits`` of a ``[8192, 157184]`` bf16 logits tensor (all labels valid,
mean reduction, ``grad_output = 1``), the launcher ``linghe.bwd.loss.ce_backward`` with
the forward's saved ``lse``: main's kernel (git ``--old-rev``) against the new one at
every value of ``BWD_CONFIG`` worth trying (pipeline stages, program order, block and
warps, columns per program, the target fix-up, eviction hints; ``*`` = the defaults), plus
both in place. Fewest bytes: read the logits, write dlogits (5151 MB).

Grad norm: ``linghe.optim.grad_norm`` of the benchmark's 300 fp32 tensors (298.1M
elements, 1192 MB read): main's (git) against the new kernel at the knobs of
``linghe.optim.multi_tensor.NORM_CONFIG`` and the plan's ``PROGRAMS_PER_SM``.

Per row: ``kernel µs`` (``benchmark.harness.device_time_us``: profiler kernel time, L2
flushed before each call), GB/s from the fewest bytes, % of the 1 GiB device copy
(``copy_bandwidth_gbps``) and % of a size-matched copy (the same bytes read + written: a
``[8192, 157184]`` bf16 copy for CE; a copy moving 1192 MB for the norm, and beside it
``torch.linalg.vector_norm`` of one flat 298M-element tensor as a read-only reference),
the compiled kernel's registers, shared memory and resident programs per SM (for the
norm, a grid of more programs than fit is flagged: the last programs would wait).

Checks in the same run: every row's output against a float32/float64 reference computed
with PyTorch (relative error; outputs NaN-poisoned before the checked call, so an
unwritten element fails); for the norm also that a NaN in the list gives NaN.

``--cpu``: tiny shapes on the Triton interpreter (a smoke test of this script, no
timings). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    # The interpreter is chosen when a kernel is decorated: before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from linghe import optim  # noqa: E402
from linghe import reference as ref  # noqa: E402
from linghe import utils as U  # noqa: E402
from linghe.bwd import loss as B  # noqa: E402
from linghe.fwd import loss as F  # noqa: E402
from linghe.optim import multi_tensor as K  # noqa: E402
from linghe.testing import rel_err  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    device_time_us,
    fmt,
    interpreter_matches,
    load_module_at,
    print_columns,
)

#: main before this change (the kernels the probe compares against).
OLD_REV = "4c2dfc3"

_CE_TOL = 1e-2  # bf16 dlogits vs the float32 reference
_NORM_TOL = 1e-5

#: (name, BWD_CONFIG changes): the new CE backward's variants (the first is the default).
_CE_VARIANTS = [
    ("default", {}),
    ("main's knobs (int32 cmp)", dict(stages=1, prefetch=True, evict="evict_first",
                                      row_fastest=True, fixup=False)),
    ("stages=1", dict(stages=1)),
    ("stages=2", dict(stages=2)),
    ("stages=4", dict(stages=4)),
    ("row_fastest", dict(row_fastest=True)),
    ("evict_first", dict(evict="evict_first")),
    ("no fixup", dict(fixup=False)),
    ("chunk=0 (row/program)", dict(chunk=0)),
    ("chunk=65536", dict(chunk=65536)),
    ("bv2048 w8", dict(block_v=2048, warps=8)),
    ("bv4096 w4", dict(block_v=4096, warps=4)),
    ("bv8192 w8 stages=2", dict(block_v=8192, warps=8, stages=2)),
    ("row/program bv2048 w8 stages=1", dict(chunk=0, block_v=2048, warps=8, stages=1)),
]
_CE_QUICK = ["default", "main's knobs (int32 cmp)", "stages=1"]
_CE_CPU = ["default", "main's knobs (int32 cmp)", "row_fastest", "no fixup"]

#: (name, NORM_CONFIG changes, PROGRAMS_PER_SM or None): the new grad norm's variants.
_NORM_VARIANTS = [
    ("default", {}, None),
    ("chunked (round-2 loop)", dict(segments=False), None),
    ("chunked pps=3", dict(segments=False), 3),
    ("stages=1", dict(stages=1), None),
    ("stages=2", dict(stages=2), None),
    ("stages=4", dict(stages=4), None),
    ("pps=2", {}, 2),
    ("pps=6", {}, 6),
    ("pps=8 stages=2", dict(stages=2), 8),
    ("w4 e16 pps=8", dict(warps=4, elems=16), 8),
    ("w8 e8 stages=4", dict(elems=8, stages=4), None),
    ("w8 e32 stages=2", dict(elems=32, stages=2), None),
]
_NORM_QUICK = ["default", "chunked (round-2 loop)", "stages=2"]
_NORM_CPU = ["default", "chunked (round-2 loop)", "w4 e16 pps=8"]


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_cenorm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="a few variants only")
    p.add_argument("--only", choices=("ce", "norm"), default=None)
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of main's kernels")
    p.add_argument("--old", default=None, help="a checkout of the old tree (its linghe/ "
                   "folder is read) instead of git, for copies without .git")
    return p.parse_args(argv)


# ------------------------------------------------------------------------ old kernels
def _load_old(rev: str, old_dir: str | None):
    """main's ``fwd/loss.py``, ``bwd/loss.py``, ``optim/multi_tensor.py``, ``optim/clip.py``
    as modules beside the new ones (the old backward imports the old forward, the old
    clip the old multi-tensor kernels)."""
    def src(path):
        return os.path.dirname(os.path.join(old_dir, path)) if old_dir else None

    def load(path, name, replace=()):
        return load_module_at(rev, path, name, src_dir=src(path), replace=replace)

    f = load("linghe/fwd/loss.py", "linghe.fwd._loss_old")
    b = load("linghe/bwd/loss.py", "linghe.bwd._loss_old",
             [("from ..fwd.loss import", "from ..fwd._loss_old import")])
    k = load("linghe/optim/multi_tensor.py", "linghe.optim._multi_tensor_old")
    c = load("linghe/optim/clip.py", "linghe.optim._clip_old",
             [("from . import multi_tensor as K", "from . import _multi_tensor_old as K")])
    return f, b, k, c


# ------------------------------------------------------------------------ helpers
def _sync(cpu):
    if not cpu:
        torch.cuda.synchronize()


def _compiled_of(kernel):
    """The compiled kernels ``linghe.utils.launch`` holds for ``kernel`` (GPU)."""
    ln = U._LAUNCHERS.get(kernel)
    return dict(ln.cache) if ln is not None else {}


_RESOURCES: dict = {}  # (kernel, knobs that change the compiled code) -> resources


def _resources(kernel, before: dict, warps: int, key) -> dict:
    """Registers, shared memory and resident programs per SM of the kernel compiled since
    ``before`` (the newest; else what ``key``'s earlier row found), or ``{}``."""
    now = _compiled_of(kernel)
    new = [v for k, v in now.items() if k not in before]
    if not new:
        return _RESOURCES.get((kernel, key), {})
    k = new[-1]
    try:
        regs, shared = int(k.n_regs), int(k.metadata.shared)
    except Exception:
        return {}
    per_warp = -(-regs * 32 // 256) * 256
    fit = min(65536 // (per_warp * warps), 64 // warps, 32)
    if shared:
        fit = min(fit, 232448 // (shared + 1024))
    res = _RESOURCES[(kernel, key)] = {"regs": regs, "smem_kb": shared / 1024,
                                       "fit_per_sm": fit}
    return res


def _time(fn, cpu, reps):
    if cpu:
        return None
    return device_time_us(fn, reps=reps)


def _row(section, impl, name, fn, check, nbytes, *, cpu, reps, copy, matched, res=None,
         default=False, knobs=None):
    """Check (poisoned outputs) and time one variant; never raises."""
    r = {"section": section, "impl": impl, "name": name, "default": default,
         "knobs": knobs or {}, "ok": False, "error": None}
    try:
        kernel, warps, key = res if res else (None, 0, None)
        before = _compiled_of(kernel) if kernel is not None else {}
        U.set_poison_outputs(True)
        try:
            t0 = time.perf_counter()
            out = fn()
            _sync(cpu)
            r["first_call_s"] = time.perf_counter() - t0
        finally:
            U.set_poison_outputs(False)
        r.update(check(out))
        del out
        if kernel is not None and not cpu:
            r.update(_resources(kernel, before, warps, key))
        r["kernel_us"] = _time(fn, cpu, reps)
        t = r["kernel_us"]
        r["gbps"] = nbytes / t / 1e3 if t else None
        r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] and copy else None
        r["pct_matched"] = 100 * r["gbps"] / matched if r["gbps"] and matched else None
    except Exception as e:  # one failing row must not stop the probe
        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        r["ok"] = False
    print(f"  {section} {impl:<4} {name:<32} kernel {fmt(r.get('kernel_us'), '.1f')} µs "
          f"{'ok' if r['ok'] else 'FAIL ' + str(r.get('error') or r.get('rel_err'))}",
          file=sys.stderr, flush=True)
    return r



# ------------------------------------------------------------------------ cross entropy
def _ce_reference(x, lab, inv_n):
    """float32 dlogits of the mean cross entropy (grad_output 1), rows in blocks."""
    N, V = x.shape
    out = torch.empty(N, V, dtype=torch.float32, device=x.device)
    step = max(1, (1 << 27) // max(V, 1))
    for s in range(0, N, step):
        xs = x[s:s + step].float()
        ls = lab[s:s + step]
        p = torch.softmax(xs, dim=1) * inv_n
        valid = (ls >= 0) & (ls < V)
        rows = torch.nonzero(valid).flatten()
        p[rows, ls[rows]] -= inv_n
        p[~valid] = 0
        out[s:s + step] = p
        del xs, p
    return out


def _ce_section(cpu, quick, old, copy, rows):
    N, V = (7, 1300) if cpu else (8192, 157184)
    dev = "cpu" if cpu else "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(N, V, generator=g) * 4).to(dev, torch.bfloat16) if cpu else \
        (torch.randn(N, V, device=dev) * 4).to(torch.bfloat16)
    lab = torch.randint(0, V, (N,), generator=g).to(dev)
    if cpu:
        lab[3] = -100  # one ignored row
    _, lse, _, inv_n = F.ce_forward(x, lab, ignore_index=-100, label_smoothing=0.0,
                                    z_loss=0.0, reduction="mean")
    one = torch.ones((), dtype=torch.float32, device=dev)
    n_valid = int(((lab >= 0) & (lab < V)).sum())
    expected = _ce_reference(x, lab, 1.0 / max(n_valid, 1))
    nbytes = 2 * N * V * x.element_size()
    matched = None
    if not cpu:
        matched = _matched_copy(rows, "ce", f"[{N},{V}] bf16 copy", x, nbytes, copy, 10)
    opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0)

    def check(out):
        e = rel_err(out, expected)
        return {"rel_err": e, "ok": e <= _CE_TOL}

    def run(mod, inplace=False, buf=None):
        if inplace:
            def fn():
                return mod.ce_backward(buf, lab, lse, one, inv_n, **opts, inplace=True)
            return fn
        return lambda: mod.ce_backward(x, lab, lse, one, inv_n, **opts)

    common = dict(cpu=cpu, reps=10, copy=copy, matched=matched)
    if old is not None:
        rows.append(_row("ce", "main", "main (git)", run(old[1]), check, nbytes,
                         res=(old[1]._ce_bwd_kernel, 8, "main"), **common))
    base = dict(B.BWD_CONFIG)
    names = _CE_CPU if cpu else (_CE_QUICK if quick else [n for n, _ in _CE_VARIANTS])
    for name, knobs in _CE_VARIANTS:
        if name not in names:
            continue
        cfg = {**base, **knobs}

        def fn(cfg=cfg):
            B.BWD_CONFIG.update(cfg)
            return B.ce_backward(x, lab, lse, one, inv_n, **opts)

        B.BWD_CONFIG.update(cfg)
        warps = B.bwd_launch_config(V)[1]
        rows.append(_row("ce", "new", name, fn, check, nbytes,
                         res=(B._ce_bwd_kernel, warps, str(sorted(cfg.items()))),
                         default=not knobs, knobs=knobs, **common))
        B.BWD_CONFIG.update(base)
    # in place (the gradient overwrites a private copy of the logits; the checked call
    # sees the real logits, the timed ones the previous gradient)
    for impl, mod in (("main", old[1] if old else None), ("new", B)):
        if mod is None:
            continue
        buf = x.clone()
        rows.append(_row("ce", impl, "in place", run(mod, True, buf), check, nbytes,
                         res=(mod._ce_bwd_kernel, 8, "main" if impl == "main" else
                              str(sorted(base.items()))), default=impl == "new", **common))
        del buf
    B.BWD_CONFIG.update(base)


# ------------------------------------------------------------------------ grad norm
def _norm_lists(cpu):
    from .cases.optim import _BIG_PATTERN

    if cpu:
        return [(64, 33), (100,), (3, 7001), (7,), (1000, 2), (5, 4099)] * 2
    return _BIG_PATTERN * 60


def _matched_copy(rows, section, name, src, nbytes, copy, reps) -> float:
    """Time a device copy of ``src`` (moving ``nbytes``, read + write, as the section's op
    must), append its row and return its GB/s: the practical ceiling at this size."""
    dst = torch.empty_like(src)
    t = device_time_us(lambda: dst.copy_(src), reps=reps)
    gbps = nbytes / t / 1e3
    rows.append({"section": section, "impl": "copy", "name": name, "kernel_us": t,
                 "gbps": gbps, "pct_copy": 100 * gbps / copy, "pct_matched": 100.0,
                 "ok": True, "default": False, "knobs": {}})
    return gbps


def _norm_section(cpu, quick, old, copy, rows):
    dev = "cpu" if cpu else "cuda"
    g = torch.Generator(device="cpu").manual_seed(1)
    shapes = _norm_lists(cpu)
    ts = [torch.randn(s, generator=g).to(dev) if cpu else torch.randn(s, device=dev)
          for s in shapes]
    n = sum(t.numel() for t in ts)
    nbytes = 4 * n
    expected = ref.total_norm(ts, 2.0)  # float64
    matched = None
    if not cpu:
        src = torch.empty(n // 2, dtype=torch.float32, device=dev)
        matched = _matched_copy(rows, "norm", f"copy of {nbytes / 2e6:.0f} MB", src, nbytes,
                                copy, 20)
        del src
        flat = torch.cat([t.reshape(-1) for t in ts])
        t = device_time_us(lambda: torch.linalg.vector_norm(flat), reps=20)
        gb = nbytes / t / 1e3
        rows.append({"section": "norm", "impl": "torch", "name": "vector_norm(one flat)",
                     "kernel_us": t, "gbps": gb, "pct_copy": 100 * gb / copy,
                     "pct_matched": 100 * gb / matched, "ok": True, "default": False,
                     "knobs": {}})
        del flat

    def check_of(fn):
        def check(out):
            e = rel_err(out.double().reshape(1).cpu(), expected.reshape(1).cpu())
            t3 = ts[2].view(-1)
            keep = t3[7].item()
            t3[7] = float("nan")
            try:
                nan_ok = math.isnan(float(fn()))
            finally:
                t3[7] = keep
            return {"rel_err": e, "nan_propagates": nan_ok, "ok": e <= _NORM_TOL and nan_ok}
        return check

    common = dict(cpu=cpu, reps=20, copy=copy, matched=matched)
    if old is not None:
        def fn_old():
            return old[3].grad_norm(ts)

        rows.append(_row("norm", "main", "main (git)", fn_old, check_of(fn_old), nbytes,
                         res=(old[2]._norm_partials_kernel, old[2].NUM_WARPS, "main"),
                         **common))
    base, base_pps = dict(K.NORM_CONFIG), K.PROGRAMS_PER_SM
    names = _NORM_CPU if cpu else (_NORM_QUICK if quick else [v[0] for v in _NORM_VARIANTS])
    for name, knobs, pps in _NORM_VARIANTS:
        if name not in names:
            continue
        K.NORM_CONFIG.update({**base, **knobs})
        K.PROGRAMS_PER_SM = pps or base_pps
        optim.clear_plan_cache()  # the plans hold the grid

        def fn():
            return optim.grad_norm(ts)

        kn = dict(knobs, programs_per_sm=K.PROGRAMS_PER_SM)
        r = _row("norm", "new", name, fn, check_of(fn), nbytes,
                 res=(K._norm_partials_kernel, K.NORM_CONFIG["warps"],
                      str(sorted(K.NORM_CONFIG.items()))),
                 default=not knobs and pps is None, knobs=kn, **common)
        if r.get("fit_per_sm") is not None and r["fit_per_sm"] < K.PROGRAMS_PER_SM:
            r["note"] = f"grid {K.PROGRAMS_PER_SM}/SM > {r['fit_per_sm']} resident"
        rows.append(r)
    K.NORM_CONFIG.update(base)
    K.PROGRAMS_PER_SM = base_pps
    optim.clear_plan_cache()


# ------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = _parse(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    if not interpreter_matches(cpu, "benchmark.probe_cenorm"):
        return 2
    t_start = time.perf_counter()
    copy = None if cpu else copy_bandwidth_gbps(Config("cuda", quick=False))
    dev_name = (torch.cuda.get_device_name() if not cpu
                else (platform.processor() or "cpu") + " (Triton interpreter)")
    print(f"device: {dev_name}; copy {copy or 0:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", file=sys.stderr, flush=True)
    old, old_error = None, None
    try:
        old = _load_old(args.old_rev, args.old)
    except Exception as e:  # no git history here: the new rows alone
        old_error = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  main's kernels not loaded ({old_error}); new rows only", file=sys.stderr)
    rows: list[dict] = []
    if args.only in (None, "ce"):
        _ce_section(cpu, args.quick, old, copy, rows)
        if not cpu:
            torch.cuda.empty_cache()
    if args.only in (None, "norm"):
        _norm_section(cpu, args.quick, old, copy, rows)
    report = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
              "interpreter": cpu, "copy_gbps": copy, "old_rev": args.old_rev,
              "old_error": old_error, "wall_s": time.perf_counter() - t_start,
              "ce_bwd_config": {k: v for k, v in B.BWD_CONFIG.items()},
              "norm_config": dict(K.NORM_CONFIG, programs_per_sm=K.PROGRAMS_PER_SM,
                                  chunk=K.CHUNK),
              "rows": rows}
    if args.json:
        d = os.path.dirname(args.json)
        if d:
            os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}", file=sys.stderr)
    _print_table(rows, dev_name, copy, report["wall_s"])
    bad = [r for r in rows if not r.get("ok")]
    return 1 if bad else 0


def _print_table(rows, dev_name, copy, wall):
    head = ["op", "impl", "variant", "kernel µs", "GB/s", "% copy", "% matched", "vs main",
            "regs", "smem KB", "fit/SM", "rel err", "check"]
    mains = {r["section"]: r.get("kernel_us") for r in rows if r["impl"] == "main"
             and r["name"] == "main (git)"}
    lines = []
    for r in rows:
        m = mains.get(r["section"])
        vs = f"{m / r['kernel_us']:.3f}x" if m and r.get("kernel_us") and r["impl"] in (
            "new", "main") and r["name"] != "in place" else ""
        chk = "ok" if r.get("ok") else "FAIL " + (r.get("error") or "")[:50]
        if r.get("note"):
            chk += " (" + r["note"] + ")"
        lines.append([r["section"], r["impl"], r["name"] + (" *" if r.get("default") else ""),
                      fmt(r.get("kernel_us"), ".1f"), fmt(r.get("gbps"), ".0f"),
                      fmt(r.get("pct_copy"), ".1f"), fmt(r.get("pct_matched"), ".1f"), vs,
                      fmt(r.get("regs"), "d"), fmt(r.get("smem_kb"), ".0f"),
                      fmt(r.get("fit_per_sm"), "d"),
                      fmt(r.get("rel_err"), ".1e"), chk])
    print(f"{dev_name}; copy {copy or 0:.0f} GB/s (1 GiB); % matched = of a copy moving the "
          f"same bytes; * = default; probe wall {wall:.0f} s")
    print_columns(head, lines)


if __name__ == "__main__":
    sys.exit(main())
