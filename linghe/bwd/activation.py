"""SwiGLU backward kernels.

With ``h = silu(g) * u`` and ``y = p * h`` (``p = 1`` without probs), for an incoming
``dy``: ``dg = dy * p * u * s * (1 + g * (1 - s))`` (``s = sigmoid(g)``),
``du = dy * p * silu(g)``, ``dp = sum_j dy_j * h_j`` (fp32 accumulation).

- :func:`silu_mul_bwd`: plain ``dx [M, 2N]`` (x's dtype) and ``dprobs``; with expert
  ``counts`` it zeroes the gradient of padding/tail rows of a grouped buffer.
- :func:`silu_mul_bwd_rowwise_fp8`: ``dx`` and its rowwise 1x128 FP8 copy from one kernel
  (a high-precision wgrad and an FP8 dgrad of the same gradient).
- :func:`silu_mul_bwd_quant`: the same ``dx`` emitted already quantized to 1x128 FP8
  (rowwise and columnwise) for an FP8 linear layer's dgrad/wgrad GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.quantize import FP8_DTYPE, quant_cols, quant_row_groups, quant_rows
from ..fp8.tensor import Fp8Tensor
from ..fwd import activation as _fwd
from ..fwd.activation import rows_valid, silu_f32
from ..fwd.grouped_mm import quantize_grouped_fwd
from ..utils import cdiv, device_guard, empty, launch, next_power_of_2

BLOCK = 128
#: ``(rows, columns of each half a step, warps)`` of a program of the one-kernel SwiGLU
#: backward with dx's rowwise FP8 copy (:func:`silu_mul_bwd_rowwise_fp8`; the columns
#: shrink to whole 128-column groups that divide ``N``, the rows grow to keep the
#: elements). H200, the e2e's rows (256 experts, 69k rows, ``N`` = 1024), kernel µs and %
#: of a size-matched copy: 8 x 256 / 4 warps 219 (91%); the previous 4 x 1024 / 4 warps
#: 289 (70%: 32 fp32 values a tensor a thread); 2 x 1024 237; 16 x 256 / 8 warps 220; 32 x
#: 128 / 8 236 (``benchmark/results/h200_probe_silu_bwd_rowwise_fp8_tiles_*``). dx and
#: its FP8 copy are the same bits at any tile; dprobs sums its columns in tile order.
ROWWISE_FP8_TILE = (8, 256, 4)


@triton.jit
def _silu_mul_grads(g, u, dy, p, HAS_P: tl.constexpr):
    """``(dg, du, dy*h)`` for fp32 tiles; ``p [BM]`` is ignored unless ``HAS_P``."""
    silu, s = silu_f32(g)
    dyh = dy * silu * u
    if HAS_P:
        dy = dy * p[:, None]
    dg = dy * u * (s * (1.0 + g * (1.0 - s)))
    du = dy * silu
    return dg, du, dyh


@triton.jit
def _silu_mul_bwd_kernel(dy_ptr, x_ptr, p_ptr, cnt_ptr, dx_ptr, dp_ptr, q_ptr, s_ptr, M, N, E,
                         stride_dy, stride_x, stride_dx, ALIGN,
                         BM: tl.constexpr, BN: tl.constexpr, HAS_P: tl.constexpr,
                         NEED_DP: tl.constexpr, BATCH: tl.constexpr, EP2: tl.constexpr,
                         QUANT: tl.constexpr = False, POW2: tl.constexpr = False):
    """``dx`` (and ``dprobs``) of a ``[BM]``-row tile, ``BN`` columns of each half at a
    time. ``QUANT`` (``N % BN == 0``, ``BN`` a multiple of 128): also ``dx``'s rowwise
    1x128 FP8 copy (``q [M, 2N]``, ``s [M, 2N / 128]``), quantized from the values as
    stored in ``dx``'s dtype: the bits ``quantize_grouped_fwd(dx)`` gives, without reading
    ``dx`` back."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < M
    if BATCH:
        lmask = rmask & rows_valid(cnt_ptr, E, rows, ALIGN, EP2)
    else:
        lmask = rmask
    p = tl.zeros([BM], tl.float32)
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=lmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BM], tl.float32)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        cmask = cols < N
        m = lmask[:, None] & cmask[None, :]
        xp = x_ptr + rows[:, None] * stride_x + cols[None, :]
        g = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        u = tl.load(xp + N, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=m,
                     other=0.0).to(tl.float32)
        dg, du, dyh = _silu_mul_grads(g, u, dy, p, HAS_P)
        if NEED_DP:
            acc += tl.sum(dyh, 1)
        sm = rmask[:, None] & cmask[None, :]
        dxp = dx_ptr + rows[:, None] * stride_dx + cols[None, :]
        dg = dg.to(dx_ptr.dtype.element_ty)
        du = du.to(dx_ptr.dtype.element_ty)
        tl.store(dxp, dg, mask=sm)
        tl.store(dxp + N, du, mask=sm)
        if QUANT:
            quant_row_groups(dg.to(tl.float32), rows, n0, q_ptr, s_ptr, M, 2 * N,
                             2 * N // 128, 1, BN, POW2)
            quant_row_groups(du.to(tl.float32), rows, N + n0, q_ptr, s_ptr, M, 2 * N,
                             2 * N // 128, 1, BN, POW2)
    if NEED_DP:
        tl.store(dp_ptr + rows, acc.to(dp_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _bwd_quant_block(pid_m, pid_n, tile_start, real_end, seg_stop, dy_ptr, x_ptr, p_ptr,
                     q_ptr, s_ptr, qt_ptr, st_ptr, dpp_ptr, M, N, stride_dy, stride_x,
                     NPROG_N, NG, COLWISE: tl.constexpr, POW2: tl.constexpr,
                     HAS_P: tl.constexpr, NEED_DP: tl.constexpr, SPLIT: tl.constexpr,
                     BATCH: tl.constexpr):
    """dx columns ``pid_n * 128 ..`` (of the 2N) of the 128-row tile from ``tile_start``:
    quantized rowwise and columnwise, and this block's dprobs partial. BATCH: rows below
    ``real_end`` are read (real rows), rows below ``seg_stop`` written (padding/tail rows
    as zeros). Row vectors and masks are formed here from the scalars, so that a loop over
    blocks carries only scalars."""
    K = 2 * N
    GK = tl.cdiv(K, 128)
    rows = tile_start.to(tl.int64) + tl.arange(0, 128)
    if BATCH:
        wmask = (rows < seg_stop) & (rows < M)
        rmask = (rows < real_end) & wmask
    else:
        rmask = rows < M
        wmask = rmask
    p = tl.zeros([128], tl.float32)
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if SPLIT:
        # N % 128 == 0: block pid_n is a whole 128-column block of the gate half
        # (pid_n < N/128: dg, and the dprobs partial) or of the up half (du; u is not
        # read). One 128x128 fp32 result tile is live at a time (fewer registers than
        # forming dg and du in one program), and loads stay contiguous.
        NB = N // 128
        gate = (tl.zeros([128], tl.int32) + pid_n) < NB  # uniform: the whole block
        j = (pid_n % NB) * 128 + tl.arange(0, 128)
        c = pid_n * 128 + tl.arange(0, 128)
        m = rmask[:, None] & (j < N)[None, :]
        xp = x_ptr + rows[:, None] * stride_x + j[None, :]
        g = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        u = tl.load(xp + N, mask=m & gate[None, :], other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + j[None, :], mask=m,
                     other=0.0).to(tl.float32)
        silu, sig = silu_f32(g)
        dyh = dy * silu * u  # zero in up-half blocks (u = 0 there)
        if HAS_P:
            dy = dy * p[:, None]
        dx = tl.where(gate[None, :], dy * u * (sig * (1.0 + g * (1.0 - sig))), dy * silu)
        qx, sx = quant_rows(dx, POW2)
        wm = wmask[:, None] & (j < N)[None, :]
        tl.store(q_ptr + rows[:, None] * K + c[None, :], qx, mask=wm)
        tl.store(s_ptr + rows * GK + pid_n, sx, mask=wmask)
        if COLWISE:
            qxt, sxt = quant_cols(dx, POW2)
            # qt[c, m] = q[m, c]: stored through transposed addresses.
            tl.store(qt_ptr + c.to(tl.int64)[None, :] * M + rows[:, None], qxt, mask=wm)
            tl.store(st_ptr + c.to(tl.int64) * NG + pid_m, sxt)
        if NEED_DP:
            tl.store(dpp_ptr + rows * NPROG_N + pid_n, tl.sum(dyh, 1),
                     mask=wmask & gate)  # gate is uniform: any [128] vector works
    else:
        # General N: the block is dx columns c of the 2N; column c reads gate/up column
        # j = c mod N (a gather only in the block straddling the halves).
        c = pid_n * 128 + tl.arange(0, 128)
        cmask = c < K
        is_gate = c < N
        j = tl.where(is_gate, c, c - N)
        m = rmask[:, None] & cmask[None, :]
        xp = x_ptr + rows[:, None] * stride_x + j[None, :]
        g = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        u = tl.load(xp + N, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + j[None, :], mask=m,
                     other=0.0).to(tl.float32)
        dg, du, dyh = _silu_mul_grads(g, u, dy, p, HAS_P)
        dx = tl.where(is_gate[None, :], dg, du)
        dyh = tl.where(is_gate[None, :], dyh, 0.0)
        qx, sx = quant_rows(dx, POW2)
        wm = wmask[:, None] & cmask[None, :]
        tl.store(q_ptr + rows[:, None] * K + c[None, :], qx, mask=wm)
        tl.store(s_ptr + rows * GK + pid_n, sx, mask=wmask)
        if COLWISE:
            qxt, sxt = quant_cols(dx, POW2)
            tl.store(qt_ptr + c.to(tl.int64)[None, :] * M + rows[:, None], qxt, mask=wm)
            tl.store(st_ptr + c.to(tl.int64) * NG + pid_m, sxt, mask=cmask)
        if NEED_DP:
            tl.store(dpp_ptr + rows * NPROG_N + pid_n, tl.sum(dyh, 1), mask=wmask)


@triton.jit
def _silu_mul_bwd_quant_kernel(dy_ptr, x_ptr, p_ptr, cnt_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
                               dpp_ptr, M, N, E, stride_dy, stride_x, NPROG_N, ALIGN, NG,
                               COLWISE: tl.constexpr, POW2: tl.constexpr,
                               HAS_P: tl.constexpr, NEED_DP: tl.constexpr,
                               SPLIT: tl.constexpr, BATCH: tl.constexpr,
                               EP2: tl.constexpr, ALIGN16: tl.constexpr,
                               NCOL: tl.constexpr):
    # dx is [M, 2N]; its rowwise groups are 128 consecutive columns of the 2N. Program
    # (pid_m, pid_c) takes the row tile pid_m and the 128-column blocks
    # [pid_c * NCOL, pid_c * NCOL + NCOL) of dx, in turn.
    # BATCH: rows grouped by expert; program row tiles follow the segments
    # (expert_tile), so the columnwise groups never cross one; only real rows are read
    # (rmask), padding/tail rows are written as zeros (wmask).
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    if BATCH:
        tile_start, real_end, seg_stop, _g, _gu, _i, _so, _u = _fwd.expert_tile(
            cnt_ptr, E, M, pid_m, ALIGN, EP2)
        if ALIGN16:
            # 16-byte vector stores of the transposed tile (see aligned16).
            tile_start, seg_stop = _fwd.aligned16(tile_start, seg_stop)
    else:
        tile_start = pid_m.to(tl.int64) * 128
        real_end = M
        seg_stop = M
    if NCOL == 1:
        _bwd_quant_block(pid_m, pid_c, tile_start, real_end, seg_stop, dy_ptr, x_ptr, p_ptr,
                         q_ptr, s_ptr, qt_ptr, st_ptr, dpp_ptr, M, N, stride_dy, stride_x,
                         NPROG_N, NG, COLWISE, POW2, HAS_P, NEED_DP, SPLIT, BATCH)
    else:
        # Only scalars cross the loop; disable_licm keeps triton from hoisting the
        # per-block address and mask tiles out of it (live across the loop they spill).
        # (ptxas still spills about 100 B here at 255 registers: the probe decides.)
        n0 = pid_c * NCOL
        for pid_n in tl.range(n0, tl.minimum(n0 + NCOL, tl.cdiv(2 * N, 128)), num_stages=1,
                              disable_licm=True):
            _bwd_quant_block(pid_m, pid_n, tile_start, real_end, seg_stop, dy_ptr, x_ptr,
                             p_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, dpp_ptr, M, N, stride_dy,
                             stride_x, NPROG_N, NG, COLWISE, POW2, HAS_P, NEED_DP, SPLIT,
                             BATCH)


def silu_mul_bwd(dy: torch.Tensor, x: torch.Tensor, probs: torch.Tensor | None, *,
                 need_dprobs: bool, counts: torch.Tensor | None = None, align: int = 1):
    """Backward of SwiGLU: ``dy [M, N]``, ``x [M, 2N]`` (last dims contiguous), ``probs [M]``.

    Returns ``(dx [M, 2N] in x's dtype, dprobs [M] in probs' dtype or None)``. With
    ``counts [E]`` (device) rows are taken as grouped by expert (segments padded to
    ``align``, :mod:`linghe.layout`): padding and tail rows get ``dx = 0`` and
    ``dprobs = 0`` whatever ``dy`` holds there.
    """
    dx, dp, _q, _s = _launch_silu_mul_bwd(dy, x, probs, need_dprobs, counts, align)
    return dx, dp


def _launch_silu_mul_bwd(dy, x, probs, need_dprobs, counts, align, quant=False, pow2=False):
    M, N = x.shape[0], x.shape[1] // 2
    dx = empty(M, 2 * N, dtype=x.dtype, device=x.device)
    need_dprobs = need_dprobs and probs is not None
    dp = empty(M, dtype=probs.dtype, device=x.device) if need_dprobs else None
    q = s = None
    if quant:
        q = empty(M, 2 * N, dtype=FP8_DTYPE, device=x.device)
        s = empty(M, cdiv(2 * N, BLOCK), dtype=torch.float32, device=x.device)
    if M > 0:
        BM, BN, warps = _fwd.tile_config(M, max(N, 1))
        if quant:  # column tiles of whole 1x128 groups of one half: BN divides N
            bm, bn, warps = ROWWISE_FP8_TILE
            BN = BLOCK * min((N // BLOCK) & -(N // BLOCK), bn // BLOCK)
            BM = max(1, min(bm * bn // BN, next_power_of_2(M)))
        E = counts.numel() if counts is not None else 0
        with device_guard(x):
            launch(_silu_mul_bwd_kernel, (cdiv(M, BM),),
                dy, x, probs, counts, dx, dp, q, s, M, N, E, dy.stride(0), x.stride(0),
                dx.stride(0), align, BM=BM, BN=BN, HAS_P=probs is not None,
                NEED_DP=need_dprobs, BATCH=counts is not None,
                EP2=max(next_power_of_2(E), 2), QUANT=quant, POW2=pow2, num_warps=warps)
    return dx, dp, q, s


def silu_mul_bwd_rowwise_fp8(dy: torch.Tensor, x: torch.Tensor, probs: torch.Tensor | None,
                             *, need_dprobs: bool, counts: torch.Tensor, align: int,
                             pow2_scale: bool = False):
    """:func:`silu_mul_bwd` of rows grouped by expert that also returns ``dx``'s rowwise
    1x128 FP8 copy: what a high-precision weight gradient (``dx`` in x's dtype) and an
    FP8 dgrad GEMM (the FP8 copy) both take (kernel-level API).

    Returns ``(dx [M, 2N] in x's dtype, q [M, 2N] e4m3, s [M, cdiv(2N, 128)] float32,
    dprobs [M] or None)``; ``(q, s)`` are the bits ``quantize_grouped_fwd(dx, counts,
    align, columnwise=False)`` returns (padding and tail rows: zeros, scale 1). One
    kernel where ``N`` is a multiple of 128 (its column tiles are whole 1x128 groups of
    one half; dx is never read back); otherwise (documented fallback) ``silu_mul_bwd``
    then ``quantize_grouped_fwd``.
    """
    N = x.shape[1] // 2
    if N > 0 and N % BLOCK == 0:
        dx, dp, q, s = _launch_silu_mul_bwd(dy, x, probs, need_dprobs, counts, align,
                                            quant=True, pow2=pow2_scale)
        return dx, q, s, dp
    dx, dp = silu_mul_bwd(dy, x, probs, need_dprobs=need_dprobs, counts=counts, align=align)
    q, s, _qt, _st = quantize_grouped_fwd(dx, counts, align, rowwise=True, columnwise=False,
                                          pow2_scale=pow2_scale)
    return dx, q, s, dp


def silu_mul_bwd_quant(dy: torch.Tensor, x: torch.Tensor, probs: torch.Tensor | None = None,
                       *, columnwise: bool = True, pow2_scale: bool = False,
                       need_dprobs: bool = True, counts: torch.Tensor | None = None,
                       align: int = 1, segments: torch.Tensor | None = None):
    """Backward of SwiGLU emitting ``dx`` quantized to 1x128 FP8 (kernel-level API).

    Args:
        dy: ``[M, N]`` float gradient of ``y`` (last dim contiguous).
        x: ``[M, 2N]`` forward input, gate half first (last dim contiguous).
        probs: ``[M]`` row weights or None.
        columnwise: also emit the columnwise copy of ``dx`` (``[2N, M]``, 1x128 groups
            along the M tokens), from the same fp32 values.
        pow2_scale: power-of-two scales.
        need_dprobs: compute ``dprobs``.

    Returns ``(dx, dprobs)``: ``dx`` an :class:`Fp8Tensor` of logical shape ``[M, 2N]``
    and ``x``'s dtype (``rowwise_data [M, 2N]``, ``rowwise_scale [M, cdiv(2N,128)]``; with
    ``columnwise`` also ``columnwise_data [2N, M]``, ``columnwise_scale [2N,
    cdiv(M,128)]``); ``dprobs [M]`` in probs' dtype (or None). Rowwise groups run over the
    2N columns of ``dx`` as one row, so when ``N % 128 != 0`` one group holds the end of
    the gate half and the start of the up half, exactly as ``quantize_1x128(dx)`` would.
    No autograd: the caller is the FP8 layer's backward.

    Rows grouped by expert (``counts [E]`` on the device, segments padded to ``align``,
    :mod:`linghe.layout`; the backward of ``batch_silu_mul_quant``): padding and tail
    rows are not read and get ``dx = 0`` (scale 1) and ``dprobs = 0``, and the
    columnwise groups follow the segments as in ``batch_silu_mul_quant``
    (``columnwise_scale [2N, cdiv(M,128) + E]``); ``segments`` is the layout's offsets
    ``[E + 1]`` that ``dx`` then carries as ``col_segments`` (required with ``counts``
    and ``columnwise``).
    """
    M, N = x.shape[0], x.shape[1] // 2
    K = 2 * N
    dev = x.device
    batch = counts is not None
    E = counts.numel() if batch else 0
    NG = _fwd.batch_col_groups(M, E) if batch else cdiv(M, BLOCK)
    if batch and columnwise and segments is None:
        raise ValueError("silu_mul_bwd_quant with counts and columnwise needs segments "
                         "(the layout's offsets [E + 1]) for the columnwise copy")
    if batch and _fwd.QUANT_BWD_MODE == "two_kernel" and N > 0:
        # dx in x's dtype, then the grouped quantizer (same groups; dx is rounded to x's
        # dtype before it is quantized, so rare elements differ by one e4m3 step).
        dxh, dp = silu_mul_bwd(dy, x, probs, need_dprobs=need_dprobs, counts=counts,
                               align=align)
        q, s, qt, st = quantize_grouped_fwd(dxh, counts, align, columnwise=columnwise,
                                            pow2_scale=pow2_scale)
        return Fp8Tensor((M, K), x.dtype, rowwise_data=q, rowwise_scale=s,
                         columnwise_data=qt, columnwise_scale=st, scaling="1x128",
                         col_segments=segments if columnwise else None), dp
    q = empty(M, K, dtype=FP8_DTYPE, device=dev)
    s = empty(M, cdiv(K, BLOCK), dtype=torch.float32, device=dev)
    qt = st = None
    if columnwise:
        qt = empty(K, M, dtype=FP8_DTYPE, device=dev)
        st = empty(K, NG, dtype=torch.float32, device=dev)
    need_dprobs = need_dprobs and probs is not None
    dp = None
    # The batch form launches even with M == 0: its unused groups get scale 1.
    if (M > 0 or batch) and N > 0:
        split = N % BLOCK == 0
        ncol = max(_fwd.QUANT_BWD_COLS, 1)
        # dprobs partials: one column per gate block (split) or per dx block (general).
        nprog_n = N // BLOCK if split else cdiv(K, BLOCK)
        part = (empty(M, nprog_n, dtype=torch.float32, device=dev)
                if need_dprobs else None)
        with device_guard(x):
            launch(_silu_mul_bwd_quant_kernel, (NG, cdiv(cdiv(K, BLOCK), ncol)),
                dy, x, probs, counts, q, s, qt, st, part, M, N, E,
                dy.stride(0) if M else N, x.stride(0) if M else K, nprog_n, align, NG,
                COLWISE=columnwise, POW2=pow2_scale, HAS_P=probs is not None,
                NEED_DP=need_dprobs, SPLIT=split, BATCH=batch,
                EP2=next_power_of_2(E + 1) if batch else 1,
                ALIGN16=batch and align % 16 == 0, NCOL=ncol,
                num_warps=_fwd.QUANT_BWD_NUM_WARPS)
        if need_dprobs:
            dp = part.sum(1).to(probs.dtype)
    elif need_dprobs:
        dp = torch.zeros(M, dtype=probs.dtype, device=dev)
    dx = Fp8Tensor((M, K), x.dtype, rowwise_data=q, rowwise_scale=s, columnwise_data=qt,
                   columnwise_scale=st, scaling="1x128",
                   col_segments=segments if batch and columnwise else None)
    return dx, dp
