"""The CPU machinery's shortcuts through the Triton interpreter (tests/conftest.py,
``_patch_interpreter_dead_work``): ``tl.reduce`` with a combine function of its own gives
the bits of the interpreter's own element-by-element loop."""

import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _lopsided(a, b):  # not associative: the fold's order shows in the bits
    return a * 0.5 + b * 1.25


@triton.jit
def _sum_and_max(a0, a1, b0, b1):
    return a0 + b0, tl.where(a1 > b1, a1, b1)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _reduce_kernel(x_ptr, f_ptr, i_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    cols = tl.arange(0, C)
    rows = tl.arange(0, R)
    x = tl.load(x_ptr + r * C + c)
    xi = (x * 1000.0).to(tl.int32)
    tl.store(f_ptr + cols, tl.reduce(x, 0, _max_nan))
    tl.store(f_ptr + C + rows, tl.reduce(x, 1, _lopsided))
    tl.store(f_ptr + C + R + r, tl.reduce(x, 1, _lopsided, keep_dims=True))
    s, m = tl.reduce((x, x * 3.0), 0, _sum_and_max)
    tl.store(f_ptr + C + 2 * R + cols, s)
    tl.store(f_ptr + 2 * C + 2 * R + cols, m)
    tl.store(f_ptr + 3 * C + 2 * R, tl.reduce(tl.reshape(x, [R * C]), 0, _lopsided))
    v = tl.reshape(xi, [R * C])
    s1, s2 = tl.reduce((v, v * 7), 0, _add2)
    tl.store(i_ptr, s1)
    tl.store(i_ptr + 1, s2)
    tl.store(i_ptr + 2 + tl.arange(0, 1), tl.reduce(v, 0, _max_nan, keep_dims=True))
    tl.store(i_ptr + 3 + cols, tl.reduce(xi, 0, _add2_first))


@triton.jit
def _add2_first(a, b):
    return a + b


def _run(x):
    R, C = x.shape
    f = torch.full((3 * C + 2 * R + 1,), float("nan"))
    i = torch.full((3 + C,), -1, dtype=torch.int32)
    _reduce_kernel[(1,)](x, f, i, R=R, C=C)
    return f, i


@pytest.mark.parametrize("shape", [(1, 1), (1, 8), (16, 1), (8, 16), (32, 64)])
def test_custom_reduce_same_bits_as_element_loop(device, monkeypatch, shape):
    if device != "cpu":
        pytest.skip("the interpreter's shortcut (CPU only)")
    from triton.runtime import interpreter as interp

    fast = interp.ReduceOps.generic_reduce
    if not hasattr(fast, "__wrapped__"):
        pytest.skip("the shortcut is off (LINGHE_TEST_INTERPRETER_AS_IS=1) or not installed")
    x = torch.randn(shape) * 100
    if x.numel() > 1:
        x[0, -1] = float("nan")  # NaN propagates through the max
    got = _run(x)
    monkeypatch.setattr(interp.ReduceOps, "generic_reduce", fast.__wrapped__)
    want = _run(x)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    assert not got[0].isnan().all()  # written
