"""SwiGLU forward kernels: ``silu_mul`` and its fused 1x128 FP8 quantization.

``x [M, 2n]`` holds the gate half first: ``y = silu(x[:, :n]) * x[:, n:]`` (times
``probs[row]`` when given), computed in fp32 registers.

- :func:`silu_mul_fwd`: ``y`` in ``x``'s dtype.
- :func:`silu_mul_quant_fwd`: ``y`` quantized in one pass to 1x128 FP8 (rowwise, and
  columnwise from the same fp32 values); programs take 128 rows x 128 output columns.
- :func:`batch_silu_mul_quant_fwd`: the same for rows grouped by expert
  (:mod:`linghe.layout`): columnwise groups start at each expert segment's start and never
  cross segments. Counts are read on the device (no host sync); the grid is sized by a
  static bound and programs past the rows in use write zeros / scale 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.quantize import FP8_DTYPE, quant_cols, quant_rows
from ..utils import cdiv, device_guard, empty, launch, next_power_of_2

BLOCK = 128

# Launch knobs (GPU performance; semantics do not depend on them).
#: elements of one [BM, BN] tile per program in the plain (non-quantizing) kernels.
TILE_ELEMS = 4096
#: warps of the 128x128-tile quantizing forward kernels. ptxas (sm_90, offline): 8 warps
#: use 128 registers, 4 warps 176 (255 for the batch form), so either way 2 programs fit
#: on an SM; 8 warps give those two tiles twice the warps. (quantize_1x128 prefers 4 warps
#: because its single-input tile needs only 168 registers there: 3 programs per SM.)
QUANT_NUM_WARPS = 8
#: warps of the per-expert (batch) form: measured on an H200 (32 experts, [65536, 2048]),
#: 4 warps 203 µs, 8 warps 284, 16 warps 277 (before :func:`aligned16`, when triton 3.6
#: stored the transposed tile byte by byte; ``benchmark/probe_activation.py`` re-measures).
BATCH_QUANT_NUM_WARPS = 4
#: warps of the quantized-dx backward kernel (more live 128x128 fp32 tiles: g, u, dy):
#: 16 for its non-batch form, 530 against 623 µs with 8 at [69376, 2048] on an H100 (the
#: batch form, when ``QUANT_BWD_MODE = "fused"``, preferred 8: 766 against 848).
QUANT_BWD_NUM_WARPS = 16
#: 128-column blocks that one program of the per-expert (batch) forward takes in turn (a
#: loop): the row tile's :func:`expert_tile` (a load of the counts, two scans and several
#: reductions over ``next_power_of_2(E + 1)`` lanes, all before the data loads can start)
#: is then computed once per that many blocks. 1: one block per program, as before.
#: ``python -m benchmark.probe_activation`` measures the values.
BATCH_QUANT_COLS = 1
#: the same for the quantized-dx backward kernel (both forms; 16 blocks at ``N = 1024``).
QUANT_BWD_COLS = 1
#: the batch (per-expert) quantized-dx backward: ``"two_kernel"`` (``silu_mul_bwd``
#: writes dx in x's dtype, then ``quantize_grouped_fwd`` quantizes it) or ``"fused"``
#: (one kernel). Two kernels move ~1.6x the bytes but both stream at high occupancy,
#: where the fused one holds three 128x128 fp32 tiles in 255 registers, one program per
#: SM, and waits on every tile's loads: on an H100 at the FP8 MoE shape 570 against
#: 766 µs (256 experts) and 496 against 589 (32 experts); software-pipelining the fused
#: kernel's column loop was slower still (884-947 µs),
#: ``benchmark/results/h100_probe_activation_2026-11-25b.*``. The non-batch form is
#: always fused.
QUANT_BWD_MODE = "two_kernel"


@triton.jit
def silu_f32(g):
    """``(silu(g), sigmoid(g))`` for fp32 ``g``."""
    s = 1.0 / (1.0 + tl.exp(-g))
    return g * s, s


@triton.jit
def _add6(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5


@triton.jit
def expert_tile(cnt_ptr, E, R, t, ALIGN, EP2: tl.constexpr):
    """Where 128-row tile ``t`` of a grouped buffer lies (rows grouped by expert).

    Expert ``e`` owns tiles ``[g_off[e], g_off[e+1])`` with ``g_off`` the exclusive cumsum
    of ``cdiv(roundup(count_e, ALIGN), 128)``; tiles from ``g_off[E]`` on cover the tail
    rows ``[offsets[E], R)`` in order. Returns ``(tile_start, real_end, seg_end, g_off
    [EP2] exclusive, g_used, idx, seg_off [EP2] exclusive, used)``: rows ``< real_end``
    are real, rows in ``[real_end, seg_end)`` are padding/tail (zeros); ``seg_off`` are
    the segment offsets and ``used`` = ``offsets[E]``. Negative counts count as 0.

    Every program of a grouped kernel runs this before its data loads can start, so it
    is one scan and one (six-operand) reduction: the experts wholly before tile ``t``
    (``g_end <= t``) give the segment's start, the one expert holding it (``g_start <= t
    < g_end``, none for a tail tile) its count and padded size. (``seg_off``, a second
    scan, is dead code unless the caller uses it.)
    """
    idx = tl.arange(0, EP2)
    emask = idx < E
    c = tl.load(cnt_ptr + idx, mask=emask, other=0).to(tl.int32)
    c = tl.maximum(c, 0)  # lanes >= E: 0, so they add nothing below
    padded = (c + ALIGN - 1) // ALIGN * ALIGN
    ntile = (padded + 127) // 128
    g_end = tl.cumsum(ntile, 0)
    g_start = g_end - ntile
    before = g_end <= t
    this = (g_start <= t) & (g_end > t)
    zero = tl.zeros_like(c)
    seg_start, g_start_e, pad_e, cnt_e, used, g_used = tl.reduce(
        (tl.where(before, padded, zero), tl.where(before, ntile, zero),
         tl.where(this, padded, zero), tl.where(this, c, zero), padded, ntile), 0, _add6)
    is_tail = t >= g_used
    tile_start = tl.where(is_tail, used + (t - g_used) * 128,
                          seg_start + (t - g_start_e) * 128)
    real_end = tl.where(is_tail, 0, seg_start + cnt_e)
    seg_stop = tl.where(is_tail, R, seg_start + pad_e)
    seg_off = tl.cumsum(padded, 0) - padded
    return tile_start, real_end, seg_stop, g_start, g_used, idx, seg_off, used


@triton.jit
def aligned16(tile_start, seg_stop):
    """:func:`expert_tile`'s ``(tile_start, seg_stop)`` when ``ALIGN % 16 == 0``, written
    so that the compiler sees both are multiples of 16 (same values: segment starts and
    ends are multiples of ``ALIGN``; a tail tile's ``seg_stop = R`` is rounded up to one,
    which the caller's ``rows < R`` mask covers). A 128-row tile's transposed
    (row-contiguous) fp8 store is then a 16-byte vector store, and so is its mask.
    ``tl.multiple_of`` on these scalars is not enough: triton 3.6 (sm_90, offline) drops the
    hint and, without ``seg_stop``'s, cannot prove the mask constant over 16 rows: it emits
    64 single-byte stores per thread for the backward tile and spills (120 B of stack)."""
    return tile_start // 16 * 16, (seg_stop + 15) // 16 * 16


@triton.jit
def rows_valid(cnt_ptr, E, rows, ALIGN, EP2: tl.constexpr):
    """``[BM]`` bool: which ``rows`` are real rows of some expert segment (not padding or
    tail) in a grouped buffer with per-expert ``counts`` padded to ``ALIGN``."""
    idx = tl.arange(0, EP2)
    emask = idx < E
    c = tl.load(cnt_ptr + idx, mask=emask, other=0).to(tl.int32)
    c = tl.maximum(c, 0)
    padded = (c + ALIGN - 1) // ALIGN * ALIGN
    start = tl.cumsum(padded, 0) - padded
    r = rows[:, None]
    inseg = (r >= start[None, :]) & (r < (start + c)[None, :]) & emask[None, :]
    return tl.sum(inseg.to(tl.int32), 1) > 0


@triton.jit
def _silu_mul_fwd_kernel(x_ptr, p_ptr, y_ptr, M, N, stride_x, stride_y,
                         BM: tl.constexpr, BN: tl.constexpr, HAS_P: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    xp = x_ptr + rows[:, None] * stride_x + cols[None, :]
    g = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(xp + N, mask=mask, other=0.0).to(tl.float32)
    silu, _ = silu_f32(g)
    y = silu * u
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        y = y * p[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _quant_fwd_block(pid_m, pid_n, rows, lmask, smask, p, x_ptr, q_ptr, s_ptr, qt_ptr,
                     st_ptr, M, N, stride_x, NG, BM: tl.constexpr, COLWISE: tl.constexpr,
                     POW2: tl.constexpr, HAS_P: tl.constexpr):
    """One [BM, 128] output block (columns ``pid_n * 128 ..``) of the quantizing forward."""
    cols = pid_n * 128 + tl.arange(0, 128)
    cmask = cols < N
    mask = lmask[:, None] & cmask[None, :]
    xp = x_ptr + rows[:, None] * stride_x + cols[None, :]
    g = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(xp + N, mask=mask, other=0.0).to(tl.float32)
    silu, _ = silu_f32(g)
    y = silu * u
    if HAS_P:
        y = y * p[:, None]
    q, s = quant_rows(y, POW2)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q,
             mask=smask[:, None] & cmask[None, :])
    nvalid = (tl.zeros([BM], tl.int32) + pid_n * 128) < N  # False only when N == 0
    tl.store(s_ptr + rows * tl.cdiv(N, 128) + pid_n, s, mask=smask & nvalid)
    if COLWISE:
        qt, st = quant_cols(y, POW2)
        # qt[c, m] = quant(y)[m, c]: stored through transposed addresses.
        tl.store(qt_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], qt,
                 mask=smask[:, None] & cmask[None, :])
        tl.store(st_ptr + cols.to(tl.int64) * NG + pid_m, st, mask=cmask)


@triton.jit
def _silu_mul_quant_fwd_kernel(x_ptr, p_ptr, cnt_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, goff_ptr,
                               M, N, E, stride_x, ALIGN, NG,
                               BM: tl.constexpr, COLWISE: tl.constexpr, POW2: tl.constexpr,
                               HAS_P: tl.constexpr, BATCH: tl.constexpr, EP2: tl.constexpr,
                               ALIGN16: tl.constexpr, NCOL: tl.constexpr):
    # Program (pid_m, pid_c) takes the row tile pid_m and the 128-column blocks
    # [pid_c * NCOL, pid_c * NCOL + NCOL) of the output, in turn.
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    if BATCH:
        tile_start, real_end, seg_stop, g_off, g_used, eidx, seg_off, used = expert_tile(
            cnt_ptr, E, M, pid_m, ALIGN, EP2)
        # Program (0, 0) publishes the per-expert columnwise group offsets [E + 1] and,
        # in the next E + 1 entries, the segment offsets that the groups follow.
        # (EP2 > E, so entry E fits in the same vector.)
        first = (eidx * 0 + pid_m + pid_c) == 0
        tl.store(goff_ptr + eidx, tl.where(eidx < E, g_off, g_used), mask=(eidx <= E) & first)
        tl.store(goff_ptr + E + 1 + eidx, tl.where(eidx < E, seg_off, used),
                 mask=(eidx <= E) & first)
        if ALIGN16:
            # Segment starts are multiples of ALIGN (a multiple of 16): show the compiler,
            # so that the transposed (row-contiguous) fp8 stores are 16-byte vectors.
            tile_start, seg_stop = aligned16(tile_start, seg_stop)
        rows = tile_start.to(tl.int64) + tl.arange(0, BM)
        smask = (rows < seg_stop) & (rows < M)   # rows this program writes
        lmask = (rows < real_end) & smask        # rows it reads (real rows)
    else:
        rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        smask = rows < M
        lmask = smask
    p = tl.zeros([BM], tl.float32)
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=lmask, other=0.0).to(tl.float32)
    if NCOL == 1:
        _quant_fwd_block(pid_m, pid_c, rows, lmask, smask, p, x_ptr, q_ptr, s_ptr, qt_ptr,
                         st_ptr, M, N, stride_x, NG, BM, COLWISE, POW2, HAS_P)
    else:
        n0 = pid_c * NCOL
        for pid_n in tl.range(n0, tl.minimum(n0 + NCOL, tl.cdiv(N, 128)), num_stages=1):
            _quant_fwd_block(pid_m, pid_n, rows, lmask, smask, p, x_ptr, q_ptr, s_ptr,
                             qt_ptr, st_ptr, M, N, stride_x, NG, BM, COLWISE, POW2, HAS_P)


_TILE_CONFIGS: dict = {}


def tile_config(M: int, N: int):
    """``(BM, BN, num_warps)`` for the plain kernels over ``[M, N]`` outputs (cached per
    shape: the per-call host work is a dict lookup)."""
    cfg = _TILE_CONFIGS.get((M, N))
    if cfg is None:
        BN = min(next_power_of_2(N), 1024)
        BM = max(1, min(max(TILE_ELEMS // BN, 1), next_power_of_2(M)))
        cfg = _TILE_CONFIGS[(M, N)] = (BM, BN, (4 if BM * BN <= 4096 else 8))
    return cfg


def silu_mul_fwd(x: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """``x [M, 2N]`` (last dim contiguous), ``probs [M]`` or None → ``y [M, N]``, x's dtype."""
    M, N = x.shape[0], x.shape[1] // 2
    y = empty(M, N, dtype=x.dtype, device=x.device)
    if M > 0 and N > 0:
        BM, BN, warps = tile_config(M, N)
        with device_guard(x):
            launch(_silu_mul_fwd_kernel, (cdiv(M, BM), cdiv(N, BN)),
                x, probs, y, M, N, x.stride(0), y.stride(0), BM=BM, BN=BN,
                HAS_P=probs is not None, num_warps=warps)
    return y


def silu_mul_quant_fwd(x: torch.Tensor, probs: torch.Tensor | None, *, columnwise: bool,
                       pow2_scale: bool):
    """Fused SwiGLU + 1x128 quantization of ``x [M, 2N]``.

    Returns ``(q [M, N], s [M, cdiv(N,128)], qt [N, M] | None, st [N, cdiv(M,128)] | None)``.
    """
    M, N = x.shape[0], x.shape[1] // 2
    dev = x.device
    q = empty(M, N, dtype=FP8_DTYPE, device=dev)
    s = empty(M, cdiv(N, BLOCK), dtype=torch.float32, device=dev)
    qt = st = None
    if columnwise:
        qt = empty(N, M, dtype=FP8_DTYPE, device=dev)
        st = empty(N, cdiv(M, BLOCK), dtype=torch.float32, device=dev)
    if M > 0 and N > 0:
        BM = 128 if columnwise else 32
        with device_guard(x):
            launch(_silu_mul_quant_fwd_kernel, (cdiv(M, BM), cdiv(N, BLOCK)),
                x, probs, None, q, s, qt, st, None, M, N, 0, x.stride(0), 1,
                cdiv(M, BLOCK), BM=BM, COLWISE=columnwise, POW2=pow2_scale,
                HAS_P=probs is not None, BATCH=False, EP2=1, ALIGN16=False, NCOL=1,
                num_warps=QUANT_NUM_WARPS if columnwise else 4)
    return q, s, qt, st


def batch_col_groups(num_rows: int, num_experts: int) -> int:
    """Static bound ``G = cdiv(num_rows, 128) + num_experts`` on the columnwise groups of a
    grouped buffer (each expert adds at most one partial group)."""
    return cdiv(num_rows, BLOCK) + num_experts


def batch_silu_mul_quant_fwd(x: torch.Tensor, probs: torch.Tensor | None,
                             counts: torch.Tensor, align: int, *, columnwise: bool,
                             pow2_scale: bool):
    """Fused SwiGLU + 1x128 quantization of rows grouped by expert.

    ``x [R, 2N]``, ``probs [R]`` or None, ``counts [E]`` int32/int64 (device). Returns
    ``(q [R, N], s [R, cdiv(N,128)], qt [N, R] | None, st [N, G] | None, g_off [E+1] int32,
    seg_off [E+1] int32)`` with ``G = cdiv(R,128) + E``; expert ``e``'s columnwise groups
    are columns ``[g_off[e], g_off[e+1])`` of ``st`` and start at row ``seg_off[e]`` (the
    segment offsets); columns from ``g_off[E]`` on hold the tail rows' groups (zeros) and
    then unused groups, all with scale 1.
    """
    R, N = x.shape[0], x.shape[1] // 2
    E = counts.numel()
    dev = x.device
    G = batch_col_groups(R, E)
    q = empty(R, N, dtype=FP8_DTYPE, device=dev)
    s = empty(R, cdiv(N, BLOCK), dtype=torch.float32, device=dev)
    qt = st = None
    if columnwise:
        qt = empty(N, R, dtype=FP8_DTYPE, device=dev)
        st = empty(N, G, dtype=torch.float32, device=dev)
    offs = empty(2, E + 1, dtype=torch.int32, device=dev)  # g_off, seg_off: one allocation
    g_off = offs[0]
    # N == 0 still runs one column of programs so that g_off is written.
    ncol = max(BATCH_QUANT_COLS, 1)
    with device_guard(x):
        launch(_silu_mul_quant_fwd_kernel, (G, max(cdiv(cdiv(N, BLOCK), ncol), 1)),
            x, probs, counts, q, s, qt, st, g_off, R, N, E, x.stride(0), align, G,
            BM=BLOCK, COLWISE=columnwise, POW2=pow2_scale, HAS_P=probs is not None,
            BATCH=True, EP2=next_power_of_2(E + 1), ALIGN16=align % 16 == 0, NCOL=ncol,
            num_warps=BATCH_QUANT_NUM_WARPS)
    return q, s, qt, st, g_off, offs[1]
