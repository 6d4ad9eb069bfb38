"""FP8 delayed-scaling bookkeeping: per-tensor amax history and quantization scales."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..utils import cdiv, device_guard, empty, launch, next_power_of_2


@triton.jit
def _amax_update_kernel(hist_ptr, scale_ptr, n, L, fp8_max, pow2_margin,
                        MOST_RECENT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns ``[pid*BLOCK_N, ...)``: new scale from the history, then roll the history
    down one row (``hist[i+1] = hist[i]``, row 0 = 0)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = cols < n
    amax = tl.load(hist_ptr + cols, mask=m, other=0.0)
    if not MOST_RECENT:
        for r in range(1, L):
            v = tl.load(hist_ptr + r * n + cols, mask=m, other=0.0)
            amax = tl.maximum(amax, v, propagate_nan=tl.PropagateNan.ALL)
    prev = tl.load(scale_ptr + cols, mask=m, other=1.0)
    s = tl.div_rn(tl.div_rn(tl.zeros_like(amax) + fp8_max, amax), tl.zeros_like(amax) + pow2_margin)
    # amax 0 / negative / NaN / Inf, or a scale that overflowed: keep the previous scale
    good = (amax > 0.0) & (amax < float("inf")) & (s < float("inf"))
    tl.store(scale_ptr + cols, tl.where(good, s, prev), mask=m)
    for j in range(0, L - 1):
        i = L - 1 - j
        v = tl.load(hist_ptr + (i - 1) * n + cols, mask=m, other=0.0)
        tl.store(hist_ptr + i * n + cols, v, mask=m)
    tl.store(hist_ptr + cols, tl.zeros_like(amax), mask=m)


class AmaxHistory:
    """Amax history and quantization scales of ``num_tensors`` FP8-cast tensors (delayed
    scaling).

    Buffers (float32, on ``device``):

    * ``amax_history [history_len, num_tensors]``: row 0 is the current step's amaxes, being
      recorded with :meth:`record`; rows 1.. are older steps (row i = i steps ago).
    * ``scale [num_tensors]``: the *quantization* scale, ``x_fp8 = x * scale``, initially 1.

    :meth:`update` (once per step, after every :meth:`record`): all-reduces row 0 (MAX) over
    ``group`` in one collective, then one fused kernel computes every scale,
    ``scale = (fp8_max / amax) / 2**margin`` with ``amax`` = max over all rows
    (``amax_compute="max"``) or row 0 (``"most_recent"``), keeping the previous scale where
    amax is 0 or non-finite (or the scale would overflow), and rolls the history
    (``new[i+1] = old[i]``, the oldest row drops out, row 0 becomes 0).

    A plain class (not an ``nn.Module``): :meth:`state_dict` / :meth:`load_state_dict`
    round-trip the buffers and settings (``load_state_dict`` copies into the existing
    buffers, so references to ``amax_history``/``scale`` stay valid). No host syncs.
    """

    def __init__(self, num_tensors: int, history_len: int = 16, *, amax_compute: str = "max",
                 margin: float = 0, fp8_max: float = 448.0, device=None):
        if not isinstance(num_tensors, int) or isinstance(num_tensors, bool) or num_tensors < 0:
            raise ValueError(f"num_tensors must be an int >= 0, got {num_tensors!r}")
        if not isinstance(history_len, int) or isinstance(history_len, bool) or history_len < 1:
            raise ValueError(f"history_len must be an int >= 1, got {history_len!r}")
        if amax_compute not in ("max", "most_recent"):
            raise ValueError(f"amax_compute must be 'max' or 'most_recent', got {amax_compute!r}")
        if not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise ValueError(f"margin must be a finite number, got {margin!r}")
        if not isinstance(fp8_max, (int, float)) or not math.isfinite(fp8_max) or fp8_max <= 0:
            raise ValueError(f"fp8_max must be a finite number > 0, got {fp8_max!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        self.num_tensors = num_tensors
        self.history_len = history_len
        self.amax_compute = amax_compute
        self.margin = margin
        self.fp8_max = float(fp8_max)
        self.amax_history = torch.zeros(history_len, num_tensors, dtype=torch.float32,
                                        device=device)
        self.scale = torch.ones(num_tensors, dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def record(self, index: int, amax: torch.Tensor) -> None:
        """``amax_history[0, index] = max(amax_history[0, index], amax)`` on the device
        (``amax``: a one-element tensor, any float dtype; NaN propagates)."""
        if not isinstance(index, int) or isinstance(index, bool) or not (
                0 <= index < self.num_tensors):
            raise ValueError(f"index must be an int in [0, {self.num_tensors}), got {index!r}")
        if not isinstance(amax, torch.Tensor) or amax.numel() != 1:
            raise TypeError("amax must be a one-element torch.Tensor")
        if amax.device != self.device:
            raise ValueError(f"amax is on {amax.device} but the history is on {self.device}")
        row = self.amax_history[0, index:index + 1]
        torch.maximum(row, amax.detach().reshape(1).to(torch.float32), out=row)

    def update(self, group=None) -> None:
        """All-reduce the current amaxes (MAX) over ``group`` (one collective; skipped when
        ``group`` is None), recompute every scale and roll the history (one kernel)."""
        if group is not None:
            torch.distributed.all_reduce(self.amax_history[0], op=torch.distributed.ReduceOp.MAX,
                                         group=group)
        n = self.num_tensors
        if n == 0:
            return
        block = min(1024, max(16, next_power_of_2(n)))
        with device_guard(self.scale):
            launch(_amax_update_kernel, (cdiv(n, block),),
                self.amax_history, self.scale, n, self.history_len, self.fp8_max,
                float(2.0 ** self.margin), MOST_RECENT=self.amax_compute == "most_recent",
                BLOCK_N=block, num_warps=4)

    def state_dict(self) -> dict:
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone(),
                "amax_compute": self.amax_compute, "margin": self.margin,
                "fp8_max": self.fp8_max}

    def load_state_dict(self, state: dict) -> None:
        h, s = state["amax_history"], state["scale"]
        if tuple(s.shape) != (self.num_tensors,):
            raise ValueError(f"state['scale'] has shape {tuple(s.shape)}, expected "
                             f"({self.num_tensors},)")
        if h.dim() != 2 or h.shape[1] != self.num_tensors:
            raise ValueError(f"state['amax_history'] has shape {tuple(h.shape)}, expected "
                             f"(*, {self.num_tensors})")
        if h.shape[0] != self.history_len:
            self.history_len = h.shape[0]
            self.amax_history = empty(h.shape, dtype=torch.float32, device=self.device)
        self.amax_history.copy_(h)
        self.scale.copy_(s)
        self.amax_compute = state.get("amax_compute", self.amax_compute)
        self.margin = state.get("margin", self.margin)
        self.fp8_max = float(state.get("fp8_max", self.fp8_max))

    def __repr__(self) -> str:
        return (f"AmaxHistory(num_tensors={self.num_tensors}, history_len={self.history_len}, "
                f"amax_compute={self.amax_compute!r}, margin={self.margin}, "
                f"fp8_max={self.fp8_max}, device={self.device})")
