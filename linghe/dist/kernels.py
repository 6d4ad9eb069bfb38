"""Triton kernels of the expert-parallel exchange (:mod:`linghe.dist.dispatcher`).

Records. What one ``all_to_all_single`` moves per routed copy is one fixed-size record:
the row's payload (``H`` elements of the token dtype, or ``H`` e4m3 bytes), then a
trailer of 4-byte words -- the routing weight (fp32), the local expert id (as an fp32
number, ``-1`` for an empty capacity slot) and, for an FP8 payload, the ``ceil(H/128)``
fp32 1x128 scales -- padded to a multiple of 16 bytes. A record buffer is a float32
tensor ``[N, words]`` used as a byte container (the payload is read through a view of
it in the payload dtype). So rows, weights and scales travel in one exchange, and the
receiver learns each row's expert from the row itself. Gradient records (backward of
the dispatch) carry ``dx``'s row and one trailer word, ``dprob``. The combine moves plain
rows (no trailer): a ``[N, H]`` tensor of the expert output's dtype.

Two-part buffers. Rows a rank sends to itself never enter the collective: the kernel
that fills the send buffer writes them straight into the tail of the receive buffer.
Every kernel therefore addresses a *virtual* record index ``v``: records ``v < n_split``
live in buffer ``P`` at ``v``, the others in buffer ``Q`` at ``q_base + v - n_split``
(``P`` and ``Q`` may be one tensor). Each access is two masked loads or stores, of which
at most one touches memory.

Kernels (each serves a forward and, mirrored, a backward):

- ``scatter_tokens``: token rows -> their ``k`` records (source side; dispatch forward
  with the per-copy slot computed from the routing, FP8 quantization fused; combine
  backward from known slots, with the probs gradient as a dot product);
- ``unpack_rows``: records -> rows grouped by local expert, padded by index, FP8
  dequantized (receiver side; dispatch forward, combine backward);
- ``pack_rows``: rows grouped by local expert -> records in arrival order (receiver side;
  combine forward, dispatch backward);
- ``gather_tokens``: records -> ``out[t] = sum_j w[t, j] * record(slot[t, j])`` in fp32
  (source side; combine forward, dispatch backward with the probs gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..fp8.quantize import FP8_DTYPE, quant_rows
from ..fwd.permute import _zero_range
from ..utils import INTERPRET, cdiv, device_guard, empty, launch, next_power_of_2, num_sms

#: Trailer words of a forward record before the scales: routing weight, local expert id.
TRAILER_PROB, TRAILER_ID, TRAILER_SCALES = 0, 1, 2


@dataclass(frozen=True)
class RecordSpec:
    """Byte layout of one record: ``hidden`` payload elements of ``dtype`` (e4m3 for an
    FP8 payload), then ``trailer`` fp32 words at word ``trailer_offset``, padded to 16
    bytes (``words`` fp32 words per record). ``trailer == 0``: plain rows (no container)."""

    hidden: int
    dtype: torch.dtype
    trailer: int

    @property
    def trailer_offset(self) -> int:
        return cdiv(self.hidden * _itemsize(self.dtype), 4)

    @property
    def words(self) -> int:
        return cdiv(self.trailer_offset + self.trailer, 4) * 4

    @property
    def nbytes(self) -> int:
        """Bytes per record (what the exchange moves per row)."""
        if self.trailer == 0:
            return self.hidden * _itemsize(self.dtype)
        return 4 * self.words

    def empty(self, n: int, device) -> torch.Tensor:
        """A buffer of ``n`` records: float32 ``[n, words]``, or ``[n, H]`` plain rows."""
        if self.trailer == 0:
            return empty(n, self.hidden, dtype=self.dtype, device=device)
        return empty(n, self.words, dtype=torch.float32, device=device)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def fwd_spec(hidden: int, dtype: torch.dtype, fp8: bool) -> RecordSpec:
    """Dispatch-forward records: payload, routing weight, local id (and 1x128 scales)."""
    if fp8:
        return RecordSpec(hidden, FP8_DTYPE, TRAILER_SCALES + cdiv(hidden, 128))
    return RecordSpec(hidden, dtype, TRAILER_SCALES)


class VBuf:
    """A virtual record buffer over ``P`` (records ``v < n_split``) and ``Q`` (records
    ``v >= n_split`` at ``q_base + v - n_split``): the kernel arguments for it."""

    __slots__ = ("spec", "P", "Q", "n_split", "q_base")

    def __init__(self, spec: RecordSpec, P: torch.Tensor, Q: torch.Tensor | None = None,
                 n_split: int | None = None, q_base: int = 0):
        self.spec, self.P = spec, P
        self.Q = P if Q is None else Q
        self.n_split = P.shape[0] if n_split is None else n_split
        self.q_base = q_base

    def args(self):
        s = self.spec
        if s.trailer == 0:
            return (self.P, self.P, self.Q, self.Q, self.n_split, self.q_base, s.hidden, 0, 0)
        return (self.P.view(s.dtype), self.P, self.Q.view(s.dtype), self.Q, self.n_split,
                self.q_base, s.words * 4 // _itemsize(s.dtype), s.words, s.trailer_offset)


# ------------------------------------------------------------------------ scatter_tokens
# Addressing (all kernels, written out inline: on the interpreter every call of a nested
# @triton.jit helper re-patches triton.language, about 3 ms): for virtual records ``v``,
# ``inp = v < n_split``; data of ``v`` at ``Pd + v*stride`` (when ``inp``) or at
# ``Qd + (q_base + v - n_split)*stride``, trailer word ``w`` at ``Pw + v*wstride + TW + w``
# (or the same in ``Qw``). Copies are a [tokens, k] tile and rows a [tokens, k, columns]
# tile, so the k copies of a token move in one store (or load) each, all in flight.
@triton.jit
def _scatter_tokens_kernel(
        x_ptr, p_ptr, w_ptr, ids_ptr, row_ptr, offs_ptr, slot_ptr, dot_ptr, dp_ptr,
        Pd, Pw, Qd, Qw, n_split, q_base, stride, wstride, TW,
        T, H, G, stride_x, El, rank, C, n_tok_progs,
        K_TOP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
        BR: tl.constexpr, SLOTS: tl.constexpr, CAP: tl.constexpr, HAS_P: tl.constexpr,
        HAS_W: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_tok_progs:
        toks = pid.to(tl.int64) * BT + tl.arange(0, BT)
        tmask = toks < T
        jj = tl.arange(0, BK)
        m2 = tmask[:, None] & (jj < K_TOP)[None, :]
        flat = toks[:, None] * K_TOP + jj[None, :]
        if SLOTS:
            # Slot of each routed copy in the virtual send buffer: destination blocks in
            # rank order with this rank's own block moved to the end (it is written into
            # the receive buffer's tail, never exchanged). `row` is the copy's position
            # in global expert order (build_index with align 1, so destination-major).
            e = tl.load(ids_ptr + flat, mask=m2, other=-1).to(tl.int32)
            row = tl.load(row_ptr + flat, mask=m2, other=-1)
            ok = row >= 0
            e = tl.where(ok, e, 0)
            r = e // El
            p = row - tl.load(offs_ptr + r * El, mask=m2 & ok, other=0)
            s_start = tl.load(offs_ptr + rank * El)
            s_cnt = tl.load(offs_ptr + (rank + 1) * El) - s_start
            mine = r == rank
            if CAP:
                ok = ok & (p < C)
                slot = tl.where(mine, n_split + p, (r - (r > rank).to(tl.int32)) * C + p)
            else:
                slot = tl.where(mine, n_split + p, row - tl.where(r > rank, s_cnt, 0))
            slot = tl.where(ok, slot, -1)
            tl.store(slot_ptr + flat, slot, mask=m2)
        else:
            slot = tl.load(slot_ptr + flat, mask=m2, other=-1)
        slot = slot.to(tl.int64)
        ok = slot >= 0
        inp = ok & (slot < n_split)
        inq = ok & (slot >= n_split)
        vq = q_base + slot - n_split
        pd = Pd + slot * stride
        qd = Qd + vq * stride
        if QUANT:
            # 1x128 groups: quantize each token's group once, store it to its k records.
            cq = tl.arange(0, 128)
            for g in range(G):
                cols = g * 128 + cq
                cm = cols < H
                xt = tl.load(x_ptr + toks[:, None] * stride_x + cols[None, :],
                             mask=tmask[:, None] & cm[None, :], other=0.0).to(tl.float32)
                q, sc = quant_rows(xt, POW2)
                val = tl.broadcast_to(q[:, None, :], (BT, BK, 128))
                c3 = cols[None, None, :]
                tl.store(pd[:, :, None] + c3, val, mask=inp[:, :, None] & cm[None, None, :])
                tl.store(qd[:, :, None] + c3, val, mask=inq[:, :, None] & cm[None, None, :])
                s2 = tl.broadcast_to(sc[:, None], (BT, BK))
                tl.store(Pw + slot * wstride + TW + 2 + g, s2, mask=inp)
                tl.store(Qw + vq * wstride + TW + 2 + g, s2, mask=inq)
        else:
            if HAS_W:
                w2 = tl.load(w_ptr + flat, mask=ok, other=0.0)
            dacc = tl.zeros([BT, BK], dtype=tl.float32)
            for h0 in range(0, H, BH):
                cols = h0 + tl.arange(0, BH)
                cm = cols < H
                xt = tl.load(x_ptr + toks[:, None] * stride_x + cols[None, :],
                             mask=tmask[:, None] & cm[None, :], other=0.0).to(tl.float32)
                val = tl.broadcast_to(xt[:, None, :], (BT, BK, BH))
                if HAS_W:
                    val = val * w2[:, :, None]
                c3 = cols[None, None, :]
                tl.store(pd[:, :, None] + c3, val.to(Pd.dtype.element_ty),
                         mask=inp[:, :, None] & cm[None, None, :])
                tl.store(qd[:, :, None] + c3, val.to(Qd.dtype.element_ty),
                         mask=inq[:, :, None] & cm[None, None, :])
                if DOT:
                    # combine backward: dprobs[t, j] = <dout[t], returned row of (t, j)>
                    rv = tl.load(dot_ptr + (slot * H)[:, :, None] + c3,
                                 mask=ok[:, :, None] & cm[None, None, :], other=0.0)
                    dacc += tl.sum(rv.to(tl.float32) * xt[:, None, :], axis=2)
            if DOT:
                tl.store(dp_ptr + flat, dacc, mask=m2)
        if HAS_P:
            pr = tl.load(p_ptr + flat, mask=ok, other=0.0)
            tl.store(Pw + slot * wstride + TW, pr, mask=inp)
            tl.store(Qw + vq * wstride + TW, pr, mask=inq)
            if SLOTS:
                lid = (e - r * El).to(tl.float32)
                tl.store(Pw + slot * wstride + TW + 1, lid, mask=inp)
                tl.store(Qw + vq * wstride + TW + 1, lid, mask=inq)
    else:
        # Capacity mode: destination r's slots past its copies are marked empty (id -1),
        # so the receiver skips them. (Only SLOTS + CAP launches these programs.)
        # (names differ from the other branch's: Triton needs one type per name)
        dst = pid - n_tok_progs
        cnt = tl.load(offs_ptr + (dst + 1) * El) - tl.load(offs_ptr + dst * El)
        filled = tl.minimum(cnt, C)
        base = tl.where(dst == rank, n_split,
                        (dst - (dst > rank).to(tl.int32)) * C).to(tl.int64)
        neg = tl.full([BR], -1.0, tl.float32)
        for s0 in range(filled, C, BR):
            v = base + s0 + tl.arange(0, BR)
            m = v < base + C
            tl.store(Pw + v * wstride + TW + 1, neg, mask=m & (v < n_split))
            tl.store(Qw + (q_base + v - n_split) * wstride + TW + 1, neg,
                     mask=m & (v >= n_split))


def _row_tiles(H: int, elem: int) -> tuple[int, int]:
    """(records, columns) of a 2-D tile: about 8 KB of rows per step on the GPU; few, big
    programs on the interpreter (every program, and every op in it, costs there)."""
    BH = max(16, min(next_power_of_2(max(H, 1)), (4096 // elem) if not INTERPRET else 256))
    BT = max(1, min(16 if not INTERPRET else 32, (8192 if not INTERPRET else 4096) // BH))
    return BT, BH


def _token_tiles(H: int, k: int, quant: bool = False) -> tuple[int, int, int]:
    """(tokens, k block, columns) of a 3-D ``[tokens, k, columns]`` tile: at most 8192
    elements on the GPU (registers: the k copies of each row are in flight together);
    FP8 quantization works on 128-column groups."""
    BK = next_power_of_2(max(k, 1))
    budget = 8192 if not INTERPRET else 16384
    BH = 128 if quant else max(16, min(next_power_of_2(max(H, 1)), max(budget // BK, 16),
                                       1024 if not INTERPRET else 256))
    BT = max(1, min(16 if not INTERPRET else 32, budget // (BK * BH)))
    return BT, BK, BH


def scatter_tokens(x: torch.Tensor, out: VBuf, *, slot: torch.Tensor, routing=None,
                   probs: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                   quant: bool = False, pow2_scale: bool = False,
                   dot_rows: torch.Tensor | None = None,
                   capacity: int = 0) -> torch.Tensor | None:
    """Write token ``t``'s ``k`` records ``out[slot[t, j]]``.

    ``routing=(expert_ids [T, k], row [T, k], offsets [E + 1], num_local_experts, rank)``
    makes the kernel compute ``slot`` (written into ``slot [T, k]`` int32; ``-1`` =
    dropped) from the routing: destination-major order, this rank's block last, and in
    capacity mode (``capacity = C > 0``) at most ``C`` slots per destination (empty ones
    marked in the trailer). Without it ``slot`` is read. ``probs [T, k]`` go to the
    trailer (with the local id when routing); ``weights [T, k]`` scale the payload;
    ``quant`` quantizes the payload to 1x128 e4m3 (scales to the trailer; rounded up to
    powers of two with ``pow2_scale``). With
    ``dot_rows [N, H]`` returns ``d[t, j] = <x[t], dot_rows[slot[t, j]]>`` fp32.
    """
    T, H = x.shape
    k = slot.shape[1]
    dev = x.device
    d = empty(T, k, dtype=torch.float32, device=dev) if dot_rows is not None else None
    W = 0
    if routing is not None:
        ids, row, offs, El, rank = routing
        W = (offs.shape[0] - 1) // El if capacity else 0
    else:
        ids = row = offs = slot
        El, rank = 1, 0
    BT, BK, BH = _token_tiles(H, k, quant)
    if dot_rows is not None:
        BT = max(1, BT // 2)
    n_tok = cdiv(T, BT)
    grid = n_tok + W
    if grid == 0:
        return d
    dummy = slot
    with device_guard(x):
        launch(_scatter_tokens_kernel, (grid,),
               x, probs if probs is not None else dummy, weights if weights is not None
               else dummy, ids, row, offs, slot, dot_rows if dot_rows is not None else x,
               d if d is not None else dummy, *out.args(), T, H, cdiv(H, 128),
               x.stride(0) if T else H, El, rank, capacity, n_tok,
               K_TOP=k, BT=BT, BH=BH, BK=BK, BR=64,
               SLOTS=routing is not None, CAP=capacity > 0, HAS_P=probs is not None,
               HAS_W=weights is not None, QUANT=quant, POW2=pow2_scale,
               DOT=dot_rows is not None,
               num_warps=4 if BT * BK * BH <= 4096 else 8)
    return d


# ------------------------------------------------------------------------ unpack_rows
@triton.jit
def _unpack_rows_kernel(
        Pd, Pw, Qd, Qw, n_split, q_base, stride, wstride, TW,
        ridx_ptr, out_ptr, os_ptr, prow_ptr, offs_ptr, tpe_ptr, N, H, G, El, R,
        n_slot_progs, n_tail_progs,
        BT: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, BHZ: tl.constexpr,
        BG: tl.constexpr, HAS_P: tl.constexpr, DEQUANT: tl.constexpr,
        FP8OUT: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_slot_progs:
        v = pid.to(tl.int64) * BT + tl.arange(0, BT)
        row = tl.load(ridx_ptr + v, mask=v < N, other=-1).to(tl.int64)
        ok = row >= 0
        inp = ok & (v < n_split)
        inq = ok & (v >= n_split)
        vq = q_base + v - n_split
        pd = Pd + v * stride
        qd = Qd + vq * stride
        # (the two parts are selected with where, not added: bits are kept, -0.0 too)
        if DEQUANT or FP8OUT:
            cq = tl.arange(0, 128)
            for g in range(G):
                cols = g * 128 + cq
                cm = (cols < H)[None, :]
                a = tl.load(pd[:, None] + cols[None, :], mask=inp[:, None] & cm, other=0.0)
                b = tl.load(qd[:, None] + cols[None, :], mask=inq[:, None] & cm, other=0.0)
                q = tl.where(inp[:, None], a, b)
                sc = tl.where(inp, tl.load(Pw + v * wstride + TW + 2 + g, mask=inp, other=0.0),
                              tl.load(Qw + vq * wstride + TW + 2 + g, mask=inq, other=0.0))
                if FP8OUT:
                    tl.store(out_ptr + (row * H)[:, None] + cols[None, :], q,
                             mask=ok[:, None] & cm)
                    tl.store(os_ptr + row * G + g, sc, mask=ok)
                else:
                    val = q.to(tl.float32) * sc[:, None]
                    tl.store(out_ptr + (row * H)[:, None] + cols[None, :],
                             val.to(out_ptr.dtype.element_ty), mask=ok[:, None] & cm)
        else:
            for h0 in range(0, H, BH):
                cols = h0 + tl.arange(0, BH)
                cm = (cols < H)[None, :]
                a = tl.load(pd[:, None] + cols[None, :], mask=inp[:, None] & cm, other=0.0)
                b = tl.load(qd[:, None] + cols[None, :], mask=inq[:, None] & cm, other=0.0)
                tl.store(out_ptr + (row * H)[:, None] + cols[None, :],
                         tl.where(inp[:, None], a, b).to(out_ptr.dtype.element_ty),
                         mask=ok[:, None] & cm)
        if HAS_P:
            pr = tl.where(inp, tl.load(Pw + v * wstride + TW, mask=inp, other=0.0),
                          tl.load(Qw + vq * wstride + TW, mask=inq, other=0.0))
            tl.store(prow_ptr + row, pr, mask=ok)
    else:
        # Zeros for the padding rows of local expert q (q < El), then for the tail rows
        # offsets[El] .. R spread over the tail programs (the ExpertLayout contract).
        pe = pid - n_slot_progs  # (not `q`: the other branch's name, another type)
        is_pad = pe < El
        qe = tl.minimum(pe, El - 1)
        off_q = tl.load(offs_ptr + qe)
        off_q1 = tl.load(offs_ptr + qe + 1)
        off_e = tl.load(offs_ptr + El)
        start = tl.where(is_pad, off_q + tl.load(tpe_ptr + qe), off_e + (pe - El) * BR)
        end = tl.minimum(tl.where(is_pad, off_q1, R + 0 * off_e), R)
        step = tl.where(is_pad, BR + 0 * off_e, n_tail_progs * BR + 0 * off_e)
        start = tl.minimum(start, end)
        _zero_range(out_ptr, start, end, step, H, BR, BHZ, 0.0)
        if FP8OUT:
            _zero_range(os_ptr, start, end, step, G, BR, BG, 1.0)
        if HAS_P:
            _zero_range(prow_ptr, start, end, step, 1, BR, 16, 0.0)


def unpack_rows(src: VBuf, layout, out_dtype: torch.dtype, *, probs: bool = False,
                dequant: bool = False, fp8_out: bool = False):
    """Rows grouped by local expert from records: ``out[row_index[v]] = record(v)``
    (dequantized when ``dequant``; with ``fp8_out`` the e4m3 rows and their 1x128 scales
    as they arrived), ``probs_rows[row] = record(v).prob`` when ``probs``; padding and
    tail rows of ``layout`` (``row_index [N, 1]``) are zeros (scales 1). Returns
    ``(rows [R, H], scales [R, ceil(H/128)] | None, probs_rows [R] fp32 | None)``."""
    H, R = src.spec.hidden, layout.num_rows
    N, El = layout.row_index.shape[0], layout.num_experts
    G = cdiv(H, 128)
    dev = layout.offsets.device
    out = empty(R, H, dtype=FP8_DTYPE if fp8_out else out_dtype, device=dev)
    osc = empty(R, G, dtype=torch.float32, device=dev) if fp8_out else None
    prow = empty(R, dtype=torch.float32, device=dev) if probs else None
    BT, BH = _row_tiles(H, out.element_size())
    warps = 4 if BH * BT <= 4096 else 8
    if dequant or fp8_out:
        # 128-column groups: 32 rows a step, so each thread moves 16-byte vectors
        BT, warps = 32, 4
    BR = 16
    n_slot = cdiv(N, BT)
    n_tail = max(1, min(cdiv(R, BR), 2 * num_sms(dev)))
    with device_guard(out):
        launch(_unpack_rows_kernel, (n_slot + El + n_tail,),
               *src.args(), layout.row_index, out, osc if osc is not None else out,
               prow if prow is not None else out, layout.offsets, layout.tokens_per_expert,
               N, H, G, El, R, n_slot, n_tail, BT=BT, BH=BH, BR=BR,
               BHZ=min(max(next_power_of_2(max(H, 1)), 16), 256 if INTERPRET else 1024),
               BG=max(16, next_power_of_2(G)), HAS_P=probs, DEQUANT=dequant,
               FP8OUT=fp8_out, num_warps=warps)
    return out, osc, prow


# ------------------------------------------------------------------------ pack_rows
@triton.jit
def _pack_rows_kernel(src_ptr, sprow_ptr, ridx_ptr, Pd, Pw, Qd, Qw, n_split, q_base, stride,
                      wstride, TW, N, H, BT: tl.constexpr, BH: tl.constexpr,
                      HAS_P: tl.constexpr):
    v = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    row = tl.load(ridx_ptr + v, mask=v < N, other=-1).to(tl.int64)
    ok = row >= 0
    inp = ok & (v < n_split)
    inq = ok & (v >= n_split)
    vq = q_base + v - n_split
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        cm = (cols < H)[None, :]
        val = tl.load(src_ptr + (row * H)[:, None] + cols[None, :], mask=ok[:, None] & cm,
                      other=0.0)
        tl.store(Pd + (v * stride)[:, None] + cols[None, :], val.to(Pd.dtype.element_ty),
                 mask=inp[:, None] & cm)
        tl.store(Qd + (vq * stride)[:, None] + cols[None, :], val.to(Qd.dtype.element_ty),
                 mask=inq[:, None] & cm)
    if HAS_P:
        pr = tl.load(sprow_ptr + row, mask=ok, other=0.0)
        tl.store(Pw + v * wstride + TW, pr, mask=inp)
        tl.store(Qw + vq * wstride + TW, pr, mask=inq)


def pack_rows(rows: torch.Tensor, layout, out: VBuf,
              probs_rows: torch.Tensor | None = None) -> None:
    """Records in arrival order from rows grouped by local expert: ``record(v) =
    rows[row_index[v]]`` (and ``.prob = probs_rows[row]``); empty slots are not written."""
    N, H = layout.row_index.shape[0], rows.shape[1]
    if N == 0:
        return
    BT, BH = _row_tiles(H, rows.element_size())
    with device_guard(rows):
        launch(_pack_rows_kernel, (cdiv(N, BT),),
               rows, probs_rows if probs_rows is not None else rows, layout.row_index,
               *out.args(), N, H, BT=BT, BH=BH, HAS_P=probs_rows is not None,
               num_warps=4 if BH * BT <= 4096 else 8)


# ------------------------------------------------------------------------ gather_tokens
@triton.jit
def _gather_tokens_kernel(Pd, Pw, Qd, Qw, n_split, q_base, stride, wstride, TW,
                          slot_ptr, w_ptr, out_ptr, dp_ptr, T, H,
                          K_TOP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                          BK: tl.constexpr, HAS_W: tl.constexpr, PGRAD: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    tmask = toks < T
    jj = tl.arange(0, BK)
    m2 = tmask[:, None] & (jj < K_TOP)[None, :]
    flat = toks[:, None] * K_TOP + jj[None, :]
    slot = tl.load(slot_ptr + flat, mask=m2, other=-1).to(tl.int64)
    ok = slot >= 0
    inp = ok & (slot < n_split)
    inq = ok & (slot >= n_split)
    vq = q_base + slot - n_split
    pd = Pd + slot * stride
    qd = Qd + vq * stride
    if HAS_W:
        w2 = tl.load(w_ptr + flat, mask=ok, other=0.0)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        cm = cols < H
        c3 = cols[None, None, :]
        a = tl.load(pd[:, :, None] + c3, mask=inp[:, :, None] & cm[None, None, :], other=0.0)
        b = tl.load(qd[:, :, None] + c3, mask=inq[:, :, None] & cm[None, None, :], other=0.0)
        v = tl.where(inp[:, :, None], a, b).to(tl.float32)
        if HAS_W:
            v = v * w2[:, :, None]
        tl.store(out_ptr + toks[:, None] * H + cols[None, :],
                 tl.sum(v, axis=1).to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cm[None, :])
    if PGRAD:
        g = tl.where(inp, tl.load(Pw + slot * wstride + TW, mask=inp, other=0.0),
                     tl.load(Qw + vq * wstride + TW, mask=inq, other=0.0))
        tl.store(dp_ptr + flat, g, mask=m2)


def gather_tokens(src: VBuf, slot: torch.Tensor, out_dtype: torch.dtype, *,
                  weights: torch.Tensor | None = None, probs_grad: bool = False):
    """``out[t] = sum_j weights[t, j] * record(slot[t, j])`` (fp32 sum, ``-1`` skipped);
    with ``probs_grad`` also ``dp[t, j] = record(slot[t, j]).prob`` (0 when dropped).
    Returns ``(out [T, H], dp [T, k] | None)``."""
    T, k = slot.shape
    H = src.spec.hidden
    dev = slot.device
    out = empty(T, H, dtype=out_dtype, device=dev)
    dp = empty(T, k, dtype=torch.float32, device=dev) if probs_grad else None
    if T == 0:
        return out, dp
    BT, BK, BH = _token_tiles(H, k)
    with device_guard(out):
        launch(_gather_tokens_kernel, (cdiv(T, BT),),
               *src.args(), slot, weights if weights is not None else out, out,
               dp if dp is not None else out, T, H, K_TOP=k, BT=BT, BH=BH, BK=BK,
               HAS_W=weights is not None, PGRAD=probs_grad,
               num_warps=4)  # (8 warps split the [tokens, H] sum's stores into 8 bytes)
    return out, dp
