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
    copy_heads,
    head_block,
    head_sum,
    load_pieces,
    load_weight_pieces,
    piece_offsets,
    rope_config,
    rope_cos_sin,
    store_pieces,
    swap_halves,
    token_block,
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
def rope_norm_bwd(g12, g3, x12, x3, w12, w3, a12, a3, cos, sin_s, D, eps,
                  NORM: tl.constexpr, HAS_REST: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_NR: tl.constexpr):
    """RoPE backward ``dn = g*cos - g[partner]*sin_s`` (the partner: :func:`swap_halves`),
    then the RMSNorm backward ``dx = rstd * (dn*w - xhat * mean(dn*w*xhat))`` with
    ``dw += dn * xhat`` accumulated elementwise in the fp32 tiles ``a12, a3`` (reduced
    once, after the token loop). Returns ``(dx12, dx3, a12, a3)`` (fp32)."""
    u = g12.to(tl.float32)
    d12 = u * cos - swap_halves(u, BLOCK_HALF) * sin_s
    d3 = g3.to(tl.float32)
    if NORM:
        x12 = x12.to(tl.float32)
        x3 = x3.to(tl.float32)
        inv_d = 1.0 / D  # a scalar: no division per head
        rstd = tl.math.rsqrt(head_sum(x12 * x12, x3 * x3, HAS_REST, BLOCK_NR) * inv_d
                             + eps)[:, :, None]
        x12 = x12 * rstd
        a12 += d12 * x12
        d12 = d12 * w12
        if HAS_REST:
            x3 = x3 * rstd
            a3 += d3 * x3
            d3 = d3 * w3
        c = (head_sum(d12 * x12, d3 * x3, HAS_REST, BLOCK_NR) * inv_d)[:, :, None]
        d12 = (d12 - x12 * c) * rstd
        d3 = (d3 - x3 * c) * rstd
    return d12, d3, a12, a3


@triton.jit
def store_dw(dw_row, a12, a3, HALF, R, D, HAS_REST: tl.constexpr, BLOCK_HALF: tl.constexpr,
             BLOCK_NR: tl.constexpr):
    """Reduce the fp32 accumulator tiles over heads and tokens; store the ``[D]`` row."""
    o12, in12 = piece_offsets(HALF, 2, BLOCK_HALF)
    tl.store(dw_row + o12, tl.sum(tl.sum(a12, axis=1), axis=0)[None, None, :], mask=in12)
    if HAS_REST:
        o3, in3 = piece_offsets(HALF, BLOCK_NR, BLOCK_HALF)
        tl.store(dw_row + R + o3, tl.sum(tl.sum(a3, axis=1), axis=0)[None, None, :],
                 mask=in3 & (o3 < D - R))


@triton.jit
def bwd_heads(dy_ptr, x_row, dx_row, t3, live, h0, NH, H, HKV, G, D, HALF, R, eps, cos,
              sin_s, w12, w3, a12, a3, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
              NORM: tl.constexpr, HAS_REST: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_HALF: tl.constexpr, BLOCK_NR: tl.constexpr):
    """One head block of q (``KIND`` 0) or k (1) of a token block: load the gradient
    (``[T, NH, D]`` rows at ``dy_ptr``) and the input, store dx into dqkv, return the
    updated accumulators."""
    h, m, col = head_block(h0, live, NH, H, HKV, G, D, KIND, INTERLEAVED, BLOCK_H)
    g12, g3 = load_pieces(dy_ptr + (t3 * NH + h) * D, m, HALF, R, D, HAS_REST, BLOCK_HALF,
                          BLOCK_NR)
    if NORM:
        x12, x3 = load_pieces(x_row + col, m, HALF, R, D, HAS_REST, BLOCK_HALF, BLOCK_NR)
    else:
        x12, x3 = g12, g3
    y12, y3, a12, a3 = rope_norm_bwd(g12, g3, x12, x3, w12, w3, a12, a3, cos, sin_s, D, eps,
                                     NORM, HAS_REST, BLOCK_HALF, BLOCK_NR)
    store_pieces(dx_row + col, m, y12, y3, HALF, R, D, HAS_REST, BLOCK_HALF, BLOCK_NR)
    return a12, a3


@triton.jit
def _qk_norm_rope_bwd_kernel(qkv_ptr, dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, freqs_ptr, pos_ptr,
                             qw_ptr, kw_ptr, dw_ptr, T, S, H, HKV, D, HALF, R, NPOS,
                             stride_b, stride_s, dstride_b, dstride_s, eps,
                             INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
                             NORM_Q: tl.constexpr, NORM_K: tl.constexpr,
                             HAS_REST: tl.constexpr, ONE_BLOCK: tl.constexpr,
                             APPROX: tl.constexpr, STAGES: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
                             BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             BLOCK_NR: tl.constexpr, BLOCK_D: tl.constexpr):
    """Persistent: program ``pid`` handles token blocks ``pid, pid + P, ...`` of
    ``BLOCK_T`` tokens (a loop software-pipelined over ``STAGES`` stages) and writes one
    float32 partial row ``[dq_norm_weight | dk_norm_weight]`` (``2*D``) at ``dw_ptr``.
    The weight-gradient terms stay elementwise in registers until the end (no cross-warp
    reduction per token)."""
    pid = tl.program_id(0)
    zero64 = pid.to(tl.int64) * 0
    P = tl.num_programs(0)
    G = H // HKV
    NB = tl.cdiv(T, BLOCK_T)
    wq12, wq3 = load_weight_pieces(qw_ptr, HALF, R, D, NORM_Q, HAS_REST, BLOCK_HALF, BLOCK_NR)
    wk12, wk3 = load_weight_pieces(kw_ptr, HALF, R, D, NORM_K, HAS_REST, BLOCK_HALF, BLOCK_NR)
    aq12 = tl.zeros([BLOCK_HQ, BLOCK_T, 2 * BLOCK_HALF], dtype=tl.float32)
    aq3 = tl.zeros([BLOCK_HQ, BLOCK_T, BLOCK_NR * BLOCK_HALF], dtype=tl.float32)
    ak12 = tl.zeros([BLOCK_HK, BLOCK_T, 2 * BLOCK_HALF], dtype=tl.float32)
    ak3 = tl.zeros([BLOCK_HK, BLOCK_T, BLOCK_NR * BLOCK_HALF], dtype=tl.float32)
    for blk in tl.range(pid, NB, P, num_stages=STAGES):
        # (zero64: int64 offsets; blk is a plain int in the interpreter)
        t0 = zero64 + blk * BLOCK_T
        t, live, b, s = token_block(t0, T, S, BLOCK_T)
        t3 = t[None, :, None]
        x_row = qkv_ptr + (b * stride_b + s * stride_s)[None, :, None]
        dx_row = dqkv_ptr + (b * dstride_b + s * dstride_s)[None, :, None]
        if ONE_BLOCK:
            # every load of the token block is issued before any math
            hq, mq, cq = head_block(0, live, H, H, HKV, G, D, 0, INTERLEAVED, BLOCK_HQ)
            hk, mk, ck = head_block(0, live, HKV, H, HKV, G, D, 1, INTERLEAVED, BLOCK_HK)
            hv, mv, cv = head_block(0, live, HKV, H, HKV, G, D, 2, INTERLEAVED, BLOCK_HK)
            gq12, gq3 = load_pieces(dq_ptr + (t3 * H + hq) * D, mq, HALF, R, D, HAS_REST,
                                    BLOCK_HALF, BLOCK_NR)
            gk12, gk3 = load_pieces(dk_ptr + (t3 * HKV + hk) * D, mk, HALF, R, D, HAS_REST,
                                    BLOCK_HALF, BLOCK_NR)
            if NORM_Q:
                xq12, xq3 = load_pieces(x_row + cq, mq, HALF, R, D, HAS_REST, BLOCK_HALF,
                                        BLOCK_NR)
            else:
                xq12, xq3 = gq12, gq3
            if NORM_K:
                xk12, xk3 = load_pieces(x_row + ck, mk, HALF, R, D, HAS_REST, BLOCK_HALF,
                                        BLOCK_NR)
            else:
                xk12, xk3 = gk12, gk3
            copy_heads(dv_ptr + (t3 * HKV + hv) * D, dx_row + cv, mv, D, BLOCK_D)
            cos, sin_s = rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS,
                                      APPROX, BLOCK_HALF)
            y12, y3, aq12, aq3 = rope_norm_bwd(gq12, gq3, xq12, xq3, wq12, wq3, aq12, aq3,
                                               cos, sin_s, D, eps, NORM_Q, HAS_REST,
                                               BLOCK_HALF, BLOCK_NR)
            store_pieces(dx_row + cq, mq, y12, y3, HALF, R, D, HAS_REST, BLOCK_HALF,
                         BLOCK_NR)
            y12, y3, ak12, ak3 = rope_norm_bwd(gk12, gk3, xk12, xk3, wk12, wk3, ak12, ak3,
                                               cos, sin_s, D, eps, NORM_K, HAS_REST,
                                               BLOCK_HALF, BLOCK_NR)
            store_pieces(dx_row + ck, mk, y12, y3, HALF, R, D, HAS_REST, BLOCK_HALF,
                         BLOCK_NR)
        else:
            cos, sin_s = rope_cos_sin(freqs_ptr, pos_ptr, t, live, s, NPOS, HALF, HAS_POS,
                                      APPROX, BLOCK_HALF)
            for h0 in range(0, H, BLOCK_HQ):
                aq12, aq3 = bwd_heads(dq_ptr, x_row, dx_row, t3, live, h0, H, H, HKV, G, D,
                                      HALF, R, eps, cos, sin_s, wq12, wq3, aq12, aq3, 0,
                                      INTERLEAVED, NORM_Q, HAS_REST, BLOCK_HQ, BLOCK_HALF,
                                      BLOCK_NR)
            for h0 in range(0, HKV, BLOCK_HK):
                ak12, ak3 = bwd_heads(dk_ptr, x_row, dx_row, t3, live, h0, HKV, H, HKV, G,
                                      D, HALF, R, eps, cos, sin_s, wk12, wk3, ak12, ak3, 1,
                                      INTERLEAVED, NORM_K, HAS_REST, BLOCK_HK, BLOCK_HALF,
                                      BLOCK_NR)
                hv, mv, cv = head_block(h0, live, HKV, H, HKV, G, D, 2, INTERLEAVED,
                                        BLOCK_HK)
                copy_heads(dv_ptr + (t3 * HKV + hv) * D, dx_row + cv, mv, D, BLOCK_D)
    if NORM_Q:
        store_dw(dw_ptr + pid * (2 * D), aq12, aq3, HALF, R, D, HAS_REST, BLOCK_HALF,
                 BLOCK_NR)
    if NORM_K:
        store_dw(dw_ptr + pid * (2 * D) + D, ak12, ak3, HALF, R, D, HAS_REST, BLOCK_HALF,
                 BLOCK_NR)


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
    cfg = rope_config(H, Hkv, D, rotary_dim, fwd.BWD_TOKENS, fwd.BWD_NUM_WARPS,
                      fwd.TILE_CAP, fwd.COS_SIN_APPROX)
    stages = max(1, int(fwd.BWD_STAGES))
    dev = qkv.device
    key = ("qk_norm_rope_bwd", dev.index, qkv.dtype, nq, nk, interleaved,
           position_ids is not None, H, Hkv, D, rotary_dim, stages, *cfg.values())
    blocks = -(-T // cfg["BLOCK_T"])
    P = max(1, min(blocks, num_sms(dev) * resident_programs(key, PROGRAMS_PER_SM)))
    # One float32 partial row per program: [q weight grad | k weight grad].
    partial = empty(P, 2 * D, dtype=torch.float32, device=dev) if nq or nk else freqs
    with device_guard(qkv):
        ck = launch(_qk_norm_rope_bwd_kernel, (P,),
            qkv, dq, dk, dv, dqkv, freqs, position_ids if position_ids is not None else freqs,
            q_norm_weight if nq else freqs, k_norm_weight if nk else freqs, partial,
            T, S, H, Hkv, D, rotary_dim // 2, rotary_dim, freqs.shape[0], stride_b,
            stride_s, dstride_b, dstride_s, eps, INTERLEAVED=interleaved,
            HAS_POS=position_ids is not None, NORM_Q=nq, NORM_K=nk, STAGES=stages, **cfg)
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
