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
# activation: SwiGLU (silu_mul), fused 1x128 quantization, per-expert batch form
# ======================================================================================


def silu_mul(x: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` (times ``probs[row]``) for ``x [..., 2n]``.

    ``probs`` has one weight per row (shape ``[M]`` or ``x.shape[:-1]``). Computed in
    x's dtype (pass float64 inputs for a high-precision spec).
    """
    n = x.shape[-1] // 2
    y = torch.nn.functional.silu(x[..., :n]) * x[..., n:]
    if probs is not None:
        y = y * probs.reshape(*x.shape[:-1], 1).to(y.dtype)
    return y


def silu_mul_quant(x: torch.Tensor, probs: torch.Tensor | None = None,
                   pow2_scale: bool = False):
    """1x128 quantization of ``silu_mul(x, probs)`` (in float32 or better) of
    ``x [..., 2n]`` viewed as ``[M, 2n]``: returns ``(q [M, n], scale [M, cdiv(n,128)],
    q_t [n, M], scale_t [n, cdiv(M,128)])`` (rowwise and columnwise copies)."""
    xf = x.float() if x.dtype != torch.float64 else x
    pf = None
    if probs is not None:
        pf = probs.float() if probs.dtype != torch.float64 else probs
    y = silu_mul(xf, pf)
    y = y.reshape(-1, y.shape[-1])
    return (*quantize_1x128(y, pow2_scale), *quantize_1x128_columnwise(y, pow2_scale))


def expert_segments(tokens_per_expert, align: int):
    """Host list of ``(start, real, padded)`` per expert for rows grouped by expert
    (:mod:`linghe.layout`)."""
    counts = [max(int(c), 0) for c in torch.as_tensor(tokens_per_expert).tolist()]
    segs, start = [], 0
    for c in counts:
        padded = -(-c // align) * align
        segs.append((start, c, padded))
        start += padded
    return segs


def batch_silu_mul_quant(x: torch.Tensor, probs: torch.Tensor | None,
                         tokens_per_expert, align: int = 16, pow2_scale: bool = False):
    """Spec of ``linghe.batch_silu_mul_quant`` (loops over experts; slow, host counts).

    ``x [R, 2n]`` rows grouped by expert (segments padded to ``align``; padding and tail
    rows are treated as zeros whatever x holds there). Returns ``(q [R, n], scale
    [R, cdiv(n,128)], q_t [n, R], scale_t [n, G], col_group_offsets [E+1])`` where
    ``G = cdiv(R,128) + E``; expert e's columnwise groups (1x128 along tokens, starting at
    its segment start, never crossing it) are scale columns ``[g_off[e], g_off[e+1])``;
    the tail rows ``[offsets[E], R)`` form the next groups, and unused columns have scale 1.
    """
    R, n = x.shape[0], x.shape[1] // 2
    segs = expert_segments(tokens_per_expert, align)
    xf = x.float() if x.dtype != torch.float64 else x
    real = torch.zeros(R, dtype=torch.bool, device=x.device)
    for start, c, _ in segs:
        real[start:start + c] = True
    xm = torch.where(real[:, None], xf, torch.zeros((), dtype=xf.dtype, device=x.device))
    pf = None
    if probs is not None:
        pf = probs.float() if probs.dtype != torch.float64 else probs
        pf = torch.where(real, pf, torch.zeros((), dtype=pf.dtype, device=x.device))
    y = silu_mul(xm, pf)
    q, s = quantize_1x128(y, pow2_scale)
    E = len(segs)
    G = math.ceil(R / BLOCK) + E
    q_t = torch.zeros(n, R, dtype=FP8_DTYPE, device=x.device)
    s_t = torch.ones(n, G, dtype=torch.float32, device=x.device)
    g_off = [0]
    used = 0
    for start, _, padded in segs:
        if padded:
            qe, se = quantize_1x128_columnwise(y[start:start + padded], pow2_scale)
            q_t[:, start:start + padded] = qe
            s_t[:, g_off[-1]:g_off[-1] + se.shape[1]] = se
        g_off.append(g_off[-1] + math.ceil(padded / BLOCK))
        used = start + padded
    if used < R:  # tail rows: zeros, scale 1 (already)
        q_t[:, used:] = torch.zeros((), dtype=torch.float32).to(FP8_DTYPE)
    return q, s, q_t, s_t, torch.tensor(g_off, dtype=torch.int32, device=x.device)


def dequantize_batch_columnwise(q_t: torch.Tensor, scale_t: torch.Tensor, tokens_per_expert,
                                align: int, dtype=torch.float32) -> torch.Tensor:
    """Inverse of the segment-grouped columnwise copy of :func:`batch_silu_mul_quant`:
    ``[n, R]`` fp8 + ``[n, G]`` scales → ``[R, n]`` (rows in their original order)."""
    n, R = q_t.shape
    out = torch.zeros(R, n, dtype=torch.float32, device=q_t.device)
    g = 0
    for start, _, padded in expert_segments(tokens_per_expert, align):
        if padded:
            ng = math.ceil(padded / BLOCK)
            out[start:start + padded] = dequantize_1x128(
                q_t[:, start:start + padded], scale_t[:, g:g + ng]).t()
            g += ng
    return out.to(dtype)
# norm: RMSNorm (+ residual add), RMSNorm + 1x128 FP8 quantization
# ======================================================================================


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim in float32 (float64 stays float64), not rounded."""
    xf = x.float() if x.dtype != torch.float64 else x
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return xf * rstd * weight.to(xf.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             residual: torch.Tensor | None = None):
    """``y = x * rsqrt(mean(x^2, -1) + eps) * weight`` in fp32 math, cast to ``x.dtype``.

    With ``residual``: ``h = x + residual`` (in ``x``'s dtype) is normalized and
    ``(y, h)`` is returned.
    """
    if residual is not None:
        h = x + residual
        return rms_norm_f32(h, weight, eps).to(x.dtype), h
    return rms_norm_f32(x, weight, eps).to(x.dtype)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                   columnwise: bool = True, pow2_scale: bool = False):
    """1x128 quantization of the (unrounded fp32) RMSNorm output of ``x [..., K]``.

    Returns ``(q [M, K], scale [M, ceil(K/128)])`` plus, with ``columnwise``,
    ``(q_t [K, M], scale_t [K, ceil(M/128)])``.
    """
    y = rms_norm_f32(x, weight, eps).float()
    y = y.reshape(-1, y.shape[-1])
    out = quantize_1x128(y, pow2_scale)
    if columnwise:
        out = (*out, *quantize_1x128_columnwise(y, pow2_scale))
    return out
