"""Times the round-2 RMSNorm kernels (git 457e10a, never timed on a GPU) against main's:
``python -m benchmark.probe_norm_round2 [--json PATH] [--r2 DIR] [--cpu]``.

Round 2 (merged on 2026-11-22, replaced before any GPU run) had three ideas main does
not: the backward's weight-gradient partials reduced inside the backward kernel by the
last program of each group (a counter per group, no second launch), an optional
``store_y=False`` forward (rstd only), and ``rms_norm_quant`` as one "slab" kernel (a
program owns 128 rows: pass 1 sums squares, pass 2 re-reads the slab from L2 and writes
both 1x128 copies) or "two_kernel" (rstd, then [128, 128] tiles). Main has a two-launch
backward (partials, then a sum kernel) and rms_norm_quant as a rows kernel (rstd and the
rowwise copy) plus columnwise tiles.

Rows, at ``x [8192, 2048]`` bf16 (weight bf16, eps 1e-6): rms_norm fwd, rms_norm bwd (dx
and dweight), rms_norm_quant row+col and rowwise; round 2's quant modes "slab" and
"two_kernel" each. Round 2's files come from ``--r2 DIR`` (holding its ``fwd/norm.py``
and ``bwd/norm.py``: the device copy has no git) or from git. Each row is checked in the
same run against :mod:`linghe.reference` (fp32 math) and against main's output.
``kernel µs``: :func:`benchmark.harness.device_time_us`; ``% copy``: GB/s from the fewest
bytes against a 1 GiB device copy; ``% size``: against a copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402

from benchmark import harness  # noqa: E402
from linghe import reference as ref  # noqa: E402
from linghe.bwd import norm as bwd_norm  # noqa: E402
from linghe.fwd import norm as fwd_norm  # noqa: E402
from linghe.testing import rel_err  # noqa: E402

R2_REV = "457e10a"


def _load_r2(src_dir: str | None):
    """Round 2's forward and backward as modules inside the package (their relative
    imports resolve against main's ``linghe.fp8.quantize`` / ``linghe.utils``, which
    still have the names they use); from ``src_dir``'s ``fwd/norm.py`` and
    ``bwd/norm.py`` when given, else from git."""
    def load(part):
        d = os.path.join(src_dir, part) if src_dir else None
        return harness.load_module_at(R2_REV, f"linghe/{part}/norm.py",
                                      f"linghe.{part}._norm_r2", src_dir=d)

    return load("fwd"), load("bwd")


def _check_quant(out, x, w, eps, columnwise):
    """Largest error of the dequantized copies against the fp32 reference's, relative to
    its largest magnitude (one e4m3 step is 2^-3 relative at most)."""
    exp = ref.rms_norm_quant(x, w, eps, columnwise=columnwise)
    q, s, qt, st = out[0], out[1], out[2], out[3]
    errs = []

    def deq(data, scale):
        d = data.float().view(data.shape[0], -1)
        g = scale.float().repeat_interleave(128, dim=1)[:, :d.shape[1]]
        return d * g

    errs.append(rel_err(deq(q, s), deq(exp[0], exp[1])))
    if columnwise:
        errs.append(rel_err(deq(qt, st), deq(exp[2], exp[3])))
    return max(errs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_norm_round2",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--cpu", action="store_true", help="tiny shape, Triton interpreter")
    p.add_argument("--r2", default=None, help="folder with round 2's fwd/norm.py and "
                   "bwd/norm.py (instead of git)")
    args = p.parse_args(argv)
    if not harness.interpreter_matches(args.cpu or not torch.cuda.is_available(),
                                       "benchmark.probe_norm_round2"):
        return 2
    cpu = args.cpu or not torch.cuda.is_available()
    dev = "cpu" if cpu else "cuda"
    M, K = (261, 384) if cpu else (8192, 2048)
    eps = 1e-6
    r2f, r2b = _load_r2(args.r2)
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(K, device=dev)).to(torch.bfloat16)
    dy = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    cfg = harness.Config(device=dev, quick=True)
    copy_gbps = None if cpu else harness.copy_bandwidth_gbps(cfg)

    def timed(fn):
        if cpu:
            fn()
            return None
        return harness.device_time_us(fn)

    y_ref = ref.rms_norm(x, w, eps)
    _, _, rstd_main = fwd_norm.rms_norm_fwd(x, w, eps)
    xr = x.float().requires_grad_()
    wr = w.float().requires_grad_()
    ref.rms_norm_f32(xr, wr, eps).backward(dy.float())
    dx_ref, dw_ref = xr.grad, wr.grad

    rows = []
    bf = 2  # bytes per bf16

    def row(op, impl, fn, nbytes, check):
        us = timed(fn)
        out = fn()
        err = check(out)
        size_us = None
        if not cpu and impl == "main":
            size_us = harness.size_matched_copy_us(nbytes, dev)
        rows.append(dict(op=op, impl=impl, kernel_us=us, bytes=nbytes, err=err,
                         gbps=None if us is None else nbytes / us / 1e3,
                         size_copy_us=size_us))

    # rms_norm fwd: read x, write y (+ rstd)
    fwd_bytes = 2 * M * K * bf + 4 * M
    for impl, mod in (("main", fwd_norm), ("round2", r2f)):
        row("rms_norm fwd", impl, lambda mod=mod: mod.rms_norm_fwd(x, w, eps), fwd_bytes,
            lambda o: rel_err(o[0].float(), y_ref.float()))
    # rms_norm bwd: read x, dy, write dx (+ rstd, weight)
    bwd_bytes = 3 * M * K * bf + 4 * M
    for impl, mod in (("main", bwd_norm), ("round2", r2b)):
        row("rms_norm bwd", impl,
            lambda mod=mod: mod.rms_norm_bwd(dy, x, w, rstd_main), bwd_bytes,
            lambda o: max(rel_err(o[0].float(), dx_ref), rel_err(o[1].float(), dw_ref)))
    # rms_norm_quant: read x, write q (+ q_t) and scales
    for columnwise in (True, False):
        op = "rms_norm_quant " + ("row+col" if columnwise else "row")
        nb = M * K * bf + M * K * (2 if columnwise else 1)
        row(op, "main", lambda c=columnwise: fwd_norm.rms_norm_quant_fwd(
            x, w, eps, columnwise=c, pow2_scale=False), nb,
            lambda o, c=columnwise: _check_quant(o, x, w, eps, c))
        for mode in ("slab", "two_kernel"):
            def fn(c=columnwise, mode=mode):
                old = r2f.QUANT_MODE
                r2f.QUANT_MODE = mode
                r2f._QUANT_PLANS.clear()
                try:
                    return r2f.rms_norm_quant_fwd(x, w, eps, columnwise=c, pow2_scale=False)
                finally:
                    r2f.QUANT_MODE = old
            # (the plan is rebuilt per call: host-only work, outside the kernel µs)
            row(op, f"round2 {mode}", fn, nb,
                lambda o, c=columnwise: _check_quant(o, x, w, eps, c))

    name = "cpu" if cpu else torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{platform.node()}; x [{M}, {K}] bf16; copy {harness.fmt(copy_gbps, '.0f')} GB/s")
    head = ["op", "impl", "kernel µs", "GB/s", "% copy", "% size", "rel err"]
    lines = []
    size_of = {}
    for r in rows:
        if r["size_copy_us"] is not None:
            size_of[r["op"]] = r["size_copy_us"]
        sz = size_of.get(r["op"])
        lines.append([r["op"], r["impl"], harness.fmt(r["kernel_us"], ".1f"),
                      harness.fmt(r["gbps"], ".0f"),
                      harness.fmt(None if r["gbps"] is None or copy_gbps is None
                                  else 100 * r["gbps"] / copy_gbps, ".0f"),
                      harness.fmt(None if sz is None or r["kernel_us"] is None
                                  else 100 * sz / r["kernel_us"], ".0f"),
                      f"{r['err']:.2e}"])
    harness.print_columns(head, lines)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=name, torch=torch.__version__, triton=triton.__version__,
                           shape=[M, K], copy_gbps=copy_gbps, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
