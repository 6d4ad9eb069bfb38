"""Cross-entropy backward kernel: recomputes the softmax from the saved ``lse``.

For a valid row ``i`` with weight ``g_i`` (``grad_output / n_valid`` for "mean",
``grad_output`` for "sum", ``grad_output[i]`` for "none") and smoothing ``eps`` over
``V_total`` classes::

    dlogits[i, j] = g_i * ((1 + 2 z lse_i) softmax_ij - (1 - eps) [j == label_i] - eps / V_total)

Ignored rows (``ignore_index`` or a label outside ``[0, V_total)``) get exactly 0 (the
row is written, not read). A program streams a range of columns of one row once (read
logits, write dlogits; the write may alias the logits buffer: a program reads only its own
columns, each before it writes it, the pipelined loop reading ahead of the writes); long
rows are split over several programs (``fwd.loss.split_v``). The per-row scalars (label,
``lse``, the row weight) are read once per program; nothing else but the logits is read.

Per element the loop does ``exp2(x log2e - lse log2e)``, one FMA and one select (ignored
rows) before the bf16/fp16 store: the target column is not looked for in the loop
(``FIXUP``, the default): the program whose column range holds the label reads that logit
before its loop (in place, a barrier follows: no thread's store overtakes that read) and,
after a barrier behind the loop, overwrites the one element with its target term.
(``FIXUP=False`` compares every column with the label, an int32 compare and a select per
element; the round-2 kernel did that in int64, ~6 more instructions per element.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..fwd.loss import LOG2E, _row_label, block_v, split_v
from ..utils import device_guard, empty, launch

#: Launch configuration of :func:`ce_backward` for large rows on the GPU (the probe,
#: ``benchmark.probe_cenorm``, varies it; ``None`` = the heuristics of ``fwd.loss``):
#: ``block_v``/``warps``: columns per loop step and warps (``LINGHE_CE_BWD`` also sets
#: them); ``chunk``: columns per program (``LINGHE_CE_CHUNK``; 0 = one program per row);
#: ``stages``: the loop is software-pipelined by Triton (``tl.range(num_stages=)``: the
#: logits are copied asynchronously into shared memory ``stages - 1`` blocks ahead; 1 =
#: plain loads); ``prefetch``: round 2's register prefetch of the next block (ptxas moves
#: the load after this block's math, so it hides little; use with ``stages=1``);
#: ``evict``: eviction hint of the logits load and dlogits store ("" none, the default;
#: "evict_first": round 2's, ``LINGHE_CE_EVICT=1``: 1369 µs vs 1333 µs without on H200);
#: ``row_fastest``: program ``p`` takes row ``p % N`` (consecutive programs on different
#: rows, the round-2 order) instead of row ``p // S`` (consecutive programs cover
#: consecutive columns of a row, then the next row); ``fixup``: see the module doc.
#: H200 at [8192, 157184] bf16 (probe_cenorm, 2026-11-26; main 1377.5 µs): 4096-column
#: blocks / 8 warps 1276.9 µs, 2048 / 8 warps 1263.5 (96.6% of copy), the default.
BWD_CONFIG = dict(block_v=2048, warps=8, chunk=None, stages=3, prefetch=False,
                  evict="evict_first" if os.environ.get("LINGHE_CE_EVICT") == "1" else "",
                  row_fastest=False, fixup=True)


@triton.jit
def _ce_bwd_kernel(x_ptr, stride_x, dx_ptr, stride_dx, lab_ptr, lse_ptr, go_ptr, go_stride,
                   inv_n_ptr, N, S, V, vocab_start, V_total, ignore_index, eps, z_loss,
                   CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, PER_ROW: tl.constexpr,
                   PREFETCH: tl.constexpr = False, EVICT: tl.constexpr = "",
                   ROW_FASTEST: tl.constexpr = False, FIXUP: tl.constexpr = True,
                   STAGES: tl.constexpr = 1, INPLACE: tl.constexpr = False):
    # a 1-D grid of N * S programs: (row, column range k)
    pid = tl.program_id(0)
    if ROW_FASTEST:
        row = (pid % N).to(tl.int64)
        k = pid // N
    else:
        row = (pid // S).to(tl.int64)
        k = pid % S
    valid, local, in_slice = _row_label(lab_ptr, row, vocab_start, V, V_total, ignore_index)
    xb = x_ptr + row * stride_x
    db = dx_ptr + row * stride_dx
    cols = tl.arange(0, BLOCK_V)
    # program (row, k) covers columns [k * CHUNK, min((k + 1) * CHUNK, V))
    lo = k * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    c = lo + cols
    if PREFETCH:
        # software prefetch of the next block (never past this program's range: with the
        # in-place variant other programs' ranges are being overwritten); the first
        # block's load does not wait for the label
        x_nxt = tl.load(xb + c, mask=c < hi, other=0.0, eviction_policy=EVICT)
    else:
        x_nxt = tl.zeros([BLOCK_V], dtype=x_ptr.dtype.element_ty)
    lse = tl.load(lse_ptr + row)
    if PER_ROW:
        g = tl.load(go_ptr + row * go_stride).to(tl.float32)
    else:
        g = tl.load(go_ptr).to(tl.float32) * tl.load(inv_n_ptr)
    g = tl.where(valid, g, 0.0)
    coef = g * (1.0 + 2.0 * z_loss * lse)
    smooth = g * eps / V_total
    hit = g * (1.0 - eps)
    lse2 = lse * LOG2E
    mine = in_slice & (local >= lo) & (local < hi)  # the label's column is in this range
    t_off = tl.where(mine, local, 0)
    if FIXUP:
        # the target logit, read before the loop (the in-place variant overwrites it)
        x_t = tl.load(xb + t_off, mask=mine, other=0.0).to(tl.float32)
        if INPLACE:  # ... and that read happens before any thread's store (CTA barrier)
            tl.debug_barrier()
    local32 = local.to(tl.int32)  # -1 when the label is not in this slice
    n_read = tl.where(valid, hi, lo)  # an ignored row is written (zeros), not read
    for off in tl.range(lo, hi, BLOCK_V, num_stages=STAGES):
        c = off + cols
        mask = c < hi
        if PREFETCH:
            x = x_nxt.to(tl.float32)
            cn = c + BLOCK_V
            x_nxt = tl.load(xb + cn, mask=cn < n_read, other=0.0, eviction_policy=EVICT)
        else:
            x = tl.load(xb + c, mask=c < n_read, other=0.0,
                        eviction_policy=EVICT).to(tl.float32)
        p = tl.exp2(x * LOG2E - lse2)
        d = coef * p - smooth
        if not FIXUP:
            d -= tl.where(cols == local32 - off, hit, 0.0)
        d = tl.where(valid, d, 0.0)
        tl.store(db + c, d.to(dx_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT)
    if FIXUP:
        # every thread's stores of the loop are ordered before the one below (CTA barrier)
        tl.debug_barrier()
        d_t = coef * tl.exp2(x_t * LOG2E - lse2) - smooth - hit
        tl.store(db + t_off, d_t.to(dx_ptr.dtype.element_ty), mask=mine)


def bwd_launch_config(V: int) -> tuple[int, int, int, int]:
    """``(BLOCK_V, num_warps, CHUNK, S)`` of the backward for rows of ``V`` columns, from
    :data:`BWD_CONFIG` and the heuristics of ``fwd.loss`` (:func:`block_v`, :func:`split_v`;
    on the interpreter only the heuristics, so small tests split rows)."""
    cfg = BWD_CONFIG
    big = (cfg["block_v"], cfg["warps"]) if cfg["block_v"] and cfg["warps"] else None
    BV, warps = block_v(V, "bwd", big)
    chunk, S = split_v(V, BV, "bwd", cfg["chunk"])
    return BV, warps, chunk, S


def ce_backward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                grad_output: torch.Tensor, inv_n: torch.Tensor | None, *, ignore_index: int,
                label_smoothing: float, z_loss: float, vocab_start: int = 0,
                vocab_total: int | None = None, inplace: bool = False) -> torch.Tensor:
    """``dlogits [N, V]`` (logits' dtype). ``grad_output`` is a scalar (with ``inv_n``, the
    row weight from the forward's reduction) or ``[N]`` (reduction "none", ``inv_n=None``).
    With ``inplace=True`` the gradient overwrites ``logits`` and ``logits`` is returned."""
    N, V = logits.shape
    Vt = V if vocab_total is None else vocab_total
    dx = logits if inplace else empty(N, V, dtype=logits.dtype, device=logits.device)
    if N == 0 or V == 0:
        return dx
    per_row = inv_n is None
    go = grad_output.float() if grad_output.dtype == torch.float64 else grad_output
    go_stride = go.stride(0) if per_row else 0
    BV, warps, chunk, S = bwd_launch_config(V)
    cfg = BWD_CONFIG
    with device_guard(logits):
        launch(_ce_bwd_kernel, (N * S,),
            logits, logits.stride(0), dx, dx.stride(0), labels, lse, go, go_stride,
            inv_n if inv_n is not None else lse, N, S, V, vocab_start, Vt, ignore_index,
            float(label_smoothing), float(z_loss), CHUNK=chunk, BLOCK_V=BV, PER_ROW=per_row,
            PREFETCH=cfg["prefetch"], EVICT=cfg["evict"], ROW_FASTEST=cfg["row_fastest"],
            FIXUP=cfg["fixup"], STAGES=cfg["stages"], INPLACE=inplace, num_warps=warps)
    return dx



@triton.jit
def _scale_unless_one_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr):
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:  # loss.backward()'s gradient is 1: nothing to read or write
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(x_ptr + offs, (x.to(tl.float32) * g).to(x_ptr.dtype.element_ty), mask=mask)


def scale_by_grad_(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``t *= grad`` in place (``t`` contiguous, ``grad`` a one-element device tensor),
    decided on the device: with ``grad == 1`` (a loss's usual gradient) the kernel reads
    ``grad`` and returns, so a precomputed gradient costs no pass over its bytes and the
    host never syncs. Returns ``t``."""
    n = t.numel()
    if n:
        BLOCK = 4096
        with device_guard(t):
            launch(_scale_unless_one_kernel, (triton.cdiv(n, BLOCK),), t, grad.reshape(1), n,
                   BLOCK=BLOCK, num_warps=8)
    return t
