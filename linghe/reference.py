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


def group_amax(x: torch.Tensor, dim) -> torch.Tensor:
    """``max |x|`` over ``dim``, NaN elements ignored (as CUDA's ``fmaxf``, which the
    kernels' reductions compile to): a NaN element quantizes to NaN, the rest of its group
    as if it were absent. (A group of NaN only gets amax 0 here, scale 1; the kernels
    give it a NaN scale, 0 with power-of-two scales. Its data is NaN either way.)"""
    a = x.abs()
    return torch.where(a.isnan(), torch.zeros_like(a), a).amax(dim=dim)


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
    scale = fp8_scale(group_amax(xf, -1), pow2_scale)
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
    scale = fp8_scale(group_amax(blocks, (1, 3)), pow2_scale)
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
    segs = expert_segments(tokens_per_expert, align)
    xf = x.float() if x.dtype != torch.float64 else x
    real = real_rows(segs, x.shape[0], x.device)
    xm = torch.where(real[:, None], xf, torch.zeros((), dtype=xf.dtype, device=x.device))
    pf = None
    if probs is not None:
        pf = probs.float() if probs.dtype != torch.float64 else probs
        pf = torch.where(real, pf, torch.zeros((), dtype=pf.dtype, device=x.device))
    return quantize_grouped_1x128(silu_mul(xm, pf), tokens_per_expert, align, pow2_scale)


def real_rows(segs, num_rows: int, device) -> torch.Tensor:
    """``[num_rows]`` bool: the real rows of the segments ``segs`` (from
    :func:`expert_segments`), False on padding and tail rows."""
    real = torch.zeros(num_rows, dtype=torch.bool, device=device)
    for start, c, _ in segs:
        real[start:start + c] = True
    return real


def quantize_grouped_1x128(y: torch.Tensor, tokens_per_expert, align: int,
                           pow2_scale: bool = False):
    """1x128 quantization of rows grouped by expert ``y [R, n]`` (padding and tail rows
    are taken as zeros whatever ``y`` holds), the columnwise groups per segment: returns
    ``(q [R, n], scale [R, cdiv(n,128)], q_t [n, R], scale_t [n, G], col_group_offsets
    [E+1])`` as :func:`batch_silu_mul_quant` describes (``G = cdiv(R,128) + E``)."""
    R, n = y.shape
    segs = expert_segments(tokens_per_expert, align)
    real = real_rows(segs, R, y.device)
    y = torch.where(real[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    q, s = quantize_1x128(y, pow2_scale)
    E = len(segs)
    G = math.ceil(R / BLOCK) + E
    q_t = torch.zeros(n, R, dtype=FP8_DTYPE, device=y.device)
    s_t = torch.ones(n, G, dtype=torch.float32, device=y.device)
    g_off = [0]
    for start, _, padded in segs:
        if padded:
            qe, se = quantize_1x128_columnwise(y[start:start + padded], pow2_scale)
            q_t[:, start:start + padded] = qe
            s_t[:, g_off[-1]:g_off[-1] + se.shape[1]] = se
        g_off.append(g_off[-1] + math.ceil(padded / BLOCK))
    # tail rows: zeros, scale 1 (already)
    return q, s, q_t, s_t, torch.tensor(g_off, dtype=torch.int32, device=y.device)


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


def segment_col_group(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows]`` int64: the columnwise scale group of each row when groups follow
    segments (``offsets [E + 1]``): expert ``e``'s rows ``offsets[e] + 128 i ..`` are group
    ``g_off[e] + i`` (``g_off`` = exclusive cumsum of ``ceil(segment / 128)``), the rows
    from ``offsets[E]`` on are groups ``g_off[E] + (r - offsets[E]) // 128``. Device ops
    only (no host sync)."""
    off = offsets.to(torch.int64)
    r = torch.arange(num_rows, device=off.device)
    e = torch.searchsorted(off[1:].contiguous(), r, right=True)  # E for the tail rows
    ntile = torch.div(off[1:] - off[:-1] + BLOCK - 1, BLOCK, rounding_mode="floor")
    g_off = torch.cat([ntile.new_zeros(1), ntile.cumsum(0)])
    return g_off[e] + torch.div(r - off[e], BLOCK, rounding_mode="floor")


def dequantize_segment_columnwise(q_t: torch.Tensor, scale_t: torch.Tensor,
                                  offsets: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Columnwise copy whose 1x128 groups follow segments (``offsets [E + 1]``, see
    :func:`segment_col_group`): ``[n, R]`` fp8 + ``[n, G]`` scales → ``[n, R]`` (not
    transposed back). Same values as :func:`dequantize_batch_columnwise`, on the device."""
    g = segment_col_group(offsets, q_t.shape[1]).clamp(max=max(scale_t.shape[1] - 1, 0))
    return (q_t.float() * scale_t.float()[:, g]).to(dtype)
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
# router: FP32 router GEMM, top-k routing (softmax / sigmoid, bias, groups), z-loss
# ======================================================================================


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight[E, K]^T`` computed in float64 from the given values, returned
    as float32 ``[..., E]`` (what an fp32-exact kernel must match to ~1e-7)."""
    return (x.double() @ weight.double().t()).float()


def _group_mask(sel: torch.Tensor, score: str, num_groups: int, topk_groups: int):
    T, E = sel.shape
    g = sel.view(T, num_groups, E // num_groups)
    if score == "sigmoid":
        gs = g.topk(min(2, E // num_groups), dim=-1).values.sum(-1)
    else:
        gs = g.amax(-1)
    keep = gs.topk(topk_groups, dim=-1).indices
    mask = torch.zeros(T, num_groups, dtype=torch.bool, device=sel.device)
    mask.scatter_(1, keep, True)
    return mask.repeat_interleave(E // num_groups, dim=1)


def topk_route(logits: torch.Tensor, k: int, score: str = "softmax",
               expert_bias: torch.Tensor | None = None, num_groups: int = 1,
               topk_groups: int = 1, normalize: bool = True, scale: float = 1.0):
    """Top-k routing (DeepSeek-V3 style). ``logits [T, E]`` -> ``(probs [T, k] fp32,
    expert_ids [T, k] int32, tokens_per_expert [E] int32)``.

    ``s = softmax(logits)`` or ``sigmoid(logits)`` (in float32); the selection score is
    ``s + expert_bias`` (bias affects selection only). With ``num_groups > 1`` experts are in
    ``num_groups`` contiguous groups; a group's score is the sum of its top-2 selection
    scores (sigmoid) or its max (softmax); only the ``topk_groups`` best groups are eligible.
    Ids are sorted by selection score, descending. ``probs = s[ids]`` (divided by their sum
    when ``normalize``) times ``scale``.
    """
    s = torch.softmax(logits.float(), -1) if score == "softmax" else torch.sigmoid(logits.float())
    sel = s.detach() if expert_bias is None else s.detach() + expert_bias.float()
    if num_groups > 1:
        sel = sel.masked_fill(~_group_mask(sel, score, num_groups, topk_groups), float("-inf"))
    ids = sel.topk(k, dim=-1).indices
    p = s.gather(1, ids)
    if normalize:
        p = p / p.sum(-1, keepdim=True)
    p = p * scale
    tpe = torch.bincount(ids.flatten(), minlength=logits.shape[1]).to(torch.int32)
    return p, ids.to(torch.int32), tpe


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits[t])^2`` (float32 scalar; 0 for no tokens)."""
    lf = logits.float().reshape(-1, logits.shape[-1])
    if lf.shape[0] == 0:
        return lf.sum()
    return (torch.logsumexp(lf, -1) ** 2).mean()


# ======================================================================================
# permute: MoE rows grouped by expert, padded by index (see linghe/layout.py)
# ======================================================================================


def permute(x: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor | None = None,
            num_experts: int = 1, align: int = 16, num_rows: int | None = None):
    """Rows grouped by expert (stable: token order within an expert), each segment padded
    with zero rows to a multiple of ``align``; tail rows zero. Out-of-range ids dropped.
    Returns ``(rows [num_rows, H], probs_rows [num_rows] | None, row_index [T, k] int64,
    offsets [E + 1], tokens_per_expert [E])``."""
    T, k = expert_ids.shape
    E = num_experts
    if num_rows is None:
        num_rows = T * k + E * (align - 1)
    ids = expert_ids.long().flatten()
    valid = (ids >= 0) & (ids < E)
    counts = torch.bincount(ids[valid], minlength=E)
    padded = (counts + align - 1) // align * align
    offsets = torch.zeros(E + 1, dtype=torch.long, device=x.device)
    offsets[1:] = torch.cumsum(padded, 0)
    key = torch.where(valid, ids, E)
    order = torch.argsort(key, stable=True)
    sorted_e = key[order]
    nv = int(valid.sum())
    starts = torch.zeros(E + 1, dtype=torch.long, device=x.device)
    starts[1:] = torch.cumsum(counts, 0)
    rank = torch.arange(nv, device=x.device) - starts[sorted_e[:nv]]
    rows_of = torch.full((T * k,), -1, dtype=torch.long, device=x.device)
    rows_of[order[:nv]] = offsets[sorted_e[:nv]] + rank
    rows_of = torch.where(rows_of < num_rows, rows_of, -1)
    ok = rows_of >= 0
    tok = torch.arange(T * k, device=x.device) // max(k, 1)
    rows = x.new_zeros(num_rows, x.shape[1])
    rows = rows.index_add(0, rows_of[ok], x[tok[ok]])
    prow = None
    if probs is not None:
        prow = probs.new_zeros(num_rows).index_add(0, rows_of[ok], probs.flatten()[ok])
    return rows, prow, rows_of.view(T, k), offsets, counts


def unpermute(rows: torch.Tensor, row_index: torch.Tensor, probs: torch.Tensor | None = None,
              residual: torch.Tensor | None = None):
    """``out[t] = sum_j probs[t, j] * rows[row_index[t, j]] + residual[t]`` (skipping
    ``-1``; no residual: 0), summed in float32, returned in ``rows``' dtype."""
    T, k = row_index.shape
    idx = row_index.long().flatten()
    ok = idx >= 0
    v = rows.float()[idx.clamp_min(0)]
    w = ok.float() if probs is None else probs.float().flatten() * ok
    tok = torch.arange(T * k, device=rows.device) // max(k, 1)
    out = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    out = out.index_add(0, tok, v * w[:, None])
    if residual is not None:
        out = out + residual.float()
    return out.to(rows.dtype)
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


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, maximize: bool = False,
               grad_coef: float | torch.Tensor = 1.0) -> None:
    """One AdamW step (decoupled weight decay), in place, computed in float64 and stored in
    each tensor's dtype. ``steps``: the step count of each tensor *after* this step (the
    bias corrections use it); ``grad_coef`` multiplies every gradient first (clipping)."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        g64 = g.double() * torch.as_tensor(grad_coef, dtype=torch.float64).to(g.device)
        if maximize:
            g64 = -g64
        p64 = p.double() * (1.0 - lr * weight_decay)
        m64 = beta1 * m.double() + (1.0 - beta1) * g64
        v64 = beta2 * v.double() + (1.0 - beta2) * g64 * g64
        bc1 = 1.0 - beta1 ** float(step)
        bc2 = 1.0 - beta2 ** float(step)
        p64 = p64 - (lr / bc1) * m64 / (v64.sqrt() / bc2 ** 0.5 + eps)
        p.copy_(p64)
        m.copy_(m64)
        v.copy_(v64)


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
# fp8_gemm: FP8 GEMMs of a linear layer (fprop X·W^T, dgrad dY·W, wgrad dY^T·X)
# ======================================================================================


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, scaling: str) -> torch.Tensor:
    """float32 value of FP8 data ``q [R, K]`` with scales in the ``scaling`` layout:
    ``"1x128"`` (``[R, ceil(K/128)]``), ``"128x128"`` (``[ceil(R/128), ceil(K/128)]``) or
    ``"tensor"`` (one scale)."""
    if scaling == "tensor":
        return q.float() * scale.float().reshape(())
    if scaling == "1x128":
        return dequantize_1x128(q, scale)
    if scaling == "128x128":
        return dequantize_128x128(q, scale)
    raise ValueError(f"unknown scaling {scaling!r}")


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             a_scaling: str = "1x128", b_scaling: str = "128x128",
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``C [M, N] = deq(A [M, K]) · deq(B [N, K])^T (+ bias)`` in float64, returned as float32.

    fprop: A = X rowwise, B = W rowwise; dgrad: A = dY rowwise, B = W columnwise;
    wgrad: A = dY columnwise, B = X columnwise (see ``linghe.fp8.gemm``)."""
    c = dequantize_fp8(a, a_scale, a_scaling).double() @ \
        dequantize_fp8(b, b_scale, b_scaling).double().t()
    if bias is not None:
        c = c + bias.double()
    return c.float()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """High-precision linear ``x·W^T + b`` (the unquantized spec of ``linghe.nn.Linear``)."""
    return torch.nn.functional.linear(x, weight, bias)
# === loss: cross entropy (+ label smoothing, z-loss, ignore_index), linear cross entropy ===


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0,
                  z_loss: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` in fp32 (float64 stays float64) plus ``z_loss * lse**2`` per row.

    Rows whose label is ``ignore_index`` or outside ``[0, V)`` are ignored (loss 0, no
    gradient). ``"mean"`` divides the sum by the number of non-ignored rows, and is 0 (not
    NaN) when every row is ignored. Returns fp32 (float64) scalar, or ``[N]`` for "none".
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    V = x.shape[-1]
    valid = (labels != ignore_index) & (labels >= 0) & (labels < V)
    lab = torch.where(valid, labels.long(), torch.full_like(labels.long(), -100))
    loss = torch.nn.functional.cross_entropy(x, lab, ignore_index=-100, reduction="none",
                                             label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(x, dim=-1)
        loss = loss + torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / valid.sum().clamp(min=1).to(total.dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0) -> torch.Tensor:
    """:func:`cross_entropy` of the full logits ``hidden @ weight.T (+ bias)`` (computed
    in the input dtype, as eager PyTorch would)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy(logits, labels, ignore_index, reduction, label_smoothing, z_loss)


class _Fp8LMHeadLogits(torch.autograd.Function):
    """``logits = dq(q_1x128(h)) · dq(q_128x128(W))^T`` rounded to ``h``'s dtype; backward
    ``dh = dq(q_1x128(dlogits)) · dq(q_128x128(W))`` and ``dW = dlogits^T · h``, with
    ``fp8_wgrad`` the product of both quantized 1x128 along the tokens (columnwise
    copies), else unquantized."""

    @staticmethod
    def forward(ctx, h, w, pow2_scale, fp8_wgrad):
        hd = dequantize_1x128(*quantize_1x128(h, pow2_scale), torch.float64)
        wd = dequantize_128x128(*quantize_128x128(w, pow2_scale), torch.float64)
        ctx.save_for_backward(h, wd)
        ctx.pow2_scale = pow2_scale
        ctx.fp8_wgrad = fp8_wgrad
        return (hd @ wd.T).to(h.dtype)

    @staticmethod
    def backward(ctx, d):
        h, wd = ctx.saved_tensors
        p2 = ctx.pow2_scale
        dd = dequantize_1x128(*quantize_1x128(d, p2), torch.float64)
        if ctx.fp8_wgrad:
            dt = dequantize_1x128(*quantize_1x128_columnwise(d, p2), torch.float64)
            ht = dequantize_1x128(*quantize_1x128_columnwise(h, p2), torch.float64)
            dw = dt @ ht.T
        else:
            dw = d.double().T @ h.double()
        return (dd @ wd).to(h.dtype), dw.to(h.dtype), None, None


def linear_cross_entropy_fp8(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             bias: torch.Tensor | None = None, ignore_index: int = -100,
                             reduction: str = "mean", label_smoothing: float = 0.0,
                             z_loss: float = 0.0, pow2_scale: bool = True,
                             fp8_wgrad: bool = False) -> torch.Tensor:
    """:func:`linear_cross_entropy` with the FP8 LM head (``TrainingContext(lm_head_fp8=
    True)``): the logits are the blockwise FP8 product of ``hidden`` quantized 1x128 and
    ``weight`` 128x128 (exact products, rounded once to the input dtype), the hidden
    gradient the FP8 product of the logits' gradient quantized 1x128 and the same weight;
    the weight gradient ``dlogits^T · hidden`` is, with ``fp8_wgrad`` (the recipe's, for a
    head without bias), the FP8 product of both quantized 1x128 along the tokens in
    128-token groups from the first row, else not quantized. (With a "mean"/"sum"
    reduction linghe quantizes the gradient of the loss itself and scales the GEMMs'
    results by ``grad_output`` afterwards; this spec quantizes the gradient as it arrives,
    so the two are equal for ``grad_output = 1``, and within FP8 rounding otherwise.)"""
    logits = _Fp8LMHeadLogits.apply(hidden, weight, pow2_scale, fp8_wgrad)
    if bias is not None:
        logits = logits + bias
    return cross_entropy(logits, labels, ignore_index, reduction, label_smoothing, z_loss)


# ======================================================================================
# === moe: routed SwiGLU experts (loop over experts) + shared experts ===
# ======================================================================================


def grouped_swiglu(rows: torch.Tensor, probs_rows: torch.Tensor | None,
                   gate_up: torch.Tensor, down: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    """The expert FFN of ``linghe.functional.moe.grouped_swiglu`` over rows grouped by
    expert (``offsets [E + 1]``): ``grouped_mm(silu_mul(grouped_mm(rows, gate_up),
    probs_rows), down)``, in the inputs' dtype (pass float64 for a high-precision spec)."""
    h = grouped_mm(rows, gate_up, offsets)
    return grouped_mm(silu_mul(h, probs_rows), down, offsets)


def moe(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor,
        down: torch.Tensor, top_k: int, *, score: str = "sigmoid",
        expert_bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
        shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None):
    """What :class:`linghe.nn.MoE` computes (unsharded), by a plain loop over experts.

    ``x [T, H]``; ``router_weight [E, H]``; ``gate_up [E, 2I, H]`` (gate rows first);
    ``down [E, H, I]``; optional shared SwiGLU weights ``[2Is, H]`` / ``[H, Is]``.
    ``out[t] = sum_j p[t,j] * down_e @ silu_mul(gate_up_e @ x[t])`` with ``(p, e)`` from
    :func:`topk_route` of :func:`router_logits`, each expert's SwiGLU computed in ``x``'s
    dtype per GEMM (fp32 math in silu_mul, the result rounded to ``x``'s dtype), plus the
    shared experts. Returns ``(out [T, H], logits, expert_ids, tokens_per_expert)``.
    """
    logits = router_logits(x, router_weight)
    probs, ids, tpe = topk_route(logits, top_k, score=score, expert_bias=expert_bias,
                                 num_groups=num_groups, topk_groups=topk_groups)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            # keep the expert's weights in the graph (zero gradient, like a grouped GEMM)
            out = out + 0 * (gate_up[e].sum() + down[e].sum()).float()
            continue
        h = x[t] @ gate_up[e].t()
        a = silu_mul(h, probs[t, j]).to(x.dtype)
        out = out.index_add(0, t, (a @ down[e].t()).float())
    if shared_gate_up is not None:
        out = out + (silu_mul(x @ shared_gate_up.t()).to(x.dtype) @ shared_down.t()).float()
    return out.to(x.dtype), logits, ids, tpe


# ======================================================================================
# === embedding: token embedding (row gather) and its weight gradient ===
# ======================================================================================


def embedding(tokens: torch.Tensor, weight: torch.Tensor,
              padding_idx: int | None = None) -> torch.Tensor:
    """``weight[tokens]`` (``F.embedding``) of ``tokens [...]`` int, ``weight [V, H]``:
    ``[..., H]`` in ``weight``'s dtype. An id outside ``[0, V)`` gives a zero row and no
    gradient (``F.embedding`` would raise); the ``padding_idx`` row (negative: counted
    from ``V``) is read as it is but gets no gradient. Differentiable: the weight's
    gradient is :func:`embedding_backward` in ``weight``'s dtype (pass float64 for the
    high-precision spec)."""
    V = weight.shape[0]
    valid = (tokens >= 0) & (tokens < V)
    out = torch.nn.functional.embedding(torch.where(valid, tokens, 0), weight,
                                        padding_idx=padding_idx)
    return torch.where(valid.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype,
                                                              device=out.device))


def embedding_backward(tokens: torch.Tensor, grad: torch.Tensor, num_embeddings: int,
                       padding_idx: int | None = None,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The weight gradient of :func:`embedding`: ``dW [V, H]`` in ``dtype`` with
    ``dW[v] = sum of grad[t] over tokens t == v`` (``index_add_`` in ``dtype``), zero for
    the ``padding_idx`` row, rows no token touches, and ids outside ``[0, V)``. linghe
    rounds this float64 sum once to the weight's dtype (``.float().to(dtype)``)."""
    V = num_embeddings
    ids = tokens.reshape(-1).long()
    g = grad.reshape(ids.shape[0], grad.shape[-1]).to(dtype)
    keep = (ids >= 0) & (ids < V)
    if padding_idx is not None:
        keep &= ids != (padding_idx + V if padding_idx < 0 else padding_idx)
    dw = torch.zeros(V, g.shape[1], dtype=dtype, device=grad.device)
    return dw.index_add_(0, ids[keep], g[keep])
