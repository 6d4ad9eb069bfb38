"""Cross-entropy backward kernel: recomputes the softmax from the saved ``lse``.

For a valid row ``i`` with weight ``g_i`` (``grad_output / n_valid`` for "mean",
``grad_output`` for "sum", ``grad_output[i]`` for "none") and smoothing ``eps`` over
``V_total`` classes::

    dlogits[i, j] = g_i * ((1 + 2 z lse_i) softmax_ij - (1 - eps) [j == label_i] - eps / V_total)

Ignored rows (``ignore_index`` or a label outside ``[0, V_total)``) get exactly 0 (the
row is written, not read). A program streams a range of columns of one row once (read
logits, write dlogits; the write may alias the logits buffer: each element is read before
the same thread writes it); long rows are split over several programs
(``fwd.loss.split_v``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fwd.loss import EVICT_POLICY, LOG2E, PREFETCH_DEFAULT, _row_label, block_v, split_v
from ..utils import device_guard, empty, launch


@triton.jit
def _ce_bwd_kernel(x_ptr, stride_x, dx_ptr, stride_dx, lab_ptr, lse_ptr, go_ptr, go_stride,
                   inv_n_ptr, V, vocab_start, V_total, ignore_index, eps, z_loss,
                   CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, PER_ROW: tl.constexpr,
                   PREFETCH: tl.constexpr = PREFETCH_DEFAULT,
                   EVICT: tl.constexpr = EVICT_POLICY):
    row = tl.program_id(0).to(tl.int64)
    valid, local, in_slice = _row_label(lab_ptr, row, vocab_start, V, V_total, ignore_index)
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
    xb = x_ptr + row * stride_x
    db = dx_ptr + row * stride_dx
    cols = tl.arange(0, BLOCK_V)
    # program (row, k) covers columns [k * CHUNK, min((k + 1) * CHUNK, V))
    lo = tl.program_id(1) * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    n_read = tl.where(valid, hi, lo)  # an ignored row is written (zeros), not read
    # software prefetch of the next block (never past this program's range: with the
    # in-place variant other programs' ranges are being overwritten)
    c = lo + cols
    if PREFETCH:
        # (the first block's load does not wait for the label)
        x_nxt = tl.load(xb + c, mask=c < hi, other=0.0,
                        eviction_policy=EVICT)
    else:
        x_nxt = tl.zeros([BLOCK_V], dtype=x_ptr.dtype.element_ty)
    for off in range(lo, hi, BLOCK_V):
        c = off + cols
        mask = c < hi
        if PREFETCH:
            x = x_nxt.to(tl.float32)
            cn = c + BLOCK_V
            x_nxt = tl.load(xb + cn, mask=cn < n_read, other=0.0,
                            eviction_policy=EVICT)
        else:
            x = tl.load(xb + c, mask=c < n_read, other=0.0,
                        eviction_policy=EVICT).to(tl.float32)
        p = tl.exp2(x * LOG2E - lse2)
        d = coef * p - smooth - tl.where(c == local, hit, 0.0)
        d = tl.where(valid, d, 0.0)
        tl.store(db + c, d.to(dx_ptr.dtype.element_ty), mask=mask,
                 eviction_policy=EVICT)


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
    BV, warps = block_v(V, "bwd")
    chunk, S = split_v(V, BV, "bwd")
    with device_guard(logits):
        launch(_ce_bwd_kernel, (N, S),
            logits, logits.stride(0), dx, dx.stride(0), labels, lse, go, go_stride,
            inv_n if inv_n is not None else lse, V, vocab_start, Vt, ignore_index,
            float(label_smoothing), float(z_loss), CHUNK=chunk, BLOCK_V=BV, PER_ROW=per_row,
            num_warps=warps)
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
