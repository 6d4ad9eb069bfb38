"""AdamW updates that also write a weight's FP8 copies (128x128 blocks).

An FP8 layer quantizes its weights once per optimizer step (:class:`~linghe.fp8.WeightCache`):
the first forward after a step reads every updated weight again, only to quantize it.
For a weight bound to such a cache (:meth:`WeightCache.bind_128x128`),
:class:`linghe.optim.AdamW` instead runs :func:`adamw_quant_128_`: each program updates one
128x128 block of the weight (and its moments) exactly as the multi-tensor AdamW kernel
does, then quantizes the block from the values it has just written (in the weight's
dtype), and writes both FP8 copies and the block's scale; the optimizer puts the result
in the cache, and from the next step on writes into that copy's buffers (the same
tensors every step, their version counters bumped: what CUDA graphs captured with
:func:`linghe.whole_step_capture` read). The bytes saved are one read of the weight
from memory (2 bytes per bf16 parameter; the block is read back from L2), a ninth of the
optimizer's and the quantization's traffic.

The copies are bit-identical to :func:`linghe.quantize_128x128` of the updated weight
(``columnwise=True``): the same block amax, scale and e4m3 rounding. A program walks its
block in slices of ``ROWS`` rows for the update (the block's amax kept), then quantizes
the values it wrote as one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.quantize import FP8_DTYPE, fp8_block_scale, to_e4m3
from ..utils import cdiv, device_guard, empty, launch
from .multi_tensor import _adamw_block, adamw_bias, adamw_scalars

BLOCK = 128


@triton.jit
def _adamw_quant_128_kernel(p_ptr, g_ptr, m_ptr, v_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
                            bias_ptr, t, coef_ptr, lr_ptr, lr, beta1, beta2, eps,
                            weight_decay, N, K, CLIP: tl.constexpr, LR_TENSOR: tl.constexpr,
                            MAXIMIZE: tl.constexpr, POW2: tl.constexpr, ROWS: tl.constexpr,
                            STAGES: tl.constexpr):
    """AdamW on the 128x128 block ``(pid_n, pid_k)`` of a weight ``[N, K]`` (the math of
    :func:`~linghe.optim.multi_tensor._adamw_kernel`, bias corrections from row ``t`` of
    ``bias``), then the block quantized like ``_quantize_128x128_kernel``: ``q [N, K]``,
    ``s [cdiv(N,128), cdiv(K,128)]``, ``qt [K, N]``, ``st [cdiv(K,128), cdiv(N,128)]``.

    Two passes: the update in ``ROWS``-row slices (keeping the block's amax of the
    values as stored; a loop pipelined ``STAGES`` deep, so that the next slices' loads
    are in flight while one is updated), then, after a barrier, the quantization of those
    values read back as one tile (the block was just written: L2 hits; 128-byte rows of
    the transposed copy, where 16-row slices wrote 16-byte pieces)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    lr_f, coef, decay = adamw_scalars(coef_ptr, lr_ptr, lr, weight_decay, CLIP, LR_TENSOR)
    step_size, bc2_sqrt = adamw_bias(bias_ptr, t, lr_f)
    cols = pid_k * 128 + tl.arange(0, 128)
    cmask = cols < K
    r0 = pid_n.to(tl.int64) * 128
    amax = tl.zeros([], tl.float32)
    for i in tl.range(0, 128, ROWS, num_stages=STAGES):
        rows = r0 + i + tl.arange(0, ROWS)
        mask = (rows < N)[:, None] & cmask[None, :]
        o = rows[:, None] * K + cols[None, :]
        p = _adamw_block(p_ptr + o, g_ptr + o, m_ptr + o, v_ptr + o, mask, coef, decay,
                         step_size, bc2_sqrt, beta1, beta2, eps, MAXIMIZE)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(tl.where(mask, p.to(tl.float32), 0.0)),
                                              axis=1), axis=0))
    scale = fp8_block_scale(amax, POW2)
    tl.debug_barrier()  # this CTA's writes of the block are visible to all its threads
    # the whole block at once: each row of the transposed copy gets 128 contiguous bytes
    rows = r0 + tl.arange(0, 128)
    mask = (rows < N)[:, None] & cmask[None, :]
    w = tl.load(p_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
    q = to_e4m3(w.to(tl.float32) * (1.0 / scale))
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(qt_ptr + cols[:, None].to(tl.int64) * N + rows[None, :], tl.trans(q),
             mask=tl.trans(mask))
    tl.store(s_ptr + pid_n * tl.cdiv(K, 128) + pid_k, scale)
    tl.store(st_ptr + pid_k * tl.cdiv(N, 128) + pid_n, scale)


#: Launch knobs of :func:`adamw_quant_128_`: rows per slice, warps, pipeline stages of
#: the update loop (``benchmark.probe_adamw``, the e2e's expert weights on an H200: 1, no
#: pipelining, as before: 79% of the copy bandwidth; 2: 65%; 3: 82%; 4: 86%).
ROWS = 16
NUM_WARPS = 8
STAGES = 4


def adamw_quant_128_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     bias: torch.Tensor, row: int, *, lr, beta1: float, beta2: float,
                     eps: float, weight_decay: float, maximize: bool,
                     coef: torch.Tensor | None, pow2_scale: bool, shape2d: tuple[int, int],
                     out: tuple | None = None):
    """One AdamW step of ``p`` (in place, with its moments ``m``/``v``; gradient ``g``;
    bias corrections ``bias[row]``; the other arguments as for
    :func:`~linghe.optim.multi_tensor.adamw_`) viewed as ``shape2d = (N, K)``, returning
    the FP8 copies of the updated weight as :func:`linghe.quantize_128x128` makes them:
    ``(q [N, K], s, qt [K, N], st)``. All four tensors contiguous, of ``N * K``
    elements, on one CUDA device (or the interpreter). ``out``: ``(q, s, qt, st)`` to
    write into (the previous step's copy, as :func:`copy_buffers_fit` accepts), else new
    tensors."""
    N, K = shape2d
    dev = p.device
    if out is not None:
        q, s, qt, st = out
    else:
        q = empty(N, K, dtype=FP8_DTYPE, device=dev)
        s = empty(cdiv(N, BLOCK), cdiv(K, BLOCK), dtype=torch.float32, device=dev)
        qt = empty(K, N, dtype=FP8_DTYPE, device=dev)
        st = empty(cdiv(K, BLOCK), cdiv(N, BLOCK), dtype=torch.float32, device=dev)
    if N and K:
        lr_tensor = isinstance(lr, torch.Tensor)
        with device_guard(p):
            launch(_adamw_quant_128_kernel, (cdiv(N, BLOCK), cdiv(K, BLOCK)), p, g, m, v, q, s,
                   qt, st, bias, row, coef if coef is not None else bias,
                   lr if lr_tensor else bias, 0.0 if lr_tensor else float(lr), float(beta1),
                   float(beta2), float(eps), float(weight_decay), N, K,
                   CLIP=coef is not None, LR_TENSOR=lr_tensor, MAXIMIZE=bool(maximize),
                   POW2=bool(pow2_scale), ROWS=ROWS, STAGES=STAGES, num_warps=NUM_WARPS)
    return q, s, qt, st


def copy_buffers_fit(value, shape2d: tuple[int, int], device: torch.device) -> bool:
    """Whether ``value`` (an :class:`~linghe.Fp8Tensor` this update made before) can take
    the next copy of a weight viewed as ``shape2d`` in place: both 128x128 copies, e4m3,
    contiguous, of the shapes :func:`adamw_quant_128_` writes, on ``device``."""
    N, K = shape2d
    if value is None or value.scaling != "128x128":
        return False
    want = ((value.rowwise_data, (N, K), FP8_DTYPE),
            (value.rowwise_scale, (cdiv(N, BLOCK), cdiv(K, BLOCK)), torch.float32),
            (value.columnwise_data, (K, N), FP8_DTYPE),
            (value.columnwise_scale, (cdiv(K, BLOCK), cdiv(N, BLOCK)), torch.float32))
    return all(t is not None and tuple(t.shape) == shape and t.dtype == dtype
               and t.device == device and t.is_contiguous() for t, shape, dtype in want)
