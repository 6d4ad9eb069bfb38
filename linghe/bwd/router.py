"""Router backward kernels: router GEMM grads (fp32-exact), top-k routing, z-loss.

- ``router_logits``: ``dx = dlogits @ W`` (dx in x's dtype) and ``dW = dlogits^T @ x``
  (fp32), both through :func:`linghe.fwd.router.matmul_exact` (bf16 part splitting, no
  TF32); ``dW`` splits the token dimension over programs and sums the partial products in a
  deterministic second pass.
- ``topk_route``: one program per block of rows recomputes the scores from the logits and
  back-propagates ``dprobs`` through the scale, the normalization and softmax/sigmoid
  (selection has no gradient).
- ``router_z_loss``: ``dlogits = g * 2 * lse / T * softmax(logits)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fwd.router import _rows_per_prog, matmul_exact
from ..utils import cdiv, device_guard, empty, empty_like, next_power_of_2

#: Part-product order of ``dx`` when x is bf16/fp16: 1 (default) sums ``dl_hi*W_hi +
#: dl_mid*W_hi + dl_hi*W_mid`` (error ~2^-16, far under the bf16 output's rounding); 0 is
#: a single bf16 GEMM ``bf16(dl) @ bf16(W)`` (error ~ one bf16 ulp, 1/3 of the flops for an
#: fp32 weight). A float32 ``x`` always gets order 2 (fp32-exact).
DX_ORDER = 1


def router_logits_bwd(dlogits: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                      need_dx: bool = True, need_dw: bool = True):
    """``dlogits [T, E]`` fp32, ``x2 [T, K]``, ``weight [E, K]`` -> ``(dx [T, K] x.dtype,
    dw [E, K] fp32)`` (``None`` where not needed)."""
    dx_order = 2 if x2.dtype == torch.float32 else DX_ORDER
    dx = matmul_exact(dlogits, weight, x2.dtype, order=dx_order) if need_dx else None
    # fp32 weight: fp32-exact dw (ORDER 2); a bf16/fp16 weight gets its gradient in its own
    # dtype, so bf16-level accuracy (ORDER 1: 2 passes instead of 3) is enough there.
    order = 2 if weight.dtype == torch.float32 else 1
    dw = matmul_exact(dlogits.t(), x2, torch.float32, order=order) if need_dw else None
    return dx, dw


@triton.jit
def _topk_bwd_kernel(logits_ptr, ids_ptr, dp_ptr, dl_ptr, T, E, stride_l, scale,
                     ROWS: tl.constexpr, K_TOP: tl.constexpr, BE: tl.constexpr,
                     SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr):
    pid = tl.program_id(0)
    eb = tl.arange(0, BE)
    emask = eb < E
    for i in range(ROWS):
        t = pid.to(tl.int64) * ROWS + i
        rv = (eb * 0 + t) < T
        x = tl.load(logits_ptr + t * stride_l + eb, mask=emask & rv,
                    other=float("-inf")).to(tl.float32)
        if SIGMOID:
            s = tl.where(emask, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        else:
            mx = tl.max(x, axis=0)
            ex = tl.where(emask, tl.exp(x - mx), 0.0)
            s = ex / tl.sum(ex, axis=0)
        gv = tl.zeros([BE], dtype=tl.float32)
        selm = eb < 0
        for j in range(K_TOP):
            tj = tl.minimum(t, T - 1) * K_TOP + j
            e = tl.load(ids_ptr + tj)
            g = tl.load(dp_ptr + tj)
            hit = (eb == e) & rv
            gv = tl.where(hit, g, gv)
            selm = selm | hit
        p = tl.where(selm, s, 0.0)
        if NORMALIZE:
            S = tl.sum(p, axis=0)
            d = tl.sum(gv * p, axis=0) / S
            ds = tl.where(selm, scale * (gv - d) / S, 0.0)
        else:
            ds = tl.where(selm, scale * gv, 0.0)
        if SIGMOID:
            dl = ds * s * (1.0 - s)
        else:
            dl = s * (ds - tl.sum(ds * s, axis=0))
        tl.store(dl_ptr + t * stride_l + eb, dl.to(dl_ptr.dtype.element_ty), mask=emask & rv)


def topk_route_bwd(dprobs: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                   sigmoid: bool, normalize: bool, scale: float) -> torch.Tensor:
    """``dlogits [T, E]`` (logits' dtype, contiguous) from ``dprobs [T, k]`` fp32."""
    T, E = logits.shape
    k = ids.shape[1]
    dl = empty(T, E, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return dl
    ROWS = _rows_per_prog(T, logits.device)
    BE = next_power_of_2(E)
    with device_guard(logits):
        _topk_bwd_kernel[(cdiv(T, ROWS),)](
            logits, ids, dprobs, dl, T, E, E, float(scale), ROWS=ROWS, K_TOP=k, BE=BE,
            SIGMOID=sigmoid, NORMALIZE=normalize, num_warps=1 if BE <= 512 else 4)
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
        _zloss_bwd_kernel[(cdiv(T, ROWS),)](
            logits, lse, g.reshape(1).float().contiguous(), dl, T, E, logits.stride(0),
            1.0 / T, ROWS=ROWS, BE=BE, num_warps=1 if BE <= 512 else 4)
    return dl
