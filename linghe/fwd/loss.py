"""Cross-entropy forward kernels (online softmax over vocabulary blocks) and launchers.

A program streams (a range of columns of) one row of logits once in blocks of ``BLOCK_V``
columns, keeping a running max and sum of exponentials (fp32, base-2 exponentials), the
target logit (one masked scalar load) and, with label smoothing, the row sum. From these
it writes the per-row loss and ``lse = logsumexp(row)`` (saved for backward).

Modes (constexpr):

- default (one program per row): per-row ``loss`` and ``lse``;
- ``SPLIT``: partials ``(max, sum-exp relative to max, target logit, row sum)`` of a
  column range: long rows are split over several programs (:func:`split_v`) and a small
  kernel (``_ce_combine_kernel``) combines them per row; the vocab-parallel path uses
  the partials of its whole slice and combines them across ranks;
- ``FUSE_BWD``: after the statistics, a second sweep over the row writes the gradient
  ``w * d loss_i / d logits_i`` over the logits in place, ``w`` the reduction's row weight
  read from the device (``1 / n_valid`` for "mean": :func:`ce_row_weight`); the fused
  linear cross entropy uses this, so its gradients need no rescaling pass afterwards.

:func:`ce_grad_fp8` (``_ce_grad_fp8_kernel``) is the FP8 LM head's gradient pass: from
the logits and the saved ``lse`` it writes the gradient only as FP8, both 1x128 copies
from ``[128, 128]`` tiles (the rowwise one for the hidden gradient, the columnwise one,
grouped along the tokens, for the weight gradient), never the 16-bit gradient.

Labels outside ``[0, V_total)`` and equal to ``ignore_index`` mark the row ignored: loss 0,
gradient 0 (written without reading the row), and the target load is masked (never an
out-of-bounds read). An ignored row's saved ``lse`` is 0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..fp8.quantize import (
    _tile_coords,
    packed_row_order,
    quant_cols,
    quant_rows,
    store_cols_cvt4,
)
from ..utils import INTERPRET, cdiv, device_guard, empty, launch, next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def _knob(name: str):
    v = os.environ.get(name, "")
    if not v:
        return None
    b, w = (int(t) for t in v.split(","))
    return b, w


#: Tuning knobs for the GPU (read at import): "BLOCK_V,NUM_WARPS" of the forward and
#: backward kernels for large rows, e.g. LINGHE_CE_FWD=4096,4 LINGHE_CE_BWD=4096,8.
_FWD_KNOB = _knob("LINGHE_CE_FWD")
#: Software prefetch of the next block in the streaming loops (LINGHE_CE_PREFETCH=0: off).
PREFETCH_DEFAULT = os.environ.get("LINGHE_CE_PREFETCH", "1") != "0"
_BWD_KNOB = _knob("LINGHE_CE_BWD")


def block_v(V: int, kind: str = "fwd", big: tuple[int, int] | None = None) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a row of ``V`` columns.

    On the GPU, large rows use 4096-column blocks: forward 4 warps (32 fp32 per thread, four
    16-byte bf16 loads; reductions over 4 warps are cheap), backward 8 warps (16 per
    thread). Many small programs per SM hide the memory latency. Override with the
    ``LINGHE_CE_FWD`` / ``LINGHE_CE_BWD`` environment variables (``"BLOCK_V,WARPS"``) or
    ``big`` (the pair for large rows). On the interpreter the cap is 256 so small test
    vocabularies still exercise the multi-block online softmax.
    """
    if INTERPRET:
        return min(next_power_of_2(max(V, 1)), 256), 2
    knob = _FWD_KNOB if kind == "fwd" else _BWD_KNOB
    # round 1 (H200): bwd (4096, 8) -> 1333 µs at 91% of copy BW; kept as the default
    big = big or knob or ((4096, 4) if kind == "fwd" else (4096, 8))
    b = min(next_power_of_2(max(V, 1)), big[0])
    if b == big[0]:
        return big
    return b, max(1, min(big[1], b // 256))


@triton.jit
def _row_label(lab_ptr, row, vocab_start, V, V_total, ignore_index):
    label = tl.load(lab_ptr + row).to(tl.int64)
    valid = (label != ignore_index) & (label >= 0) & (label < V_total)
    local = label - vocab_start
    in_slice = valid & (local >= 0) & (local < V)
    local = tl.where(in_slice, local, -1)
    return valid, local, in_slice


@triton.jit
def _ce_fwd_kernel(x_ptr, stride_x, lab_ptr, loss_ptr, lse_ptr, part_ptr, w_ptr, N, V,
                   vocab_start, V_total, ignore_index, eps, z_loss,
                   CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, SMOOTH: tl.constexpr,
                   SPLIT: tl.constexpr, FUSE_BWD: tl.constexpr,
                   PREFETCH: tl.constexpr = PREFETCH_DEFAULT,
                   q_ptr=None, qs_ptr=None, stride_q=0, stride_qs_m=0, stride_qs_g=0,
                   QUANT: tl.constexpr = False, POW2: tl.constexpr = True):
    """``QUANT`` (with ``FUSE_BWD``): also write the gradient's FP8 copy in 1x128 groups
    (``q [N, V]`` e4m3, scales ``qs [N, ceil(V/128)]`` at the given strides), quantized
    from the stored (rounded) gradient, as ``quantize_1x128`` of it would be."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    valid, local, in_slice = _row_label(lab_ptr, row, vocab_start, V, V_total, ignore_index)
    if SPLIT:
        # program (row, k) covers columns [k * CHUNK, min((k + 1) * CHUNK, V))
        lo = tl.program_id(1) * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
    else:
        lo = 0
        hi = V
    mine = in_slice & (local >= lo) & (local < hi)
    x_t = tl.load(base + tl.where(mine, local, 0), mask=mine, other=0.0).to(tl.float32)
    x_t = tl.where(mine, x_t, 0.0)

    cols = tl.arange(0, BLOCK_V)
    m2 = -float("inf")  # running max, in log2 units (x * log2 e)
    s = 0.0  # sum of exp2(x * log2 e - m2)
    sx = 0.0  # row sum (label smoothing)
    n_cols = tl.where(valid, hi, lo)  # an ignored row is not read
    # PREFETCH: the next block's load is issued before this block's math
    c = lo + cols
    if PREFETCH:
        # (the first block's load does not wait for the label)
        x_nxt = tl.load(base + c, mask=c < hi, other=-float("inf"))
    else:
        x_nxt = tl.zeros([BLOCK_V], dtype=x_ptr.dtype.element_ty)
    for off in range(lo, n_cols, BLOCK_V):
        c = off + cols
        mask = c < hi
        if PREFETCH:
            x = x_nxt.to(tl.float32)
            cn = c + BLOCK_V
            x_nxt = tl.load(base + cn, mask=cn < n_cols, other=-float("inf"))
        else:
            x = tl.load(base + c, mask=mask, other=-float("inf")).to(tl.float32)
        t = x * LOG2E
        new_m = tl.maximum(m2, tl.max(t, axis=0))
        safe_m = tl.where(new_m == -float("inf"), 0.0, new_m)
        s = s * tl.exp2(m2 - safe_m) + tl.sum(tl.exp2(t - safe_m), axis=0)
        m2 = new_m
        if SMOOTH:
            sx += tl.sum(tl.where(mask, x, 0.0), axis=0)

    if SPLIT:
        # partials of this column range, part[k, 4, N]: max, sum-exp (relative to that
        # max), target logit (0 if the label is elsewhere), row sum
        p = part_ptr + tl.program_id(1).to(tl.int64) * 4 * N + row
        tl.store(p, m2 * LN2)
        tl.store(p + N, s)
        tl.store(p + 2 * N, x_t)
        tl.store(p + 3 * N, sx)
    else:
        lse = (m2 + tl.log2(s)) * LN2
        loss = lse - (1.0 - eps) * x_t + z_loss * lse * lse
        if SMOOTH:
            loss -= eps / V_total * sx
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
        if FUSE_BWD:
            # gradient of this row's loss times the reduction's row weight
            g = tl.where(valid, tl.load(w_ptr), 0.0)
            coef = g * (1.0 + 2.0 * z_loss * lse)
            smooth = g * eps / V_total
            hit = g * (1.0 - eps)
            lse2 = lse * LOG2E
            local32 = local.to(tl.int32)  # int32 compares in the loop (-1: not in slice)
            for off in range(0, V, BLOCK_V):
                c = off + cols
                mask = c < V
                x = tl.load(base + c, mask=c < n_cols, other=0.0).to(tl.float32)
                p = tl.exp2(x * LOG2E - lse2)
                d = coef * p - smooth - tl.where(cols == local32 - off, hit, 0.0)
                d = tl.where(valid, d, 0.0)
                d = d.to(x_ptr.dtype.element_ty)
                tl.store(base + c, d, mask=mask)
                if QUANT:
                    G: tl.constexpr = 128 if BLOCK_V >= 128 else BLOCK_V
                    dg = tl.reshape(tl.where(mask, d.to(tl.float32), 0.0),
                                    (BLOCK_V // G, G))
                    q, sc = quant_rows(dg, POW2)
                    tl.store(q_ptr + row * stride_q + c, tl.reshape(q, (BLOCK_V,)), mask=mask)
                    grp = off // 128 + tl.arange(0, BLOCK_V // G)
                    tl.store(qs_ptr + row * stride_qs_m + grp * stride_qs_g, sc,
                             mask=grp * 128 < V)


@triton.jit
def _ce_grad_fp8_kernel(x_ptr, stride_x, lab_ptr, lse_ptr, w_ptr, w_stride, N, V, V_total,
                        ignore_index, eps, z_loss, q_ptr, s_ptr, stride_q, stride_sm,
                        stride_sg, qt_ptr, st_ptr, ldt, t0, stride_stk, stride_stg,
                        ROWWISE: tl.constexpr, COLWISE: tl.constexpr, POW2: tl.constexpr,
                        PACK: tl.constexpr, RPT: tl.constexpr, K_FAST: tl.constexpr = True,
                        REVERSE: tl.constexpr = True, EVEN_V: tl.constexpr = False,
                        ROUND: tl.constexpr = True):
    """One ``[128, 128]`` tile of ``d = w_row * d loss / d logits`` (``w_row`` the row
    weight at ``w_ptr``, per row with ``w_stride`` 1, one for all with 0) from the logits
    ``x [N, V]`` and their ``lse``, rounded to the logits' dtype as the fused kernel stores
    it, then quantized: ``ROWWISE`` into ``q [N, V]`` / ``s`` (1x128 along the vocabulary),
    ``COLWISE`` into ``q_t [V, ldt]`` at token columns ``t0 + row`` and ``s_t`` at group
    ``t0 // 128 + tile row`` (1x128 along the tokens; ``t0`` a multiple of 128; ``PACK``:
    4 tokens a word, ``ldt`` and the chunk's end multiples of 16). ``EVEN_V``: ``V`` a
    multiple of 128 (no column masks). ``ROUND`` (default): quantize the gradient rounded
    to the logits' dtype (the bits ``quantize_1x128`` of the 16-bit gradient gives); off:
    the fp32 gradient itself (a launch variant for the probe). Tile order as
    ``quantize._tile_coords`` (default: a row block's tiles in turn, from the last tile, as
    the statistics pass before it read the chunk's last rows last: some are still in L2)."""
    nm = tl.cdiv(N, 128)
    nk = tl.cdiv(V, 128)
    pid_m, pid_k, rows, cols = _tile_coords(tl.program_id(0), nm * nk, nm, nk, 128, 128,
                                            K_FAST, REVERSE)
    if PACK:
        rows = pid_m.to(tl.int64) * 128 + packed_row_order(RPT)
    rmask = rows < N
    cmask = cols < V
    label = tl.load(lab_ptr + rows, mask=rmask, other=ignore_index).to(tl.int64)
    valid = rmask & (label != ignore_index) & (label >= 0) & (label < V_total)
    local = tl.where(valid, label, -1).to(tl.int32)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    g = tl.where(valid, tl.load(w_ptr + rows * w_stride, mask=rmask, other=0.0).to(tl.float32),
                 0.0)
    coef = g * (1.0 + 2.0 * z_loss * lse)
    smooth = g * eps / V_total
    hit = g * (1.0 - eps)
    if EVEN_V:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    p = tl.exp2(x * LOG2E - (lse * LOG2E)[:, None])
    # (an ignored or absent row has g = 0: coef = smooth = hit = 0, so d = 0 there)
    d = coef[:, None] * p - smooth[:, None] - tl.where(cols[None, :] == local[:, None],
                                                      hit[:, None], 0.0)
    if not EVEN_V:
        d = tl.where(cmask[None, :], d, 0.0)
    if ROUND:
        d = d.to(x_ptr.dtype.element_ty).to(tl.float32)  # as the 16-bit gradient would be
    if ROWWISE:
        q, sc = quant_rows(d, POW2)
        if EVEN_V:
            qmask = rmask[:, None]
        else:
            qmask = rmask[:, None] & cmask[None, :]
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q, mask=qmask)
        tl.store(s_ptr + rows * stride_sm + pid_k * stride_sg, sc, mask=rmask)
    if COLWISE:
        tile_start = t0 + pid_m * 128
        if PACK:
            st = store_cols_cvt4(d, qt_ptr, tile_start, cols, cmask, t0 + N, ldt, RPT, POW2)
        else:
            qt, st = quant_cols(d, POW2)
            if EVEN_V:
                tmask = rmask[:, None]
            else:
                tmask = rmask[:, None] & cmask[None, :]
            tl.store(qt_ptr + cols[None, :].to(tl.int64) * ldt + (t0 + rows)[:, None], qt,
                     mask=tmask)
        tl.store(st_ptr + cols * stride_stk + (t0 // 128 + pid_m) * stride_stg, st,
                 mask=cmask)


@triton.jit
def _ce_combine_kernel(part_ptr, lab_ptr, loss_ptr, lse_ptr, N, S, V_total, ignore_index, eps,
                       z_loss, SMOOTH: tl.constexpr, S_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Combine the ``S`` column-range partials ``part[S, 4, N]`` of ``BLOCK`` rows into their
    loss and lse (one 2-D load per field: all partials in flight at once)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = o < N
    k = tl.arange(0, S_P2)
    km = (k < S)[:, None] & mask[None, :]
    ptr = part_ptr + (k.to(tl.int64) * 4 * N)[:, None] + o[None, :]
    m_k = tl.load(ptr, mask=km, other=-float("inf"))
    s_k = tl.load(ptr + N, mask=km, other=0.0)
    x_t = tl.sum(tl.load(ptr + 2 * N, mask=km, other=0.0), axis=0)
    m = tl.max(m_k, axis=0)
    ms = tl.where(m == -float("inf"), 0.0, m)
    s = tl.sum(s_k * tl.exp(m_k - ms[None, :]), axis=0)
    lab = tl.load(lab_ptr + o, mask=mask, other=ignore_index).to(tl.int64)
    ok = mask & (lab != ignore_index) & (lab >= 0) & (lab < V_total)
    lse = ms + tl.log(s)
    loss = lse - (1.0 - eps) * x_t + z_loss * lse * lse
    if SMOOTH:
        sx = tl.sum(tl.load(ptr + 3 * N, mask=km, other=0.0), axis=0)
        loss -= eps / V_total * sx
    tl.store(loss_ptr + o, tl.where(ok, loss, 0.0), mask=mask)
    tl.store(lse_ptr + o, tl.where(ok, lse, 0.0), mask=mask)


@triton.jit
def _ce_reduce_kernel(loss_ptr, lab_ptr, out_ptr, inv_n_ptr, N, V_total, ignore_index,
                      MEAN: tl.constexpr, BLOCK: tl.constexpr, COUNT_ONLY: tl.constexpr = False):
    """One program: ``out = sum(loss) [/ max(n_valid, 1)]`` (a fixed order: deterministic)
    and ``inv_n = 1/max(n_valid, 1)`` (mean) or 1 (sum), the backward's row weight;
    ``COUNT_ONLY``: ``inv_n`` alone (from the labels)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    cnt = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(0, N, BLOCK):
        o = off + offs
        mask = o < N
        if not COUNT_ONLY:
            acc += tl.load(loss_ptr + o, mask=mask, other=0.0)
        lab = tl.load(lab_ptr + o, mask=mask, other=ignore_index).to(tl.int64)
        ok = mask & (lab != ignore_index) & (lab >= 0) & (lab < V_total)
        cnt += ok.to(tl.int32)
    total = tl.sum(acc, axis=0)
    n = tl.sum(cnt, axis=0)
    if MEAN:
        inv = 1.0 / tl.maximum(n, 1).to(tl.float32)
    else:
        inv = n.to(tl.float32) * 0.0 + 1.0
    if not COUNT_ONLY:
        tl.store(out_ptr, total * inv)
    tl.store(inv_n_ptr, inv)


def split_v(V: int, BV: int, kind: str = "fwd", target: int | None = None) -> tuple[int, int]:
    """``(CHUNK, S)``: columns per program (a multiple of ``BV``) and programs per row.

    Splitting a long row over several programs keeps each program short, so the last wave
    of a launch drains quickly (a whole 157K-column row per program leaves SMs idle at the
    end). About 32K columns per program on the GPU (``LINGHE_CE_CHUNK`` or ``target``
    overrides; 0 = no split), 512 on the interpreter so tests exercise it.
    """
    if INTERPRET:
        target = 512
    elif target is None:
        target = int(os.environ.get("LINGHE_CE_CHUNK", "32768"))
    if target <= 0 or V <= target:
        return max(BV, cdiv(V, BV) * BV), 1
    S = cdiv(V, target)
    chunk = cdiv(cdiv(V, S), BV) * BV
    return chunk, cdiv(V, chunk)


def ce_forward(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
               label_smoothing: float, z_loss: float, reduction: str = "none",
               loss_out: torch.Tensor | None = None, fuse_bwd: bool = False,
               row_weight: torch.Tensor | None = None, grad_fp8=None):
    """Forward over ``logits [N, V]`` (rows with stride(1) == 1).

    Returns ``(loss [N] fp32, lse [N] fp32, out, inv_n)``: per-row losses (0 for ignored
    rows), per-row logsumexp (0 for ignored rows), and for ``reduction`` "mean"/"sum" the
    fp32 scalar loss and the backward's row weight ``inv_n [1]`` (``None, None`` for
    "none"). Long rows are split over several programs (:func:`split_v`) whose partials a
    small kernel combines per row; the reduction is one more single-program kernel. With
    ``fuse_bwd=True`` (one program per row) the logits are overwritten by the gradient
    times ``row_weight`` (a float32 ``[1]`` device tensor, e.g. :func:`ce_row_weight`;
    ``None``: 1) (see the module doc).
    ``loss_out`` (a contiguous fp32 [N] buffer) receives the per-row loss if given.
    ``grad_fp8 = (q, scale, pow2_scale)`` (with ``fuse_bwd``): the kernel also writes the
    gradient's 1x128 FP8 copy, ``q [N, V]`` e4m3 (row-major) and ``scale [N, ceil(V/128)]``
    fp32 (any strides), as :func:`~linghe.fp8.quantize_1x128` of the stored gradient.
    """
    N, V = logits.shape
    dev = logits.device
    loss = loss_out if loss_out is not None else empty(N, dtype=torch.float32, device=dev)
    lse = empty(N, dtype=torch.float32, device=dev)
    reduce = reduction != "none"
    out = inv_n = None
    if N == 0:
        if reduce:
            out, inv_n = ce_reduce(loss, labels, ignore_index=ignore_index, vocab_total=V,
                                   mean=reduction == "mean")
        return loss, lse, out, inv_n
    BV, warps = block_v(V)
    chunk, S = split_v(V, BV)
    if grad_fp8 is not None and not fuse_bwd:
        raise ValueError("grad_fp8 needs fuse_bwd=True")
    if fuse_bwd:
        S = 1
        if row_weight is None:
            row_weight = torch.ones(1, dtype=torch.float32, device=dev)
    smooth = label_smoothing != 0.0
    eps, z = float(label_smoothing), float(z_loss)
    with device_guard(logits):
        if S == 1 and grad_fp8 is not None:
            q, qs, pow2 = grad_fp8
            launch(_ce_fwd_kernel, (N,),
                logits, logits.stride(0), labels, loss, lse, loss, row_weight, N, V, 0, V,
                ignore_index, eps, z, q_ptr=q, qs_ptr=qs, stride_q=q.stride(0),
                stride_qs_m=qs.stride(0), stride_qs_g=qs.stride(1), CHUNK=BV, BLOCK_V=BV,
                SMOOTH=smooth, SPLIT=False, FUSE_BWD=True, QUANT=True, POW2=pow2,
                num_warps=warps)
        elif S == 1:
            launch(_ce_fwd_kernel, (N,),
                logits, logits.stride(0), labels, loss, lse, loss,
                row_weight if fuse_bwd else loss, N, V, 0, V,
                ignore_index, eps, z, CHUNK=BV, BLOCK_V=BV, SMOOTH=smooth, SPLIT=False,
                FUSE_BWD=fuse_bwd, num_warps=warps)
        else:
            part = empty(S, 4, N, dtype=torch.float32, device=dev)
            launch(_ce_fwd_kernel, (N, S),
                logits, logits.stride(0), labels, loss, lse, part, loss, N, V, 0, V,
                ignore_index, eps, z, CHUNK=chunk, BLOCK_V=BV, SMOOTH=smooth, SPLIT=True,
                FUSE_BWD=False, num_warps=warps)
            S_P2 = next_power_of_2(S)
            BR = max(16, min(256, 2048 // S_P2))
            launch(_ce_combine_kernel, (cdiv(N, BR),),
                part, labels, loss, lse, N, S, V, ignore_index, eps, z, SMOOTH=smooth,
                S_P2=S_P2, BLOCK=BR, num_warps=4)
    if reduce:
        out, inv_n = ce_reduce(loss, labels, ignore_index=ignore_index, vocab_total=V,
                               mean=reduction == "mean")
    return loss, lse, out, inv_n


def ce_partials(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
                vocab_start: int, vocab_total: int) -> torch.Tensor:
    """Vocab-parallel partials of this rank's slice ``logits [N, V_local]``: ``[4, N]``
    fp32 = row max, sum-exp relative to it, target logit (0 if the label is on another
    rank or ignored), row sum. One program per row; an ignored row is not read."""
    N, V = logits.shape
    part = empty(1, 4, N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return part[0]
    BV, warps = block_v(V)
    with device_guard(logits):
        launch(_ce_fwd_kernel, (N, 1),
            logits, logits.stride(0), labels, part, part, part, part, N, V, vocab_start,
            vocab_total, ignore_index, 0.0, 0.0, CHUNK=cdiv(V, BV) * BV, BLOCK_V=BV,
            SMOOTH=True, SPLIT=True, FUSE_BWD=False, num_warps=warps)
    return part[0]


def ce_reduce(loss_rows: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
              vocab_total: int, mean: bool):
    """``(loss scalar fp32, inv_n [1] fp32)`` from per-row losses (see the kernel)."""
    N = loss_rows.shape[0]
    out = empty((), dtype=torch.float32, device=loss_rows.device)
    inv_n = empty(1, dtype=torch.float32, device=loss_rows.device)
    with device_guard(loss_rows):
        # one program; N = 8192 rows in one 8192-wide step (loads all in flight at once)
        B = min(max(next_power_of_2(max(N, 1)), 128), 256 if INTERPRET else 8192)
        launch(_ce_reduce_kernel, (1,), loss_rows, labels, out, inv_n, N, vocab_total, ignore_index,
               MEAN=mean, BLOCK=B, num_warps=max(1, min(16, B // 256)))
    return out, inv_n


def ce_row_weight(labels: torch.Tensor, *, ignore_index: int, vocab_total: int,
                  mean: bool) -> torch.Tensor:
    """The reduction's row weight ``[1]`` fp32 from the labels alone (on the device, no
    sync): ``1 / max(n_valid, 1)`` for "mean", 1 for "sum" (what :func:`ce_reduce`
    returns as ``inv_n``), known before any logits are computed."""
    N = labels.shape[0]
    inv_n = empty(1, dtype=torch.float32, device=labels.device)
    with device_guard(labels):
        B = min(max(next_power_of_2(max(N, 1)), 128), 256 if INTERPRET else 8192)
        launch(_ce_reduce_kernel, (1,), inv_n, labels, inv_n, inv_n, N, vocab_total,
               ignore_index, MEAN=mean, BLOCK=B, COUNT_ONLY=True,
               num_warps=max(1, min(16, B // 256)))
    return inv_n


def _grad_fp8_knob():
    v = os.environ.get("LINGHE_CE_GRAD_FP8", "")
    if not v:
        return None
    w, r = (int(t) for t in v.split(","))
    return dict(warps=w, maxnreg=r or None)


#: Launch of :func:`ce_grad_fp8`'s ``[128, 128]`` tiles: warps and the register cap per
#: thread (``maxnreg``; None: ptxas chooses). The tile lives in registers, so these set how
#: many programs share an SM. ptxas (sm_90, triton 3.6): 4 warps 226 registers (2 programs
#: per SM), capped at 168 (3 per SM) 188 bytes of spills; 8 warps 203 (1), capped at 128
#: no spills (2). H200, one e2e chunk ([2048, 157184] bf16, kernel µs, bits equal):
#: 4 warps 508, capped at 168 **457**, 8 warps 548 (capped 548), 16 warps 740; the tile
#: order made no difference (``h200_probe_fp8_lm_head_sweep_2026-11-27_s16``).
#: ``k_fast`` / ``reverse``: the tile order (the kernel's ``K_FAST`` / ``REVERSE``);
#: ``round``: its ``ROUND``. ``LINGHE_CE_GRAD_FP8="warps,maxnreg"`` overrides (0: no cap).
GRAD_FP8_CONFIG = _grad_fp8_knob() or dict(warps=4, maxnreg=168)


def ce_grad_fp8(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                row_weight: torch.Tensor, *, ignore_index: int, label_smoothing: float,
                z_loss: float, pow2_scale: bool, rowwise=None, columnwise=None,
                config: dict | None = None) -> None:
    """The gradient of the loss rows of ``logits [N, V]`` (rows with stride(1) == 1), times
    ``row_weight`` (fp32 ``[1]``: one weight, e.g. :func:`ce_row_weight`; or ``[N]``: one
    per row, e.g. a ``reduction="none"`` grad_output), written only as FP8 (e4m3):

    - ``rowwise = (q, scale)``: ``q [N, V]`` and ``scale [N, ceil(V/128)]`` (any strides),
      1x128 groups along the vocabulary, as :func:`~linghe.fp8.quantize_1x128` of the
      16-bit gradient would be (the dgrad operand);
    - ``columnwise = (q_t, scale_t, t0)``: ``q_t [V, T]`` (contiguous) receives the
      gradient transposed at token columns ``t0 .. t0 + N`` and ``scale_t [V, ceil(T/128)]``
      (any strides) its 1x128 scales along the tokens, groups from ``t0 // 128``
      (``t0`` a multiple of 128): the wgrad operand of a run of chunks.

    ``lse [N]`` from :func:`ce_forward`. Ignored rows give zeros (scale 1). ``config``:
    as :data:`GRAD_FP8_CONFIG` (the default)."""
    N, V = logits.shape
    if rowwise is None and columnwise is None or N == 0 or V == 0:
        return
    w_stride = row_weight.stride(0) if row_weight.numel() != 1 else 0
    q = s = qt = st = None
    ssm = ssg = sstk = sstg = 0
    ldt = t0 = 0
    if rowwise is not None:
        q, s = rowwise
        ssm, ssg = s.stride()
    pack = False
    if columnwise is not None:
        qt, st, t0 = columnwise
        if t0 % 128:
            raise ValueError(f"t0 must be a multiple of 128, got {t0}")
        ldt = qt.shape[1]
        sstk, sstg = st.stride()
        pack = ldt % 16 == 0 and (t0 + N) % 16 == 0
        if pack:
            qt = qt.view(torch.int32)
    cfg = config or GRAD_FP8_CONFIG
    opts = {} if cfg.get("maxnreg") is None else {"maxnreg": cfg["maxnreg"]}
    with device_guard(logits):
        launch(_ce_grad_fp8_kernel, (cdiv(N, 128) * cdiv(V, 128),),
               logits, logits.stride(0), labels, lse, row_weight, w_stride, N, V, V,
               ignore_index, float(label_smoothing), float(z_loss), q, s,
               q.stride(0) if q is not None else 0, ssm, ssg, qt, st, ldt, t0, sstk, sstg,
               ROWWISE=q is not None, COLWISE=qt is not None, POW2=pow2_scale, PACK=pack,
               # (rows a thread holds in the packed store: 128 over the rows one repetition
               # of the tile's layout covers, 4 per warp; see quantize.pack_rows_per_thread)
               RPT=max(4, 32 // cfg["warps"]), K_FAST=cfg.get("k_fast", True),
               REVERSE=cfg.get("reverse", True), EVEN_V=V % 128 == 0,
               ROUND=cfg.get("round", True), num_warps=cfg["warps"], **opts)
