"""Grouped GEMMs over rows grouped by expert (forward kernels and launchers).

Rows follow :class:`linghe.layout.ExpertLayout`: expert ``e``'s segment is rows
``offsets[e] .. offsets[e+1]`` of ``rows [R, K]`` (real rows, then zero padding rows),
rows ``>= offsets[E]`` are the tail. Weights are per expert, ``[E, N, K]`` (``nn.Linear``
convention), and ``out[r] = rows[r] @ W_e^T`` for ``r`` in segment ``e``.

**Tile schedule (no host sync, no extra launch).** The segment sizes live on the device
only. Each program of the GEMM kernel turns ``offsets`` (``E + 1`` ints, L2-resident)
into the cumulative number of ``BM``-row tiles per expert (``cdiv(padded_e, BM)``,
:func:`tile_schedule`) and finds its row tile's expert with two masked sums
(:func:`find_tile`), so a tile never crosses two experts
whatever ``align`` is (a tile may be partial within its segment: masked). The tiles are
the static bound ``T = cdiv(R, BM) + E + 1`` row tiles (times the column tiles); tiles
past the experts' tiles cover the tail (from ``offsets[E]``) and store zeros without a K
loop, and those past row ``R`` store nothing. :func:`tile_map` materializes the same
schedule (tests, debugging).

The same "rows @ B_e" kernel serves the forward (``B_e = W_e^T``) and the dgrad
(``B_e = W_e``) through strides; :mod:`linghe.bwd.grouped_mm` holds the wgrad kernel.

**FP8 blockwise.** ``rows`` as an :class:`~linghe.fp8.Fp8Tensor` with 1x128 rowwise
scales (``[R, ceil(K/128)]``, transposed by the launcher so that each K step's scales of
a tile are one contiguous load), weights from :func:`quantize_grouped_weight` (128x128
blocks per expert). The K loop steps by 128 and promotes each partial product with its
scales: ``acc += dot(a_q, b_q) * (sa[:, None] * sb[None, :])`` (the default), or, with
``RESCALE`` (:data:`FP8_RESCALE`, or ``"RESCALE"`` in a launcher's ``config``), keeps
the accumulator in units of the current step's scale so the MMA accumulates into it
(one ``BM x BN`` fp32 tile of registers instead of two; see :func:`fp8_rescale`). On the
GPU, shapes from ``AUTOTUNE_MIN_ROWS`` rows on pick their tiles from a small autotune
list (``LINGHE_GROUPED_MM_AUTOTUNE=0``: the heuristic of :func:`_mm_config`); a
launcher's ``config`` argument pins the tiles (benchmark/fp8_gemm_sweep.py). The
TMA kernel (:func:`_grouped_rows_tma_kernel`, :data:`FP8_TMA`, either form) loads the
operands wherever the tensors allow it (16-byte aligned rows, weights contiguous along
the contraction): 9-15% faster than the pointer kernel on an H100. On sm_90 the
promoting form runs as a warp-specialized Gluon kernel instead
(:mod:`linghe.fwd.grouped_mm_ws`, :data:`FP8_WS`: a loader warp and two consumer
warpgroups per persistent program, 128-row tiles; same bits, 1.1-1.4x faster than the
Triton kernel, 1.48-1.67x ``torch._grouped_mm`` bf16 at the MoE shapes on an H100); the
Triton kernels remain the path everywhere else (CPU interpreter, other GPUs, operands
TMA cannot describe, ``config`` without ``WS``).

**bf16/fp16 (Triton backend).** On sm_90 the warp-specialized kernel
(:func:`~linghe.fwd.grouped_mm_ws.launch_hp_rows_ws`, :data:`HP_WS`; also what
``backend="auto"`` takes there, :func:`hp_ws_preferred`); elsewhere the same TMA kernel
on bf16/fp16 descriptors (no scales, ``BK = 64``: 128-byte rows) runs the
high-precision forward and dgrad wherever :func:`_tma_operands` can describe the
operands (:data:`BF16_TMA`; the dgrad's weight ``W_e [N, K]`` is read N-major, so both
need ``N`` a multiple of ``BK``); elsewhere, and for float32, the pointer kernel. A
launcher's ``config`` pins its tiles or asks for the pointer kernel (``TMA=False``;
:func:`_check_rows_config`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..fp8 import Fp8Tensor, quantize_128x128
from ..fp8.quantize import FP8_DTYPE, groups_adjacent, quant_cols, quant_rows
from ..utils import (
    INTERPRET,
    cdiv,
    cuda_capability,
    device_guard,
    dot_f32acc,
    empty,
    grouped_tile_order,
    launch,
    next_power_of_2,
    tma_capable,
)
from .activation import aligned16, batch_col_groups, expert_tile
from .grouped_mm_ws import (
    FP8_WS,
    HP_WS,
    HP_WS_CONFIG,
    WS_CONFIG,
    WS_TILES,
    launch_fp8_rows_ws,
    launch_hp_rows_ws,
    ws_capable,
    ws_config,
    ws_descriptor,
)

BLOCK = 128  # FP8 group / block size

#: Default promotion form of the FP8 grouped GEMMs (rows kernel and wgrad): ``False``
#: promotes each K step's product into a second accumulator (``acc += dot * scale``),
#: ``True`` rescales the one accumulator (:func:`fp8_rescale`). Read once at import
#: (``LINGHE_FP8_RESCALE=1``); a launcher's ``config["RESCALE"]`` overrides it. With
#: TMA the rescaled rows kernel takes 128x128 tiles (two programs per SM): on an H100
#: 4-9% faster than the promoting default at 32 experts (~2K rows each: 1.24-1.27x
#: ``torch._grouped_mm`` bf16 instead of 1.12-1.17x), slower at 256 (~256 rows each),
#: with fp32-output errors of ~1e-3 instead of ~1.3e-4 against the dequantized product
#: (the tensor cores' reduced-precision accumulation over the whole K loop; below bf16
#: output rounding at K = 2048). ``benchmark/results/h100_fp8_tmar_sweep_2026-11-26.*``.
FP8_RESCALE: bool = os.environ.get("LINGHE_FP8_RESCALE", "0") == "1"

#: Smallest normal fp32: the floor of a K step's scale in the rescaled form.
_FP32_TINY = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def fp8_scale_floor(s):
    """``s`` floored at the smallest normal fp32 (NaN and Inf pass through)."""
    return tl.where(s < _FP32_TINY, _FP32_TINY, s)


@triton.jit
def fp8_rescale(s_prev, s):
    """For the rescaled FP8 promotion: ``(s_floor, s_prev / s_floor)`` (``s_prev``: the
    last step's floored scale, or 1 before the first step).

    The accumulator is kept in units of the current K step's scale ``s``: ``acc =
    dot(a_q, b_q, acc * (s_prev / s))`` each step, ``acc * s_last`` after the loop, so
    the MMA accumulates in place (no second tile). With power-of-two scales the ratio
    and the product are exact (same result as promoting); otherwise one correctly
    rounded division and one extra fp32 rounding per step. ``s`` is floored at the
    smallest normal fp32 (a product of two tiny scales may underflow to 0, and 0 would
    turn the ratio into Inf/NaN); such a step's contribution is then overestimated by
    at most ``128 * 448^2 * 2^-126 < 2^-101`` (absolute). NaN/Inf scales pass through
    (NaN < x is false), so NaN/Inf inputs still give NaN as the dequantized product
    would. Limit: the partial sum in units of ``s`` must stay finite, i.e. a row's
    scales must not span more than ~2^100 across its K steps."""
    s = fp8_scale_floor(s)
    return s, tl.math.div_rn(s_prev, s)


@triton.jit
def fp8_promote(acc, a, b, sa, bs_k, pid_n, cols, cmask, bs_sj, BN: tl.constexpr):
    """The promoting form's step: ``acc + dot(a, b) * scales`` for one 128-deep K step,
    with the row scales ``sa [BM]`` and the step's weight scales at ``bs_k + (column
    block) * bs_sj`` (loaded before the MMA is issued): ``BN <= 128`` (dividing 128) has
    one weight scale, folded into the row scales (no ``[BM, BN]`` scale tile in
    registers); a multiple of 128 one per 128 columns."""
    if BN <= 128:
        s = sa * tl.load(bs_k + ((pid_n * BN) // 128) * bs_sj)
        return acc + tl.dot(a, b) * s[:, None]
    sb = tl.load(bs_k + (cols // 128) * bs_sj, mask=cmask, other=1.0)
    return acc + tl.dot(a, b) * sa[:, None] * sb[None, :]


@triton.jit
def fp8_step(acc, a, b, sa, bs_k, pid_n, cols, cmask, bs_sj, sa_prev, sb_prev,
             BN: tl.constexpr, RESCALE: tl.constexpr):
    """One 128-deep K step of the FP8 rows kernels: ``(acc, sa_prev, sb_prev)`` after
    it. Promoting form (:func:`fp8_promote`; ``sa_prev``/``sb_prev`` unused), or
    ``RESCALE``: the accumulator in units of the last step's scales (:func:`fp8_rescale`;
    ``sa_prev`` the row scale times the weight scale where ``BN <= 128``, else row and
    column scales apart), finished by :func:`fp8_finish`."""
    if not RESCALE:
        return fp8_promote(acc, a, b, sa, bs_k, pid_n, cols, cmask, bs_sj, BN), sa_prev, \
            sb_prev
    if BN <= 128:  # one weight scale per step: folded into the row scales
        s = sa * tl.load(bs_k + ((pid_n * BN) // 128) * bs_sj)
        s, ratio = fp8_rescale(sa_prev, s)
        return tl.dot(a, b, acc * ratio[:, None]), s, sb_prev
    sb = tl.load(bs_k + (cols // 128) * bs_sj, mask=cmask, other=1.0)
    sa, ra = fp8_rescale(sa_prev, sa)
    sb, rb = fp8_rescale(sb_prev, sb)
    return tl.dot(a, b, acc * ra[:, None] * rb[None, :]), sa, sb


@triton.jit
def fp8_finish(acc, sa_prev, sb_prev, BN: tl.constexpr, RESCALE: tl.constexpr):
    """The accumulator in output units after the K loop (rescaled form: times the last
    step's scales)."""
    if not RESCALE:
        return acc
    if BN <= 128:
        return acc * sa_prev[:, None]
    return acc * sa_prev[:, None] * sb_prev[None, :]


# --------------------------------------------------------------------------------------
# Tile schedule
# --------------------------------------------------------------------------------------


@triton.jit
def _tile_map_kernel(offsets_ptr, tile_off_ptr, tile_expert_ptr, E, n_tiles,
                     BM: tl.constexpr, EP2: tl.constexpr, BT: tl.constexpr):
    """One program: ``tile_off [E + 1]`` (cumulative ``cdiv(seg_e, BM)``) and, for every
    row tile ``t < n_tiles``, ``tile_expert[t]`` = its expert (``E`` for a tail tile)."""
    idx = tl.arange(0, EP2)
    m = idx < E
    lo = tl.load(offsets_ptr + idx, mask=m, other=0)
    hi = tl.load(offsets_ptr + idx + 1, mask=m, other=0)
    tiles = tl.where(m, (hi - lo + (BM - 1)) // BM, 0)
    cum = tl.cumsum(tiles, axis=0)  # cum[e] = tile_off[e + 1]
    tl.store(tile_off_ptr + idx + 1, cum, mask=m)
    tl.store(tile_off_ptr + idx, tl.zeros((EP2,), dtype=tl.int32), mask=idx == 0)
    for t0 in range(0, n_tiles, BT):
        t = t0 + tl.arange(0, BT)
        # expert of tile t = number of experts whose tiles all end at or before t.
        before = (cum[None, :] <= t[:, None]) & m[None, :]
        e = tl.sum(before.to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + t, e, mask=t < n_tiles)


def tile_map(offsets: torch.Tensor, num_rows: int, block_m: int):
    """The tile schedule that :func:`find_tile` computes inside the GEMM kernel, as tensors
    (tests/debugging; one tiny launch, no host sync): ``(tile_off [E + 1], tile_expert
    [n_tiles], n_tiles)`` with the static bound ``n_tiles``."""
    E = offsets.numel() - 1
    n_tiles = row_tile_bound(num_rows, E, block_m)
    tile_off = torch.empty(E + 1, dtype=torch.int32, device=offsets.device)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=offsets.device)
    EP2 = max(16, triton.next_power_of_2(E))
    BT = max(16, min(256, 16384 // EP2))
    with device_guard(offsets):
        launch(_tile_map_kernel, (1,), offsets, tile_off, tile_expert, E, n_tiles, BM=block_m,
               EP2=EP2, BT=BT, num_warps=4)
    return tile_off, tile_expert, n_tiles


def row_tile_bound(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on expert tiles plus tail tiles: ``sum_e cdiv(p_e, BM) +
    cdiv(R - offsets[E], BM) <= cdiv(R, BM) + E + 1``."""
    return cdiv(num_rows, block_m) + num_experts + 1


@triton.jit
def tile_schedule(offsets_ptr, E, BM: tl.constexpr, EP2: tl.constexpr):
    """The expert tile schedule, computed once per program from ``offsets`` (``E + 1``
    int32, L2-resident; no separate launch): ``(tiles [EP2], cum [EP2], emask)`` with
    ``tiles[e] = cdiv(segment_e, BM)`` and ``cum`` its inclusive cumsum."""
    idx = tl.arange(0, EP2)
    m = idx < E
    lo = tl.load(offsets_ptr + idx, mask=m, other=0)
    hi = tl.load(offsets_ptr + idx + 1, mask=m, other=0)
    tiles = tl.where(m, (hi - lo + (BM - 1)) // BM, 0)
    return tiles, tl.cumsum(tiles, axis=0), m


@triton.jit
def find_tile(offsets_ptr, t, E, tiles, cum, emask, BM: tl.constexpr, EP2: tl.constexpr):
    """For row tile ``t``: ``(e, row_start, row_end)`` from the schedule of
    :func:`tile_schedule` (no cumsum here: two masked sums and two scalar loads).
    ``e == E`` marks a tail tile (``row_end`` is then a huge bound; the caller also masks
    with the row count). Same schedule as :func:`tile_map`."""
    idx = tl.arange(0, EP2)
    e = tl.sum(((cum <= t) & emask).to(tl.int32), axis=0)
    first = tl.sum(tl.where(idx < e, tiles, 0), axis=0)
    base = tl.load(offsets_ptr + e)
    start = base + (t - first) * BM
    nxt = tl.load(offsets_ptr + tl.minimum(e + 1, E))
    end = tl.where(e < E, nxt, 2147483647)
    return e, start, end


@triton.jit
def _grouped_rows_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, offsets_ptr,
    R, I, J, E, R_BUCKET,
    stride_am, stride_be, stride_bi, stride_bj, stride_cm,
    stride_ask, bs_se, bs_si, bs_sj,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, B_KMAJOR: tl.constexpr, EP2: tl.constexpr,
    RESCALE: tl.constexpr = False,
):
    """``c[r, j] = sum_i a[r, i] * b[e(r), i, j]`` for rows grouped by expert.

    One program per output tile of the ``T x cdiv(J, BN)`` tiles (``T = cdiv(R, BM) + E
    + 1`` row tiles, L2-friendly grouped order). ``R_BUCKET`` only keys the autotuning.
    (A persistent variant, each program looping over tiles after one schedule
    computation, needed 30-60 more registers per thread in sm_90 ptxas: fewer programs
    per SM, so it was dropped.)

    ``B_KMAJOR`` (``stride_bi == 1``): ``b`` is contiguous along the contraction dim, so
    its tile is loaded ``[BN, BK]`` (row-major) and fed as ``tl.trans``: both MMA operands
    K-major, which Hopper FP8 wgmma requires.

    FP8: ``a`` 1x128 rowwise with its scales *transposed*, ``as_t[i // 128, r]`` (row
    stride ``stride_ask``), so that a tile's per-row scales of one K step are one
    contiguous load; ``b`` 128x128 blocks (scale ``bs[e * bs_se + (i // 128) * bs_si +
    (j // 128) * bs_sj]``), ``BK == 128``. ``BN <= 128`` (dividing 128): one weight
    scale per step, folded into the row scales (no ``[BM, BN]`` scale tile in
    registers); ``BN`` a multiple of 128: one weight scale per 128 columns (a ``[BN]``
    vector). ``RESCALE``: the one-accumulator promotion of :func:`fp8_rescale` (masked
    rows and columns load scale 1, so their ratios stay finite; tail tiles, which have
    no K loop, store ``0 * 1``).
    """
    num_row_tiles = tl.cdiv(R, BM) + E + 1
    t, pid_n = grouped_tile_order(tl.program_id(0), num_row_tiles, tl.cdiv(J, BN), GROUP_M)
    tiles, cum, emask = tile_schedule(offsets_ptr, E, BM, EP2)
    e, start, end = find_tile(offsets_ptr, t, E, tiles, cum, emask, BM, EP2)
    valid = e < E
    e64 = tl.minimum(e, E - 1).to(tl.int64)
    rows = start.to(tl.int64) + tl.arange(0, BM)
    rmask = (rows < end) & (rows < R) & (rows >= 0)  # never out of bounds
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < J
    k_end = tl.where(valid, I, 0)  # tail tiles: no K loop, store zeros

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # RESCALE: the accumulator's units (the last step's row and column scales).
    sa_prev = tl.full((BM,), 1.0, tl.float32)
    sb_prev = tl.full((BN,), 1.0, tl.float32)
    a_rows = a_ptr + rows[:, None] * stride_am
    b_base = b_ptr + e64 * stride_be
    for k0 in range(0, k_end, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < I
        a = tl.load(a_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if B_KMAJOR:  # [BN, BK] tile, contiguous along K; used transposed
            bt = tl.load(b_base + cols[:, None].to(tl.int64) * stride_bj + ks[None, :],
                         mask=cmask[:, None] & kmask[None, :], other=0.0)
            b = tl.trans(bt)
        else:
            b = tl.load(b_base + ks[:, None].to(tl.int64) * stride_bi
                        + cols[None, :].to(tl.int64) * stride_bj,
                        mask=kmask[:, None] & cmask[None, :], other=0.0)
        if FP8:
            kb = k0 // BK
            sa = tl.load(as_ptr + kb * stride_ask + rows, mask=rmask, other=1.0)
            acc, sa_prev, sb_prev = fp8_step(
                acc, a, b, sa, bs_ptr + e64 * bs_se + kb * bs_si, pid_n, cols, cmask, bs_sj,
                sa_prev, sb_prev, BN, RESCALE)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = dot_f32acc(a, b, acc)
    if FP8:
        acc = fp8_finish(acc, sa_prev, sb_prev, BN, RESCALE)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _grouped_rows_tma_kernel(
    a_desc, b_desc, c_ptr, as_ptr, bs_ptr, offsets_ptr,
    R, I, J, E, R_BUCKET, b_row_e, b_col_e, stride_cm, stride_ask, bs_se, bs_si, bs_sj,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EP2: tl.constexpr, B_NMAJOR: tl.constexpr = False, RESCALE: tl.constexpr = False,
):
    """The rows kernel with both operands loaded by TMA: FP8 (promoting form, or
    ``RESCALE``: one accumulator tile, see :func:`fp8_step`), or bf16/fp16.

    Same tiles, schedule and promotion as :func:`_grouped_rows_kernel` (``FP8``,
    ``B_KMAJOR``, ``RESCALE=False``), but ``a`` and ``b`` come through tensor
    descriptors: ``a_desc`` over ``a [R, I]`` with ``[BM, BK]`` boxes, ``b_desc`` over a
    2-D view of ``b`` that is contiguous along the contraction dim, whose ``[BN, BK]``
    box of expert ``e`` starts at row ``e * b_row_e + pid_n * BN``, column ``e * b_col_e
    + k0`` (forward: ``[E*J, I]``, ``b_row_e = J``; dgrad: the columnwise copy ``[J,
    E*I]``, ``b_col_e = I``). The copy engine does the address arithmetic and the
    zero fill past the tensors' ends (K tails, the last rows), so no masks or address
    registers are needed for the operands; rows of a box that belong to the next expert
    are computed and not stored. Fewer registers than the pointer kernel (sm_90 ptxas:
    152 against 195 at 64x128 / 4 warps), so three programs share an SM.
    FP8 variants of the K loop (scales loaded 1-2 K blocks ahead, K blocks in pairs,
    column halves) were no faster on an H100 (gate_up fwd: 867 µs default, 884-1185
    variants; ``benchmark/results/h100_fp8_tmav_sweep_2026-11-26.*``) and were removed.

    bf16/fp16 descriptors (FP8 is read off ``a_desc``'s dtype; no scales: ``as_ptr``/
    ``bs_ptr`` and their strides unused): the K loop is ``acc = dot(a, b, acc)``, which
    Triton keeps asynchronous (``wgmma.wait_group 1``: one K step's MMAs in flight while
    the next step's are issued), ``BK = 64`` (128-byte rows). ``B_NMAJOR`` (bf16/fp16
    only; off by default, so a compile that leaves it out gets the K-major kernel) is
    the dgrad's ``B_e = W_e [I, J]``, contiguous along ``J``: ``b_desc`` is the ``[E*I,
    J]`` view with ``[BK, BN]`` boxes, expert ``e``'s at row ``e * b_row_e + k0``
    (``b_row_e = I``), column ``pid_n * BN``, fed to the MMA as it is (Hopper's bf16
    wgmma reads an N-major B from shared memory); the launcher takes this path only
    where ``I`` is a multiple of ``BK`` (a K box never reaches the next expert's rows)."""
    FP8: tl.constexpr = a_desc.dtype == tl.float8e4nv
    tl.static_assert(not (FP8 and B_NMAJOR), "FP8 wgmma needs both operands K-major")
    num_row_tiles = tl.cdiv(R, BM) + E + 1
    t, pid_n = grouped_tile_order(tl.program_id(0), num_row_tiles, tl.cdiv(J, BN), GROUP_M)
    tiles, cum, emask = tile_schedule(offsets_ptr, E, BM, EP2)
    e, start, end = find_tile(offsets_ptr, t, E, tiles, cum, emask, BM, EP2)
    valid = e < E
    ec = tl.minimum(e, E - 1)
    rows = start.to(tl.int64) + tl.arange(0, BM)
    rmask = (rows < end) & (rows < R) & (rows >= 0)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < J
    k_end = tl.where(valid, I, 0)  # tail tiles: no K loop, store zeros
    if B_NMAJOR:  # [BK, BN] boxes at (expert's rows + k0, column tile)
        b_row = ec * b_row_e
        b_col = pid_n * BN
    else:  # [BN, BK] boxes at (expert's rows + column tile, expert's columns + k0)
        b_row = ec * b_row_e + pid_n * BN
        b_col = ec * b_col_e
    bs_e = bs_ptr + ec.to(tl.int64) * bs_se
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    sa_prev = tl.full((BM,), 1.0, tl.float32)  # RESCALE: the accumulator's units
    sb_prev = tl.full((BN,), 1.0, tl.float32)
    for k0 in range(0, k_end, BK):
        a = a_desc.load([start, k0])
        if B_NMAJOR:
            b = b_desc.load([b_row + k0, b_col])
        else:
            b = tl.trans(b_desc.load([b_row, b_col + k0]))
        if FP8:
            kb = k0 // BK
            sa = tl.load(as_ptr + kb * stride_ask + rows, mask=rmask, other=1.0)
            acc, sa_prev, sb_prev = fp8_step(acc, a, b, sa, bs_e + kb * bs_si, pid_n, cols,
                                             cmask, bs_sj, sa_prev, sb_prev, BN, RESCALE)
        else:
            acc = dot_f32acc(a, b, acc)
    if FP8:
        acc = fp8_finish(acc, sa_prev, sb_prev, BN, RESCALE)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


#: Autotune the GEMMs from this many rows on (tests and small shapes use the heuristic:
#: one compile per shape instead of one per config).
AUTOTUNE_MIN_ROWS = 4096


def _mm_config(R: int, E: int, J: int, fp8: bool, block_m: int | None,
               f32: bool = False, tma: bool = False):
    """Block sizes by shape (GPU) or small tiles (interpreter).

    Every expert wastes up to one partial row tile, so few rows per expert (e.g. 256
    experts sharing 64K rows) take 64-row tiles, many take 128. FP8 (sm_90 ptxas,
    offline): the promoted accumulator costs a second ``BM x BN`` fp32 tile of registers;
    128x128 tiles with 8 warps take ~190 registers (one program per SM), 64x128 with 4
    warps (one warpgroup, m64n128 wgmma) ~180, so two programs share an SM and one
    promotes while the other's MMAs run. The rescaled form (``RESCALE``) needs one tile:
    ~128 registers for both, so 128x128/8 warps fits two programs per SM and 128x256 /
    256x128 with 8 warps compile without spilling (benchmark/NOTES.md,
    ``python -m benchmark.fp8_gemm_sweep --ptxas``). ``tma`` (the FP8 TMA kernel, 152
    registers at 64x128 / 4 warps): 3 stages, which leaves shared memory for three
    programs per SM (the fastest on an H100 at every MoE shape but one, within 1% there,
    ``benchmark/results/h100_fp8_tma_sweep_2026-11-25.*``). bf16/fp16 with ``tma`` (the
    same kernel on bf16 descriptors): 128x256 / 8 warps / 4 stages (154-191 registers,
    192 KiB: one program per SM), the fastest or within 1.5% of it of 11 tile configs at
    both MoE layouts, fwd and dgrad, on an H100 (``probe_grouped_bf16``,
    ``benchmark/results/h100_probe_grouped_bf16_2026-11-26.*``: 1.24-1.55x main's pointer
    kernel; against ``torch._grouped_mm`` 0.84-0.98x fwd, 1.01-1.08x dgrad); a pinned
    ``block_m`` keeps 128-column tiles."""
    if INTERPRET:
        bm = block_m or 32
        return dict(BM=bm, BN=64, BK=128 if fp8 else 32, GROUP_M=4, num_warps=4,
                    num_stages=1)
    if fp8:
        if tma and FP8_RESCALE and block_m is None:
            # one accumulator tile: 128-row tiles at two programs per SM (105 registers),
            # each expert's weights re-read half as often as with 64-row tiles
            return dict(BM=128, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=3)
        bm = block_m or 64
        stages = (3 if bm == 64 else 4) if tma else (3 if bm == 128 else 4)
        return dict(BM=bm, BN=128, BK=128, GROUP_M=8, num_warps=8 if bm == 128 else 4,
                    num_stages=stages)
    bm = block_m or (64 if R < 512 * E else 128)
    if f32:  # 4-byte tiles: keep the pipelined shared memory under ~100 KB
        return dict(BM=bm, BN=128, BK=32, GROUP_M=8, num_warps=8, num_stages=3)
    if tma and block_m is None:
        return dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4)
    return dict(BM=bm, BN=128, BK=64, GROUP_M=8, num_warps=8 if bm == 128 else 4,
                num_stages=4)


# The FP8 autotune space (GPU, R >= AUTOTUNE_MIN_ROWS), promoting form (FP8_RESCALE off).
# BN must divide 128 (one weight scale per K step) or be a multiple of 128.
_FP8_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 8}, num_warps=w, num_stages=st)
    for bm, bn, w, st in [(64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3),
                          (128, 128, 8, 4), (128, 64, 4, 4)]]


def _autotune_enabled() -> bool:
    return not INTERPRET and os.environ.get("LINGHE_GROUPED_MM_AUTOTUNE", "1") != "0"


_rows_tuned = None


def _rows_kernel_tuned():
    global _rows_tuned
    if _rows_tuned is None:
        _rows_tuned = triton.autotune(
            configs=_FP8_CONFIGS,
            key=["I", "J", "E", "R_BUCKET", "B_KMAJOR", "RESCALE"])(_grouped_rows_kernel)
    return _rows_tuned


_PLANS: dict = {}  # (R, E, J, fp8, f32, block_m) -> (config, grid)


def _check_fp8_config(config: dict) -> dict:
    """The FP8 rows kernel's tiles from a ``config`` override (keys ``BM``, ``BN``,
    ``num_warps``, ``num_stages``; optional ``GROUP_M`` (8), ``RESCALE``
    (:data:`FP8_RESCALE`), ``TMA`` (:data:`FP8_TMA`), ``BK`` (128 only), ``WS`` (the
    warp-specialized kernel on sm_90, ``(BM, BN)`` in
    :data:`~linghe.fwd.grouped_mm_ws.WS_TILES`, ``num_stages`` its ring depth) and
    ``MAXNREG`` (its register cap)), checked: no other keys; ``BN`` divides 128 or is a
    multiple of it."""
    known = {"BM", "BN", "BK", "GROUP_M", "num_warps", "num_stages", "RESCALE", "TMA", "WS",
             "MAXNREG"}
    if set(config) - known or config.get("BK", BLOCK) != BLOCK:
        raise ValueError(f"FP8 grouped GEMM config: keys {sorted(known)} (BK = 128), got "
                         f"{config}")
    bn = config["BN"]
    if not (128 % bn == 0 or bn % 128 == 0):
        raise ValueError(f"FP8 grouped GEMM: BN must divide 128 or be a multiple of 128, "
                         f"got {bn}")
    ws = bool(config.get("WS", False))
    rescale = bool(config.get("RESCALE", FP8_RESCALE and not ws))
    tma = bool(config.get("TMA", FP8_TMA and not rescale))
    if ws and (rescale or (config["BM"], bn) not in WS_TILES):
        raise ValueError(f"FP8 grouped GEMM: the warp-specialized kernel (WS) promotes, with "
                         f"(BM, BN) in {WS_TILES}, got {config}")
    return dict(BM=config["BM"], BN=bn, BK=BLOCK, GROUP_M=config.get("GROUP_M", 8),
                num_warps=config["num_warps"], num_stages=config["num_stages"],
                RESCALE=rescale, TMA=tma, WS=ws,
                **({"MAXNREG": config["MAXNREG"]} if "MAXNREG" in config else {}))


#: Load the FP8 rows kernel's operands with TMA (:func:`_grouped_rows_tma_kernel`)
#: where the operands allow it (:func:`_tma_operands`). ``LINGHE_FP8_TMA=0``: the
#: pointer-load kernel everywhere.
FP8_TMA: bool = os.environ.get("LINGHE_FP8_TMA", "1") == "1"

#: The same for bf16/fp16 operands (the Triton backend of :func:`grouped_mm_fwd` and the
#: dgrad): :func:`_grouped_rows_tma_kernel` on bf16/fp16 descriptors where
#: :func:`_tma_operands` can describe the operands. ``LINGHE_BF16_TMA=0``: the pointer
#: kernel everywhere the warp-specialized kernel does not run (on sm_90 also set
#: ``LINGHE_HP_WS=0``; main's bf16 path before the TMA loads).
BF16_TMA: bool = os.environ.get("LINGHE_BF16_TMA", "1") == "1"


def _tools_descriptor(t, shape, strides, box, reuse=False):
    return TensorDescriptor(t, shape, strides, box)


def _tma_operands(a, b, I, J, E, stride_be, stride_bi, stride_bj, BM, BN, BK=BLOCK,
                  make=_tools_descriptor):
    """``(a_desc, b_desc, b_row_e, b_col_e)`` for :func:`_grouped_rows_tma_kernel`, or
    ``None`` where TMA cannot address the operands. ``a [R, I]`` in ``[BM, BK]`` boxes.
    ``b`` is one 2-D matrix, either contiguous along the contraction dim (``stride_bi ==
    1``, ``[BN, BK]`` boxes) as ``[E*J, I]`` (experts stacked along the rows: the
    forward's weights) or ``[J, E*I]`` (along the columns, ``I`` a multiple of ``BK`` so
    that no K box reaches the next expert: the FP8 dgrad's columnwise copy), or, 2-byte
    operands only, contiguous along the output dim (``stride_bj == 1``, ``[BK, BN]``
    boxes, the kernel's ``B_NMAJOR``: the bf16 dgrad's ``W_e [I, J]``) as ``[E*I, J]``
    with ``I`` a multiple of ``BK``. Row strides and bases 16-byte aligned (TMA).
    ``make(t, shape, strides, box, reuse)`` builds each descriptor (default: a
    ``triton.tools`` one; ``reuse`` is set for ``b``, the weights, whose descriptor the
    warp-specialized kernels' :func:`~linghe.fwd.grouped_mm_ws.ws_descriptor` keeps)."""
    es = a.element_size()
    if a.stride(1) != 1 or (a.stride(0) * es) % 16 or a.data_ptr() % 16 or b.data_ptr() % 16:
        return None
    if stride_bi == 1:
        if (stride_bj * es) % 16:
            return None
        if stride_be == J * stride_bj:
            shape, b_row_e, b_col_e = [E * J, I], J, 0
        elif stride_be == I and stride_bj >= E * I and I % BK == 0:
            shape, b_row_e, b_col_e = [J, E * I], 0, I
        else:
            return None
        b_desc = make(b, shape, [stride_bj, 1], [BN, BK], True)
    elif stride_bj == 1 and es == 2:
        if (stride_bi * es) % 16 or stride_be != I * stride_bi or I % BK:
            return None
        b_row_e, b_col_e = I, 0
        b_desc = make(b, [E * I, J], [stride_bi, 1], [BK, BN], True)
    else:
        return None
    a_desc = make(a, list(a.shape), [a.stride(0), 1], [BM, BK], False)
    return a_desc, b_desc, b_row_e, b_col_e


def _check_rows_config(config: dict, f32: bool) -> dict:
    """The high-precision rows kernel's tiles from a ``config`` override (keys ``BM``,
    ``BN``, ``num_warps``, ``num_stages``; optional ``BK`` (64; 32 for float32),
    ``GROUP_M`` (8), ``TMA`` (:data:`BF16_TMA`; bf16/fp16 only)), checked. Where the
    launcher falls back to the pointer kernel (operands TMA cannot describe) the same
    tiles load through pointers."""
    known = {"BM", "BN", "BK", "GROUP_M", "num_warps", "num_stages", "TMA"}
    if set(config) - known:
        raise ValueError(f"grouped GEMM config: unknown keys {sorted(set(config) - known)} "
                         f"(bf16/fp16/fp32 take {sorted(known)})")
    out = dict(BM=config["BM"], BN=config["BN"], BK=config.get("BK", 32 if f32 else 64),
               GROUP_M=config.get("GROUP_M", 8), num_warps=config["num_warps"],
               num_stages=config["num_stages"], TMA=bool(config.get("TMA", BF16_TMA and not f32)))
    for k in ("BM", "BN", "BK"):
        v = out[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"grouped GEMM config: {k} must be a power of two >= 16, got {v}")
    if out["TMA"] and f32:
        raise ValueError("grouped GEMM config: TMA loads are for bf16/fp16 operands (float32 "
                         "runs the pointer kernel)")
    return out


def launch_grouped_rows(a, b, out, offsets, *, stride_be, stride_bi, stride_bj,
                        a_scale=None, b_scale=None, bs_strides=(0, 0, 0),
                        block_m: int | None = None, config: dict | None = None):
    """Launch ``out[r, :] = a[r, :] @ B_{e(r)}`` with ``B_e[i, j] = b[e*stride_be +
    i*stride_bi + j*stride_bj]``. ``a [R, I]`` and ``out [R, J]`` row-major with a
    contiguous last dim; ``a_scale [R, cdiv(I, 128)]`` (FP8; any strides: the
    warp-specialized kernel reads it in place, the Triton kernels from a transposed copy
    made here, for contiguous per-step loads). Writes every row of
    ``out`` (zeros past ``offsets[E]``). ``config``: pinned tiles (and, FP8, promotion
    form) and operand loads instead of the defaults (:func:`_check_fp8_config`,
    :func:`_check_rows_config`).

    By default, FP8 on sm_90: the warp-specialized Gluon kernel (:data:`FP8_WS`, tiles
    from :func:`~linghe.fwd.grouped_mm_ws.ws_config`; not with ``block_m`` or
    :data:`FP8_RESCALE`), bf16/fp16 on sm_90 its 16-bit form (:data:`HP_WS`, not with
    ``block_m`` or ``config``); elsewhere the TMA kernel (:data:`FP8_TMA` promoting form /
    :data:`BF16_TMA` bf16 and fp16; fixed tiles from :func:`_mm_config`) where
    :func:`_tma_operands` can describe the operands, else the pointer kernel (FP8:
    autotuned from ``AUTOTUNE_MIN_ROWS`` rows on). float32 always runs the pointer
    kernel (IEEE products). A ``config`` with ``WS`` where that kernel cannot run gets
    the Triton kernel at its default tiles."""
    R, I = a.shape
    J = out.shape[1]
    E = offsets.numel() - 1
    if R == 0 or J == 0:
        return out
    fp8 = a_scale is not None
    f32 = a.dtype == torch.float32
    EP2 = max(16, triton.next_power_of_2(E))
    cfg = None
    want_ws = False
    if config is not None:
        cfg = _check_fp8_config(config) if fp8 else _check_rows_config(config, f32)
        tma = cfg.pop("TMA")
        want_ws = cfg.pop("WS", False)
        maxnreg = cfg.pop("MAXNREG", WS_CONFIG["MAXNREG"])
    elif fp8:
        tma = FP8_TMA and tma_capable(a)
        # (the warp-specialized kernel promotes: LINGHE_FP8_RESCALE=1 keeps Triton's form;
        # a pinned block_m asks for the Triton kernel's tiles)
        want_ws = FP8_WS and not FP8_RESCALE and block_m is None
    else:
        tma = BF16_TMA and a.element_size() == 2 and tma_capable(a)
    if want_ws and ws_capable(a):
        wcfg = ws_config(R, E, I, J, a.device) if cfg is None else dict(
            WS_CONFIG, BM=cfg["BM"], BN=cfg["BN"], STAGES=cfg["num_stages"],
            GROUP_M=cfg["GROUP_M"], MAXNREG=maxnreg)
        ops = _tma_operands(a, b, I, J, E, stride_be, stride_bi, stride_bj, wcfg["BM"],
                            wcfg["BN"], make=ws_descriptor)
        if ops is not None:  # (reads the row scales in their own strides)
            return launch_fp8_rows_ws(ops, out, a_scale, b_scale, offsets, bs_strides, wcfg)
    # the Triton kernels read the row scales transposed, [GK, R] (contiguous per K step)
    as_t = a_scale.t().contiguous() if fp8 else offsets
    if (not fp8 and not f32 and cfg is None and block_m is None and HP_WS
            and ws_capable(a)):
        # bf16/fp16 on sm_90: the warp-specialized kernel (fp32 accumulation)
        ops = _tma_operands(a, b, I, J, E, stride_be, stride_bi, stride_bj,
                            HP_WS_CONFIG["BM"], HP_WS_CONFIG["BN"], HP_WS_CONFIG["BK"],
                            make=ws_descriptor)
        if ops is not None:
            return launch_hp_rows_ws(ops, out, offsets, stride_bi != 1)
    if want_ws and cfg is not None:
        # asked for the warp-specialized kernel where it cannot run: the Triton kernel at
        # its own default tiles (the WS tiles do not suit it)
        cfg = None
        tma = FP8_TMA and tma_capable(a)
    if tma:
        tcfg = cfg or _mm_config(R, E, J, fp8, block_m, tma=True)
        ops = _tma_operands(a, b, I, J, E, stride_be, stride_bi, stride_bj, tcfg["BM"],
                            tcfg["BN"], tcfg["BK"])
        if ops is not None:
            tcfg = dict(tcfg)
            rescale = fp8 and bool(tcfg.pop("RESCALE", FP8_RESCALE))
            grid = (row_tile_bound(R, E, tcfg["BM"]) * cdiv(J, tcfg["BN"]),)
            with device_guard(a):
                launch(_grouped_rows_tma_kernel, grid, *ops[:2], out, as_t,
                       b_scale if fp8 else offsets, offsets, R, I, J, E,
                       triton.next_power_of_2(R), *ops[2:], out.stride(0),
                       as_t.stride(0) if fp8 else 0, *bs_strides, EP2=EP2,
                       B_NMAJOR=stride_bi != 1, RESCALE=rescale, **tcfg)
            return out
    args = (a, b, out, as_t, b_scale if fp8 else offsets, offsets, R, I, J, E,
            triton.next_power_of_2(R), a.stride(0), stride_be, stride_bi, stride_bj,
            out.stride(0), as_t.stride(0) if fp8 else 0, *bs_strides)
    flags = dict(FP8=fp8, IEEE=f32, B_KMAJOR=stride_bi == 1, EP2=EP2)
    if cfg is not None:
        grid = (row_tile_bound(R, E, cfg["BM"]) * cdiv(J, cfg["BN"]),)
        with device_guard(a):
            launch(_grouped_rows_kernel, grid, *args, **flags, **cfg)
        return out
    flags["RESCALE"] = fp8 and FP8_RESCALE
    with device_guard(a):
        if fp8 and block_m is None and R >= AUTOTUNE_MIN_ROWS and _autotune_enabled():
            grid = lambda meta: (row_tile_bound(R, E, meta["BM"]) * cdiv(J, meta["BN"]),)
            _rows_kernel_tuned()[grid](*args, **flags)
            return out
        key = (R, E, J, fp8, f32, block_m)
        plan = _PLANS.get(key)
        if plan is None:
            cfg = _mm_config(R, E, J, fp8, block_m, f32=f32)
            plan = _PLANS[key] = (cfg, (row_tile_bound(R, E, cfg["BM"]) * cdiv(J, cfg["BN"]),))
        cfg, grid = plan
        launch(_grouped_rows_kernel, grid, *args, **flags, BM=cfg["BM"], BN=cfg["BN"],
               BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
               num_stages=cfg["num_stages"])
    return out


# --------------------------------------------------------------------------------------
# torch._grouped_mm (cuBLAS/CUTLASS grouped GEMM) detection
# --------------------------------------------------------------------------------------


def hp_ws_preferred(t: torch.Tensor, dgrad_contraction: int | None = None) -> bool:
    """Whether ``backend="auto"`` takes the warp-specialized bf16/fp16 rows kernel
    (:func:`~linghe.fwd.grouped_mm_ws.launch_hp_rows_ws`, forward and dgrad) over
    ``torch._grouped_mm``: on sm_90 with Gluon, 16-bit ``t``, :data:`HP_WS` on, and, for a
    dgrad (or a layer that runs one), its contraction ``dgrad_contraction`` (the weight's
    ``N``, read N-major) a multiple of the kernel's ``BK``: otherwise TMA cannot read the
    weight and torch's kernel beats the pointer kernel left. H200, 8192
    tokens top-8, µs against ``torch._grouped_mm`` (with its tail zeroing): E = 256
    gate_up fwd 1067 (1138) / dgrad 1038 (1125), down 556 (613) / 527 (577); E = 32
    gate_up 747 (773) / 748 (773), down 399 (424) / 380 (407)
    (``benchmark/results/h200_probe_bf16_ws_rows_2026-11-27_s14``). Operands TMA cannot
    describe take the Triton kernels."""
    if dgrad_contraction is not None and dgrad_contraction % HP_WS_CONFIG["BK"]:
        return False
    return HP_WS and t.dtype in (torch.bfloat16, torch.float16) and ws_capable(t)


def torch_grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run these bf16 operands: CUDA sm90, bf16, the
    GEMM dims (last dim of each operand, ``N`` and ``K`` of a 3-D weight) 16-byte
    multiples (TMA). Never on CPU/interpreter. Segment starts must be multiples of 8 rows
    as well (its wgrad contracts over the rows); that is the caller's to know (the
    layout's ``align``), since reading ``offsets`` would be a host sync."""
    if not hasattr(torch, "_grouped_mm") or INTERPRET:
        return False
    t0 = tensors[0]
    if t0.device.type != "cuda":
        return False
    if cuda_capability(t0.device) != (9, 0):
        return False
    for t in tensors:
        if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape[-1] % 8 != 0:
            return False
        if t.dim() == 3 and t.shape[-2] % 8 != 0:
            return False
        if t.data_ptr() % 16 != 0:
            return False
    return True


@triton.jit
def _zero_tail_kernel(c_ptr, offsets_ptr, R, J, E, stride_cm, BM: tl.constexpr,
                      BN: tl.constexpr):
    """Zero rows ``offsets[E] .. R`` of ``c``: a small grid strides over the tail's row
    tiles only, so the work (and the number of busy programs) follows the tail's size."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    used = tl.minimum(tl.maximum(tl.load(offsets_ptr + E), 0), R)
    zeros = tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty)
    for rt in range(used // BM + pid, tl.cdiv(R, BM), nprog):
        rows = (rt * BM + tl.arange(0, BM)).to(tl.int64)
        rmask = (rows >= used) & (rows < R)
        for c0 in range(0, J, BN):
            cols = c0 + tl.arange(0, BN)
            tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], zeros,
                     mask=rmask[:, None] & (cols < J)[None, :])


def zero_tail(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Zero rows ``>= offsets[E]`` of ``out [R, J]`` (stores only there; no sync)."""
    R, J = out.shape
    if R and J:
        BM, BN = 32, 256
        with device_guard(out):
            launch(_zero_tail_kernel, (min(cdiv(R, BM), 128),),
                out, offsets, R, J, offsets.numel() - 1, out.stride(0), BM=BM, BN=BN,
                num_warps=4)
    return out


# --------------------------------------------------------------------------------------
# Forward launchers
# --------------------------------------------------------------------------------------


def grouped_mm_fwd(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                   backend: str = "auto", block_m: int | None = None) -> torch.Tensor:
    """``out [R, N] = rows_e @ W_e^T`` per segment (high-precision operands).

    ``backend``: ``"auto"`` (on sm_90 the warp-specialized kernel, :func:`hp_ws_preferred`;
    else ``torch._grouped_mm`` when :func:`torch_grouped_mm_ok`, else Triton),
    ``"triton"`` (the warp-specialized kernel where it runs, else the Triton kernels) or
    ``"torch"``. Inputs are validated by the caller.
    """
    R, K = rows.shape
    E, N, _ = weight.shape
    use_torch = backend == "torch" or (backend == "auto" and not hp_ws_preferred(rows)
                                       and torch_grouped_mm_ok(rows, weight))
    if use_torch and R > 0 and N > 0:
        out = torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets[1:])
        return zero_tail(out, offsets)
    out = empty(R, N, dtype=rows.dtype, device=rows.device)
    return launch_grouped_rows(rows, weight, out, offsets, stride_be=N * K, stride_bi=1,
                               stride_bj=K, block_m=block_m)


# --------------------------------------------------------------------------------------
# FP8 blockwise
# --------------------------------------------------------------------------------------


def quantize_grouped_weight(weight: torch.Tensor, *, columnwise: bool = True,
                            pow2_scale: bool = False) -> Fp8Tensor:
    """Quantize per-expert weights ``[E, N, K]`` in 128x128 blocks per expert.

    Quantizes the ``[E*N, K]`` view with :func:`linghe.quantize_128x128`; ``N`` must be a
    multiple of 128 so that no block straddles two experts (then the container's own
    ``dequantize`` is exact). Returns an :class:`Fp8Tensor` of logical shape
    ``[E, N, K]`` with ``rowwise_data [E*N, K]``, ``rowwise_scale [E*N/128,
    ceil(K/128)]`` and, with ``columnwise=True`` (needed by the dgrad), the exact
    transpose ``columnwise_data [K, E*N]`` / ``columnwise_scale [ceil(K/128), E*N/128]``.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"weight must be a 3-D [E, N, K] tensor, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    E, N, K = weight.shape
    if N % BLOCK != 0:
        raise ValueError(f"FP8 grouped weights need N (weight.shape[1]) to be a multiple of "
                         f"128 so that 128x128 blocks stay within one expert, got N={N}")
    w2 = weight.reshape(E * N, K)
    if not w2.is_contiguous():
        w2 = w2.contiguous()
    q = quantize_128x128(w2, columnwise=columnwise, pow2_scale=pow2_scale)
    return Fp8Tensor(weight.shape, weight.dtype, rowwise_data=q.rowwise_data,
                     rowwise_scale=q.rowwise_scale, columnwise_data=q.columnwise_data,
                     columnwise_scale=q.columnwise_scale, scaling="128x128")


def grouped_mm_fp8_fwd(a_fp8: Fp8Tensor, w_fp8: Fp8Tensor, offsets: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16,
                       block_m: int | None = None, config: dict | None = None) -> torch.Tensor:
    """FP8 forward launcher: ``a_fp8`` rowwise 1x128 ``[R, K]``, ``w_fp8`` from
    :func:`quantize_grouped_weight` ``[E, N, K]`` -> ``[R, N]`` in ``out_dtype``.
    ``config``: pinned tiles/promotion form (see :func:`launch_grouped_rows`)."""
    q, s = a_fp8.rowwise_data, a_fp8.rowwise_scale
    R, K = q.shape
    E, N, _ = w_fp8.shape
    GK = cdiv(K, BLOCK)
    out = empty(R, N, dtype=out_dtype, device=q.device)
    # B_e[k, n] = Wq[e*N + n, k]; scale ws[(e*N + n) // 128, k // 128].
    return launch_grouped_rows(
        q, w_fp8.rowwise_data, out, offsets, stride_be=N * K, stride_bi=1, stride_bj=K,
        a_scale=s, b_scale=w_fp8.rowwise_scale,
        bs_strides=((N // BLOCK) * GK, 1, GK), block_m=block_m, config=config)


def fp8_dtype_ok(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


# --------------------------------------------------------------------------------------
# 1x128 quantization of rows grouped by expert (columnwise groups follow the segments)
# --------------------------------------------------------------------------------------


@triton.jit
def _quantize_grouped_kernel(x_ptr, xs_ptr, cnt_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
                             R, K, E, stride_x, stride_xs, ALIGN, NG,
                             FP8_IN: tl.constexpr, ROWWISE: tl.constexpr,
                             COLWISE: tl.constexpr, POW2: tl.constexpr, EP2: tl.constexpr,
                             ALIGN16: tl.constexpr):
    """One 128-row tile (:func:`~linghe.fwd.activation.expert_tile`: tiles start at each
    segment start and never cross it) x 128 columns. Reads only real rows (``FP8_IN``:
    fp8 data times its rowwise 1x128 scale), writes zeros (scale 1) on padding/tail rows."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    tile_start, real_end, seg_stop, _g, _gu, _i, _so, _u = expert_tile(
        cnt_ptr, E, R, pid_m, ALIGN, EP2)
    if ALIGN16:  # segment starts are multiples of 16: vector stores of the transposed tile
        tile_start, seg_stop = aligned16(tile_start, seg_stop)
    rows = tile_start.to(tl.int64) + tl.arange(0, 128)
    smask = (rows < seg_stop) & (rows < R)
    lmask = (rows < real_end) & smask
    cols = pid_n * 128 + tl.arange(0, 128)
    cmask = cols < K
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                mask=lmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if FP8_IN:
        xs = tl.load(xs_ptr + rows * stride_xs + pid_n, mask=lmask, other=0.0)
        x = x * xs[:, None]
    if ROWWISE:
        q, s = quant_rows(x, POW2)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q,
                 mask=smask[:, None] & cmask[None, :])
        tl.store(s_ptr + rows * tl.cdiv(K, 128) + pid_n, s, mask=smask)
    if COLWISE:
        qt, st = quant_cols(x, POW2)
        tl.store(qt_ptr + cols.to(tl.int64)[None, :] * R + rows[:, None], qt,
                 mask=smask[:, None] & cmask[None, :])
        tl.store(st_ptr + cols.to(tl.int64) * NG + pid_m, st, mask=cmask)


def quantize_grouped_fwd(x: torch.Tensor, counts: torch.Tensor, align: int, *,
                         x_scale: torch.Tensor | None = None, rowwise: bool = True,
                         columnwise: bool = True, pow2_scale: bool = False):
    """1x128 quantization of ``x [R, K]`` (rows grouped by expert, last dim contiguous),
    or of fp8 ``x`` times its rowwise scales ``x_scale [R, cdiv(K,128)]`` (dequantized in
    registers, then quantized again: the columnwise copy of an FP8-only buffer).

    Returns ``(q [R, K] | None, s [R, cdiv(K,128)] | None, qt [K, R] | None,
    st [K, G] | None)`` with ``G = cdiv(R,128) + E``: the columnwise groups follow the
    segments of ``counts [E]`` padded to ``align`` (as ``batch_silu_mul_quant_fwd``).
    Padding and tail rows are not read; their outputs are zeros with scale 1."""
    R, K = x.shape
    E = counts.numel()
    dev = x.device
    G = batch_col_groups(R, E)
    x_scale = groups_adjacent(x_scale)  # (the kernel reads a row's groups adjacent)
    q = s = qt = st = None
    if rowwise:
        q = empty(R, K, dtype=FP8_DTYPE, device=dev)
        s = empty(R, cdiv(K, BLOCK), dtype=torch.float32, device=dev)
    if columnwise:
        qt = empty(K, R, dtype=FP8_DTYPE, device=dev)
        st = empty(K, G, dtype=torch.float32, device=dev)
    if K > 0 and (rowwise or columnwise):
        with device_guard(x):
            launch(_quantize_grouped_kernel, (G, cdiv(K, BLOCK)),
                   x, x_scale if x_scale is not None else x, counts, q, s, qt, st, R, K, E,
                   x.stride(0) if R else K, x_scale.stride(0) if x_scale is not None and R
                   else 1, align, G, FP8_IN=x_scale is not None, ROWWISE=rowwise,
                   COLWISE=columnwise, POW2=pow2_scale, EP2=next_power_of_2(E + 1),
                   ALIGN16=align % 16 == 0, num_warps=4)
    return q, s, qt, st
