"""MoE permute / unpermute backward launchers.

The backward of a gather is a scatter and vice versa, so these reuse the two data-movement
kernels of :mod:`linghe.fwd.permute`:

- ``permute`` backward: ``dx[t] = sum_j d_rows[row_index[t, j]]`` (a gather-sum) and
  ``dprobs[t, j] = d_probs_rows[row_index[t, j]]``;
- ``unpermute`` backward: ``d_rows[row_index[t, j]] = probs[t, j] * dout[t]`` (a scatter;
  padding and tail rows get zero gradient) and ``dprobs[t, j] = <dout[t], rows[row]>``.
"""

from __future__ import annotations

import torch

from ..fwd.permute import gather_rows, scatter_rows, scatter_rows_fp8_copy
from ..layout import ExpertLayout


def permute_backward(d_rows: torch.Tensor, layout: ExpertLayout, x_dtype: torch.dtype,
                     d_probs_rows: torch.Tensor | None = None):
    """Returns ``(dx [T, H] in x_dtype, dprobs [T, k] fp32 | None)``."""
    return gather_rows(d_rows, layout, out_dtype=x_dtype, probs_rows_grad=d_probs_rows)


def unpermute_backward(dout: torch.Tensor, layout: ExpertLayout, rows_dtype: torch.dtype,
                       probs: torch.Tensor | None = None, rows: torch.Tensor | None = None):
    """Returns ``(d_rows [num_rows, H] in rows_dtype, dprobs [T, k] fp32 | None)``;
    ``dprobs`` is computed when ``rows`` is given."""
    out, _, _, d = scatter_rows(dout, layout, weights=probs, out_dtype=rows_dtype,
                                dot_rows=rows)
    return out, d


def unpermute_backward_fp8_copy(dout: torch.Tensor, layout: ExpertLayout,
                                rows_dtype: torch.dtype, *, pow2_scale: bool = False):
    """``unpermute``'s ``d_rows`` without ``probs`` (each row a copy of its token's ``dout``
    row) together with its 1x128 rowwise FP8 copy, in one pass: each token row is
    quantized once in registers and stored with every copy. ``(d_rows [num_rows, H] in
    rows_dtype, data [num_rows, H] e4m3, scale [num_rows, cdiv(H, 128)] fp32)``, padding
    and tail rows 0 with scale 1: what quantizing ``d_rows`` itself gives, bit for bit,
    without reading it again."""
    return scatter_rows_fp8_copy(dout, layout, out_dtype=rows_dtype, pow2_scale=pow2_scale)
