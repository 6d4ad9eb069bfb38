"""SwiGLU: ``silu_mul``, ``silu_mul_quant`` (fused FP8) and ``batch_silu_mul_quant``
(rows grouped by expert). autograd.Functions over :mod:`linghe.fwd.activation` and
:mod:`linghe.bwd.activation`; inputs are validated here."""

from __future__ import annotations

import math

import torch

from .. import library
from ..bwd import activation as _bwd
from ..fp8.tensor import Fp8Tensor
from ..fwd import activation as _fwd
from ..layout import ExpertLayout
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    check_kernel_device,
    check_same_device,
    check_tensor,
    debug_enabled,
    rows_view,
)

__all__ = ["batch_silu_mul_quant", "silu_mul", "silu_mul_quant"]


# ------------------------------------------------------------------------- validation
def _check_x(x: torch.Tensor, ndim=None) -> int:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1, ndim=ndim, last_dim_contiguous=True)
    check_kernel_device("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dimension must be even (gate half then up half), got "
                         f"shape {tuple(x.shape)}")
    return x.shape[-1] // 2


def _check_probs(probs, x: torch.Tensor) -> torch.Tensor | None:
    """``probs`` as a contiguous ``[M]`` tensor (M = rows of x), or None."""
    if probs is None:
        return None
    dtypes = (torch.float32,) if x.dtype == torch.float32 else (torch.float32, x.dtype)
    check_tensor("probs", probs, dtypes=dtypes)
    M = math.prod(x.shape[:-1])
    lead = tuple(x.shape[:-1])
    if tuple(probs.shape) not in ((M,), lead):
        raise ValueError(f"probs must have shape ({M},) or {lead} (one weight per row of x), "
                         f"got {tuple(probs.shape)}")
    check_same_device(x=x, probs=probs)
    return probs.reshape(M).contiguous()


def _grad_rows(dy: torch.Tensor, M: int, N: int) -> torch.Tensor:
    if dy.dim() == 2 and dy.is_contiguous():
        return dy
    return dy.contiguous().reshape(M, N)


# ------------------------------------------------------------------------- silu_mul
class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p1):
        x2 = rows_view(x)
        y = _fwd.silu_mul_fwd(x2, p1)
        ctx.save_for_backward(x2, p1)
        ctx.x_shape = x.shape
        return y if x.dim() == 2 else y.view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        x2, p1 = ctx.saved_tensors
        M, N = x2.shape[0], x2.shape[1] // 2
        dx, dp = _bwd.silu_mul_bwd(_grad_rows(dy, M, N), x2, p1,
                                   need_dprobs=ctx.needs_input_grad[1])
        return (dx if len(ctx.x_shape) == 2 else dx.view(ctx.x_shape)), dp


def silu_mul(x: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation: ``y = silu(x[..., :n]) * x[..., n:]`` (times ``probs[row]``).

    Args:
        x: ``[..., 2n]`` float32/float16/bfloat16, last dim contiguous, gate half first.
        probs: optional per-row weights (routed experts' router probabilities), shape
            ``[M]`` (M = product of x's leading dims) or ``x.shape[:-1]``, float32 or x's
            dtype.

    Returns ``y [..., n]`` in x's dtype, computed in fp32. Saved for backward: ``x`` and
    ``probs``. Gradients flow to ``x`` (x's dtype) and ``probs`` (probs' dtype; fp32 sum).
    """
    _check_x(x)
    p1 = _check_probs(probs, x)
    if torch.compiler.is_compiling():
        return library.silu_mul(x, p1)
    return apply_function(_SiluMul, x, p1)


# ------------------------------------------------------------------------- silu_mul_quant
class _SiluMulQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p1, columnwise, pow2):
        x2 = rows_view(x)
        q, s, qt, st = _fwd.silu_mul_quant_fwd(x2, p1, columnwise=columnwise,
                                               pow2_scale=pow2)
        ctx.save_for_backward(x2, p1)
        ctx.x_shape = x.shape
        return Fp8Tensor((*x.shape[:-1], x.shape[-1] // 2), x.dtype, rowwise_data=q,
                         rowwise_scale=s, columnwise_data=qt, columnwise_scale=st,
                         scaling="1x128")

    @staticmethod
    def backward(ctx, dy):
        x2, p1 = ctx.saved_tensors
        M, N = x2.shape[0], x2.shape[1] // 2
        if isinstance(dy, Fp8Tensor):
            dy = dy.dequantize()
        dx, dp = _bwd.silu_mul_bwd(_grad_rows(dy, M, N), x2, p1,
                                   need_dprobs=ctx.needs_input_grad[1])
        return dx.view(ctx.x_shape), dp, None, None


def silu_mul_quant(x: torch.Tensor, probs: torch.Tensor | None = None, *,
                   columnwise: bool = True, pow2_scale: bool = False) -> Fp8Tensor:
    """SwiGLU fused with 1x128 FP8 quantization of its output, in one pass.

    Args:
        x: ``[..., 2n]`` float32/float16/bfloat16 (last dim contiguous), gate half first.
        probs: optional ``[M]`` (or ``x.shape[:-1]``) per-row weights, fp32 or x's dtype.
        columnwise: also produce the columnwise copy (``y.T [n, M]`` in 1x128 groups of
            128 tokens), quantized from the same fp32 values as the rowwise copy.
        pow2_scale: round scales up to powers of two.

    Returns an :class:`Fp8Tensor` of logical shape ``[..., n]`` and x's dtype:
    ``rowwise_data [M, n]`` e4m3, ``rowwise_scale [M, cdiv(n,128)]``, and with
    ``columnwise`` ``columnwise_data [n, M]``, ``columnwise_scale [n, cdiv(M,128)]``.
    ``y`` itself is never materialised in high precision. It carries autograd: the
    backward is straight-through (``dx``, ``dprobs`` as :func:`silu_mul`'s backward for
    the incoming ``dy``). Saved for backward: ``x`` and ``probs``.
    """
    _check_x(x)
    p1 = _check_probs(probs, x)
    if torch.compiler.is_compiling():
        return library.silu_mul_quant(x, p1, columnwise, pow2_scale)
    return apply_function(_SiluMulQuant, x, p1, bool(columnwise), bool(pow2_scale))


# ------------------------------------------------------------------------- batch form
class _BatchSiluMulQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, counts, align, columnwise, pow2, segments):
        q, s, qt, st, g_off, seg_off = _fwd.batch_silu_mul_quant_fwd(
            x, probs, counts, align, columnwise=columnwise, pow2_scale=pow2)
        ctx.save_for_backward(x, probs, counts)
        ctx.align = align
        ctx.mark_non_differentiable(g_off)
        # The columnwise groups follow the expert segments: the tensor carries them (the
        # layout's own offsets when given, so that consumers can match them by identity).
        y = Fp8Tensor((x.shape[0], x.shape[1] // 2), x.dtype, rowwise_data=q, rowwise_scale=s,
                      columnwise_data=qt, columnwise_scale=st, scaling="1x128",
                      col_segments=(segments if segments is not None else seg_off)
                      if columnwise else None)
        return y, g_off

    @staticmethod
    def backward(ctx, dy, _dg_off):
        x, probs, counts = ctx.saved_tensors
        if isinstance(dy, Fp8Tensor):
            dy = dy.dequantize()
        dy = dy.contiguous()
        dx, dp = _bwd.silu_mul_bwd(dy, x, probs, need_dprobs=ctx.needs_input_grad[1],
                                   counts=counts, align=ctx.align)
        return dx, dp, None, None, None, None, None


def batch_silu_mul_quant(x: torch.Tensor, probs: torch.Tensor | None,
                         tokens_per_expert: torch.Tensor | None = None, *, align: int = 16,
                         layout: ExpertLayout | None = None, columnwise: bool = True,
                         pow2_scale: bool = False):
    """SwiGLU + 1x128 FP8 quantization of rows grouped by expert (the output of ``permute``).

    The rows follow :mod:`linghe.layout`: expert ``e``'s segment starts at
    ``offsets[e]`` (exclusive cumsum of ``roundup(tokens_per_expert, align)``) and holds
    its real rows first, then padding; rows from ``offsets[E]`` to ``R`` are tail. Padding
    and tail rows of ``x`` are never read: their outputs are zeros (scale 1).

    Args:
        x: ``[R, 2n]`` float32/float16/bfloat16 (last dim contiguous), gate half first.
        probs: ``[R]`` per-row weights (fp32 or x's dtype) or None.
        tokens_per_expert: ``[E]`` int32/int64 real rows per expert, on x's device. Read
            on the device only: no host sync. (Give this or ``layout``.)
        align: segment alignment in rows (with ``tokens_per_expert``).
        layout: an :class:`~linghe.layout.ExpertLayout` instead of ``tokens_per_expert``
            and ``align`` (its ``num_rows`` must equal ``R``).
        columnwise: also produce the segment-grouped columnwise copy.
        pow2_scale: power-of-two scales.

    Returns ``(y, col_group_offsets)``:

    - ``y``: :class:`Fp8Tensor`, logical ``[R, n]``, x's dtype. ``rowwise_data [R, n]``,
      ``rowwise_scale [R, cdiv(n,128)]`` as in :func:`silu_mul_quant`. ``columnwise_data
      [n, R]`` (row ``c`` = column ``c`` of ``y`` over all rows, in row order) with
      ``columnwise_scale [n, G]``, ``G = cdiv(R,128) + E`` (a static bound): the 1x128
      groups along tokens start at each expert's segment start and never cross segments
      (the last group of a segment may be partial). ``y.col_segments`` holds the segment
      offsets ``[E + 1]`` that these groups follow (``layout.offsets`` itself when
      ``layout`` is given), so ``y.dequantize(columnwise=True)`` is exact and consumers
      that need plain groups (``linghe.fp8.gemm.wgrad``, ``fp8_linear``) refuse or
      requantize it.
    - ``col_group_offsets``: ``[E + 1]`` int32 device tensor; expert ``e``'s columnwise
      groups are scale columns ``[g_off[e], g_off[e+1])``, ``g_off[e] = sum_{j<e}
      cdiv(padded_j, 128)``; group ``g_off[e] + i`` covers rows ``offsets[e] + 128 i`` ..
      (clipped to the segment). Scale columns from ``g_off[E]`` on are 1 (tail/unused).

    Backward (straight-through, as :func:`silu_mul_quant`): ``dx [R, 2n]`` with zeros on
    padding/tail rows, and ``dprobs [R]`` (zeros there too). Saved: ``x``, ``probs`` and
    the counts.

    Out-of-contract counts never cause out-of-bounds access: negative counts count as 0
    and rows past ``R`` are dropped. With ``linghe.set_debug(True)`` (host sync) they
    raise ``ValueError`` instead.
    """
    _check_x(x, ndim=2)
    R = x.shape[0]
    if layout is not None:
        if not isinstance(layout, ExpertLayout):
            raise TypeError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
        if tokens_per_expert is not None:
            raise ValueError("give tokens_per_expert or layout, not both")
        if layout.num_rows != R:
            raise ValueError(f"layout.num_rows ({layout.num_rows}) must equal x.shape[0] ({R})")
        tokens_per_expert, align = layout.tokens_per_expert, layout.align
    if tokens_per_expert is None:
        raise ValueError("tokens_per_expert (or layout) is required")
    check_tensor("tokens_per_expert", tokens_per_expert, dtypes=(torch.int32, torch.int64),
                 ndim=1)
    if tokens_per_expert.numel() < 1:
        raise ValueError("tokens_per_expert must have at least one expert")
    check_same_device(x=x, tokens_per_expert=tokens_per_expert)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align must be a positive int, got {align!r}")
    p1 = _check_probs(probs, x)
    counts = tokens_per_expert.contiguous()
    segments = layout.offsets if layout is not None else None
    if debug_enabled():
        c = counts.long().cpu()
        if bool((c < 0).any()):
            raise ValueError(f"tokens_per_expert must be non-negative, got {c.tolist()}")
        used = int(((c + align - 1) // align * align).sum())
        if used > R:
            raise ValueError(f"tokens_per_expert padded to align={align} needs {used} rows, "
                             f"but x has {R}")
    if torch.compiler.is_compiling():
        return library.batch_silu_mul_quant(x, p1, counts, align, columnwise, pow2_scale,
                                            segments)
    return apply_function(_BatchSiluMulQuant, x, p1, counts, align, bool(columnwise),
                          bool(pow2_scale), segments)
