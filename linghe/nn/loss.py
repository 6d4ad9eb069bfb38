"""Loss modules over :mod:`linghe.functional.loss` (no math here)."""

from __future__ import annotations

import torch

from ..functional.loss import cross_entropy


class CrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`linghe.cross_entropy`: ``forward(logits [N, V], labels [N])``.

    See :func:`linghe.cross_entropy` for the options; ``inplace_backward=True`` overwrites
    the logits with their gradient during backward.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, z_loss: float = 0.0,
                 inplace_backward: bool = False, process_group=None):
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.inplace_backward = inplace_backward
        self.process_group = process_group

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, labels, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             z_loss=self.z_loss, inplace_backward=self.inplace_backward,
                             process_group=self.process_group)

    def extra_repr(self) -> str:
        s = (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
             f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
             f"inplace_backward={self.inplace_backward}")
        if self.process_group is not None:
            s += ", vocab_parallel=True"
        return s
