"""Forward kernels: split + qk-norm + rotate-half RoPE + transpose, and HF-layout RoPE.

The qk_norm_rope helpers (``token_block``, ``rope_cos_sin``, ``head_block``, ``copy_heads``,
``load_pieces``, ``store_pieces``, ``load_weight_pieces``, ``head_sum``, ``rope_config``)
are shared with :mod:`linghe.bwd.rope`.
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


# --------------------------------------------------------------------------------------
# qk_norm_rope: tiles are 3-D [heads, tokens, pieces]. The last axis holds a head's
# elements in chunks of ``R/2`` (padded to ``BLOCK_HALF``): ``x12[h, t, k] = x[j*R/2 + i]``
# with ``j, i = divmod(k, BLOCK_HALF)`` (the rotary part, two chunks: the rotation pairs
# chunk 0 with chunk 1) and ``x3[h, t, k] = x[R + j*R/2 + i]`` (the rest, ``BLOCK_NR``
# chunks), the same shape as ``x12`` when ``D - R == R`` (the standard half RoPE), so
# every tile of a kind shares one register layout (no layout conversions through shared
# memory). Only the last axis is contiguous in memory, so Triton's layouts always give it
# the lanes first (16-byte vectors, then 8 lanes at R = 64): the rotation partner, a
# ``tl.flip`` of the chunk axis of a ``[.., 2, BLOCK_HALF]`` view (:func:`swap_halves`),
# is a lane exchange, and per-head sums stay inside a warp. (A separate chunk axis, as
# before, went to lanes or to warps depending on the Triton version: triton 3.6 orders
# equally contiguous axes first to last, 3.9 last to first; on warps the flip and the
# sums went through shared memory with barriers.)
# --------------------------------------------------------------------------------------


@triton.jit
def token_block(t0, T, S, BLOCK_T: tl.constexpr):
    """Tokens ``t0 .. t0+BLOCK_T`` (int64, output order ``t = b*S + s``): ``(t, live, b,
    s)`` as ``[BLOCK_T]`` vectors."""
    t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
    live = t < T
    b = t // S
    return t, live, b, t - b * S


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
    evaluated per element of the tiles' layouts (8 values per thread at R = 64), where the
    polynomial was a third of the backward's instructions. The interpreter evaluates
    ``APPROX`` with ``tl.cos``/``tl.sin``."""
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
def rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS: tl.constexpr,
                 APPROX: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """``(cos, sin_s)``, fp32 ``[1, BT, 2*BLOCK_HALF]`` in the rotary tiles' piece order,
    of the angles ``freqs[pos]`` of tokens ``t`` (``live`` their mask, ``s`` their
    sequence positions); ``sin_s`` is signed for the chunk (``-sin`` for chunk 0, ``+sin``
    for chunk 1) so that ``y12 = x12*cos + swap_halves(x12)*sin_s``. A position outside
    ``[0, NPOS)`` reads nothing and gets angle 0 (no rotation)."""
    k = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    i = k % BLOCK_HALF
    if HAS_POS:
        p = tl.load(pos_ptr + t, mask=live, other=0).to(tl.int64)
    else:
        p = s
    ok = (live & (p >= 0) & (p < NPOS))[:, None] & (i < HALF)
    cos, sin = cos_sin(tl.load(freqs_ptr + p[:, None] * HALF + i, mask=ok, other=0.0),
                       APPROX)
    return cos[None, :, :], tl.where(k < BLOCK_HALF, -sin, sin)[None, :, :]


@triton.jit
def swap_halves(x, BLOCK_HALF: tl.constexpr):
    """The rotation partner of a rotary tile ``[BH, BT, 2*BLOCK_HALF]``: its two chunks
    swapped (a lane exchange: the chunk bit of the last axis is a lane bit)."""
    BH: tl.constexpr = x.shape[0]
    BT: tl.constexpr = x.shape[1]
    y = tl.flip(tl.reshape(x, [BH, BT, 2, BLOCK_HALF]), 2)
    return tl.reshape(y, [BH, BT, 2 * BLOCK_HALF])


@triton.jit
def head_block(h0, live, NH, H, HKV, G, D, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
               BLOCK_H: tl.constexpr):
    """The set-up of one head block of kind ``KIND`` (0 q, 1 k, 2 v), shared by every
    head-block path of both kernels: ``(h [BH,1,1] head ids h0 .., m [BH,BT,1] mask
    (heads < NH and live tokens), col [BH,1,1] int64: their first element's column in
    the fused projection)``."""
    h = h0 + tl.arange(0, BLOCK_H)
    col = head_columns(h, H, HKV, G, KIND, INTERLEAVED).to(tl.int64) * D
    m = (h < NH)[:, None, None] & live[None, :, None]
    return h[:, None, None], m, col[:, None, None]


@triton.jit
def copy_heads(src, dst, m, D, BLOCK_D: tl.constexpr):
    """Copy whole heads (the v part): ``src``/``dst`` ``[BH,BT,1]`` element pointers of
    their first elements, ``m`` their mask."""
    dd = tl.arange(0, BLOCK_D)[None, None, :]
    md = m & (dd < D)
    tl.store(dst + dd, tl.load(src + dd, mask=md, other=0.0), mask=md)


@triton.jit
def piece_offsets(HALF, NC: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """``(offsets, in_chunk)`` ``[1,1,NC*BLOCK_HALF]`` of ``NC`` chunks of ``HALF``
    elements laid out in ``BLOCK_HALF`` slots (``in_chunk``: the slot holds an element)."""
    k = tl.arange(0, NC * BLOCK_HALF)[None, None, :]
    i = k % BLOCK_HALF
    return (k // BLOCK_HALF) * HALF + i, i < HALF


@triton.jit
def load_pieces(src, m, HALF, R, D, HAS_REST: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_NR: tl.constexpr):
    """``(x12 [BH,BT,2*BLOCK_HALF], x3 [BH,BT,BLOCK_NR*BLOCK_HALF])`` of the heads starting
    at the element pointers ``src [BH,BT,1]`` (``m`` their mask), in the pointer's dtype;
    ``x3`` is ``x12`` when there is no non-rotary part."""
    o12, in12 = piece_offsets(HALF, 2, BLOCK_HALF)
    x12 = tl.load(src + o12, mask=m & in12, other=0.0)
    if HAS_REST:
        o3, in3 = piece_offsets(HALF, BLOCK_NR, BLOCK_HALF)
        x3 = tl.load(src + R + o3, mask=m & in3 & (o3 < D - R), other=0.0)
    else:
        x3 = x12
    return x12, x3


@triton.jit
def store_pieces(dst, m, y12, y3, HALF, R, D, HAS_REST: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_NR: tl.constexpr):
    """Store the pieces of heads starting at ``dst [BH,BT,1]`` (``m`` their mask)."""
    ty = dst.dtype.element_ty
    o12, in12 = piece_offsets(HALF, 2, BLOCK_HALF)
    tl.store(dst + o12, y12.to(ty), mask=m & in12)
    if HAS_REST:
        o3, in3 = piece_offsets(HALF, BLOCK_NR, BLOCK_HALF)
        tl.store(dst + R + o3, y3.to(ty), mask=m & in3 & (o3 < D - R))


@triton.jit
def load_weight_pieces(w_ptr, HALF, R, D, NORM: tl.constexpr, HAS_REST: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, BLOCK_NR: tl.constexpr):
    """The norm weight's pieces ``(w12 [1,1,2*BLOCK_HALF], w3 [1,1,BLOCK_NR*BLOCK_HALF])``
    in fp32 (ones without norm)."""
    if NORM:
        o12, in12 = piece_offsets(HALF, 2, BLOCK_HALF)
        w12 = tl.load(w_ptr + o12, mask=in12, other=0.0).to(tl.float32)
        if HAS_REST:
            o3, in3 = piece_offsets(HALF, BLOCK_NR, BLOCK_HALF)
            w3 = tl.load(w_ptr + R + o3, mask=in3 & (o3 < D - R), other=0.0).to(tl.float32)
        else:
            w3 = w12
    else:
        w12 = tl.full([1, 1, 2 * BLOCK_HALF], 1.0, tl.float32)
        w3 = tl.full([1, 1, BLOCK_NR * BLOCK_HALF], 1.0, tl.float32)
    return w12, w3


@triton.jit
def head_sum(a12, a3, HAS_REST: tl.constexpr, BLOCK_NR: tl.constexpr):
    """Per-head sums ``[BH, BT]`` of the fp32 tiles ``a12`` (+ ``a3``): one reduction when
    both have the same shape."""
    if HAS_REST:
        if BLOCK_NR == 2:
            ss = tl.sum(a12 + a3, axis=2)
        else:
            ss = tl.sum(a12, axis=2) + tl.sum(a3, axis=2)
    else:
        ss = tl.sum(a12, axis=2)
    return ss


@triton.jit
def rope_norm_fwd(x12, x3, w12, w3, cos, sin_s, D, eps, NORM: tl.constexpr,
                  HAS_REST: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_NR: tl.constexpr):
    """(RMSNorm), then rotate-half RoPE: fp32 ``(y12, y3)``."""
    a = x12.to(tl.float32)
    c = x3.to(tl.float32)
    if NORM:
        # (a scalar reciprocal: one division per program instead of one per head)
        ss = head_sum(a * a, c * c, HAS_REST, BLOCK_NR)
        rstd = tl.math.rsqrt(ss * (1.0 / D) + eps)[:, :, None]
        a = a * rstd * w12
        c = c * rstd * w3
    return a * cos + swap_halves(a, BLOCK_HALF) * sin_s, c


@triton.jit
def fwd_heads(row, out_ptr, t3, live, h0, NH, H, HKV, G, D, HALF, R, eps, w12, w3, cos,
              sin_s, KIND: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
              HAS_REST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
              BLOCK_NR: tl.constexpr):
    """One head block of q (``KIND`` 0) or k (1): load from the fused projection rows
    ``row [1,BT,1]``, normalize and rotate, store into ``out [T, NH, D]``."""
    h, m, col = head_block(h0, live, NH, H, HKV, G, D, KIND, INTERLEAVED, BLOCK_H)
    x12, x3 = load_pieces(row + col, m, HALF, R, D, HAS_REST, BLOCK_HALF, BLOCK_NR)
    y12, y3 = rope_norm_fwd(x12, x3, w12, w3, cos, sin_s, D, eps, NORM, HAS_REST,
                            BLOCK_HALF, BLOCK_NR)
    store_pieces(out_ptr + (t3 * NH + h) * D, m, y12, y3, HALF, R, D, HAS_REST, BLOCK_HALF,
                 BLOCK_NR)


@triton.jit
def _qk_norm_rope_fwd_kernel(qkv_ptr, freqs_ptr, pos_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr,
                             v_ptr, T, S, H, HKV, D, HALF, R, NPOS, stride_b, stride_s, eps,
                             INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
                             NORM_Q: tl.constexpr, NORM_K: tl.constexpr,
                             HAS_REST: tl.constexpr, ONE_BLOCK: tl.constexpr,
                             APPROX: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                             BLOCK_HALF: tl.constexpr, BLOCK_NR: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    """``BLOCK_T`` tokens per program, all heads of each kind in one tile (``ONE_BLOCK``:
    every load is issued before any math) or in head blocks."""
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    G = H // HKV
    t, live, b, s = token_block(t0, T, S, BLOCK_T)
    row = qkv_ptr + (b * stride_b + s * stride_s)[None, :, None]
    t3 = t[None, :, None]
    if ONE_BLOCK:
        hq, mq, cq = head_block(0, live, H, H, HKV, G, D, 0, INTERLEAVED, BLOCK_HQ)
        hk, mk, ck = head_block(0, live, HKV, H, HKV, G, D, 1, INTERLEAVED, BLOCK_HK)
        hv, mv, cv = head_block(0, live, HKV, H, HKV, G, D, 2, INTERLEAVED, BLOCK_HK)
        xq12, xq3 = load_pieces(row + cq, mq, HALF, R, D, HAS_REST, BLOCK_HALF, BLOCK_NR)
        xk12, xk3 = load_pieces(row + ck, mk, HALF, R, D, HAS_REST, BLOCK_HALF, BLOCK_NR)
        copy_heads(row + cv, v_ptr + (t3 * HKV + hv) * D, mv, D, BLOCK_D)
        cos, sin_s = rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS,
                                  APPROX, BLOCK_HALF)
        w12, w3 = load_weight_pieces(qw_ptr, HALF, R, D, NORM_Q, HAS_REST, BLOCK_HALF,
                                     BLOCK_NR)
        y12, y3 = rope_norm_fwd(xq12, xq3, w12, w3, cos, sin_s, D, eps, NORM_Q, HAS_REST,
                                BLOCK_HALF, BLOCK_NR)
        store_pieces(q_ptr + (t3 * H + hq) * D, mq, y12, y3, HALF, R, D, HAS_REST,
                     BLOCK_HALF, BLOCK_NR)
        w12, w3 = load_weight_pieces(kw_ptr, HALF, R, D, NORM_K, HAS_REST, BLOCK_HALF,
                                     BLOCK_NR)
        y12, y3 = rope_norm_fwd(xk12, xk3, w12, w3, cos, sin_s, D, eps, NORM_K, HAS_REST,
                                BLOCK_HALF, BLOCK_NR)
        store_pieces(k_ptr + (t3 * HKV + hk) * D, mk, y12, y3, HALF, R, D, HAS_REST,
                     BLOCK_HALF, BLOCK_NR)
    else:
        cos, sin_s = rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS,
                                  APPROX, BLOCK_HALF)
        w12, w3 = load_weight_pieces(qw_ptr, HALF, R, D, NORM_Q, HAS_REST, BLOCK_HALF,
                                     BLOCK_NR)
        for h0 in range(0, H, BLOCK_HQ):
            fwd_heads(row, q_ptr, t3, live, h0, H, H, HKV, G, D, HALF, R, eps, w12, w3, cos,
                      sin_s, 0, INTERLEAVED, NORM_Q, HAS_REST, BLOCK_HQ, BLOCK_HALF,
                      BLOCK_NR)
        w12, w3 = load_weight_pieces(kw_ptr, HALF, R, D, NORM_K, HAS_REST, BLOCK_HALF,
                                     BLOCK_NR)
        for h0 in range(0, HKV, BLOCK_HK):
            fwd_heads(row, k_ptr, t3, live, h0, HKV, H, HKV, G, D, HALF, R, eps, w12, w3,
                      cos, sin_s, 1, INTERLEAVED, NORM_K, HAS_REST, BLOCK_HK, BLOCK_HALF,
                      BLOCK_NR)
            hv, mv, cv = head_block(h0, live, HKV, H, HKV, G, D, 2, INTERLEAVED, BLOCK_HK)
            copy_heads(row + cv, v_ptr + (t3 * HKV + hv) * D, mv, D, BLOCK_D)


#: Tokens per program and warps of the forward (and the backward's tokens per loop step
#: and warps); see :func:`rope_config`. Measured on an H100 at the standard shape (seq 4096
#: x 2, 16q/4kv heads of 128, rotary 64, bf16; ``benchmark/probe_rope.py``, kernel µs),
#: with the chunk-first tiles, the polynomial cos/sin and the unpipelined backward loop of
#: 42e0718: forward t1 w4 38.5, t2 w4 38.9, t2 w8 38.6, t4 w8 39.4, t1 w8 46.6 (the kernel
#: before it 42.6); backward t1 w4 61.4, t2 w4 62.6, t2 w8 74.8, t1 w8 98.3 (before: 113.3).
FWD_TOKENS = 1
FWD_NUM_WARPS = 4
BWD_TOKENS = 1
BWD_NUM_WARPS = 4
#: Software-pipelining stages of the backward's persistent token loop (``tl.range``
#: ``num_stages``; 1: a plain loop). With 2-3 stages Triton prefetches the next token
#: blocks' loads with ``cp.async`` into shared memory while a block is computed, so a
#: program no longer waits for each block's loads in turn (the unpipelined loop was:
#: load, wait, compute, store). Offline sm_90 compile with triton 3.6 at the standard
#: shape (``python -m benchmark.probe_rope --sass``), t1 w4: 1 stage 128 registers, 557
#: SASS instructions per token and warp; 2 stages 128 registers (4 programs per SM),
#: 11.5 KiB shared memory, 625; 3 stages 151 registers (3 per SM), 669. main's kernel:
#: 128 registers, 759. H200 (probe_rope, 2026-11-26; main's kernel 52.8 µs): 1 stage
#: 47.4 µs, 2 stages 50.5, 3 stages 44.2 (77% of copy).
BWD_STAGES = 3
#: cos/sin of the angles: ``True`` the MUFU ``cos.approx``/``sin.approx`` after the angle
#: reduction, ``False`` the polynomial (:func:`cos_sin`).
COS_SIN_APPROX = True
#: Elements of one kind's head tile (all its tokens and heads, full head width) at most.
TILE_CAP = 8192


@functools.cache  # per-shape decision, cached (host time)
def rope_config(H: int, Hkv: int, D: int, R: int, tokens: int, num_warps: int,
                tile_cap: int, approx: bool = True):
    """``dict`` of the qk_norm_rope kernels' block sizes: ``BLOCK_T`` (tokens per program or
    loop step, ``tokens`` or fewer so that a q tile stays within ``tile_cap`` elements),
    ``BLOCK_HQ``/``BLOCK_HK`` (head tiles), ``BLOCK_HALF`` (rotary half), ``BLOCK_NR``
    (chunks of ``R/2`` dims covering the non-rotary part), ``BLOCK_D`` (v copy width),
    ``HAS_REST``, ``ONE_BLOCK`` (all heads of a kind in one tile), ``APPROX`` (cos/sin)
    and ``num_warps``."""
    BLOCK_D = next_power_of_2(max(D, 2))
    BLOCK_HQ = min(next_power_of_2(H), max(1, tile_cap // BLOCK_D))
    BLOCK_HK = min(next_power_of_2(Hkv), max(1, tile_cap // BLOCK_D))
    BLOCK_T = max(1, min(tokens, tile_cap // (BLOCK_HQ * BLOCK_D)))
    BLOCK_T = 1 << (BLOCK_T.bit_length() - 1)  # a power of two
    half = R // 2
    return dict(BLOCK_T=BLOCK_T, BLOCK_HQ=BLOCK_HQ, BLOCK_HK=BLOCK_HK,
                BLOCK_HALF=next_power_of_2(max(half, 1)),
                BLOCK_NR=next_power_of_2(max(-(-(D - R) // half), 1)), BLOCK_D=BLOCK_D,
                HAS_REST=D > R, ONE_BLOCK=H <= BLOCK_HQ and Hkv <= BLOCK_HK,
                APPROX=bool(approx), num_warps=num_warps)


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
    cfg = rope_config(H, Hkv, D, rotary_dim, FWD_TOKENS, FWD_NUM_WARPS, TILE_CAP,
                      COS_SIN_APPROX)
    grid = (-(-T // cfg["BLOCK_T"]),)
    with device_guard(qkv):
        launch(_qk_norm_rope_fwd_kernel, grid,
            qkv, freqs, position_ids if position_ids is not None else freqs,
            q_norm_weight if q_norm_weight is not None else freqs,
            k_norm_weight if k_norm_weight is not None else freqs,
            q, k, v, T, S, H, Hkv, D, rotary_dim // 2, rotary_dim, freqs.shape[0], stride_b,
            stride_s, eps, INTERLEAVED=interleaved, HAS_POS=position_ids is not None,
            NORM_Q=q_norm_weight is not None, NORM_K=k_norm_weight is not None, **cfg)
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
