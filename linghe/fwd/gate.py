"""Forward kernel of group RMSNorm with sigmoid gate (linear-attention output), with the
``[B, S] -> [S, B]`` transpose fused into the store when the gate is ``"sbh"``.

A program works on a tile of ``BLOCK_T`` tokens x ``BLOCK_G`` groups (rows) by
``BLOCK_C`` channels (columns); each row is one (token, group) and is normalized on its own.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..bwd.resident import learn_resident, resident_programs
from ..utils import cdiv, device_guard, empty, launch, next_power_of_2, num_sms


@triton.jit
def gate_tile(blk, T, S, G, C, SHARED_W: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows of token block ``blk``: ``(b, s)`` per row (int64, x order ``t = b*S + s``),
    channel offsets ``g*C + c``, weight offsets (``c`` when shared) and the mask."""
    r = tl.arange(0, BLOCK_T * BLOCK_G)
    g = r % BLOCK_G
    t = blk.to(tl.int64) * BLOCK_T + r // BLOCK_G
    b = t // S
    s = t - b * S
    c = tl.arange(0, BLOCK_C)
    mask = ((t < T) & (g < G))[:, None] & (c < C)[None, :]
    offs = g[:, None] * C + c[None, :]
    if SHARED_W:
        woffs = c[None, :] + g[:, None] * 0
    else:
        woffs = offs
    return b, s, offs, woffs, mask


@triton.jit
def _group_rms_norm_gate_fwd_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, T, S, G, C, sxb, sxs,
                                    sgb, sgs, syb, sys, eps, SHARED_W: tl.constexpr,
                                    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                                    BLOCK_C: tl.constexpr):
    b, s, offs, woffs, mask = gate_tile(tl.program_id(0), T, S, G, C, SHARED_W, BLOCK_T,
                                        BLOCK_G, BLOCK_C)
    x = tl.load(x_ptr + (b * sxb + s * sxs)[:, None] + offs, mask=mask,
                other=0.0).to(tl.float32)
    gt = tl.load(gate_ptr + (b * sgb + s * sgs)[:, None] + offs, mask=mask,
                 other=0.0).to(tl.float32)
    w = tl.load(w_ptr + woffs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / C + eps)
    y = x * rstd[:, None] * w * tl.sigmoid(gt)
    tl.store(y_ptr + (b * syb + s * sys)[:, None] + offs, y.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _load_tile_fwd(x_ptr, gate_ptr, blk, T, S, G, C, sxb, sxs, sgb, sgs,
                   SHARED_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """Raw (input dtype) x and gate of token block ``blk`` (masked off past T)."""
    b, s, offs, _, mask = gate_tile(blk, T, S, G, C, SHARED_W, BLOCK_T, BLOCK_G, BLOCK_C)
    x = tl.load(x_ptr + (b * sxb + s * sxs)[:, None] + offs, mask=mask, other=0.0)
    gt = tl.load(gate_ptr + (b * sgb + s * sgs)[:, None] + offs, mask=mask, other=0.0)
    return x, gt


@triton.jit
def _group_rms_norm_gate_fwd_persistent_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, T, S, G, C,
                                               sxb, sxs, sgb, sgs, syb, sys, eps,
                                               SHARED_W: tl.constexpr, BLOCK_T: tl.constexpr,
                                               BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Persistent variant: the weight is loaded once per program, and the next block's
    loads are issued before the current block's math and store (two blocks in flight)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    nblk = tl.cdiv(T, BLOCK_T)
    _, _, _, woffs, wmask = gate_tile(pid * 0, T, S, G, C, SHARED_W, BLOCK_T, BLOCK_G,
                                      BLOCK_C)
    w = tl.load(w_ptr + woffs, mask=wmask, other=0.0).to(tl.float32)
    x_raw, g_raw = _load_tile_fwd(x_ptr, gate_ptr, pid, T, S, G, C, sxb, sxs, sgb, sgs,
                                  SHARED_W, BLOCK_T, BLOCK_G, BLOCK_C)
    for blk in range(pid, nblk, P):
        cur = blk + pid * 0
        xn, gn = _load_tile_fwd(x_ptr, gate_ptr, cur + P, T, S, G, C, sxb, sxs, sgb, sgs,
                                SHARED_W, BLOCK_T, BLOCK_G, BLOCK_C)
        b, s, offs, _, mask = gate_tile(cur, T, S, G, C, SHARED_W, BLOCK_T, BLOCK_G, BLOCK_C)
        x = x_raw.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / C + eps)
        y = x * rstd[:, None] * w * tl.sigmoid(g_raw.to(tl.float32))
        tl.store(y_ptr + (b * syb + s * sys)[:, None] + offs, y.to(y_ptr.dtype.element_ty),
                 mask=mask)
        x_raw, g_raw = xn, gn


#: Use the persistent, prefetching forward (knob: False = one program per token block).
FWD_PERSISTENT = True
#: Persistent forward programs per SM before the kernel's fit is known, and the cap after.
FWD_PROGRAMS_PER_SM = 4
FWD_MAX_PROGRAMS_PER_SM = 16

@functools.cache  # per-shape decision, cached (host time)
def gate_blocks(G: int, C: int, elems: int = 2048):
    """(BLOCK_T, BLOCK_G, BLOCK_C, num_warps): tiles of about ``elems`` elements (at least
    one whole token)."""
    BLOCK_G, BLOCK_C = next_power_of_2(G), next_power_of_2(max(C, 1))
    BLOCK_T = max(1, elems // (BLOCK_G * BLOCK_C))
    n = BLOCK_T * BLOCK_G * BLOCK_C
    num_warps = 2 if n <= 1024 else 4 if n <= 2048 else 8 if n <= 8192 else 16
    return BLOCK_T, BLOCK_G, BLOCK_C, num_warps


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
    T = B * S
    y = empty(gate.shape, dtype=x3.dtype, device=x3.device)
    if T == 0 or dim == 0:
        return y
    BT, BG, BC, nw = gate_blocks(G, C)
    sgb, sgs = gate_token_strides(gate, gate_layout)
    syb, sys = gate_token_strides(y, gate_layout)
    shared_w = weight.numel() != dim
    if FWD_PERSISTENT:
        key = ("gate_fwd", x3.device.index, x3.dtype, weight.dtype, shared_w, BT, BG, BC, nw)
        P = max(1, min(cdiv(T, BT), num_sms(x3.device) * resident_programs(key,
                                                                     FWD_PROGRAMS_PER_SM)))
        with device_guard(x3):
            ck = launch(_group_rms_norm_gate_fwd_persistent_kernel, (P,),
                x3, gate, weight, y, T, S, G, C, x3.stride(0), x3.stride(1), sgb, sgs, syb,
                sys, eps, SHARED_W=shared_w, BLOCK_T=BT, BLOCK_G=BG, BLOCK_C=BC,
                num_warps=nw)
        learn_resident(key, ck, nw, FWD_MAX_PROGRAMS_PER_SM)
        return y
    with device_guard(x3):
        launch(_group_rms_norm_gate_fwd_kernel, (cdiv(T, BT),),
            x3, gate, weight, y, T, S, G, C, x3.stride(0), x3.stride(1), sgb, sgs, syb, sys,
            eps, SHARED_W=weight.numel() != dim, BLOCK_T=BT, BLOCK_G=BG, BLOCK_C=BC,
            num_warps=nw)
    return y
