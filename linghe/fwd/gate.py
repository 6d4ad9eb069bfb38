"""Forward kernel of group RMSNorm with sigmoid gate (linear-attention output), with the
``[B, S] -> [S, B]`` transpose fused into the store when the gate is ``"sbh"``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import device_guard, empty, next_power_of_2


@triton.jit
def group_tile(G, C, SHARED_W: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Offsets ``[BLOCK_G, BLOCK_C]`` of a token's channels (``g*C + c``), of the weight
    (``c`` when shared by the groups) and the mask."""
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_C)
    mask = (g < G)[:, None] & (c < C)[None, :]
    offs = g[:, None] * C + c[None, :]
    if SHARED_W:
        woffs = c[None, :] + g[:, None] * 0
    else:
        woffs = offs
    return offs, woffs, mask


@triton.jit
def _group_rms_norm_gate_fwd_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, S, G, C, sxb, sxs, sgb,
                                    sgs, syb, sys, eps, SHARED_W: tl.constexpr,
                                    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # token in x order: t = b * S + s
    b = t // S
    s = t - b * S
    offs, woffs, mask = group_tile(G, C, SHARED_W, BLOCK_G, BLOCK_C)
    x = tl.load(x_ptr + b * sxb + s * sxs + offs, mask=mask, other=0.0).to(tl.float32)
    gt = tl.load(gate_ptr + b * sgb + s * sgs + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + woffs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / C + eps)
    y = x * rstd[:, None] * w * tl.sigmoid(gt)
    tl.store(y_ptr + b * syb + s * sys + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def gate_blocks(G: int, C: int):
    """(BLOCK_G, BLOCK_C, num_warps) for a token of ``G`` groups of ``C`` channels."""
    BLOCK_G, BLOCK_C = next_power_of_2(G), next_power_of_2(max(C, 1))
    n = BLOCK_G * BLOCK_C
    num_warps = 2 if n <= 1024 else 4 if n <= 4096 else 8 if n <= 8192 else 16
    return BLOCK_G, BLOCK_C, num_warps


def gate_token_strides(t: torch.Tensor, layout: str):
    """(stride_b, stride_s) of a ``[S, B, dim]`` ("sbh") or ``[B, S, dim]`` tensor."""
    if layout == "sbh":
        return t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1)


def group_rms_norm_gate_fwd(x3, gate, weight, *, num_groups, eps, gate_layout):
    """``x3 [B, S, dim]`` (last dim contiguous). Returns ``y`` contiguous in the gate's
    layout and x's dtype."""
    B, S, dim = x3.shape
    G, C = num_groups, dim // num_groups
    y = empty(gate.shape, dtype=x3.dtype, device=x3.device)
    if B * S == 0 or dim == 0:
        return y
    BG, BC, nw = gate_blocks(G, C)
    sgb, sgs = gate_token_strides(gate, gate_layout)
    syb, sys = gate_token_strides(y, gate_layout)
    with device_guard(x3):
        _group_rms_norm_gate_fwd_kernel[(B * S,)](
            x3, gate, weight, y, S, G, C, x3.stride(0), x3.stride(1), sgb, sgs, syb, sys, eps,
            SHARED_W=weight.numel() != dim, BLOCK_G=BG, BLOCK_C=BC, num_warps=nw)
    return y
