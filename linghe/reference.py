"""Plain-PyTorch reference of every linghe op: the executable spec.

Tests compare the kernels against these functions (run in float64/float32), and the
benchmark uses them as the "eager" baseline (and ``torch.compile`` of them). Each section
carries the name of the op family it specifies (``fwd/<family>.py``, ``tests/test_<family>.py``).
Functions here are differentiable with autograd, so gradients are specified too.
"""

from __future__ import annotations

import math

import torch

# ======================================================================================
# fp8: blockwise quantization (1x128 groups, 128x128 blocks), e4m3
# ======================================================================================

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s for positive float32 ``s`` (exact bit arithmetic)."""
    bits = s.float().contiguous().view(torch.int32)
    up = (bits + 0x007FFFFF) & 0x7F800000
    return torch.where(bits == 0, bits, up).view(torch.float32)


def fp8_scale(amax: torch.Tensor, pow2_scale: bool = False) -> torch.Tensor:
    """Dequantization scale of a block: ``amax / 448`` (rounded up to a power of two when
    ``pow2_scale``); a block whose amax is 0 gets scale 1."""
    amax = amax.float()
    scale = amax / FP8_MAX
    if pow2_scale:
        scale = round_up_pow2(scale)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize_1x128(x: torch.Tensor, pow2_scale: bool = False):
    """Rowwise 1x128 quantization of ``x [M, K]``.

    Returns ``(q [M, K] float8_e4m3fn, scale [M, ceil(K/128)] float32)`` with
    ``x ≈ q * scale`` per group of 128 consecutive elements of a row (the last group of a
    row may be partial).
    """
    M, K = x.shape
    G = math.ceil(K / BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, G * BLOCK - K)).view(M, G, BLOCK)
    scale = fp8_scale(xf.abs().amax(dim=-1), pow2_scale)
    q = (xf / scale[..., None]).to(FP8_DTYPE).view(M, G * BLOCK)[:, :K]
    return q.contiguous(), scale


def quantize_1x128_columnwise(x: torch.Tensor, pow2_scale: bool = False):
    """Columnwise copy of ``x [M, K]``: ``x.T [K, M]`` quantized in 1x128 groups along M.

    This is the quantization of the high-precision transpose, not the transpose of the
    rowwise quantization. Returns ``(q_t [K, M], scale_t [K, ceil(M/128)])``.
    """
    return quantize_1x128(x.t(), pow2_scale)


def quantize_128x128(w: torch.Tensor, pow2_scale: bool = False):
    """128x128 block quantization of a weight ``w [N, K]``.

    Returns ``(q [N, K], scale [ceil(N/128), ceil(K/128)])``.
    """
    N, K = w.shape
    GN, GK = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    wf = torch.nn.functional.pad(w.float(), (0, GK * BLOCK - K, 0, GN * BLOCK - N))
    blocks = wf.view(GN, BLOCK, GK, BLOCK)
    scale = fp8_scale(blocks.abs().amax(dim=(1, 3)), pow2_scale)
    q = (blocks / scale[:, None, :, None]).to(FP8_DTYPE).view(GN * BLOCK, GK * BLOCK)
    return q[:N, :K].contiguous(), scale


def dequantize_1x128(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32):
    """Inverse of :func:`quantize_1x128`: ``q [M, K]`` times its group scales."""
    K = q.shape[1]
    s = scale.float().repeat_interleave(BLOCK, dim=1)[:, :K]
    return (q.float() * s).to(dtype)


def dequantize_128x128(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32):
    """Inverse of :func:`quantize_128x128`."""
    N, K = q.shape
    s = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:N, :K]
    return (q.float() * s).to(dtype)


# ======================================================================================
# optim: total norm, gradient clipping, zero counting, FP8 amax/scale bookkeeping
# ======================================================================================


def total_norm(tensors, norm_type: float = 2.0, dtype=torch.float64) -> torch.Tensor:
    """Norm of the concatenation of ``tensors`` (each flattened, read in ``dtype``);
    ``tensor(0.)`` for an empty list (as PyTorch)."""
    ts = [t.detach().reshape(-1).to(dtype) for t in tensors]
    if not ts:
        return torch.tensor(0.0, dtype=dtype)
    return torch.linalg.vector_norm(torch.cat(ts), float(norm_type))


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clamp(max_norm / (total + 1e-6), max=1)`` (PyTorch's clip coefficient)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """In-place clipping of the ``.grad`` of ``parameters`` (None skipped); returns the total
    norm (float32). The gradients are multiplied by the float32 coefficient in float32 and
    stored in their own dtype."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = total_norm(grads, norm_type, torch.float32)
    coef = clip_coef(total, max_norm)
    for g in grads:
        g.copy_((g.double() if g.dtype == torch.float64 else g.float()) * coef)
    return total


def count_zeros(tensors) -> torch.Tensor:
    """Number of elements equal to 0 (``-0.0`` counts, NaN does not), int64."""
    total = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        if t.dtype.is_floating_point and t.element_size() == 1:
            t = t.float()  # fp8: compare the widened values
        total += (t == 0).sum().cpu()
    return total


def amax_history_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float = 448.0,
                        margin: float = 0, amax_compute: str = "max"):
    """Delayed scaling step: returns ``(new_history, new_scale)``.

    ``amax = max over the rows of amax_history [L, n]`` (``"max"``) or row 0
    (``"most_recent"``); ``scale = (fp8_max / amax) / 2**margin`` where amax is finite and
    > 0 (and the scale finite), else the previous scale; the history rolls down one row
    (``new[i+1] = old[i]``) and row 0 becomes 0.
    """
    h = amax_history.float()
    amax = h.amax(dim=0) if amax_compute == "max" else h[0]
    s = torch.full_like(amax, fp8_max) / amax / (2.0 ** margin)  # (not 448 / t: a reciprocal)
    good = (amax > 0) & torch.isfinite(amax) & torch.isfinite(s)
    new_scale = torch.where(good, s, scale.float())
    new_hist = torch.zeros_like(h)
    new_hist[1:] = h[:-1]
    return new_hist, new_scale
