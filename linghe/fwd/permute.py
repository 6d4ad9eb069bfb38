"""MoE permute / unpermute forward kernels (rows grouped by expert, padded by index).

Index map (two small kernels, deterministic, no atomics, no host sync):

1. ``_hist_kernel``: the flat copies ``n = t*k + j`` are cut into chunks of ``CHUNK``;
   each program writes its chunk's per-expert histogram ``hist[c, E]``.
2. ``_index_kernel``: each chunk sums the histograms of all chunks (totals -> padded
   counts -> segment offsets) and of the chunks before it (exclusive prefix), then ranks
   its own copies in token order with a one-hot cumulative sum: ``row_index[t, j] =
   offsets[e] + (copies of e before n)``. Program 0 also writes the layout tensors.

Data movement (one launch each):

- ``scatter_rows``: one program per block of tokens reads each token's row once and
  writes it to its ``k`` destination rows (optionally times a per-copy weight), and extra
  programs write zeros to every padding row and to the tail (rows ``>= offsets[E]``).
- ``gather_rows``: one program per block of tokens sums the token's ``k`` rows (optionally
  weighted) in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.quantize import FP8_DTYPE, groups_adjacent, quant_rows
from ..layout import ExpertLayout
from ..utils import INTERPRET, cdiv, device_guard, empty, launch, next_power_of_2, num_sms

CHUNK = 256  # copies per index program: T*k = 65536 -> 256 programs (latency-bound scans)


@triton.jit
def _hist_kernel(ids_ptr, hist_ptr, N, E, CHUNK: tl.constexpr, SUB: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    eb = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        n = c * CHUNK + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + n, mask=n < N, other=-1).to(tl.int32)
        valid = (ids >= 0) & (ids < E)
        onehot = ((ids[:, None] == eb[None, :]) & valid[:, None]).to(tl.int32)
        acc += tl.sum(onehot, axis=0)
    tl.store(hist_ptr + c * E + eb, acc, mask=eb < E)


@triton.jit
def _index_kernel(ids_ptr, hist_ptr, row_index_ptr, tpe_ptr, padded_ptr, offsets_ptr,
                  N, E, C, align, num_rows, CHUNK: tl.constexpr, SUB: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0)
    eb = tl.arange(0, BLOCK_E)
    emask = eb < E
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        h = tl.load(hist_ptr + cs.to(tl.int64)[:, None] * E + eb[None, :],
                    mask=(cs < C)[:, None] & emask[None, :], other=0)
        total += tl.sum(h, axis=0)
        before += tl.sum(tl.where((cs < c)[:, None], h, 0), axis=0)
    padded = (total + align - 1) // align * align
    seg_end = tl.cumsum(padded, axis=0)
    seg_start = seg_end - padded
    first = (tl.zeros([BLOCK_E], dtype=tl.int32) + c) == 0
    tl.store(tpe_ptr + eb, total, mask=emask & first)
    tl.store(padded_ptr + eb, padded, mask=emask & first)
    tl.store(offsets_ptr + 1 + eb, seg_end, mask=emask & first)
    tl.store(offsets_ptr + eb, tl.zeros([BLOCK_E], dtype=tl.int32), mask=(eb == 0) & first)
    base = seg_start + before
    for s in range(0, CHUNK, SUB):
        n = c.to(tl.int64) * CHUNK + s + tl.arange(0, SUB)
        nmask = n < N
        ids = tl.load(ids_ptr + n, mask=nmask, other=-1).to(tl.int32)
        valid = (ids >= 0) & (ids < E)
        onehot = ((ids[:, None] == eb[None, :]) & valid[:, None]).to(tl.int32)
        incl = tl.cumsum(onehot, axis=0)
        row = tl.sum(onehot * (base[None, :] + incl - 1), axis=1)
        row = tl.where(valid & (row < num_rows), row, -1)
        tl.store(row_index_ptr + n, row, mask=nmask)
        base += tl.sum(onehot, axis=0)


def build_index(expert_ids: torch.Tensor, num_experts: int, align: int,
                num_rows: int) -> ExpertLayout:
    """Index map of ``permute``: an :class:`ExpertLayout` with ``row_index [T, k]`` int32.

    ``expert_ids [T, k]`` int32/int64 (contiguous). Ids outside ``[0, E)`` are dropped
    (``row_index = -1``, not counted); so are copies whose row would be ``>= num_rows``.
    Rows of an expert are in token order (then ``j`` order): deterministic.
    """
    return layout_from_index(index_buffer(expert_ids, num_experts, align, num_rows),
                             expert_ids.shape, num_experts, align, num_rows)


def index_buffer(expert_ids: torch.Tensor, num_experts: int, align: int,
                 num_rows: int) -> torch.Tensor:
    """The launches of :func:`build_index`: one int32 buffer whose first ``T*k + 3E + 1``
    entries are ``row_index | tokens_per_expert | padded | offsets`` (then scratch)."""
    T, k = expert_ids.shape
    dev = expert_ids.device
    E = num_experts
    N = T * k
    BLOCK_E = next_power_of_2(E)
    SUB = max(16, min(64, 8192 // BLOCK_E))
    chunk = max(CHUNK, SUB)
    C = cdiv(N, chunk)
    # one allocation for every int32 output and the scratch histogram (fewer host ops)
    buf = empty(N + 3 * E + 1 + C * E, dtype=torch.int32, device=dev)
    if N == 0:
        buf.zero_()
        return buf
    row_index, tpe, padded, offsets = _index_views(buf, N, E)
    BLOCK_C = max(2, min(64, 8192 // BLOCK_E))
    hist = buf[N + 3 * E + 1:]
    nw = 4 if BLOCK_E <= 256 else 8
    with device_guard(expert_ids):
        launch(_hist_kernel, (C,), expert_ids, hist, N, E, CHUNK=chunk, SUB=SUB,
               BLOCK_E=BLOCK_E, num_warps=nw)
        launch(_index_kernel, (C,), expert_ids, hist, row_index, tpe, padded, offsets, N, E, C,
               align, num_rows, CHUNK=chunk, SUB=SUB, BLOCK_E=BLOCK_E,
               BLOCK_C=BLOCK_C, num_warps=nw)
    return buf


def _index_views(buf: torch.Tensor, N: int, E: int):
    return buf[:N], buf[N:N + E], buf[N + E:N + 2 * E], buf[N + 2 * E:N + 3 * E + 1]


def layout_from_index(buf: torch.Tensor, ids_shape, num_experts: int, align: int,
                      num_rows: int) -> ExpertLayout:
    """The :class:`ExpertLayout` whose tensors are views of an :func:`index_buffer`."""
    T, k = ids_shape
    row_index, tpe, padded, offsets = _index_views(buf, T * k, num_experts)
    return ExpertLayout(num_experts=num_experts, align=align, num_rows=num_rows,
                        tokens_per_expert=tpe, padded_tokens_per_expert=padded,
                        offsets=offsets, row_index=row_index.view(T, k))


# ------------------------------------------------------------------------------ scatter
@triton.jit
def _zero_range(out_ptr, start, end, step, ncols, BR: tl.constexpr, BH: tl.constexpr,
                VALUE: tl.constexpr):
    """Write ``VALUE`` to rows ``[start, end)`` (stepping ``step`` rows per block) of a
    row-major ``[*, ncols]`` buffer."""
    for r0 in range(start, end, step):
        rr = r0 + tl.arange(0, BR)
        rmask = rr < end
        for h0 in range(0, ncols, BH):
            cols = h0 + tl.arange(0, BH)
            z = tl.full([BR, BH], VALUE, dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + rr.to(tl.int64)[:, None] * ncols + cols[None, :], z,
                     mask=rmask[:, None] & (cols < ncols)[None, :])


@triton.jit
def _scatter_kernel(x_ptr, xs_ptr, row_index_ptr, w_ptr, pin_ptr, out_ptr, os_ptr, pout_ptr,
                    rin_ptr, dw_ptr, offsets_ptr, tpe_ptr, q_ptr, qs_ptr,
                    T, H, G, E, num_rows, stride_x, stride_xs, n_tok_progs, n_tail_progs,
                    K_TOP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                    BG: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BHZ: tl.constexpr,
                    HAS_SCALE: tl.constexpr, HAS_W: tl.constexpr, HAS_P: tl.constexpr,
                    DOT: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr,
                    DEQUANT: tl.constexpr):
    """``QUANT`` (not with ``HAS_W``/``HAS_SCALE``): also the rowwise 1x128 FP8 copy of
    the output, each token row quantized once and its data and scales (``qs [num_rows,
    G]``, ``G = cdiv(H, 128)``) stored with every copy. ``DEQUANT`` (not with
    ``HAS_SCALE``): ``x`` is FP8 with 1x128 scales ``xs [T, G]``, written dequantized
    (fp32 product, one rounding). With either, ``BH`` is a multiple of 128 or covers
    ``H``."""
    pid = tl.program_id(0)
    if pid < n_tok_progs:
        toks = pid.to(tl.int64) * BT + tl.arange(0, BT)
        tmask = toks < T
        jj = tl.arange(0, BK)
        m2 = tmask[:, None] & (jj < K_TOP)[None, :]
        # the block's row indices (and weights) in registers: no dependent loads below
        r2 = tl.load(row_index_ptr + toks[:, None] * K_TOP + jj[None, :], mask=m2,
                     other=-1).to(tl.int64)
        if HAS_W:
            w2 = tl.load(w_ptr + toks[:, None] * K_TOP + jj[None, :], mask=m2 & (r2 >= 0),
                         other=0.0)
        else:
            w2 = tl.zeros([BT, BK], dtype=tl.float32)
        dacc = tl.zeros([BT, BK], dtype=tl.float32)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)
            cmask = cols < H
            xm = tmask[:, None] & cmask[None, :]
            xt = tl.load(x_ptr + toks[:, None] * stride_x + cols[None, :], mask=xm, other=0.0)
            # QUANT, DEQUANT: the block's 1x128 groups (one, narrower, when H < 128)
            GS: tl.constexpr = 128 if BH >= 128 else BH
            gg = h0 // 128 + tl.arange(0, BH // GS)
            if DEQUANT:
                sc = tl.load(xs_ptr + toks[:, None] * stride_xs + gg[None, :],
                             mask=tmask[:, None] & (gg < G)[None, :], other=1.0)
                xt = tl.reshape(tl.reshape(xt.to(tl.float32), [BT, BH // GS, GS])
                                * sc[:, :, None], [BT, BH])
            if QUANT:  # the output's values (rounded to its dtype), quantized once
                xq = tl.reshape(xt.to(out_ptr.dtype.element_ty).to(tl.float32),
                                [BT * (BH // GS), GS])
                qv, sv = quant_rows(xq, POW2)
                qv = tl.reshape(qv, [BT, BH])
                sv = tl.reshape(sv, [BT, BH // GS])
            for j in range(K_TOP):
                r = tl.sum(tl.where(jj[None, :] == j, r2, 0), axis=1)
                ok = r >= 0
                om = ok[:, None] & cmask[None, :]
                if HAS_W:
                    w = tl.sum(tl.where(jj[None, :] == j, w2, 0.0), axis=1)
                    val = (xt.to(tl.float32) * w[:, None]).to(out_ptr.dtype.element_ty)
                else:
                    val = xt.to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + r[:, None] * H + cols[None, :], val, mask=om)
                if QUANT:
                    tl.store(q_ptr + r[:, None] * H + cols[None, :], qv, mask=om)
                    tl.store(qs_ptr + r[:, None] * G + gg[None, :], sv,
                             mask=ok[:, None] & (gg < G)[None, :])
                if DOT:
                    rv = tl.load(rin_ptr + r[:, None] * H + cols[None, :], mask=om, other=0.0)
                    d = tl.sum(rv.to(tl.float32) * xt.to(tl.float32), axis=1)
                    dacc += tl.where(jj[None, :] == j, d[:, None], 0.0)
        if DOT:
            tl.store(dw_ptr + toks[:, None] * K_TOP + jj[None, :], dacc,
                     mask=tmask[:, None] & (jj < K_TOP)[None, :])
        for j in range(K_TOP):
            r = tl.sum(tl.where(jj[None, :] == j, r2, 0), axis=1)
            ok = r >= 0
            if HAS_SCALE:
                gs = tl.arange(0, BG)
                for g0 in range(0, G, BG):
                    gg = g0 + gs
                    sm = tmask[:, None] & (gg < G)[None, :]
                    sc = tl.load(xs_ptr + toks[:, None] * stride_xs + gg[None, :], mask=sm,
                                 other=1.0)
                    tl.store(os_ptr + r[:, None] * G + gg[None, :], sc,
                             mask=ok[:, None] & (gg < G)[None, :])
            if HAS_P:
                p = tl.load(pin_ptr + toks * K_TOP + j, mask=tmask & ok, other=0.0)
                tl.store(pout_ptr + r, p, mask=ok)
    else:
        q = pid - n_tok_progs
        # q < E: the padding rows of expert q; else the tail rows offsets[E] .. num_rows,
        # spread over the tail programs.
        is_pad = q < E
        qe = tl.minimum(q, E - 1)
        off_q = tl.load(offsets_ptr + qe)
        off_q1 = tl.load(offsets_ptr + qe + 1)
        cnt_q = tl.load(tpe_ptr + qe)
        off_e = tl.load(offsets_ptr + E)
        start = tl.where(is_pad, off_q + cnt_q, off_e + (q - E) * BR)
        end = tl.where(is_pad, off_q1, num_rows + 0 * off_e)
        step = tl.where(is_pad, BR + 0 * off_e, n_tail_progs * BR + 0 * off_e)
        end = tl.minimum(end, num_rows)  # an explicit num_rows may cut a segment
        start = tl.minimum(start, end)
        _zero_range(out_ptr, start, end, step, H, BR, BHZ, 0.0)
        if HAS_SCALE:
            _zero_range(os_ptr, start, end, step, G, BR, BG, 1.0)
        if QUANT:
            _zero_range(q_ptr, start, end, step, H, BR, BHZ, 0.0)
            _zero_range(qs_ptr, start, end, step, G, BR, BG, 1.0)
        if HAS_P:
            _zero_range(pout_ptr, start, end, step, 1, BR, 16, 0.0)


def _token_tiles(H: int, elem: int) -> tuple[int, int]:
    BH = min(next_power_of_2(max(H, 1)), 4096 // elem if not INTERPRET else 256)
    BH = max(BH, 16)
    BT = max(1, min(16, (8192 if not INTERPRET else 2048) // BH))
    return BT, BH


def scatter_rows(x: torch.Tensor, layout: ExpertLayout, *, x_scale: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None, probs: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, dot_rows: torch.Tensor | None = None):
    """Scatter token rows to their expert rows: ``out[row_index[t, j]] = x[t] (* w[t, j])``.

    Args:
        x: ``[T, H]`` (last dim contiguous); fp8 data when ``x_scale [T, G]`` is given
            (its scale rows move with it).
        weights: optional ``[T, k]`` fp32 per-copy factor (the unpermute backward).
        probs: optional ``[T, k]`` fp32 copied to ``probs_rows[row]``.
        dot_rows: optional ``[num_rows, H]``: also return ``d[t, j] = <x[t], dot_rows[row]>``
            in fp32 (0 for dropped copies) — the probs gradient of ``unpermute``.

    Returns ``(out [num_rows, H], out_scale [num_rows, G] | None, probs_rows [num_rows] |
    None, d [T, k] | None)``. Padding rows and the tail are zeros (scales 1, probs 0).
    """
    return _scatter(x, layout, x_scale, weights, probs, out_dtype, dot_rows)[:4]


def scatter_rows_fp8_copy(x: torch.Tensor, layout: ExpertLayout, *,
                          out_dtype: torch.dtype | None = None, pow2_scale: bool = False):
    """:func:`scatter_rows` of a high-precision ``x [T, H]`` (no weights) that also writes
    the output's rowwise 1x128 FP8 copy, each token row quantized once (in registers,
    from its values in ``out_dtype``). Returns ``(out [num_rows, H], q [num_rows, H] e4m3,
    s [num_rows, cdiv(H, 128)] fp32)``; padding and tail rows 0 (scale 1): bit for bit
    what quantizing ``out`` gives (:func:`linghe.fp8.quantize.quant_rows`)."""
    out, _, _, _, q, s = _scatter(x, layout, None, None, None, out_dtype, None,
                                  quant=True, pow2=pow2_scale)
    return out, q, s


def _scatter(x, layout, x_scale, weights, probs, out_dtype, dot_rows, *, quant=False,
             pow2=False, dequant=False):
    """The launch of :func:`scatter_rows` (``quant``: also the output's FP8 copy;
    ``dequant``: ``x`` FP8 with ``x_scale``, written dequantized)."""
    T, H = x.shape
    k = layout.row_index.shape[1]
    E, R = layout.num_experts, layout.num_rows
    dev = x.device
    out = empty(R, H, dtype=out_dtype or x.dtype, device=dev)
    x_scale = groups_adjacent(x_scale)  # (the kernel reads a row's groups adjacent)
    G = x_scale.shape[1] if x_scale is not None else (cdiv(H, 128) if quant else 0)
    moves_scale = x_scale is not None and not dequant
    out_s = empty(R, G, dtype=torch.float32, device=dev) if moves_scale else None
    prow = empty(R, dtype=torch.float32, device=dev) if probs is not None else None
    d = empty(T, k, dtype=torch.float32, device=dev) if dot_rows is not None else None
    q = empty(R, H, dtype=FP8_DTYPE, device=dev) if quant else None
    qs = empty(R, G, dtype=torch.float32, device=dev) if quant else None
    BT, BH = _token_tiles(H, x.element_size())  # (BH < H only at powers of 2 >= 256)
    if dot_rows is not None:
        BT = max(1, BT // 2)
    BR = 16
    BHZ = min(max(next_power_of_2(max(H, 1)), 16), 256 if INTERPRET else 1024)
    n_tok = cdiv(T, BT)
    sms = num_sms(dev)
    n_tail = max(1, min(cdiv(R, BR), 2 * sms))
    grid = (n_tok + E + n_tail,)
    dummy = out
    with device_guard(x):
        launch(_scatter_kernel, grid,
            x, x_scale if x_scale is not None else dummy, layout.row_index,
            weights if weights is not None else dummy, probs if probs is not None else dummy,
            out, out_s if out_s is not None else dummy, prow if prow is not None else dummy,
            dot_rows if dot_rows is not None else dummy, d if d is not None else dummy,
            layout.offsets, layout.tokens_per_expert,
            q if quant else dummy, qs if quant else dummy,
            T, H, G, E, R, x.stride(0) if T else H,
            x_scale.stride(0) if x_scale is not None and T else max(G, 1), n_tok, n_tail,
            K_TOP=k, BT=BT, BH=BH, BG=max(16, min(next_power_of_2(max(G, 1)), 64)), BR=BR,
            BK=next_power_of_2(max(k, 1)), BHZ=BHZ, HAS_SCALE=moves_scale,
            HAS_W=weights is not None, HAS_P=probs is not None, DOT=dot_rows is not None,
            QUANT=quant, POW2=pow2, DEQUANT=dequant, num_warps=4 if BH * BT <= 4096 else 8)
    return out, out_s, prow, d, q, qs


class TokenRows:
    """FP8 expert rows not made yet: :func:`scatter_rows` of 1x128 FP8 tokens (``data [T,
    H]`` e4m3, ``scale [T, cdiv(H, 128)]`` fp32) by ``layout``, as ``permute`` of
    ``quantize_tokens`` made them. What an op keeps instead of the rows when it needs
    them again later (the experts' deferred high-precision wgrad): ``k`` times fewer
    bytes held, and the rows are made by one scatter when needed, as FP8 (the same
    bytes) or dequantized (the values :func:`~linghe.fp8.dequantize_1x128_rows` gives
    for them) without reading the FP8 rows."""

    __slots__ = ("data", "scale", "layout")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, layout: ExpertLayout):
        self.data, self.scale, self.layout = data, scale, layout

    @property
    def shape(self) -> tuple[int, int]:
        return (self.layout.num_rows, self.data.shape[1])

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [num_rows, H] e4m3, scale [num_rows, G])``."""
        q, s, _, _ = scatter_rows(self.data, self.layout, x_scale=self.scale)
        return q, s

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows dequantized to ``dtype`` ``[num_rows, H]`` (padding and tail 0)."""
        return _scatter(self.data, self.layout, self.scale, None, None, dtype, None,
                        dequant=True)[0]


# ------------------------------------------------------------------------------ gather
@triton.jit
def _gather_acc(rows_ptr, r2, w2, jj, j, cols, cmask, H, acc, HAS_W: tl.constexpr):
    r = tl.sum(tl.where(jj[None, :] == j, r2, 0), axis=1)
    ok = r >= 0
    v = tl.load(rows_ptr + r[:, None] * H + cols[None, :], mask=ok[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.sum(tl.where(jj[None, :] == j, w2, 0.0), axis=1)
        v = v * w[:, None]
    return acc + v


@triton.jit
def _gather_kernel(rows_ptr, row_index_ptr, w_ptr, out_ptr, prg_ptr, dp_ptr, add_ptr, T, H,
                   stride_out, stride_add, K_TOP: tl.constexpr, BT: tl.constexpr,
                   BH: tl.constexpr, BK: tl.constexpr, HAS_W: tl.constexpr,
                   PGRAD: tl.constexpr, UNROLL: tl.constexpr, HAS_ADD: tl.constexpr = False):
    # HAS_ADD: add[t] joins the fp32 sum last, so out = sum + add is rounded once
    pid = tl.program_id(0)
    toks = pid.to(tl.int64) * BT + tl.arange(0, BT)
    tmask = toks < T
    jj = tl.arange(0, BK)
    m2 = tmask[:, None] & (jj < K_TOP)[None, :]
    r2 = tl.load(row_index_ptr + toks[:, None] * K_TOP + jj[None, :], mask=m2,
                 other=-1).to(tl.int64)
    if HAS_W:
        w2 = tl.load(w_ptr + toks[:, None] * K_TOP + jj[None, :], mask=m2 & (r2 >= 0), other=0.0)
    else:
        w2 = tl.zeros([BT, BK], dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        cmask = cols < H
        acc = tl.zeros([BT, BH], dtype=tl.float32)
        if UNROLL:
            # the k row loads are independent: unrolled, they are all in flight at once
            for j in tl.static_range(K_TOP):
                acc = _gather_acc(rows_ptr, r2, w2, jj, j, cols, cmask, H, acc, HAS_W)
        else:
            for j in range(K_TOP):
                acc = _gather_acc(rows_ptr, r2, w2, jj, j, cols, cmask, H, acc, HAS_W)
        if HAS_ADD:  # (after the row loads: those are the long ones)
            acc += tl.load(add_ptr + toks[:, None] * stride_add + cols[None, :],
                           mask=tmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + toks[:, None] * stride_out + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
    if PGRAD:
        g = tl.load(prg_ptr + r2, mask=m2 & (r2 >= 0), other=0.0)
        tl.store(dp_ptr + toks[:, None] * K_TOP + jj[None, :], g, mask=m2)


def gather_rows(rows: torch.Tensor, layout: ExpertLayout, *, weights: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, probs_rows_grad: torch.Tensor | None = None,
                add: torch.Tensor | None = None):
    """``out[t] = sum_j w[t, j] * rows[row_index[t, j]]`` (fp32 sum; dropped copies skip).

    ``rows [num_rows, H]`` contiguous; ``weights [T, k]`` fp32 or ``None`` (= 1). With
    ``probs_rows_grad [num_rows]`` also returns ``dp[t, j] = probs_rows_grad[row]``. With
    ``add [T, H]`` (last dim contiguous) ``add[t]`` joins the fp32 sum last: ``out = sum +
    add``, rounded once. Returns ``(out [T, H], dp [T, k] | None)``.
    """
    T, k = layout.row_index.shape
    H = rows.shape[1]
    dev = rows.device
    out = empty(T, H, dtype=out_dtype or rows.dtype, device=dev)
    dp = empty(T, k, dtype=torch.float32, device=dev) if probs_rows_grad is not None else None
    if T == 0:
        return out, dp
    BT, BH = _token_tiles(H, rows.element_size())
    dummy = out
    with device_guard(rows):
        launch(_gather_kernel, (cdiv(T, BT),),
            rows, layout.row_index, weights if weights is not None else dummy, out,
            probs_rows_grad if probs_rows_grad is not None else dummy,
            dp if dp is not None else dummy, add if add is not None else dummy, T, H, H,
            add.stride(0) if add is not None else H,
            K_TOP=k, BT=BT, BH=BH, BK=next_power_of_2(max(k, 1)), HAS_W=weights is not None,
            PGRAD=probs_rows_grad is not None, UNROLL=k <= 16, HAS_ADD=add is not None,
            num_warps=4 if BH * BT <= 4096 else 8)
    return out, dp
