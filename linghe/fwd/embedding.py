"""Token embedding forward: a row gather ``out[t] = weight[tokens[t]]``.

One program copies a ``[BT, BH]`` tile: ``BT`` tokens' ids are loaded once, then the
``BH`` columns of each id's row (16-byte vectors along the row). An id outside
``[0, V)`` reads nothing and gives a zero row (no out-of-bounds access; the functional
layer documents it and, in debug mode, raises instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv, device_guard, empty, launch, next_power_of_2

#: Elements of one program's tile (``BT * BH``): 8 KB of bf16.
TILE_ELEMS = 4096


@triton.jit
def _embedding_fwd_kernel(tok_ptr, w_ptr, out_ptr, N, V, H, stride_w, BT: tl.constexpr,
                          BH: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rmask = rows < N
    cmask = cols < H
    ids = tl.load(tok_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    ok = rmask & (ids >= 0) & (ids < V)
    vals = tl.load(w_ptr + ids[:, None] * stride_w + cols[None, :],
                   mask=ok[:, None] & cmask[None, :], other=0.0)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], vals,
             mask=rmask[:, None] & cmask[None, :])


def fwd_tiles(H: int, elem_size: int) -> tuple[int, int]:
    """``(BT, BH)`` of the forward's tile for rows of ``H`` elements of ``elem_size``
    bytes: ``BH`` up to 1 KB of a row, ``BT`` rows up to :data:`TILE_ELEMS` elements."""
    BH = max(16 // elem_size, min(next_power_of_2(H), 1024 // elem_size))
    return max(1, TILE_ELEMS // BH), BH


def embedding_fwd(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out [N, H] = weight[tokens]`` in ``weight``'s dtype.

    ``tokens [N]`` int32/int64 (contiguous), ``weight [V, H]`` float (row stride any,
    columns contiguous). Ids outside ``[0, V)`` give zero rows."""
    N = tokens.shape[0]
    V, H = weight.shape
    out = empty(N, H, dtype=weight.dtype, device=weight.device)
    if N == 0 or H == 0:
        return out
    BT, BH = fwd_tiles(H, weight.element_size())
    with device_guard(weight):
        launch(_embedding_fwd_kernel, (cdiv(N, BT), cdiv(H, BH)), tokens, weight, out, N, V,
               H, weight.stride(0), BT=BT, BH=BH, num_warps=4)
    return out
