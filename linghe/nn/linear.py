"""``linghe.nn.Linear``: ``torch.nn.Linear`` that runs FP8 GEMMs inside a TrainingContext."""

from __future__ import annotations

import torch

from ..context import current_recipe
from ..functional.linear import WeightCache, fp8_linear


class Linear(torch.nn.Linear):
    """Drop-in ``torch.nn.Linear`` (same constructor, parameters, ``state_dict`` and repr).

    Outside a :class:`linghe.TrainingContext` (or inside one with ``fp8=None``) its forward
    is exactly ``torch.nn.Linear``'s. Inside an FP8 context it runs
    :func:`linghe.functional.linear.fp8_linear` with the active recipe: the input is
    quantized (or taken as is when it is already an :class:`~linghe.Fp8Tensor` in the
    recipe's format), the weight is quantized once per optimizer step (cached until the
    weight changes in place or is replaced) and forward and backward GEMMs run in FP8.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._fp8_weight_cache = WeightCache()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        recipe = current_recipe()
        if recipe is None:
            return super().forward(input)
        return fp8_linear(input, self.weight, self.bias, recipe,
                          cache=self._fp8_weight_cache, owner=id(self))

    def _apply(self, fn, *args, **kwargs):
        self._fp8_weight_cache.clear()
        return super()._apply(fn, *args, **kwargs)
