"""Forward kernels: split + qk-norm + rotate-half RoPE + transpose, and HF-layout RoPE.

Shared in-kernel helpers (``rope_tables``, ``head_columns``, ``reduce_angle``) are also
used by :mod:`linghe.bwd.rope`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..bwd.resident import learn_resident, resident_programs
from ..utils import device_guard, empty, launch, next_power_of_2, num_sms


@triton.jit
def reduce_angle(a):
    """``a`` reduced to about ``[-pi, pi]`` (fp32 Cody-Waite), so that GPU sin/cos
    approximations, accurate only near zero, stay accurate for large positions. Cody-Waite
    split of 2*pi: 6.28125 has 8 significant bits, so ``k * 6.28125`` is exact."""
    k = tl.floor(a * 0.15915494309189535 + 0.5)
    return (a - k * 6.28125) - k * 1.9353071795864769e-03


@triton.jit
def rope_tables(freqs_ptr, pos, NPOS, HALF, R, BLOCK_D: tl.constexpr):
    """Per-dim RoPE factors for one position (fp32 ``[BLOCK_D]``), ``HALF = R/2``.

    Returns ``(cos, sin_s)``: ``cos`` (1 outside the rotary dims) and ``sin`` signed so
    that ``y = x*cos + x[partner]*sin_s`` (``-sin`` in the first half, ``+sin`` in the
    second, 0 outside), ``partner`` being ``i + R/2`` in the first half, ``i - R/2`` in
    the second (:func:`load_partner`). A position outside ``[0, NPOS)`` reads nothing and
    gets angle 0 (no rotation).
    """
    d = tl.arange(0, BLOCK_D)
    first = d < HALF
    rot = d < R
    fi = tl.where(first, d, d - HALF)
    pv = pos + tl.zeros([BLOCK_D], dtype=tl.int64)
    ok = rot & (pv >= 0) & (pv < NPOS)
    ang = tl.load(freqs_ptr + pv * HALF + fi, mask=ok, other=0.0).to(tl.float32)
    ang = reduce_angle(ang)
    cos = tl.where(rot, tl.cos(ang), 1.0)
    sin = tl.sin(ang)
    sin_s = tl.where(first, -sin, tl.where(rot, sin, 0.0))
    return cos, sin_s


@triton.jit
def load_partner(ptr, d, HALF, R, mask):
    """``x[partner(d)]`` in ``ptr``'s dtype for rows at ``ptr`` (``d`` broadcast against
    ``ptr``): ``x[d + HALF]`` for ``d < HALF``, ``x[d - HALF]`` for ``HALF <= d < R``, 0
    beyond. Two loads with affine (vectorizable) offsets instead of a gather; they hit L1.
    Kept in the narrow dtype (fewer registers while it waits, e.g. across the backward's
    prefetch); float32 math promotes it exactly."""
    first = d < HALF
    second = (d >= HALF) & (d < R)
    a = tl.load(ptr + (d + HALF), mask=mask & first, other=0.0)
    b = tl.load(ptr + (d - HALF), mask=mask & second, other=0.0)
    return tl.where(first, a, b)


@triton.jit
def head_columns(h, H, HKV, G, KIND: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Column (in head units) of head ``h`` of kind 0=q, 1=k, 2=v in the fused projection
    (``G = H / Hkv`` query heads per kv group)."""
    if INTERLEAVED:
        if KIND == 0:
            col = (h // G) * (G + 2) + h % G
        elif KIND == 1:
            col = h * (G + 2) + G
        else:
            col = h * (G + 2) + G + 1
    else:
        if KIND == 0:
            col = h
        elif KIND == 1:
            col = H + h
        else:
            col = H + HKV + h
    return col


@triton.jit
def load_norm_weight(w_ptr, D, HALF, R, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(w, w[partner])`` as fp32 ``[BLOCK_D]`` (ones when there is no norm)."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    if NORM:
        w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        wp = load_partner(w_ptr, d, HALF, R, dmask)
    else:
        w = tl.full([BLOCK_D], 1.0, tl.float32)
        wp = w
    return w, wp


@triton.jit
def load_heads(in_row, h0, NH, H, HKV, G, D, HALF, R, KIND: tl.constexpr,
               INTERLEAVED: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Heads ``h0 .. h0+BLOCK_H`` of one kind of one token of the fused projection.
    Returns ``(x [BLOCK_H, BLOCK_D] and x[partner] in the input dtype (x when not ROPE), h,
    col offsets, mask)``."""
    d = tl.arange(0, BLOCK_D)
    h = h0 + tl.arange(0, BLOCK_H)
    mask = (h < NH)[:, None] & (d < D)[None, :]
    col = head_columns(h, H, HKV, G, KIND, INTERLEAVED) * D
    src = in_row + col[:, None]
    x = tl.load(src + d[None, :], mask=mask, other=0.0)
    if ROPE:
        xp = load_partner(src, d[None, :], HALF, R, mask)
    else:
        xp = x
    return x, xp, h, col, mask


@triton.jit
def finish_heads_fwd(x, xp, h, mask, out_row, w, wp, D, eps, cos, sin_s,
                     NORM: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr):
    """(norm), (rope) and store heads ``h`` of one token contiguously at ``out_row``."""
    d = tl.arange(0, BLOCK_D)
    if ROPE:
        y = x.to(tl.float32)
        if NORM:
            rstd = tl.math.rsqrt(tl.sum(y * y, axis=1) / D + eps)
            y = y * rstd[:, None] * w[None, :]
            xp = xp * rstd[:, None] * wp[None, :]
        y = y * cos[None, :] + xp * sin_s[None, :]
    else:
        y = x
    tl.store(out_row + h[:, None] * D + d[None, :], y.to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_part_fwd(in_row, out_row, w_ptr, NH, H, HKV, G, D, HALF, R, eps, cos, sin_s,
                  KIND: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                  ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's heads of one kind, in head blocks: load, (norm), (rope), store."""
    w, wp = load_norm_weight(w_ptr, D, HALF, R, NORM, BLOCK_D)
    for h0 in range(0, NH, BLOCK_H):
        x, xp, h, col, mask = load_heads(in_row, h0, NH, H, HKV, G, D, HALF, R, KIND,
                                         INTERLEAVED, ROPE, BLOCK_H, BLOCK_D)
        finish_heads_fwd(x, xp, h, mask, out_row, w, wp, D, eps, cos, sin_s, NORM, ROPE,
                         BLOCK_D)


@triton.jit
def _qk_norm_rope_fwd_kernel(qkv_ptr, freqs_ptr, pos_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr,
                             v_ptr, S, H, HKV, D, HALF, R, NPOS, stride_b, stride_s, eps,
                             INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
                             NORM_Q: tl.constexpr, NORM_K: tl.constexpr,
                             ONE_BLOCK: tl.constexpr, BLOCK_HQ: tl.constexpr,
                             BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # token in output order: t = b * S + s
    b = t // S
    s = t - b * S
    G = H // HKV
    in_row = qkv_ptr + b * stride_b + s * stride_s
    q_row, k_row, v_row = q_ptr + t * H * D, k_ptr + t * HKV * D, v_ptr + t * HKV * D
    if ONE_BLOCK:
        # Every head fits one tile per kind: issue all loads before any math.
        xq, xqp, hq, _, mq = load_heads(in_row, 0, H, H, HKV, G, D, HALF, R, 0, INTERLEAVED,
                                        True, BLOCK_HQ, BLOCK_D)
        xk, xkp, hk, _, mk = load_heads(in_row, 0, HKV, H, HKV, G, D, HALF, R, 1,
                                        INTERLEAVED, True, BLOCK_HK, BLOCK_D)
        xv, _, hv, _, mv = load_heads(in_row, 0, HKV, H, HKV, G, D, HALF, R, 2, INTERLEAVED,
                                      False, BLOCK_HK, BLOCK_D)
    if HAS_POS:
        pos = tl.load(pos_ptr + t).to(tl.int64)
    else:
        pos = s
    cos, sin_s = rope_tables(freqs_ptr, pos, NPOS, HALF, R, BLOCK_D)
    if ONE_BLOCK:
        wq, wqp = load_norm_weight(qw_ptr, D, HALF, R, NORM_Q, BLOCK_D)
        wk, wkp = load_norm_weight(kw_ptr, D, HALF, R, NORM_K, BLOCK_D)
        finish_heads_fwd(xv, xv, hv, mv, v_row, wk, wkp, D, eps, cos, sin_s, False, False,
                         BLOCK_D)
        finish_heads_fwd(xq, xqp, hq, mq, q_row, wq, wqp, D, eps, cos, sin_s, NORM_Q, True,
                         BLOCK_D)
        finish_heads_fwd(xk, xkp, hk, mk, k_row, wk, wkp, D, eps, cos, sin_s, NORM_K, True,
                         BLOCK_D)
    else:
        _qkv_part_fwd(in_row, q_row, qw_ptr, H, H, HKV, G, D, HALF, R, eps, cos, sin_s, 0,
                      INTERLEAVED, NORM_Q, True, BLOCK_HQ, BLOCK_D)
        _qkv_part_fwd(in_row, k_row, kw_ptr, HKV, H, HKV, G, D, HALF, R, eps, cos, sin_s, 1,
                      INTERLEAVED, NORM_K, True, BLOCK_HK, BLOCK_D)
        _qkv_part_fwd(in_row, v_row, kw_ptr, HKV, H, HKV, G, D, HALF, R, eps, cos, sin_s, 2,
                      INTERLEAVED, False, False, BLOCK_HK, BLOCK_D)


@triton.jit
def _load_token_fwd(qkv_ptr, t, T, S, H, HKV, G, D, HALF, R, stride_b, stride_s,
                    INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Every load of token ``t`` (int64, output order; nothing is read when ``t >= T``)
    when all heads of a kind fit one tile: ``(xq, xq[p], xk, xk[p], xv)``, input dtype."""
    live = (t < T).to(tl.int32)
    b = t // S
    s = t - b * S
    in_row = qkv_ptr + b * stride_b + s * stride_s
    xq, xqp, _, _, _ = load_heads(in_row, 0, H * live, H, HKV, G, D, HALF, R, 0, INTERLEAVED,
                                  True, BLOCK_HQ, BLOCK_D)
    xk, xkp, _, _, _ = load_heads(in_row, 0, HKV * live, H, HKV, G, D, HALF, R, 1,
                                  INTERLEAVED, True, BLOCK_HK, BLOCK_D)
    xv, _, _, _, _ = load_heads(in_row, 0, HKV * live, H, HKV, G, D, HALF, R, 2, INTERLEAVED,
                                False, BLOCK_HK, BLOCK_D)
    return xq, xqp, xk, xkp, xv


@triton.jit
def _qk_norm_rope_fwd_persistent_kernel(qkv_ptr, freqs_ptr, pos_ptr, qw_ptr, kw_ptr, q_ptr,
                                        k_ptr, v_ptr, T, S, H, HKV, D, HALF, R, NPOS,
                                        stride_b, stride_s, eps, INTERLEAVED: tl.constexpr,
                                        HAS_POS: tl.constexpr, NORM_Q: tl.constexpr,
                                        NORM_K: tl.constexpr, BLOCK_HQ: tl.constexpr,
                                        BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Persistent variant of :func:`_qk_norm_rope_fwd_kernel` for heads that fit one tile
    per kind: program ``pid`` handles tokens ``pid, pid + P, ...`` and issues the next
    token's loads before the current token's math and stores (two tokens in flight)."""
    pid = tl.program_id(0)
    zero64 = pid.to(tl.int64) * 0
    P = tl.num_programs(0)
    G = H // HKV
    d = tl.arange(0, BLOCK_D)
    hq = tl.arange(0, BLOCK_HQ)
    hk = tl.arange(0, BLOCK_HK)
    mq = (hq < H)[:, None] & (d < D)[None, :]
    mk = (hk < HKV)[:, None] & (d < D)[None, :]
    wq, wqp = load_norm_weight(qw_ptr, D, HALF, R, NORM_Q, BLOCK_D)
    wk, wkp = load_norm_weight(kw_ptr, D, HALF, R, NORM_K, BLOCK_D)
    xq, xqp, xk, xkp, xv = _load_token_fwd(qkv_ptr, pid + zero64, T, S, H, HKV, G, D, HALF,
                                           R, stride_b, stride_s, INTERLEAVED, BLOCK_HQ,
                                           BLOCK_HK, BLOCK_D)
    for t32 in range(pid, T, P):
        t = t32 + zero64  # int64 (t32 is a plain int in the interpreter)
        nxq, nxqp, nxk, nxkp, nxv = _load_token_fwd(qkv_ptr, t + P, T, S, H, HKV, G, D, HALF,
                                                    R, stride_b, stride_s, INTERLEAVED,
                                                    BLOCK_HQ, BLOCK_HK, BLOCK_D)
        if HAS_POS:
            pos = tl.load(pos_ptr + t).to(tl.int64)
        else:
            pos = t - (t // S) * S
        cos, sin_s = rope_tables(freqs_ptr, pos, NPOS, HALF, R, BLOCK_D)
        finish_heads_fwd(xv, xv, hk, mk, v_ptr + t * HKV * D, wk, wkp, D, eps, cos, sin_s,
                         False, False, BLOCK_D)
        finish_heads_fwd(xq, xqp, hq, mq, q_ptr + t * H * D, wq, wqp, D, eps, cos, sin_s,
                         NORM_Q, True, BLOCK_D)
        finish_heads_fwd(xk, xkp, hk, mk, k_ptr + t * HKV * D, wk, wkp, D, eps, cos, sin_s,
                         NORM_K, True, BLOCK_D)
        xq, xqp, xk, xkp, xv = nxq, nxqp, nxk, nxkp, nxv


#: Use the persistent, prefetching forward when all heads fit one tile per kind (False =
#: one program per token, the round-1 kernel). Measured on an H200 at the standard shape
#: (seq 4096 x 2, 16q/4kv heads of 128): one program per token 39.6 µs, persistent 46.5.
FWD_PERSISTENT = False
#: Persistent forward programs per SM before the kernel's fit is known, and the cap after.
FWD_PROGRAMS_PER_SM = 4
FWD_MAX_PROGRAMS_PER_SM = 16

@functools.cache  # per-shape decision, cached (host time)
def head_blocks(H: int, Hkv: int, D: int):
    """(BLOCK_HQ, BLOCK_HK, BLOCK_D, num_warps): head tiles of at most 4096 elements."""
    BLOCK_D = next_power_of_2(max(D, 2))
    cap = max(1, 4096 // BLOCK_D)
    BLOCK_HQ = min(next_power_of_2(H), cap)
    BLOCK_HK = min(next_power_of_2(Hkv), cap)
    num_warps = 4 if BLOCK_HQ * BLOCK_D >= 1024 else 2
    return BLOCK_HQ, BLOCK_HK, BLOCK_D, num_warps


def token_strides(qkv: torch.Tensor, layout: str):
    """(B, S, stride_b, stride_s) of the fused projection in either layout."""
    if layout == "sbh":
        S, B = qkv.shape[0], qkv.shape[1]
        return B, S, qkv.stride(1), qkv.stride(0)
    B, S = qkv.shape[0], qkv.shape[1]
    return B, S, qkv.stride(0), qkv.stride(1)


def qk_norm_rope_fwd(qkv, freqs, position_ids, q_norm_weight, k_norm_weight, *, num_heads,
                     num_kv_heads, head_dim, rotary_dim, layout, interleaved, eps):
    """Launch the forward; inputs are validated by ``functional.rope``. Returns (q, k, v)."""
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    B, S, stride_b, stride_s = token_strides(qkv, layout)
    dev = qkv.device
    q = empty(B, S, H, D, dtype=qkv.dtype, device=dev)
    k = empty(B, S, Hkv, D, dtype=qkv.dtype, device=dev)
    v = empty(B, S, Hkv, D, dtype=qkv.dtype, device=dev)
    T = B * S
    if T == 0:
        return q, k, v
    BHQ, BHK, BD, nw = head_blocks(H, Hkv, D)
    dummy = freqs
    one_block = H <= BHQ and Hkv <= BHK
    if FWD_PERSISTENT and one_block:
        nq, nk, pos = q_norm_weight is not None, k_norm_weight is not None, position_ids
        key = ("qk_norm_rope_fwd", dev.index, qkv.dtype, nq, nk, interleaved,
               pos is not None, BHQ, BHK, BD, nw)
        P = max(1, min(T, num_sms(dev) * resident_programs(key, FWD_PROGRAMS_PER_SM)))
        with device_guard(qkv):
            ck = launch(_qk_norm_rope_fwd_persistent_kernel, (P,),
                qkv, freqs, pos if pos is not None else dummy,
                q_norm_weight if nq else dummy, k_norm_weight if nk else dummy,
                q, k, v, T, S, H, Hkv, D, rotary_dim // 2, rotary_dim, freqs.shape[0],
                stride_b, stride_s, eps, INTERLEAVED=interleaved, HAS_POS=pos is not None,
                NORM_Q=nq, NORM_K=nk, BLOCK_HQ=BHQ, BLOCK_HK=BHK, BLOCK_D=BD, num_warps=nw)
        learn_resident(key, ck, nw, FWD_MAX_PROGRAMS_PER_SM)
        return q, k, v
    with device_guard(qkv):
        launch(_qk_norm_rope_fwd_kernel, (T,),
            qkv, freqs, position_ids if position_ids is not None else dummy,
            q_norm_weight if q_norm_weight is not None else dummy,
            k_norm_weight if k_norm_weight is not None else dummy,
            q, k, v, S, H, Hkv, D, rotary_dim // 2, rotary_dim, freqs.shape[0], stride_b,
            stride_s, eps,
            INTERLEAVED=interleaved, HAS_POS=position_ids is not None,
            NORM_Q=q_norm_weight is not None, NORM_K=k_norm_weight is not None,
            ONE_BLOCK=one_block, BLOCK_HQ=BHQ, BLOCK_HK=BHK, BLOCK_D=BD, num_warps=nw)
    return q, k, v


# --------------------------------------------------------------------------------------
# HF layout: q [B, H, S, D], k [B, Hk, S, D], cos/sin [S, D] or [B, S, D] (or tables)
# --------------------------------------------------------------------------------------


@triton.jit
def _hf_load(x_ptr, b, s, h0, NH, D, HALF, sxb, sxh, sxs, BLOCK_H: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """Heads ``h0 ..`` of token ``(b, s)``: ``(x fp32, x[partner] input dtype, h int64,
    mask)``."""
    d = tl.arange(0, BLOCK_D)
    h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
    mask = (h < NH)[:, None] & (d < D)[None, :]
    src = x_ptr + b * sxb + s * sxs + h[:, None] * sxh
    x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = load_partner(src, d[None, :], HALF, D, mask)
    return x, xp, h, mask


@triton.jit
def _hf_store(x, xp, h, mask, o_ptr, b, s, NH, S, D, cos, sin, sgn, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    y = x * cos[None, :] + xp * (sgn * sin)[None, :]
    dst = o_ptr + ((b * NH + h[:, None]) * S + s) * D + d[None, :]
    tl.store(dst, y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _hf_part(x_ptr, o_ptr, b, s, NH, S, D, HALF, sxb, sxh, sxs, cos, sin, sgn,
             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    for h0 in range(0, NH, BLOCK_H):
        x, xp, h, mask = _hf_load(x_ptr, b, s, h0, NH, D, HALF, sxb, sxh, sxs, BLOCK_H,
                                  BLOCK_D)
        _hf_store(x, xp, h, mask, o_ptr, b, s, NH, S, D, cos, sin, sgn, BLOCK_D)


@triton.jit
def _hf_rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, NPOS, S, HQ, HK,
                    D, HALF, sqb, sqh, sqs, skb, skh, sks, scb, scs, HAS_POS: tl.constexpr,
                    BACKWARD: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK_HQ: tl.constexpr,
                    BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (b, s) token: all heads of q and k. Forward ``y = x*cos[i] + sgn*x[p]*sin[i]``
    (sgn -1 in the first half); backward ``dx = dy*cos[i] - sgn*dy[p]*sin[p]``."""
    t = tl.program_id(0).to(tl.int64)
    b = t // S
    s = t - b * S
    if ONE_BLOCK:
        # All heads fit one tile per tensor: issue the q and k loads before anything else.
        xq, xqp, hq, mq = _hf_load(q_ptr, b, s, 0, HQ, D, HALF, sqb, sqh, sqs, BLOCK_HQ,
                                   BLOCK_D)
        xk, xkp, hk, mk = _hf_load(k_ptr, b, s, 0, HK, D, HALF, skb, skh, sks, BLOCK_HK,
                                   BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    first = d < HALF
    cmask = dmask
    if HAS_POS:
        pv = tl.load(pos_ptr + t).to(tl.int64) + tl.zeros([BLOCK_D], dtype=tl.int64)
        cmask = dmask & (pv >= 0) & (pv < NPOS)  # out of range: cos = sin = 0, no read
        crow = pv * scs
    else:
        crow = b * scb + s * scs
    cos = tl.load(cos_ptr + crow + d, mask=cmask, other=0.0).to(tl.float32)
    if BACKWARD:
        sin = load_partner(sin_ptr + crow, d, HALF, D, cmask)
        sgn = tl.where(first, 1.0, -1.0)
    else:
        sin = tl.load(sin_ptr + crow + d, mask=cmask, other=0.0).to(tl.float32)
        sgn = tl.where(first, -1.0, 1.0)
    if ONE_BLOCK:
        _hf_store(xq, xqp, hq, mq, qo_ptr, b, s, HQ, S, D, cos, sin, sgn, BLOCK_D)
        _hf_store(xk, xkp, hk, mk, ko_ptr, b, s, HK, S, D, cos, sin, sgn, BLOCK_D)
    else:
        _hf_part(q_ptr, qo_ptr, b, s, HQ, S, D, HALF, sqb, sqh, sqs, cos, sin, sgn,
                 BLOCK_HQ, BLOCK_D)
        _hf_part(k_ptr, ko_ptr, b, s, HK, S, D, HALF, skb, skh, sks, cos, sin, sgn,
                 BLOCK_HK, BLOCK_D)


def hf_rope(q, k, cos, sin, position_ids, backward: bool):
    """Launch HF-layout RoPE (or its backward on the gradients). ``cos``/``sin`` are
    ``[B or 1, S, D]`` views (batch stride 0 when shared) or ``[max_pos, D]`` tables
    with ``position_ids [B, S]`` contiguous. Outputs are contiguous ``[B, H, S, D]``."""
    B, HQ, S, D = q.shape
    HK = k.shape[1]
    qo = empty(q.shape, dtype=q.dtype, device=q.device)
    ko = empty(k.shape, dtype=k.dtype, device=k.device)
    if B * S == 0 or D == 0:
        return qo, ko
    if position_ids is not None:
        scb, scs = 0, cos.stride(0)
    else:
        scb, scs = cos.stride(0), cos.stride(1)
    BHQ, BHK, BD, nw = head_blocks(HQ, HK, D)
    with device_guard(q):
        launch(_hf_rope_kernel, (B * S,),
            q, k, qo, ko, cos, sin, position_ids if position_ids is not None else cos,
            cos.shape[0], S, HQ, HK, D, D // 2, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
            k.stride(1), k.stride(2), scb, scs, HAS_POS=position_ids is not None, BACKWARD=backward,
            ONE_BLOCK=HQ <= BHQ and HK <= BHK, BLOCK_HQ=BHQ, BLOCK_HK=BHK, BLOCK_D=BD, num_warps=nw)
    return qo, ko
