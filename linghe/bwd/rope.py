"""Backward kernels of split + qk-norm + RoPE + transpose (HF-layout RoPE's backward is the
same kernel as its forward, see :func:`linghe.fwd.rope.hf_rope`).

Nothing but the inputs is saved: the per-head rstd is recomputed from ``qkv``, which the
backward reads anyway for the norm gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fwd.rope import head_blocks, head_columns, load_partner, rope_tables, token_strides
from ..utils import device_guard, empty, launch, num_sms
from .resident import learn_resident, resident_programs, sum_partials_tall


@triton.jit
def load_heads_bwd(x_row, dy_row, h0, NH, H, HKV, G, D, HALF, R, live, KIND: tl.constexpr,
                   INTERLEAVED: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Gradient heads ``h0 ..`` of one kind of one token (contiguous ``[NH, D]`` at
    ``dy_row``), their rotate-half partners and (for the norm) the input heads of qkv;
    nothing is read unless ``live`` (int 1: the token exists; 0: it does not).
    Returns ``(dy, dy[partner] (dy dtype), x (qkv's dtype; dy[partner] without norm), col
    offsets, mask)``."""
    d = tl.arange(0, BLOCK_D)
    h = h0 + tl.arange(0, BLOCK_H)
    mask = (h < NH * live)[:, None] & (d < D)[None, :]
    col = head_columns(h, H, HKV, G, KIND, INTERLEAVED) * D
    src = dy_row + h[:, None] * D
    dy = tl.load(src + d[None, :], mask=mask, other=0.0)
    if ROPE:
        dyp = load_partner(src, d[None, :], HALF, R, mask)
    else:
        dyp = dy.to(tl.float32)
    if NORM:
        x = tl.load(x_row + col[:, None] + d[None, :], mask=mask, other=0.0)
    else:
        x = dyp
    return dy, dyp, x, col, mask


@triton.jit
def finish_heads_bwd(dy, dyp, x, col, mask, dx_row, w, acc, D, eps, cos, sin_s,
                     NORM: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr):
    """RoPE backward ``g = dy*cos - dy[p]*sin_s``, then the RMSNorm backward
    ``dx = rstd * (g*w - xhat * mean(g*w*xhat))`` and ``dw += sum(g * xhat)``; store dx
    into the token's row of dqkv. Returns the updated ``acc``."""
    d = tl.arange(0, BLOCK_D)
    if ROPE:
        g = dy.to(tl.float32) * cos[None, :] - dyp * sin_s[None, :]
        if NORM:
            x = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            xhat = x * rstd[:, None]
            acc += tl.sum(g * xhat, axis=0)
            gw = g * w[None, :]
            c = tl.sum(gw * xhat, axis=1) / D
            g = (gw - xhat * c[:, None]) * rstd[:, None]
    else:
        g = dy
    tl.store(dx_row + col[:, None] + d[None, :], g.to(dx_row.dtype.element_ty), mask=mask)
    return acc


@triton.jit
def _qkv_part_bwd(x_row, dy_row, dx_row, w, acc, NH, H, HKV, G, D, HALF, R, eps, cos, sin_s,
                  live, KIND: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                  ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's heads of one kind, in head blocks."""
    for h0 in range(0, NH, BLOCK_H):
        dy, dyp, x, col, mask = load_heads_bwd(x_row, dy_row, h0, NH, H, HKV, G, D, HALF, R,
                                               live, KIND, INTERLEAVED, NORM, ROPE, BLOCK_H,
                                               BLOCK_D)
        acc = finish_heads_bwd(dy, dyp, x, col, mask, dx_row, w, acc, D, eps, cos, sin_s,
                               NORM, ROPE, BLOCK_D)
    return acc


@triton.jit
def heads_cols(NH, H, HKV, G, D, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(col offsets, mask)`` of all heads of one kind (one tile)."""
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    mask = (h < NH)[:, None] & (d < D)[None, :]
    col = head_columns(h, H, HKV, G, KIND, INTERLEAVED) * D
    return col, mask


@triton.jit
def load_token_bwd(qkv_ptr, dq_ptr, dk_ptr, dv_ptr, t, T, S, H, HKV, G, D, HALF, R,
                   stride_b, stride_s, INTERLEAVED: tl.constexpr, NORM_Q: tl.constexpr,
                   NORM_K: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """Every load of token ``t`` (int64; nothing is read when ``t >= T``) when all heads of
    a kind fit one tile: ``(dq, dq[p], xq, dk, dk[p], xk, dv)``."""
    ok = (t < T).to(tl.int32)
    b = t // S
    s = t - b * S
    x_row = qkv_ptr + b * stride_b + s * stride_s
    gq, gqp, xq, _, _ = load_heads_bwd(x_row, dq_ptr + t * H * D, 0, H, H, HKV, G, D, HALF,
                                       R, ok, 0, INTERLEAVED, NORM_Q, True, BLOCK_HQ, BLOCK_D)
    gk, gkp, xk, _, _ = load_heads_bwd(x_row, dk_ptr + t * HKV * D, 0, HKV, H, HKV, G, D,
                                       HALF, R, ok, 1, INTERLEAVED, NORM_K, True, BLOCK_HK,
                                       BLOCK_D)
    gv, _, _, _, _ = load_heads_bwd(x_row, dv_ptr + t * HKV * D, 0, HKV, H, HKV, G, D, HALF,
                                    R, ok, 2, INTERLEAVED, False, False, BLOCK_HK, BLOCK_D)
    return gq, gqp, xq, gk, gkp, xk, gv


@triton.jit
def _qk_norm_rope_bwd_kernel(qkv_ptr, dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, freqs_ptr, pos_ptr,
                             qw_ptr, kw_ptr, dw_ptr, T, S, H, HKV, D, HALF, R, NPOS,
                             stride_b, stride_s, dstride_b, dstride_s, eps,
                             INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
                             NORM_Q: tl.constexpr, NORM_K: tl.constexpr,
                             ONE_BLOCK: tl.constexpr, BLOCK_HQ: tl.constexpr,
                             BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Persistent: program ``pid`` handles tokens ``pid, pid + P, ...`` and writes one
    float32 partial row ``[dq_norm_weight | dk_norm_weight]`` (``2*D``) at ``dw_ptr``."""
    pid = tl.program_id(0)
    zero64 = pid.to(tl.int64) * 0
    P = tl.num_programs(0)
    G = H // HKV
    d = tl.arange(0, BLOCK_D)
    wq = tl.zeros([BLOCK_D], dtype=tl.float32)
    wk = tl.zeros([BLOCK_D], dtype=tl.float32)
    if NORM_Q:
        wq = tl.load(qw_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    if NORM_K:
        wk = tl.load(kw_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    acc_q = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_k = tl.zeros([BLOCK_D], dtype=tl.float32)
    if ONE_BLOCK:
        # Software prefetch: the next token's loads are issued before the current token's
        # math and stores, so each program keeps two tokens of loads in flight.
        gq, gqp, xq, gk, gkp, xk, gv = load_token_bwd(
            qkv_ptr, dq_ptr, dk_ptr, dv_ptr, pid + zero64, T, S, H, HKV, G, D, HALF, R,
            stride_b, stride_s, INTERLEAVED, NORM_Q, NORM_K, BLOCK_HQ, BLOCK_HK, BLOCK_D)
        cq, mq = heads_cols(H, H, HKV, G, D, 0, INTERLEAVED, BLOCK_HQ, BLOCK_D)
        ck, mk = heads_cols(HKV, H, HKV, G, D, 1, INTERLEAVED, BLOCK_HK, BLOCK_D)
        cv, mv = heads_cols(HKV, H, HKV, G, D, 2, INTERLEAVED, BLOCK_HK, BLOCK_D)
        for t32 in range(pid, T, P):
            t = t32 + zero64  # int64 (t32 is a plain int in the interpreter)
            ngq, ngqp, nxq, ngk, ngkp, nxk, ngv = load_token_bwd(
                qkv_ptr, dq_ptr, dk_ptr, dv_ptr, t + P, T, S, H, HKV, G, D, HALF, R,
                stride_b, stride_s, INTERLEAVED, NORM_Q, NORM_K, BLOCK_HQ, BLOCK_HK, BLOCK_D)
            b = t // S
            s = t - b * S
            dx_row = dqkv_ptr + b * dstride_b + s * dstride_s
            if HAS_POS:
                pos = tl.load(pos_ptr + t).to(tl.int64)
            else:
                pos = s
            cos, sin_s = rope_tables(freqs_ptr, pos, NPOS, HALF, R, BLOCK_D)
            acc_k = finish_heads_bwd(gv, gv, gv, cv, mv, dx_row, wk, acc_k, D, eps, cos,
                                     sin_s, False, False, BLOCK_D)
            acc_q = finish_heads_bwd(gq, gqp, xq, cq, mq, dx_row, wq, acc_q, D, eps, cos,
                                     sin_s, NORM_Q, True, BLOCK_D)
            acc_k = finish_heads_bwd(gk, gkp, xk, ck, mk, dx_row, wk, acc_k, D, eps, cos,
                                     sin_s, NORM_K, True, BLOCK_D)
            gq, gqp, xq, gk, gkp, xk, gv = ngq, ngqp, nxq, ngk, ngkp, nxk, ngv
    else:
        for t32 in range(pid, T, P):
            t = t32 + zero64
            b = t // S
            s = t - b * S
            x_row = qkv_ptr + b * stride_b + s * stride_s
            dx_row = dqkv_ptr + b * dstride_b + s * dstride_s
            dq_row = dq_ptr + t * H * D
            dk_row = dk_ptr + t * HKV * D
            dv_row = dv_ptr + t * HKV * D
            if HAS_POS:
                pos = tl.load(pos_ptr + t).to(tl.int64)
            else:
                pos = s
            cos, sin_s = rope_tables(freqs_ptr, pos, NPOS, HALF, R, BLOCK_D)
            acc_q = _qkv_part_bwd(x_row, dq_row, dx_row, wq, acc_q, H, H, HKV, G, D, HALF, R,
                                  eps, cos, sin_s, 1, 0, INTERLEAVED, NORM_Q, True, BLOCK_HQ,
                                  BLOCK_D)
            acc_k = _qkv_part_bwd(x_row, dk_row, dx_row, wk, acc_k, HKV, H, HKV, G, D, HALF, R,
                                  eps, cos, sin_s, 1, 1, INTERLEAVED, NORM_K, True, BLOCK_HK,
                                  BLOCK_D)
            acc_k = _qkv_part_bwd(x_row, dv_row, dx_row, wk, acc_k, HKV, H, HKV, G, D, HALF, R,
                                  eps, cos, sin_s, 1, 2, INTERLEAVED, False, False, BLOCK_HK,
                                  BLOCK_D)
    if NORM_Q:
        tl.store(dw_ptr + pid * (2 * D) + d, acc_q, mask=d < D)
    if NORM_K:
        tl.store(dw_ptr + pid * (2 * D) + D + d, acc_k, mask=d < D)


#: Persistent backward programs per SM (knob: each program loops over tokens and writes
#: one float32 partial row of the norm-weight gradients; with the prefetch each program
#: holds two tokens' tiles in registers). This is the guess before the kernel's fit is
#: known; after the first launch, what fits an SM (register use), at most the MAX.
PROGRAMS_PER_SM = 3
MAX_PROGRAMS_PER_SM = 8

def _programs(T: int, device, key) -> int:
    return max(1, min(T, num_sms(device) * resident_programs(key, PROGRAMS_PER_SM)))


def qk_norm_rope_bwd(dq, dk, dv, qkv, freqs, position_ids, q_norm_weight, k_norm_weight, *,
                     num_heads, num_kv_heads, head_dim, rotary_dim, layout, interleaved, eps,
                     qkv_shape=None, qkv_dtype=None):
    """Returns ``(dqkv, dq_norm_weight, dk_norm_weight)``; ``dq/dk/dv`` contiguous
    ``[B, S, H|Hkv, D]``. ``dqkv`` is contiguous in ``qkv``'s layout and dtype; weight
    gradients are float32 partial sums per program reduced by ``sum_partials`` (float32), then
    cast to the weight's dtype (``None`` where there is no weight). Without norm weights
    ``qkv`` is not read and may be ``None`` (then ``qkv_shape``/``qkv_dtype`` are given)."""
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    nq, nk = q_norm_weight is not None, k_norm_weight is not None
    if qkv is None:
        assert not (nq or nk), "qkv is needed for the norm backward"
        dqkv = empty(qkv_shape, dtype=qkv_dtype, device=dq.device)
        qkv, stride_b, stride_s = dqkv, 0, 0  # never read
        B, S, _, _ = token_strides(dqkv, layout)
    else:
        B, S, stride_b, stride_s = token_strides(qkv, layout)
        dqkv = empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _, _, dstride_b, dstride_s = token_strides(dqkv, layout)
    T = B * S
    BHQ, BHK, BD, nw = head_blocks(H, Hkv, D)
    key = ("qk_norm_rope_bwd", qkv.device.index, qkv.dtype, nq, nk, interleaved,
           position_ids is not None, BHQ, BHK, BD, nw)
    P = _programs(T, qkv.device, key)
    # One float32 partial row per program: [q weight grad | k weight grad].
    partial = empty(P, 2 * D, dtype=torch.float32, device=qkv.device) if nq or nk else None
    if T > 0:
        dummy = freqs
        with device_guard(qkv):
            ck = launch(_qk_norm_rope_bwd_kernel, (P,),
                qkv, dq, dk, dv, dqkv, freqs,
                position_ids if position_ids is not None else dummy,
                q_norm_weight if nq else dummy, k_norm_weight if nk else dummy,
                partial if partial is not None else dummy,
                T, S, H, Hkv, D, rotary_dim // 2, rotary_dim, freqs.shape[0], stride_b,
                stride_s, dstride_b, dstride_s, eps,
                INTERLEAVED=interleaved, HAS_POS=position_ids is not None, NORM_Q=nq,
                NORM_K=nk, ONE_BLOCK=H <= BHQ and Hkv <= BHK, BLOCK_HQ=BHQ, BLOCK_HK=BHK,
                BLOCK_D=BD, num_warps=nw)
        learn_resident(key, ck, nw, MAX_PROGRAMS_PER_SM)
    gq = gk = None
    if T == 0:
        gq = torch.zeros_like(q_norm_weight) if nq else None
        gk = torch.zeros_like(k_norm_weight) if nk else None
    elif nq and nk and q_norm_weight.dtype == k_norm_weight.dtype:
        both = sum_partials_tall(partial, q_norm_weight.dtype)  # one launch for both weights
        gq, gk = both[:D], both[D:]
    else:
        if nq:
            gq = sum_partials_tall(partial[:, :D].contiguous(), q_norm_weight.dtype)
        if nk:
            gk = sum_partials_tall(partial[:, D:].contiguous(), k_norm_weight.dtype)
    return dqkv, gq, gk
