"""Probe of the ``qk_norm_rope`` kernels (split + qk-norm + half RoPE + transpose):
``python -m benchmark.probe_rope --out DIR [--cpu] [--quick] [--old-rev REV | --old DIR]``.

At the standard shape (seq 4096 x batch 2, 16 q / 4 kv heads, head_dim 128, rotary_dim
64, bf16 qk-norm weights, layout "sbh", Megatron-interleaved qkv, bf16) it times the
forward and backward launchers of :mod:`linghe.fwd.rope` / :mod:`linghe.bwd.rope` against
the same launchers before the rewrite (the "old" kernels, git ``--old-rev``, default the
commit before it, loaded into temporary modules, or from ``--old DIR`` holding
``rope.py`` files of ``fwd`` and ``bwd``: see ``--old``)
and, for the new kernels, every value of the launch knobs (``FWD_TOKENS`` x
``FWD_NUM_WARPS``, ``BWD_TOKENS`` x ``BWD_NUM_WARPS``; rows marked ``*`` are the
defaults).

Times per call: ``kernel µs`` is the profiler's kernel time (sum of the kernels one call
launches, each call after an L2 flush: the number the benchmark reports), ``graph µs``
the median of ``triton.testing.do_bench_cudagraph`` (host time hidden), ``host µs`` the
launcher's host time per call behind a GPU spin (and, for the backward, the autograd
backward of ``linghe.qk_norm_rope`` as the benchmark calls it). GB/s count the fewest
bytes (forward: read qkv, write q/k/v; backward: read dq/dk/dv and the q/k part of qkv,
write dqkv), % copy is against a measured device-to-device copy.

Checks, in the same run: every output of every row against the old kernels (max abs
difference in bf16 ulps of the value, relative error) and against
:func:`linghe.reference.qk_norm_rope` in float32 (forward outputs, and dqkv/dweights by
autograd through the reference).

``--cpu`` runs tiny shapes through the Triton interpreter (a smoke test of this script,
not a measurement). The table is printed last; ``DIR/probe_rope.json`` gets the rows.
"""

from __future__ import annotations

import argparse
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

import linghe  # noqa: E402
from linghe import reference as ref  # noqa: E402
from linghe.testing import rel_err  # noqa: E402
from linghe.utils import INTERPRET  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    device_time_us,
    graph_time_us,
    host_us,
    load_module_at,
)

_FWD_KNOBS = [(1, 4), (2, 4), (2, 8), (4, 8), (1, 8)]
_BWD_KNOBS = [(1, 4), (1, 8), (2, 8), (2, 4)]
_CPU_KNOBS = [(1, 4), (2, 4)]
_TOL = 1e-2  # bf16 vs the float32 reference (relative error)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_rope",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for probe_rope.json")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="default knobs only")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the old kernels")
    p.add_argument("--old", default=None, help="directory with the old kernels (fwd's and "
                   "bwd's rope.py under fwd/ and bwd/) instead of git (a copy without .git)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------ old kernels
#: The commit before the 4-D-tile rewrite of the qk_norm_rope kernels.
OLD_REV = "42e0718~1"


def _load_old(old_dir: str | None, rev: str):
    """The old linghe/fwd/rope.py and linghe/bwd/rope.py (at git ``rev``, or from
    ``old_dir``/fwd and ``old_dir``/bwd) as modules ``linghe.fwd._rope_old`` /
    ``linghe.bwd._rope_old`` (the old backward imports the old forward's helpers)."""
    def src(part):
        return os.path.join(old_dir, part) if old_dir else None

    fwd = load_module_at(rev, "linghe/fwd/rope.py", "linghe.fwd._rope_old", src_dir=src("fwd"))
    bwd = load_module_at(rev, "linghe/bwd/rope.py", "linghe.bwd._rope_old", src_dir=src("bwd"),
                         replace=[("from ..fwd.rope import", "from ..fwd._rope_old import")])
    return fwd, bwd


# ------------------------------------------------------------------------ timing
def _sync(cpu):
    if not cpu:
        torch.cuda.synchronize()


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
    """Max relative error vs ``refs`` and per-output errors."""
    errs = {n: rel_err(o, r) for o, r, n in zip(outs, refs, names)}
    return max(errs.values()), errs


def _vs_old(outs, olds, names):
    """Elements that differ from the old kernels' output, and the max abs difference."""
    res = {}
    for o, r, n in zip(outs, olds, names):
        d = (o.float() - r.float()).abs()
        res[n] = {"differ": int((d > 0).sum()), "max_abs": float(d.max()) if d.numel() else 0.0,
                  "rel_err": rel_err(o, r)}
    return res


def main(argv=None) -> int:
    args = _parse(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu != INTERPRET:
        print("--cpu needs TRITON_INTERPRET=1 before triton is imported: run it as its own "
              "process (python -m benchmark.probe_rope --cpu)", file=sys.stderr)
        return 2
    dev = "cpu" if cpu else "cuda"
    from linghe.bwd import rope as B
    from linghe.fwd import rope as F

    oldF, oldB = _load_old(args.old, args.old_rev)
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

    def row(op, impl, knobs, fn, nbytes, refs, names, default=False):
        r = {"op": op, "impl": impl, "knobs": knobs, "default": default, "ok": False,
             "error": None}
        try:
            t0 = time.perf_counter()
            out = [o for o in fn() if o is not None]
            _sync(cpu)
            first = (time.perf_counter() - t0) * 1e6
            r["ref_rel_err"], r["ref_errs"] = _compare(out, refs, names)
            r["ok"] = r["ref_rel_err"] <= _TOL
            if impl == "old":
                old_out[op] = out
            elif op in old_out:
                r["vs_old"] = _vs_old(out, old_out[op], names)
            if cpu:
                r["kernel_us"], r["graph_us"], r["host_us"] = None, None, None
                r["interp_us"] = first
            else:
                r["kernel_us"] = device_time_us(fn)
                r["graph_us"] = graph_time_us(fn)
                r["host_us"], r["host_waited"] = host_us(fn)
                t = r["kernel_us"] or r["graph_us"]
                r["gbps"] = nbytes / t / 1e3 if t else None
                r["pct_copy"] = 100 * r["gbps"] / copy if r["gbps"] and copy else None
        except Exception as e:  # one failing row must not stop the probe
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"  {op} {impl:<4} {str(knobs):<30} kernel {_f(r.get('kernel_us'), '.1f')} µs "
              f"{'ok' if r['ok'] else 'FAIL ' + str(r['error'] or '')}", file=sys.stderr,
              flush=True)
        rows.append(r)

    fnames, bnames = ["q", "k", "v"], ["dqkv", "dq_norm_weight", "dk_norm_weight"]
    row("fwd", "old", {}, fwd_of(oldF), fwd_bytes, ref_fwd, fnames)
    row("bwd", "old", {}, bwd_of(oldB), bwd_bytes, ref_bwd, bnames)
    dflt_f = (F.FWD_TOKENS, F.FWD_NUM_WARPS)
    dflt_b = (F.BWD_TOKENS, F.BWD_NUM_WARPS)
    fk = [dflt_f] if args.quick else (_CPU_KNOBS if cpu else _FWD_KNOBS)
    bk = [dflt_b] if args.quick else (_CPU_KNOBS if cpu else _BWD_KNOBS)
    for tok, w in [dflt_f] + [k for k in fk if k != dflt_f]:
        F.FWD_TOKENS, F.FWD_NUM_WARPS = tok, w
        row("fwd", "new", {"tokens": tok, "warps": w}, fwd_of(F), fwd_bytes, ref_fwd, fnames,
            default=(tok, w) == dflt_f)
    F.FWD_TOKENS, F.FWD_NUM_WARPS = dflt_f
    for tok, w in [dflt_b] + [k for k in bk if k != dflt_b]:
        F.BWD_TOKENS, F.BWD_NUM_WARPS = tok, w
        row("bwd", "new", {"tokens": tok, "warps": w}, bwd_of(B), bwd_bytes, ref_bwd,
            bnames, default=(tok, w) == dflt_b)
    F.BWD_TOKENS, F.BWD_NUM_WARPS = dflt_b
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
              "interpreter": cpu, "copy_gbps": copy, "shape": p, "fwd_bytes": fwd_bytes,
              "bwd_bytes": bwd_bytes, "autograd_bwd_host_us": autograd_host, "rows": rows}
    _print_table(rows, dev_name, copy)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "probe_rope.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}", file=sys.stderr)
    bad = [r for r in rows if not r["ok"]]
    return 1 if bad else 0


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def _print_table(rows, dev_name, copy):
    head = ["op", "impl", "knobs", "kernel µs", "graph µs", "host µs", "GB/s", "% copy",
            "vs old (elems differ / max abs)", "ref rel err"]
    lines = []
    for r in rows:
        k = r["knobs"]
        kn = (f"t{k['tokens']} w{k['warps']}" if k else "before") + (" *" if r["default"] else "")
        vo = r.get("vs_old")
        vs = ("; ".join(f"{n} {d['differ']}/{d['max_abs']:.2g}" for n, d in vo.items())
              if vo else "")
        chk = (f"{r['ref_rel_err']:.1e}" if r.get("ref_rel_err") is not None else "") + (
            "" if r["ok"] else " FAIL " + (r["error"] or "")[:60])
        lines.append([r["op"], r["impl"], kn, _f(r.get("kernel_us"), ".1f"),
                      _f(r.get("graph_us"), ".1f"), _f(r.get("host_us"), ".1f"),
                      _f(r.get("gbps"), ".0f"), _f(r.get("pct_copy"), ".0f"), vs, chk])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    print(f"{dev_name}; copy {copy or 0:.0f} GB/s; GB/s and % copy from kernel µs")
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(str(c).ljust(w) for c, w in zip(line, widths)))


if __name__ == "__main__":
    sys.exit(main())
