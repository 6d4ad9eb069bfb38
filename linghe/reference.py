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


def unpermute(rows: torch.Tensor, row_index: torch.Tensor, probs: torch.Tensor | None = None):
    """``out[t] = sum_j probs[t, j] * rows[row_index[t, j]]`` (skipping ``-1``), summed in
    float32, returned in ``rows``' dtype."""
    T, k = row_index.shape
    idx = row_index.long().flatten()
    ok = idx >= 0
    v = rows.float()[idx.clamp_min(0)]
    w = ok.float() if probs is None else probs.float().flatten() * ok
    tok = torch.arange(T * k, device=rows.device) // max(k, 1)
    out = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    out = out.index_add(0, tok, v * w[:, None])
    return out.to(rows.dtype)
