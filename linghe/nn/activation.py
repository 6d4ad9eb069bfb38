"""``SwiGLU``: the bias-free gated MLP (no math here: it calls ``linghe.silu_mul``)."""

from __future__ import annotations

import torch
from torch import nn

from ..functional.activation import silu_mul

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """``down_proj(silu_mul(gate_up_proj(x)))``: a bias-free SwiGLU MLP.

    Args:
        hidden_size: input/output features ``H``.
        intermediate_size: ``I``.
        device, dtype: for the parameters.

    Parameters: ``gate_up_proj`` (``nn.Linear(H, 2I)``, weight ``[2I, H]`` with the gate
    rows first, then the up rows) and ``down_proj`` (``nn.Linear(I, H)``). Input
    ``[..., H]`` → output ``[..., H]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, **fk)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
