"""Token embedding: autograd Function, public function and input validation.

``linghe.embedding(tokens, weight)`` is ``torch.nn.functional.embedding(tokens, weight)``
with a backward that never synchronises with the host (PyTorch's counts unique ids on
the host for more than 3072 tokens, pytorch/pytorch#82886, which also breaks CUDA-graph
capture), is deterministic (one program writes each row, in a fixed order of float64
additions: ``linghe/bwd/embedding.py``) and, with gradient accumulation, adds into the
existing ``.grad`` rows that the batch touches instead of building a dense ``[V, H]``
gradient that ``AccumulateGrad`` then adds (``linghe/bwd/accumulate.py``).
"""

from __future__ import annotations

import torch

from .. import library
from ..bwd import embedding as bwd
from ..bwd.accumulate import accumulation_param, grad_to_accumulate, take_grad
from ..fwd import embedding as fwd
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    check_kernel_device,
    check_same_device,
    check_tensor,
    debug_enabled,
)

__all__ = ["embedding"]

_TOKEN_DTYPES = (torch.int32, torch.int64)


class EmbeddingFunction(torch.autograd.Function):
    """``out [N, H] = weight[tokens]`` of flat ``tokens [N]``. Saved for backward: only
    ``tokens`` (and, for fused accumulation, the weight parameter itself on ``ctx``)."""

    @staticmethod
    def forward(ctx, tokens, weight, padding_idx):
        out = fwd.embedding_fwd(tokens, weight)
        ctx.save_for_backward(tokens)
        ctx.meta = (weight.shape[0], padding_idx, weight.dtype)
        ctx.w_param = accumulation_param(weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        param, ctx.w_param = ctx.w_param, None
        if not ctx.needs_input_grad[1]:
            return None, None, None
        (tokens,) = ctx.saved_tensors
        num_embeddings, padding_idx, dtype = ctx.meta
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        acc = grad_to_accumulate(param, dtype)
        if acc is not None:  # fused accumulation: add the touched rows into .grad
            bwd.embedding_bwd_accumulate_(acc, tokens, grad, padding_idx)
            return None, take_grad(param, acc), None
        if torch.is_grad_enabled() and grad.requires_grad:  # create_graph: dW depends on grad
            return None, _EmbeddingGradFunction.apply(tokens, grad, num_embeddings,
                                                      padding_idx, dtype), None
        return None, bwd.embedding_bwd(tokens, grad, num_embeddings, padding_idx, dtype), None


class _EmbeddingGradFunction(torch.autograd.Function):
    """The weight gradient ``dW [V, H]`` of ``grad [N, H]`` as a differentiable function
    of ``grad`` (the backward under ``create_graph``; the weight does not enter it):
    ``d/d grad`` of ``<dW, ggW>`` is ``ggW[tokens]``, zero for the tokens that give no
    gradient (padding, out of range). Saved: ``tokens``."""

    @staticmethod
    def forward(ctx, tokens, grad, num_embeddings, padding_idx, dtype):
        ctx.save_for_backward(tokens)
        ctx.padding_idx = padding_idx
        return bwd.embedding_bwd(tokens, grad, num_embeddings, padding_idx, dtype)

    @staticmethod
    def backward(ctx, ggw):
        (tokens,) = ctx.saved_tensors
        gg = embedding(tokens, ggw)  # zero rows for ids out of range; differentiable
        if ctx.padding_idx is not None:
            gg = gg.masked_fill((tokens == ctx.padding_idx).unsqueeze(-1), 0)
        return None, gg, None, None, None


def _check_ids(tokens: torch.Tensor, V: int) -> None:
    """Debug mode only (a host sync): every id is in ``[0, V)``."""
    if not debug_enabled() or tokens.numel() == 0:
        return
    bad = (tokens < 0) | (tokens >= V)
    if bool(bad.any()):
        v = int(tokens[bad][0])
        raise ValueError(f"tokens must be in [0, {V}) (num_embeddings), found {v} (debug "
                         "mode; outside it such a token gives a zero row and no gradient)")


def normalize_padding_idx(padding_idx: int | None, num_embeddings: int) -> int | None:
    """``padding_idx`` in ``[0, V)`` (a negative one counts from ``V``, as in torch), or
    ``None``; raises ``ValueError`` outside ``[-V, V)``."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"padding_idx must be an int or None, got {type(padding_idx).__name__}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}) "
                         f"(num_embeddings), got {padding_idx}")
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


def embedding(tokens: torch.Tensor, weight: torch.Tensor, *,
              padding_idx: int | None = None) -> torch.Tensor:
    """Token embedding ``weight[tokens]``, as ``torch.nn.functional.embedding``.

    Args:
        tokens: int32/int64 ids of any shape ``[...]`` (any strides; ``N`` ids in all).
            An id outside ``[0, V)`` gives a zero row and no gradient (``F.embedding``
            raises instead; checking would cost a host sync here): with
            ``linghe.set_debug(True)`` / ``LINGHE_DEBUG=1`` it raises ``ValueError``.
        weight: ``[V, H]`` float32/float16/bfloat16 with contiguous rows
            (``stride(1) == 1``; other strides are copied first), ``V < 2^31 - 1``.
        padding_idx: a row (negative: counted from ``V``) that gets no gradient, as in
            torch; its forward value is read as it is.

    Returns ``[..., H]`` in ``weight``'s dtype. Saved for backward: ``tokens`` only.
    Backward: ``dW[v] = sum of grad[t] over the tokens t == v``, summed in float64 and
    rounded once to ``weight``'s dtype, with no host sync and the same bits on every run
    (see ``linghe/bwd/embedding.py``); rows no token touches are zero. Tokens have no
    gradient. Gradient accumulation: when ``weight`` is a leaf parameter whose ``.grad``
    already holds a gradient (micro-batches after the first), the backward adds each
    touched row's sum into that ``.grad`` row (float64 add, one rounding) and returns the
    same tensor (``linghe.fused_grad_accumulation``; ``linghe/bwd/accumulate.py`` says
    when it steps aside), so no ``[V, H]`` buffer is built or added. With
    ``create_graph`` the weight gradient is differentiable in the output's gradient (as
    torch's), to any order.
    """
    check_tensor("tokens", tokens, dtypes=_TOKEN_DTYPES)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    check_same_device(tokens=tokens, weight=weight)
    check_kernel_device("weight", weight)
    V, H = weight.shape
    if V >= 2**31 - 1:
        raise ValueError(f"weight must have fewer than 2^31 - 1 rows, got {V}")
    padding_idx = normalize_padding_idx(padding_idx, V)
    _check_ids(tokens, V)
    flat = tokens.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        weight = weight.contiguous()
    if torch.compiler.is_compiling():
        out = library.embedding(flat, weight, padding_idx)
    else:
        out = apply_function(EmbeddingFunction, flat, weight, padding_idx)
    return out.view(*tokens.shape, H)
