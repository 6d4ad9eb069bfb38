"""``permute`` / ``unpermute``: MoE token rows grouped by expert, padded by index.

Output conventions (the contract of :class:`linghe.layout.ExpertLayout`):

- ``rows [num_rows, H]``: expert ``e``'s segment starts at ``layout.offsets[e]``; its first
  ``layout.tokens_per_expert[e]`` rows are the tokens routed to ``e`` **in token order**
  (for one token, in ``j`` order), then zero rows up to ``layout.padded_tokens_per_expert[e]
  = roundup(count, align)``. Rows ``>= layout.offsets[E]`` (the tail of the static bound)
  are zero. The order is deterministic (no atomics).
- ``layout.row_index [T, k]`` int32: the row of token ``t``'s ``j``-th copy, ``-1`` if the
  copy was dropped.
- ``num_rows``: by default the static bound ``max_grouped_rows(T, k, E, align) =
  T*k + E*(align-1)`` (no host sync); pass ``num_rows=`` when the exact size is known.
- Expert id ``-1`` always means **"not routed"** (e.g. a token whose expert lives on
  another rank, or a NaN row from ``topk_route``): the copy is dropped silently (row -1,
  not counted in ``tokens_per_expert``; ``unpermute`` skips it, so it contributes nothing),
  also in debug mode. Other ids outside ``[0, E)`` (``< -1`` or ``>= E``) are dropped the
  same way, but with ``linghe.set_debug(True)`` / ``LINGHE_DEBUG=1`` they raise
  ``ValueError`` (a host sync).
  Copies that do not fit in an explicit ``num_rows`` are dropped the same way (debug mode
  raises).
"""

from __future__ import annotations

import torch

from .. import library
from ..bwd import handoff as fp8_handoff
from ..bwd.permute import permute_backward, unpermute_backward, unpermute_backward_fp8_copy
from ..fp8.tensor import Fp8Tensor
from ..fwd.permute import TokenRows, build_index, scatter_rows
from ..fwd.permute import gather_rows as _gather_rows
from ..layout import ExpertLayout, max_grouped_rows
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    check_kernel_device,
    check_same_device,
    check_tensor,
    debug_enabled,
)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, layout):
        rows, _, prow, _ = scatter_rows(x, layout, probs=probs)
        ctx.layout = layout
        ctx.x_dtype = x.dtype
        ctx.has_probs = probs is not None
        return rows, prow

    @staticmethod
    def backward(ctx, d_rows, d_prow):
        want_p = ctx.has_probs and ctx.needs_input_grad[1]
        if d_rows is None:
            d_rows = torch.zeros(ctx.layout.num_rows, 0, device=ctx.layout.offsets.device)
        if want_p and d_prow is None:
            d_prow = torch.zeros(ctx.layout.num_rows, device=d_rows.device)
        dx, dp = permute_backward(d_rows.contiguous(), ctx.layout, ctx.x_dtype,
                                  d_prow.float().contiguous() if want_p else None)
        return (dx if ctx.needs_input_grad[0] else None), dp, None


class _PermuteFp8(torch.autograd.Function):
    """FP8 rows move with their scales; the gradient (a plain tensor: an ``Fp8Tensor``
    incoming gradient is dequantized) goes back to the high-precision input through the
    same gather-sum as :class:`_Permute` (straight-through the quantization)."""

    @staticmethod
    def forward(ctx, x, probs, layout):
        data, scale, prow, _ = scatter_rows(x.rowwise_data, layout, x_scale=x.rowwise_scale,
                                            probs=probs)
        rows = Fp8Tensor((layout.num_rows, x.shape[1]), x.dtype, rowwise_data=data,
                         rowwise_scale=scale, scaling="1x128")
        # what the rows were made from: an op that needs them much later keeps this
        # instead (k times fewer bytes; linghe.functional.moe's deferred wgrad)
        rows._linghe_token_rows = TokenRows(x.rowwise_data, x.rowwise_scale, layout)
        ctx.layout = layout
        ctx.x_dtype = x.dtype
        ctx.has_probs = probs is not None
        return rows, prow

    @staticmethod
    def backward(ctx, d_rows, d_prow):
        if isinstance(d_rows, Fp8Tensor):
            d_rows = d_rows.dequantize()
        return _Permute.backward(ctx, d_rows, d_prow)


class _Unpermute(torch.autograd.Function):
    """``handoff``: the FP8 expert FFN's request for the rowwise FP8 copy of ``d_rows``
    (:mod:`linghe.bwd.handoff`); made from the token rows, without ``probs`` only."""

    @staticmethod
    def forward(ctx, rows, probs, layout, handoff, residual):
        out, _ = _gather_rows(rows, layout, weights=probs, add=residual)
        ctx.layout = layout
        ctx.rows_dtype = rows.dtype
        ctx.handoff = handoff
        ctx.save_for_backward(rows if (probs is not None and probs.requires_grad) else None,
                              probs)
        return out

    @staticmethod
    def backward(ctx, dout):
        rows, probs = ctx.saved_tensors
        want_p = probs is not None and ctx.needs_input_grad[1]
        dout = dout.contiguous()
        handoff, ctx.handoff = ctx.handoff, None
        d_res = dout if ctx.needs_input_grad[4] else None  # out = sum + residual
        if handoff is not None and ctx.needs_input_grad[0] and not want_p:
            # (probs is None here: the hand-off is asked for without probs only)
            d_rows, q, s = unpermute_backward_fp8_copy(dout, ctx.layout, ctx.rows_dtype,
                                                       pow2_scale=handoff.pow2_scale)
            handoff.offer(d_rows, q, s)
            return d_rows, None, None, None, d_res
        d_rows, dp = unpermute_backward(dout, ctx.layout, ctx.rows_dtype,
                                        probs=probs, rows=rows if want_p else None)
        return (d_rows if ctx.needs_input_grad[0] else None), dp, None, None, d_res


def _check_ids(expert_ids: torch.Tensor, num_experts: int) -> None:
    if expert_ids.numel() and debug_enabled():
        bad = (expert_ids < -1) | (expert_ids >= num_experts)
        if bool(bad.any()):
            v = expert_ids[bad][0].item()
            raise ValueError(f"expert_ids must be in [0, {num_experts}) (num_experts) or -1 (not "
                             f"routed), found {v} (debug mode; outside it such copies are "
                             "dropped)")


def permute(x, expert_ids: torch.Tensor, probs: torch.Tensor | None = None, *,
            num_experts: int, align: int = 16, num_rows: int | None = None):
    """Group token rows by expert, each expert's segment padded to a multiple of ``align``.

    Args:
        x: ``[T, H]`` float32/float16/bfloat16 (last dim contiguous), or an
            :class:`~linghe.fp8.Fp8Tensor` with 1x128 ``rowwise_data [T, H]`` and
            ``rowwise_scale [T, ceil(H/128)]`` (data and scales move together).
        expert_ids: ``[T, k]`` int32/int64 (e.g. from :func:`linghe.topk_route`). ``-1`` =
            not routed (always dropped silently); other out-of-range ids are dropped too
            (debug mode: ``ValueError``); see the module docstring.
        probs: optional ``[T, k]`` float32 routing weights, moved to ``probs_rows``.
        num_experts: ``E``.
        align: segment alignment in rows (>= 1).
        num_rows: rows of the output; default ``T*k + E*(align-1)`` (no host sync).

    Returns ``(rows, probs_rows, layout)``: ``rows [num_rows, H]`` in ``x``'s dtype (an
    ``Fp8Tensor`` with rowwise data ``[num_rows, H]`` and scales ``[num_rows, G]`` for FP8
    input: padding/tail rows have data 0 and scale 1), ``probs_rows [num_rows]`` float32 (0 on
    padding/tail; ``None`` without ``probs``), and an :class:`~linghe.layout.ExpertLayout`
    with ``tokens_per_expert``, ``padded_tokens_per_expert``, ``offsets`` and ``row_index``
    filled. Backward (bf16/fp16/fp32 ``x``): ``dx[t] = sum_j d_rows[row_index[t, j]]`` in
    ``x``'s dtype and ``dprobs[t, j] = d_probs_rows[row_index[t, j]]``; only ``layout`` is
    saved. FP8 ``x`` (requiring grad, e.g. from a straight-through quantization) gets its
    gradient as a plain ``[T, H]`` tensor in its logical dtype by the same gather-sum (an
    ``Fp8Tensor`` gradient of ``rows`` is dequantized first).
    """
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be an int >= 1, got {align!r}")
    is_fp8 = isinstance(x, Fp8Tensor)
    if is_fp8:
        if x.rowwise_data is None or x.scaling != "1x128":
            raise ValueError("x as an Fp8Tensor must carry 1x128 rowwise data and scales")
        check_tensor("x.rowwise_data", x.rowwise_data, ndim=2, contiguous=True)
        xd = x.rowwise_data
    else:
        check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2, last_dim_contiguous=True)
        xd = x
    T, H = xd.shape
    check_tensor("expert_ids", expert_ids, dtypes=(torch.int32, torch.int64), ndim=2)
    if expert_ids.shape[0] != T:
        raise ValueError(f"expert_ids must have shape ({T}, k) to match x, got "
                         f"{tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    if probs is not None:
        check_tensor("probs", probs, dtypes=(torch.float32,), shape=(T, k))
    check_same_device(x=xd, expert_ids=expert_ids, probs=probs)
    check_kernel_device("x", xd)
    if num_rows is None:
        num_rows = max_grouped_rows(T, k, num_experts, align)
    elif not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be an int >= 0, got {num_rows!r}")
    _check_ids(expert_ids, num_experts)
    if torch.compiler.is_compiling():
        return library.permute(x, expert_ids.contiguous(),
                               probs.contiguous() if probs is not None else None,
                               num_experts, align, num_rows)
    layout = build_index(expert_ids.contiguous(), num_experts, align, num_rows)
    if debug_enabled() and T * k:
        need = int(layout.offsets[-1].item())
        if need > num_rows:
            raise ValueError(f"num_rows={num_rows} is too small: the grouped rows need {need} "
                             "(debug mode; outside it the copies that do not fit are dropped)")
    probs_c = probs.contiguous() if probs is not None else None
    fn = _PermuteFp8 if is_fp8 else _Permute
    rows, prow = apply_function(fn, x, probs_c, layout)
    return rows, (prow if probs is not None else None), layout


def unpermute(rows: torch.Tensor, layout: ExpertLayout, probs: torch.Tensor | None = None, *,
              residual: torch.Tensor | None = None):
    """Combine expert rows back to tokens: ``out[t] = sum_j probs[t, j] * rows[row_index[t, j]]``.

    Args:
        rows: ``[num_rows, H]`` float32/float16/bfloat16 grouped by expert as ``permute``
            returned them (``num_rows == layout.num_rows``).
        layout: the :class:`~linghe.layout.ExpertLayout` from :func:`permute` (needs
            ``row_index``).
        probs: optional ``[T, k]`` float32 weights (``None``: plain sum).
        residual: optional ``[T, H]`` float tensor (last dim contiguous) added to the sum
            in the same pass: ``out = sum + residual``, accumulated in fp32 and rounded
            once (e.g. a shared expert's output; one read of it instead of a separate
            add's two reads and a write). Under ``torch.compile`` the add is a separate op.

    Returns ``[T, H]`` in ``rows``' dtype, summed in fp32; dropped copies contribute 0.
    Backward: ``d_rows[row] = probs[t, j] * dout[t]`` (padding/tail rows get 0),
    ``dprobs[t, j] = <dout[t], rows[row]>`` and ``dresidual = dout``; saves ``probs`` and
    (only when ``probs`` needs a gradient) ``rows``.
    """
    if not isinstance(layout, ExpertLayout) or layout.row_index is None:
        raise TypeError("layout must be the ExpertLayout returned by permute (with row_index)")
    if isinstance(rows, Fp8Tensor):
        raise TypeError("rows must be a high-precision tensor (float32/float16/bfloat16), got an "
                        "Fp8Tensor: dequantize it or run the expert GEMM first")
    check_tensor("rows", rows, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    if rows.shape[0] != layout.num_rows:
        raise ValueError(f"rows must have {layout.num_rows} rows (layout.num_rows), got "
                         f"{rows.shape[0]}")
    T, k = layout.row_index.shape
    if probs is not None:
        check_tensor("probs", probs, dtypes=(torch.float32,), shape=(T, k))
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES, shape=(T, rows.shape[1]),
                     last_dim_contiguous=True)
    check_same_device(rows=rows, row_index=layout.row_index, probs=probs, residual=residual)
    check_kernel_device("rows", rows)
    if torch.compiler.is_compiling():
        out = library.unpermute(rows, layout, probs.contiguous() if probs is not None else None)
        return out if residual is None else (out.float() + residual.float()).to(out.dtype)
    # (the FP8 copy of d_rows is the token rows' copy moved: with per-copy probs it is not)
    handoff = fp8_handoff.requested(rows) if probs is None else None
    return apply_function(_Unpermute, rows,
                          probs.contiguous() if probs is not None else None, layout, handoff,
                          residual)
