"""Delayed scaling: per-tensor FP8 scales from an amax history, updated once per step.

:class:`DelayedScalingState` hands every quantized tensor of a model (a Linear's input,
weight and output gradient) a slot in an amax history, records each step's amax there and,
once per step (:meth:`DelayedScalingState.update`, called when a ``TrainingContext`` exits),
reduces the current amaxes across the recipe's ``amax_group`` and recomputes the scales.
Forward tensors (e4m3, max 448) and gradients (e5m2, max 57344) keep separate histories.

The history itself is ``linghe.optim.AmaxHistory`` (one all-reduce, then one fused kernel
for the scale recompute and the roll).
"""

from __future__ import annotations

from typing import Any

import torch

from .tensor import Fp8Tensor
from .tensorwise import FP8_MAX, quantize_tensorwise


def _new_history(num_tensors, history_len, amax_compute, margin, fp8_max, device):
    # Imported here: linghe.optim imports linghe.fp8 (avoid a cycle at import time).
    from ..optim import AmaxHistory

    return AmaxHistory(num_tensors, history_len, amax_compute=amax_compute, margin=margin,
                       fp8_max=fp8_max, device=device)


class DelayedScalingState:
    """Slot registry and amax histories of the ``delayed`` recipe (one per
    ``TrainingContext``; see the module docstring).

    Slots are keyed by any hashable (``linghe.nn.Linear`` uses ``(id(module), role)``) and
    are created on first use; the histories grow (copying their contents) while new
    tensors appear during the first step. A slot that has never been through an update
    uses the current amax (current scaling) so the first step never saturates.
    """

    def __init__(self, history_len: int, amax_compute: str, margin: float, group=None):
        self.history_len = history_len
        self.amax_compute = amax_compute
        self.margin = margin
        self.group = group
        self._slots: dict[Any, dict[torch.dtype, int]] = {}
        self._count: dict[torch.dtype, int] = {}
        self._hist: dict[torch.dtype, Any] = {}
        self._ready: dict[torch.dtype, int] = {}  # slots below this index went through update
        self.steps = 0

    # ------------------------------------------------------------------ slots
    def _slot(self, key, fp8_dtype, device) -> int:
        per = self._slots.setdefault(key, {})
        if fp8_dtype in per:
            return per[fp8_dtype]
        idx = self._count.get(fp8_dtype, 0)
        per[fp8_dtype] = idx
        self._count[fp8_dtype] = idx + 1
        hist = self._hist.get(fp8_dtype)
        if hist is None or hist.scale.numel() <= idx:
            cap = max(16, 2 * (idx + 1))
            new = _new_history(cap, self.history_len, self.amax_compute, self.margin,
                               FP8_MAX[fp8_dtype], device)
            if hist is not None:
                n = hist.scale.numel()
                new.amax_history[:, :n].copy_(hist.amax_history)
                new.scale[:n].copy_(hist.scale)
            self._hist[fp8_dtype] = new
        return idx

    def history(self, fp8_dtype=torch.float8_e4m3fn):
        """The amax-history object for ``fp8_dtype`` tensors (``None`` before first use)."""
        return self._hist.get(fp8_dtype)

    # ------------------------------------------------------------------ use
    def quantize(self, x: torch.Tensor, key, *, fp8_dtype: torch.dtype, rowwise: bool = True,
                 columnwise: bool = False) -> Fp8Tensor:
        """Quantize ``x`` with its slot's delayed scale and record its amax."""
        idx = self._slot(key, fp8_dtype, x.device)
        hist = self._hist[fp8_dtype]
        amax = torch.empty(1, dtype=torch.float32, device=x.device)
        scale = None
        if idx < self._ready.get(fp8_dtype, 0):
            scale = 1.0 / hist.scale[idx]
        t = quantize_tensorwise(x, fp8_dtype=fp8_dtype, rowwise=rowwise,
                                columnwise=columnwise, scale=scale, amax_out=amax)
        hist.record(idx, amax)
        return t

    def record(self, key, amax: torch.Tensor, fp8_dtype=torch.float8_e4m3fn) -> None:
        """Record an amax for ``key`` without quantizing (e.g. a cached weight)."""
        idx = self._slot(key, fp8_dtype, amax.device)
        self._hist[fp8_dtype].record(idx, amax)

    def update(self) -> None:
        """Reduce this step's amaxes across ``group`` (MAX) and recompute the scales."""
        for dt in sorted(self._hist, key=str):
            self._hist[dt].update(group=self.group)
            self._ready[dt] = self._count[dt]
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "ready": {str(k): v for k, v in self._ready.items()},
                "histories": {str(k): h.state_dict() for k, h in self._hist.items()}}
