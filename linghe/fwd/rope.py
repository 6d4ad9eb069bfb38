"""Forward kernels: split + qk-norm + rotate-half RoPE + transpose, and HF-layout RoPE.

The qk_norm_rope helpers (``token_block``, ``rope_cos_sin`` / ``rope_angles`` /
``angles_cos_sin``, ``head_block``, ``copy_heads`` / ``load_heads`` / ``store_heads``,
``load_head``, ``store_head``, ``load_weight``, ``head_sum``, ``head_rstd``,
``launch_config``) are shared with :mod:`linghe.bwd.rope`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..utils import _INTERPRET_C, device_guard, empty, launch, next_power_of_2


@triton.jit
def reduce_angle(a):
    """``a`` reduced to about ``[-pi, pi]`` (fp32 Cody-Waite), so that GPU sin/cos
    approximations, accurate only near zero, stay accurate for large positions. Cody-Waite
    split of 2*pi: 6.28125 has 8 significant bits, so ``k * 6.28125`` is exact."""
    k = tl.floor(a * 0.15915494309189535 + 0.5)
    return (a - k * 6.28125) - k * 1.9353071795864769e-03


@triton.jit
def load_partner(ptr, d, HALF, R, mask):
    """``x[partner(d)]`` in ``ptr``'s dtype for rows at ``ptr`` (``d`` broadcast against
    ``ptr``): ``x[d + HALF]`` for ``d < HALF``, ``x[d - HALF]`` for ``HALF <= d < R``, 0
    beyond. Two loads with affine (vectorizable) offsets instead of a gather; they hit L1.
    Used by the HF-layout kernel (whose rotary part is the whole head)."""
    first = d < HALF
    second = (d >= HALF) & (d < R)
    a = tl.load(ptr + (d + HALF), mask=mask & first, other=0.0)
    b = tl.load(ptr + (d - HALF), mask=mask & second, other=0.0)
    return tl.where(first, a, b)


@triton.jit
def head_columns(h, H, HKV, G: tl.constexpr, KIND: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Column (in head units) of head ``h`` of kind 0=q, 1=k, 2=v in the fused projection
    (``G = H / Hkv`` query heads per kv group: a compile-time constant, so the interleaved
    layout's ``h // G`` is no run-time division)."""
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


# --------------------------------------------------------------------------------------
# qk_norm_rope: a head of D elements is held as four tiles [heads, tokens, pieces]:
# ``x1 = x[:R/2]`` and ``x2 = x[R/2:R]`` (the rotary halves: the rotation pairs ``x1[i]``
# with ``x2[i]``), ``x3 = x[R:R+RH]`` and ``x4 = x[R+RH:D]`` (the rest in two halves,
# ``RH = (D-R)/2``; absent when ``R == D``). The tiles' shapes depend only on the padded
# widths, so at the standard half RoPE (``D - R == R``) all four (and cos/sin) share one
# register layout: an element's rotation partner sits in the same thread at the same
# register position (no shuffles, no shared memory, on any Triton version), cos/sin are
# evaluated once per position for both halves, and a per-head sum is one reduction inside
# a warp. Other shapes are correct and slower (Triton moves the rest's sums between
# layouts). ``EVEN``: every head, piece and token of the tiles is real (no masks).
# --------------------------------------------------------------------------------------


@triton.jit
def token_block(blk, T, S, NBATCH, BLOCK_T: tl.constexpr, ROW_ORDER: tl.constexpr):
    """Token block ``blk``: ``(t, live, b, s)`` as int32 ``[BLOCK_T]`` vectors (token
    counts are below 2^31; addresses are formed in int64 from them), ``t = b*S + s`` the
    output order. ``ROW_ORDER``: the block holds consecutive rows ``s*NBATCH + b`` of an
    ``"sbh"`` projection (memory order), else consecutive output tokens."""
    r = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    live = r < T
    if ROW_ORDER:
        s = r // NBATCH
        b = r - s * NBATCH
        t = b * S + s
    else:
        b = r // S
        s = r - b * S
        t = r
    return t, live, b, s


@triton.jit
def token_offsets(b, s, stride_b, stride_s):
    """int64 ``[1, BT, 1]`` element offsets of the rows of tokens ``(b, s)``."""
    return (b.to(tl.int64) * stride_b + s.to(tl.int64) * stride_s)[None, :, None]


@triton.jit
def load_if(ptr, m, EVEN: tl.constexpr):
    """``tl.load(ptr)`` masked by ``m`` (0 elsewhere) unless ``EVEN`` (every lane real)."""
    if EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=m, other=0.0)
    return x


@triton.jit
def store_if(ptr, x, m, EVEN: tl.constexpr):
    """``tl.store(ptr, x)`` masked by ``m`` unless ``EVEN``."""
    if EVEN:
        tl.store(ptr, x)
    else:
        tl.store(ptr, x, mask=m)


@triton.jit
def cos_sin_poly(h):
    """``(cos(2h), sin(2h))`` for ``|h| <= pi/2``: Taylor polynomials of the half angle
    (truncation under 6e-8) and the double-angle formulas; about 20 FMA-class
    instructions for both, absolute error about 3e-7."""
    x2 = h * h
    s = 1.0 / 39916800.0
    s = s * x2 - 1.0 / 362880.0
    s = s * x2 + 1.0 / 5040.0
    s = s * x2 - 1.0 / 120.0
    s = s * x2 + 1.0 / 6.0
    s = h - h * x2 * s  # sin(h)
    c = 1.0 / 479001600.0
    c = c * x2 - 1.0 / 3628800.0
    c = c * x2 + 1.0 / 40320.0
    c = c * x2 - 1.0 / 720.0
    c = c * x2 + 1.0 / 24.0
    c = c * x2 - 0.5
    c = c * x2 + 1.0  # cos(h)
    return (c - s) * (c + s), 2.0 * s * c


@triton.jit
def cos_sin(a, APPROX: tl.constexpr):
    """``(cos(a), sin(a))`` in fp32 after a Cody-Waite reduction to ``[-pi, pi]`` (exact
    while ``|a| < ~4e5`` rad, i.e. positions below ~4e5 at RoPE's highest frequency 1).

    ``APPROX``: the hardware's ``cos.approx``/``sin.approx`` (one MUFU instruction each,
    absolute error about 5e-7 on ``[-pi, pi]``); else :func:`cos_sin_poly` (about 20
    FMA-class instructions, 3e-7). Both are far below a bf16 ulp of the outputs. They are
    evaluated per element of the tiles' layouts (4 values per thread at R = 64 and 4
    warps). The interpreter evaluates ``APPROX`` with ``tl.cos``/``tl.sin``."""
    r = reduce_angle(a)
    if APPROX:
        if _INTERPRET_C:
            c = tl.cos(r)
            s = tl.sin(r)
        else:
            c = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=f,f", [r],
                                          dtype=tl.float32, is_pure=True, pack=1)
            s = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=f,f", [r],
                                          dtype=tl.float32, is_pure=True, pack=1)
    else:
        c, s = cos_sin_poly(r * 0.5)
    return c, s


@triton.jit
def rope_angles(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS: tl.constexpr,
                EVEN: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The angles ``freqs[pos, i]``, fp32 ``[BT, BLOCK_HALF]``, of tokens ``t`` (``live``
    their mask, ``s`` their sequence positions). A position outside ``[0, NPOS)`` reads
    nothing and gets angle 0 (no rotation)."""
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if HAS_POS:
        p = load_if(pos_ptr + t, live, EVEN).to(tl.int64)
        ok = (live & (p >= 0) & (p < NPOS))[:, None] & (i < HALF)
        a = tl.load(freqs_ptr + p[:, None] * HALF + i, mask=ok, other=0.0)
    else:  # s < S <= NPOS (checked by the caller)
        a = load_if(freqs_ptr + s.to(tl.int64)[:, None] * HALF + i, live[:, None] & (i < HALF),
                    EVEN)
    return a


@triton.jit
def angles_cos_sin(a, APPROX: tl.constexpr):
    """``(cos, sin)``, fp32 ``[1, BT, BLOCK_HALF]``, of :func:`rope_angles`' ``a``."""
    cos, sin = cos_sin(a, APPROX)
    return cos[None, :, :], sin[None, :, :]


@triton.jit
def rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS: tl.constexpr,
                 EVEN: tl.constexpr, APPROX: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """``(cos, sin)``, fp32 ``[1, BT, BLOCK_HALF]``, of the angles of tokens ``t``
    (:func:`rope_angles`)."""
    return angles_cos_sin(rope_angles(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS,
                                      EVEN, BLOCK_HALF), APPROX)


@triton.jit
def head_block(h0, live, NH, H, HKV, D, G: tl.constexpr, KIND: tl.constexpr,
               INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr):
    """The set-up of one head block of kind ``KIND`` (0 q, 1 k, 2 v), shared by every
    head-block path of both kernels: ``(h [BH,1,1] head ids h0 .., m [BH,BT,1] mask
    (heads < NH and live tokens), col [BH,1,1]: their first element's offset in a row of
    the fused projection)`` (int32: offsets inside one row)."""
    h = h0 + tl.arange(0, BLOCK_H)
    col = head_columns(h, H, HKV, G, KIND, INTERLEAVED) * D
    m = (h < NH)[:, None, None] & live[None, :, None]
    return h[:, None, None], m, col[:, None, None]


@triton.jit
def load_heads(src, m, D, EVEN: tl.constexpr, BLOCK_D: tl.constexpr):
    """Whole heads (the v part), ``[BH,BT,BLOCK_D]``: ``src`` ``[BH,BT,1]`` element
    pointers of their first elements, ``m`` their mask."""
    dd = tl.arange(0, BLOCK_D)[None, None, :]
    return load_if(src + dd, m & (dd < D), EVEN)


@triton.jit
def store_heads(dst, x, m, D, EVEN: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store :func:`load_heads`' ``x`` at ``dst`` (``[BH,BT,1]`` pointers, ``m`` mask)."""
    dd = tl.arange(0, BLOCK_D)[None, None, :]
    store_if(dst + dd, x, m & (dd < D), EVEN)


@triton.jit
def copy_heads(src, dst, m, D, EVEN: tl.constexpr, BLOCK_D: tl.constexpr):
    """Copy whole heads (the v part) from ``src`` to ``dst`` (:func:`load_heads`)."""
    store_heads(dst, load_heads(src, m, D, EVEN, BLOCK_D), m, D, EVEN, BLOCK_D)


@triton.jit
def piece_mask(m, i, N, BLOCK: tl.constexpr):
    """``m`` and ``i < N`` (``i`` the piece offsets), or just ``m`` when the piece is
    full (``N == BLOCK``, both compile-time: no per-element compare)."""
    if N == BLOCK:
        mi = m
    else:
        mi = m & (i < N)
    return mi


@triton.jit
def load_head(row, col, m, HALF, R, RH, HAS_REST: tl.constexpr, EVEN: tl.constexpr,
              BLOCK_HALF: tl.constexpr, BLOCK_RH: tl.constexpr):
    """The pieces ``(x1, x2, x3, x4)`` (``[BH,BT,BLOCK_HALF]`` twice, ``[BH,BT,BLOCK_RH]``
    twice) of the heads at offsets ``col [BH,1,1]`` of the rows ``row [1,BT,1]`` (element
    pointers; ``m [BH,BT,1]`` their mask), in the pointer's dtype. Without a rest part
    ``x3, x4`` are ``x1, x2``."""
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    mi = piece_mask(m, i, HALF, BLOCK_HALF)
    x1 = load_if(row + (col + i), mi, EVEN)
    x2 = load_if(row + (col + HALF + i), mi, EVEN)
    if HAS_REST:
        j = tl.arange(0, BLOCK_RH)[None, None, :]
        mj = piece_mask(m, j, RH, BLOCK_RH)
        x3 = load_if(row + (col + R + j), mj, EVEN)
        x4 = load_if(row + (col + R + RH + j), mj, EVEN)
    else:
        x3 = x1
        x4 = x2
    return x1, x2, x3, x4


@triton.jit
def store_head(row, col, m, y1, y2, y3, y4, HALF, R, RH, HAS_REST: tl.constexpr,
               EVEN: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_RH: tl.constexpr):
    """Store the pieces of heads at offsets ``col`` of the rows ``row`` (as
    :func:`load_head`), cast to the pointer's dtype."""
    ty = row.dtype.element_ty
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    mi = piece_mask(m, i, HALF, BLOCK_HALF)
    store_if(row + (col + i), y1.to(ty), mi, EVEN)
    store_if(row + (col + HALF + i), y2.to(ty), mi, EVEN)
    if HAS_REST:
        j = tl.arange(0, BLOCK_RH)[None, None, :]
        mj = piece_mask(m, j, RH, BLOCK_RH)
        store_if(row + (col + R + j), y3.to(ty), mj, EVEN)
        store_if(row + (col + R + RH + j), y4.to(ty), mj, EVEN)


@triton.jit
def load_weight(w_ptr, HALF, R, RH, NORM: tl.constexpr, HAS_REST: tl.constexpr,
                BLOCK_HALF: tl.constexpr, BLOCK_RH: tl.constexpr):
    """The norm weight's pieces ``(w1, w2, w3, w4)`` ``[1,1,*]`` in fp32 (ones without
    norm)."""
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    j = tl.arange(0, BLOCK_RH)[None, None, :]
    if NORM:
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        if HAS_REST:
            w3 = tl.load(w_ptr + R + j, mask=j < RH, other=0.0).to(tl.float32)
            w4 = tl.load(w_ptr + R + RH + j, mask=j < RH, other=0.0).to(tl.float32)
        else:
            w3 = w1
            w4 = w2
    else:
        w1 = tl.full([1, 1, BLOCK_HALF], 1.0, tl.float32)
        w2 = w1
        w3 = tl.full([1, 1, BLOCK_RH], 1.0, tl.float32)
        w4 = w3
    return w1, w2, w3, w4


@triton.jit
def head_sum(a12, a34, HAS_REST: tl.constexpr, SAME: tl.constexpr):
    """Per-head sums ``[BH, BT]`` of the fp32 rotary tile ``a12`` plus the rest tile
    ``a34``: one reduction when both have the same shape (``SAME``)."""
    if HAS_REST:
        if SAME:
            ss = tl.sum(a12 + a34, axis=2)
        else:
            ss = tl.sum(a12, axis=2) + tl.sum(a34, axis=2)
    else:
        ss = tl.sum(a12, axis=2)
    return ss


@triton.jit
def head_rstd(a1, a2, a3, a4, D, eps, HAS_REST: tl.constexpr, SAME: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` per head, ``[BH, BT, 1]``, of fp32 pieces (a scalar
    reciprocal of ``D``: no division per head)."""
    ss = head_sum(a1 * a1 + a2 * a2, a3 * a3 + a4 * a4, HAS_REST, SAME)
    return tl.math.rsqrt(ss * (1.0 / D) + eps)[:, :, None]


@triton.jit
def norm_rope_fwd(x1, x2, x3, x4, w1, w2, w3, w4, cos, sin, D, eps, NORM: tl.constexpr,
                  HAS_REST: tl.constexpr, SAME: tl.constexpr):
    """(RMSNorm), then rotate-half RoPE ``(x1*cos - x2*sin, x2*cos + x1*sin)``: fp32
    ``(y1, y2, y3, y4)``."""
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    a3 = x3.to(tl.float32)
    a4 = x4.to(tl.float32)
    if NORM:
        rstd = head_rstd(a1, a2, a3, a4, D, eps, HAS_REST, SAME)
        a1 = a1 * rstd * w1
        a2 = a2 * rstd * w2
        if HAS_REST:
            a3 = a3 * rstd * w3
            a4 = a4 * rstd * w4
    return a1 * cos - a2 * sin, a2 * cos + a1 * sin, a3, a4


@triton.jit
def fwd_heads(row, out_row, live, h0, NH, H, HKV, D, HALF, R, RH, eps, w1, w2, w3, w4,
              cos, sin, G: tl.constexpr, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
              NORM: tl.constexpr, HAS_REST: tl.constexpr, SAME: tl.constexpr,
              EVEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
              BLOCK_RH: tl.constexpr):
    """One head block of q (``KIND`` 0) or k (1): load from the fused projection rows
    ``row [1,BT,1]``, normalize and rotate, store into the output rows ``out_row``
    (``[T, NH, D]``)."""
    h, m, col = head_block(h0, live, NH, H, HKV, D, G, KIND, INTERLEAVED, BLOCK_H)
    x1, x2, x3, x4 = load_head(row, col, m, HALF, R, RH, HAS_REST, EVEN, BLOCK_HALF,
                               BLOCK_RH)
    y1, y2, y3, y4 = norm_rope_fwd(x1, x2, x3, x4, w1, w2, w3, w4, cos, sin, D, eps, NORM,
                                   HAS_REST, SAME)
    store_head(out_row, h * D, m, y1, y2, y3, y4, HALF, R, RH, HAS_REST, EVEN, BLOCK_HALF,
               BLOCK_RH)


@triton.jit
def fwd_block(blk, qkv_ptr, freqs_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, T, S, NBATCH, H, HKV,
              D, HALF, R, RH, NPOS, stride_b, stride_s, eps, wq1, wq2, wq3, wq4, wk1, wk2,
              wk3, wk4, G: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
              NORM_Q: tl.constexpr, NORM_K: tl.constexpr, HAS_REST: tl.constexpr,
              SAME: tl.constexpr, ONE_BLOCK: tl.constexpr, EVEN: tl.constexpr,
              APPROX: tl.constexpr, ROW_ORDER: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
              BLOCK_RH: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token block ``blk`` of the forward: all heads of each kind in one tile
    (``ONE_BLOCK``: every load is issued before any math) or in head blocks."""
    t, live, b, s = token_block(blk, T, S, NBATCH, BLOCK_T, ROW_ORDER)
    row = qkv_ptr + token_offsets(b, s, stride_b, stride_s)
    t3 = t.to(tl.int64)[None, :, None]
    q_row = q_ptr + t3 * (H * D)
    k_row = k_ptr + t3 * (HKV * D)
    v_row = v_ptr + t3 * (HKV * D)
    if ONE_BLOCK:
        hq, mq, cq = head_block(0, live, H, H, HKV, D, G, 0, INTERLEAVED, BLOCK_HQ)
        hk, mk, ck = head_block(0, live, HKV, H, HKV, D, G, 1, INTERLEAVED, BLOCK_HK)
        hv, mv, cv = head_block(0, live, HKV, H, HKV, D, G, 2, INTERLEAVED, BLOCK_HK)
        xq1, xq2, xq3, xq4 = load_head(row, cq, mq, HALF, R, RH, HAS_REST, EVEN,
                                       BLOCK_HALF, BLOCK_RH)
        xk1, xk2, xk3, xk4 = load_head(row, ck, mk, HALF, R, RH, HAS_REST, EVEN,
                                       BLOCK_HALF, BLOCK_RH)
        copy_heads(row + cv, v_row + hv * D, mv, D, EVEN, BLOCK_D)
        cos, sin = rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS,
                                EVEN, APPROX, BLOCK_HALF)
        y1, y2, y3, y4 = norm_rope_fwd(xq1, xq2, xq3, xq4, wq1, wq2, wq3, wq4, cos, sin,
                                       D, eps, NORM_Q, HAS_REST, SAME)
        store_head(q_row, hq * D, mq, y1, y2, y3, y4, HALF, R, RH, HAS_REST, EVEN,
                   BLOCK_HALF, BLOCK_RH)
        y1, y2, y3, y4 = norm_rope_fwd(xk1, xk2, xk3, xk4, wk1, wk2, wk3, wk4, cos, sin,
                                       D, eps, NORM_K, HAS_REST, SAME)
        store_head(k_row, hk * D, mk, y1, y2, y3, y4, HALF, R, RH, HAS_REST, EVEN,
                   BLOCK_HALF, BLOCK_RH)
    else:
        cos, sin = rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS,
                                EVEN, APPROX, BLOCK_HALF)
        for h0 in range(0, H, BLOCK_HQ):
            fwd_heads(row, q_row, live, h0, H, H, HKV, D, HALF, R, RH, eps, wq1, wq2,
                      wq3, wq4, cos, sin, G, 0, INTERLEAVED, NORM_Q, HAS_REST, SAME,
                      EVEN, BLOCK_HQ, BLOCK_HALF, BLOCK_RH)
        for h0 in range(0, HKV, BLOCK_HK):
            fwd_heads(row, k_row, live, h0, HKV, H, HKV, D, HALF, R, RH, eps, wk1, wk2,
                      wk3, wk4, cos, sin, G, 1, INTERLEAVED, NORM_K, HAS_REST, SAME,
                      EVEN, BLOCK_HK, BLOCK_HALF, BLOCK_RH)
            hv, mv, cv = head_block(h0, live, HKV, H, HKV, D, G, 2, INTERLEAVED,
                                    BLOCK_HK)
            copy_heads(row + cv, v_row + hv * D, mv, D, EVEN, BLOCK_D)


@triton.jit
def _qk_norm_rope_fwd_kernel(qkv_ptr, freqs_ptr, pos_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr,
                             v_ptr, T, S, NBATCH, NPOS, stride_b, stride_s, eps,
                             H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                             HALF: tl.constexpr, R: tl.constexpr, RH: tl.constexpr,
                             G: tl.constexpr, INTERLEAVED: tl.constexpr,
                             HAS_POS: tl.constexpr, NORM_Q: tl.constexpr,
                             NORM_K: tl.constexpr, HAS_REST: tl.constexpr,
                             SAME: tl.constexpr, ONE_BLOCK: tl.constexpr,
                             EVEN: tl.constexpr, APPROX: tl.constexpr,
                             ROW_ORDER: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                             BLOCK_HALF: tl.constexpr, BLOCK_RH: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    """One token block of ``BLOCK_T`` tokens per program (:func:`fwd_block`)."""
    pid = tl.program_id(0)
    wq1, wq2, wq3, wq4 = load_weight(qw_ptr, HALF, R, RH, NORM_Q, HAS_REST, BLOCK_HALF,
                                     BLOCK_RH)
    wk1, wk2, wk3, wk4 = load_weight(kw_ptr, HALF, R, RH, NORM_K, HAS_REST, BLOCK_HALF,
                                     BLOCK_RH)
    fwd_block(pid, qkv_ptr, freqs_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, T, S, NBATCH, H, HKV,
              D, HALF, R, RH, NPOS, stride_b, stride_s, eps, wq1, wq2, wq3, wq4, wk1, wk2,
              wk3, wk4, G, INTERLEAVED, HAS_POS, NORM_Q, NORM_K, HAS_REST, SAME, ONE_BLOCK,
              EVEN, APPROX, ROW_ORDER, BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_RH,
              BLOCK_D)


#: Tokens per program and warps of the forward, and the backward's tokens per loop step
#: and warps; see :func:`rope_config`. H100 (probe_rope, 2026-11-26, standard shape):
#: this forward 36.8 µs; a whole-row tile (q, k and v heads in one tile, 38.5-41.7) and a
#: persistent software-pipelined forward (38.3-40.4) lost and were removed.
FWD_TOKENS = 1
FWD_NUM_WARPS = 4
BWD_TOKENS = 1
BWD_NUM_WARPS = 4
#: Software-pipelining stages of the backward's persistent token loop (``tl.range``
#: ``num_stages``; 1: a plain loop). With 2-3 stages Triton prefetches the next token
#: blocks' loads with ``cp.async`` into shared memory while a block is computed; most of
#: the k head's loads are 2-byte and stay synchronous anyway, so the plain loop, whose
#: loads four resident programs per SM keep in flight, is the fastest. H200, the current
#: tiles, six alternating rounds in one process (``h200_rope_bwd_stages_ab_*``): 1
#: stage 43.8 µs, 2 stages 52.8, 3 stages 45.3, the same bits (the previous tile layout,
#: 2026-11-26: 47.4 / 50.5 / 44.2).
BWD_STAGES = 1
#: The backward's plain loop (``BWD_STAGES`` 1, one head block a kind) with the next token
#: block's loads issued before this block's stores, into registers (``PREFETCH``; ~20
#: registers of raw 16-bit data a thread at the standard shape): ncu found the loop
#: waiting on each token's loads (long-scoreboard stalls, 44% of the samples). H200,
#: standard shape, in one process against the previous loop (``probe_rope --old``,
#: ``h200_probe_rope_prefetch_*``): kernel 42.1-42.2 -> 41.0-41.2 µs, the same bits.
BWD_PREFETCH = True
#: Register cap of the backward kernel (``maxnreg``; None: ptxas chooses): 128 lets four
#: programs of 4 warps share an SM (with the prefetch 43.3 against 43.7-43.9 µs
#: uncapped, both kernels; without it the cap made no difference).
BWD_MAXNREG = 128
#: cos/sin of the angles: ``True`` the MUFU ``cos.approx``/``sin.approx`` after the angle
#: reduction, ``False`` the polynomial (:func:`cos_sin`).
COS_SIN_APPROX = True
#: ``"sbh"`` projections with several sequences: token blocks in the projection's row
#: order (``s*B + b``: both kernels read/write it sequentially, the ``[B, S, ...]``
#: tensors at B places) instead of the output order (``b*S + s``). H100 (probe_rope,
#: standard shape, B = 2): backward 59.0 -> 57.4 µs, forward 36.8 either way.
ROW_ORDER = True
#: Elements of one kind's head tile (all its tokens and heads, full head width) at most.
TILE_CAP = 8192


@functools.cache  # per-shape decision, cached (host time)
def rope_config(H: int, Hkv: int, D: int, R: int, tokens: int, num_warps: int,
                tile_cap: int, approx: bool = True):
    """``dict`` of the qk_norm_rope kernels' compile-time parameters: the head shape (``H``,
    ``HKV``, ``D``, ``R``, ``HALF = R/2``, ``RH = (D-R)/2``: model constants, so that
    every offset inside a head is an immediate), ``BLOCK_T`` (tokens
    per program or loop step, ``tokens`` or fewer so that a q tile stays within
    ``tile_cap`` elements), ``BLOCK_HQ``/``BLOCK_HK`` (head tiles), ``BLOCK_HALF`` (rotary
    half), ``BLOCK_RH`` (half of the rest ``D - R``), ``BLOCK_D`` (v copy width), ``G``
    (query heads per kv head), ``HAS_REST``, ``SAME`` (the rest's halves are as wide as
    the rotary ones), ``ONE_BLOCK`` (all heads of a kind in one tile), ``EVEN`` (no
    padded head, piece or v lane; the launcher adds the token condition), ``APPROX``
    (cos/sin) and ``num_warps``."""
    BLOCK_D = next_power_of_2(max(D, 2))
    BLOCK_HQ = min(next_power_of_2(H), max(1, tile_cap // BLOCK_D))
    BLOCK_HK = min(next_power_of_2(Hkv), max(1, tile_cap // BLOCK_D))
    BLOCK_T = max(1, min(tokens, tile_cap // (BLOCK_HQ * BLOCK_D)))
    BLOCK_T = 1 << (BLOCK_T.bit_length() - 1)  # a power of two
    half, rh = R // 2, (D - R) // 2
    BLOCK_HALF = next_power_of_2(max(half, 1))
    BLOCK_RH = next_power_of_2(max(rh, 1))
    even = (H % BLOCK_HQ == 0 and Hkv % BLOCK_HK == 0 and half == BLOCK_HALF
            and rh in (0, BLOCK_RH) and D == BLOCK_D)
    return dict(H=H, HKV=Hkv, D=D, HALF=half, R=R, RH=rh, G=H // Hkv, BLOCK_T=BLOCK_T,
                BLOCK_HQ=BLOCK_HQ, BLOCK_HK=BLOCK_HK, BLOCK_HALF=BLOCK_HALF,
                BLOCK_RH=BLOCK_RH, BLOCK_D=BLOCK_D, HAS_REST=D > R,
                SAME=BLOCK_RH == BLOCK_HALF, ONE_BLOCK=H <= BLOCK_HQ and Hkv <= BLOCK_HK,
                EVEN=even, APPROX=bool(approx), num_warps=num_warps)


def check_tokens(T: int) -> None:
    """The kernels index tokens in int32 (addresses in int64)."""
    if T >= 2**31:
        raise ValueError(f"qk_norm_rope supports fewer than 2^31 tokens, got {T}")


def launch_config(H: int, Hkv: int, D: int, R: int, T: int, tokens: int, num_warps: int,
                  approx: bool, layout: str, B: int) -> dict:
    """:func:`rope_config` for ``T`` tokens of a ``layout`` projection with ``B``
    sequences: ``EVEN`` only when the token blocks divide ``T``, and ``ROW_ORDER``."""
    cfg = dict(rope_config(H, Hkv, D, R, tokens, num_warps, TILE_CAP, approx))
    cfg["EVEN"] = cfg["EVEN"] and T % cfg["BLOCK_T"] == 0
    cfg["ROW_ORDER"] = bool(ROW_ORDER) and layout == "sbh" and B > 1
    return cfg


@functools.cache  # per-shape decision, cached (host time)
def head_blocks(H: int, Hkv: int, D: int):
    """(BLOCK_HQ, BLOCK_HK, BLOCK_D, num_warps) of the HF-layout kernel: head tiles of at
    most 4096 elements."""
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
    check_tokens(T)
    cfg = launch_config(H, Hkv, D, rotary_dim, T, FWD_TOKENS, FWD_NUM_WARPS, COS_SIN_APPROX,
                        layout, B)
    with device_guard(qkv):
        launch(_qk_norm_rope_fwd_kernel, (-(-T // cfg["BLOCK_T"]),),
            qkv, freqs, position_ids if position_ids is not None else freqs,
            q_norm_weight if q_norm_weight is not None else freqs,
            k_norm_weight if k_norm_weight is not None else freqs,
            q, k, v, T, S, B, freqs.shape[0], stride_b, stride_s, eps, INTERLEAVED=interleaved,
            HAS_POS=position_ids is not None, NORM_Q=q_norm_weight is not None,
            NORM_K=k_norm_weight is not None, **cfg)
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
