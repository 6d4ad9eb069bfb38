"""RMSNorm forward kernels: ``rms_norm`` (optionally fused with a residual add) and
``rms_norm_quant`` (RMSNorm fused with 1x128 FP8 quantization, rowwise + columnwise).

Launchers take 2-D ``[M, K]`` views with a contiguous last dim and return raw tensors;
validation and autograd live in ``linghe.functional.norm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.quantize import BLOCK, empty_1x128, quant_cols, quant_rows
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
                         SINGLE: tl.constexpr, HAS_RES: tl.constexpr,
                         STORE_Y: tl.constexpr = True):
    """Persistent over row blocks of ``BM`` rows; ``y``/``h`` are contiguous ``[M, K]``.
    ``STORE_Y=False`` only computes ``rstd`` (first kernel of the two-kernel quant)."""
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
            if STORE_Y:
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
            if STORE_Y:
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
                                  BK: tl.constexpr, HAS_RES: tl.constexpr,
                                  STORE_Y: tl.constexpr):
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
        if STORE_Y:
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


def _launch_fwd(x, r, weight, y, h, rstd, M, K, eps, *, has_res, store_y):
    bm, bk, single, warps = fwd_config(K)
    per_sm = FWD_PROGRAMS_PER_SM if single else FWD_PROGRAMS_PER_SM_MULTI
    grid = (min(cdiv(M, bm), num_sms(x.device) * per_sm),)
    args = (x, r, weight, y, h, rstd, M, K, x.stride(0), r.stride(0), float(eps))
    if single and FWD_PREFETCH and K >= FWD_PREFETCH_MIN_K:
        launch(_rms_norm_fwd_prefetch_kernel, grid, *args, BM=bm, BK=bk, HAS_RES=has_res,
               STORE_Y=store_y, num_warps=warps)
    else:
        launch(_rms_norm_fwd_kernel, grid, *args, BM=bm, BK=bk, SINGLE=single, HAS_RES=has_res,
               STORE_Y=store_y, num_warps=warps)


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
                    has_res=residual is not None, store_y=True)
    return y, h, rstd


# --------------------------------------------------------------------------------------
# RMSNorm + 1x128 FP8 quantization
# --------------------------------------------------------------------------------------
#
# Design: the columnwise copy needs groups of 128 *tokens*, so a program owns a slab of
# BM = 128 rows (32 without the columnwise copy). Pass 1 walks the slab's columns in
# [BM, P1_BK] tiles accumulating the sum of squares -> rstd per row (one HBM read of x).
# Pass 2 walks the column blocks again (the slab was just read, so these loads hit L2),
# normalizes in fp32 and quantizes each [BM, 128] tile rowwise (quant_rows) and
# columnwise (quant_cols) from the same fp32 values; the bf16 normalized output is never
# written. With few slabs (M/128 < #SMs) the grid's second axis splits pass 2's column
# blocks over SPLIT programs per slab; each of them repeats pass 1 (adjacent programs read
# the same slab at the same time, so the repeats mostly hit L2).
#
# A slab kernel has only M/128 programs (64 at M = 8192), which may leave an H200
# latency-bound, so there is a second mode, "two_kernel": the rms_norm kernel computes
# rstd [M] alone (full parallelism, one read of x), then the same quant kernel with
# RSTD_IN runs one program per [128 rows, 128 cols] tile (like quantize_1x128), re-reading
# x (L2-hot when x fits in L2: 32 MB at [8192, 2048] bf16). QUANT_MODE picks: "slab",
# "two_kernel", or "auto" (two_kernel when slabs * QUANT_MAX_SPLIT < #SMs). Both modes
# give identical results up to rstd's summation order. Measured on an H200 (M = 8192,
# K = 2048 / 4096 / 8192): two_kernel with 4 warps per tile 40.7 / 75.0 / 140.8 µs, the
# best slab configuration 54.5 / 105.5 / 203.2 µs, so two_kernel is the default.


@triton.jit
def _rms_norm_quant_kernel(x_ptr, w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, rstd_ptr, M, K,
                           stride_x, eps, BM: tl.constexpr, P1_BK: tl.constexpr,
                           COLWISE: tl.constexpr, POW2: tl.constexpr,
                           RSTD_IN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    nsplit = tl.num_programs(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < M
    cols0 = tl.arange(0, 128)
    if RSTD_IN:
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    else:
        colsp = tl.arange(0, P1_BK)
        acc = tl.zeros([BM], tl.float32)
        for k0 in range(0, K, P1_BK):
            cols = k0 + colsp
            mask = rmask[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            acc += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(acc / K + eps)
        if pid_s == 0:
            tl.store(rstd_ptr + rows, rstd, mask=rmask)
    nkb = tl.cdiv(K, 128)
    nmb = tl.cdiv(M, 128)
    for kb in range(pid_s, nkb, nsplit):
        cols = kb * 128 + cols0
        cmask = cols < K
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        q, s = quant_rows(y, POW2)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * nkb + kb, s, mask=rmask)
        if COLWISE:
            qt, st = quant_cols(y, POW2)
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(qt),
                     mask=cmask[:, None] & rmask[None, :])
            tl.store(st_ptr + cols * nmb + pid_m, st, mask=cmask)


#: Tuning knobs of rms_norm_quant: mode ("auto", "slab", "two_kernel"), most programs
#: per slab (each repeats pass 1, so more than 2 costs L2 bandwidth), pass-1 column
#: chunk, warps.
QUANT_MODE = "two_kernel"
QUANT_MAX_SPLIT = 2
QUANT_WARPS_TILE = 4
QUANT_P1_BK = 256
QUANT_WARPS_COLWISE = 16
QUANT_WARPS_ROWWISE = 4


def quant_split(M: int, K: int, bm: int, device: torch.device) -> int:
    """Programs per slab: split pass 2's column blocks when there are fewer slabs than
    SMs (M = 8192 gives 64 slabs of 128 rows)."""
    slabs = cdiv(M, bm)
    nkb = cdiv(K, BLOCK)
    want = cdiv(num_sms(device), max(slabs, 1))
    return max(1, min(nkb, want, QUANT_MAX_SPLIT))


def quant_mode(M: int, bm: int, device: torch.device) -> str:
    """``"slab"`` or ``"two_kernel"`` (see the design note above; knob ``QUANT_MODE``)."""
    if QUANT_MODE != "auto":
        return QUANT_MODE
    return "two_kernel" if cdiv(M, bm) * QUANT_MAX_SPLIT < num_sms(device) else "slab"


def rms_norm_quant_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       columnwise: bool, pow2_scale: bool):
    """``x [M, K]``, ``weight [K]`` -> ``(q, s, q_t, s_t, rstd)`` (1x128 layout of
    ``linghe.fp8``; ``q_t``/``s_t`` are ``None`` without ``columnwise``)."""
    M, K = x.shape
    q, s, qt, st = empty_1x128(M, K, x.device, rowwise=True, columnwise=columnwise)
    rstd = empty(M, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s, qt, st, rstd
    bm = 128 if columnwise else 32
    mode = quant_mode(M, bm, x.device)
    with device_guard(x):
        if mode == "two_kernel":
            _launch_fwd(x, x, weight, x, x, rstd, M, K, eps, has_res=False, store_y=False)
            grid = (cdiv(M, bm), cdiv(K, BLOCK))
            warps = QUANT_WARPS_TILE if columnwise else QUANT_WARPS_ROWWISE
        else:
            grid = (cdiv(M, bm), quant_split(M, K, bm, x.device))
            warps = QUANT_WARPS_COLWISE if columnwise else QUANT_WARPS_ROWWISE
        launch(_rms_norm_quant_kernel, grid,
            x, weight, q, s, qt if qt is not None else q, st if st is not None else s, rstd,
            M, K, x.stride(0), float(eps), BM=bm, P1_BK=QUANT_P1_BK if columnwise else 128,
            COLWISE=columnwise, POW2=pow2_scale, RSTD_IN=mode == "two_kernel",
            num_warps=warps)
    return q, s, qt, st, rstd


__all__ = ["rms_norm_fwd", "rms_norm_quant_fwd"]
