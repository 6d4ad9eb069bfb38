"""RMSNorm: ``rms_norm`` (optionally fused with a residual add) and ``rms_norm_quant``
(RMSNorm fused with 1x128 FP8 quantization), with autograd.

Forward kernels live in ``linghe.fwd.norm``, the backward kernel in ``linghe.bwd.norm``.
"""

from __future__ import annotations

import torch

from .. import library
from ..bwd import norm as bwd
from ..fp8.tensor import Fp8Tensor
from ..fwd import norm as fwd
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    check_kernel_device,
    check_same_device,
    check_tensor,
    rows_view,
)


def _check(x, weight, eps, residual=None):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1, last_dim_contiguous=True)
    check_kernel_device("x", x)
    K = x.shape[-1]
    if K == 0:
        raise ValueError("x must have a non-empty last (hidden) dimension, got shape "
                         f"{tuple(x.shape)}")
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=1, shape=(K,))
    check_same_device(x=x, weight=weight, residual=residual)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape),
                     last_dim_contiguous=True)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def _grad_rows(g: torch.Tensor) -> torch.Tensor:
    """A gradient as ``[M, K]`` rows with a contiguous last dim (a broadcast gradient,
    e.g. of ``.sum()``, is materialized)."""
    if g.dim() > 0 and g.shape[-1] > 1 and g.stride(-1) != 1:
        g = g.contiguous()
    return rows_view(g)


def _norm_backward(ctx, dy, dh):
    """``(dx, dweight, dresidual)`` of a norm Function that saved ``(x or h, weight,
    rstd)`` and ``ctx.has_residual``: ``dh`` (the gradient at ``h``, or ``None``) is added
    inside the backward kernel; only ``dh`` arriving passes it to ``x`` and the
    residual."""
    saved, weight, rstd = ctx.saved_tensors
    if dy is None:
        dx = dh.to(saved.dtype) if dh is not None else None
        return dx, None, dx if ctx.has_residual else None
    shape = dy.shape
    dx, dw = bwd.rms_norm_bwd(_grad_rows(dy), saved, weight, rstd,
                              _grad_rows(dh) if dh is not None else None,
                              need_dweight=ctx.needs_input_grad[1])
    if len(shape) != 2:
        dx = dx.view(shape)
    return dx, dw, dx if ctx.has_residual else None


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with autograd; saves ``x`` (``h`` with a residual), ``weight`` and
    ``rstd [M] float32``."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        x2 = rows_view(x)
        r2 = rows_view(residual) if residual is not None else None
        y, h, rstd = fwd.rms_norm_fwd(x2, weight, eps, r2)
        saved = h if h is not None else x2
        ctx.save_for_backward(saved, weight, rstd)
        ctx.has_residual = residual is not None
        ctx.set_materialize_grads(False)
        if x.dim() != 2:  # (a view costs host time even when it changes nothing)
            y = y.view(x.shape)
            h = h.view(x.shape) if h is not None else None
        if h is None:
            return y
        return y, h

    @staticmethod
    def backward(ctx, dy, dh=None):
        return (*_norm_backward(ctx, dy, dh), None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension: ``y = x * rsqrt(mean(x^2) + eps) * weight``.

    Args:
        x: ``[..., K]`` float32/float16/bfloat16, CUDA (or CPU under the Triton
            interpreter), contiguous last dim; any ``K >= 1`` and any number of rows.
        weight: ``[K]`` float32/float16/bfloat16 (may differ from ``x``'s dtype).
        eps: added to the mean square.
        residual: optional ``[..., K]`` with ``x``'s shape and dtype. Then
            ``h = x + residual`` (rounded to ``x``'s dtype) is normalized and
            ``(rms_norm(h), h)`` is returned (fused add + norm; gradients reach ``x``,
            ``residual`` and ``weight``, including those flowing into ``h``).

    Returns ``y`` (``[..., K]``, ``x``'s dtype), or ``(y, h)`` with ``residual``. Math is
    fp32; ``dweight`` is reduced in fp32 deterministically. Saved for backward: ``x``
    (or ``h``), ``weight`` and ``rstd [M] float32``.
    """
    _check(x, weight, eps, residual)
    if torch.compiler.is_compiling():
        return library.rms_norm(x, weight, eps, residual)
    return apply_function(RMSNormFunction, x, weight.contiguous(), residual, float(eps))


class RMSNormQuantFunction(torch.autograd.Function):
    """``rms_norm_quant`` with a straight-through backward; saves ``x`` (``h`` with a
    residual), ``weight``, ``rstd``."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, columnwise, pow2_scale):
        x2 = rows_view(x)
        if residual is not None:
            x2 = x2 + rows_view(residual)  # h, as [M, K] rows
        # (scales group-major: what the FP8 Linear's cuBLAS GEMMs read, no copy there)
        q, s, qt, st, rstd = fwd.rms_norm_quant_fwd(x2, weight, eps, columnwise=columnwise,
                                                    pow2_scale=pow2_scale,
                                                    group_major_scales=True)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.has_residual = residual is not None
        ctx.set_materialize_grads(False)
        y = Fp8Tensor(x.shape, x.dtype, rowwise_data=q, rowwise_scale=s,
                      columnwise_data=qt, columnwise_scale=st, scaling="1x128")
        if residual is None:
            return y
        return y, (x2 if x.dim() == 2 else x2.view(x.shape))

    @staticmethod
    def backward(ctx, dy, dh=None):
        if isinstance(dy, Fp8Tensor):
            dy = dy.dequantize()
        return (*_norm_backward(ctx, dy, dh), None, None, None)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                   columnwise: bool = True, pow2_scale: bool = False,
                   residual: torch.Tensor | None = None):
    """RMSNorm fused with 1x128 FP8 (e4m3) quantization of its output.

    Normalizes ``x [..., K]`` (fp32 math) and quantizes the result in fp32: rowwise
    (``rowwise_data [M, K]``, ``rowwise_scale [M, ceil(K/128)]``; one pass that also
    computes rstd, two passes over rows wider than 8192) and, with ``columnwise``, the
    transpose in groups of 128 tokens (``columnwise_data [K, M]``, ``columnwise_scale [K,
    ceil(M/128)]``; a second kernel of ``[128, BN]`` tiles that re-reads ``x`` and applies
    the same rstd and weight, so both copies quantize the same fp32 values). Both scale
    tensors are stored group-major (``rowwise_scale.stride() == (1, M)``; under
    ``torch.compile`` contiguous), the layout the FP8 ``Linear``'s cuBLAS GEMMs read. The
    high-precision normalized output is never written. Arguments as :func:`rms_norm`;
    ``pow2_scale`` rounds scales up to powers of two.

    ``residual`` (optional, ``x``'s shape and dtype): the pre-norm block's residual add,
    ``h = x + residual`` (rounded to ``x``'s dtype) is normalized and ``(y, h)`` returned.
    The add is a separate kernel in the forward; in the backward the gradient arriving at
    ``h`` is added inside the norm's backward kernel (one rounding) instead of by a
    separate add.

    Returns an :class:`~linghe.fp8.Fp8Tensor` ``y`` with ``x``'s shape and dtype that
    carries autograd (or ``(y, h)`` with ``residual``): its backward treats the
    quantization as identity (straight-through) and gives the same ``dx``/``dweight``
    as :func:`rms_norm` (recomputed from ``x`` (``h``) and the saved ``rstd [M]
    float32``; ``x`` (``h``) and ``weight`` are saved too).
    """
    _check(x, weight, eps, residual)
    if torch.compiler.is_compiling():
        h = x if residual is None else x + residual
        y = library.rms_norm_quant(h, weight, eps, columnwise, pow2_scale)
        return y if residual is None else (y, h)
    return apply_function(RMSNormQuantFunction, x, weight.contiguous(), residual,
                          float(eps), bool(columnwise), bool(pow2_scale))


__all__ = ["RMSNormFunction", "RMSNormQuantFunction", "rms_norm", "rms_norm_quant"]
