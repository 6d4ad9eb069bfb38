"""RMSNorm backward: ``dx`` and ``dweight`` from ``x`` (or ``h``), ``weight``, ``rstd``.

One persistent kernel walks row blocks, writes ``dx`` and accumulates each program's
partial ``dweight`` in fp32 (registers, or its own row of the partial buffer for wide
hidden sizes); the last programs to finish then sum the ``[P, K]`` partials in a fixed
order (deterministic) into ``dweight`` in the same launch (``_reduce_dw``; knob
``BWD_FUSED_DW=False``: a second small kernel does it). Shared by ``rms_norm`` and
``rms_norm_quant``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv, device_guard, empty, next_power_of_2, num_sms

#: Widest power-of-two hidden tile kept in registers; wider rows go in MULTI_BK blocks.
MAX_SINGLE_BK = 8192
MULTI_BK = 2048
#: Persistent programs per SM (each writes one fp32 partial dweight row of K floats).
BWD_PROGRAMS_PER_SM = 2
BWD_PROGRAMS_PER_SM_MULTI = 1


def bwd_config(K: int):
    """``(BM, BK, SINGLE, num_warps)`` for hidden size ``K``."""
    bk = max(16, next_power_of_2(K))
    if bk <= MAX_SINGLE_BK:
        bm = max(1, min(32, 4096 // bk))
        warps = 4 if bk * bm <= 2048 else 8
        if bk >= 8192:
            warps = 16
        return bm, bk, True, warps
    return 2, MULTI_BK, False, 8


@triton.jit
def _reduce_dw(dwp_ptr, dw_ptr, cnt_ptr, pid, nprog, K, GS, GSP: tl.constexpr,
               NGP: tl.constexpr, RBK: tl.constexpr, RBK2: tl.constexpr):
    """In-kernel deterministic ``dweight = sum_p partial[p]`` (no second launch).

    Called by every program once its partial row ``partial[pid]`` is stored. Programs
    form groups of ``GS``; the last of a group to finish (atomic ticket on
    ``cnt[1 + group]``) sums the group's rows in order into ``partial[nprog + group]``;
    the last group to finish (ticket on ``cnt[0]``) sums the group rows in order into
    ``dw``. Nobody waits, so there is no deadlock whatever the scheduling. The finishing
    programs reset the counters to 0 for the next launch (launches on one stream are
    ordered; the launcher keeps one counter buffer per stream).
    """
    # Every thread's partial stores precede this program's release (atomic, acq_rel).
    tl.debug_barrier()
    ng = tl.cdiv(nprog, GS)
    grp = pid // GS
    gsize = tl.minimum(GS, nprog - grp * GS)
    ticket = tl.atomic_add(cnt_ptr + 1 + grp, 1)
    if ticket == gsize - 1:
        r = tl.arange(0, GSP)
        rm = r < gsize
        src = dwp_ptr + (grp * GS).to(tl.int64) * K
        dst = dwp_ptr + (nprog + grp).to(tl.int64) * K
        for k0 in range(0, K, RBK):
            cols = k0 + tl.arange(0, RBK)
            cm = cols < K
            v = tl.load(src + r[:, None].to(tl.int64) * K + cols[None, :],
                        mask=rm[:, None] & cm[None, :], other=0.0, cache_modifier=".cg")
            tl.store(dst + cols, tl.sum(v, axis=0), mask=cm)
        tl.store(cnt_ptr + 1 + grp, 0)
        tl.debug_barrier()
        ticket2 = tl.atomic_add(cnt_ptr, 1)
        if ticket2 == ng - 1:
            g = tl.arange(0, NGP)
            gm = g < ng
            gsrc = dwp_ptr + (nprog + g).to(tl.int64)[:, None] * K
            for k0 in range(0, K, RBK2):
                cols = k0 + tl.arange(0, RBK2)
                cm = cols < K
                v = tl.load(gsrc + cols[None, :], mask=gm[:, None] & cm[None, :], other=0.0,
                            cache_modifier=".cg")
                tl.store(dw_ptr + cols, tl.sum(v, axis=0).to(dw_ptr.dtype.element_ty),
                         mask=cm)
            tl.store(cnt_ptr, 0)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dh_ptr, dx_ptr, dwp_ptr, M, K,
                         stride_x, stride_dy, stride_dh, cnt_ptr, dw_ptr, GS,
                         BM: tl.constexpr, BK: tl.constexpr,
                         SINGLE: tl.constexpr, HAS_DH: tl.constexpr, FUSED: tl.constexpr,
                         GSP: tl.constexpr, NGP: tl.constexpr, RBK: tl.constexpr,
                         RBK2: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblk = tl.cdiv(M, BM)
    cols0 = tl.arange(0, BK)
    dwp_row = dwp_ptr + pid.to(tl.int64) * K
    if SINGLE:
        cmask = cols0 < K
        w = tl.load(w_ptr + cols0, mask=cmask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BK], tl.float32)
    else:
        for k0 in range(0, K, BK):
            cols = k0 + cols0
            tl.store(dwp_row + cols, tl.zeros([BK], tl.float32), mask=cols < K)
        tl.debug_barrier()
    for blk in range(pid, nblk, nprog):
        rows = blk * BM + tl.arange(0, BM).to(tl.int64)
        rmask = rows < M
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        if SINGLE:
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols0[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols0[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            xhat = x * rstd[:, None]
            g = dy * w[None, :]
            c = tl.sum(g * xhat, axis=1) / K
            dx = rstd[:, None] * (g - xhat * c[:, None])
            if HAS_DH:
                dx += tl.load(dh_ptr + rows[:, None] * stride_dh + cols0[None, :], mask=mask,
                              other=0.0).to(tl.float32)
            tl.store(dx_ptr + rows[:, None] * K + cols0[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw_acc += tl.sum(dy * xhat, axis=0)
        else:
            cacc = tl.zeros([BM, BK], tl.float32)
            for k0 in range(0, K, BK):
                cols = k0 + cols0
                cm = cols < K
                mask = rmask[:, None] & cm[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask,
                             other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                cacc += dy * w[None, :] * x
            c = tl.sum(cacc, axis=1) * rstd / K
            for k0 in range(0, K, BK):
                cols = k0 + cols0
                cm = cols < K
                mask = rmask[:, None] & cm[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask,
                             other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                xhat = x * rstd[:, None]
                g = dy * w[None, :]
                dx = rstd[:, None] * (g - xhat * c[:, None])
                if HAS_DH:
                    dx += tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :],
                                  mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + rows[:, None] * K + cols[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                part = tl.load(dwp_row + cols, mask=cm, other=0.0)
                tl.store(dwp_row + cols, part + tl.sum(dy * xhat, axis=0), mask=cm)
            # The next row block reads this partial back, maybe from other threads.
            tl.debug_barrier()
    if SINGLE:
        tl.store(dwp_row + cols0, dw_acc, mask=cmask)
    if FUSED:
        _reduce_dw(dwp_ptr, dw_ptr, cnt_ptr, pid, nprog, K, GS, GSP, NGP, RBK, RBK2)


@triton.jit
def _rms_norm_bwd_prefetch_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dh_ptr, dx_ptr, dwp_ptr,
                                  M, K, stride_x, stride_dy, stride_dh, cnt_ptr, dw_ptr, GS,
                                  BM: tl.constexpr, BK: tl.constexpr, HAS_DH: tl.constexpr,
                                  FUSED: tl.constexpr, GSP: tl.constexpr, NGP: tl.constexpr,
                                  RBK: tl.constexpr, RBK2: tl.constexpr):
    """Single-tile path of :func:`_rms_norm_bwd_kernel` with the next row block's loads
    issued before the current block is reduced."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblk = tl.cdiv(M, BM)
    cols = tl.arange(0, BK)
    cmask = cols < K
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BK], tl.float32)
    rows = pid * BM + tl.arange(0, BM).to(tl.int64)
    mask = (rows < M)[:, None] & cmask[None, :]
    x_raw = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy_raw = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask,
                     other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
    for blk in range(pid, nblk, nprog):
        rows_n = (blk + nprog) * BM + tl.arange(0, BM).to(tl.int64)
        rmask_n = rows_n < M
        mask_n = rmask_n[:, None] & cmask[None, :]
        x_next = tl.load(x_ptr + rows_n[:, None] * stride_x + cols[None, :], mask=mask_n,
                         other=0.0)
        dy_next = tl.load(dy_ptr + rows_n[:, None] * stride_dy + cols[None, :],
                          mask=mask_n, other=0.0)
        rstd_next = tl.load(rstd_ptr + rows_n, mask=rmask_n, other=0.0)
        mask = (rows < M)[:, None] & cmask[None, :]
        x = x_raw.to(tl.float32)
        dy = dy_raw.to(tl.float32)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / K
        dx = rstd[:, None] * (g - xhat * c[:, None])
        if HAS_DH:
            dx += tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * K + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        rows = rows_n
        x_raw = x_next
        dy_raw = dy_next
        rstd = rstd_next
    tl.store(dwp_ptr + pid.to(tl.int64) * K + cols, dw_acc, mask=cmask)
    if FUSED:
        _reduce_dw(dwp_ptr, dw_ptr, cnt_ptr, pid, nprog, K, GS, GSP, NGP, RBK, RBK2)


#: Use the prefetching single-tile kernel (knob for A/B on the GPU).
BWD_PREFETCH = True


@triton.jit
def _sum_rows_kernel(p_ptr, out_ptr, P, K, BP: tl.constexpr, BN: tl.constexpr):
    """``out[k] = sum_p p[p, k]`` in fp32, fixed order."""
    pid = tl.program_id(0)
    cols = pid * BN + tl.arange(0, BN)
    cmask = cols < K
    acc = tl.zeros([BP, BN], tl.float32)
    for p0 in range(0, P, BP):
        prow = p0 + tl.arange(0, BP)
        mask = (prow < P)[:, None] & cmask[None, :]
        acc += tl.load(p_ptr + prow[:, None].to(tl.int64) * K + cols[None, :], mask=mask,
                       other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cmask)


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor, dh: torch.Tensor | None = None, *,
                 need_dweight: bool = True):
    """Gradients of ``y = x * rstd * weight`` (``x`` is the normalized input, i.e. ``h``
    with a residual).

    ``dy``, ``x``, ``dh`` are ``[M, K]`` with contiguous last dims; ``dh`` (optional) is
    an extra gradient added to ``dx`` (the residual stream's). Returns ``(dx [M, K]
    x.dtype, dweight [K] weight.dtype or None)``; ``dweight`` is reduced in fp32.
    """
    M, K = x.shape
    dx = empty(M, K, dtype=x.dtype, device=x.device)
    if M == 0 or K == 0:
        dw = torch.zeros(K, dtype=weight.dtype, device=x.device) if need_dweight else None
        return dx, dw
    key = (M, K, x.device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(M, K, x.device)
    bm, bk, single, warps, P, BN, BP, GS, GSP, NGP, RBK, RBK2 = plan
    fused = need_dweight and BWD_FUSED_DW
    # Fused: rows [P, P + groups) of the partial buffer hold the group sums.
    partial = torch.empty(P + (cdiv(P, GS) if fused else 0), K, dtype=torch.float32,
                          device=x.device)
    dw = empty(K, dtype=weight.dtype, device=x.device) if need_dweight else None
    cnt = _counters(x.device) if fused else None
    d = dh if dh is not None else dy
    with device_guard(x):
        args = (x, weight, rstd, dy, d, dx, partial, M, K, x.stride(0), dy.stride(0),
                d.stride(0), cnt, dw, GS)
        if single and BWD_PREFETCH:
            _rms_norm_bwd_prefetch_kernel[(P,)](*args, BM=bm, BK=bk, HAS_DH=dh is not None,
                                                FUSED=fused, GSP=GSP, NGP=NGP, RBK=RBK, RBK2=RBK2,
                                                num_warps=warps)
        else:
            _rms_norm_bwd_kernel[(P,)](*args, BM=bm, BK=bk, SINGLE=single,
                                       HAS_DH=dh is not None, FUSED=fused, GSP=GSP,
                                       NGP=NGP, RBK=RBK, RBK2=RBK2, num_warps=warps)
        if need_dweight and not fused:
            _sum_rows_kernel[(cdiv(K, BN),)](partial, dw, P, K, BP=BP, BN=BN, num_warps=4)
    return dx, dw


#: Launch plans per (M, K, device): the per-call host work is a dict lookup.
_PLANS: dict = {}


def _plan(M: int, K: int, device: torch.device):
    bm, bk, single, warps = bwd_config(K)
    P = min(cdiv(M, bm), num_sms(device) * (BWD_PROGRAMS_PER_SM if single
                                            else BWD_PROGRAMS_PER_SM_MULTI))
    BN = 32 if K <= 4096 else 128
    BP = min(64, max(8, next_power_of_2(P)))
    # Fused dweight reduction: ~sqrt(P) programs per group, at most MAX_GROUPS groups.
    GS = max(RED_GROUP, cdiv(P, MAX_GROUPS))
    GSP = max(2, next_power_of_2(GS))
    NGP = max(2, next_power_of_2(cdiv(P, GS)))
    # Column chunks of the two reduction levels: [GSP, RBK] and [NGP, RBK2] tiles of
    # 64 fp32 per thread (few, large loads: the reduction is the kernel's serial tail).
    cap = 2048 * warps
    RBK = max(16, min(RED_BK, bk, cap // GSP))
    RBK2 = max(16, min(RED_BK, bk, cap // NGP))
    return bm, bk, single, warps, P, BN, BP, GS, GSP, NGP, RBK, RBK2


#: Reduce dweight inside the backward kernel (last-finisher tickets; one launch instead of
#: two). False: a second kernel sums the partials (same values up to summation order).
BWD_FUSED_DW = True
#: Programs per group of the fused reduction, most groups, column chunk of its loads.
RED_GROUP = 16
MAX_GROUPS = 64
RED_BK = 4096
#: One int32 counter buffer [1 + MAX_GROUPS] per (device, stream), zero between launches.
_COUNTERS: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    else:
        key = (device.type, 0)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(1 + MAX_GROUPS, dtype=torch.int32, device=device)
    return c


__all__ = ["rms_norm_bwd"]
