"""RMSNorm forward kernels: ``rms_norm`` (optionally fused with a residual add) and
``rms_norm_quant`` (RMSNorm fused with 1x128 FP8 quantization, rowwise + columnwise).

Launchers take 2-D ``[M, K]`` views with a contiguous last dim and return raw tensors;
validation and autograd live in ``linghe.functional.norm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.quantize import empty_1x128, launch_1x128_rows, launch_1x128_tiles
from ..utils import cdiv, device_guard, empty, launch, next_power_of_2, num_sms

#: Largest power-of-two hidden tile held in registers in one piece; wider rows are
#: processed in MULTI_BK column blocks (two passes: sum of squares, then normalize; the
#: second pass re-reads the row block while it is still in L1/L2).
MAX_SINGLE_BK = 8192
#: Column block of the multi-pass path.
MULTI_BK = 4096
#: Persistent grid size of rms_norm: programs per SM (single-tile / multi-pass rows).
FWD_PROGRAMS_PER_SM = 8
FWD_PROGRAMS_PER_SM_MULTI = 4


def fwd_config(K: int):
    """``(BM rows per tile, BK column tile, SINGLE, num_warps)`` for hidden size ``K``."""
    bk = max(16, next_power_of_2(K))
    if bk <= MAX_SINGLE_BK:
        bm = max(1, min(64, 8192 // bk))
        warps = 4 if bk * bm <= 2048 else 8
        if bk >= 8192:
            warps = 16
        return bm, bk, True, warps
    return 2, MULTI_BK, False, 8


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, M, K, stride_x,
                         stride_r, eps, BM: tl.constexpr, BK: tl.constexpr,
                         SINGLE: tl.constexpr, HAS_RES: tl.constexpr):
    """Persistent over row blocks of ``BM`` rows; ``y``/``h`` are contiguous ``[M, K]``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblk = tl.cdiv(M, BM)
    cols0 = tl.arange(0, BK)
    if SINGLE:
        cmask = cols0 < K
        w = tl.load(w_ptr + cols0, mask=cmask, other=0.0).to(tl.float32)
    for blk in range(pid, nblk, nprog):
        rows = blk * BM + tl.arange(0, BM).to(tl.int64)
        rmask = rows < M
        if SINGLE:
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols0[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_ptr + rows[:, None] * stride_r + cols0[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                h = (x + r).to(h_ptr.dtype.element_ty)
                tl.store(h_ptr + rows[:, None] * K + cols0[None, :], h, mask=mask)
                x = h.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
            tl.store(rstd_ptr + rows, rstd, mask=rmask)
            y = x * rstd[:, None] * w[None, :]
            tl.store(y_ptr + rows[:, None] * K + cols0[None, :],
                     y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            # Pass 1: sum of squares over column blocks (and h = x + r written once).
            acc = tl.zeros([BM, BK], tl.float32)
            for k0 in range(0, K, BK):
                cols = k0 + cols0
                mask = rmask[:, None] & (cols < K)[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                if HAS_RES:
                    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask,
                                other=0.0).to(tl.float32)
                    h = (x + r).to(h_ptr.dtype.element_ty)
                    tl.store(h_ptr + rows[:, None] * K + cols[None, :], h, mask=mask)
                    x = h.to(tl.float32)
                acc += x * x
            rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / K + eps)
            tl.store(rstd_ptr + rows, rstd, mask=rmask)
            if HAS_RES:
                tl.debug_barrier()  # pass 2 re-reads h, possibly from other threads
            # Pass 2: normalize (the row block was just read: L2-hot).
            for k0 in range(0, K, BK):
                cols = k0 + cols0
                cm = cols < K
                mask = rmask[:, None] & cm[None, :]
                if HAS_RES:
                    x = tl.load(h_ptr + rows[:, None] * K + cols[None, :], mask=mask,
                                other=0.0).to(tl.float32)
                else:
                    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                                other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                y = x * rstd[:, None] * w[None, :]
                tl.store(y_ptr + rows[:, None] * K + cols[None, :],
                         y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fwd_prefetch_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, M, K,
                                  stride_x, stride_r, eps, BM: tl.constexpr,
                                  BK: tl.constexpr, HAS_RES: tl.constexpr):
    """Single-tile path of :func:`_rms_norm_fwd_kernel` with the next row block's loads
    issued before the current block is reduced (twice the bytes in flight)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblk = tl.cdiv(M, BM)
    cols = tl.arange(0, BK)
    cmask = cols < K
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    rows = pid * BM + tl.arange(0, BM).to(tl.int64)
    mask = (rows < M)[:, None] & cmask[None, :]
    x_raw = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r_raw = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask,
                        other=0.0)
    for blk in range(pid, nblk, nprog):
        rows_n = (blk + nprog) * BM + tl.arange(0, BM).to(tl.int64)
        mask_n = (rows_n < M)[:, None] & cmask[None, :]
        x_next = tl.load(x_ptr + rows_n[:, None] * stride_x + cols[None, :], mask=mask_n,
                         other=0.0)
        if HAS_RES:
            r_next = tl.load(r_ptr + rows_n[:, None] * stride_r + cols[None, :],
                             mask=mask_n, other=0.0)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        x = x_raw.to(tl.float32)
        if HAS_RES:
            h = (x + r_raw.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + rows[:, None] * K + cols[None, :], h, mask=mask)
            x = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + rows[:, None] * K + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)
        rows = rows_n
        x_raw = x_next
        if HAS_RES:
            r_raw = r_next


#: Use the prefetching single-tile kernel from this hidden size up (H200 sweep: at K = 2048
#: the plain kernel is faster, 19.3 vs 21.0 µs; from K = 4096 the prefetching one, by 1-12%).
FWD_PREFETCH = True
FWD_PREFETCH_MIN_K = 4096


def _launch_fwd(x, r, weight, y, h, rstd, M, K, eps, *, has_res):
    bm, bk, single, warps = fwd_config(K)
    per_sm = FWD_PROGRAMS_PER_SM if single else FWD_PROGRAMS_PER_SM_MULTI
    grid = (min(cdiv(M, bm), num_sms(x.device) * per_sm),)
    args = (x, r, weight, y, h, rstd, M, K, x.stride(0), r.stride(0), float(eps))
    if single and FWD_PREFETCH and K >= FWD_PREFETCH_MIN_K:
        launch(_rms_norm_fwd_prefetch_kernel, grid, *args, BM=bm, BK=bk, HAS_RES=has_res,
               num_warps=warps)
    else:
        launch(_rms_norm_fwd_kernel, grid, *args, BM=bm, BK=bk, SINGLE=single, HAS_RES=has_res,
               num_warps=warps)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """``x [M, K]`` (last dim contiguous), ``weight [K]``, optional ``residual [M, K]``.

    Returns ``(y [M, K] x.dtype, h [M, K] or None, rstd [M] float32)`` where
    ``h = x + residual`` (rounded to x's dtype) is what was normalized.
    """
    M, K = x.shape
    y = empty(M, K, dtype=x.dtype, device=x.device)
    h = empty(M, K, dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = empty(M, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return y, h, rstd
    r = residual if residual is not None else x
    with device_guard(x):
        _launch_fwd(x, r, weight, y, h if h is not None else y, rstd, M, K, eps,
                    has_res=residual is not None)
    return y, h, rstd


# --------------------------------------------------------------------------------------
# RMSNorm + 1x128 FP8 quantization
# --------------------------------------------------------------------------------------
#
# Two kernels of linghe.fp8.quantize, each with an RMSNorm prologue (one implementation of
# the rowwise and of the columnwise quantization for quantize_1x128 and this op):
#
# 1. the rows kernel (rowwise copy, one pass): a program takes whole rows (up to
#    QUANT_ROWS_CONFIG["max_bk"] columns in registers), computes rstd (stored for the
#    backward), y = x * rstd * w in fp32 and quantizes y in 1x128 groups along the row;
# 2. with the columnwise copy, the tile kernel: [128 tokens, BN columns] tiles of x,
#    scaled by that rstd and w (the same fp32 y), quantized columnwise. It re-reads x, by
#    default in reverse tile order, row block by row block (k_fast), so that it starts on
#    the rows kernel 1 read last (the likeliest to be still in L2).
#
# QUANT_MODE "rstd_tiles" splits the work the other way: kernel 1 stores rstd only and the
# tile kernel writes both copies. Both modes give identical bits.

#: Tuning knobs of rms_norm_quant (benchmark/probe_tilequant.py sweeps them):
#: QUANT_MODE "rows_cols" or "rstd_tiles" (above); the rows kernel's config
#: (linghe.fp8.quantize.ROWS_CONFIG keys); the tile kernel's configs (TILE_CONFIGS
#: entries) for the columnwise copy / both copies; its tile order.
QUANT_MODE = "rows_cols"
#: (H200, probe_tilequant at [8192, 2048]: 4 warps for the rows kernel, rowwise only 17.8
#: -> 16.9 µs; 64-column tiles for the columnwise copy, row+col 35.8 -> 34.4 µs.)
QUANT_ROWS_CONFIG = dict(rows=4, elems=8192, warps=4, max_bk=8192)
QUANT_TILE_COLS = dict(bm=128, bn=64, warps=4, k_fast=True)
QUANT_TILE_ROWCOL = dict(bm=128, bn=128, warps=4, k_fast=False)
QUANT_TILE_REVERSE = True


def rms_norm_quant_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       columnwise: bool, pow2_scale: bool, group_major_scales: bool = False):
    """``x [M, K]`` (last dim contiguous), ``weight [K]`` -> ``(q, s, q_t, s_t, rstd)``:
    the 1x128 layout of ``linghe.fp8`` (``q [M, K]``, ``s [M, ceil(K/128)]``, ``q_t
    [K, M]``, ``s_t [K, ceil(M/128)]``; ``q_t``/``s_t`` are ``None`` without
    ``columnwise``) of ``y = x * rstd * weight`` (fp32, never written), and ``rstd [M]``
    float32 (saved for the backward). ``group_major_scales``: both scales stored
    group-major (strides ``(1, M)`` / ``(1, K)``, :func:`~linghe.fp8.quantize.empty_1x128`),
    the layout the cuBLAS GEMMs of the FP8 ``Linear`` it feeds read (no copy per GEMM);
    else contiguous."""
    M, K = x.shape
    q, s, qt, st = empty_1x128(M, K, x.device, rowwise=True, columnwise=columnwise,
                               group_major=group_major_scales)
    rstd = empty(M, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s, qt, st, rstd
    both = columnwise and QUANT_MODE == "rstd_tiles"
    launch_1x128_rows(x, None if both else q, None if both else s, QUANT_ROWS_CONFIG,
                      pow2_scale=pow2_scale, weight=weight, rstd=rstd, eps=eps)
    if columnwise:
        launch_1x128_tiles(x, q if both else None, s if both else None, qt, st,
                           QUANT_TILE_ROWCOL if both else QUANT_TILE_COLS,
                           pow2_scale=pow2_scale, weight=weight, rstd=rstd,
                           reverse=QUANT_TILE_REVERSE)
    return q, s, qt, st, rstd


__all__ = ["rms_norm_fwd", "rms_norm_quant_fwd"]
