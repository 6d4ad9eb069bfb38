"""Blockwise FP8 quantization kernels and the in-kernel helpers fused kernels reuse.

In-kernel helpers (``@triton.jit``, import them into fused kernels):

- :func:`fp8_block_scale` — dequantization scale from an amax (``amax/448``, optional
  power-of-two round-up, amax 0 → 1), bit-exact with ``reference.fp8_scale``;
- :func:`quant_rows` / :func:`quant_cols` — quantize an fp32 tile in 1x128 groups along
  its columns (rowwise) or along its rows (columnwise); :func:`inv_scale` — the
  reciprocal of a scale as ``1.0 / s`` gives it, in fewer instructions.

Kernels of the 1x128 format (``quantize_1x128`` and, with an RMSNorm prologue,
``linghe.fwd.norm.rms_norm_quant_fwd``; launch knobs ``TILE_CONFIGS``, ``ROWS_CONFIG``,
``ROW_MODE``, ``ROWCOL_MODE``):

- :func:`_quantize_rows_kernel` (:func:`rows_program`): whole rows, rowwise copy;
- :func:`_quantize_1x128_kernel` (:func:`quant_tile`): ``[BM, BN]`` tiles, either copy or
  both, one tile per program (persistent loops over the tiles, Triton-pipelined or with a
  register prefetch, ran at 32-47 µs against 27.6 on an H200: benchmark/NOTES.md);
- :func:`_quantize_split_kernel`: both copies in one launch of row programs and
  columnwise tiles, chunk by chunk (the default for both copies).

The columnwise copy of a tile leaves through transposed addresses, or (``TILE_CONFIGS``
``pack``, the default of "split") cast 4 tokens at a time into 32-bit words
(:func:`store_cols_cvt4`), which makes Triton's transposing layout conversion 32-bit
instead of byte-wide (the same helpers serve ``batch_silu_mul_quant``).

Elements are multiplied by the reciprocal of their group's scale (one division per group,
not per element: per-element IEEE division ran 2.5x slower on an H200, and even a precise
per-group reciprocal cost 40% in the columnwise path). The reference does the same; on the
GPU the reciprocal may differ from IEEE by an ulp for non-power-of-two scales, so rare
elements land one e4m3 step apart (power-of-two scales are exact).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..utils import (
    _INTERPRET_C,
    FLOAT_DTYPES,
    cdiv,
    check_kernel_device,
    check_tensor,
    device_guard,
    empty,
    launch,
    num_sms,
    rows_view,
)
from .tensor import Fp8Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


@triton.jit
def to_e4m3(x):
    """Cast fp32 ``x`` to e4m3 with round-to-nearest-even.

    On the GPU this is the hardware cast. The triton 3.9 interpreter loses the carry when
    rounding up crosses a power of two (127.2 becomes 64), so there we first round to e4m3
    precision in fp32 (3 mantissa bits; a fixed 2^-9 step below 2^-6), after which the
    cast is exact, and write NaN (0x7F) ourselves, which its cast turns into a number.
    """
    if _INTERPRET_C:
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32,
                                                                         bitcast=True)
        subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
        nan = tl.full(x.shape, 0x7F, tl.int8).to(tl.float8e4nv, bitcast=True)
        return tl.where(x != x, nan, x.to(tl.float8e4nv))
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def fp8_block_scale(amax, POW2: tl.constexpr):
    """Dequantization scale for blocks with absolute maximum ``amax`` (fp32)."""
    s = amax / 448.0
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        s = ((bits + 0x007FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(amax == 0.0, 1.0, s)


@triton.jit
def _rcp_approx(s):
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [s],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def inv_scale(s, POW2: tl.constexpr):
    """``1.0 / s`` for a scale ``s`` of :func:`fp8_block_scale`, bit for bit, in fewer
    instructions. On the GPU ``1.0 / s`` is PTX ``div.full.f32``: MUFU.RCP of ``s``, with
    ``s`` and the result scaled by 2^24 when ``s`` is subnormal and by 1/4 when it is above
    2^126 (~8 instructions; every thread computes the scales of all groups it holds
    elements of, 16 per thread in the columnwise tiles). A scale is never above 2^126
    unless inf (``amax / 448 <= FLT_MAX / 448``), where MUFU.RCP gives div.full's 0 too,
    so only the subnormal fix-up is kept; a power-of-two scale is never subnormal (nor is
    one of 0, inf, NaN a problem: MUFU.RCP gives div.full's inf, 0, NaN): one MUFU.RCP."""
    if _INTERPRET_C:
        return 1.0 / s
    elif POW2:
        return _rcp_approx(s)
    else:
        tiny = s < 1.1754943508222875e-38
        r = _rcp_approx(tl.where(tiny, s * 16777216.0, s))
        return tl.where(tiny, r * 16777216.0, r)


@triton.jit
def quant_rows(x, POW2: tl.constexpr):
    """Quantize fp32 ``x [R, 128]``: one group per row. Returns ``(q e4m3, scale [R])``."""
    scale = fp8_block_scale(tl.max(tl.abs(x), axis=1), POW2)
    q = to_e4m3(x * inv_scale(scale, POW2)[:, None])
    return q, scale


@triton.jit
def quant_cols(x, POW2: tl.constexpr):
    """Quantize fp32 ``x [128, C]``: one group per column. Returns ``(q e4m3, scale [C])``."""
    scale = fp8_block_scale(tl.max(tl.abs(x), axis=0), POW2)
    q = to_e4m3(x * inv_scale(scale, POW2)[None, :])
    return q, scale


@triton.jit
def quant_row_groups(y, rows, k0, q_ptr, s_ptr, M, K, stride_sm, stride_sg,
                     BK: tl.constexpr, POW2: tl.constexpr):
    """Quantize fp32 ``y [R, BK]`` (``BK`` a multiple of 128): rows ``rows`` (int64),
    columns ``k0 + [0, BK)`` of an ``[M, K]`` tensor (``k0`` a multiple of 128), in 1x128
    groups along its columns, and store the data ``[M, K]`` (contiguous) and the scales
    (``s[row, group]`` at ``row * stride_sm + group * stride_sg``). Out-of-range columns
    must be 0 in ``y``."""
    G: tl.constexpr = BK // 128
    R: tl.constexpr = y.shape[0]
    y3 = tl.reshape(y, [R, G, 128])
    scale = fp8_block_scale(tl.max(tl.abs(y3), axis=2), POW2)
    q = tl.reshape(to_e4m3(y3 * inv_scale(scale, POW2)[:, :, None]), [R, BK])
    rmask = rows < M
    cols = k0 + tl.arange(0, BK)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q,
             mask=rmask[:, None] & (cols < K)[None, :])
    g = k0 // 128 + tl.arange(0, G)
    tl.store(s_ptr + rows[:, None] * stride_sm + g[None, :] * stride_sg, scale,
             mask=rmask[:, None] & (g < tl.cdiv(K, 128))[None, :])


@triton.jit
def rows_program(x_ptr, w_ptr, q_ptr, s_ptr, rstd_ptr, r0, M, K, stride_x, stride_sm,
                 stride_sg, eps, RB: tl.constexpr, BK: tl.constexpr, SINGLE: tl.constexpr,
                 NORM: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr, w_pre=None,
                 W_PRE: tl.constexpr = False):
    """Rows ``[r0, r0 + RB)`` of ``x [M, K]`` quantized rowwise in 1x128 groups
    (:func:`quant_row_groups`). With ``NORM`` the rows are RMS-normalized first: ``rstd =
    1 / sqrt(mean(x^2) + eps)`` is stored and ``y = x * rstd * w`` (fp32) quantized;
    ``QUANT=False`` (with ``NORM``) only stores ``rstd``. ``SINGLE``: the whole row in one
    ``BK >= K`` piece; else ``BK``-column blocks (with ``NORM`` two passes: the sum of
    squares, then the rows again, from L1/L2). ``W_PRE`` (``SINGLE``): ``w_pre`` is the
    weight, already loaded (fp32 ``[BK]``)."""
    rows = tl.arange(0, RB).to(tl.int64) + r0
    rmask = rows < M
    cols0 = tl.arange(0, BK)
    if SINGLE:
        cmask = cols0 < K
        y = tl.load(x_ptr + rows[:, None] * stride_x + cols0[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / K + eps)
            tl.store(rstd_ptr + rows, rstd, mask=rmask)
            if W_PRE:
                w = w_pre
            else:
                w = tl.load(w_ptr + cols0, mask=cmask, other=0.0).to(tl.float32)
            y = y * rstd[:, None] * w[None, :]
        if QUANT:
            quant_row_groups(y, rows, 0, q_ptr, s_ptr, M, K, stride_sm, stride_sg, BK, POW2)
    else:
        rstd = tl.zeros([RB], tl.float32)
        if NORM:
            acc = tl.zeros([RB, BK], tl.float32)
            for k0 in range(0, K, BK):
                cols = k0 + cols0
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                            mask=rmask[:, None] & (cols < K)[None, :],
                            other=0.0).to(tl.float32)
                acc += x * x
            rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / K + eps)
            tl.store(rstd_ptr + rows, rstd, mask=rmask)
        if QUANT:
            for k0 in range(0, K, BK):
                cols = k0 + cols0
                cmask = cols < K
                y = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                            mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                if NORM:
                    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                    y = y * rstd[:, None] * w[None, :]
                quant_row_groups(y, rows, k0, q_ptr, s_ptr, M, K, stride_sm, stride_sg, BK,
                                 POW2)


@triton.jit
def _quantize_rows_kernel(x_ptr, w_ptr, q_ptr, s_ptr, rstd_ptr, M, K, stride_x, stride_sm,
                          stride_sg, eps, RB: tl.constexpr, BK: tl.constexpr,
                          SINGLE: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr,
                          POW2: tl.constexpr, PERSIST: tl.constexpr = False):
    """Program ``pid``: :func:`rows_program` on rows ``[pid * RB, pid * RB + RB)``; with
    ``PERSIST`` on every ``nprog``-th block of ``RB`` rows from ``pid`` on, the weight
    loaded once (``NORM``, ``SINGLE``)."""
    if PERSIST:
        W_PRE: tl.constexpr = NORM and SINGLE
        w = tl.zeros([BK], tl.float32)
        if W_PRE:
            cols0 = tl.arange(0, BK)
            w = tl.load(w_ptr + cols0, mask=cols0 < K, other=0.0).to(tl.float32)
        for blk in range(tl.program_id(0), tl.cdiv(M, RB), tl.num_programs(0)):
            rows_program(x_ptr, w_ptr, q_ptr, s_ptr, rstd_ptr, blk * RB, M, K, stride_x,
                         stride_sm, stride_sg, eps, RB, BK, SINGLE, NORM, QUANT, POW2, w,
                         W_PRE)
    else:
        rows_program(x_ptr, w_ptr, q_ptr, s_ptr, rstd_ptr, tl.program_id(0) * RB, M, K,
                     stride_x, stride_sm, stride_sg, eps, RB, BK, SINGLE, NORM, QUANT, POW2)


@triton.jit
def _tile_coords(t, ntiles, nm, nk, BM: tl.constexpr, BN: tl.constexpr,
                 K_FAST: tl.constexpr, REVERSE: tl.constexpr):
    """Tile ``t`` of the ``[nm, nk]`` grid of ``[BM, BN]`` tiles: ``(pid_m, pid_k, rows
    int64, cols)``. ``K_FAST``: consecutive ``t`` walk a row block's column blocks (else a
    column block's row blocks); ``REVERSE``: from the last tile. ``t >= ntiles`` gives
    rows past ``M`` (an empty, fully masked tile)."""
    if REVERSE:
        t = ntiles - 1 - t
    if K_FAST:
        pid_m = t // nk
        pid_k = t - pid_m * nk
    else:
        pid_k = t // nm
        pid_m = t - pid_k * nm
    valid = (t >= 0) & (t < ntiles)
    pid_m = tl.where(valid, pid_m, nm)
    pid_k = tl.where(valid, pid_k, nk)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_k * BN + tl.arange(0, BN)
    return pid_m, pid_k, rows, cols


@triton.jit
def _load_tile(x_ptr, w_ptr, rstd_ptr, rows, cols, M, K, stride_xm, NORM: tl.constexpr):
    """The raw ``x`` tile (zeros out of range) and, with ``NORM``, its rows' ``rstd``
    (fp32) and its columns' weight (raw); without ``NORM`` those two are ``x`` again."""
    rmask = rows < M
    cmask = cols < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :],
                mask=rmask[:, None] & cmask[None, :], other=0.0)
    if NORM:
        r = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
        return x, r, w
    else:
        return x, x, x


@triton.jit
def packed_row_order(RPT: tl.constexpr):
    """``[128]`` int32: the tile row (0..127) that logical row ``i`` of a packed-store tile
    loads, ``(i % L) * RPT + i // L`` with ``L = 128 // RPT``. Triton holds a ``[128, 128]``
    tile of the quantizing kernels in row repetitions ``i = l + L * k`` (``l`` over lanes
    and warps, ``k`` over a thread's registers: ``L = 16`` at 4 warps, sm_90, triton 3.6 and
    3.9), so with this order the ``RPT`` rows a thread holds are consecutive tokens and its
    columnwise fp8 values pack into whole 32-bit words without leaving the thread
    (:func:`store_cols_packed`). Any order gives the same results; this one is fast."""
    L: tl.constexpr = 128 // RPT
    i = tl.arange(0, 128)
    return (i % L) * RPT + i // L


@triton.jit
def store_cols_packed(qt, qt32_ptr, tile_start, cols, cmask, stop, M,
                      RPT: tl.constexpr):
    """Store the columnwise fp8 tile ``qt [128, C]`` (logical rows in
    :func:`packed_row_order`, tile rows from ``tile_start``) transposed into ``q_t [N, M]``,
    given as int32 words (``qt32_ptr``; ``M`` and ``tile_start`` multiples of 16). The 4
    tokens of a word are packed in registers (byte ``k`` = token ``4 j + k``) and the tile
    leaves as ``[C, 32]`` words, a 128-byte row of ``q_t`` per column, through a 32-bit
    layout conversion instead of an 8-bit one (which Triton writes to shared memory a byte
    at a time, 8-way bank conflicted). Tokens ``>= stop`` (a multiple of 16) are not
    written."""
    C: tl.constexpr = qt.shape[1]
    L: tl.constexpr = 128 // RPT
    b = tl.reshape(qt.to(tl.uint8, bitcast=True).to(tl.int32), [RPT // 4, 4, L, C])
    sh = tl.arange(0, 4) * 8
    w = tl.sum(b << sh[None, :, None, None], axis=1)  # disjoint bytes: the sum is an OR
    w = tl.reshape(tl.permute(w, (2, 1, 0)), [C, 32])  # word j = l * RPT // 4 + k // 4
    _store_col_words(w, qt32_ptr, tile_start, cols, cmask, stop, M)


@triton.jit
def _store_col_words(w, qt32_ptr, tile_start, cols, cmask, stop, M):
    """Store ``w [C, 32]`` int32 (word ``j`` of column ``c``: tokens ``tile_start + 4 j``
    .. ``+ 3``) into ``q_t [N, M]`` given as int32 words: a 128-byte row per column.
    Tokens ``>= stop`` (a multiple of 16) are not written."""
    j = tl.arange(0, 32)
    # (M // 16 * 4 == M // 4 and tile_start // 16 * 4 == tile_start // 4 for multiples of
    # 16, written so that the compiler sees 16-byte aligned rows of 4 words.)
    ptr = (qt32_ptr + cols.to(tl.int64)[:, None] * (M // 16 * 4)
           + (tile_start // 16 * 4 + j)[None, :])
    nw = (stop - tile_start) // 16 * 4  # words in range, in whole 16-byte vectors
    tl.store(ptr, w, mask=cmask[:, None] & (j < nw)[None, :])


@triton.jit
def e4m3x4(a, b, c, d):
    """int32 words of the e4m3 casts of fp32 ``a, b, c, d`` (byte 0 = ``a`` .. byte 3 =
    ``d``), bit for bit :func:`to_e4m3`: two
    ``cvt.rn.satfinite.e4m3x2.f32`` (Triton's own cast; the first source goes to the high
    byte) merged into one word."""
    if _INTERPRET_C:
        w = to_e4m3(a).to(tl.uint8, bitcast=True).to(tl.int32)
        w = w | (to_e4m3(b).to(tl.uint8, bitcast=True).to(tl.int32) << 8)
        w = w | (to_e4m3(c).to(tl.uint8, bitcast=True).to(tl.int32) << 16)
        return w | (to_e4m3(d).to(tl.uint8, bitcast=True).to(tl.int32) << 24)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }",
            "=r,f,f,f,f", [a, b, c, d], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def store_cols_cvt4(y, qt32_ptr, tile_start, cols, cmask, stop, M, RPT: tl.constexpr,
                    POW2: tl.constexpr):
    """``quant_cols(y)`` of fp32 ``y [128, C]`` (logical rows in :func:`packed_row_order`)
    stored as :func:`store_cols_packed` stores it (the same words); returns the scales
    ``[C]``. Each word is cast from its 4 tokens at once (:func:`e4m3x4`): a thread's
    ``RPT`` rows are consecutive tokens, so splitting the row axis into (word, token pair,
    token) only relabels registers, where Triton's cast of the tile pairs two *columns* of
    a token and the bytes are then moved between words (~3 integer ops per byte, sm_90)."""
    C: tl.constexpr = y.shape[1]
    L: tl.constexpr = 128 // RPT
    scale = fp8_block_scale(tl.max(tl.abs(y), axis=0), POW2)
    v = y * inv_scale(scale, POW2)[None, :]
    # logical row i = k * L + l holds token l * RPT + k, k = 4 * wd + 2 * b1 + b0
    v = tl.reshape(v, [RPT // 4, 2, 2, L, C])                 # (wd, b1, b0, l, c)
    ev, od = tl.split(tl.permute(v, (0, 1, 3, 4, 2)))         # b0 = 0 / 1
    t0, t2 = tl.split(tl.permute(ev, (0, 2, 3, 1)))           # (wd, l, c), b1 = 0 / 1
    t1, t3 = tl.split(tl.permute(od, (0, 2, 3, 1)))
    w = e4m3x4(t0, t1, t2, t3)                                # [RPT // 4, L, C]
    w = tl.reshape(tl.permute(w, (2, 1, 0)), [C, 32])         # word j = l * RPT // 4 + wd
    _store_col_words(w, qt32_ptr, tile_start, cols, cmask, stop, M)
    return scale


@triton.jit
def quant_tile(x, rstd, w, rows, cols, pid_m, pid_k, q_ptr, s_ptr, qt_ptr, st_ptr, M, K,
               stride_sm, stride_sg, stride_stk, stride_stg, ROWWISE: tl.constexpr,
               COLWISE: tl.constexpr, NORM: tl.constexpr, POW2: tl.constexpr,
               PACK: tl.constexpr = False, RPT: tl.constexpr = 8):
    """Quantize the tile ``x [BM, BN]`` (rows ``rows`` int64 of row block ``pid_m``,
    columns ``cols`` of column block ``pid_k`` of an ``[M, K]`` tensor; zeros out of
    range), with ``NORM`` first ``y = x * rstd[:, None] * w[None, :]`` in fp32, and store
    it in the 1x128 layout: with ``ROWWISE`` (``BN == 128``) data ``[M, K]`` and scales
    ``s[m, k // 128]``; with ``COLWISE`` (``BM == 128``) the transposed data ``[K, M]``
    (``q_t[k, m]``: each column's 128 tokens are one 128-byte row of ``q_t``) and scales
    ``s_t[k, m // 128]`` (scale strides as given). ``PACK`` (``COLWISE``; rows in
    :func:`packed_row_order` of ``RPT``, ``M`` a multiple of 16, ``qt_ptr`` as int32): the
    columnwise data is cast and stored 4 tokens a word (:func:`store_cols_cvt4`)."""
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    y = x.to(tl.float32)
    if NORM:
        y = y * rstd[:, None] * w.to(tl.float32)[None, :]
    if ROWWISE:
        q, s = quant_rows(y, POW2)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * stride_sm + pid_k * stride_sg, s, mask=rmask)
    if COLWISE:
        if PACK:
            st = store_cols_cvt4(y, qt_ptr, pid_m * 128, cols, cmask, M, M, RPT, POW2)
        else:
            qt, st = quant_cols(y, POW2)
            tl.store(qt_ptr + cols[None, :].to(tl.int64) * M + rows[:, None], qt, mask=mask)
        tl.store(st_ptr + cols * stride_stk + pid_m * stride_stg, st, mask=cmask)


@triton.jit
def _quantize_1x128_kernel(x_ptr, w_ptr, rstd_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K,
                           stride_xm, stride_sm, stride_sg, stride_stk, stride_stg,
                           BM: tl.constexpr, BN: tl.constexpr, ROWWISE: tl.constexpr,
                           COLWISE: tl.constexpr, NORM: tl.constexpr, POW2: tl.constexpr,
                           K_FAST: tl.constexpr, REVERSE: tl.constexpr,
                           PACK: tl.constexpr = False, RPT: tl.constexpr = 8):
    """1x128 quantization of ``x [M, K]`` (optionally RMS-normalized: ``NORM``) in
    ``[BM, BN]`` tiles (see :func:`quant_tile`; ``PACK``: its packed columnwise store), one
    tile per program in the order of :func:`_tile_coords`."""
    nm = tl.cdiv(M, BM)
    nk = tl.cdiv(K, BN)
    pid_m, pid_k, rows, cols = _tile_coords(tl.program_id(0), nm * nk, nm, nk, BM, BN,
                                            K_FAST, REVERSE)
    if PACK:
        rows = pid_m.to(tl.int64) * BM + packed_row_order(RPT)
    x, r, w = _load_tile(x_ptr, w_ptr, rstd_ptr, rows, cols, M, K, stride_xm, NORM)
    quant_tile(x, r, w, rows, cols, pid_m, pid_k, q_ptr, s_ptr, qt_ptr, st_ptr, M, K,
               stride_sm, stride_sg, stride_stk, stride_stg, ROWWISE, COLWISE, NORM, POW2,
               PACK, RPT)


@triton.jit
def _quantize_split_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, stride_xm, stride_sm,
                           stride_sg, stride_stk, stride_stg, RB: tl.constexpr,
                           BK: tl.constexpr, SINGLE: tl.constexpr, BN: tl.constexpr,
                           POW2: tl.constexpr, PACK: tl.constexpr = False,
                           RPT: tl.constexpr = 8):
    """Both 1x128 copies of ``x [M, K]`` in one launch of two kinds of independent
    programs, per 128-row chunk in program-id order: ``128 // RB`` row programs
    (:func:`rows_program`: the rowwise copy of ``RB`` whole rows), then ``cdiv(K, BN)``
    column tiles (:func:`quant_tile`, columnwise only; ``PACK``: its packed store), which
    re-read the chunk the row programs just read, from L2."""
    NR: tl.constexpr = 128 // RB
    nk = tl.cdiv(K, BN)
    pid = tl.program_id(0)
    c = pid // (NR + nk)
    i = pid - c * (NR + nk)
    if i < NR:
        rows_program(x_ptr, x_ptr, q_ptr, s_ptr, s_ptr, c * 128 + i * RB, M, K, stride_xm,
                     stride_sm, stride_sg, 0.0, RB, BK, SINGLE, False, True, POW2)
    else:
        if PACK:
            rows = c.to(tl.int64) * 128 + packed_row_order(RPT)
        else:
            rows = c.to(tl.int64) * 128 + tl.arange(0, 128)
        cols = (i - NR) * BN + tl.arange(0, BN)
        x, r, w = _load_tile(x_ptr, x_ptr, x_ptr, rows, cols, M, K, stride_xm, False)
        quant_tile(x, r, w, rows, cols, c, i - NR, q_ptr, s_ptr, qt_ptr, st_ptr, M, K,
                   stride_sm, stride_sg, stride_stk, stride_stg, False, True, False, POW2,
                   PACK, RPT)


@triton.jit
def _quantize_128x128_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, N, K, stride_wn,
                             COLWISE: tl.constexpr, POW2: tl.constexpr,
                             RELOAD_T: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n.to(tl.int64) * 128 + tl.arange(0, 128)
    cols = pid_k * 128 + tl.arange(0, 128)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    scale = fp8_block_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0), POW2)
    q = to_e4m3(w * (1.0 / scale))
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(s_ptr + pid_n * tl.cdiv(K, 128) + pid_k, scale)
    if COLWISE:
        tmask = (cols < K)[:, None] & (rows < N)[None, :]
        if RELOAD_T:
            # float32 input: re-read the block transposed (from L2) and quantize it with the
            # same scale instead of transposing the fp8 tile in registers (tl.trans of that
            # fp8 layout is the suspect for the corrupted columnwise copies of fp32 weights
            # seen on an H200; bf16 inputs were verified there). Bit-identical result.
            wt = tl.load(w_ptr + rows[None, :] * stride_wn + cols[:, None], mask=tmask,
                         other=0.0).to(tl.float32)
            qt = to_e4m3(wt * (1.0 / scale))
        else:
            qt = tl.trans(q)
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * N + rows[None, :], qt, mask=tmask)
        tl.store(st_ptr + pid_k * tl.cdiv(N, 128) + pid_n, scale)


#: Launch configurations of :func:`_quantize_1x128_kernel` for ``quantize_1x128`` (tuning
#: knobs; ``benchmark/probe_tilequant.py`` sweeps them), by the copies asked for: "rc"
#: rowwise + columnwise, "r" rowwise, "c" columnwise. Keys: ``bm``/``bn`` the tile (``bn``
#: 128 with the rowwise copy, ``bm`` 128 with the columnwise one); ``warps``; ``k_fast``
#: the tile order (:func:`_tile_coords`); ``pack`` (entries with the columnwise copy):
#: the columnwise data cast and stored 4 tokens a 32-bit word (:func:`store_cols_cvt4`)
#: where ``M`` is a multiple of 16 (the plain fp8 store otherwise; same bits), ``rpt``
#: overrides :func:`pack_rows_per_thread`. "split" packs: H200, [8192, 2048] bf16, both
#: copies 24.3 -> 22.9 us (``h200_probe_small_bw_not_kept_2026-11-26_s10``: the store
#: through Triton's tile cast and byte-wide transposing conversion was the difference; the
#: helper branch's packing of Triton's casts without the 4-token cast failed the GPU
#: tests for fp32 inputs and was not kept).
TILE_CONFIGS = {
    "rc": dict(bm=128, bn=128, warps=4, k_fast=False),
    "r": dict(bm=32, bn=128, warps=8, k_fast=False),
    "c": dict(bm=128, bn=64, warps=4, k_fast=False),
    # the columnwise tiles (``bn``) and the warps of ROWCOL_MODE "split"
    "split": dict(bm=128, bn=64, warps=4, pack=True),
}
#: Launch configuration of :func:`_quantize_rows_kernel` for ``quantize_1x128``: at most
#: ``rows`` rows and ``elems`` elements per program, ``warps``, widest row held in one
#: piece (``max_bk``; wider rows go in ``max_bk`` blocks); ``per_sm`` (optional): a
#: persistent grid of that many programs per SM (the weight of RMSNorm loaded once).
ROWS_CONFIG = dict(rows=4, elems=8192, warps=8, max_bk=8192)
#: Kernels of ``quantize_1x128``: the rowwise copy alone from the "tiles" kernel or the
#: "rows" kernel; both copies from the tiles in one pass ("tiles"); "rows_cols": the rows
#: kernel, then the columnwise tiles in reverse order (re-reading x, partly from L2);
#: "split": :func:`_quantize_split_kernel` (rows and columnwise tiles in one launch, chunk
#: by chunk; ROWS_CONFIG and TILE_CONFIGS["split"]). "split" is the default: 24.5 against
#: 27.6 µs for "tiles" on an H200 at [8192, 2048]; rowwise only, "rows" 15.8 against 16.4
#: µs for "tiles" (``h200_probe_tilequant_2026-11-26.*``).
ROW_MODE = "rows"
ROWCOL_MODE = "split"


def rows_tile(K: int, config: dict) -> tuple[int, int, bool]:
    """``(RB rows, BK columns, SINGLE)`` of a :func:`_quantize_rows_kernel` program for
    ``K`` columns: whole rows up to ``config["max_bk"]`` columns (at most
    ``config["rows"]`` rows and ``config["elems"]`` elements, a power of two), else one
    row in blocks of ``max_bk`` columns."""
    bk = max(BLOCK, 1 << (K - 1).bit_length())
    if bk > config["max_bk"]:
        return 1, config["max_bk"], False
    rb = max(1, min(config["rows"], config["elems"] // bk))
    return 1 << (rb.bit_length() - 1), bk, True


def launch_1x128_rows(x2: torch.Tensor, q, s, config: dict, *, pow2_scale: bool,
                      weight: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
                      eps: float = 0.0) -> None:
    """Launch :func:`_quantize_rows_kernel` on ``x2 [M, K]`` (last dim contiguous, ``M``
    and ``K`` > 0): the rowwise copy ``q, s`` (:func:`empty_1x128`; ``None``: only
    ``rstd``, which needs ``weight``) and, with ``weight [K]``, RMSNorm first (``rstd
    [M]`` float32 written). ``config``: like :data:`ROWS_CONFIG`."""
    M, K = x2.shape
    rb, bk, single = rows_tile(K, config)
    ssm, ssg = s.stride() if s is not None else (0, 0)
    grid = cdiv(M, rb)
    per_sm = config.get("per_sm", 0)
    if per_sm:
        grid = min(grid, per_sm * num_sms(x2.device))
    with device_guard(x2):
        launch(_quantize_rows_kernel, (grid,), x2, weight, q, s, rstd, M, K,
               x2.stride(0), ssm, ssg, float(eps), RB=rb, BK=bk, SINGLE=single,
               NORM=weight is not None, QUANT=q is not None, POW2=pow2_scale,
               PERSIST=per_sm > 0, num_warps=config["warps"])


def pack_rows_per_thread(x2: torch.Tensor, config: dict, qt, rowwise: bool) -> int:
    """``RPT`` of the packed columnwise store (:func:`packed_row_order`) for ``config``'s
    ``[128, bn]`` tiles of ``x2`` (``rowwise``: the tile also stores the rowwise copy), or
    0 for the plain store (``config["pack"]`` off, no columnwise copy ``qt``, or ``M`` not
    a multiple of 16); ``config["rpt"]`` overrides it. Triton lays the tile out in 16-byte
    vectors along its columns (of the rowwise fp8 store where there is one, else of the
    load), lanes first along the columns, then the remaining lanes and the warps along the
    rows, so one repetition covers ``L`` rows and a thread holds ``128 // L`` of them (any
    ``RPT`` gives the same bits; the right one avoids shuffles)."""
    if qt is None or not config.get("pack") or x2.shape[0] % 16:
        return 0
    if config.get("rpt"):
        return config["rpt"]
    vec = 16 if rowwise else 16 // x2.element_size()
    lanes_k = min(32, max(1, config["bn"] // vec))
    rows_per_rep = min(BLOCK, 32 // lanes_k * config["warps"])
    return max(4, BLOCK // rows_per_rep)


def launch_1x128_tiles(x2: torch.Tensor, q, s, qt, st, config: dict, *, pow2_scale: bool,
                       weight: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
                       reverse: bool = False) -> None:
    """Launch :func:`_quantize_1x128_kernel` on ``x2 [M, K]`` (last dim contiguous, ``M``
    and ``K`` > 0) into the components ``q, s`` (rowwise) and ``qt, st`` (columnwise) of
    :func:`empty_1x128` (``None`` for a copy not asked for; scales in any strides).
    With ``weight [K]`` and ``rstd [M]`` float32 the tile quantized is RMSNorm's output
    ``x * rstd * weight`` (fp32 math). ``config``: a :data:`TILE_CONFIGS` entry;
    ``reverse``: tiles from the last one (to find the rows a previous kernel read last
    still in L2)."""
    M, K = x2.shape
    bm, bn = config["bm"], config["bn"]
    if q is not None and bn != BLOCK or qt is not None and bm != BLOCK:
        raise ValueError(f"tile {bm}x{bn} does not hold whole 1x128 groups")
    ssm, ssg = s.stride() if s is not None else (0, 0)
    sstk, sstg = st.stride() if st is not None else (0, 0)
    rpt = pack_rows_per_thread(x2, config, qt, q is not None)
    with device_guard(x2):
        launch(_quantize_1x128_kernel, (cdiv(M, bm) * cdiv(K, bn),),
               x2, weight, rstd, q, s, qt.view(torch.int32) if rpt else qt, st, M, K,
               x2.stride(0), ssm, ssg, sstk, sstg,
               BM=bm, BN=bn, ROWWISE=q is not None, COLWISE=qt is not None,
               NORM=weight is not None, POW2=pow2_scale, K_FAST=config.get("k_fast", False),
               REVERSE=reverse, PACK=rpt > 0, RPT=rpt or 8, num_warps=config["warps"])


def launch_1x128_split(x2: torch.Tensor, q, s, qt, st, rows_config: dict,
                       tile_config: dict, *, pow2_scale: bool) -> None:
    """Launch :func:`_quantize_split_kernel` on ``x2 [M, K]`` (``M``, ``K`` > 0) into all
    four components of :func:`empty_1x128`: row programs as ``rows_config``
    (:func:`rows_tile`, at most 128 rows), column tiles of
    ``tile_config["bn"]`` columns, ``tile_config["warps"]`` warps for both."""
    M, K = x2.shape
    rb, bk, single = rows_tile(K, rows_config)
    rb = min(rb, BLOCK)
    bn = tile_config["bn"]
    grid = cdiv(M, BLOCK) * (BLOCK // rb + cdiv(K, bn))
    rpt = pack_rows_per_thread(x2, tile_config, qt, False)
    with device_guard(x2):
        launch(_quantize_split_kernel, (grid,), x2, q, s, qt.view(torch.int32) if rpt else qt,
               st, M, K, x2.stride(0), s.stride(0), s.stride(1), st.stride(0), st.stride(1),
               RB=rb, BK=bk, SINGLE=single, BN=bn, POW2=pow2_scale, PACK=rpt > 0,
               RPT=rpt or 8, num_warps=tile_config["warps"])


def groups_adjacent(scale: torch.Tensor | None) -> torch.Tensor | None:
    """1x128 scales ``[rows, groups]`` with a row's groups adjacent in memory (unit stride
    along the last dim), as the kernels that take only a row stride read them: ``scale``
    itself, or a contiguous copy of scales stored otherwise (e.g. the group-major ones of
    ``rms_norm_quant``, or any transposed view a caller built), so that no kernel reads
    such scales at the wrong places."""
    if scale is None or scale.dim() < 2 or scale.shape[-1] <= 1 or scale.stride(-1) == 1:
        return scale
    return scale.contiguous()


def empty_1x128(M: int, K: int, device, *, rowwise: bool, columnwise: bool,
                group_major: bool = False):
    """Allocate the four 1x128 components (``None`` where not asked) for ``[M, K]``.

    The scales are ``[rows, groups]`` tensors; ``group_major`` stores them transposed in
    memory (strides ``(1, rows)``): the layout cuBLAS's blockwise FP8 GEMM reads, so a
    GEMM through ``torch._scaled_mm`` needs no re-layout copy."""
    q = s = qt = st = None
    f32 = torch.float32
    if rowwise:
        q = empty(M, K, dtype=FP8_DTYPE, device=device)
        G = cdiv(K, BLOCK)
        s = empty(G, M, dtype=f32, device=device).t() if group_major else \
            empty(M, G, dtype=f32, device=device)
    if columnwise:
        qt = empty(K, M, dtype=FP8_DTYPE, device=device)
        G = cdiv(M, BLOCK)
        st = empty(G, K, dtype=f32, device=device).t() if group_major else \
            empty(K, G, dtype=f32, device=device)
    return q, s, qt, st


def quantize_1x128(x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False,
                   pow2_scale: bool = False) -> Fp8Tensor:
    """Quantize activations/gradients to FP8 e4m3 in 1x128 groups.

    Args:
        x: ``[..., K]`` float32/float16/bfloat16 with a contiguous last dim; leading dims
            are flattened to ``M`` rows.
        rowwise: produce ``rowwise_data [M, K]`` and ``rowwise_scale [M, ceil(K/128)]``
            (groups of 128 consecutive elements of a row).
        columnwise: produce ``columnwise_data [K, M]`` and ``columnwise_scale
            [K, ceil(M/128)]`` (the transpose quantized in groups of 128 tokens; in
            one launch with the rowwise copy, which reads ``x`` from memory once: see
            ``ROWCOL_MODE``).
        pow2_scale: round each scale up to a power of two.

    Returns an :class:`Fp8Tensor` with ``x``'s shape and dtype. ``scale = amax/448`` per
    group, an all-zero group gets scale 1; tails (M or K not a multiple of 128) are partial
    groups. NaN/Inf in a group give NaN in the data (never an error).
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1, last_dim_contiguous=True)
    check_kernel_device("x", x)
    if not (rowwise or columnwise):
        raise ValueError("quantize_1x128 needs rowwise=True or columnwise=True")
    if torch.compiler.is_compiling():
        from .. import library  # (lazy: linghe.library imports this module)
        return library.quantize_1x128(x, rowwise, columnwise, pow2_scale)
    q, s, qt, st = quantize_1x128_launch(rows_view(x), rowwise, columnwise, pow2_scale)
    return Fp8Tensor(x.shape, x.dtype, rowwise_data=q, rowwise_scale=s,
                     columnwise_data=qt, columnwise_scale=st, scaling="1x128")


def quantize_1x128_launch(x2: torch.Tensor, rowwise: bool, columnwise: bool,
                          pow2_scale: bool, group_major_scales: bool = False):
    """The launcher of :func:`quantize_1x128` on ``x2 [M, K]`` (last dim contiguous):
    ``(q, s, qt, st)``, ``None`` for the copies not asked for; the scales in the layout
    :func:`empty_1x128` says (``group_major_scales``)."""
    M, K = x2.shape
    q, s, qt, st = empty_1x128(M, K, x2.device, rowwise=rowwise, columnwise=columnwise,
                               group_major=group_major_scales)
    if M > 0 and K > 0:
        if rowwise and columnwise and ROWCOL_MODE == "tiles":
            launch_1x128_tiles(x2, q, s, qt, st, TILE_CONFIGS["rc"], pow2_scale=pow2_scale)
        elif rowwise and columnwise and ROWCOL_MODE == "split":
            launch_1x128_split(x2, q, s, qt, st, ROWS_CONFIG, TILE_CONFIGS["split"],
                               pow2_scale=pow2_scale)
        else:
            if rowwise and (columnwise or ROW_MODE == "rows"):
                launch_1x128_rows(x2, q, s, ROWS_CONFIG, pow2_scale=pow2_scale)
            elif rowwise:
                launch_1x128_tiles(x2, q, s, None, None, TILE_CONFIGS["r"],
                                   pow2_scale=pow2_scale)
            if columnwise:
                launch_1x128_tiles(x2, None, None, qt, st, TILE_CONFIGS["c"],
                                   pow2_scale=pow2_scale, reverse=rowwise)
    return q, s, qt, st


@triton.jit
def _dequantize_1x128_rows_kernel(q_ptr, s_ptr, out_ptr, M, K, stride_qm, stride_sm,
                                  stride_om, BM: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    pid_k = tl.program_id(1)
    cols = pid_k * 128 + tl.arange(0, 128)
    rmask = rows < M
    mask = rmask[:, None] & (cols < K)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + rows * stride_sm + pid_k, mask=rmask, other=1.0)
    x = q.to(tl.float32) * s[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             x.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_1x128_rows(q: torch.Tensor, scale: torch.Tensor,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rowwise 1x128 dequantization (kernel-level API): ``q [M, K]`` FP8 (last dim
    contiguous) times ``scale [M, ceil(K/128)]`` float32 -> ``[M, K]`` in ``dtype``,
    the values :func:`linghe.reference.dequantize_1x128` gives (fp32 product, then one
    rounding). One read of the FP8 rows and one write: what a bf16 consumer of an FP8
    activation (e.g. a high-precision weight gradient) needs."""
    check_tensor("q", q, dtypes=(FP8_DTYPE,), ndim=2, last_dim_contiguous=True)
    M, K = q.shape
    check_tensor("scale", scale, dtypes=(torch.float32,), shape=(M, cdiv(K, BLOCK)))
    scale = groups_adjacent(scale)
    check_kernel_device("q", q)
    out = empty(M, K, dtype=dtype, device=q.device)
    if M > 0 and K > 0:
        BM = 32
        with device_guard(q):
            launch(_dequantize_1x128_rows_kernel, (cdiv(M, BM), cdiv(K, BLOCK)),
                   q, scale, out, M, K, q.stride(0), scale.stride(0), out.stride(0), BM=BM,
                   num_warps=4)
    return out


def quantize_128x128(w: torch.Tensor, *, columnwise: bool = False,
                     pow2_scale: bool = False) -> Fp8Tensor:
    """Quantize a weight ``w [N, K]`` to FP8 e4m3 in 128x128 blocks.

    Returns an :class:`Fp8Tensor` with ``rowwise_data [N, K]`` and ``rowwise_scale
    [ceil(N/128), ceil(K/128)]``; with ``columnwise=True`` also ``columnwise_data [K, N]``
    and ``columnwise_scale [ceil(K/128), ceil(N/128)]`` (a square block's scale is the same
    either way, so this is the exact transpose). Partial edge blocks are allowed.
    """
    check_tensor("w", w, dtypes=FLOAT_DTYPES, ndim=2, last_dim_contiguous=True)
    check_kernel_device("w", w)
    if torch.compiler.is_compiling():
        from .. import library  # (lazy: linghe.library imports this module)
        return library.quantize_128x128(w, columnwise, pow2_scale)
    q, s, qt, st = quantize_128x128_launch(w, columnwise, pow2_scale)
    return Fp8Tensor(w.shape, w.dtype, rowwise_data=q, rowwise_scale=s,
                     columnwise_data=qt, columnwise_scale=st, scaling="128x128")


def quantize_128x128_launch(w: torch.Tensor, columnwise: bool, pow2_scale: bool):
    """The launcher of :func:`quantize_128x128` on ``w [N, K]``: ``(q, s, qt, st)``
    (``qt``/``st`` ``None`` without ``columnwise``)."""
    N, K = w.shape
    GN, GK = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    q = empty(N, K, dtype=FP8_DTYPE, device=w.device)
    s = empty(GN, GK, dtype=torch.float32, device=w.device)
    qt = st = None
    if columnwise:
        qt = empty(K, N, dtype=FP8_DTYPE, device=w.device)
        st = empty(GK, GN, dtype=torch.float32, device=w.device)
    if N > 0 and K > 0:
        with device_guard(w):
            launch(_quantize_128x128_kernel, (GN, GK),
                w, q, s, qt, st, N, K, w.stride(0), COLWISE=columnwise, POW2=pow2_scale,
                RELOAD_T=w.dtype == torch.float32, num_warps=8)
    return q, s, qt, st
