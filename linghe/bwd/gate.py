"""Backward kernel of group RMSNorm with sigmoid gate.

Nothing but the inputs is saved: the per-group rstd is recomputed from ``x``, which the
backward reads anyway. With ``n = xhat * w`` and ``sig = sigmoid(gate)``:
``dgate = dy * n * sig * (1 - sig)``, ``dn = dy * sig``, ``dw = sum(dn * xhat)``,
``dx = rstd * (dn*w - xhat * mean_group(dn*w*xhat))``.

A persistent grid (``PROGRAMS_PER_SM`` programs per SM) walks token blocks, prefetching the
next block's loads before the current block's math; each program keeps its weight-gradient
partial in float32 registers and writes it once; the partials
``[P, len(weight)]`` are summed in float32 afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fwd.gate import gate_blocks, gate_tile, gate_token_strides
from ..utils import cdiv, device_guard, empty, launch, num_sms
from .resident import learn_resident, resident_programs, sum_partials_tall

#: Persistent programs per SM before the kernel's fit is known (knob: more hides latency,
#: but each adds a float32 partial of the weight gradient that is written and summed); after
#: the first launch, what fits an SM (register use), at most ``MAX_PROGRAMS_PER_SM``.
PROGRAMS_PER_SM = 3
MAX_PROGRAMS_PER_SM = 6


@triton.jit
def _load_tile_bwd(x_ptr, gate_ptr, dy_ptr, blk, T, S, G, C, sxb, sxs, sgb, sgs, syb, sys,
                   SHARED_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """Raw (input dtype) x, gate and dy of token block ``blk`` (all masked off past T)."""
    b, s, offs, _, mask = gate_tile(blk, T, S, G, C, SHARED_W, BLOCK_T, BLOCK_G, BLOCK_C)
    x = tl.load(x_ptr + (b * sxb + s * sxs)[:, None] + offs, mask=mask, other=0.0)
    gt = tl.load(gate_ptr + (b * sgb + s * sgs)[:, None] + offs, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + (b * syb + s * sys)[:, None] + offs, mask=mask, other=0.0)
    return x, gt, dy


@triton.jit
def _group_rms_norm_gate_bwd_kernel(x_ptr, gate_ptr, w_ptr, dy_ptr, dx_ptr, dg_ptr, dw_ptr,
                                    T, S, G, C, sxb, sxs, sgb, sgs, syb, sys, sdxb, sdxs,
                                    sdgb, sdgs, eps, SHARED_W: tl.constexpr,
                                    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                                    BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    nblk = tl.cdiv(T, BLOCK_T)
    _, _, offs, woffs, wmask = gate_tile(pid * 0, T, S, G, C, SHARED_W, BLOCK_T, BLOCK_G,
                                         BLOCK_C)
    w = tl.load(w_ptr + woffs, mask=wmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_G, BLOCK_C], dtype=tl.float32)
    # Software prefetch: the loads of the next block are issued before the math and the
    # stores of the current one, so each program keeps two blocks of loads in flight.
    x_raw, gt_raw, dy_raw = _load_tile_bwd(x_ptr, gate_ptr, dy_ptr, pid, T, S, G, C, sxb,
                                           sxs, sgb, sgs, syb, sys, SHARED_W, BLOCK_T,
                                           BLOCK_G, BLOCK_C)
    for blk in range(pid, nblk, P):
        cur = blk + pid * 0
        xn, gn, dyn = _load_tile_bwd(x_ptr, gate_ptr, dy_ptr, cur + P, T, S, G, C, sxb, sxs,
                                     sgb, sgs, syb, sys, SHARED_W, BLOCK_T, BLOCK_G, BLOCK_C)
        b, s, offs, woffs, mask = gate_tile(cur, T, S, G, C, SHARED_W, BLOCK_T, BLOCK_G,
                                            BLOCK_C)
        x = x_raw.to(tl.float32)
        gt = gt_raw.to(tl.float32)
        dy = dy_raw.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / C + eps)
        xhat = x * rstd[:, None]
        sig = tl.sigmoid(gt)
        dn = dy * sig
        dg = dy * (xhat * w) * sig * (1.0 - sig)
        acc += dn * xhat
        gw = dn * w
        cc = tl.sum(gw * xhat, axis=1) / C
        dx = (gw - xhat * cc[:, None]) * rstd[:, None]
        tl.store(dx_ptr + (b * sdxb + s * sdxs)[:, None] + offs,
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + (b * sdgb + s * sdgs)[:, None] + offs,
                 dg.to(dg_ptr.dtype.element_ty), mask=mask)
        x_raw, gt_raw, dy_raw = xn, gn, dyn
    c = tl.arange(0, BLOCK_C)
    if SHARED_W:
        tl.store(dw_ptr + pid * C + c, tl.sum(acc, axis=0), mask=c < C)
    else:
        acc3 = tl.reshape(acc, [BLOCK_T, BLOCK_G, BLOCK_C])
        g = tl.arange(0, BLOCK_G)
        tl.store(dw_ptr + pid * (G * C) + g[:, None] * C + c[None, :], tl.sum(acc3, axis=0),
                 mask=(g < G)[:, None] & (c < C)[None, :])


def group_rms_norm_gate_bwd(dy, x3, gate, weight, *, num_groups, eps, gate_layout):
    """``dy`` contiguous in the gate's layout. Returns ``(dx3 [B, S, dim], dgate, dweight)``:
    ``dx3`` contiguous in x's dtype, ``dgate`` contiguous like the gate, ``dweight`` from
    float32 per-program partials summed in float32, in the weight's dtype."""
    B, S, dim = x3.shape
    G, C = num_groups, dim // num_groups
    T = B * S
    dx = empty(x3.shape, dtype=x3.dtype, device=x3.device)
    dg = empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if T == 0 or dim == 0:
        return dx, dg, torch.zeros_like(weight)
    # One token (2048 elements at the standard shape) per block, 4 warps: small register
    # tiles so that PROGRAMS_PER_SM programs (each with two blocks in flight) stay resident.
    BT, BG, BC, nw = gate_blocks(G, C, elems=2048)
    shared_w = weight.numel() != dim
    key = ("gate_bwd", x3.device.index, x3.dtype, gate.dtype, weight.dtype, shared_w, BT, BG,
           BC, nw)
    P = max(1, min(cdiv(T, BT), num_sms(x3.device) * resident_programs(key, PROGRAMS_PER_SM)))
    partial = empty(P, weight.numel(), dtype=torch.float32, device=x3.device)
    sgb, sgs = gate_token_strides(gate, gate_layout)
    syb, sys = gate_token_strides(dy, gate_layout)
    sdgb, sdgs = gate_token_strides(dg, gate_layout)
    with device_guard(x3):
        ck = launch(_group_rms_norm_gate_bwd_kernel, (P,),
            x3, gate, weight, dy, dx, dg, partial, T, S, G, C, x3.stride(0), x3.stride(1),
            sgb, sgs, syb, sys, dx.stride(0), dx.stride(1), sdgb, sdgs, eps,
            SHARED_W=shared_w, BLOCK_T=BT, BLOCK_G=BG, BLOCK_C=BC, num_warps=nw)
    learn_resident(key, ck, nw, MAX_PROGRAMS_PER_SM)
    return dx, dg, sum_partials_tall(partial, weight.dtype)
