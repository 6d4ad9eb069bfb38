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
# === rope: split + qk-norm + rotate-half RoPE + transpose; HF-layout apply_rope ===
# ======================================================================================


def rope_freqs(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE angles ``[max_pos, rotary_dim/2]`` float32: ``pos * base^(-2i/rotary_dim)``."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    pos = torch.arange(max_pos, dtype=torch.float64)
    return (pos[:, None] * inv[None, :]).float()


def qkv_head_columns(num_heads: int, num_kv_heads: int, interleaved: bool):
    """Head indices (in units of head_dim) of the q, k and v heads inside the fused
    ``(H + 2 Hkv) * D`` projection. ``interleaved``: Megatron GQA order, per kv group its
    ``H/Hkv`` query heads, then its k head, then its v head; else ``[all q|all k|all v]``."""
    H, Hkv = num_heads, num_kv_heads
    if interleaved:
        G = H // Hkv
        q = [(h // G) * (G + 2) + h % G for h in range(H)]
        k = [j * (G + 2) + G for j in range(Hkv)]
        v = [j * (G + 2) + G + 1 for j in range(Hkv)]
    else:
        q = list(range(H))
        k = list(range(H, H + Hkv))
        v = list(range(H + Hkv, H + 2 * Hkv))
    return q, k, v


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
    """NeoX rotate-half RoPE on the first ``rotary_dim`` dims of ``x [..., D]`` (pairs
    ``(i, i + rotary_dim/2)``); ``cos``/``sin`` ``[..., rotary_dim/2]`` broadcast to x."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def qk_norm_rope(qkv, freqs, *, num_heads, num_kv_heads, q_norm_weight=None,
                 k_norm_weight=None, rotary_dim=None, layout="sbh", interleaved=True,
                 position_ids=None, eps=1e-6):
    """Split the fused projection ``qkv`` (``[S, B, (H+2Hkv)*D]`` for ``layout="sbh"``,
    ``[B, S, ...]`` for ``"bsh"``) into heads, RMS-normalize q and k per head (when the
    ``[D]`` weights are given), apply rotate-half RoPE with angles ``freqs[pos]`` on the
    first ``rotary_dim`` dims (positions ``0..S-1`` or ``position_ids [B, S]``) and return
    ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]`` contiguous in qkv's dtype. Math in fp32."""
    H, Hkv = num_heads, num_kv_heads
    x = qkv.transpose(0, 1) if layout == "sbh" else qkv
    B, S, W = x.shape
    D = W // (H + 2 * Hkv)
    R = D if rotary_dim is None else rotary_dim
    x = x.float().reshape(B, S, H + 2 * Hkv, D)
    qi, ki, vi = qkv_head_columns(H, Hkv, interleaved)
    q, k, v = x[:, :, qi], x[:, :, ki], x[:, :, vi]

    def norm(t, w):
        if w is None:
            return t
        rstd = torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        return t * rstd * w.float()

    q, k = norm(q, q_norm_weight), norm(k, k_norm_weight)
    if position_ids is None:
        ang = freqs[:S].float()[None].expand(B, S, R // 2)
    else:
        ang = freqs.float()[position_ids.long()]
    cos, sin = torch.cos(ang)[:, :, None, :], torch.sin(ang)[:, :, None, :]
    q = rotate_half_rope(q, cos, sin, R)
    k = rotate_half_rope(k, cos, sin, R)
    dt = qkv.dtype
    return q.to(dt).contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous()


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half``: ``cat(-x2, x1)`` over the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, k, cos, sin, position_ids=None):
    """Hugging Face ``apply_rotary_pos_emb`` for ``q [B, H, S, D]``, ``k [B, Hk, S, D]``:
    ``x * cos + rotate_half(x) * sin``. ``cos``/``sin`` are ``[S, D]`` or ``[B, S, D]``;
    with ``position_ids [B, S]`` they are tables ``[max_pos, D]`` indexed by it. fp32 math,
    outputs in q's/k's dtype."""
    if position_ids is not None:
        cos, sin = cos[position_ids.long()], sin[position_ids.long()]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    c, s = cos.float()[:, None], sin.float()[:, None]
    qf, kf = q.float(), k.float()
    qo = qf * c + hf_rotate_half(qf) * s
    ko = kf * c + hf_rotate_half(kf) * s
    return qo.to(q.dtype), ko.to(k.dtype)


# ======================================================================================
# === gate: group RMSNorm with sigmoid gate (linear-attention output) ===
# ======================================================================================


def group_rms_norm_gate(x, gate, weight, *, num_groups=4, eps=1e-6, gate_layout="sbh"):
    """``x [B, S, H, d_head]`` viewed as ``[B, S, dim]`` is split into ``num_groups`` groups
    of ``dim/num_groups`` channels, each RMS-normalized on its own, scaled by ``weight``
    (``[dim]``, or ``[dim/num_groups]`` shared by all groups) and multiplied by
    ``sigmoid(gate)``. ``gate`` is ``[S, B, dim]`` (``"sbh"``) or ``[B, S, dim]``
    (``"bsh"``); the output has the gate's layout and x's dtype. Math in fp32."""
    B, S = x.shape[0], x.shape[1]
    dim = x[0, 0].numel() if x.numel() else math.prod(x.shape[2:])
    G = num_groups
    xf = x.float().reshape(B, S, G, dim // G)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float().reshape(-1, dim // G) if weight.numel() == dim else weight.float()
    y = (xf * rstd * w).reshape(B, S, dim)
    if gate_layout == "sbh":
        y = y.transpose(0, 1)
    return (y * torch.sigmoid(gate.float())).to(x.dtype).contiguous()
