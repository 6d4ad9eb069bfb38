"""Router forward kernels: fp32-exact router GEMM, fused top-k routing, z-loss.

**fp32-exact GEMM without TF32.** ``_mm_kernel`` computes ``C = A @ B`` where each operand
is read in its own dtype and split in registers into bf16 parts whose sum is exactly the
value (bf16: 1 part; fp16: 2 parts; fp32: 3 parts: ``hi = bf16(a)``, ``mid = bf16(a - hi)``,
``lo = bf16(a - hi - mid)``, 8+8+8 significand bits). Every product of two bf16 parts is
exact in fp32, and the tensor cores accumulate in fp32, so summing the part products
``a_i * b_j`` with ``i + j <= ORDER`` gives a float32-accurate result (``ORDER=2`` drops
only terms below ``2^-24`` relative; ``ORDER=1`` is used when the output is bf16/fp16).
For bf16 ``x`` and bf16 weight that is one bf16 tensor-core dot; fp32 weight costs 3.
On Hopper the tensor cores' fp32 accumulation is not IEEE round-to-nearest, so "exact"
means relative error ~1e-6 at K ~ 2048 (still ~100x under TF32).

**Top-k routing.** Ungrouped routing (``num_groups == 1``) runs ``_topk_fwd_rows_kernel``
on ``[BT, E]`` tiles (reductions over many rows at once). Grouped routing runs
``_topk_fwd_kernel``: one row's ``E`` scores sit in registers as a
``[groups, experts per group]`` tile; softmax/sigmoid, bias, group-limited selection and
``k`` rounds of arg-max run there; a per-program histogram of chosen experts is added to
``tokens_per_expert`` with one vector of integer atomics (exact, order-independent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import (
    INTERPRET,
    cdiv,
    device_guard,
    dot_f32acc,
    empty,
    grouped_tile_order,
    launch,
    next_power_of_2,
    num_sms,
)


@triton.jit
def _split3(a):
    """fp32 tile -> three bf16 tiles with ``hi + mid + lo == a`` (for normal values)."""
    h = a.to(tl.bfloat16)
    r = a - h.to(tl.float32)
    m = r.to(tl.bfloat16)
    lo = (r - m.to(tl.float32)).to(tl.bfloat16)
    return h, m, lo


@triton.jit
def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, k_per_split,
               s_ap, s_bp, SA: tl.constexpr, SB: tl.constexpr, ORDER: tl.constexpr,
               A_SPLIT: tl.constexpr, B_SPLIT: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """``C = A @ B`` from bf16 parts (module docstring). ``A_SPLIT``/``B_SPLIT``: the
    operand is already split in memory (:func:`split3`: parts ``s_ap``/``s_bp`` elements
    apart), so the tile is loaded as three bf16 tiles instead of split in registers."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    pid_m, pid_n = grouped_tile_order(pid, num_m, num_n, GROUP_M)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < k_hi
        a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :].to(tl.int64) * s_ak
        a_mask = mmask[:, None] & kmask[None, :]
        b_ptrs = b_ptr + rk[:, None].to(tl.int64) * s_bk + rn[None, :] * s_bn
        b_mask = kmask[:, None] & nmask[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if SA == 1:
            a0 = a.to(tl.bfloat16)
            a1 = a0
            a2 = a0
        elif A_SPLIT:
            a0 = a
            a1 = tl.load(a_ptrs + s_ap, mask=a_mask, other=0.0)
            a2 = a1
            if SA > 2 and ORDER >= 2:
                a2 = tl.load(a_ptrs + 2 * s_ap, mask=a_mask, other=0.0)
        else:
            a0, a1, a2 = _split3(a.to(tl.float32))
        if SB == 1:
            b0 = b.to(tl.bfloat16)
            b1 = b0
            b2 = b0
        elif B_SPLIT:
            b0 = b
            b1 = tl.load(b_ptrs + s_bp, mask=b_mask, other=0.0)
            b2 = b1
            if SB > 2 and ORDER >= 2:
                b2 = tl.load(b_ptrs + 2 * s_bp, mask=b_mask, other=0.0)
        else:
            b0, b1, b2 = _split3(b.to(tl.float32))
        # smallest terms first
        if ORDER >= 2:
            if SA > 1:
                if SB > 1:
                    acc = dot_f32acc(a1, b1, acc)
            if SA > 2:
                acc = dot_f32acc(a2, b0, acc)
            if SB > 2:
                acc = dot_f32acc(a0, b2, acc)
        if ORDER >= 1:
            if SA > 1:
                acc = dot_f32acc(a1, b0, acc)
            if SB > 1:
                acc = dot_f32acc(a0, b1, acc)
        acc = dot_f32acc(a0, b0, acc)
    c_base = c_ptr + pid_s.to(tl.int64) * M * N
    tl.store(c_base + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


_PARTS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
#: Split a float32 operand into its bf16 parts in memory before the GEMM (knob; False:
#: every tile splits the fp32 values it loads, in registers).
PRESPLIT = True


@triton.jit
def _split3_kernel(src_ptr, dst_ptr, n, K, s_m, s_k, BLOCK: tl.constexpr):
    # (n = M * K comes from the host: an int argument equal to 1 is specialized to a
    # constexpr, which has no .to())
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    m = offs // K
    k = offs % K
    h, mid, lo = _split3(tl.load(src_ptr + m * s_m + k * s_k, mask=mask, other=0.0))
    tl.store(dst_ptr + offs, h, mask=mask)
    tl.store(dst_ptr + n + offs, mid, mask=mask)
    tl.store(dst_ptr + 2 * n + offs, lo, mask=mask)


def split3(a: torch.Tensor) -> torch.Tensor:
    """float32 ``a [M, K]`` (any strides) -> ``[3, M, K]`` contiguous bf16 parts
    ``hi, mid, lo`` with ``hi + mid + lo == a`` (for normal values)."""
    M, K = a.shape
    out = empty(3, M, K, dtype=torch.bfloat16, device=a.device)
    if M * K:
        BLOCK = 1024
        launch(_split3_kernel, (cdiv(M * K, BLOCK),), a, out, M * K, K, a.stride(0),
               a.stride(1), BLOCK=BLOCK, num_warps=4)
    return out
_MM_CFG: dict = {}


def _mm_config(M: int, N: int, K: int, ea: int, eb: int, dev) -> tuple:
    """``(BM, BN, BK, num_warps, num_stages, split_k)`` for ``[M, K] @ [K, N]`` with operand
    element sizes ``ea``/``eb`` (cached per shape)."""
    key = (M, N, K, ea, eb, dev)
    cfg = _MM_CFG.get(key)
    if cfg is not None:
        return cfg
    if INTERPRET:
        cfg = (32, 32, 32, 4, 1, 1)
    else:
        sms = num_sms(dev)
        if N <= 256:
            # narrow output (the router's E): one tile spans N, so A is read exactly once
            BM, BN, nw = 64, max(16, next_power_of_2(N)), 4
        else:
            BM, BN, nw = 128, 128, 8
        BK = 64
        if eb == 4 and BN >= 256:
            BK, nw = 32, 8  # an fp32 B tile is split in registers: keep it small
        ns = 2 if (ea == 4 and eb == 4) else (3 if max(ea, eb) == 4 or BN >= 256 else 4)
        # (smem: BN=256 bf16 stages are 40 KB each, plus a 64 KB fp32 epilogue tile)
        if BN < 256 and M * N <= 64 * 128 * sms:
            BM = 64
        tiles = cdiv(M, BM) * cdiv(N, BN)
        split_k = 1
        if tiles < sms and K >= 2048:
            # few output tiles (dW = dlogits^T @ x: [E, K] over T): split the reduction so
            # that about two waves of programs run; fp32 partials summed deterministically
            split_k = max(1, min(cdiv(2 * sms, tiles), K // 512))
        cfg = (BM, BN, BK, nw, ns, split_k)
    _MM_CFG[key] = cfg
    return cfg


def matmul_exact(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
                 order: int | None = None, split_k: int | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (any strides) -> ``[M, N]`` contiguous ``out_dtype``, exact to
    float32 accuracy without TF32 (see the module docstring). ``order`` defaults to 2 for
    a float32 output and 1 otherwise. ``split_k`` > 1 sums partial products over K chunks
    (a deterministic second pass). The operand with more bf16 parts is put in the MMA's A
    slot (computing ``C^T = B^T A^T``): on Hopper, A may come from registers, B must be
    staged through shared memory."""
    M, K = a.shape
    N = b.shape[1]
    if order is None:
        order = 2 if out_dtype == torch.float32 else 1
    dev = a.device
    swap = _PARTS[b.dtype] > _PARTS[a.dtype] and order > 0
    if swap:
        a_, b_, M_, N_ = b.t(), a.t(), N, M
    else:
        a_, b_, M_, N_ = a, b, M, N
    BM, BN, BK, nw, ns, sk = _mm_config(M_, N_, K, a_.element_size(), b_.element_size(), dev)
    if split_k is None:
        split_k = sk
    k_per = cdiv(cdiv(K, split_k), BK) * BK if K else BK
    split_k = max(1, cdiv(K, k_per))
    if split_k == 1:
        c = empty(M, N, dtype=out_dtype, device=dev)
    else:
        c = empty(split_k, M, N, dtype=torch.float32, device=dev)
    if M == 0 or N == 0:
        return c if split_k == 1 else c.sum(0).to(out_dtype)
    if K == 0:
        return torch.zeros(M, N, dtype=out_dtype, device=dev)
    s_cm, s_cn = (1, N) if swap else (N, 1)
    tiles = cdiv(M_, BM) * cdiv(N_, BN)
    sa, sb = _PARTS[a_.dtype], _PARTS[b_.dtype]
    with device_guard(a):
        # An fp32 operand is split once here, not in every tile that reads it (each A tile
        # is read by all N tiles and vice versa); the MMA then reads bf16 parts.
        a_split = sa == 3 and PRESPLIT and order > 0
        b_split = sb == 3 and PRESPLIT and order > 0
        if a_split:
            a_ = split3(a_)
        if b_split:
            b_ = split3(b_)
        s_ap = M_ * K if a_split else 0
        s_bp = K * N_ if b_split else 0
        launch(_mm_kernel, (tiles, split_k),
            a_, b_, c, M_, N_, K, a_.stride(-2), a_.stride(-1), b_.stride(-2), b_.stride(-1),
            s_cm, s_cn, k_per, s_ap, s_bp, SA=sa, SB=sb, ORDER=order, A_SPLIT=a_split,
            B_SPLIT=b_split, BM=BM, BN=BN, BK=BK, GROUP_M=8, num_warps=nw, num_stages=ns)
    if split_k > 1:
        c = c.sum(0) if out_dtype == torch.float32 else c.sum(0).to(out_dtype)
    return c


def router_logits_fwd(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 [T, K] @ weight[E, K]^T`` -> fp32 ``[T, E]``."""
    return matmul_exact(x2, weight.t(), torch.float32, order=2)


# ------------------------------------------------------------------------------ top-k
@triton.jit
def _topk_fwd_kernel(logits_ptr, bias_ptr, probs_ptr, ids_ptr, tpe_ptr, T, stride_l, G, EG,
                     TOPG, scale, ROWS: tl.constexpr, K_TOP: tl.constexpr,
                     BG: tl.constexpr, BGE: tl.constexpr, BK: tl.constexpr,
                     SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                     NORMALIZE: tl.constexpr):
    pid = tl.program_id(0)
    gi = tl.arange(0, BG)
    ji = tl.arange(0, BGE)
    e2 = gi[:, None] * EG + ji[None, :]
    valid = (gi < G)[:, None] & (ji < EG)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e2, mask=valid, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BG, BGE], dtype=tl.float32)
    hist = tl.zeros([BG, BGE], dtype=tl.int32)
    kk = tl.arange(0, BK)
    neg = float("-inf")
    for i in range(ROWS):
        t = pid.to(tl.int64) * ROWS + i
        rv2 = (e2 * 0 + t) < T
        x = tl.load(logits_ptr + t * stride_l + e2, mask=valid & rv2, other=neg).to(tl.float32)
        if SIGMOID:
            s = 1.0 / (1.0 + tl.exp(-x))
            s = tl.where(valid, s, 0.0)
        else:
            mx = tl.max(tl.max(x, axis=1), axis=0)
            ex = tl.where(valid, tl.exp(x - mx), 0.0)
            s = ex / tl.sum(tl.sum(ex, axis=1), axis=0)
        sel = tl.where(valid, s + bias, neg)
        if GROUPED:
            m1 = tl.max(sel, axis=1)
            if SIGMOID:
                j1 = tl.min(tl.where(sel == m1[:, None], ji[None, :], BGE), axis=1)
                m2 = tl.max(tl.where(ji[None, :] == j1[:, None], neg, sel), axis=1)
                gscore = tl.where(EG > 1, m1 + m2, m1)
            else:
                gscore = m1
            gscore = tl.where(gi < G, gscore, neg)
            gsel = gi < 0
            for _q in range(TOPG):
                cand = tl.where(gsel, neg, gscore)
                mg = tl.max(cand, axis=0)
                gidx = tl.min(tl.where((cand == mg) & ~gsel & (gi < G), gi, BG), axis=0)
                gsel = gsel | (gi == gidx)
            sel = tl.where(gsel[:, None], sel, neg)
        pk = tl.zeros([BK], dtype=tl.float32)
        ik = tl.zeros([BK], dtype=tl.int32)
        for j in range(K_TOP):
            m = tl.max(tl.max(sel, axis=1), axis=0)
            idx = tl.min(tl.min(tl.where((sel == m) & valid, e2, (BG * BGE)), axis=1), axis=0)
            hit = e2 == idx
            sv = tl.sum(tl.sum(tl.where(hit, s, 0.0), axis=1), axis=0)
            pk = tl.where(kk == j, sv, pk)
            ik = tl.where(kk == j, idx, ik)
            sel = tl.where(hit, neg, sel)
            hist += (hit & rv2).to(tl.int32)
        if NORMALIZE:
            pk = pk / tl.sum(pk, axis=0)
        pk = pk * scale
        ik = tl.where(ik < (BG * BGE), ik, -1)
        om = (kk < K_TOP) & ((kk * 0 + t) < T)
        tl.store(probs_ptr + t * K_TOP + kk, pk, mask=om)
        tl.store(ids_ptr + t * K_TOP + kk, ik, mask=om)
    tl.atomic_add(tpe_ptr + e2, hist, mask=valid & (hist > 0))


@triton.jit
def _topk_fwd_rows_kernel(logits_ptr, bias_ptr, probs_ptr, ids_ptr, tpe_ptr, T, E, stride_l,
                          scale, BT: tl.constexpr, K_TOP: tl.constexpr, BE: tl.constexpr,
                          BK: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                          NORMALIZE: tl.constexpr):
    """Ungrouped routing on a ``[BT, E]`` tile of rows: every reduction runs over ``BT``
    rows at once (same semantics as ``_topk_fwd_kernel`` with one group)."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BT + tl.arange(0, BT)
    rmask = rows < T
    eb = tl.arange(0, BE)
    emask = eb < E
    m2 = rmask[:, None] & emask[None, :]
    neg = float("-inf")
    x = tl.load(logits_ptr + rows[:, None] * stride_l + eb[None, :], mask=m2,
                other=neg).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
        s = tl.where(emask[None, :], s, 0.0)
    else:
        mx = tl.max(x, axis=1)
        ex = tl.where(emask[None, :], tl.exp(x - mx[:, None]), 0.0)
        s = ex / tl.sum(ex, axis=1)[:, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + eb, mask=emask, other=0.0).to(tl.float32)
        sel = tl.where(emask[None, :], s + bias[None, :], neg)
    else:
        sel = tl.where(emask[None, :], s, neg)
    kk = tl.arange(0, BK)
    pk = tl.zeros([BT, BK], dtype=tl.float32)
    ik = tl.zeros([BT, BK], dtype=tl.int32)
    hist2 = tl.zeros([BT, BE], dtype=tl.int32)
    for j in range(K_TOP):
        m = tl.max(sel, axis=1)
        idx = tl.min(tl.where((sel == m[:, None]) & emask[None, :], eb[None, :], BE), axis=1)
        hit = eb[None, :] == idx[:, None]
        sv = tl.sum(tl.where(hit, s, 0.0), axis=1)
        pk = tl.where(kk[None, :] == j, sv[:, None], pk)
        ik = tl.where(kk[None, :] == j, idx[:, None], ik)
        sel = tl.where(hit, neg, sel)
        hist2 += (hit & m2).to(tl.int32)
    if NORMALIZE:
        pk = pk / tl.sum(pk, axis=1)[:, None]
    pk = pk * scale
    ik = tl.where(ik < BE, ik, -1)
    om = rmask[:, None] & (kk < K_TOP)[None, :]
    tl.store(probs_ptr + rows[:, None] * K_TOP + kk[None, :], pk, mask=om)
    tl.store(ids_ptr + rows[:, None] * K_TOP + kk[None, :], ik, mask=om)
    hist = tl.sum(hist2, axis=0)
    tl.atomic_add(tpe_ptr + eb, hist, mask=emask & (hist > 0))


def _rows_per_prog(T: int, dev) -> int:
    if INTERPRET:
        return 4
    sms = num_sms(dev)
    # ~32 single-warp programs per SM: the per-row reductions are latency-bound, so
    # parallelism comes from many resident programs rather than long loops
    return max(1, min(16, cdiv(T, 32 * sms)))


def topk_route_fwd(logits: torch.Tensor, k: int, sigmoid: bool, bias: torch.Tensor | None,
                   num_groups: int, topk_groups: int, normalize: bool, scale: float):
    """Launch the fused top-k kernel on ``logits [T, E]`` (last dim contiguous).
    Returns ``(probs [T, k] fp32, ids [T, k] int32, tokens_per_expert [E] int32)``."""
    T, E = logits.shape
    dev = logits.device
    probs = empty(T, k, dtype=torch.float32, device=dev)
    ids = empty(T, k, dtype=torch.int32, device=dev)
    tpe = torch.zeros(E, dtype=torch.int32, device=dev)
    if T == 0:
        return probs, ids, tpe
    if num_groups == 1:
        BE = next_power_of_2(E)
        BT = max(1, (512 if INTERPRET else 2048) // BE)
        with device_guard(logits):
            launch(_topk_fwd_rows_kernel, (cdiv(T, BT),),
                logits, bias if bias is not None else logits, probs, ids, tpe, T, E,
                logits.stride(0), float(scale), BT=BT, K_TOP=k, BE=BE,
                BK=next_power_of_2(k), SIGMOID=sigmoid, HAS_BIAS=bias is not None,
                NORMALIZE=normalize, num_warps=4 if BT * BE <= 4096 else 8)
        return probs, ids, tpe
    G = num_groups
    EG = E // G
    BG, BGE = next_power_of_2(G), next_power_of_2(EG)
    ROWS = _rows_per_prog(T, dev)
    nw = 1 if BG * BGE <= 512 else (2 if BG * BGE <= 2048 else 4)
    with device_guard(logits):
        launch(_topk_fwd_kernel, (cdiv(T, ROWS),),
            logits, bias if bias is not None else logits, probs, ids, tpe, T, logits.stride(0),
            G, EG, topk_groups, float(scale), ROWS=ROWS, K_TOP=k, BG=BG, BGE=BGE,
            BK=next_power_of_2(k), SIGMOID=sigmoid, HAS_BIAS=bias is not None,
            GROUPED=G > 1, NORMALIZE=normalize, num_warps=nw)
    return probs, ids, tpe


# ------------------------------------------------------------------------------ z-loss
@triton.jit
def _zloss_fwd_kernel(logits_ptr, lse_ptr, part_ptr, loss_ptr, cnt_ptr, T, E, stride_l, inv_t,
                      n_progs,
                      ROWS: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr):
    pid = tl.program_id(0)
    eb = tl.arange(0, BE)
    zero_v = tl.zeros([BE], dtype=tl.float32)
    zero = tl.sum(zero_v, axis=0)
    acc = zero
    for i in range(ROWS):
        t = pid.to(tl.int64) * ROWS + i
        rv = (eb * 0 + t) < T
        m_run = zero + float("-inf")
        s_run = zero
        for e0 in range(0, E, BE):
            x = tl.load(logits_ptr + t * stride_l + e0 + eb, mask=(e0 + eb < E) & rv,
                        other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_run, tl.max(x, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_run = s_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
            m_run = m_new
        m_safe = tl.where(m_run == float("-inf"), 0.0, m_run)
        lse = m_safe + tl.log(s_run)
        lse_v = zero_v + lse
        tl.store(lse_ptr + t + eb, lse_v, mask=(eb == 0) & rv)
        acc += tl.sum(tl.where((eb == 0) & rv, lse_v * lse_v, 0.0), axis=0)
    tl.store(part_ptr + pid, acc)
    tl.debug_barrier()  # the partial is written before this program's release below
    # The last program to finish sums the per-program partials in a fixed order (so the
    # result is deterministic) and writes the loss; it then resets the
    # counter for the next call. Branch-free: other programs' loads/stores are masked off.
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    pb = tl.arange(0, BP)
    last = (pb * 0 + done) == n_progs - 1
    tot = tl.zeros([BP], dtype=tl.float32)
    for p0 in range(0, n_progs, BP):
        tot += tl.load(part_ptr + p0 + pb, mask=(p0 + pb < n_progs) & last, other=0.0,
                       cache_modifier=".cg")
    loss = tl.sum(tot, axis=0) * inv_t
    tl.store(loss_ptr + pb, tot * 0.0 + loss, mask=(pb == 0) & last)
    tl.store(cnt_ptr + pb, pb * 0, mask=(pb == 0) & last)


_COUNTERS: dict = {}


def _counter(dev) -> torch.Tensor:
    """A per-device int32 zero that ``_zloss_fwd_kernel`` increments and resets to zero
    (calls on one device are assumed stream-ordered, as all of a training step's are)."""
    c = _COUNTERS.get(dev)
    if c is None:
        c = _COUNTERS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    return c


def router_z_loss_fwd(logits: torch.Tensor):
    """Returns ``(loss [] fp32, lse [T] fp32)`` for ``logits [T, E]``: one launch (the loss
    is reduced in-kernel by the last program)."""
    T, E = logits.shape
    dev = logits.device
    lse = empty(T, dtype=torch.float32, device=dev)
    if T == 0:
        return torch.zeros((), dtype=torch.float32, device=dev), lse
    ROWS = _rows_per_prog(T, dev)
    n = cdiv(T, ROWS)
    part = empty(n, dtype=torch.float32, device=dev)
    # its own tensor (not a view of ``part``: in-place ops on the returned loss must work)
    loss = empty((), dtype=torch.float32, device=dev)
    BE = min(next_power_of_2(max(E, 1)), 4096)
    BP = min(next_power_of_2(n), 256)
    with device_guard(logits):
        launch(_zloss_fwd_kernel, (n,), logits, lse, part, loss, _counter(dev), T, E,
               logits.stride(0),
               1.0 / T, n, ROWS=ROWS, BE=BE, BP=BP,
               num_warps=1 if BE <= 512 else 4)
    return loss, lse
