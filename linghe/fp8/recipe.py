"""FP8 training recipes: how activations, weights and gradients are quantized for GEMMs.

- ``blockwise`` (DeepSeek-V3): activations and gradients in 1x128 groups, weights in
  128x128 blocks, e4m3 everywhere, power-of-two scales by default.
- ``tensorwise``: one current scale per tensor (amax of this tensor now), e4m3 forward,
  e5m2 gradients.
- ``delayed``: one scale per tensor from an amax history (``history_len`` steps, reduced
  with ``amax_compute``, ``margin`` powers of two of headroom), the current amaxes reduced
  across ``amax_group`` once per step; e4m3 forward, e5m2 gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .delayed import DelayedScalingState
from .quantize import quantize_1x128, quantize_1x128_launch, quantize_128x128
from .tensor import Fp8Tensor
from .tensorwise import quantize_tensorwise

RECIPES = ("blockwise", "tensorwise", "delayed")
AMAX_COMPUTE = ("max", "most_recent")


@dataclass(frozen=True)
class Fp8Recipe:
    """An FP8 training recipe (immutable; :class:`linghe.TrainingContext` builds it).

    ``state`` is the delayed recipe's amax bookkeeping (``None`` otherwise); it is shared
    by every use of the recipe, so it lives as long as the context that made it.
    """

    name: str
    pow2_scale: bool = True
    fp8_wgrad: bool = True
    history_len: int = 16
    amax_compute: str = "max"
    margin: float = 0
    expert_fp8_wgrad: bool = False
    expert_fp8: bool = True
    lm_head_fp8: bool = False
    amax_group: Any = field(default=None, compare=False)
    state: DelayedScalingState | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"fp8 recipe must be None or one of {RECIPES}, got {self.name!r}")
        for opt in ("pow2_scale", "fp8_wgrad", "expert_fp8_wgrad", "expert_fp8",
                    "lm_head_fp8"):
            if not isinstance(getattr(self, opt), bool):
                raise ValueError(f"{opt} must be a bool, got {getattr(self, opt)!r}")
        hl = self.history_len
        if isinstance(hl, bool) or not isinstance(hl, int) or hl < 1:
            raise ValueError(f"history_len must be an int >= 1, got {hl!r}")
        if self.amax_compute not in AMAX_COMPUTE:
            raise ValueError(f"amax_compute must be one of {AMAX_COMPUTE}, got "
                             f"{self.amax_compute!r}")
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not m >= 0:
            raise ValueError(f"margin must be a number >= 0, got {m!r}")
        if self.lm_head_fp8 and self.name != "blockwise":
            raise ValueError("lm_head_fp8 needs the 'blockwise' recipe (1x128 activations "
                             f"and gradients, 128x128 weights), got fp8={self.name!r}")
        if self.amax_group is not None and self.name != "delayed":
            raise ValueError("amax_group is used only by the 'delayed' recipe, got it with "
                             f"fp8={self.name!r}")
        if self.name == "delayed" and self.state is None:
            object.__setattr__(self, "state", DelayedScalingState(
                self.history_len, self.amax_compute, self.margin, self.amax_group))

    # ------------------------------------------------------------------ formats
    @property
    def fp8_experts(self) -> bool:
        """Whether the routed experts' grouped GEMMs run FP8 under this recipe: blockwise
        only, and ``expert_fp8`` (else they stay in the input's precision)."""
        return self.name == "blockwise" and self.expert_fp8

    @property
    def fp8_lm_head(self) -> bool:
        """Whether :func:`linghe.linear_cross_entropy` runs its logits (fprop) and hidden
        gradient (dgrad) GEMMs in FP8 under this recipe (``lm_head_fp8``; blockwise only)."""
        return self.name == "blockwise" and self.lm_head_fp8

    @property
    def act_scaling(self) -> str:
        """Scaling of activations and gradients (``"1x128"`` or ``"tensor"``)."""
        return "1x128" if self.name == "blockwise" else "tensor"

    @property
    def weight_scaling(self) -> str:
        """Scaling of weights (``"128x128"`` or ``"tensor"``)."""
        return "128x128" if self.name == "blockwise" else "tensor"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.name == "blockwise" else torch.float8_e5m2

    # ------------------------------------------------------------------ quantizers
    def quantize_input(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False,
                       key=None, grad: bool = False) -> Fp8Tensor:
        """Quantize an activation (``grad=False``) or a gradient (``grad=True``) ``[..., K]``
        for this recipe. ``key`` names the tensor's amax slot (delayed recipe only)."""
        dt = self.grad_dtype if grad else self.fwd_dtype
        if self.name == "blockwise":
            return quantize_1x128(x, rowwise=rowwise, columnwise=columnwise,
                                  pow2_scale=self.pow2_scale)
        if self.name == "tensorwise":
            return quantize_tensorwise(x, fp8_dtype=dt, rowwise=rowwise, columnwise=columnwise,
                                       pow2_scale=self.pow2_scale)
        return self.state.quantize(x, key, fp8_dtype=dt, rowwise=rowwise,
                                   columnwise=columnwise)

    def quantize_input_parts(self, x2: torch.Tensor, *, rowwise: bool = True,
                             columnwise: bool = False, key=None, grad: bool = False):
        """:meth:`quantize_input` of ``x2 [M, K]`` (last dim contiguous) as raw components
        ``(q, s, qt, st, scaling)`` (``None`` for copies not asked for), for linghe's own
        layers: no :class:`Fp8Tensor` wrapper, and blockwise scales stored group-major
        (the layout cuBLAS reads: no re-layout copy per GEMM; see
        :func:`~linghe.fp8.quantize.empty_1x128`)."""
        if self.name == "blockwise":
            return (*quantize_1x128_launch(x2, rowwise, columnwise, self.pow2_scale, True),
                    "1x128")
        t = self.quantize_input(x2, rowwise=rowwise, columnwise=columnwise, key=key,
                                grad=grad)
        return (t.rowwise_data, t.rowwise_scale, t.columnwise_data, t.columnwise_scale,
                t.scaling)

    def quantize_weight(self, w: torch.Tensor, *, key=None) -> Fp8Tensor:
        """Quantize a weight ``[N, K]`` with both copies (rowwise for fprop, columnwise
        ``[K, N]`` for dgrad)."""
        if self.name == "blockwise":
            return quantize_128x128(w, columnwise=True, pow2_scale=self.pow2_scale)
        return self.quantize_input(w, rowwise=True, columnwise=True, key=key)

    def accepts(self, t: Fp8Tensor, *, grad: bool = False) -> bool:
        """Whether an :class:`Fp8Tensor` input already has this recipe's format."""
        dt = self.grad_dtype if grad else self.fwd_dtype
        data = t.rowwise_data if t.rowwise_data is not None else t.columnwise_data
        return t.scaling == self.act_scaling and data.dtype == dt
