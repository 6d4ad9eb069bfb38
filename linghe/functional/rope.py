"""Rotary position embedding: fused split + qk-norm + RoPE + transpose (Megatron layout)
and Hugging Face-layout ``apply_rope``."""

from __future__ import annotations

import torch

from .. import library, reference
from ..bwd.rope import qk_norm_rope_bwd
from ..fwd.rope import hf_rope, qk_norm_rope_fwd
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    check_kernel_device,
    check_tensor,
    debug_enabled,
)

_INT_DTYPES = (torch.int32, torch.int64)


def rope_freqs(max_pos: int, rotary_dim: int, base: float = 10000.0,
               device=None) -> torch.Tensor:
    """RoPE angles ``[max_pos, rotary_dim/2]`` float32 for :func:`qk_norm_rope`:
    ``freqs[p, i] = p * base^(-2i/rotary_dim)`` (computed in float64, stored float32)."""
    if not isinstance(max_pos, int) or max_pos < 0:
        raise ValueError(f"max_pos must be a non-negative int, got {max_pos!r}")
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    return reference.rope_freqs(max_pos, rotary_dim, base).to(device)


def _check_positions(position_ids: torch.Tensor, max_pos: int) -> None:
    if debug_enabled() and position_ids.numel():
        lo, hi = int(position_ids.min()), int(position_ids.max())
        if lo < 0 or hi >= max_pos:
            raise ValueError(f"position_ids must lie in [0, {max_pos}) (the rows of the "
                             f"angle/cos table), got values in [{lo}, {hi}]")


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, freqs, position_ids, qw, kw, opts):
        q, k, v = qk_norm_rope_fwd(qkv, freqs, position_ids, qw, kw, **opts)
        norm = qw is not None or kw is not None
        # The norm backward recomputes rstd from qkv (read anyway for dw), so qkv is saved
        # only when a norm weight is given; no activation is saved otherwise.
        ctx.save_for_backward(qkv if norm else None, freqs, position_ids, qw, kw)
        ctx.meta = (qkv.shape, qkv.dtype, qkv.device)
        ctx.opts = opts
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, freqs, position_ids, qw, kw = ctx.saved_tensors
        shape, dtype, device = ctx.meta
        dq = dq.contiguous() if dq is not None else None
        dk = dk.contiguous() if dk is not None else None
        dv = dv.contiguous() if dv is not None else None
        H, Hkv, D = ctx.opts["num_heads"], ctx.opts["num_kv_heads"], ctx.opts["head_dim"]
        B, S = (shape[1], shape[0]) if ctx.opts["layout"] == "sbh" else (shape[0], shape[1])
        if dq is None:
            dq = torch.zeros(B, S, H, D, dtype=dtype, device=device)
        if dk is None:
            dk = torch.zeros(B, S, Hkv, D, dtype=dtype, device=device)
        if dv is None:
            dv = torch.zeros(B, S, Hkv, D, dtype=dtype, device=device)
        dqkv, dqw, dkw = qk_norm_rope_bwd(dq, dk, dv, qkv, freqs, position_ids, qw, kw,
                                          qkv_shape=shape, qkv_dtype=dtype, **ctx.opts)
        return dqkv, None, None, dqw, dkw, None


def qk_norm_rope(qkv: torch.Tensor, freqs: torch.Tensor, *, num_heads: int,
                 num_kv_heads: int, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None, rotary_dim: int | None = None,
                 layout: str = "sbh", interleaved: bool = True,
                 position_ids: torch.Tensor | None = None, eps: float = 1e-6):
    """Split a fused QKV projection into heads, RMS-normalize q and k per head, apply
    rotate-half RoPE and transpose to the flash-attention layout, in one kernel.

    Args:
        qkv: ``[S, B, (H + 2*Hkv) * D]`` (``layout="sbh"``) or ``[B, S, ...]`` (``"bsh"``),
            float32/float16/bfloat16, last dim contiguous (other strides are free).
        freqs: RoPE angles ``[max_pos, rotary_dim/2]`` float32 (:func:`rope_freqs`);
            ``max_pos`` must exceed every position.
        num_heads, num_kv_heads: ``H`` and ``Hkv``; with ``interleaved=True`` ``H`` must
            be a multiple of ``Hkv``.
        q_norm_weight, k_norm_weight: ``[D]`` RMSNorm weights (any float dtype) or ``None``
            (no norm on that tensor).
        rotary_dim: dims rotated (the first ``rotary_dim`` of each head; even, ``<= D``;
            default ``D``); pairs are ``(i, i + rotary_dim/2)`` (NeoX / rotate-half).
        interleaved: Megatron GQA order (per kv group: its ``H/Hkv`` query heads, then k,
            then v); ``False``: ``[all q | all k | all v]``.
        position_ids: ``[B, S]`` int32/int64 positions (packed sequences); default
            ``0..S-1`` for every batch row. A position outside ``[0, max_pos)`` is never
            read out of bounds: it gets no rotation, and in debug mode
            (:func:`linghe.set_debug`) it raises ``ValueError`` (a host sync).
        eps: RMSNorm epsilon.

    Returns ``q [B, S, H, D]``, ``k [B, S, Hkv, D]``, ``v [B, S, Hkv, D]``, contiguous,
    in ``qkv``'s dtype; math is float32 (norm, then RoPE with ``cos/sin`` of the angle).

    Backward: ``dqkv`` (contiguous, ``qkv``'s shape/layout/dtype) and the norm weights'
    gradients (float32 accumulation, per-program partials summed in float32). Saved for
    backward: references to ``qkv`` (only when a norm weight is given; the per-head rstd
    is recomputed from it), ``freqs``, ``position_ids`` and the weights; no new buffer.
    """
    check_tensor("qkv", qkv, dtypes=FLOAT_DTYPES, ndim=3, last_dim_contiguous=True)
    check_kernel_device("qkv", qkv)
    if layout not in ("sbh", "bsh"):
        raise ValueError(f'layout must be "sbh" or "bsh", got {layout!r}')
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    H, Hkv = num_heads, num_kv_heads
    W = qkv.shape[-1]
    if W % (H + 2 * Hkv) != 0 or W == 0:
        raise ValueError(f"qkv's last dim ({W}) must be (num_heads + 2*num_kv_heads) * "
                         f"head_dim = {H + 2 * Hkv} * head_dim")
    D = W // (H + 2 * Hkv)
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D} (qkv last dim {W} / {H + 2 * Hkv})")
    if interleaved and H % Hkv:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({Hkv}) for "
                         "interleaved=True")
    R = D if rotary_dim is None else rotary_dim
    if not isinstance(R, int) or R <= 0 or R % 2 or R > D:
        raise ValueError(f"rotary_dim must be a positive even int <= head_dim ({D}), got "
                         f"{rotary_dim!r}")
    check_tensor("freqs", freqs, dtypes=(torch.float32,), ndim=2, device=qkv.device,
                 contiguous=True)
    if freqs.shape[1] != R // 2:
        raise ValueError(f"freqs must have shape (max_pos, rotary_dim/2 = {R // 2}), got "
                         f"{tuple(freqs.shape)}")
    B, S = (qkv.shape[1], qkv.shape[0]) if layout == "sbh" else (qkv.shape[0], qkv.shape[1])
    if position_ids is not None:
        check_tensor("position_ids", position_ids, dtypes=_INT_DTYPES, shape=(B, S),
                     device=qkv.device)
        position_ids = position_ids.contiguous()
        _check_positions(position_ids, freqs.shape[0])
    elif freqs.shape[0] < S:
        raise ValueError(f"freqs has {freqs.shape[0]} positions but the sequence length is "
                         f"{S}; need freqs.shape[0] >= S")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(name, w, dtypes=FLOAT_DTYPES, shape=(D,), device=qkv.device,
                         contiguous=True)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    # (every tensor was checked on qkv's device above: no separate same-device pass)
    opts = dict(num_heads=H, num_kv_heads=Hkv, head_dim=D, rotary_dim=R, layout=layout,
                interleaved=bool(interleaved), eps=float(eps))
    if torch.compiler.is_compiling():
        return library.qk_norm_rope(qkv, freqs, position_ids, q_norm_weight, k_norm_weight, opts)
    return apply_function(_QKNormRope, qkv, freqs, position_ids, q_norm_weight, k_norm_weight, opts)


class _ApplyRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids):
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.shapes = (q.shape, k.shape)
        return hf_rope(q, k, cos, sin, position_ids, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        qs, ks = ctx.shapes
        if dq is None:
            dq = torch.zeros(qs, dtype=dk.dtype, device=dk.device)
        if dk is None:
            dk = torch.zeros(ks, dtype=dq.dtype, device=dq.device)
        # The kernel reads the last dim with stride 1; a broadcast gradient (of .sum()) has
        # stride 0 there.
        gq, gk = hf_rope(dq.contiguous(), dk.contiguous(), cos, sin, position_ids,
                         backward=True)
        return gq, gk, None, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor | None = None):
    """Hugging Face ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``), fused
    for q and k, forward and backward.

    Args:
        q: ``[B, H, S, D]``, k: ``[B, Hk, S, D]``, same float dtype, D even, last dim
            contiguous (any other strides, e.g. a transposed ``[B, S, H, D]`` view).
        cos, sin: ``[S, D]`` or ``[B, S, D]`` (``[1, S, D]`` broadcasts) as HF's rotary
            embedding returns them, any float dtype; with ``position_ids [B, S]`` they are
            tables ``[max_pos, D]`` gathered at those positions (older HF convention; an
            out-of-range position is never read out of bounds: it gets cos 0, sin 0;
            debug mode raises).
            They are treated as constants (no gradient; an error if they require one).

    Returns ``(q_embed, k_embed)`` contiguous ``[B, H|Hk, S, D]`` in q's dtype; math in
    float32. Saved for backward: references to ``cos``, ``sin``, ``position_ids``.
    """
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4, last_dim_contiguous=True)
    check_kernel_device("q", q)
    check_tensor("k", k, dtypes=(q.dtype,), ndim=4, device=q.device, last_dim_contiguous=True)
    B, H, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"k must have shape ({B}, Hk, {S}, {D}) to match q, got "
                         f"{tuple(k.shape)}")
    if D % 2:
        raise ValueError(f"head_dim (q.shape[-1]) must be even, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, device=q.device, last_dim_contiguous=True)
        if torch.is_grad_enabled() and t.requires_grad:
            raise ValueError(f"{name} requires grad; apply_rope treats cos/sin as constants "
                             "(compute them under torch.no_grad() or detach them)")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got "
                         f"{tuple(sin.shape)}")
    if sin.stride() != cos.stride():
        sin = sin.contiguous()
        cos = cos.contiguous()
    if position_ids is not None:
        check_tensor("position_ids", position_ids, dtypes=_INT_DTYPES, shape=(B, S),
                     device=q.device)
        check_tensor("cos", cos, ndim=2, shape=(None, D))
        position_ids = position_ids.contiguous()
        _check_positions(position_ids, cos.shape[0])
    else:
        if cos.dim() == 2:
            check_tensor("cos", cos, shape=(S, D))
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        check_tensor("cos", cos, ndim=3, shape=(None, S, D))
        if cos.shape[0] not in (1, B):
            raise ValueError(f"cos must have batch size 1 or {B}, got {tuple(cos.shape)}")
        cos, sin = cos.expand(B, S, D), sin.expand(B, S, D)
    if torch.compiler.is_compiling():
        return library.apply_rope(q, k, cos, sin, position_ids)
    return apply_function(_ApplyRope, q, k, cos, sin, position_ids)
