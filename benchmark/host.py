"""Host time per call of linghe's public ops: ``python -m benchmark.host``.

What a training step feels when the GPU is fast and the host is slow: the Python and launch
work one call costs on the CPU. Measured as in ANCHORS.md: ``--calls`` back-to-back calls
after warm-up, no sync inside the loop, with a long spin kernel queued first so that the
host never waits for the GPU (the queue never drains while timing). ``fwd`` times the op;
``fwd+bwd`` times ``op(...)`` plus ``backward()`` through autograd. A CUDA stream holds
about a thousand pending launches; past that a launch blocks until the GPU drains, which
behind the spin means waiting for it. So fwd+bwd rows, which launch several kernels per
call, run fewer calls (``--calls-bwd``), keeping the queue under that depth.

The ``linghe 0.3`` and ``torch`` columns are the reference numbers of ANCHORS.md (the
earlier open-source linghe's raw launcher and PyTorch's native op, measured on the H200
host); the ``torch`` rows measured here (``F.rms_norm``...) run in the same process as
ours, so compare ours with those first. ``--profile NAME`` prints cProfile's top entries
for one row, to see where a call's host time goes.

On CPU (no GPU) the kernels run through the Triton interpreter, so the numbers are
interpreter time, not host overhead: use it only to check that the script runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import linghe  # noqa: E402
from linghe.utils import launch  # noqa: E402

from .harness import host_us as harness_host_us  # noqa: E402

#: Reference host µs per call from ANCHORS.md (H200 host, torch 2.11, triton 3.6):
#: (earlier linghe 0.3 raw launcher, PyTorch native) or None where not measured.
ANCHOR_US = {
    "rms_norm fwd": (50.3, 11.5),
    "rms_norm fwd+bwd": (None, 114.3),
    "silu_mul(probs) fwd": (37.3, None),
    "quantize_1x128 row+col": (None, None),
    "rms_norm_quant row+col": (None, None),
}


@triton.jit
def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@dataclass
class HostCase:
    name: str
    run: Callable[[], object]
    backward: bool = False
    #: run the backward on the calling thread (``torch.autograd.set_multithreading_enabled
    #: (False)``) instead of the autograd engine's device thread
    caller_thread: bool = False
    #: back-to-back calls for this row on a GPU (rows that launch many kernels per call
    #: need fewer to stay under the launch queue's depth); ``None``: ``--calls`` or
    #: ``--calls-bwd``
    calls: int | None = None


def _cases(device: str, small: bool) -> list[HostCase]:
    T, H = (64, 256) if small else (8192, 2048)
    E, k, In = (8, 2, 128) if small else (256, 8, 1024)
    bf = torch.bfloat16
    x = torch.randn(T, H, device=device, dtype=bf)
    xg = x.clone().requires_grad_()
    w = torch.rand(H, device=device, dtype=bf) + 0.5
    wg = w.clone().requires_grad_()
    h2 = torch.randn(T, 2 * In, device=device, dtype=bf, requires_grad=True)
    probs_t = torch.rand(T, device=device)
    router_w = torch.randn(E, H, device=device) * 0.02
    logits = torch.randn(T, E, device=device)
    out: list[HostCase] = [
        HostCase("rms_norm fwd", lambda: linghe.rms_norm(x, w)),
        HostCase("torch F.rms_norm fwd", lambda: F.rms_norm(x, (H,), w, 1e-6)),
        HostCase("rms_norm fwd+bwd", lambda: linghe.rms_norm(xg, wg), backward=True),
        HostCase("torch F.rms_norm fwd+bwd", lambda: F.rms_norm(xg, (H,), wg, 1e-6),
                 backward=True),
        HostCase("rms_norm_quant row+col", lambda: linghe.rms_norm_quant(x, w)),
        HostCase("quantize_1x128 row+col",
                 lambda: linghe.quantize_1x128(x, rowwise=True, columnwise=True)),
        HostCase("silu_mul(probs) fwd", lambda: linghe.silu_mul(h2.detach(), probs_t)),
        HostCase("silu_mul fwd+bwd", lambda: linghe.silu_mul(h2), backward=True),
        HostCase("silu_mul_quant row+col", lambda: linghe.silu_mul_quant(h2.detach())),
        HostCase("router_logits fwd", lambda: linghe.router_logits(x, router_w)),
        HostCase("topk_route sigmoid groups",
                 lambda: linghe.topk_route(logits, k, score="sigmoid", num_groups=8 if not small
                                           else 2, topk_groups=4 if not small else 1)),
        HostCase("empty torch op (x.add_(0))", lambda: probs_t.add_(0)),
        HostCase("triton launch kernel[grid](...)",
                 lambda: _copy_kernel[(1,)](probs_t, probs_t, 64, BLOCK=64)),
        HostCase("triton launch linghe.utils.launch",
                 lambda: launch(_copy_kernel, (1,), probs_t, probs_t, 64, BLOCK=64)),
    ]
    # nn.Linear bf16 vs FP8 (fwd+bwd), the layer FP8 training lives in.
    lin = linghe.nn.Linear(H, 3 * H // 2 if not small else 384, bias=False, device=device,
                           dtype=bf)
    ctx = linghe.TrainingContext(fp8="blockwise")

    def fp8_linear():
        with ctx:
            return lin(xg)

    def fp8_linear_fwd_nograd():
        with ctx, torch.no_grad():
            return lin(xg)

    # The pieces of an FP8 Linear call, to see where its host time goes: the autograd
    # floor of a custom Function (fwd+bwd that launch nothing), the quantization of the
    # input, one FP8 GEMM (linghe's dispatch, and torch._scaled_mm alone), the forward
    # without and with autograd.
    xq = linghe.quantize_1x128(x, rowwise=True, columnwise=False, pow2_scale=True)
    with ctx:
        wq = lin._fp8_weight_cache.get_for_recipe(lin.weight, linghe.current_recipe(), "w")
        recipe = linghe.current_recipe()
    from linghe.fp8 import gemm as fp8_gemm
    sx_cublas, sw_cublas = fp8_gemm._torch_scales(xq.rowwise_scale, "1x128",
                                                  wq.rowwise_scale, "128x128", H)
    out += [HostCase("nn.Linear bf16 fwd+bwd", lambda: lin(xg), backward=True),
            HostCase("nn.Linear fp8 fwd+bwd", fp8_linear, backward=True),
            HostCase("  autograd Function floor fwd+bwd", lambda: _Noop.apply(xg),
                     backward=True),
            # The same calls with the backward on the calling thread: what the hand-off to
            # the autograd engine's device thread costs.
            HostCase("nn.Linear bf16 fwd+bwd, caller-thread bwd", lambda: lin(xg),
                     backward=True, caller_thread=True),
            HostCase("nn.Linear fp8 fwd+bwd, caller-thread bwd", fp8_linear, backward=True,
                     caller_thread=True),
            HostCase("  autograd Function floor, caller-thread bwd", lambda: _Noop.apply(xg),
                     backward=True, caller_thread=True),
            HostCase("rms_norm fwd+bwd, caller-thread bwd", lambda: linghe.rms_norm(xg, wg),
                     backward=True, caller_thread=True),
            HostCase("torch F.rms_norm fwd+bwd, caller-thread bwd",
                     lambda: F.rms_norm(xg, (H,), wg, 1e-6), backward=True,
                     caller_thread=True),
            HostCase("  Python-Function bf16 linear fwd+bwd",
                     lambda: _PyLinear.apply(xg, lin.weight), backward=True),
            HostCase("  nn.Linear fp8 fwd (no grad)", fp8_linear_fwd_nograd),
            HostCase("  nn.Linear fp8 fwd (grad)", fp8_linear),
            HostCase("  nn.Linear fp8 backward body (no engine)",
                     lambda: _fp8_linear_backward_body(lin, xg, ctx)),
            HostCase("  nn.Linear fp8 fwd+bwd, triton GEMMs",
                     lambda: _with_env("LINGHE_FP8_GEMM_BACKEND", "triton", fp8_linear),
                     backward=True),
            HostCase("  _scaled_mm in an autograd backward", lambda: _ScaledMmInBackward.apply(
                xg, xq.rowwise_data, wq.rowwise_data, sx_cublas, sw_cublas),
                backward=True) if device == "cuda" else None,
            HostCase("  triton launch in an autograd backward", lambda: _InBackward.apply(
                xg, lambda: launch(_copy_kernel, (1,), probs_t, probs_t, 64, BLOCK=64)),
                backward=True),
            HostCase("  quantize row+col in an autograd backward", lambda: _InBackward.apply(
                xg, lambda: linghe.quantize_1x128(x, rowwise=True, columnwise=True)),
                backward=True),
            HostCase("  quantize_1x128 row+col (dy)", lambda: linghe.quantize_1x128(
                x, rowwise=True, columnwise=True, pow2_scale=True)),
            HostCase("  x.grad-like add_ (AccumulateGrad)", lambda: x.add_(0)),
            HostCase("  TrainingContext enter+exit", lambda: _enter_exit(ctx)),
            HostCase("  WeightCache hit", lambda: lin._fp8_weight_cache.get_for_recipe(
                lin.weight, recipe, "w")),
            HostCase("  quantize_1x128 row", lambda: linghe.quantize_1x128(
                x, rowwise=True, columnwise=False, pow2_scale=True)),
            HostCase("  fp8 gemm._gemm fprop", lambda: fp8_gemm._fprop(
                xq, wq, None, torch.bfloat16)),
            HostCase("  torch._scaled_mm fprop", lambda: torch._scaled_mm(
                xq.rowwise_data, wq.rowwise_data.t(), sx_cublas, sw_cublas,
                out_dtype=torch.bfloat16)) if device == "cuda" else None]
    out += _moe_cases(device, small)
    return [c for c in out if c is not None]


def _moe_cases(device: str, small: bool) -> list[HostCase]:
    """``linghe.nn.MoE`` forward+backward, bf16 and FP8, at an EP-8 GPU's share of the
    Ling-mini layer (32 experts top-8, intermediate 1024, 8192 tokens): the layer whose
    host time decides whether the FP8 step keeps ahead of its GPU work."""
    T, H, E, k, In = (64, 256, 8, 2, 128) if small else (8192, 2048, 32, 8, 1024)

    @functools.cache
    def layer():  # made on the first call: runs of other rows do not allocate it
        torch.manual_seed(0)
        moe = linghe.nn.MoE(H, E, k, In, device=device, dtype=torch.bfloat16)
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
        return moe, x, linghe.TrainingContext(fp8="blockwise")

    def bf16_moe():
        moe, x, _ = layer()
        return moe(x)

    def fp8_moe():
        moe, x, ctx = layer()
        with ctx:
            return moe(x)

    # ~60 launches per fwd+bwd: 10 calls stay under the launch queue's depth
    return [HostCase(f"nn.MoE bf16 fwd+bwd (E{E} top{k})", bf16_moe, backward=True,
                     caller_thread=True, calls=10),
            HostCase(f"nn.MoE fp8 fwd+bwd (E{E} top{k})", fp8_moe, backward=True,
                     caller_thread=True, calls=10)]


class _FakeCtx:
    """What ``_Fp8Linear.backward`` reads from its ctx, without the autograd engine."""

    needs_input_grad = (True, True, False, False, False, False, False)


_BWD_STATE: dict = {}


def _fp8_linear_backward_body(lin, x, ctx) -> None:
    """``_Fp8Linear.backward`` called directly (its forward ran once into a fake ctx):
    the backward's own host time, without the engine's."""
    from linghe.functional.linear import _Fp8Linear

    st = _BWD_STATE.get(id(lin))
    if st is None:
        fake = _FakeCtx()
        with ctx, torch.no_grad():
            y = _Fp8Linear.forward(fake, x.detach(), lin.weight, None,
                                   linghe.current_recipe(), lin._fp8_weight_cache, id(lin),
                                   True)
        saved = dict(vars(fake))
        st = _BWD_STATE[id(lin)] = (fake, saved, torch.randn_like(y))
    fake, saved, dy = st
    vars(fake).update(saved)
    return _Fp8Linear.backward(fake, dy)


def _with_env(name: str, value: str, fn):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


class _InBackward(torch.autograd.Function):
    """Identity whose backward calls ``fn()`` (on the autograd engine's thread)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.fn()
        return g, None


class _PyLinear(torch.autograd.Function):
    """``x @ w.T`` as a Python autograd Function (bf16 GEMMs): what the engine costs a
    Python backward that launches GEMMs, next to the FP8 Linear's."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class _ScaledMmInBackward(torch.autograd.Function):
    """Identity whose backward runs one ``torch._scaled_mm`` (on the autograd thread)."""

    @staticmethod
    def forward(ctx, x, a, b, sa, sb):
        ctx.args = (a, b, sa, sb)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        a, b, sa, sb = ctx.args
        torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16)
        return g, None, None, None, None


def _enter_exit(ctx) -> None:
    with ctx:
        pass


class _Noop(torch.autograd.Function):
    """A custom Function that launches nothing: the autograd floor of an op."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    return next(o for o in out if isinstance(o, torch.Tensor))


def _call(c: HostCase):
    out = c.run()
    if c.backward:
        y = _first_tensor(out)
        key = (y.shape, y.dtype, y.device)
        if key not in _GRADS:  # (one gradient per shape: no randn on the timed path)
            _GRADS[key] = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
        if c.caller_thread:
            with torch.autograd.set_multithreading_enabled(False):
                y.backward(_GRADS[key])
        else:
            y.backward(_GRADS[key])
    return out


_GRADS: dict = {}


def host_us(c: HostCase, calls: int, device: str) -> tuple[float, bool]:
    """``(host µs per call, waited)``: see :func:`benchmark.harness.host_us`."""
    if device == "cuda":
        return harness_host_us(lambda: _call(c), calls, spin_us=300_000.0)
    for _ in range(2):
        _call(c)
    t0 = time.perf_counter()
    for _ in range(calls):
        _call(c)
    return (time.perf_counter() - t0) / calls * 1e6, False


def _profiled_calls(c: HostCase, calls: int, device: str, profiler):
    """Warm up, queue a GPU spin, then run ``calls`` calls inside ``profiler`` (a context
    manager); returns it."""
    for _ in range(3):
        _call(c)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
    with profiler:
        for _ in range(calls):
            _call(c)
    if device == "cuda":
        torch.cuda.synchronize()
    return profiler


def profile(c: HostCase, calls: int, device: str) -> None:
    """cProfile's top entries by own time, then by cumulative time (the calling thread
    only: rows with ``caller_thread`` run their backward there too)."""
    import cProfile
    import pstats

    pr = _profiled_calls(c, calls, device, cProfile.Profile())
    stats = pstats.Stats(pr)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def torch_profile(c: HostCase, calls: int, device: str) -> None:
    """torch.profiler's CPU view (covers the autograd engine's own thread, which cProfile
    does not see): self CPU time per op, and the launches."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    prof = _profiled_calls(c, calls, device, tprofile(activities=[ProfilerActivity.CPU]))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                    max_name_column_width=70))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--calls-bwd", type=int, default=40,
                   help="calls for fwd+bwd rows (each launches several kernels)")
    p.add_argument("--case", nargs="*", default=None, help="substrings of row names")
    p.add_argument("--profile", default=None, help="cProfile one row (substring)")
    p.add_argument("--torch-profile", default=None,
                   help="torch.profiler CPU table of one row (substring)")
    p.add_argument("--loop", type=float, default=None,
                   help="run the first selected row back to back for this many seconds "
                        "(a sync every 20 calls) and exit: a target for a sampling "
                        "profiler such as py-spy")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = args.calls if device == "cuda" else 2
    cases = _cases(device, small=device == "cpu")
    if args.case:
        cases = [c for c in cases if any(s in c.name for s in args.case)]

    def calls_of(c: HostCase) -> int:
        if device != "cuda":
            return calls
        if c.calls is not None:
            return c.calls
        many = c.backward or "backward body" in c.name
        return args.calls_bwd if many else calls

    if args.loop:
        c = cases[0]
        print(f"== looping {c.name} for {args.loop:.1f} s")
        t_end = time.perf_counter() + args.loop
        n = 0
        while time.perf_counter() < t_end:
            for _ in range(20):
                _call(c)
            n += 20
            if device == "cuda":
                torch.cuda.synchronize()
        print(f"{n} calls")
        return 0
    for name, run, what in ((args.torch_profile, torch_profile, "torch.profiler"),
                            (args.profile, profile, "cProfile")):
        if name:
            for c in cases:
                if name in c.name:
                    print(f"== {what}: {c.name} ({calls_of(c)} calls)")
                    run(c, calls_of(c), device)
            return 0
    rows = []
    for c in cases:
        us, waited = host_us(c, calls_of(c), device)
        old, native = ANCHOR_US.get(c.name, (None, None))
        rows.append({"op": c.name, "host_us": us, "waited": waited, "linghe03_us": old,
                     "torch_anchor_us": native})
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    print(f"host µs per call ({device}, {calls} back-to-back calls ({args.calls_bwd} for "
          f"fwd+bwd), GPU kept busy)")
    print(f"{'op':34s} {'ours':>8s} {'linghe0.3':>10s} {'torch(anchor)':>14s}")
    for r in rows:
        print(f"{r['op']:34s} {fmt(r['host_us']):>8s} {fmt(r['linghe03_us']):>10s} "
              f"{fmt(r['torch_anchor_us']):>14s}" + ("  (waited for the GPU)" if r["waited"]
                                                     else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
