"""Grouped GEMMs over rows grouped by expert: autograd Function, public functions and
input validation.

``linghe.grouped_mm(rows, weight, layout)`` computes, for every expert ``e`` of an
:class:`~linghe.layout.ExpertLayout`, ``out[o_e:o_{e+1}] = rows[o_e:o_{e+1}] @ W_e^T``
with weights ``[E, N, K]`` (``nn.Linear`` convention), in one launch, reading the segment
offsets on the device (no host sync). Its backward gives ``d_rows = d_out_e @ W_e`` and
``dW_e = d_out_e^T @ rows_e`` per expert.

Kernel-level FP8 API (the blockwise recipe; ``TrainingContext(fp8="blockwise")`` wires it
in later): :func:`quantize_grouped_weight`, :func:`grouped_mm_fp8`,
:func:`grouped_mm_fp8_dgrad`, :func:`grouped_mm_fp8_wgrad`.
"""

from __future__ import annotations

import os

import torch

from .. import library
from ..bwd import grad_norms
from ..bwd import grouped_mm as bwd
from ..bwd.accumulate import accumulation_param, grad_to_accumulate, take_grad
from ..bwd.deferred import WgradPart, defer, deferrable, parts_wgrad
from ..fp8 import Fp8Tensor, quantize_1x128
from ..fp8.cache import WeightCache
from ..fwd import grouped_mm as fwd
from ..fwd.grouped_mm import quantize_grouped_weight
from ..layout import ExpertLayout
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    check_kernel_device,
    check_same_device,
    check_tensor,
)

BACKENDS = ("auto", "triton", "torch")

#: A proposed ``backend="auto"`` rule for bf16/fp16, off by default (0; not yet timed in
#: a training step; on sm_90 it matters only with ``LINGHE_HP_WS=0`` or without Gluon,
#: since the warp-specialized kernel already takes the forward and dgrad there): where
#: ``torch._grouped_mm`` would run, the forward and dgrad take
#: linghe's TMA rows kernel instead when the layout averages at most this many rows per
#: expert (``num_rows / E``: e.g. ~271 for 256 experts at 8192 tokens top-8, where
#: CUTLASS's grouped GEMM is weak), and ``N`` is a multiple of 64 (the dgrad's TMA
#: boxes); the wgrad stays on ``torch._grouped_mm``. ``LINGHE_GROUPED_MM_ROWS_TRITON_MAX``
#: (e.g. 512). See ``benchmark/probe_grouped_bf16.py``.
ROWS_TRITON_MAX_ROWS_PER_EXPERT: int = int(os.environ.get("LINGHE_GROUPED_MM_ROWS_TRITON_MAX",
                                                          "0"))
#: The resolved backend of that rule and of sm_90's (internal): linghe's fwd/dgrad, the
#: wgrad by ``grouped_mm_wgrad``'s ``"auto"``.
_TRITON_ROWS = "triton_rows"

__all__ = ["grouped_mm", "grouped_mm_fp8", "grouped_mm_fp8_dgrad", "grouped_mm_fp8_wgrad",
           "quantize_grouped_1x128", "quantize_grouped_weight"]


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------


def _offsets_of(layout, num_experts: int, num_rows: int, device) -> torch.Tensor:
    """``offsets [E + 1]`` int32 from an ExpertLayout or an offsets tensor, validated
    (shape, dtype, device; values are not read: that would be a host sync)."""
    if isinstance(layout, ExpertLayout):
        if layout.num_experts != num_experts:
            raise ValueError(f"layout.num_experts ({layout.num_experts}) must equal the "
                             f"weight's expert count E={num_experts}")
        if layout.num_rows != num_rows:
            raise ValueError(f"layout.num_rows ({layout.num_rows}) must equal the number of "
                             f"rows R={num_rows}")
        offsets = layout.offsets
        name = "layout.offsets"
    elif isinstance(layout, torch.Tensor):
        offsets = layout
        name = "offsets"
    else:
        raise TypeError(f"layout must be an ExpertLayout or an int32 offsets tensor [E + 1], "
                        f"got {type(layout).__name__}")
    check_tensor(name, offsets, dtypes=(torch.int32, torch.int64), ndim=1,
                 shape=(num_experts + 1,))
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the operands are on {device}")
    if offsets.dtype != torch.int32:
        offsets = offsets.to(torch.int32)
    return offsets if offsets.is_contiguous() else offsets.contiguous()


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" and not hasattr(torch, "_grouped_mm"):
        raise ValueError("backend='torch' needs torch._grouped_mm (torch >= 2.8)")


def _check_operands(rows, weight):
    check_tensor("rows", rows, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=3, contiguous=True)
    if weight.dtype != rows.dtype:
        raise TypeError(f"weight must have rows' dtype {rows.dtype}, got {weight.dtype}")
    if weight.shape[0] < 1:
        raise ValueError("weight must hold at least one expert (E >= 1)")
    if weight.shape[2] != rows.shape[1]:
        raise ValueError(f"weight must have shape (E, N, K={rows.shape[1]}) to match rows "
                         f"[R, K], got {tuple(weight.shape)}")
    check_same_device(rows=rows, weight=weight)
    check_kernel_device("rows", rows)


# --------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------


class _ColumnwiseCopy:
    """The columnwise half of an :class:`Fp8Tensor` (what the FP8 dgrad/wgrad launchers
    read), without the rowwise copy, so that the latter is freed after the forward."""

    __slots__ = ("shape", "columnwise_data", "columnwise_scale")

    def __init__(self, t: Fp8Tensor):
        self.shape = t.shape
        self.columnwise_data = t.columnwise_data
        self.columnwise_scale = t.columnwise_scale


class GroupedMMFunction(torch.autograd.Function):
    """Saved for backward: ``rows``, ``weight`` and ``offsets`` (high precision); with
    ``fp8=True`` instead the columnwise 1x128 copy of ``rows`` (for the wgrad) and the
    columnwise 128x128 copy of the weight (for the dgrad), each only when the other
    operand needs a gradient. ``wgrad_micro_batches > 1`` (high precision only): the
    weight gradient is deferred (:mod:`linghe.bwd.deferred`)."""

    @staticmethod
    def forward(ctx, rows, weight, offsets, fp8, backend, pow2_scale, weight_cache=None,
                wgrad_micro_batches=1):
        ctx.fp8, ctx.backend, ctx.pow2 = fp8, backend, pow2_scale
        need_dx, need_dw = rows.requires_grad, weight.requires_grad
        if not fp8:
            out = fwd.grouped_mm_fwd(rows, weight, offsets, backend=_rows_backend(backend))
            ctx.save_for_backward(rows if need_dw else None, weight if need_dx else None,
                                  offsets)
            ctx.w_param = accumulation_param(weight)
            ctx.defer = (deferrable(weight, wgrad_micro_batches), wgrad_micro_batches)
            # (the optimizer asked for this weight's gradient norm: grad_norms)
            ctx.norm_w = weight if need_dw and grad_norms.watched(weight) else None
            return out
        a = quantize_1x128(rows, rowwise=True, columnwise=need_dw, pow2_scale=pow2_scale)
        if weight_cache is not None:
            w = cached_grouped_weight(weight_cache, weight, pow2_scale)
        else:
            w = quantize_grouped_weight(weight, columnwise=need_dx, pow2_scale=pow2_scale)
        out = fwd.grouped_mm_fp8_fwd(a, w, offsets, out_dtype=rows.dtype)
        # Only the columnwise copies live on (plain holders: no tensor-subclass construction).
        ctx.a = _ColumnwiseCopy(a) if need_dw else None
        ctx.w = _ColumnwiseCopy(w) if need_dx else None
        ctx.dtypes = (rows.dtype, weight.dtype)
        ctx.save_for_backward(offsets)
        return out

    @staticmethod
    def backward(ctx, d_out):
        d_out = d_out.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_rows = d_w = None
        if not ctx.fp8:
            rows, weight, offsets = ctx.saved_tensors
            if need_dx:
                d_rows = bwd.grouped_mm_dgrad(d_out, weight, offsets,
                                              backend=_rows_backend(ctx.backend))
            param, ctx.w_param = ctx.w_param, None
            (defer_w, n), ctx.defer = ctx.defer, None
            # None: stashed, the gradient comes with a later micro-batch's backward
            parts = defer(defer_w, n, WgradPart(d_out, rows, None, offsets)) if need_dw else ()
            grad = grad_to_accumulate(param, d_out.dtype) if parts else None
            norm_w, ctx.norm_w = ctx.norm_w, None
            if parts:
                # (the rows rule's wgrad: its own auto choice, torch's or the WS kernel)
                d_w = parts_wgrad(parts, grad, out_dtype=rows.dtype,
                                  backend="auto" if ctx.backend == _TRITON_ROWS
                                  else ctx.backend, norm_weight=norm_w)
                if grad is not None:  # fused accumulation
                    d_w = take_grad(param, grad)
            return d_rows, d_w, None, None, None, None, None, None
        (offsets,) = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g = quantize_1x128(d_out, rowwise=need_dx, columnwise=need_dw, pow2_scale=ctx.pow2)
        if need_dx:
            d_rows = bwd.grouped_mm_fp8_dgrad(g, ctx.w, offsets, out_dtype=x_dtype)
        if need_dw:
            d_w = bwd.grouped_mm_fp8_wgrad(g, ctx.a, offsets, out_dtype=w_dtype)
        ctx.a = ctx.w = None
        return d_rows, d_w, None, None, None, None, None, None


def _rows_backend(backend: str) -> str:
    """The forward's and dgrad's backend of a resolved ``backend``."""
    return "triton" if backend == _TRITON_ROWS else backend


def _auto_backend(rows: torch.Tensor, weight: torch.Tensor, layout) -> str:
    """``backend="auto"`` for high-precision operands: ``"torch"`` where
    ``torch._grouped_mm`` can run them (and the layout promises 8-row aligned segments),
    except on sm_90, where the forward and dgrad take the warp-specialized kernel
    (:func:`~linghe.fwd.grouped_mm.hp_ws_preferred`: ``"triton_rows"``, the wgrad
    ``grouped_mm_wgrad``'s own ``"auto"``: the warp-specialized wgrad there); then
    :data:`ROWS_TRITON_MAX_ROWS_PER_EXPERT`'s rule (``"triton_rows"``: the wgrad
    ``"auto"``, torch's off sm_90), else ``"triton"``."""
    # torch._grouped_mm's wgrad needs every segment to start on a multiple of 8 rows
    # (16 bytes of bf16): only an ExpertLayout's align tells us without a host sync.
    aligned = isinstance(layout, ExpertLayout) and layout.align % 8 == 0
    if not (aligned and fwd.torch_grouped_mm_ok(rows, weight)):
        return "triton"
    E, N, _ = weight.shape
    if fwd.hp_ws_preferred(rows, N):
        return _TRITON_ROWS
    limit = ROWS_TRITON_MAX_ROWS_PER_EXPERT
    if limit > 0 and fwd.BF16_TMA and rows.shape[0] <= limit * E and N % 64 == 0:
        return _TRITON_ROWS
    return "torch"


def cached_grouped_weight(cache: WeightCache, weight: torch.Tensor,
                          pow2_scale: bool) -> Fp8Tensor:
    """``quantize_grouped_weight(weight, columnwise=True)`` through ``cache``: quantized
    once per version of ``weight`` (once per optimizer step), both copies kept, so that
    every micro-batch's forward and dgrad reuse them; bound to ``weight``, so that
    :class:`linghe.optim.AdamW` makes the copy inside its step."""
    fmt = ("grouped_128x128", pow2_scale)

    def quantize(w):  # (a miss: bind the weight itself, not this detached alias)
        E, N, K = weight.shape
        cache.bind_128x128(weight, fmt, pow2_scale, (E * N, K))
        return quantize_grouped_weight(w, columnwise=True, pow2_scale=pow2_scale)

    return cache.get(weight, quantize, fmt)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, layout, *, fp8: bool = False,
               backend: str = "auto", pow2_scale: bool = False,
               weight_cache: WeightCache | None = None,
               wgrad_micro_batches: int = 1) -> torch.Tensor:
    """Per-expert GEMM over rows grouped by expert: ``out_e = rows_e @ weight[e]^T``.

    Args:
        rows: ``[R, K]`` float32/float16/bfloat16, contiguous, grouped by expert as
            ``layout`` says: expert ``e``'s segment is rows ``offsets[e] .. offsets[e+1]``
            (real rows then padding rows, which must be zero), rows ``>= offsets[E]`` are
            the tail. Padding rows give zero outputs because they are zero.
        weight: ``[E, N, K]`` of ``rows``' dtype, contiguous (``nn.Linear`` convention).
        layout: an :class:`~linghe.layout.ExpertLayout` (``num_experts == E``,
            ``num_rows == R``) or its ``offsets [E + 1]`` int32/int64 tensor, on the
            operands' device. The offsets are read on the device only (no host sync); the
            kernel never reads past row ``R`` whatever they hold.
        fp8: FP8 blockwise: ``rows`` quantized 1x128 (plus a columnwise copy for the
            wgrad), ``weight`` 128x128 per expert (:func:`quantize_grouped_weight`, needs
            ``N % 128 == 0``); backward quantizes ``d_out`` 1x128 (rowwise for the dgrad,
            columnwise for the wgrad). Any ``K`` and any ``align``.
        backend: ``"auto"`` uses ``torch._grouped_mm`` for bf16 on CUDA sm90 when ``N``
            and ``K`` are multiples of 8 and ``layout`` is an ExpertLayout whose ``align``
            is a multiple of 8 (its wgrad needs 16-byte aligned segments; raw offsets
            carry no such promise), except that there, with Gluon and ``N`` a multiple of
            64, the forward, dgrad and wgrad take linghe's warp-specialized kernels
            (faster; ``LINGHE_HP_WS=0`` turns them off); else the Triton kernels (with
            :data:`ROWS_TRITON_MAX_ROWS_PER_EXPERT` set, off by default: the forward and
            dgrad of layouts with few rows per expert on Triton, the wgrad on torch);
            ``"triton"`` / ``"torch"`` force one (``"torch"``: the caller guarantees
            those alignments). FP8 always runs the Triton kernels.
        pow2_scale: power-of-two FP8 scales.
        weight_cache: with ``fp8``, a :class:`~linghe.fp8.WeightCache` that keeps the
            weight's FP8 copies (rowwise and columnwise) until the weight changes
            (:func:`cached_grouped_weight`); ``None`` quantizes on every call.
        wgrad_micro_batches: ``n > 1`` defers the weight gradient (high precision only):
            every ``n``-th backward computes it over the rows of the last ``n``
            micro-batches in one launch, the others stash their operands
            (:mod:`linghe.bwd.deferred`: set ``n`` to the micro-batches per optimizer
            step; ``.grad`` lacks the pending ones until then). ``1``: every backward
            computes its own.

    Returns ``out [R, N]`` in ``rows``' dtype, fp32 accumulation, zeros past
    ``offsets[E]``. Saved for backward: see :class:`GroupedMMFunction`. Gradients:
    ``d_rows`` in ``rows``' dtype, ``d_weight [E, N, K]`` in ``weight``'s dtype (an
    expert with no rows gets zeros).
    """
    _check_operands(rows, weight)
    _check_backend(backend)
    offsets = _offsets_of(layout, weight.shape[0], rows.shape[0], rows.device)
    if fp8 and weight.shape[1] % 128 != 0:
        raise ValueError(f"fp8=True needs N (weight.shape[1]) to be a multiple of 128, got "
                         f"{weight.shape[1]}")
    if weight_cache is not None and not isinstance(weight_cache, WeightCache):
        raise TypeError(f"weight_cache must be a linghe.fp8.WeightCache or None, got "
                        f"{type(weight_cache).__name__}")
    check_wgrad_micro_batches(wgrad_micro_batches, fp8_wgrad=fp8)
    if torch.compiler.is_compiling():
        # (the torch._grouped_mm check reads data pointers: the op decides "auto" at run
        # time; a graph keeps no weight_cache: FP8 weights are quantized in every call)
        if backend == "auto" and not (isinstance(layout, ExpertLayout) and layout.align % 8 == 0):
            backend = "triton"
        return library.grouped_mm(rows, weight, offsets, bool(fp8), backend, bool(pow2_scale))
    if backend == "auto" and not fp8:
        backend = _auto_backend(rows, weight, layout)
    return apply_function(GroupedMMFunction, rows, weight, offsets, bool(fp8), backend,
                          bool(pow2_scale), weight_cache if fp8 else None,
                          wgrad_micro_batches)


def check_wgrad_micro_batches(n, *, fp8_wgrad: bool) -> None:
    """``wgrad_micro_batches`` must be an int >= 1, and 1 with an FP8 wgrad (the
    deferred wgrad multiplies high-precision operands)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"wgrad_micro_batches must be an int >= 1, got {n!r}")
    if n > 1 and fp8_wgrad:
        raise ValueError("wgrad_micro_batches > 1 defers a high-precision weight gradient; "
                         "the FP8 wgrad (grouped_mm(fp8=True), fp8_wgrad=True, the recipe's "
                         "expert_fp8_wgrad) cannot be deferred")


# --------------------------------------------------------------------------------------
# kernel-level FP8 API
# --------------------------------------------------------------------------------------


def _check_fp8_rows(name, t, *, rowwise: bool, columnwise: bool):
    if not isinstance(t, Fp8Tensor):
        raise TypeError(f"{name} must be an Fp8Tensor (linghe.quantize_1x128), got "
                        f"{type(t).__name__}")
    if t.scaling != "1x128" or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D Fp8Tensor with scaling '1x128', got shape "
                         f"{tuple(t.shape)} scaling {t.scaling!r}")
    if rowwise and t.rowwise_data is None:
        raise ValueError(f"{name} needs its rowwise copy (quantize_1x128(rowwise=True))")
    if columnwise and t.columnwise_data is None:
        raise ValueError(f"{name} needs its columnwise copy (quantize_1x128(columnwise=True))")
    check_kernel_device(name, t.rowwise_data if rowwise else t.columnwise_data)


def _wgrad_segments(dout_fp8: Fp8Tensor, a_fp8: Fp8Tensor, layout) -> bool:
    """Whether the wgrad operands' columnwise groups follow the layout's segments (both
    carry ``col_segments``, the very offsets tensor of ``layout``) or are plain 128-token
    groups (neither does). Matched by identity: comparing values would be a host sync."""
    sd, sa = dout_fp8.col_segments, a_fp8.col_segments
    if sd is None and sa is None:
        return False
    given = layout.offsets if isinstance(layout, ExpertLayout) else layout
    if sd is None or sa is None or sd is not sa or sa is not given:
        raise ValueError(
            "dout_fp8 and a_fp8 must both have plain columnwise groups (quantize_1x128) or "
            "both groups that follow the segments of this layout (col_segments that is "
            "layout.offsets itself, e.g. batch_silu_mul_quant(layout=layout) and "
            "quantize_grouped_1x128(x, layout)); got col_segments "
            f"{'set' if sd is not None else 'None'} / {'set' if sa is not None else 'None'}"
            f"{', different tensors' if sd is not None and sa is not None else ''}")
    return True


def _check_fp8_weight(name, w, *, rowwise: bool, columnwise: bool):
    if not isinstance(w, Fp8Tensor) or w.scaling != "128x128" or w.dim() != 3:
        raise TypeError(f"{name} must be a 3-D [E, N, K] Fp8Tensor from "
                        f"quantize_grouped_weight, got {type(w).__name__} "
                        f"{tuple(getattr(w, 'shape', ()))}")
    E, N, K = w.shape
    if N % 128 != 0:
        raise ValueError(f"{name}: N must be a multiple of 128, got {N}")
    if rowwise and (w.rowwise_data is None or tuple(w.rowwise_data.shape) != (E * N, K)):
        raise ValueError(f"{name} needs rowwise_data of shape ({E * N}, {K})")
    if columnwise and (w.columnwise_data is None
                       or tuple(w.columnwise_data.shape) != (K, E * N)):
        raise ValueError(f"{name} needs its columnwise copy of shape ({K}, {E * N}) "
                         "(quantize_grouped_weight(columnwise=True))")


def _check_out_dtype(out_dtype):
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")


def grouped_mm_fp8(a_fp8: Fp8Tensor, w_fp8: Fp8Tensor, layout,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 forward: ``out [R, N] = a_e @ W_e^T`` per expert, no autograd.

    ``a_fp8``: ``[R, K]`` Fp8Tensor with its rowwise 1x128 copy; ``w_fp8``: ``[E, N, K]``
    from :func:`quantize_grouped_weight`; ``layout`` as in :func:`grouped_mm`. Each
    128-wide K step is promoted with its scales in fp32. Zeros past ``offsets[E]``."""
    _check_fp8_rows("a_fp8", a_fp8, rowwise=True, columnwise=False)
    _check_fp8_weight("w_fp8", w_fp8, rowwise=True, columnwise=False)
    _check_out_dtype(out_dtype)
    if w_fp8.shape[2] != a_fp8.shape[1]:
        raise ValueError(f"w_fp8 must have K={a_fp8.shape[1]}, got shape {tuple(w_fp8.shape)}")
    check_same_device(a_fp8=a_fp8, w_fp8=w_fp8)
    offsets = _offsets_of(layout, w_fp8.shape[0], a_fp8.shape[0], a_fp8.device)
    if torch.compiler.is_compiling():
        return library.grouped_mm_fp8_fwd_kernel(a_fp8, w_fp8, offsets, out_dtype)
    return fwd.grouped_mm_fp8_fwd(a_fp8, w_fp8, offsets, out_dtype=out_dtype)


def grouped_mm_fp8_dgrad(dout_fp8: Fp8Tensor, w_fp8: Fp8Tensor, layout,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 dgrad: ``d_rows [R, K] = d_out_e @ W_e`` per expert. ``dout_fp8`` ``[R, N]`` with
    its rowwise 1x128 copy; ``w_fp8`` with its columnwise copy."""
    _check_fp8_rows("dout_fp8", dout_fp8, rowwise=True, columnwise=False)
    _check_fp8_weight("w_fp8", w_fp8, rowwise=False, columnwise=True)
    _check_out_dtype(out_dtype)
    if w_fp8.shape[1] != dout_fp8.shape[1]:
        raise ValueError(f"w_fp8 must have N={dout_fp8.shape[1]}, got shape "
                         f"{tuple(w_fp8.shape)}")
    check_same_device(dout_fp8=dout_fp8, w_fp8=w_fp8)
    offsets = _offsets_of(layout, w_fp8.shape[0], dout_fp8.shape[0], dout_fp8.device)
    if torch.compiler.is_compiling():
        return library.grouped_mm_fp8_dgrad_kernel(dout_fp8, w_fp8, offsets, out_dtype)
    return bwd.grouped_mm_fp8_dgrad(dout_fp8, w_fp8, offsets, out_dtype=out_dtype)


def grouped_mm_fp8_wgrad(dout_fp8: Fp8Tensor, a_fp8: Fp8Tensor, layout,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 wgrad: ``dW [E, N, K]``, ``dW_e = d_out_e^T @ a_e`` per expert, from the
    columnwise copies of ``dout_fp8 [R, N]`` and ``a_fp8 [R, K]``: either both plain
    1x128 groups of 128 tokens over the whole buffer, as ``quantize_1x128(columnwise=True)``
    makes them (any ``align`` works: a group straddling two segments is masked per
    expert), or both grouped by the layout's segments (``col_segments`` that is
    ``layout.offsets``, from :func:`quantize_grouped_1x128`, ``batch_silu_mul_quant`` or
    the batch SwiGLU backward; no group is shared by two experts). Mixed groupings raise
    ``ValueError``."""
    _check_fp8_rows("dout_fp8", dout_fp8, rowwise=False, columnwise=True)
    _check_fp8_rows("a_fp8", a_fp8, rowwise=False, columnwise=True)
    _check_out_dtype(out_dtype)
    if dout_fp8.shape[0] != a_fp8.shape[0]:
        raise ValueError(f"dout_fp8 and a_fp8 must have the same rows, got "
                         f"{tuple(dout_fp8.shape)} and {tuple(a_fp8.shape)}")
    check_same_device(dout_fp8=dout_fp8, a_fp8=a_fp8)
    if isinstance(layout, ExpertLayout):
        E = layout.num_experts
    elif isinstance(layout, torch.Tensor) and layout.dim() == 1:
        E = layout.numel() - 1
    else:
        raise TypeError("layout must be an ExpertLayout or an offsets tensor [E + 1]")
    if E < 1:
        raise ValueError("layout must describe at least one expert")
    seg = _wgrad_segments(dout_fp8, a_fp8, layout)
    align = layout.align if isinstance(layout, ExpertLayout) else 1
    offsets = _offsets_of(layout, E, a_fp8.shape[0], a_fp8.device)
    if torch.compiler.is_compiling():
        return library.grouped_mm_fp8_wgrad_kernel(dout_fp8, a_fp8, offsets, out_dtype, seg,
                                                   align)
    return bwd.grouped_mm_fp8_wgrad(dout_fp8, a_fp8, offsets, out_dtype=out_dtype,
                                    segments=seg, align=align)


def quantize_grouped_1x128(x, layout: ExpertLayout, *, rowwise: bool = True,
                           columnwise: bool = True, pow2_scale: bool = False) -> Fp8Tensor:
    """1x128 FP8 quantization of rows grouped by expert, columnwise groups per segment.

    Args:
        x: ``[R, K]`` float32/float16/bfloat16 (last dim contiguous), or an
            :class:`~linghe.Fp8Tensor` with its rowwise 1x128 copy (e.g. ``permute``'s FP8
            rows): then the columnwise copy is made from the rowwise values (dequantized
            in registers and quantized again, as DeepSeek-V3 does for its backward) and
            the rowwise copy is kept as is.
        layout: the :class:`~linghe.layout.ExpertLayout` of the rows
            (``num_rows == R``); counts are read on the device (no host sync).
        rowwise: produce the rowwise copy (high-precision ``x`` only).
        columnwise: produce the columnwise copy ``[K, R]`` with scales ``[K,
            ceil(R/128) + E]``: groups of 128 rows starting at every segment start, never
            crossing a segment (as ``batch_silu_mul_quant``); the result carries
            ``col_segments = layout.offsets``.
        pow2_scale: power-of-two scales.

    Padding and tail rows are never read: their outputs are zeros (scale 1). Returns an
    :class:`~linghe.Fp8Tensor` of logical shape ``[R, K]``. No autograd (kernel-level,
    like :func:`linghe.quantize_1x128`): it feeds :func:`grouped_mm_fp8_dgrad` (rowwise)
    and :func:`grouped_mm_fp8_wgrad` (columnwise, with a partner grouped the same way).
    """
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
    fp8_in = isinstance(x, Fp8Tensor)
    if fp8_in:
        if x.scaling != "1x128" or x.dim() != 2 or x.rowwise_data is None:
            raise ValueError("x as an Fp8Tensor must be 2-D with a 1x128 rowwise copy")
        data, scale = x.rowwise_data, x.rowwise_scale
        rowwise = False
        if not columnwise:
            raise ValueError("x is already quantized rowwise: ask for columnwise=True")
    else:
        check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2, last_dim_contiguous=True)
        data, scale = x, None
        if not (rowwise or columnwise):
            raise ValueError("quantize_grouped_1x128 needs rowwise=True or columnwise=True")
    check_kernel_device("x", data)
    if layout.num_rows != data.shape[0]:
        raise ValueError(f"layout.num_rows ({layout.num_rows}) must equal x.shape[0] "
                         f"({data.shape[0]})")
    check_same_device(x=data, tokens_per_expert=layout.tokens_per_expert)
    if torch.compiler.is_compiling():
        return library.quantize_grouped_1x128(x, scale, layout, rowwise, columnwise,
                                              bool(pow2_scale))
    q, s, qt, st = fwd.quantize_grouped_fwd(data, layout.tokens_per_expert, layout.align,
                                            x_scale=scale, rowwise=rowwise,
                                            columnwise=columnwise, pow2_scale=pow2_scale)
    if fp8_in:
        q, s = data, scale
    return Fp8Tensor(x.shape, x.dtype, rowwise_data=q, rowwise_scale=s, columnwise_data=qt,
                     columnwise_scale=st, scaling="1x128",
                     col_segments=layout.offsets if columnwise else None)
