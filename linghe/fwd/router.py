"""Router forward kernels: fp32-exact router GEMM, fused top-k routing, z-loss.

**fp32-exact GEMM without TF32.** Each operand is represented by bf16 parts whose sum is
exactly its value (:func:`split_parts`; bf16: 1 part, the tensor itself; fp16: 2 parts;
fp32: 3 parts ``hi = bf16(a)``, ``mid = bf16(a - hi)``, ``lo = bf16(a - hi - mid)``,
8+8+8 significand bits), made once per call by a small elementwise kernel (the router
weight's parts once per forward, saved for the backward). Every product of two bf16 parts
is exact in fp32 and the tensor cores accumulate in fp32, so ``_mm_kernel``, which loads
only bf16 parts and sums the part products ``a_i * b_j`` with ``i + j <= ORDER`` into one
accumulator, is float32-accurate (``ORDER=2`` drops only terms below ``2^-24`` relative;
``ORDER=1`` is enough for a bf16/fp16 output). bf16 ``x`` with an fp32 weight costs 3
bf16 tensor-core passes. The forward writes ``[T, E]`` directly from ``128 x 128`` tiles
(``T/128 * E/128`` programs: about one wave at the standard shape); when there are too few
output tiles for the SMs (``dW = dlogits^T @ x``: ``[E, K]``) K is split over programs
and the fp32 partials are summed by a second kernel in a fixed order (deterministic).
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
    """fp32 tile -> three bf16 tiles with ``hi + mid + lo == a`` (for finite values; an
    Inf/NaN ``a`` gives ``hi = a`` and zero ``mid``/``lo``)."""
    h = a.to(tl.bfloat16)
    hf = h.to(tl.float32)
    r = tl.where(tl.abs(hf) < float("inf"), a - hf, 0.0)
    m = r.to(tl.bfloat16)
    lo = (r - m.to(tl.float32)).to(tl.bfloat16)
    return h, m, lo


@triton.jit
def _split_kernel(src_ptr, dst_ptr, n, C, s_r, s_c, P: tl.constexpr, BLOCK: tl.constexpr):
    # element i of the [R, C] source (row-major order) -> dst[p * n + i], p < P
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = src_ptr + (offs // C) * s_r + (offs % C) * s_c
    h, m, lo = _split3(tl.load(src, mask=mask, other=0.0).to(tl.float32))
    tl.store(dst_ptr + offs, h, mask=mask)
    if P > 1:
        tl.store(dst_ptr + n + offs, m, mask=mask)
    if P > 2:
        tl.store(dst_ptr + 2 * n + offs, lo, mask=mask)


#: bf16 parts that represent a value of each dtype exactly (fp16: 11 significand bits).
_PARTS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def split_parts(a: torch.Tensor, parts: int | None = None) -> torch.Tensor:
    """``a [R, C]`` (any strides) -> ``[P, R, C]`` bf16 parts ``hi, mid, lo`` (the first
    ``parts`` of them; default all that ``a``'s dtype needs) with ``hi + mid + lo == a``
    (finite values). A bf16 ``a`` is returned as the view ``a[None]`` (no copy)."""
    R, C = a.shape
    P = _PARTS[a.dtype] if parts is None else min(parts, _PARTS[a.dtype])
    if a.dtype == torch.bfloat16:
        return a.unsqueeze(0)
    out = empty(P, R, C, dtype=torch.bfloat16, device=a.device)
    n = R * C
    if n:
        if a.is_contiguous():
            C_, s_r, s_c = n, 0, 1  # flat copy: no index arithmetic per element
        else:
            C_, s_r, s_c = C, a.stride(0), a.stride(1)
        BLOCK = 1024 if INTERPRET else 2048
        with device_guard(a):
            launch(_split_kernel, (cdiv(n, BLOCK),), a, out, n, C_, s_r, s_c, P=P,
                   BLOCK=BLOCK, num_warps=4)
    return out


def split3(a: torch.Tensor) -> torch.Tensor:
    """float32 ``a [M, K]`` (any strides) -> ``[3, M, K]`` contiguous bf16 parts
    ``hi, mid, lo`` with ``hi + mid + lo == a`` (finite values)."""
    return split_parts(a.float(), 3)


@triton.jit
def _acc_dot(a, b, acc0, acc1, acc2, IDX: tl.constexpr):
    if IDX == 0:
        acc0 = dot_f32acc(a, b, acc0)
    elif IDX == 1:
        acc1 = dot_f32acc(a, b, acc1)
    else:
        acc2 = dot_f32acc(a, b, acc2)
    return acc0, acc1, acc2


@triton.jit
def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_ap, s_bp,
               s_cs, k_per_split, PA: tl.constexpr, PB: tl.constexpr, ORDER: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               EVEN_K: tl.constexpr, NACC: tl.constexpr, I11: tl.constexpr,
               I20: tl.constexpr, I02: tl.constexpr, I10: tl.constexpr, I01: tl.constexpr):
    """``C = A @ B`` from bf16 parts (module docstring): ``A`` is ``PA`` bf16 ``[M, K]``
    tiles ``s_ap`` elements apart, ``B`` is ``PB`` bf16 ``[K, N]`` tiles ``s_bp`` apart;
    the part products ``a_i b_j`` with ``i + j <= ORDER`` go into one fp32 accumulator.
    Program ``(t, s)`` computes output tile ``t`` over the K range
    ``[s * k_per_split, (s + 1) * k_per_split)`` and stores it at ``c + s * s_cs`` (a
    split-K partial, summed by ``_sum_splits_kernel``; ``s_cs = 0`` without split-K).
    ``EVEN_K``: every K range is a whole number of ``BK`` blocks (no K mask).
    ``I11 .. I01``: the accumulator (0..NACC-1) of each part product ``a_i b_j``; with one
    accumulator per dot (``NACC`` = number of products) no dot waits for the previous one
    (Triton waits for a chained wgmma before the next dot of the chain), at the cost of
    ``NACC`` accumulators in registers."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    pid_m, pid_n = grouped_tile_order(pid, num_m, num_n, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    k_lo = pid_s * k_per_split
    k_len = tl.minimum(K - k_lo, k_per_split)
    rk = tl.arange(0, BK)
    a_ptrs = (a_ptr + rm[:, None].to(tl.int64) * s_am
              + (k_lo + rk)[None, :].to(tl.int64) * s_ak)
    b_ptrs = (b_ptr + (k_lo + rk)[:, None].to(tl.int64) * s_bk
              + rn[None, :].to(tl.int64) * s_bn)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, k_len, BK):
        if EVEN_K:
            a_mask = mmask[:, None]
            b_mask = nmask[None, :]
        else:
            kmask = rk < k_len - k0
            a_mask = mmask[:, None] & kmask[None, :]
            b_mask = kmask[:, None] & nmask[None, :]
        a0 = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b0 = tl.load(b_ptrs, mask=b_mask, other=0.0)
        a1 = a0
        a2 = a0
        b1 = b0
        b2 = b0
        if PA > 1:
            a1 = tl.load(a_ptrs + s_ap, mask=a_mask, other=0.0)
        if PA > 2:
            a2 = tl.load(a_ptrs + s_ap + s_ap, mask=a_mask, other=0.0)
        if PB > 1:
            b1 = tl.load(b_ptrs + s_bp, mask=b_mask, other=0.0)
        if PB > 2:
            b2 = tl.load(b_ptrs + s_bp + s_bp, mask=b_mask, other=0.0)
        # smallest terms first (PA, PB <= ORDER + 1: every loaded part is used)
        if ORDER >= 2:
            if PA > 1:
                if PB > 1:
                    acc, acc1, acc2 = _acc_dot(a1, b1, acc, acc1, acc2, I11)
            if PA > 2:
                acc, acc1, acc2 = _acc_dot(a2, b0, acc, acc1, acc2, I20)
            if PB > 2:
                acc, acc1, acc2 = _acc_dot(a0, b2, acc, acc1, acc2, I02)
        if PA > 1:
            acc, acc1, acc2 = _acc_dot(a1, b0, acc, acc1, acc2, I10)
        if PB > 1:
            acc, acc1, acc2 = _acc_dot(a0, b1, acc, acc1, acc2, I01)
        acc = dot_f32acc(a0, b0, acc)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    if NACC == 3:
        acc = acc2 + acc1 + acc
    elif NACC == 2:
        acc = acc1 + acc
    c_ptrs = (c_ptr + pid_s.to(tl.int64) * s_cs + rm[:, None].to(tl.int64) * s_cm
              + rn[None, :].to(tl.int64) * s_cn)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, out_ptr, n, S: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = p[0, i] + p[1, i] + ... + p[S-1, i]`` in that order (deterministic); the
    ``S`` loads unrolled, so that all of them are in flight at once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = p_ptr + offs
    acc = tl.load(p, mask=mask, other=0.0)
    for _ in tl.static_range(1, S):
        p += n
        acc += tl.load(p, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


#: Split K over programs when there are at most ``sms / 2`` output tiles and
#: ``K >= SPLIT_K_MIN_K`` (each split keeps at least ``SPLIT_K_MIN_K / 2`` of K).
SPLIT_K_MIN_K = 2048
#: Launch config per role (``"fwd"``, ``"dx"``, ``"dw"``): ``None`` for the heuristic of
#: :func:`_mm_config`, or ``(BM, BN, BK, num_warps, num_stages, split_k)``.
CONFIG: dict = {"fwd": None, "dx": None, "dw": None}
#: One fp32 accumulator per part product when there are at most 3 (fwd: ``x*w_lo``,
#: ``x*w_mid``, ``x*w_hi``; dW) and they fit in registers, so the dots of one K step do
#: not wait for each other (False: one accumulator, chained dots; Triton 3.6 then waits
#: for each dot's wgmmas before the next dot).
MULTI_ACC = True
_MM_CFG: dict = {}


def _mm_config(M: int, N: int, K: int, pa: int, pb: int, dev) -> tuple:
    """``(BM, BN, BK, num_warps, num_stages, split_k)`` for ``[M, K] @ [K, N]`` with
    ``pa``/``pb`` bf16 parts loaded per operand (cached per shape)."""
    key = (M, N, K, pa, pb, dev)
    cfg = _MM_CFG.get(key)
    if cfg is not None:
        return cfg
    if INTERPRET:
        BM, BN, BK, nw, ns, sms = 32, 32, 32, 4, 1, 8
    else:
        sms = num_sms(dev)
        BM = 128 if M > 64 else max(16, next_power_of_2(M))
        BN = 128 if N > 64 else max(16, next_power_of_2(N))
        BK, nw = 64, 8
        # bf16 stages of (BM * pa + BN * pb) x BK: at most ~200 KB of shared memory in all
        stage = (BM * pa + BN * pb) * BK * 2
        ns = max(2, min(4, (200 * 1024) // stage))
        if K <= 4 * BK:
            # short K (dx = dlogits @ W, K = E): fewer stages, so that two programs share
            # an SM and one's epilogue overlaps the other's loads
            ns = min(ns, max(2, cdiv(K, BK) - 1))
    tiles = cdiv(M, BM) * cdiv(N, BN)
    split_k = 1
    if 2 * tiles <= sms and K >= SPLIT_K_MIN_K:
        # few output tiles (dW = dlogits^T @ x: [E, K] over T): one wave of programs over
        # K chunks; the fp32 partials are summed in a second, deterministic pass
        split_k = max(1, min(sms // tiles, 2 * K // SPLIT_K_MIN_K))
    cfg = (BM, BN, BK, nw, ns, split_k)
    _MM_CFG[key] = cfg
    return cfg


def matmul_parts(ap: torch.Tensor, bp: torch.Tensor, out_dtype: torch.dtype, order: int, *,
                 config: tuple | None = None) -> torch.Tensor:
    """``sum_{i + j <= order} ap[i] @ bp[j]`` -> ``[M, N]`` contiguous ``out_dtype``.

    ``ap [PA, M, K]`` and ``bp [PB, K, N]``: bf16 parts (:func:`split_parts`; any strides
    within a part, parts ``stride(0)`` apart). ``config``: ``(BM, BN, BK, num_warps,
    num_stages, split_k)``, default :func:`_mm_config`; ``split_k > 1`` writes fp32
    partials over K chunks and sums them in a fixed order (deterministic)."""
    PA, M, K = ap.shape
    PB, _, N = bp.shape
    pa, pb = min(PA, order + 1), min(PB, order + 1)
    dev = ap.device
    BM, BN, BK, nw, ns, split_k = config or _mm_config(M, N, K, pa, pb, dev)
    k_per = cdiv(cdiv(K, split_k), BK) * BK if K else BK
    split_k = max(1, cdiv(K, k_per))
    out = empty(M, N, dtype=out_dtype, device=dev)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    c = out if split_k == 1 else empty(split_k, M, N, dtype=torch.float32, device=dev)
    # the part products besides a0*b0, smallest first (the kernel's order)
    terms = [t for t, use in (("11", pa > 1 and pb > 1 and order >= 2), ("20", pa > 2),
                              ("02", pb > 2), ("10", pa > 1), ("01", pb > 1)) if use]
    acc_of = dict.fromkeys(("11", "20", "02", "10", "01"), 0)
    nacc = 1
    if MULTI_ACC and len(terms) <= 2 and BM * BN * (len(terms) + 1) <= 6144 * nw:
        # (at most ~192 accumulator registers per thread: larger tiles spill)
        nacc = len(terms) + 1
        for i, t in enumerate(terms):
            acc_of[t] = nacc - 1 - i
    with device_guard(ap):
        launch(_mm_kernel, (cdiv(M, BM) * cdiv(N, BN), split_k),
               ap, bp, c, M, N, K, ap.stride(1), ap.stride(2), bp.stride(1), bp.stride(2), N, 1,
               ap.stride(0) if pa > 1 else 0, bp.stride(0) if pb > 1 else 0,
               M * N if split_k > 1 else 0, k_per, PA=pa, PB=pb, ORDER=order, BM=BM, BN=BN,
               BK=BK, GROUP_M=8, EVEN_K=K % k_per == 0 and k_per % BK == 0, NACC=nacc,
               I11=acc_of["11"], I20=acc_of["20"], I02=acc_of["02"], I10=acc_of["10"],
               I01=acc_of["01"], num_warps=nw, num_stages=ns)
        if split_k > 1:
            BLOCK = 1024
            launch(_sum_splits_kernel, (cdiv(M * N, BLOCK),), c, out, M * N, split_k,
                   BLOCK=BLOCK, num_warps=4)
    return out


def matmul_exact(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
                 order: int | None = None, split_k: int | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (any strides, bf16/fp16/fp32) -> ``[M, N]`` contiguous
    ``out_dtype``, exact to float32 accuracy without TF32 (module docstring). ``order``
    defaults to 2 for a float32 output and 1 otherwise; ``split_k`` overrides the
    heuristic's K split."""
    if order is None:
        order = 2 if out_dtype == torch.float32 else 1
    ap = split_parts(a, order + 1)
    bp = split_parts(b, order + 1)
    cfg = None
    if split_k is not None:
        PA, M, K = ap.shape
        cfg = _mm_config(M, bp.shape[2], K, min(PA, order + 1), min(bp.shape[0], order + 1),
                         a.device)[:5] + (split_k,)
    return matmul_parts(ap, bp, out_dtype, order, config=cfg)


def weight_parts(weight: torch.Tensor) -> torch.Tensor:
    """The router weight ``[E, K]`` as its bf16 parts ``[P, E, K]`` (:func:`split_parts`):
    made once per forward and saved for the backward's ``dx``."""
    return split_parts(weight)


def router_logits_fwd(x2: torch.Tensor, weight: torch.Tensor,
                      w_parts: torch.Tensor | None = None) -> torch.Tensor:
    """``x2 [T, K] @ weight[E, K]^T`` -> fp32 ``[T, E]`` (fp32-exact). ``w_parts``:
    :func:`weight_parts` of ``weight`` if the caller has it (else split here)."""
    wp = weight_parts(weight) if w_parts is None else w_parts
    return matmul_parts(split_parts(x2), wp.transpose(1, 2), torch.float32, 2,
                        config=CONFIG["fwd"])


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
