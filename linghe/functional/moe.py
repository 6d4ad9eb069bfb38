"""Routed experts over rows grouped by expert: ``grouped_swiglu`` (the expert FFN of
``linghe.nn.MoE``), bf16 or FP8 blockwise end to end, and ``quantize_tokens`` (1x128 FP8
tokens for ``permute``, straight-through gradient).

FP8 data flow of :func:`grouped_swiglu` (one autograd node; every activation and
gradient is quantized by the kernel that produces it, never by a separate pass over a
high-precision copy, except ``dy``, which arrives in bf16 from the combine):

forward::

    rows (FP8 from permute, or quantized here)   W1, W2 (WeightCache: once per step)
    h  = grouped_mm_fp8(rows, W1)                 [R, 2I] bf16 (saved)
    a  = batch_silu_mul_quant(h, probs)           [R, I]  FP8 rowwise + segment columnwise
    y  = grouped_mm_fp8(a, W2)                    [R, H]  bf16

backward::

    dy  -> quantize_grouped_1x128                 rowwise + segment columnwise
    dW2 = wgrad(dy, a)                            segment groups on both sides
    da  = dgrad(dy, W2)                           [R, I] bf16
    dh, dprobs = batch SwiGLU backward (quant)    FP8 rowwise + segment columnwise
    dW1 = wgrad(dh, rows)                         rows' columnwise from their FP8 copy
    drows = dgrad(dh, W1)

Columnwise (wgrad) copies are grouped per expert segment (:mod:`linghe.layout`), so no
1x128 group mixes two experts and the wgrad never computes a group twice.

That is the ``fp8_wgrad=True`` flow. By default (``fp8_wgrad=False``, the recipe's
``expert_fp8_wgrad``) no columnwise copy is made: ``dW2 = wgrad(dy, a)`` and ``dW1 =
wgrad(dh, rows)`` run in rows' dtype on ``dy``/``dh`` as they arrive and the dequantized
rowwise ``a`` / ``rows``; the dgrads stay FP8. There ``dy``'s rowwise copy comes from
``unpermute``'s backward when ``y`` goes straight into it (:mod:`linghe.bwd.handoff`): it
quantizes the ``T`` token rows of its gradient once and moves them with the rows, where
quantizing ``dy`` would read all ``T * k`` rows again.
"""

from __future__ import annotations

import torch

from .. import library
from ..bwd import grad_norms
from ..bwd import grouped_mm as bwd_gm
from ..bwd import handoff as fp8_handoff
from ..bwd.accumulate import accumulation_param, grad_to_accumulate, take_grad
from ..bwd.activation import silu_mul_bwd, silu_mul_bwd_quant, silu_mul_bwd_rowwise_fp8
from ..bwd.deferred import WgradPart, defer, deferrable, parts_wgrad, prepare_wgrad_parts
from ..fp8 import Fp8Tensor, quantize_1x128
from ..fp8.cache import WeightCache
from ..fwd import grouped_mm as fwd_gm
from ..fwd.activation import batch_silu_mul_quant_fwd
from ..layout import ExpertLayout
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    check_kernel_device,
    check_same_device,
    check_tensor,
)
from .activation import silu_mul
from .grouped_mm import (
    cached_grouped_weight,
    check_wgrad_micro_batches,
    grouped_mm,
    quantize_grouped_weight,
)

__all__ = ["grouped_swiglu", "quantize_tokens"]


# ------------------------------------------------------------------------- tokens
class _QuantizeTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pow2):
        return quantize_1x128(x, rowwise=True, pow2_scale=pow2)

    @staticmethod
    def backward(ctx, g):
        if isinstance(g, Fp8Tensor):
            g = g.dequantize()
        return g, None


def quantize_tokens(x: torch.Tensor, *, pow2_scale: bool = False) -> Fp8Tensor:
    """1x128 rowwise FP8 of tokens ``x [T, H]`` (float32/float16/bfloat16, last dim
    contiguous) with a straight-through gradient: what ``permute`` moves (rows and scales
    in one kernel) into the FP8 expert GEMMs, so tokens are quantized once before the
    ``k`` routed copies are made. Returns an :class:`~linghe.Fp8Tensor` ``[T, H]`` with
    its rowwise copy; its gradient reaches ``x`` unchanged (in ``x``'s dtype)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2, last_dim_contiguous=True)
    check_kernel_device("x", x)
    if torch.compiler.is_compiling():
        return library.quantize_tokens(x, pow2_scale)
    return apply_function(_QuantizeTokens, x, bool(pow2_scale))


# ------------------------------------------------------------------------- experts
class _Parts:
    """The FP8 components the grouped GEMM launchers read (``shape``, ``rowwise_*``,
    ``columnwise_*``), without building an ``Fp8Tensor`` (host time per call) for
    intermediates that never leave this module. ``None`` where a copy is not kept."""

    __slots__ = ("shape", "rowwise_data", "rowwise_scale", "columnwise_data",
                 "columnwise_scale")

    def __init__(self, shape, q=None, s=None, qt=None, st=None):
        self.shape = shape
        self.rowwise_data, self.rowwise_scale = q, s
        self.columnwise_data, self.columnwise_scale = qt, st


def _columnwise(t) -> _Parts:
    """Only the columnwise half of ``t`` (so that its rowwise copy is freed)."""
    return _Parts(t.shape, qt=t.columnwise_data, st=t.columnwise_scale)


def _segments(layout: ExpertLayout):
    """``(offsets, tokens_per_expert, align)`` of a layout: what every GEMM and quantizer
    of the expert FFN reads."""
    return layout.offsets, layout.tokens_per_expert, layout.align


class _GroupedSwiGLUFp8(torch.autograd.Function):
    """Saved for backward: ``h [R, 2I]`` (high precision, the SwiGLU input), ``probs``,
    the columnwise FP8 copies of ``a`` (and of ``rows`` when they came in high
    precision; FP8 rows keep their rowwise copy, requantized columnwise in backward) and
    the columnwise (dgrad) copies of both FP8 weights."""

    @staticmethod
    def forward(ctx, rows, probs, w1, w2, layout, caches, pow2, fp8_wgrad, micro_batches):
        offsets, counts, align = _segments(layout)
        need_rows = rows.requires_grad
        need_p = probs is not None and probs.requires_grad
        need_w1, need_w2 = w1.requires_grad, w2.requires_grad
        # The down GEMM's dgrad feeds everything upstream of it.
        need_da = need_rows or need_p or need_w1
        out_dtype = rows.dtype
        if isinstance(rows, Fp8Tensor):
            a1 = rows
            # FP8 rows: keep the rowwise copy; the backward requantizes it columnwise
            # (FP8 wgrad) or dequantizes it (high-precision wgrad). Rows that permute made
            # from FP8 tokens are kept as those tokens for the high-precision wgrad (k
            # times fewer bytes until the wgrad runs, possibly micro-batches later; made
            # dequantized by one scatter then).
            tokens = getattr(rows, "_linghe_token_rows", None)
            a1_saved = None
            if need_w1:
                a1_saved = (tokens if tokens is not None and not fp8_wgrad
                            and tokens.layout is layout else
                            _Parts(rows.shape, rows.rowwise_data, rows.rowwise_scale))
        else:
            a1 = _Parts(rows.shape, *fwd_gm.quantize_grouped_fwd(
                rows, counts, align, rowwise=True, columnwise=need_w1 and fp8_wgrad,
                pow2_scale=pow2))
            # High-precision wgrad: the rows themselves (saved for backward below).
            a1_saved = _columnwise(a1) if need_w1 and fp8_wgrad else None
        if caches is not None:
            w1q = cached_grouped_weight(caches[0], w1, pow2)
            w2q = cached_grouped_weight(caches[1], w2, pow2)
        else:
            w1q = quantize_grouped_weight(w1.detach(), columnwise=need_rows, pow2_scale=pow2)
            w2q = quantize_grouped_weight(w2.detach(), columnwise=need_da, pow2_scale=pow2)
        h = fwd_gm.grouped_mm_fp8_fwd(a1, w1q, offsets, out_dtype=out_dtype)
        q, s, qt, st, _g_off, _seg = batch_silu_mul_quant_fwd(
            h, probs, counts, align, columnwise=need_w2 and fp8_wgrad, pow2_scale=pow2)
        a2 = _Parts((h.shape[0], h.shape[1] // 2), q, s, qt, st)
        y = fwd_gm.grouped_mm_fp8_fwd(a2, w2q, offsets, out_dtype=out_dtype)

        ctx.layout, ctx.pow2, ctx.fp8_wgrad = layout, pow2, fp8_wgrad
        ctx.need = (need_rows, need_p, need_w1, need_w2, need_da)
        ctx.a1 = a1_saved
        # High-precision wgrad: the rowwise copy (what the down GEMM multiplied), dequantized
        # in backward.
        ctx.a2 = ((_columnwise(a2) if fp8_wgrad else _Parts(a2.shape, q, s))
                  if need_w2 else None)
        ctx.w1 = _columnwise(w1q) if need_rows else None
        ctx.w2 = _columnwise(w2q) if need_da else None
        ctx.dtypes = (rows.dtype, w1.dtype, w2.dtype)
        # High-precision wgrads may add into the weights' existing gradients.
        ctx.params = ((accumulation_param(w1), accumulation_param(w2)) if not fp8_wgrad
                      else (None, None))
        ctx.defer = (deferrable(w1, micro_batches), deferrable(w2, micro_batches),
                     micro_batches)
        # weights whose gradient norm the optimizer asked for (grad_norms; high-precision
        # wgrad only)
        ctx.norm_ws = tuple(w if need and not fp8_wgrad and grad_norms.watched(w) else None
                            for w, need in ((w1, need_w1), (w2, need_w2)))
        hp_rows = need_w1 and not fp8_wgrad and not isinstance(rows, Fp8Tensor)
        ctx.save_for_backward(h if need_da else None, probs, rows if hp_rows else None)
        # The down GEMM's dgrad wants dy's rowwise FP8 copy: unpermute's backward makes it
        # from the token rows, k times fewer than y's (high-precision wgrad only: the FP8
        # wgrad quantizes dy columnwise in the same pass anyway).
        ctx.handoff = None
        if need_da and not fp8_wgrad:
            ctx.handoff = fp8_handoff.Fp8GradHandoff(pow2)
            fp8_handoff.attach(y, ctx.handoff)
        return y

    @staticmethod
    def backward(ctx, dy):
        if isinstance(dy, Fp8Tensor):
            dy = dy.dequantize()
        h, probs, rows = ctx.saved_tensors
        if ctx.fp8_wgrad:
            grads = _backward_fp8_wgrad(ctx, dy.contiguous(), h, probs)
        else:
            grads = _backward_hp_wgrad(ctx, dy.contiguous(), h, probs, rows)
        ctx.a1 = ctx.a2 = ctx.w1 = ctx.w2 = ctx.params = ctx.defer = ctx.norm_ws = None
        ctx.handoff = None
        return (*grads, None, None, None, None, None)


def _backward_fp8_wgrad(ctx, dy, h, probs):
    """``(d_rows, d_probs, d_gate_up, d_down)`` with every GEMM in FP8 (module docstring)."""
    pow2 = ctx.pow2
    need_rows, need_p, need_w1, need_w2, need_da = ctx.need
    offsets, counts, align = _segments(ctx.layout)
    x_dtype, w1_dtype, w2_dtype = ctx.dtypes
    d_rows = d_p = d_w1 = d_w2 = None
    dyq = _Parts(dy.shape, *fwd_gm.quantize_grouped_fwd(
        dy, counts, align, rowwise=need_da, columnwise=need_w2, pow2_scale=pow2))
    if need_w2:
        d_w2 = bwd_gm.grouped_mm_fp8_wgrad(dyq, ctx.a2, offsets, out_dtype=w2_dtype,
                                           segments=True, align=align)
    if need_da:
        da = bwd_gm.grouped_mm_fp8_dgrad(dyq, ctx.w2, offsets, out_dtype=h.dtype)
        dh, d_p = silu_mul_bwd_quant(da, h, probs, columnwise=need_w1, pow2_scale=pow2,
                                     need_dprobs=need_p, counts=counts, align=align,
                                     segments=offsets)
        if need_rows:
            d_rows = bwd_gm.grouped_mm_fp8_dgrad(dh, ctx.w1, offsets, out_dtype=x_dtype)
        if need_w1:
            a1 = ctx.a1
            if a1.columnwise_data is None:  # FP8 rows: columnwise from the rowwise copy
                a1 = _Parts(a1.shape, *fwd_gm.quantize_grouped_fwd(
                    a1.rowwise_data, counts, align, x_scale=a1.rowwise_scale,
                    rowwise=False, columnwise=True, pow2_scale=pow2))
            d_w1 = bwd_gm.grouped_mm_fp8_wgrad(dh, a1, offsets, out_dtype=w1_dtype,
                                               segments=True, align=align)
    return d_rows, d_p, d_w1, d_w2


def _backward_hp_wgrad(ctx, dy, h, probs, rows):
    """The backward with the weight gradients in high precision (``fp8_wgrad=False``):
    the dgrads stay FP8 (rowwise copies only), the wgrads are ``grouped_mm_wgrad``
    (``torch._grouped_mm`` where it applies) of the gradients as they arrive in
    rows' dtype and the activations: the SwiGLU output the down GEMM multiplied
    (dequantized) and the rows (FP8 rows dequantized). With ~256
    tokens per expert (256 experts) the FP8 wgrad's short K loop per output tile
    loses to the bf16 kernel, and no columnwise copy is made on either side."""
    pow2 = ctx.pow2
    need_rows, need_p, need_w1, need_w2, need_da = ctx.need
    offsets, counts, align = _segments(ctx.layout)
    x_dtype, w1_dtype, w2_dtype = ctx.dtypes
    d_rows = d_p = d_w1 = d_w2 = None
    # torch._grouped_mm's wgrad contracts over the rows: segment starts on multiples of 8.
    backend = "auto" if align % 8 == 0 else "triton"
    # Fused accumulation (weights that already have a .grad): the in-place adds run last,
    # after every step that may fail or allocate, so that an error (e.g. out of memory)
    # leaves the gradients as they were, as PyTorch's AccumulateGrad would.
    p1, p2 = ctx.params
    defer1, defer2, n = ctx.defer
    norm_w1, norm_w2 = ctx.norm_ws
    fused = []  # (grad, [WgradPart, ...], weight to record the norm of): the in-place adds
    a2 = ctx.a2
    # (parts: None when stashed for a later micro-batch (deferred wgrad), else the
    # micro-batches whose gradient is handed over now)
    parts2 = (defer(defer2, n, WgradPart(dy, a2.rowwise_data, a2.rowwise_scale, offsets))
              if need_w2 else None)
    g2 = grad_to_accumulate(p2, dy.dtype) if parts2 else None
    if parts2 and g2 is None:
        d_w2 = parts_wgrad(parts2, None, out_dtype=w2_dtype, backend=backend,
                           norm_weight=norm_w2)
    elif g2 is not None:
        fused.append((g2, prepare_wgrad_parts(parts2), norm_w2))
    g1 = None
    if need_da:
        copy = ctx.handoff.take(dy) if ctx.handoff is not None else None
        dyq = _Parts(dy.shape, *(copy if copy is not None else fwd_gm.quantize_grouped_fwd(
            dy, counts, align, rowwise=True, columnwise=False, pow2_scale=pow2)[:2]))
        da = bwd_gm.grouped_mm_fp8_dgrad(dyq, ctx.w2, offsets, out_dtype=h.dtype)
        del dyq
        if need_rows:  # dh for the wgrad and its FP8 copy for the dgrad: one kernel
            dh, q, s, d_p = silu_mul_bwd_rowwise_fp8(da, h, probs, need_dprobs=need_p,
                                                     counts=counts, align=align,
                                                     pow2_scale=pow2)
            del da
            d_rows = bwd_gm.grouped_mm_fp8_dgrad(_Parts(dh.shape, q, s), ctx.w1, offsets,
                                                 out_dtype=x_dtype)
            del q, s
        else:
            dh, d_p = silu_mul_bwd(da, h, probs, need_dprobs=need_p, counts=counts,
                                   align=align)
            del da
        if need_w1:
            # FP8 rows (what the gate_up GEMM multiplied), the tokens they were made
            # from (TokenRows), or high-precision rows
            a1 = ctx.a1 if ctx.a1 is not None else rows
            fp8_a1 = isinstance(a1, _Parts)
            parts1 = defer(defer1, n, WgradPart(
                dh, a1.rowwise_data if fp8_a1 else a1, a1.rowwise_scale if fp8_a1 else None,
                offsets))
            g1 = grad_to_accumulate(p1, dh.dtype) if parts1 else None
            if parts1 and g1 is None:
                d_w1 = parts_wgrad(parts1, None, out_dtype=w1_dtype, backend=backend,
                                   norm_weight=norm_w1)
            elif g1 is not None:
                fused.append((g1, prepare_wgrad_parts(parts1), norm_w1))
    # every operand is ready: the in-place adds, then the hand-back (no allocation between)
    for grad, parts, norm_w in fused:
        parts_wgrad(parts, grad, norm_weight=norm_w)
    if g1 is not None:
        d_w1 = take_grad(p1, g1)
    if g2 is not None:
        d_w2 = take_grad(p2, g2)
    return d_rows, d_p, d_w1, d_w2


def _check(rows, probs_rows, gate_up, down, layout, fp8):
    if isinstance(rows, Fp8Tensor):
        if not fp8:
            raise TypeError("rows is an Fp8Tensor: grouped_swiglu needs fp8=True for it (or "
                            "pass rows.dequantize())")
        if rows.scaling != "1x128" or rows.dim() != 2 or rows.rowwise_data is None:
            raise ValueError("rows as an Fp8Tensor must be 2-D with a 1x128 rowwise copy "
                             "(permute of quantize_tokens)")
        check_kernel_device("rows", rows.rowwise_data)
    else:
        check_tensor("rows", rows, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
        check_kernel_device("rows", rows)
    R, H = rows.shape
    check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES, ndim=3, contiguous=True)
    E, I2, _ = gate_up.shape
    if gate_up.shape[2] != H or I2 % 2:
        raise ValueError(f"gate_up must have shape (E, 2I, H={H}) (gate rows then up rows), "
                         f"got {tuple(gate_up.shape)}")
    check_tensor("down", down, dtypes=(gate_up.dtype,), shape=(E, H, I2 // 2), contiguous=True)
    if gate_up.dtype != rows.dtype:
        raise TypeError(f"gate_up must have rows' dtype {rows.dtype}, got {gate_up.dtype}")
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
    if layout.num_experts != E or layout.num_rows != R:
        raise ValueError(f"layout (num_experts={layout.num_experts}, num_rows="
                         f"{layout.num_rows}) must match gate_up's E={E} and rows' R={R}")
    if probs_rows is not None:
        check_tensor("probs_rows", probs_rows, dtypes=(torch.float32,), shape=(R,))
    check_same_device(rows=rows, gate_up=gate_up, down=down, probs_rows=probs_rows,
                      offsets=layout.offsets)
    if fp8 and (I2 % 128 or H % 128):
        raise ValueError(f"fp8=True needs 2I and H to be multiples of 128 (128x128 weight "
                         f"blocks within one expert), got 2I={I2}, H={H}")


def grouped_swiglu(rows, probs_rows: torch.Tensor | None, gate_up: torch.Tensor,
                   down: torch.Tensor, layout: ExpertLayout, *, fp8: bool = False,
                   pow2_scale: bool = False,
                   weight_caches: tuple[WeightCache, WeightCache] | None = None,
                   fp8_wgrad: bool = False, wgrad_micro_batches: int = 1):
    """SwiGLU experts over rows grouped by expert: ``y_e = (silu(g_e) * u_e * p) @
    down[e]^T`` with ``[g_e, u_e] = rows_e @ gate_up[e]^T``.

    Args:
        rows: ``[R, H]`` grouped by expert as ``layout`` says (``permute``'s output:
            padding and tail rows are zero), float32/float16/bfloat16 contiguous; with
            ``fp8`` also an :class:`~linghe.Fp8Tensor` with its 1x128 rowwise copy
            (``permute(quantize_tokens(x), ...)``).
        probs_rows: ``[R]`` float32 router weight of each row (``permute``'s
            ``probs_rows``), applied to the SwiGLU output; ``None`` for none.
        gate_up: ``[E, 2I, H]`` (gate rows first), rows' dtype, contiguous.
        down: ``[E, H, I]``.
        layout: the :class:`~linghe.layout.ExpertLayout` of ``rows`` (counts and offsets
            read on the device: no host sync).
        fp8: FP8 blockwise GEMMs (needs ``2I`` and ``H`` multiples of 128; any ``I`` and
            ``align``), every operand quantized by the kernel that produces it (see the
            module docstring); ``False``: ``grouped_mm`` -> ``silu_mul`` ->
            ``grouped_mm`` in high precision.
        pow2_scale: power-of-two FP8 scales (the blockwise recipe's default).
        weight_caches: with ``fp8``, two :class:`~linghe.fp8.WeightCache` (gate_up,
            down): weights quantized once per version (optimizer step) and reused by
            every micro-batch and its dgrad.
        fp8_wgrad: with ``fp8``, compute the two weight gradients in FP8 (from columnwise
            copies made in forward and backward); ``False`` (default): in rows' dtype,
            from the gradients as they arrive and the dequantized FP8 activations (no
            columnwise copies; faster on an H100 at 32 and at 256 experts, see
            ``benchmark/NOTES.md``). :class:`linghe.nn.MoE` passes the recipe's
            ``expert_fp8_wgrad`` (:class:`linghe.TrainingContext`).
        wgrad_micro_batches: ``n > 1`` defers both weight gradients (high-precision
            wgrad only: not with ``fp8_wgrad``): every ``n``-th backward computes them
            over the rows of the last ``n`` micro-batches in one launch each, the others
            stash their operands (:mod:`linghe.bwd.deferred`; set ``n`` to the
            micro-batches per optimizer step). ``1``: every backward computes its own.

    Returns ``y [R, H]`` in rows' (logical) dtype, zeros on padding and tail rows.
    Gradients: ``rows`` (a plain tensor also for FP8 rows), ``probs_rows`` (float32),
    ``gate_up`` and ``down`` (their dtype; an expert without rows gets zeros). FP8
    saves ``h [R, 2I]`` (rows' dtype), the FP8 columnwise copies of the SwiGLU output and
    of ``rows`` (or the FP8 rows themselves) and the weights' columnwise copies; with
    ``fp8_wgrad=False`` the SwiGLU output's rowwise copy and ``rows`` instead. The
    gradient of ``y`` must be zero on padding and tail rows (what ``unpermute``'s backward
    gives): the high-precision wgrad multiplies those rows too.
    """
    _check(rows, probs_rows, gate_up, down, layout, fp8)
    if weight_caches is not None:
        if not (isinstance(weight_caches, (tuple, list)) and len(weight_caches) == 2 and
                all(isinstance(c, WeightCache) for c in weight_caches)):
            raise TypeError("weight_caches must be None or two linghe.fp8.WeightCache "
                            "(gate_up, down)")
    check_wgrad_micro_batches(wgrad_micro_batches, fp8_wgrad=fp8 and fp8_wgrad)
    if not fp8:
        h = grouped_mm(rows, gate_up, layout, wgrad_micro_batches=wgrad_micro_batches)
        return grouped_mm(silu_mul(h, probs_rows), down, layout,
                          wgrad_micro_batches=wgrad_micro_batches)
    if probs_rows is not None and not probs_rows.is_contiguous():
        probs_rows = probs_rows.contiguous()
    if torch.compiler.is_compiling():  # (the unfused FP8 path: see the library function)
        return library.grouped_swiglu_fp8(rows, probs_rows, gate_up, down, layout,
                                          bool(pow2_scale))
    return apply_function(_GroupedSwiGLUFp8, rows, probs_rows, gate_up, down, layout,
                          tuple(weight_caches) if weight_caches else None, bool(pow2_scale),
                          bool(fp8_wgrad), wgrad_micro_batches)
