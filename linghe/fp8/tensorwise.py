"""Per-tensor FP8 quantization (the ``tensorwise`` and ``delayed`` recipes).

One float32 dequantization scale for the whole tensor. This is a handful of PyTorch ops
(an amax reduction, a scale, a saturating cast), not a fused kernel: per-tensor scaling is
the comparison recipe, the production path is the blockwise one.
"""

from __future__ import annotations

import torch

from .. import reference as ref
from .tensor import Fp8Tensor

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _cast(x2: torch.Tensor, deq_scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    fmax = FP8_MAX[fp8_dtype]
    # Saturate (a delayed scale may be stale); NaN stays NaN through clamp.
    return (x2.float() / deq_scale).clamp(-fmax, fmax).to(fp8_dtype)


def current_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, pow2_scale: bool = False,
                  margin: float = 0) -> torch.Tensor:
    """Dequantization scale ``amax / fp8_max * 2^margin`` (power-of-two round-up when
    ``pow2_scale``); amax 0 (or not finite) gives 1. ``amax`` is a float32 tensor."""
    amax = amax.float()
    s = amax / FP8_MAX[fp8_dtype] * (2.0 ** margin)
    if pow2_scale:
        s = ref.round_up_pow2(s)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, s, torch.ones_like(s))


def quantize_tensorwise(x: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                        rowwise: bool = True, columnwise: bool = False,
                        pow2_scale: bool = False, scale: torch.Tensor | None = None,
                        amax_out: torch.Tensor | None = None) -> Fp8Tensor:
    """Quantize ``x [..., K]`` with one scale.

    Args:
        x: float tensor; leading dims are flattened to ``M`` rows.
        fp8_dtype: ``float8_e4m3fn`` (max 448) or ``float8_e5m2`` (max 57344).
        rowwise / columnwise: which copies to produce; the columnwise copy ``[K, M]`` is the
            exact transpose of the rowwise one (same scale).
        pow2_scale: round the current scale up to a power of two.
        scale: a given float32 *dequantization* scale (delayed scaling: from the amax
            history); values beyond the FP8 range saturate. ``None``: current scaling
            (``amax / fp8_max``).
        amax_out: a 1-element float32 tensor that receives this tensor's amax (for an amax
            history).

    Returns an :class:`Fp8Tensor` with ``scaling="tensor"`` and a 1-element scale.
    """
    if fp8_dtype not in FP8_MAX:
        raise TypeError(f"fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    if not (rowwise or columnwise):
        raise ValueError("quantize_tensorwise needs rowwise=True or columnwise=True")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    amax = x2.abs().amax().float() if x2.numel() else torch.zeros((), device=x.device)
    if amax_out is not None:
        amax_out.copy_(amax.reshape(amax_out.shape))
    deq = current_scale(amax, fp8_dtype, pow2_scale) if scale is None else scale.float()
    deq = deq.reshape(1)
    q = _cast(x2, deq, fp8_dtype)
    return Fp8Tensor(x.shape, x.dtype,
                     rowwise_data=q if rowwise else None, rowwise_scale=deq if rowwise else None,
                     columnwise_data=q.t().contiguous() if columnwise else None,
                     columnwise_scale=deq if columnwise else None, scaling="tensor")
