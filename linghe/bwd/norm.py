"""RMSNorm backward: ``dx`` and ``dweight`` from ``x`` (or ``h``), ``weight``, ``rstd``.

One persistent kernel walks row blocks, writes ``dx`` and accumulates each program's
partial ``dweight`` in fp32 (registers, or its own row of the partial buffer for wide
hidden sizes); a second small kernel sums the ``[P, K]`` partials in a fixed order
(deterministic) into ``dweight``. Shared by ``rms_norm`` and ``rms_norm_quant``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv, device_guard, empty, launch, next_power_of_2, num_sms

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
def _rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dh_ptr, dx_ptr, dwp_ptr, M, K,
                         stride_x, stride_dy, stride_dh, BM: tl.constexpr, BK: tl.constexpr,
                         SINGLE: tl.constexpr, HAS_DH: tl.constexpr):
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


@triton.jit
def _rms_norm_bwd_prefetch_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dh_ptr, dx_ptr, dwp_ptr,
                                  M, K, stride_x, stride_dy, stride_dh, BM: tl.constexpr,
                                  BK: tl.constexpr, HAS_DH: tl.constexpr):
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
    bm, bk, single, warps = bwd_config(K)
    nblk = cdiv(M, bm)
    P = min(nblk, num_sms(x.device) * (BWD_PROGRAMS_PER_SM if single
                                       else BWD_PROGRAMS_PER_SM_MULTI))
    partial = torch.empty(P, K, dtype=torch.float32, device=x.device)
    d = dh if dh is not None else dy
    with device_guard(x):
        args = (x, weight, rstd, dy, d, dx, partial, M, K, x.stride(0), dy.stride(0),
                d.stride(0))
        if single and BWD_PREFETCH:
            launch(_rms_norm_bwd_prefetch_kernel, (P,), *args, BM=bm, BK=bk, HAS_DH=dh is not None,
                   num_warps=warps)
        else:
            launch(_rms_norm_bwd_kernel, (P,), *args, BM=bm, BK=bk, SINGLE=single,
                   HAS_DH=dh is not None, num_warps=warps)
        dw = None
        if need_dweight:
            dw = empty(K, dtype=weight.dtype, device=x.device)
            BN = 32 if K <= 4096 else 128
            BP = min(64, max(8, next_power_of_2(P)))
            launch(_sum_rows_kernel, (cdiv(K, BN),), partial, dw, P, K, BP=BP, BN=BN, num_warps=4)
    return dx, dw


__all__ = ["rms_norm_bwd"]
