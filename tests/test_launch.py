"""``linghe.utils.launch``: the lean launch path must pick the binary compiled for each
argument specialization (pointer alignment, integer divisibility / == 1, dtypes,
constexprs), exactly as ``kernel[grid](...)`` does."""

import pytest
import torch
import triton
import triton.language as tl

from linghe.utils import launch


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK: tl.constexpr,
                 NEG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs * stride, mask=mask, other=0.0).to(tl.float32)
    r = alpha * x + y
    if NEG:
        r = -r
    tl.store(out_ptr + offs * stride, r.to(out_ptr.dtype.element_ty), mask=mask)


def _run(x, y, alpha, neg, stride=1, block=64):
    n = x.numel() // stride if stride > 1 else x.numel()
    out = torch.full_like(x, float("nan"))
    launch(_axpy_kernel, (triton.cdiv(n, block),), x, y, out, n, stride, alpha, BLOCK=block,
           NEG=neg, num_warps=2)
    want = (alpha * x.float() + y.float()) * (-1 if neg else 1)
    idx = torch.arange(n, device=x.device) * stride
    torch.testing.assert_close(out.view(-1)[idx].float(), want.view(-1)[idx], rtol=1e-2,
                               atol=1e-2)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_specializations_share_nothing(device, dtype):
    base = torch.randn(4 * 257 + 3, device=device, dtype=dtype)
    other = torch.randn_like(base)
    # The same kernel called back to back with arguments whose specialization differs:
    # 16-byte aligned vs misaligned pointers, n divisible by 16 / not / == 1, stride 1 / 2,
    # both constexpr values. Each must run its own binary and give the right answer.
    for n in (256, 257, 1, 48):
        for off in (0, 1):
            x, y = base[off:off + n], other[off:off + n]
            for neg in (False, True):
                _run(x, y, 0.5, neg)
    _run(base[:256], other[:256], 2.0, False, stride=2)
    _run(base[1:257], other[1:257], -1.0, True, stride=2, block=32)


def test_returns_compiled_kernel_on_gpu(device):
    if device != "cuda":
        pytest.skip("the interpreter has no compiled kernel")
    x = torch.randn(100, device=device)
    out = torch.empty_like(x)
    first = launch(_axpy_kernel, (2,), x, x, out, 100, 1, 1.0, BLOCK=64, NEG=False)
    again = launch(_axpy_kernel, (2,), x, x, out, 100, 1, 1.0, BLOCK=64, NEG=False)
    assert first is again and int(again.n_regs) > 0


# --------------------------------------------------------------------------------------
# apply_function: the lean autograd entry every public op uses
# --------------------------------------------------------------------------------------

class _Scale(torch.autograd.Function):
    """y = x * w; saves both (to see that the no-grad path skips the bookkeeping)."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w, k: float):
        _Scale.calls += 1
        ctx.save_for_backward(x, w)
        ctx.set_materialize_grads(False)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * ctx.k, (g * x * ctx.k).sum(0), None


def test_apply_function_without_grad_runs_forward_only():
    from linghe.utils import apply_function

    x, w = torch.randn(3, 5), torch.randn(5)
    y = apply_function(_Scale, x, w, 2.0)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, x * w * 2.0)
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        y = apply_function(_Scale, xg, w, 2.0)
    assert y.grad_fn is None and not y.requires_grad


def test_apply_function_with_grad_matches_function_apply():
    from linghe.utils import apply_function

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    g = torch.randn(4, 3)
    apply_function(_Scale, x, w, 0.5).backward(g)
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    _Scale.apply(x, w, 0.5).backward(g)
    torch.testing.assert_close(dx, x.grad)
    torch.testing.assert_close(dw, w.grad)
    # only one input needing grad still records the graph
    x.grad = None
    y = apply_function(_Scale, x, w.detach(), 0.5)
    assert y.grad_fn is not None
    y.backward(g)
    torch.testing.assert_close(x.grad, dx)
