"""Grouped GEMM backward: dgrad (``d_rows = d_out_e @ W_e``) and wgrad
(``dW_e = d_out_e^T @ rows_e``) per expert, bf16/fp16/fp32 and FP8 blockwise.

The dgrad reuses the forward's "rows @ B_e" kernel (:mod:`linghe.fwd.grouped_mm`) with
``B_e = W_e``. The wgrad kernel runs a grid ``(cdiv(N, BN) * cdiv(K, BK), E)``: each
program owns one ``[BN, BK]`` tile of ``dW_e`` and loops over expert ``e``'s rows
``offsets[e] .. offsets[e+1]`` (read on the device; an expert with no rows writes zeros).
Rows are walked in chunks aligned to *global* multiples of the chunk size and masked to the
segment, so with FP8 each chunk is exactly one 128-token group of the columnwise copies
(``quantize_1x128(columnwise=True)`` of the whole buffer) whatever ``align`` is: a group
straddling two experts is used by both, each masking the other's rows. On sm_90 the FP8
wgrad over segment groups (the MoE path) runs as a warp-specialized Gluon kernel
(:mod:`linghe.fwd.grouped_mm_ws`), same result, and so does the bf16/fp16 wgrad (one
operand pair, accumulating, or several summed: :func:`launch_wgrad_parts`), whose fp32
sums run in another order than the Triton kernels'.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..fp8 import Fp8Tensor
from ..fp8.quantize import dequantize_1x128_rows, groups_adjacent
from ..fwd import grouped_mm as _fwd_gm
from ..fwd.grouped_mm import (
    AUTOTUNE_MIN_ROWS,
    BLOCK,
    _autotune_enabled,
    fp8_rescale,
    fp8_scale_floor,
    hp_ws_preferred,
    launch_grouped_rows,
    tma_capable,
    torch_grouped_mm_ok,
    zero_tail,
)
from ..fwd.grouped_mm_ws import (
    hp_wgrad_ws_sq_size,
    launch_fp8_wgrad_ws,
    launch_hp_wgrad_ws,
    wgrad_ws_operands_ok,
)
from ..fwd.permute import TokenRows
from ..utils import INTERPRET, cdiv, device_guard, dot_f32acc, empty, launch, next_power_of_2

# --------------------------------------------------------------------------------------
# dgrad
# --------------------------------------------------------------------------------------


def grouped_mm_dgrad(d_out: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                     backend: str = "auto", block_m: int | None = None) -> torch.Tensor:
    """``d_rows [R, K] = d_out_e [*, N] @ W_e [N, K]`` per segment (zeros past
    ``offsets[E]``)."""
    R, N = d_out.shape
    E, _, K = weight.shape
    use_torch = backend == "torch" or (backend == "auto" and not hp_ws_preferred(d_out, N)
                                       and torch_grouped_mm_ok(d_out, weight))
    if use_torch and R > 0 and K > 0:
        return zero_tail(torch._grouped_mm(d_out, weight, offs=offsets[1:]), offsets)
    out = empty(R, K, dtype=d_out.dtype, device=d_out.device)
    return launch_grouped_rows(d_out, weight, out, offsets, stride_be=N * K, stride_bi=K,
                               stride_bj=1, block_m=block_m)


def grouped_mm_fp8_dgrad(dout_fp8: Fp8Tensor, w_fp8: Fp8Tensor, offsets: torch.Tensor,
                         out_dtype: torch.dtype = torch.bfloat16,
                         block_m: int | None = None,
                         config: dict | None = None) -> torch.Tensor:
    """FP8 dgrad launcher: ``dout_fp8`` rowwise 1x128 ``[R, N]``, ``w_fp8`` with its
    columnwise copy (``quantize_grouped_weight(columnwise=True)``) -> ``[R, K]``.
    ``config``: pinned tiles/promotion form (see
    :func:`~linghe.fwd.grouped_mm.launch_grouped_rows`).

    Uses the columnwise (exact transpose) weight copy so both operands are contiguous
    along the contraction dim ``N`` (what FP8 tensor cores want)."""
    q, s = dout_fp8.rowwise_data, dout_fp8.rowwise_scale
    R, N = q.shape
    E, _, K = w_fp8.shape
    wt, wts = w_fp8.columnwise_data, w_fp8.columnwise_scale  # [K, E*N], [GK, E*N/128]
    GN = N // BLOCK
    out = empty(R, K, dtype=out_dtype, device=q.device)
    # B_e[n, k] = WqT[k, e*N + n]; scale wts[k // 128, e*GN + n // 128].
    return launch_grouped_rows(
        q, wt, out, offsets, stride_be=N, stride_bi=1, stride_bj=E * N,
        a_scale=s, b_scale=wts, bs_strides=(GN, 1, E * GN), block_m=block_m,
        config=config)


# --------------------------------------------------------------------------------------
# wgrad
# --------------------------------------------------------------------------------------

#: FP8 wgrad with segment groups and 16-aligned segments (the MoE path): load a segment's
#: partial last group with the token mask in 16-byte vector loads (async copies) instead
#: of zeroing tokens in registers (sm_90 ptxas, offline: ~13 fewer registers at 128x128,
#: and what lets RESCALE tiles fit). On by default: 7% faster at E=256 / align 16 on an
#: H100 (2582 vs 2776 µs, gate_up), the same at align 128 (no partial groups there);
#: ``LINGHE_FP8_WGRAD_VEC_MASK=0`` or a launcher's ``config["VEC_MASK"]`` turn it off.
WGRAD_VEC_MASK: bool = os.environ.get("LINGHE_FP8_WGRAD_VEC_MASK", "1") == "1"


@triton.jit
def _wgrad_kernel(
    g_ptr, x_ptr, w_ptr, offsets_ptr, xs_ptr,
    N, K, R,
    stride_gr, stride_gn, stride_xr, stride_xk, stride_we, stride_wn, stride_xs,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, IEEE: tl.constexpr,
    ACCUMULATE: tl.constexpr = False, X_FP8: tl.constexpr = False,
):
    """High precision ``dW[e, n, k] = sum_{r in seg e} g[r, n] * x[r, k]`` for ``g [R, N]``,
    ``x [R, K]`` (strides given; FP8 operands on both sides have their own kernel below).

    ``ACCUMULATE``: add the sum to the existing ``dW`` tile (fp32, one rounding) instead
    of overwriting it: fused gradient accumulation into a parameter's ``.grad``.
    ``X_FP8``: ``x`` is the rowwise 1x128 FP8 copy with scales ``xs [R, cdiv(K, 128)]``
    (row stride ``stride_xs``), dequantized in registers to ``g``'s dtype (the values
    :func:`~linghe.fp8.quantize.dequantize_1x128_rows` gives) before the MMA; ``BK``
    divides 128, so a tile's columns share one scale group."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_k = tl.cdiv(K, BK)
    pid_n = pid // num_k
    pid_k = pid % num_k
    ns = pid_n * BN + tl.arange(0, BN)
    ks = pid_k * BK + tl.arange(0, BK)
    nmask = ns < N
    kmask = ks < K
    start = tl.load(offsets_ptr + e)
    end = tl.minimum(tl.load(offsets_ptr + e + 1), R)
    first = (start // BR) * BR
    last = tl.where(end > start, end, first)  # empty segment: no iterations
    g_base = g_ptr + ns[:, None].to(tl.int64) * stride_gn
    x_base = x_ptr + ks[None, :].to(tl.int64) * stride_xk
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for r0 in range(first, last, BR):
        rs = r0 + tl.arange(0, BR)
        rmask = (rs >= start) & (rs < end) & (rs >= 0)
        rs64 = rs.to(tl.int64)
        g = tl.load(g_base + rs64[None, :] * stride_gr, mask=nmask[:, None] & rmask[None, :],
                    other=0.0)
        x = tl.load(x_base + rs64[:, None] * stride_xr, mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        if X_FP8:
            xs = tl.load(xs_ptr + rs64 * stride_xs + (pid_k * BK) // 128, mask=rmask,
                         other=0.0)
            x = (x.to(tl.float32) * xs[:, None]).to(g.dtype)
        if IEEE:
            acc = tl.dot(g, x, acc, input_precision="ieee")
        else:
            acc = dot_f32acc(g, x, acc)
    w_tile = (w_ptr + e.to(tl.int64) * stride_we + ns[:, None].to(tl.int64) * stride_wn
              + ks[None, :])
    wmask = nmask[:, None] & kmask[None, :]
    if ACCUMULATE:
        acc += tl.load(w_tile, mask=wmask, other=0.0).to(tl.float32)
    tl.store(w_tile, acc.to(w_ptr.dtype.element_ty), mask=wmask)


@triton.jit
def _wgrad_fp8_step(acc, sg_prev, grp_prev, g_rows, x_rows, gs_cols, xs_cols, stride_gs,
                    stride_xs, r0, grp, start, end, R, nmask, kmask, BR: tl.constexpr,
                    MASK_R: tl.constexpr, RESCALE: tl.constexpr, VEC_MASK: tl.constexpr):
    """One 128-token group ``grp`` (tokens ``r0 .. r0 + 127``): ``acc += (g_grp @
    x_grp^T) * (sg x sx)``; returns ``(acc, sg_prev, grp_prev)``, the accumulator's units
    (unchanged without ``RESCALE``).

    ``RESCALE``: ``acc`` is in units of the last step's scales (group ``grp_prev``, -1
    before the first step) and stays in the MMA: ``acc = dot(g, x^T, acc * (sg_prev /
    sg) x (sx_prev / sx))`` (:func:`~linghe.fwd.grouped_mm.fp8_rescale`; masked columns
    load scale 1). The row scales ``sg`` are carried (a few per thread); the column scales
    ``sx_prev`` are re-read (L1) instead: in the wgmma layout a thread holds ``BK / 4``
    columns, and carrying them costs that many registers.

    ``g_rows`` ``[BN, 1]`` / ``x_rows`` ``[BK, 1]`` point at the rows of the columnwise
    copies, so both tiles are ``[*, BR]`` contiguous along the tokens (the contraction
    dim): both MMA operands K-major. ``MASK_R``: mask tokens outside ``[start, end)``
    (boundary groups); interior groups load unmasked along the tokens (vectorized, 16 B
    per access). ``VEC_MASK`` (``start``/``end`` multiples of 16, a boundary group that
    starts at ``start``): mask the tokens ``>= end`` in the loads themselves, which stay
    16-byte vectors (async copies, no register round trip)."""
    rs = r0 + tl.arange(0, BR)
    if MASK_R and VEC_MASK:
        tm = (rs < end)[None, :]
        g = tl.load(g_rows + rs[None, :], mask=nmask[:, None] & tm, other=0.0)
        x = tl.load(x_rows + rs[None, :], mask=kmask[:, None] & tm, other=0.0)
    elif MASK_R:
        # Load the whole group (mask only the buffer end, so the loads stay vectorized),
        # then zero the other experts' tokens of one operand in registers (enough for
        # their products to vanish; half the registers of masking both).
        inb = (rs < R)[None, :]
        rm = ((rs >= start) & (rs < end))[None, :]
        g = tl.load(g_rows + rs[None, :], mask=nmask[:, None] & inb, other=0.0)
        x = tl.load(x_rows + rs[None, :], mask=kmask[:, None] & inb, other=0.0)
        g = tl.where(rm, g, tl.zeros_like(g))
    else:
        g = tl.load(g_rows + rs[None, :], mask=nmask[:, None], other=0.0)
        x = tl.load(x_rows + rs[None, :], mask=kmask[:, None], other=0.0)
    # Scales transposed ([G, N] / [G, K]): one contiguous load per operand and step.
    sg = tl.load(gs_cols + grp * stride_gs, mask=nmask, other=1.0)
    sx = tl.load(xs_cols + grp * stride_xs, mask=kmask, other=1.0)
    if RESCALE:
        sg, rg = fp8_rescale(sg_prev, sg)
        _, rx = fp8_rescale(_wgrad_col_scales(xs_cols, grp_prev, stride_xs, kmask), sx)
        acc = tl.dot(g, tl.trans(x), acc * rg[:, None] * rx[None, :])
        grp_prev = grp
    else:
        acc = acc + (tl.dot(g, tl.trans(x)) * sg[:, None]) * sx[None, :]
        sg = sg_prev
    return acc, sg, grp_prev


@triton.jit
def _wgrad_col_scales(xs_cols, grp, stride_xs, kmask):
    """The floored column scales of group ``grp`` (ones for ``grp < 0`` and masked
    columns): the units of a RESCALE accumulator."""
    s = tl.load(xs_cols + tl.maximum(grp, 0) * stride_xs, mask=kmask, other=1.0)
    return fp8_scale_floor(tl.where(grp >= 0, s, 1.0))


@triton.jit
def _wgrad_fp8_kernel(
    g_ptr, x_ptr, w_ptr, gs_ptr, xs_ptr, offsets_ptr,
    N, K, R, E, stride_g, stride_x, stride_gs, stride_xs, stride_we, stride_wn,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, SEG: tl.constexpr,
    EP2: tl.constexpr, ALIGN16: tl.constexpr, RESCALE: tl.constexpr = False,
    VEC_MASK: tl.constexpr = False,
):
    """FP8 ``dW[e, n, k] = sum_{r in seg e} g[r, n] * x[r, k]`` from the columnwise copies
    ``gq [N, R]`` / ``xq [K, R]`` (row strides ``stride_g``/``stride_x``) and their 1x128
    scales transposed, ``[G, N]`` / ``[G, K]`` (row strides ``stride_gs``/``stride_xs``);
    ``BR == 128`` (one scale group per step).

    Plain groups (``SEG=False``, ``G = ceil(R/128)``): expert ``e``'s tokens ``[start,
    end)`` are walked in global 128-token groups: the groups fully inside the segment
    first (no token mask), then at most two boundary groups (the one holding ``start``
    when it is not group-aligned, the one holding ``end`` when it is not), masked to the
    segment.

    Segment groups (``SEG=True``, both copies grouped as ``batch_silu_mul_quant`` does:
    ``G = ceil(R/128) + E``): expert ``e``'s groups are scale columns ``g_off[e] + i``
    (``g_off`` = exclusive cumsum of ``ceil(segment/128)``, from ``offsets`` here) over
    tokens ``start + 128 i ..``; only the last one may be partial (masked to the
    segment). No group is shared by two experts.

    ``RESCALE``: the one-accumulator promotion (see :func:`_wgrad_fp8_step`); the
    accumulator is multiplied by the last step's scales before the store (an expert
    with no rows stores ``0 * 1``). ``VEC_MASK`` (``SEG`` and ``ALIGN16`` only): the
    segment's partial last group masks its tokens in vectorized loads (``end`` is then
    clamped to a multiple of 16 below ``R``, which a valid layout's ``end`` already is)
    instead of zeroing them in registers."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_k = tl.cdiv(K, BK)
    pid_n = pid // num_k
    pid_k = pid % num_k
    ns = pid_n * BN + tl.arange(0, BN)
    ks = pid_k * BK + tl.arange(0, BK)
    nmask = ns < N
    kmask = ks < K
    start = tl.load(offsets_ptr + e)
    end = tl.minimum(tl.load(offsets_ptr + e + 1), R)
    start = tl.maximum(tl.minimum(start, end), 0)  # never out of bounds
    g_rows = g_ptr + ns[:, None].to(tl.int64) * stride_g
    x_rows = x_ptr + ks[:, None].to(tl.int64) * stride_x
    gs_rows = gs_ptr + ns  # + group * stride_gs (scales transposed)
    xs_rows = xs_ptr + ks
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    # RESCALE: the accumulator's units (row scales; the column scales' group, re-read).
    sg = tl.full((BN,), 1.0, tl.float32)
    gp = tl.full([], -1, tl.int32)
    if SEG:
        idx = tl.arange(0, EP2)
        m = idx < E
        lo_e = tl.load(offsets_ptr + idx, mask=m, other=0)
        hi_e = tl.load(offsets_ptr + idx + 1, mask=m, other=0)
        ntile = tl.where(m & (idx < e), (hi_e - lo_e + (BR - 1)) // BR, 0)
        gbase = tl.sum(ntile, axis=0)
        if ALIGN16:  # segment starts are multiples of 16: 16-byte vector loads
            if VEC_MASK:  # and the ends (a valid layout's end is <= R rounded down)
                end = tl.multiple_of(tl.minimum(end, (R // 16) * 16), 16)
                start = tl.minimum(start, end)
            start = tl.multiple_of(start, 16)
        if VEC_MASK:
            # One loop, one software pipeline, over every group (the token mask is all-true
            # but in the last one, and costs nothing in the vector copies): with ~256
            # tokens per expert (256 experts) a tile has two groups, and a separate loop for
            # the partial one drained the pipeline between them.
            for i in range(0, (end - start + BR - 1) // BR):
                acc, sg, gp = _wgrad_fp8_step(
                    acc, sg, gp, g_rows, x_rows, gs_rows, xs_rows, stride_gs, stride_xs,
                    start + i * BR, gbase + i, start, end, R, nmask, kmask, BR, True,
                    RESCALE, True)
        else:
            n_full = (end - start) // BR
            part = ((end - start) % BR) != 0
            for i in range(0, n_full):
                acc, sg, gp = _wgrad_fp8_step(
                    acc, sg, gp, g_rows, x_rows, gs_rows, xs_rows, stride_gs, stride_xs,
                    start + i * BR, gbase + i, start, end, R, nmask, kmask, BR, False,
                    RESCALE, False)
            for i in range(0, part.to(tl.int32)):
                acc, sg, gp = _wgrad_fp8_step(
                    acc, sg, gp, g_rows, x_rows, gs_rows, xs_rows, stride_gs, stride_xs,
                    start + (n_full + i) * BR, gbase + n_full + i, start, end, R, nmask,
                    kmask, BR, True, RESCALE, False)
    else:
        g0 = start // BR
        lo = (start + BR - 1) // BR  # first full group
        hi = end // BR  # one past the last full group
        head = ((start % BR) != 0) & (start < end)
        tail = ((end % BR) != 0) & (hi >= lo)
        for i in range(0, hi - lo):
            acc, sg, gp = _wgrad_fp8_step(
                acc, sg, gp, g_rows, x_rows, gs_rows, xs_rows, stride_gs, stride_xs,
                (lo + i) * BR, lo + i, start, end, R, nmask, kmask, BR, False, RESCALE, False)
        for i in range(0, head.to(tl.int32)):
            acc, sg, gp = _wgrad_fp8_step(
                acc, sg, gp, g_rows, x_rows, gs_rows, xs_rows, stride_gs, stride_xs,
                (g0 + i) * BR, g0 + i, start, end, R, nmask, kmask, BR, True, RESCALE, False)
        for i in range(0, tail.to(tl.int32)):
            acc, sg, gp = _wgrad_fp8_step(
                acc, sg, gp, g_rows, x_rows, gs_rows, xs_rows, stride_gs, stride_xs,
                (hi + i) * BR, hi + i, start, end, R, nmask, kmask, BR, True, RESCALE, False)
    if RESCALE:
        acc = acc * sg[:, None] * _wgrad_col_scales(xs_rows, gp, stride_xs, kmask)[None, :]
    tl.store(w_ptr + e.to(tl.int64) * stride_we + ns[:, None].to(tl.int64) * stride_wn
             + ks[None, :], acc.to(w_ptr.dtype.element_ty),
             mask=nmask[:, None] & kmask[None, :])


@functools.cache
def _wgrad_config(fp8: bool, f32: bool):
    if INTERPRET:
        return dict(BN=64, BK=64, BR=128 if fp8 else 32, num_warps=4, num_stages=1)
    if fp8:
        return dict(BN=128, BK=128, BR=128, num_warps=8, num_stages=4)
    if f32:  # 4-byte tiles: keep the pipelined shared memory under ~100 KB
        return dict(BN=128, BK=128, BR=32, num_warps=8, num_stages=3)
    return dict(BN=128, BK=128, BR=64, num_warps=8, num_stages=4)


def _launch_wgrad(g, x, dw, offsets, strides, *, accumulate=False, x_scale=None):
    E, N, K = dw.shape
    if E == 0 or N == 0 or K == 0:
        return dw
    cfg = _wgrad_config(False, g.dtype == torch.float32)
    grid = (cdiv(N, cfg["BN"]) * cdiv(K, cfg["BK"]), E)
    R = strides[-1]
    x_fp8 = x_scale is not None
    with device_guard(dw):
        launch(_wgrad_kernel, grid,
            g, x, dw, offsets, x_scale if x_fp8 else x, N, K, R, *strides[:-1],
            dw.stride(0), dw.stride(1), x_scale.stride(0) if x_fp8 else 0,
            BN=cfg["BN"], BK=cfg["BK"], BR=cfg["BR"], IEEE=(g.dtype == torch.float32),
            ACCUMULATE=accumulate, X_FP8=x_fp8,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dw


# --------------------------------------------------------------------------------------
# wgrad through TMA (bf16/fp16 operands)
# --------------------------------------------------------------------------------------

#: Route the high-precision wgrad's bf16/fp16 launches (``grouped_mm_wgrad``, backends
#: ``"auto"`` and ``"triton"``) to :func:`launch_wgrad_tma` where it can describe the
#: operands (Hopper or newer, or the interpreter). Off by default until the GPU numbers
#: say where it wins (``benchmark/probe_wgrad_tma.py``); ``LINGHE_WGRAD_TMA=1`` turns it on.
WGRAD_TMA: bool = os.environ.get("LINGHE_WGRAD_TMA", "0") == "1"


@triton.jit
def _wgrad_tma_step(acc, g_desc, x_desc, r, n0, k0, end, BR: tl.constexpr, MASK: tl.constexpr):
    """``acc += g[r:r+BR, n0:n0+BN]^T @ x[r:r+BR, k0:k0+BK]`` from one TMA box of each
    operand (``BR`` = the descriptors' box rows). ``MASK``: rows ``>= end`` (the next
    expert's, inside the box) are zeroed in the ``d_out`` box (registers: a shared-memory
    round trip, then the MMA's register A operand), else both operands go to the MMA
    straight from shared memory (A MN-major: the box's transpose)."""
    a = tl.trans(g_desc.load([r, n0]))
    if MASK:
        rows = r + tl.arange(0, BR)
        a = tl.where((rows < end)[None, :], a, tl.zeros_like(a))
    b = x_desc.load([r, k0])
    return dot_f32acc(a, b, acc)


@triton.jit
def _wgrad_tma_kernel(
    g_desc, x_desc, g16_desc, x16_desc, w_ptr, offsets_ptr, N, K, R, stride_we, stride_wn,
    sq_ptr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, TAIL: tl.constexpr,
    ACCUMULATE: tl.constexpr, SQ: tl.constexpr = False,
):
    """bf16/fp16 ``dW[e, n, k] (+)= sum_{r in seg e} g[r, n] * x[r, k]`` (fp32
    accumulation) with both operands loaded by TMA: ``g_desc`` over ``g [R, N]`` in ``[BR,
    BN]`` boxes, ``x_desc`` over ``x [R, K]`` in ``[BR, BK]`` boxes (both row-major: the
    contraction runs along their rows, so the MMA's A operand is the transpose of the
    ``g`` box (MN-major) and its B the ``x`` box as it is (N-major), which Hopper's 16-bit
    wgmma reads from shared memory); ``g16_desc``/``x16_desc``: the same tensors in
    16-row boxes (``TAIL=2`` only; any descriptors otherwise). ``w_ptr``: ``dW [E, N, K]``
    (unit last stride, strides ``stride_we``, ``stride_wn``; bf16/fp16/fp32).

    Grid ``(cdiv(N, BN) * cdiv(K, BK), E)``: program ``(t, e)`` owns one ``[BN, BK]`` tile
    of ``dW_e`` and walks expert ``e``'s rows ``offsets[e] .. min(offsets[e+1], R)`` in
    boxes starting at the segment's first row (any row: TMA needs no alignment of the
    coordinates), so only the last box can reach past the segment: into the next expert's
    rows, whose products must vanish, or past ``R`` (TMA fills zeros; so do the column
    tails past ``N``/``K``). The rows past the last full ``BR`` box (``TAIL``):

    - ``0``: no separate tail: one loop, every box masked in registers;
    - ``1``: the full boxes unmasked from shared memory, then the partial box masked;
    - ``2``: the full boxes, then 16-row boxes unmasked, then (segments whose length is
      no multiple of 16 only) one 16-row box masked: with 16-aligned segments (the MoE
      layouts) no operand passes through registers.

    Each loop is software-pipelined on its own (the pipeline drains between them). An
    expert with no rows stores zeros. ``ACCUMULATE``: the tile adds the existing ``dW``
    tile (read in the epilogue, fp32 sum, one rounding to ``dW``'s dtype) instead of
    overwriting it."""
    e, n0, k0 = _wgrad_tile(K, BN, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    acc = _wgrad_tma_segment(acc, g_desc, x_desc, g16_desc, x16_desc, offsets_ptr, e, R, n0,
                             k0, BR, TAIL)
    _wgrad_tile_store(acc, w_ptr, e, n0, k0, N, K, stride_we, stride_wn, sq_ptr, BN, BK,
                      ACCUMULATE, SQ)


@triton.jit
def _wgrad_tile(K, BN: tl.constexpr, BK: tl.constexpr):
    """``(e, n0, k0)``: the expert and the ``[BN, BK]`` tile of ``dW_e`` of this program
    (grid ``(cdiv(N, BN) * cdiv(K, BK), E)``)."""
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BK)
    return tl.program_id(1), (pid // num_k) * BN, (pid % num_k) * BK


@triton.jit
def _wgrad_tma_segment(acc, g_desc, x_desc, g16_desc, x16_desc, offsets_ptr, e, R, n0, k0,
                       BR: tl.constexpr, TAIL: tl.constexpr):
    """``acc += g_e[:, n0:n0+BN]^T @ x_e[:, k0:k0+BK]`` over expert ``e``'s rows
    ``offsets[e] .. min(offsets[e+1], R)`` of one pair of operands (the loops of
    :func:`_wgrad_tma_kernel`, ``TAIL`` as there)."""
    # int32 box coordinates whatever the offsets' dtype (R < 2^31: a TMA dim limit)
    end = tl.minimum(tl.load(offsets_ptr + e + 1), R).to(tl.int32)
    start = tl.maximum(tl.minimum(tl.load(offsets_ptr + e).to(tl.int32), end), 0)
    if TAIL == 0:
        for r in range(start, end, BR):
            acc = _wgrad_tma_step(acc, g_desc, x_desc, r, n0, k0, end, BR, True)
    else:
        n_full = (end - start) // BR
        for i in range(0, n_full):
            acc = _wgrad_tma_step(acc, g_desc, x_desc, start + i * BR, n0, k0, end, BR,
                                  False)
        r = start + n_full * BR
        if TAIL == 1:
            for i in range(0, (r < end).to(tl.int32)):  # 0 or 1 iterations
                acc = _wgrad_tma_step(acc, g_desc, x_desc, r + i * BR, n0, k0, end, BR,
                                      True)
        else:
            n16 = (end - r) // 16
            for i in range(0, n16):
                acc = _wgrad_tma_step(acc, g16_desc, x16_desc, r + i * 16, n0, k0, end, 16,
                                      False)
            r = r + n16 * 16
            for i in range(0, (r < end).to(tl.int32)):  # 0 or 1 iterations
                acc = _wgrad_tma_step(acc, g16_desc, x16_desc, r + i * 16, n0, k0, end, 16,
                                      True)
    return acc


@triton.jit
def _wgrad_tile_store(acc, w_ptr, e, n0, k0, N, K, stride_we, stride_wn, sq_ptr,
                      BN: tl.constexpr, BK: tl.constexpr, ACCUMULATE: tl.constexpr,
                      SQ: tl.constexpr):
    """Store the ``[BN, BK]`` tile ``acc`` at ``dW[e, n0:, k0:]`` (masked to ``N`` x
    ``K``); ``ACCUMULATE``: add the existing tile first (fp32 sum, one rounding). ``SQ``:
    also store the sum of the squares of the tile's float32 values (before the rounding
    to ``dW``'s dtype: a relative difference of ~1e-5 from the stored values' sum, and no
    second copy of the tile in registers) at ``sq_ptr[e * programs + program]``."""
    ns = n0 + tl.arange(0, BN)
    ks = k0 + tl.arange(0, BK)
    wmask = (ns < N)[:, None] & (ks < K)[None, :]
    w_ptrs = (w_ptr + e.to(tl.int64) * stride_we + ns[:, None].to(tl.int64) * stride_wn
              + ks[None, :])
    if ACCUMULATE:
        acc += tl.load(w_ptrs, mask=wmask, other=0.0).to(tl.float32)
    if SQ:  # (acc is 0 outside N x K: TMA zero-fills, the masked load gives 0)
        tl.store(sq_ptr + e * tl.num_programs(0) + tl.program_id(0),
                 tl.sum(tl.sum(acc * acc, 1), 0))
    tl.store(w_ptrs, acc.to(w_ptr.dtype.element_ty), mask=wmask)


#: Most operand pairs one :func:`_wgrad_tma_parts_kernel` launch walks (more are chunked).
MAX_PARTS = 4


@triton.jit
def _wgrad_tma_parts_kernel(
    g0, x0, gs0, xs0, o0, R0, g1, x1, gs1, xs1, o1, R1, g2, x2, gs2, xs2, o2, R2,
    g3, x3, gs3, xs3, o3, R3,
    w_ptr, N, K, stride_we, stride_wn, sq_ptr,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, TAIL: tl.constexpr,
    PARTS: tl.constexpr, ACCUMULATE: tl.constexpr, SQ: tl.constexpr = False,
):
    """:func:`_wgrad_tma_kernel` summed over ``PARTS`` (1-4) operand pairs, each with
    its own rows and layout (e.g. several micro-batches' ``d_out``/``rows``): ``dW[e]
    (+)= sum_p g_p,e^T @ x_p,e``, part ``p``'s rows ``o_p[e] .. min(o_p[e+1], R_p)``.
    One accumulator, one store: a deferred weight gradient
    (:mod:`linghe.bwd.deferred`). ``gs_p``/``xs_p``: part ``p``'s 16-row-box descriptors
    (``TAIL=2``; any descriptors otherwise). The unused parts' arguments are ignored."""
    e, n0, k0 = _wgrad_tile(K, BN, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    acc = _wgrad_tma_segment(acc, g0, x0, gs0, xs0, o0, e, R0, n0, k0, BR, TAIL)
    if PARTS > 1:
        acc = _wgrad_tma_segment(acc, g1, x1, gs1, xs1, o1, e, R1, n0, k0, BR, TAIL)
    if PARTS > 2:
        acc = _wgrad_tma_segment(acc, g2, x2, gs2, xs2, o2, e, R2, n0, k0, BR, TAIL)
    if PARTS > 3:
        acc = _wgrad_tma_segment(acc, g3, x3, gs3, xs3, o3, e, R3, n0, k0, BR, TAIL)
    _wgrad_tile_store(acc, w_ptr, e, n0, k0, N, K, stride_we, stride_wn, sq_ptr, BN, BK,
                      ACCUMULATE, SQ)


@functools.cache
def _wgrad_tma_default_config(accumulate: bool = False) -> dict:
    """The TMA wgrad's tiles: ``BN x BK`` output tile, ``BR`` rows per box, warps,
    pipeline stages, ``TAIL`` (see :func:`_wgrad_tma_kernel`). GPU: 128x128 / 64-row
    boxes / 3 stages (96 KiB of shared memory: two programs per SM, so one's epilogue
    overlaps the other's loads and MMAs); 8 warps and 16-row tail boxes, or, when
    accumulating, 4 warps (251 registers, no spills) and one masked tail box: 4-6%
    faster there at 256 experts on an H100 (``probe_wgrad_tma``, two runs;
    ``benchmark/results/h100_probe_wgrad_tma_acc*_2026-11-26.*``). Reading the existing
    gradient before the K loop as the accumulator's start instead of after it was 5-8%
    slower and was not kept. Interpreter: small tiles."""
    if INTERPRET:
        return dict(BN=32, BK=32, BR=32, num_warps=4, num_stages=1, TAIL=2)
    if accumulate:
        return dict(BN=128, BK=128, BR=64, num_warps=4, num_stages=3, TAIL=1)
    return dict(BN=128, BK=128, BR=64, num_warps=8, num_stages=3, TAIL=2)


def _check_wgrad_tma_config(config: dict) -> dict:
    known = {"BN", "BK", "BR", "num_warps", "num_stages", "TAIL"}
    if set(config) - known:
        raise ValueError(f"TMA wgrad config: unknown keys {sorted(set(config) - known)} "
                         f"(takes {sorted(known)})")
    cfg = dict(_wgrad_tma_default_config(), **config)
    for k in ("BN", "BK", "BR"):
        v = cfg[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"TMA wgrad config: {k} must be a power of two >= 16, got {v}")
    if cfg["TAIL"] not in (0, 1, 2):
        raise ValueError(f"TMA wgrad config: TAIL must be 0, 1 or 2, got {cfg['TAIL']}")
    return cfg


def wgrad_tma_unsupported(g: torch.Tensor, x: torch.Tensor,
                          dw: torch.Tensor | None = None) -> str | None:
    """Why :func:`launch_wgrad_tma` cannot run these operands (a message), or ``None``:
    ``g [R, N]`` and ``x [R, K]`` bf16/fp16 of one dtype on one device, unit last stride,
    row strides and base addresses 16-byte aligned (TMA); ``dw [E, N, K]`` (if given)
    contiguous, bf16/fp16/fp32, on their device."""
    if g.dim() != 2 or x.dim() != 2 or (dw is not None and dw.dim() != 3):
        return "needs d_out [R, N], rows [R, K] and dW [E, N, K]"
    if g.dtype not in (torch.bfloat16, torch.float16) or x.dtype != g.dtype:
        return f"needs bf16/fp16 operands of one dtype, got {g.dtype} and {x.dtype}"
    if g.shape[0] != x.shape[0] or g.device != x.device:
        return f"d_out {tuple(g.shape)} and rows {tuple(x.shape)}: rows or device differ"
    for name, t in (("d_out", g), ("rows", x)):
        if t.shape[1] > 1 and t.stride(1) != 1:  # (even one row: TMA assumes unit stride)
            return f"{name} must be contiguous along its last dim"
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return (f"{name}: TMA needs 16-byte aligned rows (row stride "
                    f"{t.stride(0)} elements) and base address")
    if dw is None:
        return None
    if dw.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"needs a bf16/fp16/fp32 dW, got {dw.dtype}"
    if tuple(dw.shape[1:]) != (g.shape[1], x.shape[1]) or dw.device != g.device:
        return f"dW {tuple(dw.shape)} on {dw.device} does not match the operands"
    if not dw.is_contiguous():
        return "needs a contiguous dW"
    return None


def _wgrad_descriptors(g: torch.Tensor, x: torch.Tensor, cfg: dict) -> tuple:
    """TMA descriptors of the wgrad operands ``g [R, N]`` and ``x [R, K]``: ``[BR, BN]`` /
    ``[BR, BK]`` boxes, then the 16-row boxes of ``TAIL=2`` (else the same two again)."""
    (R, N), K = g.shape, x.shape[1]
    BN, BK, BR = cfg["BN"], cfg["BK"], cfg["BR"]
    g_desc = TensorDescriptor(g, [R, N], [g.stride(0), 1], [BR, BN])
    x_desc = TensorDescriptor(x, [R, K], [x.stride(0), 1], [BR, BK])
    if cfg["TAIL"] != 2:
        return g_desc, x_desc, g_desc, x_desc
    return (g_desc, x_desc, TensorDescriptor(g, [R, N], [g.stride(0), 1], [16, BN]),
            TensorDescriptor(x, [R, K], [x.stride(0), 1], [16, BK]))


def launch_wgrad_tma(g: torch.Tensor, x: torch.Tensor, dw: torch.Tensor,
                     offsets: torch.Tensor, *, accumulate: bool = False,
                     config: dict | None = None) -> torch.Tensor:
    """``dW_e = g_e^T @ x_e`` over each expert ``e``'s rows ``offsets[e] ..
    offsets[e+1]`` (:func:`_wgrad_tma_kernel`): ``g [R, N]``, ``x [R, K]`` bf16/fp16
    (row-major, 16-byte aligned rows), ``offsets [E + 1]`` int32 on the device (rows past
    ``offsets[E]`` ignored), written into ``dw [E, N, K]`` (contiguous, bf16/fp16/fp32),
    which is returned; ``accumulate=True`` adds to ``dw`` instead (fp32 sum, one
    rounding). ``config``: tiles (keys of :func:`_wgrad_tma_default_config`). Raises
    ``ValueError`` for operands TMA cannot describe (:func:`wgrad_tma_unsupported`);
    other checks are the functional layer's."""
    why = wgrad_tma_unsupported(g, x, dw)
    if why is not None:
        raise ValueError(f"launch_wgrad_tma: {why}")
    E, N, K = dw.shape
    R = g.shape[0]
    if E == 0 or N == 0 or K == 0:
        return dw
    if R == 0:  # nothing to contract (TMA cannot describe an empty tensor)
        return dw if accumulate else dw.zero_()
    cfg = (_wgrad_tma_default_config(accumulate) if config is None
           else _check_wgrad_tma_config(config))
    BN, BK, BR = cfg["BN"], cfg["BK"], cfg["BR"]
    g_desc, x_desc, g16, x16 = _wgrad_descriptors(g, x, cfg)
    with device_guard(dw):
        launch(_wgrad_tma_kernel, (cdiv(N, BN) * cdiv(K, BK), E), g_desc, x_desc, g16, x16,
               dw, offsets, N, K, R, dw.stride(0), dw.stride(1), dw, BN=BN, BK=BK, BR=BR,
               TAIL=cfg["TAIL"], ACCUMULATE=bool(accumulate), num_warps=cfg["num_warps"],
               num_stages=cfg["num_stages"])
    return dw


@functools.cache
def _wgrad_tma_parts_default_config() -> dict:
    """The multi-part TMA wgrad's tiles (:func:`launch_wgrad_tma_parts`): 128x128 output
    tiles, 32-row boxes, 4 warps, 3 stages, 16-row tail boxes (``TAIL=2``). Each part's
    loop is short (~256 rows per expert at 256 experts), so its pipeline fills and drains
    once per part; smaller boxes shorten both. At 256 experts and 4 micro-batches on an
    H100: gate_up 4167 us, down 2182 us, against 4732 / 2463 at the accumulating
    single-part kernel's tiles (64-row boxes, one masked tail box) and 5079 / 2638 with
    32-row boxes and a masked tail (``h100_probe_deferred_wgrad_parts_m4_*_s7.json``;
    4 stages, 2 stages, 8 warps and 64-wide tiles were slower). Interpreter: small
    tiles."""
    if INTERPRET:
        return dict(BN=32, BK=32, BR=32, num_warps=4, num_stages=1, TAIL=2)
    return dict(BN=128, BK=128, BR=32, num_warps=4, num_stages=3, TAIL=2)


def wgrad_sq_size(dw: torch.Tensor, config: dict | None = None) -> int:
    """The length of :func:`launch_wgrad_tma_parts`'s ``sq_out``: one float32 per output
    tile of ``dw [E, N, K]``."""
    cfg = dict(_wgrad_tma_parts_default_config(), **(config or {}))
    E, N, K = dw.shape
    return E * cdiv(N, cfg["BN"]) * cdiv(K, cfg["BK"])


def _checked_parts(parts, dw: torch.Tensor, caller: str) -> list:
    """``parts`` as a list, each ``(g, x, offsets)`` TMA-describable against ``dw``
    (:func:`wgrad_tma_unsupported`) with ``offsets`` a contiguous int32/int64 ``[E + 1]``
    on ``dw``'s device, at least one; else ``ValueError``."""
    parts = list(parts)
    if not parts:
        raise ValueError(f"{caller} needs at least one (g, x, offsets) part")
    E = dw.shape[0] if dw.dim() == 3 else -1
    for g, x, o in parts:
        why = wgrad_tma_unsupported(g, x, dw)
        if why is None and (o.dim() != 1 or o.numel() != E + 1 or o.stride(0) != 1
                            or o.dtype not in (torch.int32, torch.int64)
                            or o.device != dw.device):
            why = (f"offsets must be a contiguous int32/int64 [E + 1] = [{E + 1}] tensor on "
                   f"{dw.device}, got {o.dtype} {tuple(o.shape)} on {o.device}")
        if why is not None:
            raise ValueError(f"{caller}: {why}")
    return parts


def launch_wgrad_tma_parts(parts, dw: torch.Tensor, *, accumulate: bool = False,
                           config: dict | None = None,
                           sq_out: torch.Tensor | None = None) -> torch.Tensor:
    """``dW_e (+)= sum_p g_p,e^T @ x_p,e`` over several operand pairs ``parts = [(g_p
    [R_p, N], x_p [R_p, K], offsets_p [E + 1]), ...]`` (each as
    :func:`launch_wgrad_tma` takes one; their ``R_p`` and layouts may differ), written
    into ``dw [E, N, K]`` with one fp32 accumulator per tile and one rounding per launch
    of up to :data:`MAX_PARTS` parts (more are chunked: the later chunks add to ``dw``).
    ``accumulate=True`` adds to ``dw``'s contents. ``config``: tiles (keys of
    :func:`_wgrad_tma_default_config`, ``TAIL`` as there). ``sq_out``: float32
    ``[wgrad_sq_size(dw)]`` that receives, per output tile, the sum of the squares of
    ``dw``'s final values (in float32, before their rounding to ``dw``'s dtype): the
    squared norm of ``dw`` is its sum. Raises
    ``ValueError`` for operands TMA cannot describe (:func:`wgrad_tma_unsupported`).
    Returns ``dw``."""
    parts = _checked_parts(parts, dw, "launch_wgrad_tma_parts")
    E, N, K = dw.shape
    if E == 0 or N == 0 or K == 0:
        return dw
    cfg = _check_wgrad_tma_config(dict(_wgrad_tma_parts_default_config(), **(config or {})))
    BN, BK, BR = cfg["BN"], cfg["BK"], cfg["BR"]
    if sq_out is not None and (sq_out.dtype != torch.float32 or not sq_out.is_contiguous()
                               or sq_out.numel() != wgrad_sq_size(dw, cfg)):
        raise ValueError(f"sq_out must be a contiguous float32 tensor of "
                         f"{wgrad_sq_size(dw, cfg)} elements")
    parts = [p for p in parts if p[0].shape[0] > 0]  # (TMA cannot describe an empty tensor)
    if not parts:
        if not accumulate:
            dw.zero_()
        if sq_out is not None:
            sq_out.zero_()
            sq_out[:1] = dw.float().square().sum()
        return dw
    grid = (cdiv(N, BN) * cdiv(K, BK), E)
    last = (len(parts) - 1) // MAX_PARTS * MAX_PARTS
    for c in range(0, len(parts), MAX_PARTS):
        chunk = parts[c:c + MAX_PARTS]
        args = []
        for g, x, offsets in chunk:
            args += [*_wgrad_descriptors(g, x, cfg), offsets, g.shape[0]]
        args += args[:6] * (MAX_PARTS - len(chunk))  # unused parts (never read)
        with device_guard(dw):
            sq = sq_out is not None and c == last  # (the last chunk stores final values)
            launch(_wgrad_tma_parts_kernel, grid, *args, dw, N, K, dw.stride(0),
                   dw.stride(1), sq_out if sq else dw, BN=BN, BK=BK, BR=BR,
                   TAIL=cfg["TAIL"], PARTS=len(chunk), ACCUMULATE=bool(accumulate or c > 0),
                   SQ=sq, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dw


def hp_wgrad_ws_ok(g: torch.Tensor, x: torch.Tensor, dw_dtype: torch.dtype) -> bool:
    """Whether the 16-bit wgrad takes the warp-specialized kernel
    (:func:`~linghe.fwd.grouped_mm_ws.launch_hp_wgrad_ws`): sm_90 with Gluon,
    :data:`~linghe.fwd.grouped_mm.HP_WS` on, operands TMA can describe
    (:func:`wgrad_tma_unsupported`) with rows, a bf16/fp16/fp32 ``dW``."""
    return (_fwd_gm.HP_WS and dw_dtype in (torch.bfloat16, torch.float16, torch.float32)
            and g.shape[0] > 0 and _fwd_gm.ws_capable(g)
            and wgrad_tma_unsupported(g, x) is None)


def launch_wgrad_parts(parts, dw: torch.Tensor, *, accumulate: bool = False,
                       norm_sq: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dW_e (+)= sum_p g_p,e^T @ x_p,e`` over operand pairs ``parts = [(g_p [R_p, N],
    x_p [R_p, K], offsets_p [E + 1]), ...]`` (bf16/fp16, as :func:`launch_wgrad_tma_parts`
    takes them) into ``dw [E, N, K]``: the warp-specialized kernel on sm_90
    (:func:`hp_wgrad_ws_ok`; 1.29x the Triton kernel at 256 experts and 4 micro-batches on
    an H200), else :func:`launch_wgrad_tma_parts`. ``norm_sq``: also return float32
    partial sums of the squares of ``dw``'s final values (their sum is its squared norm),
    else ``None``. Returns ``(dw, sums)``."""
    parts = _checked_parts(parts, dw, "launch_wgrad_parts")
    live = [p for p in parts if p[0].shape[0] > 0]  # (TMA cannot describe an empty tensor)
    if (live and dw.numel() > 0 and all(p[0].dtype == live[0][0].dtype for p in live)
            and hp_wgrad_ws_ok(live[0][0], live[0][1], dw.dtype)):
        sq = (torch.empty(hp_wgrad_ws_sq_size(dw), dtype=torch.float32, device=dw.device)
              if norm_sq else None)
        return launch_hp_wgrad_ws(live, dw, accumulate=accumulate, sq_out=sq), sq
    sq = (torch.empty(wgrad_sq_size(dw), dtype=torch.float32, device=dw.device)
          if norm_sq else None)
    return launch_wgrad_tma_parts(parts, dw, accumulate=accumulate, sq_out=sq), sq


def _wgrad_tma_route(g: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether :data:`WGRAD_TMA` sends this wgrad to :func:`launch_wgrad_tma`."""
    return (WGRAD_TMA and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
            and g.dtype in (torch.bfloat16, torch.float16) and tma_capable(g)
            and wgrad_tma_unsupported(g, x) is None)


def grouped_mm_wgrad(d_out: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, *,
                     out_dtype: torch.dtype | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """``dW [E, N, K]``: ``dW_e = d_out_e^T @ rows_e`` over expert ``e``'s segment, fp32
    accumulation, ``out_dtype`` (default ``rows.dtype``). ``backend`` ``"auto"`` /
    ``"triton"``: the warp-specialized kernel on sm_90 (:func:`hp_wgrad_ws_ok`), else
    (``"auto"``, bf16) ``torch._grouped_mm`` where it runs, else the Triton kernel;
    ``"torch"``: ``torch._grouped_mm``."""
    R, N = d_out.shape
    K = rows.shape[1]
    E = offsets.numel() - 1
    out_dtype = out_dtype or rows.dtype
    if (backend != "torch" and N > 0 and K > 0 and E > 0
            and hp_wgrad_ws_ok(d_out, rows, out_dtype)):  # sm_90: faster than torch's
        return launch_hp_wgrad_ws([(d_out, rows, offsets)],
                                  empty(E, N, K, dtype=out_dtype, device=rows.device))
    if backend != "torch" and _wgrad_tma_route(d_out, rows, out_dtype):  # LINGHE_WGRAD_TMA
        return launch_wgrad_tma(d_out, rows, empty(E, N, K, dtype=out_dtype,
                                                   device=rows.device), offsets)
    use_torch = (backend == "torch" or (backend == "auto" and out_dtype == torch.bfloat16
                                        and torch_grouped_mm_ok(d_out, rows)))
    if use_torch and N > 0 and K > 0 and E > 0:
        # 2D x 2D with offs along the contraction (row) dim -> [E, N, K]; rows past
        # offsets[E] are ignored, an empty group gives zeros.
        return torch._grouped_mm(d_out.t(), rows, offs=offsets[1:]).to(out_dtype)
    dw = empty(E, N, K, dtype=out_dtype, device=rows.device)
    return _launch_wgrad(d_out, rows, dw, offsets,
                         (d_out.stride(0), d_out.stride(1), rows.stride(0), rows.stride(1), R))


#: Fused accumulation on Hopper+ through the TMA wgrad (FP8 rows dequantized first);
#: ``LINGHE_WGRAD_ACCUMULATE_TMA=0``: the pointer kernel (FP8 rows dequantized in its loads),
#: which older GPUs always take.
WGRAD_ACCUMULATE_TMA: bool = os.environ.get("LINGHE_WGRAD_ACCUMULATE_TMA", "1") == "1"


def wgrad_accumulate_operand(rows: torch.Tensor, rows_scale: torch.Tensor | None,
                             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows, rows_scale)`` as :func:`grouped_mm_wgrad_accumulate_` will read them, made
    before any gradient is touched: FP8 rows dequantized to ``dtype`` where the TMA
    kernel takes them (it reads 16-bit operands), else as given (the pointer kernel
    dequantizes in its loads). So the accumulation itself allocates nothing and cannot
    fail halfway through a backward. ``rows`` may be a
    :class:`~linghe.fwd.permute.TokenRows` (FP8 rows not made yet): they are made here,
    dequantized or FP8 as above."""
    tokens = isinstance(rows, TokenRows)
    if ((rows_scale is not None or tokens) and WGRAD_ACCUMULATE_TMA
            and tma_capable(rows.data if tokens else rows)
            and rows.shape[0] > 0 and dtype in (torch.bfloat16, torch.float16)):
        if tokens:
            return rows.dequantized(dtype), None
        return dequantize_1x128_rows(rows, rows_scale, dtype), None
    return rows.fp8() if tokens else (rows, groups_adjacent(rows_scale))


def grouped_mm_wgrad_accumulate_(dw: torch.Tensor, d_out: torch.Tensor, rows: torch.Tensor,
                                 offsets: torch.Tensor, *,
                                 rows_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``dw[e] += d_out_e^T @ rows_e`` in place over expert ``e``'s segment (kernel-level
    API; fp32 accumulation, one rounding to ``dw``'s dtype): fused gradient accumulation
    (:mod:`linghe.bwd.accumulate`), where ``dw`` is a weight's existing ``.grad``.

    ``d_out [R, N]`` float32/float16/bfloat16; ``rows [R, K]`` in ``d_out``'s dtype, or
    FP8 e4m3 (the rowwise 1x128 copy an FP8 GEMM multiplied) with ``rows_scale [R,
    cdiv(K, 128)]`` float32, dequantized in the kernel's loads; ``dw [E, N, K]``
    contiguous, ``E = offsets.numel() - 1``. Experts without rows keep ``dw[e]``.
    Returns ``dw``."""
    R, N = d_out.shape
    K = rows.shape[1]
    E = offsets.numel() - 1
    if tuple(dw.shape) != (E, N, K) or not dw.is_contiguous():
        raise ValueError(f"dw must be a contiguous (E={E}, N={N}, K={K}) tensor, got "
                         f"{tuple(dw.shape)}")
    if rows.shape[0] != R or rows.stride(1) != 1 or d_out.stride(1) != 1:
        raise ValueError(f"d_out [R, N] and rows [R, K] must share R and be contiguous "
                         f"along their last dim, got {tuple(d_out.shape)}, "
                         f"{tuple(rows.shape)}")
    fp8_rows = rows.dtype == torch.float8_e4m3fn
    if (rows.dtype != d_out.dtype and not fp8_rows) or ((rows_scale is None) == fp8_rows):
        raise TypeError(f"rows must have d_out's dtype {d_out.dtype} (or be FP8 with "
                        f"rows_scale), got {rows.dtype}")
    if rows_scale is not None and (tuple(rows_scale.shape) != (R, cdiv(K, BLOCK))
                                   or rows_scale.dtype != torch.float32):
        raise ValueError(f"rows_scale must be float32 [R, ceil(K/128)] = {(R, cdiv(K, BLOCK))}"
                         f", got {rows_scale.dtype} {tuple(rows_scale.shape)}")
    x, x_scale = wgrad_accumulate_operand(rows, rows_scale, d_out.dtype)
    if (x_scale is None and WGRAD_ACCUMULATE_TMA and tma_capable(dw) and R > 0
            and wgrad_tma_unsupported(d_out, x, dw) is None):
        if dw.numel() > 0 and hp_wgrad_ws_ok(d_out, x, dw.dtype):
            return launch_hp_wgrad_ws([(d_out, x, offsets)], dw, accumulate=True)
        return launch_wgrad_tma(d_out, x, dw, offsets, accumulate=True)
    return _launch_wgrad(d_out, x, dw, offsets,
                         (d_out.stride(0), d_out.stride(1), x.stride(0), x.stride(1), R),
                         accumulate=True, x_scale=x_scale)


def grouped_mm_fp8_wgrad(dout_fp8: Fp8Tensor, a_fp8: Fp8Tensor, offsets: torch.Tensor,
                         out_dtype: torch.dtype = torch.bfloat16, *, segments: bool = False,
                         align: int = 1, config: dict | None = None) -> torch.Tensor:
    """FP8 wgrad launcher from the columnwise copies: ``dout_fp8`` ``[R, N]`` and
    ``a_fp8`` ``[R, K]``, each with ``columnwise_data [*, R]`` quantized in 128-token
    groups along the whole buffer (``segments=False``) or in groups that follow the
    segments of ``offsets`` (``segments=True``, both copies alike; ``align``: the
    segments' alignment, a hint for vector loads) -> ``dW [E, N, K]`` in ``out_dtype``.
    ``config``: pinned tiles instead of the autotuner/heuristic (keys ``BN``, ``BK``,
    ``num_warps``, ``num_stages``; optional ``RESCALE``, default
    :data:`~linghe.fwd.grouped_mm.FP8_RESCALE`, and ``VEC_MASK``, default
    :data:`WGRAD_VEC_MASK`), or ``{"WS": True, ...}`` with the warp-specialized
    kernel's keys (:data:`~linghe.fwd.grouped_mm_ws.WGRAD_WS_CONFIG`).

    On sm_90, segment groups run the warp-specialized Gluon kernel
    (:func:`~linghe.fwd.grouped_mm_ws.launch_fp8_wgrad_ws`; same promotion, same
    result) where TMA can read the copies (``R`` a multiple of 16); the Triton kernel
    everywhere else."""
    gq, gs = dout_fp8.columnwise_data, dout_fp8.columnwise_scale  # [N, R], [N, G]
    xq, xs = a_fp8.columnwise_data, a_fp8.columnwise_scale  # [K, R], [K, G]
    N, R = gq.shape
    K = xq.shape[0]
    E = offsets.numel() - 1
    dw = empty(E, N, K, dtype=out_dtype, device=gq.device)
    if E == 0 or N == 0 or K == 0:
        return dw
    # Scales transposed to [G, N] / [G, K] (small copies): each 128-token step then reads
    # a tile's scales with one contiguous load instead of BN strided ones.
    gs_t, xs_t = gs.t().contiguous(), xs.t().contiguous()
    ws = (config.get("WS", False) if config is not None
          else _fwd_gm.FP8_WS and not _fwd_gm.FP8_RESCALE)
    if segments and ws and _fwd_gm.ws_capable(gq) and wgrad_ws_operands_ok(gq, xq):
        ws_cfg = None if config is None else {k: v for k, v in config.items() if k != "WS"}
        return launch_fp8_wgrad_ws(gq, xq, gs_t, xs_t, dw, offsets, ws_cfg)
    if config is not None and config.get("WS"):
        config = None  # asked for the warp-specialized kernel where it cannot run
    args = (gq, xq, dw, gs_t, xs_t, offsets, N, K, R, E, gq.stride(0), xq.stride(0),
            gs_t.stride(0), xs_t.stride(0), dw.stride(0), dw.stride(1))
    align16 = segments and align % 16 == 0
    flags = dict(BR=BLOCK, SEG=segments, EP2=max(16, next_power_of_2(E)), ALIGN16=align16)
    if config is not None:
        cfg = dict(BN=config["BN"], BK=config["BK"], num_warps=config["num_warps"],
                   num_stages=config["num_stages"],
                   RESCALE=bool(config.get("RESCALE", _fwd_gm.FP8_RESCALE)),
                   VEC_MASK=align16 and bool(config.get("VEC_MASK", WGRAD_VEC_MASK)))
        with device_guard(dw):
            launch(_wgrad_fp8_kernel, (cdiv(N, cfg["BN"]) * cdiv(K, cfg["BK"]), E), *args,
                   **flags, **cfg)
        return dw
    flags["RESCALE"] = _fwd_gm.FP8_RESCALE
    flags["VEC_MASK"] = align16 and WGRAD_VEC_MASK
    with device_guard(dw):
        if R >= AUTOTUNE_MIN_ROWS and _autotune_enabled():
            _wgrad_fp8_tuned()[lambda meta: (cdiv(N, meta["BN"]) * cdiv(K, meta["BK"]), E)](
                *args, **flags)
            return dw
        cfg = _wgrad_config(True, False)
        launch(_wgrad_fp8_kernel, (cdiv(N, cfg["BN"]) * cdiv(K, cfg["BK"]), E), *args,
               **flags, BN=cfg["BN"], BK=cfg["BK"], num_warps=cfg["num_warps"],
               num_stages=cfg["num_stages"])
    return dw


# The FP8 wgrad autotune space (GPU, R >= AUTOTUNE_MIN_ROWS): [BN, BK] output tiles per
# expert, promoted per 128-token group like the forward.
_WGRAD_FP8_CONFIGS = [
    triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4),
                          (64, 128, 4, 4), (64, 256, 8, 3)]]
_wgrad_tuned = None


def _wgrad_fp8_tuned():
    global _wgrad_tuned
    if _wgrad_tuned is None:
        _wgrad_tuned = triton.autotune(configs=_WGRAD_FP8_CONFIGS,
                                       key=["N", "K", "E", "SEG", "RESCALE", "VEC_MASK"])(
                                           _wgrad_fp8_kernel)
    return _wgrad_tuned
