"""FP8 linear layer: ``y = x·W^T + b`` through the recipe's FP8 GEMMs, forward and backward.

(:class:`~linghe.fp8.cache.WeightCache`, which keeps a weight's FP8 copy between optimizer
steps, is importable from here too.)"""

from __future__ import annotations

import torch

from .. import library
from ..fp8 import gemm
from ..fp8.cache import WeightCache
from ..fp8.recipe import Fp8Recipe
from ..fp8.tensor import Fp8Tensor
from ..utils import FLOAT_DTYPES, apply_function, check_tensor


def _as_2d(t: Fp8Tensor) -> Fp8Tensor:
    if t.dim() == 2:
        return t
    K = t.shape[-1]
    return Fp8Tensor((t.numel() // K if K else 0, K), t.dtype, scaling=t.scaling,
                     rowwise_data=t.rowwise_data, rowwise_scale=t.rowwise_scale,
                     columnwise_data=t.columnwise_data, columnwise_scale=t.columnwise_scale)


def _has_dense_col(x: Fp8Tensor) -> bool:
    """Whether ``x`` has a columnwise copy the dense wgrad can read (one grouped by expert
    segments is not: it counts as missing)."""
    return x.columnwise_data is not None and x.col_segments is None


def _ready(x: Fp8Tensor, recipe: Fp8Recipe, need_col: bool) -> bool:
    """Whether ``x`` has every copy the layer reads, in the recipe's format (then its 2-D
    components are used as they are, with no new ``Fp8Tensor``)."""
    return (x.rowwise_data is not None and recipe.accepts(x)
            and (not need_col or _has_dense_col(x)))


def _prepare_input(x: Fp8Tensor, recipe: Fp8Recipe, need_col: bool, slot) -> Fp8Tensor:
    """An Fp8Tensor input ``x [..., K]`` that is not :func:`_ready` as a 2-D Fp8Tensor in
    the recipe's format with the rowwise copy and, when ``need_col``, the columnwise copy:
    the missing copy quantized from the one present, or another format requantized."""
    x2 = _as_2d(x)
    if recipe.accepts(x2):
        has_row = x2.rowwise_data is not None
        has_col = _has_dense_col(x2)
        # Quantize the missing copy from the one we have (dequantize follows
        # col_segments, so a segment-grouped copy is read right).
        hp = x2.dequantize(columnwise=not has_row)
        fill = recipe.quantize_input(hp, rowwise=not has_row, columnwise=need_col and
                                     not has_col, key=slot)
        return x2.with_components(
            **({} if has_row else {"rowwise_data": fill.rowwise_data,
                                   "rowwise_scale": fill.rowwise_scale}),
            **({} if (has_col or not need_col) else
               {"columnwise_data": fill.columnwise_data,
                "columnwise_scale": fill.columnwise_scale}))
    hp = x2.dequantize(columnwise=x2.rowwise_data is None)  # another recipe's format
    return recipe.quantize_input(_rows(hp, hp.shape[-1]), rowwise=True, columnwise=need_col,
                                 key=slot)


def _rows(t: torch.Tensor, K: int) -> torch.Tensor:
    """``t [..., K]`` as ``[M, K]`` with a contiguous last dim (no torch op when it
    already is one)."""
    t2 = t if t.dim() == 2 else t.reshape(-1, K)
    return t2 if t2.stride(-1) == 1 or K <= 1 else t2.contiguous()


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, cache: WeightCache | None, owner,
                need_dw: bool):
        K = weight.shape[1]
        lead = x.shape[:-1]
        out_dtype = x.dtype if x.dtype in gemm.OUT_DTYPES else torch.bfloat16
        fp8_wgrad = recipe.fp8_wgrad
        need_col = need_dw and fp8_wgrad
        wslot = (owner, "w")
        if cache is not None:
            wq = cache.get_for_recipe(weight, recipe, wslot)
        else:
            with torch.no_grad():
                wq = recipe.quantize_weight(weight.detach().contiguous(), key=wslot)
        if not isinstance(x, Fp8Tensor):  # the hot path: raw components, fewest torch ops
            q, s, qt, st, scaling = recipe.quantize_input_parts(
                _rows(x, K), rowwise=True, columnwise=need_col, key=(owner, "x"))
            xcol = (qt, st, scaling)
            y = gemm._gemm(q, s, scaling, wq.rowwise_data, wq.rowwise_scale, wq.scaling,
                           out_dtype, bias)
        elif _ready(x, recipe, need_col):  # e.g. from rms_norm_quant: its 2-D components
            xcol = (x.columnwise_data, x.columnwise_scale, x.scaling)
            y = gemm._gemm(x.rowwise_data, x.rowwise_scale, x.scaling, wq.rowwise_data,
                           wq.rowwise_scale, wq.scaling, out_dtype, bias)
        else:
            xq = _prepare_input(x, recipe, need_col, (owner, "x"))
            xcol = (xq.columnwise_data, xq.columnwise_scale, xq.scaling)
            y = gemm._fprop(xq, wq, bias, out_dtype)

        ctx.recipe, ctx.owner, ctx.lead, ctx.K = recipe, owner, lead, K
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        # Saved for backward: W's columnwise copy (dgrad) and X's columnwise copy (FP8
        # wgrad) or X itself (high-precision wgrad); the rowwise copies are dropped.
        # (Raw tensors, not new Fp8Tensor wrappers: less host work per call.)
        ctx.wq = (wq.columnwise_data, wq.columnwise_scale, wq.scaling)
        ctx.xq = ctx.x_hp = None
        if need_dw:
            if fp8_wgrad:
                ctx.xq = xcol
            else:
                xh = x.dequantize() if isinstance(x, Fp8Tensor) else x
                ctx.x_hp = _rows(xh, K)
        return y if len(lead) == 1 else y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        recipe = ctx.recipe
        dy2 = _rows(dy, dy.shape[-1])
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1]
        fp8_dw = need_dw and ctx.xq is not None
        dx = dw = db = None
        if need_dx or fp8_dw:
            dq, ds, dqt, dst, dscaling = recipe.quantize_input_parts(
                dy2, rowwise=need_dx, columnwise=fp8_dw, key=(ctx.owner, "dy"), grad=True)
        if need_dx:
            gdt = ctx.x_dtype if ctx.x_dtype in gemm.OUT_DTYPES else torch.bfloat16
            dx = gemm._gemm(dq, ds, dscaling, *ctx.wq, gdt, None)
            if len(ctx.lead) != 1:
                dx = dx.reshape(*ctx.lead, ctx.K)
        if need_dw:
            wdt = ctx.w_dtype if ctx.w_dtype in gemm.OUT_DTYPES else torch.float32
            if fp8_dw:
                dw = gemm._gemm(dqt, dst, dscaling, *ctx.xq, wdt, None)
            else:
                x2 = ctx.x_hp
                dw = (dy2.to(x2.dtype).t() @ x2).to(wdt)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.bias_dtype)
        ctx.xq = ctx.x_hp = ctx.wq = None
        return dx, dw, db, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               recipe: Fp8Recipe, *, cache: WeightCache | None = None,
               owner=None) -> torch.Tensor:
    """``y [..., N] = x [..., K] · weight [N, K]^T + bias`` with the recipe's FP8 GEMMs.

    Args:
        x: float32/float16/bfloat16 ``[..., K]`` (leading dims flattened), or an
            :class:`~linghe.Fp8Tensor` (e.g. from ``rms_norm_quant``): used as is when it is
            in the recipe's format (``1x128`` e4m3 for blockwise); a missing copy is
            quantized from the one present; another format is dequantized and requantized.
        weight: ``[N, K]`` float parameter; quantized once per version when ``cache`` is
            given (128x128 blocks for blockwise, with the columnwise copy for dgrad).
        bias: ``[N]`` or ``None``; added in the GEMM epilogue; its gradient is ``dY.sum(0)``.
        recipe: the FP8 recipe (``linghe.current_recipe()``).
        cache: a :class:`WeightCache` for the weight's FP8 copy.
        owner: hashable naming this layer's amax slots (delayed recipe).

    Under ``torch.compile`` (blockwise and tensorwise recipes; the delayed one raises
    ``RuntimeError``) the weight is quantized in every call: a graph keeps no ``cache``.

    Returns ``y`` in ``x``'s dtype (bfloat16 for an fp8 ``x``). Saved for backward: the
    columnwise FP8 copies of X (or X itself when ``fp8_wgrad=False``) and W. Backward
    quantizes dY (rowwise for dgrad, columnwise for wgrad; e5m2 in the per-tensor recipes)
    and returns dX in ``x``'s dtype, dW in the weight's dtype, db in the bias's dtype.
    """
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be an Fp8Recipe, got {type(recipe).__name__}")
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    K = weight.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"x must have last dim {K} (weight in_features), got shape "
                         f"{tuple(x.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(weight.shape[0],))
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    # Inside Function.forward grad mode is off, so decide here whether wgrad will be needed.
    need_dw = weight.requires_grad and torch.is_grad_enabled()
    if torch.compiler.is_compiling():
        return library.fp8_linear(x, weight, bias, recipe, need_dw)
    return apply_function(_Fp8Linear, x, weight, bias, recipe, cache, owner, need_dw)
