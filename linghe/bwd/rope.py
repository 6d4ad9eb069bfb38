"""Backward kernels of split + qk-norm + RoPE + transpose (HF-layout RoPE's backward is the
same kernel as its forward, see :func:`linghe.fwd.rope.hf_rope`).

Nothing but the inputs is saved: the per-head rstd is recomputed from ``qkv``, which the
backward reads anyway for the norm gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fwd.rope import (
    angles_cos_sin,
    copy_heads,
    head_block,
    head_rstd,
    head_sum,
    launch_config,
    load_head,
    load_heads,
    load_weight,
    rope_angles,
    rope_cos_sin,
    store_head,
    store_heads,
    token_block,
    token_offsets,
    token_strides,
)
from ..utils import (
    device_guard,
    empty,
    launch,
    next_power_of_2,
    num_sms,
    sum_partials,
)
from .resident import learn_resident, resident_programs


@triton.jit
def norm_rope_bwd(g1, g2, g3, g4, x1, x2, x3, x4, w1, w2, w3, w4, a1, a2, a3, a4, cos, sin,
                  D, eps, NORM: tl.constexpr, HAS_REST: tl.constexpr, SAME: tl.constexpr):
    """RoPE backward ``dn = (g1*cos + g2*sin, g2*cos - g1*sin)`` (the rest passes), then
    the RMSNorm backward ``dx = rstd * (dn*w - xhat * mean(dn*w*xhat))`` with ``dw +=
    dn * xhat`` accumulated elementwise in the fp32 tiles ``a1..a4`` (reduced once, after
    the token loop). Returns ``(dx1, dx2, dx3, dx4, a1, a2, a3, a4)`` (fp32)."""
    u1 = g1.to(tl.float32)
    u2 = g2.to(tl.float32)
    d1 = u1 * cos + u2 * sin
    d2 = u2 * cos - u1 * sin
    d3 = g3.to(tl.float32)
    d4 = g4.to(tl.float32)
    if NORM:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        x3 = x3.to(tl.float32)
        x4 = x4.to(tl.float32)
        rstd = head_rstd(x1, x2, x3, x4, D, eps, HAS_REST, SAME)
        # xhat = 0 where x = 0: a padded head (x loaded as 0) has rstd = inf when eps = 0,
        # and 0 * inf would put NaN into the weight-gradient sums
        x1 = tl.where(x1 == 0, 0.0, x1 * rstd)
        x2 = tl.where(x2 == 0, 0.0, x2 * rstd)
        a1 += d1 * x1
        a2 += d2 * x2
        d1 = d1 * w1
        d2 = d2 * w2
        if HAS_REST:
            x3 = tl.where(x3 == 0, 0.0, x3 * rstd)
            x4 = tl.where(x4 == 0, 0.0, x4 * rstd)
            a3 += d3 * x3
            a4 += d4 * x4
            d3 = d3 * w3
            d4 = d4 * w4
        c = (head_sum(d1 * x1 + d2 * x2, d3 * x3 + d4 * x4, HAS_REST, SAME)
             * (1.0 / D))[:, :, None]
        d1 = (d1 - x1 * c) * rstd
        d2 = (d2 - x2 * c) * rstd
        if HAS_REST:
            d3 = (d3 - x3 * c) * rstd
            d4 = (d4 - x4 * c) * rstd
    return d1, d2, d3, d4, a1, a2, a3, a4


@triton.jit
def store_dw(dw_row, a1, a2, a3, a4, HALF, R, RH, HAS_REST: tl.constexpr,
             BLOCK_HALF: tl.constexpr, BLOCK_RH: tl.constexpr):
    """Reduce the fp32 accumulator tiles over heads and tokens; store the ``[D]`` row."""
    i = tl.arange(0, BLOCK_HALF)
    tl.store(dw_row + i, tl.sum(tl.sum(a1, axis=1), axis=0), mask=i < HALF)
    tl.store(dw_row + HALF + i, tl.sum(tl.sum(a2, axis=1), axis=0), mask=i < HALF)
    if HAS_REST:
        j = tl.arange(0, BLOCK_RH)
        tl.store(dw_row + R + j, tl.sum(tl.sum(a3, axis=1), axis=0), mask=j < RH)
        tl.store(dw_row + R + RH + j, tl.sum(tl.sum(a4, axis=1), axis=0), mask=j < RH)


@triton.jit
def bwd_heads(dy_row, x_row, dx_row, live, h0, NH, H, HKV, D, HALF, R, RH, eps, cos, sin,
              w1, w2, w3, w4, a1, a2, a3, a4, G: tl.constexpr, KIND: tl.constexpr,
              INTERLEAVED: tl.constexpr, NORM: tl.constexpr, HAS_REST: tl.constexpr,
              SAME: tl.constexpr, EVEN: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_HALF: tl.constexpr, BLOCK_RH: tl.constexpr):
    """One head block of q (``KIND`` 0) or k (1) of a token block: load the gradient (the
    ``[T, NH, D]`` rows ``dy_row``) and the input, store dx into dqkv, return the updated
    accumulators."""
    h, m, col = head_block(h0, live, NH, H, HKV, D, G, KIND, INTERLEAVED, BLOCK_H)
    g1, g2, g3, g4 = load_head(dy_row, h * D, m, HALF, R, RH, HAS_REST, EVEN, BLOCK_HALF,
                               BLOCK_RH)
    if NORM:
        x1, x2, x3, x4 = load_head(x_row, col, m, HALF, R, RH, HAS_REST, EVEN, BLOCK_HALF,
                                   BLOCK_RH)
    else:
        x1, x2, x3, x4 = g1, g2, g3, g4
    y1, y2, y3, y4, a1, a2, a3, a4 = norm_rope_bwd(g1, g2, g3, g4, x1, x2, x3, x4, w1, w2,
                                                   w3, w4, a1, a2, a3, a4, cos, sin, D, eps,
                                                   NORM, HAS_REST, SAME)
    store_head(dx_row, col, m, y1, y2, y3, y4, HALF, R, RH, HAS_REST, EVEN, BLOCK_HALF,
               BLOCK_RH)
    return a1, a2, a3, a4


@triton.jit
def one_block_loads(blk, qkv_ptr, dq_ptr, dk_ptr, dv_ptr, freqs_ptr, pos_ptr, T, S, NBATCH,
                    NPOS, stride_b, stride_s, H: tl.constexpr, HKV: tl.constexpr,
                    D: tl.constexpr, HALF: tl.constexpr, R: tl.constexpr, RH: tl.constexpr,
                    G: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
                    NORM_Q: tl.constexpr, NORM_K: tl.constexpr, HAS_REST: tl.constexpr,
                    EVEN: tl.constexpr, ROW_ORDER: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, BLOCK_RH: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Every load of token block ``blk`` when all heads are one block (``ONE_BLOCK``): the
    q and k gradients' and inputs' pieces, v's gradient heads and the RoPE angles, as
    loaded (``(gq1..4, xq1..4, gk1..4, xk1..4, v, angles)``; without a norm the inputs
    are the gradients again)."""
    t, live, b, s = token_block(blk, T, S, NBATCH, BLOCK_T, ROW_ORDER)
    t3 = t.to(tl.int64)[None, :, None]
    x_row = qkv_ptr + token_offsets(b, s, stride_b, stride_s)
    hq, mq, cq = head_block(0, live, H, H, HKV, D, G, 0, INTERLEAVED, BLOCK_HQ)
    hk, mk, ck = head_block(0, live, HKV, H, HKV, D, G, 1, INTERLEAVED, BLOCK_HK)
    hv, mv, cv = head_block(0, live, HKV, H, HKV, D, G, 2, INTERLEAVED, BLOCK_HK)
    gq1, gq2, gq3, gq4 = load_head(dq_ptr + t3 * (H * D), hq * D, mq, HALF, R, RH, HAS_REST,
                                   EVEN, BLOCK_HALF, BLOCK_RH)
    if NORM_Q:
        xq1, xq2, xq3, xq4 = load_head(x_row, cq, mq, HALF, R, RH, HAS_REST, EVEN,
                                       BLOCK_HALF, BLOCK_RH)
    else:
        xq1, xq2, xq3, xq4 = gq1, gq2, gq3, gq4
    gk1, gk2, gk3, gk4 = load_head(dk_ptr + t3 * (HKV * D), hk * D, mk, HALF, R, RH,
                                   HAS_REST, EVEN, BLOCK_HALF, BLOCK_RH)
    if NORM_K:
        xk1, xk2, xk3, xk4 = load_head(x_row, ck, mk, HALF, R, RH, HAS_REST, EVEN,
                                       BLOCK_HALF, BLOCK_RH)
    else:
        xk1, xk2, xk3, xk4 = gk1, gk2, gk3, gk4
    v = load_heads(dv_ptr + t3 * (HKV * D) + hv * D, mv, D, EVEN, BLOCK_D)
    a = rope_angles(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS, EVEN, BLOCK_HALF)
    return (gq1, gq2, gq3, gq4, xq1, xq2, xq3, xq4, gk1, gk2, gk3, gk4, xk1, xk2, xk3, xk4,
            v, a)


@triton.jit
def one_block_bwd(blk, gq1, gq2, gq3, gq4, xq1, xq2, xq3, xq4, gk1, gk2, gk3, gk4, xk1, xk2,
                  xk3, xk4, v, a, wq1, wq2, wq3, wq4, wk1, wk2, wk3, wk4, aq1, aq2, aq3, aq4,
                  ak1, ak2, ak3, ak4, dqkv_ptr, T, S, NBATCH, dstride_b, dstride_s, eps,
                  H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                  R: tl.constexpr, RH: tl.constexpr, G: tl.constexpr,
                  INTERLEAVED: tl.constexpr, NORM_Q: tl.constexpr, NORM_K: tl.constexpr,
                  HAS_REST: tl.constexpr, SAME: tl.constexpr, EVEN: tl.constexpr,
                  APPROX: tl.constexpr, ROW_ORDER: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_RH: tl.constexpr, BLOCK_D: tl.constexpr):
    """The math and stores of token block ``blk`` from :func:`one_block_loads`' values:
    dqkv's q, k and v parts written; returns the updated weight-gradient accumulators
    ``(aq1..4, ak1..4)``."""
    t, live, b, s = token_block(blk, T, S, NBATCH, BLOCK_T, ROW_ORDER)
    dx_row = dqkv_ptr + token_offsets(b, s, dstride_b, dstride_s)
    hq, mq, cq = head_block(0, live, H, H, HKV, D, G, 0, INTERLEAVED, BLOCK_HQ)
    hk, mk, ck = head_block(0, live, HKV, H, HKV, D, G, 1, INTERLEAVED, BLOCK_HK)
    hv, mv, cv = head_block(0, live, HKV, H, HKV, D, G, 2, INTERLEAVED, BLOCK_HK)
    store_heads(dx_row + cv, v, mv, D, EVEN, BLOCK_D)
    cos, sin = angles_cos_sin(a, APPROX)
    y1, y2, y3, y4, aq1, aq2, aq3, aq4 = norm_rope_bwd(
        gq1, gq2, gq3, gq4, xq1, xq2, xq3, xq4, wq1, wq2, wq3, wq4, aq1, aq2, aq3, aq4, cos,
        sin, D, eps, NORM_Q, HAS_REST, SAME)
    store_head(dx_row, cq, mq, y1, y2, y3, y4, HALF, R, RH, HAS_REST, EVEN, BLOCK_HALF,
               BLOCK_RH)
    y1, y2, y3, y4, ak1, ak2, ak3, ak4 = norm_rope_bwd(
        gk1, gk2, gk3, gk4, xk1, xk2, xk3, xk4, wk1, wk2, wk3, wk4, ak1, ak2, ak3, ak4, cos,
        sin, D, eps, NORM_K, HAS_REST, SAME)
    store_head(dx_row, ck, mk, y1, y2, y3, y4, HALF, R, RH, HAS_REST, EVEN, BLOCK_HALF,
               BLOCK_RH)
    return aq1, aq2, aq3, aq4, ak1, ak2, ak3, ak4


@triton.jit
def _qk_norm_rope_bwd_kernel(qkv_ptr, dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, freqs_ptr, pos_ptr,
                             qw_ptr, kw_ptr, dw_ptr, T, S, NBATCH, NPOS, stride_b, stride_s,
                             dstride_b, dstride_s, eps, H: tl.constexpr, HKV: tl.constexpr,
                             D: tl.constexpr, HALF: tl.constexpr, R: tl.constexpr,
                             RH: tl.constexpr, G: tl.constexpr, INTERLEAVED: tl.constexpr,
                             HAS_POS: tl.constexpr, NORM_Q: tl.constexpr,
                             NORM_K: tl.constexpr, HAS_REST: tl.constexpr,
                             SAME: tl.constexpr, ONE_BLOCK: tl.constexpr,
                             EVEN: tl.constexpr, APPROX: tl.constexpr,
                             ROW_ORDER: tl.constexpr, STAGES: tl.constexpr,
                             PREFETCH: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_HQ: tl.constexpr,
                             BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             BLOCK_RH: tl.constexpr, BLOCK_D: tl.constexpr):
    """Persistent: program ``pid`` handles token blocks ``pid, pid + P, ...`` of
    ``BLOCK_T`` tokens (a loop software-pipelined over ``STAGES`` stages) and writes one
    float32 partial row ``[dq_norm_weight | dk_norm_weight]`` (``2*D``) at ``dw_ptr``.
    The weight-gradient terms stay elementwise in registers until the end (no cross-warp
    reduction per token). ``PREFETCH`` (``ONE_BLOCK``, ``STAGES`` 1): the next token
    block's loads (:func:`one_block_loads`) are issued before this block's math and
    stores (:func:`one_block_bwd`), into registers. (Loading only the k pieces a step
    ahead beside the pipeliner, earlier: H100 59.0 µs vs 58.7 without, removed.)"""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    NB = tl.cdiv(T, BLOCK_T)
    wq1, wq2, wq3, wq4 = load_weight(qw_ptr, HALF, R, RH, NORM_Q, HAS_REST, BLOCK_HALF,
                                     BLOCK_RH)
    wk1, wk2, wk3, wk4 = load_weight(kw_ptr, HALF, R, RH, NORM_K, HAS_REST, BLOCK_HALF,
                                     BLOCK_RH)
    aq1 = tl.zeros([BLOCK_HQ, BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    aq2 = tl.zeros([BLOCK_HQ, BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    aq3 = tl.zeros([BLOCK_HQ, BLOCK_T, BLOCK_RH], dtype=tl.float32)
    aq4 = tl.zeros([BLOCK_HQ, BLOCK_T, BLOCK_RH], dtype=tl.float32)
    ak1 = tl.zeros([BLOCK_HK, BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    ak2 = tl.zeros([BLOCK_HK, BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    ak3 = tl.zeros([BLOCK_HK, BLOCK_T, BLOCK_RH], dtype=tl.float32)
    ak4 = tl.zeros([BLOCK_HK, BLOCK_T, BLOCK_RH], dtype=tl.float32)
    if ONE_BLOCK:
        if PREFETCH:  # the program's first block (pid < NB)
            (gq1, gq2, gq3, gq4, xq1, xq2, xq3, xq4, gk1, gk2, gk3, gk4, xk1, xk2, xk3, xk4,
             v, a) = one_block_loads(
                pid, qkv_ptr, dq_ptr, dk_ptr, dv_ptr, freqs_ptr, pos_ptr, T, S, NBATCH, NPOS,
                stride_b, stride_s, H, HKV, D, HALF, R, RH, G, INTERLEAVED, HAS_POS, NORM_Q,
                NORM_K, HAS_REST, EVEN, ROW_ORDER, BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF,
                BLOCK_RH, BLOCK_D)
        for blk in tl.range(pid, NB, P, num_stages=STAGES):
            # every load of a token block is issued before its math; with PREFETCH those
            # of the next block (past the last block they repeat it) before this one's
            nxt = tl.minimum(blk + P, NB - 1) if PREFETCH else blk
            (ngq1, ngq2, ngq3, ngq4, nxq1, nxq2, nxq3, nxq4, ngk1, ngk2, ngk3, ngk4, nxk1,
             nxk2, nxk3, nxk4, nv, na) = one_block_loads(
                nxt, qkv_ptr, dq_ptr, dk_ptr, dv_ptr, freqs_ptr, pos_ptr, T, S, NBATCH, NPOS,
                stride_b, stride_s, H, HKV, D, HALF, R, RH, G, INTERLEAVED, HAS_POS, NORM_Q,
                NORM_K, HAS_REST, EVEN, ROW_ORDER, BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF,
                BLOCK_RH, BLOCK_D)
            if not PREFETCH:
                (gq1, gq2, gq3, gq4, xq1, xq2, xq3, xq4, gk1, gk2, gk3, gk4, xk1, xk2, xk3,
                 xk4, v, a) = (ngq1, ngq2, ngq3, ngq4, nxq1, nxq2, nxq3, nxq4, ngk1, ngk2,
                               ngk3, ngk4, nxk1, nxk2, nxk3, nxk4, nv, na)
            aq1, aq2, aq3, aq4, ak1, ak2, ak3, ak4 = one_block_bwd(
                blk, gq1, gq2, gq3, gq4, xq1, xq2, xq3, xq4, gk1, gk2, gk3, gk4, xk1, xk2,
                xk3, xk4, v, a, wq1, wq2, wq3, wq4, wk1, wk2, wk3, wk4, aq1, aq2, aq3, aq4,
                ak1, ak2, ak3, ak4, dqkv_ptr, T, S, NBATCH, dstride_b, dstride_s, eps, H, HKV,
                D, HALF, R, RH, G, INTERLEAVED, NORM_Q, NORM_K, HAS_REST, SAME, EVEN, APPROX,
                ROW_ORDER, BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, BLOCK_RH, BLOCK_D)
            if PREFETCH:
                (gq1, gq2, gq3, gq4, xq1, xq2, xq3, xq4, gk1, gk2, gk3, gk4, xk1, xk2, xk3,
                 xk4, v, a) = (ngq1, ngq2, ngq3, ngq4, nxq1, nxq2, nxq3, nxq4, ngk1, ngk2,
                               ngk3, ngk4, nxk1, nxk2, nxk3, nxk4, nv, na)
    else:
        for blk in tl.range(pid, NB, P, num_stages=STAGES):
            t, live, b, s = token_block(blk, T, S, NBATCH, BLOCK_T, ROW_ORDER)
            t3 = t.to(tl.int64)[None, :, None]
            x_row = qkv_ptr + token_offsets(b, s, stride_b, stride_s)
            dx_row = dqkv_ptr + token_offsets(b, s, dstride_b, dstride_s)
            dq_row = dq_ptr + t3 * (H * D)
            dk_row = dk_ptr + t3 * (HKV * D)
            dv_row = dv_ptr + t3 * (HKV * D)
            cos, sin = rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS,
                                    EVEN, APPROX, BLOCK_HALF)
            for h0 in range(0, H, BLOCK_HQ):
                aq1, aq2, aq3, aq4 = bwd_heads(
                    dq_row, x_row, dx_row, live, h0, H, H, HKV, D, HALF, R, RH, eps, cos,
                    sin, wq1, wq2, wq3, wq4, aq1, aq2, aq3, aq4, G, 0, INTERLEAVED, NORM_Q,
                    HAS_REST, SAME, EVEN, BLOCK_HQ, BLOCK_HALF, BLOCK_RH)
            for h0 in range(0, HKV, BLOCK_HK):
                ak1, ak2, ak3, ak4 = bwd_heads(
                    dk_row, x_row, dx_row, live, h0, HKV, H, HKV, D, HALF, R, RH, eps, cos,
                    sin, wk1, wk2, wk3, wk4, ak1, ak2, ak3, ak4, G, 1, INTERLEAVED, NORM_K,
                    HAS_REST, SAME, EVEN, BLOCK_HK, BLOCK_HALF, BLOCK_RH)
                hv, mv, cv = head_block(h0, live, HKV, H, HKV, D, G, 2, INTERLEAVED,
                                        BLOCK_HK)
                copy_heads(dv_row + hv * D, dx_row + cv, mv, D, EVEN, BLOCK_D)
    if NORM_Q:
        store_dw(dw_ptr + pid * (2 * D), aq1, aq2, aq3, aq4, HALF, R, RH, HAS_REST,
                 BLOCK_HALF, BLOCK_RH)
    if NORM_K:
        store_dw(dw_ptr + pid * (2 * D) + D, ak1, ak2, ak3, ak4, HALF, R, RH, HAS_REST,
                 BLOCK_HALF, BLOCK_RH)


def sum_dw_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of the contiguous float32 partial rows ``[P, N]`` as ``[N]`` in
    ``dtype``: :func:`linghe.utils.sum_partials` with all rows in one block (up to
    ``DW_BLOCK_P``) and ``DW_BLOCK_N`` columns per program, so each program issues its
    loads at once instead of walking the rows (the reduction is latency-bound: a few
    hundred KB, all in L2)."""
    block_p = min(max(next_power_of_2(partial.shape[0]), 16), DW_BLOCK_P)
    return sum_partials(partial, dtype, block_p=block_p, block_n=DW_BLOCK_N)


#: Persistent backward programs per SM (each loops over token blocks and writes one
#: float32 partial row of the norm-weight gradients): the guess before the kernel's fit is
#: known; after the first launch, what fits an SM (registers, shared memory), at most the
#: MAX.
PROGRAMS_PER_SM = 4
MAX_PROGRAMS_PER_SM = 8
#: The weight-gradient reduction (:func:`sum_dw_partials`): rows in one block at most,
#: columns per program.
DW_BLOCK_P = 1024
DW_BLOCK_N = 8


def qk_norm_rope_bwd(dq, dk, dv, qkv, freqs, position_ids, q_norm_weight, k_norm_weight, *,
                     num_heads, num_kv_heads, head_dim, rotary_dim, layout, interleaved, eps,
                     qkv_shape=None, qkv_dtype=None):
    """Returns ``(dqkv, dq_norm_weight, dk_norm_weight)``; ``dq/dk/dv`` contiguous
    ``[B, S, H|Hkv, D]``. ``dqkv`` is contiguous in ``qkv``'s layout and dtype; weight
    gradients are float32 partial rows (one per program, ``[P, 2*D]``) summed by one small
    launch (float32, then cast to the weight's dtype; ``None`` where there is no weight).
    Without norm weights ``qkv`` is not read and may be ``None`` (then
    ``qkv_shape``/``qkv_dtype`` are given)."""
    from ..fwd import rope as fwd

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
    if T == 0:
        return (dqkv, torch.zeros_like(q_norm_weight) if nq else None,
                torch.zeros_like(k_norm_weight) if nk else None)
    fwd.check_tokens(T)
    cfg = launch_config(H, Hkv, D, rotary_dim, T, fwd.BWD_TOKENS, fwd.BWD_NUM_WARPS,
                        fwd.COS_SIN_APPROX, layout, B)
    stages = max(1, int(fwd.BWD_STAGES))
    prefetch = bool(fwd.BWD_PREFETCH) and stages == 1
    opts = {"maxnreg": fwd.BWD_MAXNREG} if fwd.BWD_MAXNREG else {}
    dev = qkv.device
    key = ("qk_norm_rope_bwd", dev.index, qkv.dtype, nq, nk, interleaved,
           position_ids is not None, H, Hkv, D, rotary_dim, stages, prefetch, fwd.BWD_MAXNREG,
           *cfg.values())
    blocks = -(-T // cfg["BLOCK_T"])
    P = max(1, min(blocks, num_sms(dev) * resident_programs(key, PROGRAMS_PER_SM)))
    # One float32 partial row per program: [q weight grad | k weight grad].
    partial = empty(P, 2 * D, dtype=torch.float32, device=dev) if nq or nk else freqs
    with device_guard(qkv):
        ck = launch(_qk_norm_rope_bwd_kernel, (P,),
            qkv, dq, dk, dv, dqkv, freqs, position_ids if position_ids is not None else freqs,
            q_norm_weight if nq else freqs, k_norm_weight if nk else freqs, partial,
            T, S, B, freqs.shape[0], stride_b, stride_s, dstride_b, dstride_s, eps,
            INTERLEAVED=interleaved,
            HAS_POS=position_ids is not None, NORM_Q=nq, NORM_K=nk, STAGES=stages,
            PREFETCH=prefetch, **cfg, **opts)
    learn_resident(key, ck, cfg["num_warps"], MAX_PROGRAMS_PER_SM)
    gq = gk = None
    if nq and nk and q_norm_weight.dtype == k_norm_weight.dtype:
        both = sum_dw_partials(partial, q_norm_weight.dtype)  # one launch for both weights
        gq, gk = both[:D], both[D:]
    else:
        if nq:
            gq = sum_dw_partials(partial[:, :D].contiguous(), q_norm_weight.dtype)
        if nk:
            gk = sum_dw_partials(partial[:, D:].contiguous(), k_norm_weight.dtype)
    return dqkv, gq, gk
