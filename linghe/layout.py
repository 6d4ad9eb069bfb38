"""``ExpertLayout``: how rows grouped by expert sit in one buffer (MoE contract).

``permute`` (and the expert-parallel dispatcher) produce rows grouped by expert; the
per-expert kernels (``batch_silu_mul_quant``, grouped GEMMs) and ``unpermute`` consume
them. They share this description, held entirely in device tensors (no host sync):

- expert ``e``'s segment starts at row ``offsets[e]`` and spans
  ``padded_tokens_per_expert[e] = roundup(tokens_per_expert[e], align)`` rows: first its
  ``tokens_per_expert[e]`` real rows, then zero rows (padding by *index*: no activation
  is copied into a second padded buffer);
- ``offsets[E]`` is the number of rows in use; rows from there to ``num_rows`` (the tail
  of a static bound) are zero too. Kernels may skip reading padding and tail rows but
  must write defined values (zeros) to their outputs there.

Because ``align`` divides every segment, a GEMM tile of ``align`` (or a divisor of it)
rows never straddles two experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLayout:
    """Rows grouped by expert, each segment padded to a multiple of ``align``.

    Attributes:
        num_experts: ``E``.
        align: segment alignment in rows (e.g. 16 or 128).
        num_rows: rows in the grouped buffer (a static bound, or exact when known).
        tokens_per_expert: ``[E]`` int32, real rows per expert.
        padded_tokens_per_expert: ``[E]`` int32, ``roundup(tokens_per_expert, align)``.
        offsets: ``[E + 1]`` int32, segment starts; ``offsets[E]`` = rows in use.
        row_index: ``[T, k]`` int32 or ``None``: the row holding token ``t``'s ``j``-th
            routed copy, ``-1`` where that copy was dropped (filled by ``permute``).
    """

    num_experts: int
    align: int
    num_rows: int
    tokens_per_expert: torch.Tensor
    padded_tokens_per_expert: torch.Tensor
    offsets: torch.Tensor
    row_index: torch.Tensor | None = None

    @property
    def segment_ends(self) -> torch.Tensor:
        """``[E]`` int32 cumulative segment ends (the ``offs`` of ``torch._grouped_mm``)."""
        return self.offsets[1:]


def max_grouped_rows(num_tokens: int, topk: int, num_experts: int, align: int) -> int:
    """Static bound on grouped rows: every copy plus at most ``align - 1`` padding rows
    per expert. Sizing buffers by it avoids a host sync for the exact count."""
    return num_tokens * topk + num_experts * (align - 1)


def make_expert_layout(tokens_per_expert: torch.Tensor, align: int, num_rows: int,
                       row_index: torch.Tensor | None = None) -> ExpertLayout:
    """Build an :class:`ExpertLayout` from per-expert real counts (device ops only)."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    counts = tokens_per_expert.to(torch.int32)
    padded = (counts + (align - 1)) // align * align
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(padded, 0, out=offsets[1:])
    return ExpertLayout(num_experts=counts.numel(), align=align, num_rows=num_rows,
                        tokens_per_expert=counts, padded_tokens_per_expert=padded,
                        offsets=offsets, row_index=row_index)
