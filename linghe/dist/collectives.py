"""Differentiable collectives used by the expert-parallel dispatcher."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size_rank(group) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``; ``(1, 0)`` for ``group=None`` (no parallelism:
    linghe never falls back to the default world group silently)."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_to_all(x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits) if out_splits is not None else x.shape[0],
                       *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with autograd: the backward is the adjoint
    exchange (the same call with input and output splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all(g, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
               group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of the rows of ``x`` (splits ``None`` = equal)."""
    return AllToAll.apply(x, out_splits, in_splits, group)
