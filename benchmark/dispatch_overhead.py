"""Host µs per call of linghe ops, eager vs ``torch.compile``: ``python -m
benchmark.dispatch_overhead``.

Same method as :mod:`benchmark.host` (back-to-back calls, no sync, GPU kept busy so the
host never waits). Columns, per op:

- ``eager``: the public op (``linghe.rms_norm(...)``), the path a training step runs today;
- ``custom op``: the ``torch.ops.linghe.*`` op of ``linghe/library.py`` called directly
  (what a compiled graph runs per op: the dispatcher plus the launcher; for the FP8 Linear
  the small ``autograd.Function`` of ``linghe.library`` around its ops);
- ``compiled``: ``torch.compile(fn, fullgraph=True)`` of a function calling the public op
  (the graph's guards and wrappers on top of the custom op; ``--backend``, default
  inductor on a GPU, aot_eager on CPU);
- ``cudagraph``: the same with ``mode="reduce-overhead"`` (CUDA graphs: one replay per
  call; GPU only).

A row that fails prints ``error`` and the reason; the others still run. On CPU the kernels
run through the Triton interpreter, so the numbers only show that the script runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import linghe  # noqa: E402
from linghe import library  # noqa: E402

from .host import HostCase, host_us  # noqa: E402


def _ops(device: str, small: bool):
    """``(name, eager fn, custom-op fn, args, backward, context)`` rows; the context (an
    FP8 ``TrainingContext`` or None) is entered around the timing, outside the compiled
    function (entering one is not traceable)."""
    T, H = (64, 256) if small else (8192, 2048)
    E, In = (8, 128) if small else (256, 1024)
    bf = torch.bfloat16
    L = torch.ops.linghe
    x = torch.randn(T, H, device=device, dtype=bf)
    w = torch.rand(H, device=device, dtype=bf) + 0.5
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    h2 = torch.randn(T, 2 * In, device=device, dtype=bf)
    rw = torch.randn(E, H, device=device) * 0.02
    lin = linghe.nn.Linear(H, 384 if small else 3072, bias=False, device=device, dtype=bf)
    ctx = linghe.TrainingContext(fp8="blockwise")

    def fp8_linear_op(x):  # (the op's autograd is the small Function around it)
        return library.fp8_linear(x, lin.weight, None, ctx.recipe, x.requires_grad)

    return [
        ("rms_norm fwd", lambda x: linghe.rms_norm(x, w),
         lambda x: L.rms_norm_fwd(x, w, None, 1e-6)[0], (x,), False, None),
        ("rms_norm fwd+bwd", lambda x: linghe.rms_norm(x, wg),
         lambda x: L.rms_norm_fwd(x, wg, None, 1e-6)[0], (xg,), True, None),
        ("rms_norm_quant row+col", lambda x: linghe.rms_norm_quant(x, w).rowwise_data,
         lambda x: L.rms_norm_quant_fwd(x, w, 1e-6, True, False)[0], (x,), False, None),
        ("quantize_1x128 row+col",
         lambda x: linghe.quantize_1x128(x, columnwise=True).rowwise_data,
         lambda x: L.quantize_1x128(x, True, True, False)[0], (x,), False, None),
        ("silu_mul fwd", lambda h: linghe.silu_mul(h), lambda h: L.silu_mul_fwd(h, None),
         (h2,), False, None),
        ("router_logits fwd", lambda x: linghe.router_logits(x, rw),
         lambda x: L.router_logits_fwd(x, rw), (x,), False, None),
        ("nn.Linear fp8 fwd", lambda x: lin(x), fp8_linear_op, (x,), False, ctx),
        ("nn.Linear fp8 fwd+bwd", lambda x: lin(x), fp8_linear_op, (xg,), True, ctx),
    ]


def _measure(fn, args, backward: bool, calls: int, device: str, ctx):
    try:
        with ctx if ctx is not None else contextlib.nullcontext():
            us = host_us(HostCase("", lambda: fn(*args), backward=backward), calls, device)
        return us, None
    except Exception as e:  # noqa: BLE001 - one row's failure is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.dispatch_overhead",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--calls-bwd", type=int, default=40)
    p.add_argument("--backend", default=None, help="torch.compile backend")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = args.backend or ("inductor" if device == "cuda" else "aot_eager")
    rows, errors = [], []
    for name, eager, op, inputs, bwd, ctx in _ops(device, small=device == "cpu"):
        n = 2 if device == "cpu" else (args.calls_bwd if bwd else args.calls)
        row = {"op": name}
        variants = [("eager", eager), ("custom op", op),
                    ("compiled", torch.compile(eager, fullgraph=True, backend=backend))]
        if device == "cuda":
            variants.append(("cudagraph", torch.compile(eager, fullgraph=True,
                                                        mode="reduce-overhead")))
        for col, fn in variants:
            row[col], err = _measure(fn, inputs, bwd, n, device, ctx)
            if err:
                errors.append(f"{name} / {col}: {err}")
        rows.append(row)
    cols = ["eager", "custom op", "compiled"] + (["cudagraph"] if device == "cuda" else [])
    print(f"host µs per call ({device}, compile backend {backend}; {args.calls} calls, "
          f"{args.calls_bwd} for fwd+bwd)")
    print(f"{'op':26s}" + "".join(f"{c:>12s}" for c in cols))
    fmt = lambda v: "error" if v is None else f"{v:.1f}"
    for r in rows:
        print(f"{r['op']:26s}" + "".join(f"{fmt(r[c]):>12s}" for c in cols))
    for e in errors:
        print("  " + e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "torch": torch.__version__, "backend": backend, "rows": rows,
                       "errors": errors}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
