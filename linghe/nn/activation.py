"""``SwiGLU``: the bias-free gated MLP (no math here: it calls ``linghe.silu_mul``)."""

from __future__ import annotations

import torch
from torch import nn

from ..context import current_recipe
from ..functional.activation import silu_mul, silu_mul_quant
from .linear import Linear

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """``down_proj(silu_mul(gate_up_proj(x)))``: a bias-free SwiGLU MLP.

    Args:
        hidden_size: input/output features ``H``.
        intermediate_size: ``I``.
        device, dtype: for the parameters.

    Parameters: ``gate_up_proj`` (``linghe.nn.Linear(H, 2I)``, weight ``[2I, H]`` with the
    gate rows first, then the up rows) and ``down_proj`` (``linghe.nn.Linear(I, H)``); same
    ``state_dict`` as with ``torch.nn.Linear``. Input ``[..., H]`` → output ``[..., H]``.

    Outside an FP8 ``linghe.TrainingContext`` it is plain bf16/fp32 math. Inside one the
    projections run FP8 GEMMs; under the blockwise recipe the activation is
    :func:`linghe.silu_mul_quant` (SwiGLU fused with 1x128 quantization), whose
    :class:`~linghe.Fp8Tensor` ``down_proj`` consumes without re-quantizing.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, **fk)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        recipe = current_recipe()
        if recipe is not None and recipe.name == "blockwise":
            a = silu_mul_quant(h, columnwise=recipe.fp8_wgrad and torch.is_grad_enabled(),
                               pow2_scale=recipe.pow2_scale)
        else:
            a = silu_mul(h)
        return self.down_proj(a)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
