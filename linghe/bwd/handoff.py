"""A gradient's FP8 copy handed from one autograd node's backward to the next one's.

An op whose backward needs the 1x128 rowwise FP8 copy of its output's gradient would
quantize that gradient itself: one more pass over it. When the op that consumes the
output can make the copy more cheaply (``unpermute``'s backward quantizes the ``T`` token
rows of its incoming gradient and moves them with the bf16 copies, where quantizing the
expert rows costs a pass over ``T * k`` rows), the producer attaches a
:class:`Fp8GradHandoff` to its output; the consumer's backward offers its result with the
copy; the producer's backward takes the copy only if the gradient it receives is that very
tensor. Any other gradient (the output had a second consumer, so autograd summed two
gradients; it was viewed or reshaped on the way) finds nothing, and the producer
quantizes as before: the hand-off changes where the copy is made, never its value.
"""

from __future__ import annotations

import torch

_ATTR = "_linghe_fp8_grad_handoff"


class Fp8GradHandoff:
    """The rowwise 1x128 FP8 copy of one tensor's gradient, in transit.

    ``pow2_scale``: the scales the producer asks for. :meth:`offer` stores the gradient
    and its copy ``(data, scale)`` (``scale [rows, cdiv(cols, 128)]`` fp32); :meth:`take`
    returns the copy for that same gradient object only, and forgets it."""

    __slots__ = ("pow2_scale", "_grad", "_copy")

    def __init__(self, pow2_scale: bool):
        self.pow2_scale = bool(pow2_scale)
        self._grad = None
        self._copy = None

    def offer(self, grad: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
        self._grad, self._copy = grad, (data, scale)

    def take(self, grad: torch.Tensor):
        """``(data, scale)`` when ``grad`` is the offered gradient, else ``None``."""
        copy = self._copy if grad is self._grad else None
        self._grad = self._copy = None
        return copy


def attach(output: torch.Tensor, handoff: Fp8GradHandoff) -> None:
    """Ask the op that consumes ``output`` for its gradient's FP8 copy."""
    setattr(output, _ATTR, handoff)


def requested(t: torch.Tensor) -> Fp8GradHandoff | None:
    """The hand-off attached to ``t`` (an op's input), if its producer asked for one."""
    return getattr(t, _ATTR, None)
