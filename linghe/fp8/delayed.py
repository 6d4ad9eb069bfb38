"""Delayed scaling: per-tensor FP8 scales from an amax history, updated once per step.

:class:`DelayedScalingState` hands every quantized tensor of a model (a Linear's input,
weight and output gradient) a slot in an amax history, records each step's amax there and,
once per step (:meth:`DelayedScalingState.update`, called when a ``TrainingContext`` exits),
reduces the current amaxes across the recipe's ``amax_group`` and recomputes the scales.
Forward tensors (e4m3, max 448) and gradients (e5m2, max 57344) keep separate histories.

The history itself is ``linghe.optim.AmaxHistory`` (fused all-reduce + scale recompute +
roll). Until that lands on this branch, :class:`_TorchAmaxHistory` implements the same API
in plain PyTorch; :data:`_AMAX_HISTORY` is the one line to swap.
"""

from __future__ import annotations

from typing import Any

import torch

from .tensor import Fp8Tensor
from .tensorwise import FP8_MAX, quantize_tensorwise


class _TorchAmaxHistory:
    """Private stand-in for ``linghe.optim.AmaxHistory`` (same constructor, buffers and
    methods), in plain PyTorch. ``scale`` is the *quantization* scale (``x_fp8 = x *
    scale``), ``amax_history [history_len, n]`` has the current step in row 0."""

    def __init__(self, num_tensors: int, history_len: int = 16, *, amax_compute: str = "max",
                 margin: float = 0, fp8_max: float = 448.0, device=None):
        self.num_tensors = num_tensors
        self.history_len = history_len
        self.amax_compute = amax_compute
        self.margin = margin
        self.fp8_max = fp8_max
        self.amax_history = torch.zeros(history_len, num_tensors, dtype=torch.float32,
                                        device=device)
        self.scale = torch.ones(num_tensors, dtype=torch.float32, device=device)

    def record(self, index: int, amax: torch.Tensor) -> None:
        row = self.amax_history[0]
        row[index] = torch.maximum(row[index], amax.float().reshape(()))

    def update(self, group=None) -> None:
        if group is not None:
            import torch.distributed as dist

            cur = self.amax_history[0].clone()
            dist.all_reduce(cur, op=dist.ReduceOp.MAX, group=group)
            self.amax_history[0].copy_(cur)
        if self.amax_compute == "max":
            amax = self.amax_history.amax(dim=0)
        else:
            amax = self.amax_history[0]
        new = self.fp8_max / amax / (2.0 ** self.margin)
        ok = (amax > 0) & torch.isfinite(amax)
        self.scale.copy_(torch.where(ok, new, self.scale))
        self.amax_history.copy_(torch.roll(self.amax_history, 1, dims=0))
        self.amax_history[0].zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.amax_history.copy_(sd["amax_history"])
        self.scale.copy_(sd["scale"])


# TODO(lead): once linghe.optim lands, swap to `from ..optim import AmaxHistory` here.
_AMAX_HISTORY = _TorchAmaxHistory


def _new_history(num_tensors, history_len, amax_compute, margin, fp8_max, device):
    return _AMAX_HISTORY(num_tensors, history_len, amax_compute=amax_compute, margin=margin,
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
