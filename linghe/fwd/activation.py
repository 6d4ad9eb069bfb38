"""SwiGLU forward kernels: ``silu_mul`` and its fused 1x128 FP8 quantization.

``x [M, 2n]`` holds the gate half first: ``y = silu(x[:, :n]) * x[:, n:]`` (times
``probs[row]`` when given), computed in fp32 registers.

- :func:`silu_mul_fwd`: ``y`` in ``x``'s dtype.
- :func:`silu_mul_quant_fwd`: ``y`` quantized in one pass to 1x128 FP8 (rowwise, and
  columnwise from the same fp32 values); programs take 128 rows x 128 output columns.
- :func:`batch_silu_mul_quant_fwd`: the same for rows grouped by expert
  (:mod:`linghe.layout`): columnwise groups start at each expert segment's start and never
  cross segments. Counts are read on the device (no host sync): a one-wave launch turns
  them into a row-tile map, then the grid (sized by a static bound) quantizes; programs
  past the rows in use write zeros / scale 1. The columnwise copy leaves as packed 32-bit
  words of 4 tokens (:func:`store_cols_packed`) where ``align`` and the rows are multiples
  of 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.quantize import (
    FP8_DTYPE,
    packed_row_order,
    quant_cols,
    quant_rows,
    store_cols_cvt4,
    store_cols_packed,
)
from ..utils import _INTERPRET_C, cdiv, device_guard, empty, launch, next_power_of_2

BLOCK = 128

# Launch knobs (GPU performance; semantics do not depend on them).
#: elements of one [BM, BN] tile per program in the plain (non-quantizing) kernels.
TILE_ELEMS = 4096
#: warps of the 128x128-tile quantizing forward kernels. ptxas (sm_90, offline): 8 warps
#: use 128 registers, 4 warps 176, so either way 2 programs fit
#: on an SM; 8 warps give those two tiles twice the warps. (quantize_1x128 prefers 4 warps
#: because its single-input tile needs only 168 registers there: 3 programs per SM.)
QUANT_NUM_WARPS = 8
#: warps of the per-expert (batch) forward with both copies, :func:`batch_silu_mul_quant_fwd`
#: (one 128x128 tile per program), and its register cap per thread (``maxnreg``; None:
#: ptxas chooses). A program holds its tile in registers, so these set how many programs
#: share an SM. ptxas (sm_90, probs, pow2 / exact scales; ``python -m
#: benchmark.probe_batch_quant --sass``): the packed store (:data:`BATCH_QUANT_PACK`) at 4
#: warps 177 / 168 registers under triton 3.6 (2 / 3 programs per SM), 231 / 238 under 3.9;
#: capped at 168: 8 bytes of spills (3.6, pow2), none under 3.9; 8 warps 124-128 (2). The
#: unpacked store: 4 warps 180-187 (2). The probe times them against main. H100, before
#: the packed store: 4 warps in ``"rows"`` order 166.6 / 176.7 µs at 32 / 256 experts
#: with pow2 scales (``h100_probe_batch_quant_2026-11-25c.json``), 167.8 without; 8 warps
#: in ``"cols"`` order 1-2% faster with pow2 scales but 229 µs without them. H200: 4 warps
#: 133.3 µs at 32 experts (72.6% of copy), rowwise only 95.0
#: (``h200_probe_batch_quant_2026-11-26.*``). H100 with the packed store
#: (``h100_probe_batch_quant_2026-11-26c.*``; main = before it): capped at 168 registers
#: in ``"cols"`` order (:data:`BATCH_QUANT_ORDER`) is the best or within 3% of it in every
#: case: 32 experts pow2 176.0 (main) -> 161.5 µs, exact 178.8 -> 161.7, 256 experts pow2
#: 200.7 -> 167.5 (83% of copy); uncapped in "rows" order 179.1 / 170.7 / 203.6.
BATCH_QUANT_NUM_WARPS = 4
BATCH_QUANT_MAXNREG = 168
#: warps, register cap and program order (:data:`BATCH_QUANT_ORDER`) of the rowwise-only
#: launch (what the FP8 MoE step calls; the knobs above are the row+columnwise launch's).
#: ptxas (sm_90, triton 3.6): 4 warps 168 registers (3 programs per SM), 8 warps 80 (3).
#: H100: ``"cols"`` order 131.1 -> 119.2 µs at 32 experts (95% of copy; 8 warps 118.8).
BATCH_QUANT_ROW_NUM_WARPS = 4
BATCH_QUANT_ROW_MAXNREG = None
BATCH_QUANT_ROW_ORDER = "cols"
#: the batch forward's columnwise copy leaves as packed 32-bit words
#: (:func:`store_cols_packed`; needs ``align`` and ``R`` multiples of 16, else the plain
#: fp8 store): Triton's layout conversion for the transposed fp8 store writes shared memory
#: a byte at a time (128 8-way bank-conflicted ``STS.U8`` per thread and tile, sm_90,
#: triton 3.6 and 3.9); packed, it is 8 ``stmatrix`` + 8 ``LDS.128``.
BATCH_QUANT_PACK = True
#: with the packed store, build the columnwise words from token-pair casts
#: (:func:`store_cols_cvt4`) instead of Triton's cast of the tile, which pairs two columns
#: of a token and then moves bytes between words. Same bits. H200, E = 32, [65536, 2048],
#: both copies: 130.6 -> 122.1 us (pow2 scales), 130.7 -> 127.7 (exact);
#: ``h200_probe_batch_quant_2026-11-26_s10``. sm_90 SASS (triton 3.6): 3200 -> 2896
#: instructions per tile, spills 8 -> 0 bytes.
BATCH_QUANT_CVT4 = True
#: the batch forward with both copies widens its bf16 inputs by bit operations
#: (:func:`bf16x2_to_f32`: 2 SASS instructions per pair instead of Triton's 3). Same bits.
#: H200, E = 32, both copies: 122.0 -> 117.1 us (pow2), 128.5 -> 116.9 (exact); E = 256
#: 134.1 -> 125.1 (with int32 row offsets); H100 158.9 -> 157.7 (pow2), 161.7 -> 158.2
#: (``h200_probe_batch_quant_isa_2026-11-27_s11``, ``h100_..._not_kept_...``). The
#: rowwise-only launch keeps Triton's cast: with int32 row offsets it was 12-14% slower
#: on the H200 and 4% on the H100 (alone it was not timed).
BATCH_QUANT_BF16_BITS = True
#: the same widening in the rowwise-only launch (off until timed alone on a GPU).
BATCH_QUANT_ROW_BF16_BITS = False
#: warps of the quantized-dx backward kernel (more live 128x128 fp32 tiles: g, u, dy):
#: 16 for its non-batch form, 530 against 623 µs with 8 at [69376, 2048] on an H100 (the
#: batch form, when ``QUANT_BWD_MODE = "fused"``, preferred 8: 766 against 848).
QUANT_BWD_NUM_WARPS = 16
#: 128-column blocks that one program of the per-expert (batch) forward takes in turn (a
#: loop; the program's row tile is looked up once). 1: one block per program.
BATCH_QUANT_COLS = 1
#: the batch forward's program order: ``"rows"`` (consecutive programs take consecutive
#: row tiles of one column block: each qt row is written in long runs) or ``"cols"``
#: (consecutive programs take the column blocks of one row tile: h is read in order).
BATCH_QUANT_ORDER = "cols"
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
def silu_ftz(g):
    """``silu(g) = g * sigmoid(g)`` for fp32 ``g`` with one MUFU op each for the exponential
    and the reciprocal (``ex2.approx.ftz``, ``rcp.approx.ftz``): the same bits as
    :func:`silu_f32`, whose ``tl.exp`` and ``1.0 / x`` (``ex2.approx.f32``,
    ``div.full.f32``) wrap the same MUFU ops in denormal fix-ups (6 instructions each
    instead of 2 on sm_90), except that ``sigmoid(g)`` is flushed to 0 where it is
    denormal: for ``g < -87.3`` silu is ``-0`` here, ``~-1e-36`` there (an exp2 result
    that would be denormal only meets ``1 + e == 1``). The interpreter computes
    :func:`silu_f32`'s formula."""
    if _INTERPRET_C:
        s = 1.0 / (1.0 + tl.exp(-g))
    else:
        # (-g) * log2(e) == g * -log2(e) exactly; log2(e) is tl.exp's fp32 constant.
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f",
                                      [g * -1.4426950408889634], dtype=tl.float32,
                                      is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e],
                                      dtype=tl.float32, is_pure=True, pack=1)
    return g * s


@triton.jit
def bf16x2_to_f32(x):
    """``x.to(tl.float32)`` for bf16 ``x``: a pair of bf16 in one 32-bit register widens to
    ``w << 16`` and ``w & 0xFFFF0000``, one instruction each. The same bits (widening bf16
    is exact; sm_90 ptxas lowers ``cvt.f32.bf16`` to the same shift, after extracting the
    high half first: 3 instructions a pair)."""
    if _INTERPRET_C:
        return x.to(tl.float32)
    else:
        return tl.inline_asm_elementwise(
            "{ shl.b32 $0, $2, 16;\n and.b32 $1, $2, 0xFFFF0000; }", "=r,=r,r", [x],
            dtype=tl.float32, is_pure=True, pack=2)


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
                     POW2: tl.constexpr, HAS_P: tl.constexpr, FAST_SILU: tl.constexpr,
                     tile_start=0, stop=0, PACK: tl.constexpr = False,
                     RPT: tl.constexpr = 4, CVT4: tl.constexpr = False,
                     BF16_BITS: tl.constexpr = False):
    """One [BM, 128] output block (columns ``pid_n * 128 ..``) of the quantizing forward
    (``FAST_SILU``: :func:`silu_ftz`, else :func:`silu_f32`). ``PACK`` (the batch kernel;
    rows in :func:`packed_row_order`, ``BM = 128``): the columnwise copy leaves through
    :func:`store_cols_packed` (tile rows from ``tile_start``, tokens below ``stop``), or
    :func:`store_cols_cvt4` with ``CVT4``. ``BF16_BITS`` (bf16 ``x``): the inputs widen by
    :func:`bf16x2_to_f32`."""
    cols = pid_n * 128 + tl.arange(0, 128)
    cmask = cols < N
    mask = lmask[:, None] & cmask[None, :]
    xp = x_ptr + rows[:, None] * stride_x + cols[None, :]
    g = tl.load(xp, mask=mask, other=0.0)
    u = tl.load(xp + N, mask=mask, other=0.0)
    if BF16_BITS:
        g, u = bf16x2_to_f32(g), bf16x2_to_f32(u)
    else:
        g, u = g.to(tl.float32), u.to(tl.float32)
    if FAST_SILU:
        silu = silu_ftz(g)
    else:
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
        if PACK and CVT4:
            st = store_cols_cvt4(y, qt_ptr, tile_start, cols, cmask, stop, M, RPT, POW2)
        else:
            qt, st = quant_cols(y, POW2)
            if PACK:
                store_cols_packed(qt, qt_ptr, tile_start, cols, cmask, stop, M, RPT)
            else:
                # qt[c, m] = quant(y)[m, c]: stored through transposed addresses.
                tl.store(qt_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], qt,
                         mask=smask[:, None] & cmask[None, :])
        tl.store(st_ptr + cols.to(tl.int64) * NG + pid_m, st, mask=cmask)


@triton.jit
def _silu_mul_quant_fwd_kernel(x_ptr, p_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, stride_x, NG,
                               BM: tl.constexpr, COLWISE: tl.constexpr, POW2: tl.constexpr,
                               HAS_P: tl.constexpr):
    # Program (pid_m, pid_n): rows [pid_m * BM, +BM), the 128-column block pid_n.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    smask = rows < M
    p = tl.zeros([BM], tl.float32)
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=smask, other=0.0).to(tl.float32)
    _quant_fwd_block(pid_m, pid_n, rows, smask, smask, p, x_ptr, q_ptr, s_ptr, qt_ptr,
                     st_ptr, M, N, stride_x, NG, BM, COLWISE, POW2, HAS_P, False)


@triton.jit
def _batch_tile_map_kernel(cnt_ptr, map_ptr, off_ptr, E, R, G, ALIGN, EP2: tl.constexpr,
                           BT: tl.constexpr):
    """The row tiles of a grouped buffer, for :func:`_batch_silu_mul_quant_fwd_kernel`.

    Program ``e < E`` writes expert ``e``'s tiles, program ``E`` the tail tiles: tile
    ``t`` gets ``map[t] = (tile_start, real_end, seg_stop)`` (rows ``< real_end`` are real,
    rows up to ``seg_stop`` padding/tail; the same values as :func:`expert_tile`), tiles
    ``t >= G`` are dropped. Also ``off[e]`` = ``g_off[e]`` (expert ``e``'s first tile,
    ``g_off[E]`` the experts' tiles) and ``off[E + 1 + e]`` = its segment offset
    (``offsets[E]`` the rows in use). Negative counts count as 0."""
    e = tl.program_id(0)
    idx = tl.arange(0, EP2)
    c = tl.load(cnt_ptr + idx, mask=idx < E, other=0).to(tl.int32)
    c = tl.maximum(c, 0)
    padded = (c + ALIGN - 1) // ALIGN * ALIGN
    ntile = (padded + 127) // 128
    zero = tl.zeros_like(c)
    before = idx < e
    this = idx == e
    seg_start = tl.sum(tl.where(before, padded, zero), 0)
    g_start = tl.sum(tl.where(before, ntile, zero), 0)
    tl.store(off_ptr + e, g_start)
    tl.store(off_ptr + E + 1 + e, seg_start)
    tail = e == E
    nt = tl.where(tail, G - g_start, tl.sum(tl.where(this, ntile, zero), 0))
    real_end = tl.where(tail, 0, seg_start + tl.sum(tl.where(this, c, zero), 0))
    seg_stop = tl.where(tail, R, seg_start + tl.sum(tl.where(this, padded, zero), 0))
    for k0 in range(0, nt, BT):
        k = k0 + tl.arange(0, BT)
        t = g_start + k
        m = (k < nt) & (t < G)
        tl.store(map_ptr + t * 4, seg_start + k * 128, mask=m)
        tl.store(map_ptr + t * 4 + 1, real_end + k * 0, mask=m)
        tl.store(map_ptr + t * 4 + 2, seg_stop + k * 0, mask=m)


@triton.jit
def _batch_silu_mul_quant_fwd_kernel(x_ptr, p_ptr, map_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
                                     M, N, stride_x, NG, NPC, COLWISE: tl.constexpr,
                                     POW2: tl.constexpr, HAS_P: tl.constexpr,
                                     ALIGN16: tl.constexpr, NCOL: tl.constexpr,
                                     ROWS_FIRST: tl.constexpr, PACK: tl.constexpr = False,
                                     RPT: tl.constexpr = 8, CVT4: tl.constexpr = False,
                                     BF16_BITS: tl.constexpr = False):
    # Program pid takes row tile pid_m (from the tile map: it starts at its segment's
    # start, so columnwise groups never cross segments) and the 128-column blocks
    # [pid_c * NCOL, pid_c * NCOL + NCOL), in turn; NPC column programs per row tile.
    # PACK (COLWISE, ALIGN16, M % 16 == 0; qt_ptr int32): the columnwise copy leaves as
    # packed 32-bit words (store_cols_packed; with CVT4 cast a word at a time,
    # store_cols_cvt4).
    pid = tl.program_id(0)
    if ROWS_FIRST:
        pid_m = pid % NG
        pid_c = pid // NG
    else:
        pid_m = pid // NPC
        pid_c = pid % NPC
    tile_start = tl.load(map_ptr + pid_m * 4)
    real_end = tl.load(map_ptr + pid_m * 4 + 1)
    seg_stop = tl.load(map_ptr + pid_m * 4 + 2)
    n0 = pid_c * NCOL
    n1 = tl.minimum(n0 + NCOL, tl.cdiv(N, 128))
    if (tile_start >= seg_stop) | (tile_start >= M):
        # A tile past the rows (the static bound's spare tiles; ~18% of them at 256
        # experts): only its columnwise group's scales, 1.
        if COLWISE:
            for pid_n in tl.range(n0, n1, num_stages=1):
                cols = pid_n * 128 + tl.arange(0, 128)
                tl.store(st_ptr + cols.to(tl.int64) * NG + pid_m,
                         tl.full([128], 1.0, tl.float32), mask=cols < N)
    else:
        if ALIGN16:
            # Segment starts are multiples of ALIGN (a multiple of 16): show the compiler,
            # so that the transposed (row-contiguous) fp8 stores are 16-byte vectors.
            tile_start, seg_stop = aligned16(tile_start, seg_stop)
        if PACK:
            rows = tile_start.to(tl.int64) + packed_row_order(RPT)
        else:
            rows = tile_start.to(tl.int64) + tl.arange(0, 128)
        stop = tl.minimum(seg_stop, M)
        smask = (rows < seg_stop) & (rows < M)   # rows this program writes
        lmask = (rows < real_end) & smask        # rows it reads (real rows)
        p = tl.zeros([128], tl.float32)
        if HAS_P:
            p = tl.load(p_ptr + rows, mask=lmask, other=0.0).to(tl.float32)
        if NCOL == 1:
            _quant_fwd_block(pid_m, pid_c, rows, lmask, smask, p, x_ptr, q_ptr, s_ptr,
                             qt_ptr, st_ptr, M, N, stride_x, NG, 128, COLWISE, POW2, HAS_P,
                             True, tile_start, stop, PACK, RPT, CVT4, BF16_BITS)
        else:
            for pid_n in tl.range(n0, n1, num_stages=1):
                _quant_fwd_block(pid_m, pid_n, rows, lmask, smask, p, x_ptr, q_ptr, s_ptr,
                                 qt_ptr, st_ptr, M, N, stride_x, NG, 128, COLWISE, POW2,
                                 HAS_P, True, tile_start, stop, PACK, RPT, CVT4,
                                 BF16_BITS)


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
                x, probs, q, s, qt, st, M, N, x.stride(0), cdiv(M, BLOCK), BM=BM,
                COLWISE=columnwise, POW2=pow2_scale, HAS_P=probs is not None,
                num_warps=QUANT_NUM_WARPS if columnwise else 4)
    return q, s, qt, st


def batch_col_groups(num_rows: int, num_experts: int) -> int:
    """Static bound ``G = cdiv(num_rows, 128) + num_experts`` on the columnwise groups of a
    grouped buffer (each expert adds at most one partial group)."""
    return cdiv(num_rows, BLOCK) + num_experts


def batch_tile_map(counts: torch.Tensor, align: int, num_rows: int):
    """The 128-row tiles of a grouped buffer of ``num_rows`` rows with segments
    ``counts [E]`` padded to ``align`` (one launch of ``E + 1`` programs, no host sync).

    Returns ``(tile_map [G, 4] int32, g_off [E + 1] int32, seg_off [E + 1] int32)`` with
    ``G = cdiv(num_rows, 128) + E``: tile ``t``'s ``(tile_start, real_end, seg_stop)`` in
    columns 0-2 (column 3 unused; as :func:`expert_tile`: expert ``e`` owns tiles
    ``[g_off[e], g_off[e+1])``, which start at its segment start ``seg_off[e]``; tiles from
    ``g_off[E]`` on cover the tail rows from ``seg_off[E]`` and then lie past the rows)."""
    E = counts.numel()
    G = batch_col_groups(num_rows, E)
    # One allocation; g_off first (storage offset 0, as the custom op's fake outputs
    # have), the map's rows 16-byte aligned after it.
    n_off = -(-2 * (E + 1) // 4) * 4
    buf = empty(n_off + 4 * G, dtype=torch.int32, device=counts.device)
    offs, tmap = buf[:2 * (E + 1)], buf[n_off:]
    with device_guard(counts):
        launch(_batch_tile_map_kernel, (E + 1,), counts, tmap, offs, E, num_rows, G, align,
               EP2=next_power_of_2(max(E, 1)), BT=128, num_warps=4)
    return tmap.view(G, 4), offs[:E + 1], offs[E + 1:]


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

    Two launches: :func:`batch_tile_map`, then one program per 128-row tile x
    ``BATCH_QUANT_COLS`` 128-column blocks. With ``columnwise``, ``align % 16 == 0`` and
    ``R % 16 == 0`` (``linghe.layout.max_grouped_rows`` with ``align=16`` is a multiple
    of 16 where the expert count and tokens x top-k are) the columnwise copy is stored as
    packed 32-bit words (``BATCH_QUANT_PACK``); else byte by byte through Triton's layout
    conversion (the same bits, slower).
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
    tmap, g_off, seg_off = batch_tile_map(counts, align, R)
    ncol = max(BATCH_QUANT_COLS, 1)
    npc = cdiv(cdiv(N, BLOCK), ncol)
    if G > 0 and npc > 0:
        if columnwise:
            warps, maxnreg, order = BATCH_QUANT_NUM_WARPS, BATCH_QUANT_MAXNREG, BATCH_QUANT_ORDER
        else:
            warps, maxnreg, order = (BATCH_QUANT_ROW_NUM_WARPS, BATCH_QUANT_ROW_MAXNREG,
                                     BATCH_QUANT_ROW_ORDER)
        opts = {} if maxnreg is None else {"maxnreg": maxnreg}
        # The packed columnwise store needs 16-byte aligned 16-token pieces: segment starts
        # (align) and rows of q_t (R) multiples of 16.
        pack = (columnwise and BATCH_QUANT_PACK and align % 16 == 0 and R % 16 == 0
                and R > 0)
        with device_guard(x):
            launch(_batch_silu_mul_quant_fwd_kernel, (G * npc,),
                   x, probs, tmap, q, s, qt.view(torch.int32) if pack else qt, st, R, N,
                   x.stride(0), G, npc, COLWISE=columnwise, POW2=pow2_scale,
                   HAS_P=probs is not None, ALIGN16=align % 16 == 0, NCOL=ncol,
                   ROWS_FIRST=order == "rows", PACK=pack, RPT=max(4, 32 // warps),
                   CVT4=pack and BATCH_QUANT_CVT4,
                   BF16_BITS=(x.dtype == torch.bfloat16
                              and (BATCH_QUANT_BF16_BITS if columnwise
                                   else BATCH_QUANT_ROW_BF16_BITS)),
                   num_warps=warps, **opts)
    return q, s, qt, st, g_off, seg_off
