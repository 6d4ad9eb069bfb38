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
    row may be partial). Elements are multiplied by ``1 / scale`` (exact reciprocal).
    """
    M, K = x.shape
    G = math.ceil(K / BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, G * BLOCK - K)).view(M, G, BLOCK)
    scale = fp8_scale(xf.abs().amax(dim=-1), pow2_scale)
    q = (xf * (1.0 / scale)[..., None]).to(FP8_DTYPE).view(M, G * BLOCK)[:, :K]
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
    q = (blocks * (1.0 / scale)[:, None, :, None]).to(FP8_DTYPE).view(GN * BLOCK, GK * BLOCK)
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
# grouped_mm: per-expert GEMMs over rows grouped by expert (ExpertLayout)
# ======================================================================================


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out [R, N]``: for each expert ``e``, ``out[o_e:o_{e+1}] = rows[o_e:o_{e+1}] @
    weight[e].T`` with ``o = offsets [E + 1]`` (``weight [E, N, K]``, ``nn.Linear``
    convention); rows ``>= offsets[E]`` (the tail) give zeros. Differentiable: the
    gradients are the per-expert dgrad ``d_out_e @ W_e`` and wgrad ``d_out_e^T @ rows_e``.
    A per-expert loop (host sync on ``offsets``: a reference, not a kernel)."""
    R = rows.shape[0]
    E, N, _ = weight.shape
    o = [int(v) for v in offsets.tolist()]
    parts = []
    for e in range(E):
        parts.append(rows[o[e]:o[e + 1]] @ weight[e].t())
    parts.append(rows.new_zeros(R - o[E], N))
    return torch.cat(parts, 0)


def grouped_mm_fp8_dequantized(rows_q: torch.Tensor, rows_scale: torch.Tensor,
                               w_q: torch.Tensor, w_scale: torch.Tensor,
                               offsets: torch.Tensor) -> torch.Tensor:
    """FP8 grouped GEMM spec: :func:`grouped_mm` of the dequantized operands (float32),
    ``rows`` 1x128 rowwise ``[R, K]`` and weights 128x128 over the ``[E*N, K]`` view."""
    E = offsets.numel() - 1
    x = dequantize_1x128(rows_q, rows_scale)
    w = dequantize_128x128(w_q, w_scale)
    return grouped_mm(x, w.view(E, -1, w.shape[1]), offsets)
