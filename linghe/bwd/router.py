"""Router backward kernels: router GEMM grads (fp32-exact), top-k routing, z-loss.

- ``router_logits``: ``dx = dlogits @ W`` (dx in x's dtype) and ``dW = dlogits^T @ x``
  (fp32), both through :func:`linghe.fwd.router.matmul_parts` (bf16 parts, no TF32):
  ``dlogits`` is split into its bf16 parts once (shared by both GEMMs), ``W``'s parts come
  from the forward; ``dW`` splits the token dimension over programs and sums the fp32
  partials in a deterministic second pass.
- ``topk_route``: one program per block of rows recomputes the scores from the logits and
  back-propagates ``dprobs`` through the scale, the normalization and softmax/sigmoid
  (selection has no gradient).
- ``router_z_loss``: ``dlogits = g * 2 * lse / T * softmax(logits)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fwd.router import CONFIG, _rows_per_prog, matmul_parts, split_parts
from ..utils import INTERPRET, cdiv, device_guard, empty, empty_like, launch, next_power_of_2

#: Part-product order of ``dx`` when x is bf16/fp16: 0 (default) is a single bf16 GEMM
#: ``bf16(dl) @ bf16(W)`` (relative error ~2e-3, the size of the bf16 output's own rounding;
#: 1/3 of the flops of order 1: this GEMM is most of the backward's time); 1 sums
#: ``dl_hi*W_hi + dl_mid*W_hi + dl_hi*W_mid`` (error ~2^-16). A float32 ``x`` always gets
#: order 2 (fp32-exact).
DX_ORDER = 0


def router_logits_bwd(dlogits: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                      need_dx: bool = True, need_dw: bool = True,
                      w_parts: torch.Tensor | None = None):
    """``dlogits [T, E]`` fp32, ``x2 [T, K]``, ``weight [E, K]`` -> ``(dx [T, K] x.dtype,
    dw [E, K] fp32)`` (``None`` where not needed). ``w_parts``: the forward's
    :func:`linghe.fwd.router.weight_parts` of ``weight`` (split here when absent)."""
    dx_order = 2 if x2.dtype == torch.float32 else DX_ORDER
    # fp32 weight: fp32-exact dw (ORDER 2); a bf16/fp16 weight gets its gradient in its own
    # dtype, so bf16-level accuracy (ORDER 1: 2 passes instead of 3) is enough there.
    dw_order = 2 if weight.dtype == torch.float32 else 1
    dl_parts = max(dx_order + 1 if need_dx else 0, dw_order + 1 if need_dw else 0)
    if dl_parts == 0:
        return None, None
    dlp = split_parts(dlogits, dl_parts)
    dx = dw = None
    if need_dx:
        wp = split_parts(weight, dx_order + 1) if w_parts is None else w_parts
        dx = matmul_parts(dlp, wp, x2.dtype, dx_order, config=CONFIG["dx"])
    if need_dw:
        dw = matmul_parts(dlp.transpose(1, 2), split_parts(x2, dw_order + 1), torch.float32,
                          dw_order, config=CONFIG["dw"])
    return dx, dw


@triton.jit
def _topk_bwd_kernel(logits_ptr, ids_ptr, dp_ptr, dl_ptr, T, E, stride_l, scale,
                     BT: tl.constexpr, K_TOP: tl.constexpr, BK: tl.constexpr,
                     BE: tl.constexpr, SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr):
    # a [BT, E] tile of rows per program; the rows' ids/dprobs are loaded once as [BT, k]
    # vectors (no dependent scalar loads)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BT + tl.arange(0, BT)
    rmask = rows < T
    eb = tl.arange(0, BE)
    emask = eb < E
    m2 = rmask[:, None] & emask[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_l + eb[None, :], mask=m2,
                other=float("-inf")).to(tl.float32)
    if SIGMOID:
        s = tl.where(m2, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        mx = tl.where(rmask, tl.max(x, axis=1), 0.0)
        ex = tl.where(m2, tl.exp(x - mx[:, None]), 0.0)
        s = ex / tl.sum(ex, axis=1)[:, None]
    kk = tl.arange(0, BK)
    mk = rmask[:, None] & (kk < K_TOP)[None, :]
    ids2 = tl.load(ids_ptr + rows[:, None] * K_TOP + kk[None, :], mask=mk, other=-1)
    g2 = tl.load(dp_ptr + rows[:, None] * K_TOP + kk[None, :], mask=mk, other=0.0)
    gv = tl.zeros([BT, BE], dtype=tl.float32)
    selc = tl.zeros([BT, BE], dtype=tl.int32)
    for j in range(K_TOP):
        e_j = tl.sum(tl.where(kk[None, :] == j, ids2, 0), axis=1)
        g_j = tl.sum(tl.where(kk[None, :] == j, g2, 0.0), axis=1)
        hit = (eb[None, :] == e_j[:, None]) & m2
        gv = tl.where(hit, g_j[:, None], gv)
        selc = selc + hit.to(tl.int32)
    selm = selc > 0
    p = tl.where(selm, s, 0.0)
    if NORMALIZE:
        S = tl.sum(p, axis=1)[:, None]
        if K_TOP == 1:
            # p / S == 1 identically: exactly zero gradient (gv - gv keeps NaN/Inf); the
            # general formula leaves GPU rounding noise (approximate fp32 division)
            ds = tl.where(selm, scale * (gv - gv) / S, 0.0)
        else:
            d = tl.sum(gv * p, axis=1)[:, None] / S
            ds = tl.where(selm, scale * (gv - d) / S, 0.0)
    else:
        ds = tl.where(selm, scale * gv, 0.0)
    if SIGMOID:
        dl = ds * s * (1.0 - s)
    else:
        dl = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    tl.store(dl_ptr + rows[:, None] * stride_l + eb[None, :], dl.to(dl_ptr.dtype.element_ty),
             mask=m2)


def topk_route_bwd(dprobs: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                   sigmoid: bool, normalize: bool, scale: float) -> torch.Tensor:
    """``dlogits [T, E]`` (logits' dtype, contiguous) from ``dprobs [T, k]`` fp32."""
    T, E = logits.shape
    k = ids.shape[1]
    dl = empty(T, E, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return dl
    BE = next_power_of_2(E)
    BT = max(1, (512 if INTERPRET else 2048) // BE)
    nw = 4 if BT * BE <= 4096 else 8
    with device_guard(logits):
        launch(_topk_bwd_kernel, (cdiv(T, BT),),
            logits, ids, dprobs, dl, T, E, E, float(scale), BT=BT, K_TOP=k,
            BK=next_power_of_2(k), BE=BE, SIGMOID=sigmoid, NORMALIZE=normalize, num_warps=nw)
    return dl


@triton.jit
def _zloss_bwd_kernel(logits_ptr, lse_ptr, g_ptr, dl_ptr, T, E, stride_l, inv_t,
                      ROWS: tl.constexpr, BE: tl.constexpr):
    pid = tl.program_id(0)
    eb = tl.arange(0, BE)
    g = tl.load(g_ptr).to(tl.float32)
    for i in range(ROWS):
        t = pid.to(tl.int64) * ROWS + i
        rv = (eb * 0 + t) < T
        lse = tl.load(lse_ptr + tl.minimum(t, T - 1))
        c = g * 2.0 * lse * inv_t
        for e0 in range(0, E, BE):
            m = (e0 + eb < E) & rv
            x = tl.load(logits_ptr + t * stride_l + e0 + eb, mask=m, other=0.0).to(tl.float32)
            d = c * tl.exp(x - lse)
            tl.store(dl_ptr + t * E + e0 + eb, d.to(dl_ptr.dtype.element_ty), mask=m)


def router_z_loss_bwd(g: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    T, E = logits.shape
    dl = empty_like(logits) if logits.is_contiguous() else empty(T, E, dtype=logits.dtype,
                                                                   device=logits.device)
    if T == 0:
        return dl
    ROWS = _rows_per_prog(T, logits.device)
    BE = min(next_power_of_2(max(E, 1)), 4096)
    with device_guard(logits):
        launch(_zloss_bwd_kernel, (cdiv(T, ROWS),),
            logits, lse, g if g.dtype == torch.float32 else g.float(), dl, T, E, logits.stride(0),
            1.0 / T, ROWS=ROWS, BE=BE, num_warps=1 if BE <= 512 else 4)
    return dl
