"""``linghe.nn.RMSNorm``: a drop-in for ``torch.nn.RMSNorm`` over the last dimension."""

from __future__ import annotations

import torch

from ..context import current_recipe
from ..functional.norm import rms_norm, rms_norm_quant


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension, ``y = x * rsqrt(mean(x^2) + eps) * weight``.

    Like ``torch.nn.RMSNorm(hidden_size, eps=eps)``: one parameter ``weight [hidden_size]``
    initialized to ones, so state dicts load either way. Calls :func:`linghe.rms_norm`.

    Inside ``linghe.TrainingContext(fp8="blockwise")`` the forward returns
    :func:`linghe.rms_norm_quant`'s :class:`~linghe.Fp8Tensor` (1x128 e4m3, the recipe's
    ``pow2_scale``; the columnwise copy too when FP8 wgrad will need it), which a following
    :class:`linghe.nn.Linear` consumes without re-quantizing. Set ``quantize_output =
    False`` on a norm whose output does not feed an FP8 Linear (e.g. the final norm before
    a high-precision LM head; other ops would see the dequantized values).

    ``forward(x, residual)`` is the pre-norm block's residual add fused in: ``h = x +
    residual`` (rounded to ``x``'s dtype, as ``x + residual`` is) is normalized and ``(y,
    h)`` returned, ``h`` being the new residual stream. One kernel reads both and writes
    ``h`` and ``y``; in the backward the gradient arriving at ``h`` is added inside the
    norm's backward kernel instead of by autograd. Under the blockwise recipe (quantized
    output) the forward's add is a separate ``x + residual`` kernel, the backward's is
    fused the same way (:func:`linghe.rms_norm_quant`'s ``residual``).
    """

    #: Return an Fp8Tensor under the blockwise recipe (plain attribute, not in state_dict).
    quantize_output: bool = True

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        if isinstance(hidden_size, (tuple, list, torch.Size)):
            if len(hidden_size) != 1:
                raise ValueError("hidden_size must be an int (RMSNorm over the last "
                                 f"dimension only), got {tuple(hidden_size)}")
            hidden_size = hidden_size[0]
        if int(hidden_size) < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(
            torch.empty(self.hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        recipe = current_recipe()
        if recipe is not None and recipe.name == "blockwise" and self.quantize_output:
            return rms_norm_quant(x, self.weight, self.eps,
                                  columnwise=recipe.fp8_wgrad and torch.is_grad_enabled(),
                                  pow2_scale=recipe.pow2_scale, residual=residual)
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
