"""Group RMSNorm with sigmoid gate (the output norm of linear attention), with the
``[B, S] -> [S, B]`` transpose fused."""

from __future__ import annotations

import math

import torch

from .. import library
from ..bwd.gate import group_rms_norm_gate_bwd
from ..fwd.gate import group_rms_norm_gate_fwd
from ..utils import FLOAT_DTYPES, apply_function, check_kernel_device, check_tensor


class _GroupRMSNormGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, opts):
        B, S = x.shape[0], x.shape[1]
        x3 = x.reshape(B, S, -1) if x.numel() else x.new_empty(B, S, math.prod(x.shape[2:]))
        if x3.stride(-1) != 1:
            x3 = x3.contiguous()
        ctx.save_for_backward(x3, gate, weight)
        ctx.x_shape = x.shape
        ctx.opts = opts
        return group_rms_norm_gate_fwd(x3, gate, weight, **opts)

    @staticmethod
    def backward(ctx, dy):
        x3, gate, weight = ctx.saved_tensors
        dx3, dg, dw = group_rms_norm_gate_bwd(dy.contiguous(), x3, gate, weight, **ctx.opts)
        return dx3.view(ctx.x_shape), dg, dw, None


def group_rms_norm_gate(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *,
                        num_groups: int = 4, eps: float = 1e-6, gate_layout: str = "sbh"):
    """``y = groupRMSNorm(x) * weight * sigmoid(gate)`` in the gate's layout, one kernel.

    Args:
        x: ``[B, S, H, d_head]`` (or ``[B, S, dim]``) float32/float16/bfloat16, viewed as
            ``[B, S, dim]`` (copied if the trailing dims are not viewable).
        gate: ``[S, B, dim]`` (``gate_layout="sbh"``) or ``[B, S, dim]`` (``"bsh"``), x's
            dtype, last dim contiguous (other strides free).
        weight: ``[dim]`` (one weight per channel) or ``[dim / num_groups]`` (shared by
            every group), any float dtype.
        num_groups: ``dim`` is split into ``num_groups`` groups of ``dim/num_groups``
            consecutive channels, each RMS-normalized on its own (mean of squares over the
            group, ``rsqrt(ms + eps)``).

    Returns ``y`` contiguous with the gate's shape and layout, in x's dtype; float32 math.

    Backward gives ``dx`` (x's shape, contiguous), ``dgate`` (gate's shape, contiguous) and
    ``dweight`` (float32 per-program partials summed in float32, weight's dtype). Saved for
    backward: references to ``x``, ``gate`` and ``weight`` only; rstd is recomputed.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=(3, 4))
    check_kernel_device("x", x)
    check_tensor("gate", gate, dtypes=(x.dtype,), ndim=3, device=x.device,
                 last_dim_contiguous=True)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=1, device=x.device,
                 contiguous=True)
    if gate_layout not in ("sbh", "bsh"):
        raise ValueError(f'gate_layout must be "sbh" or "bsh", got {gate_layout!r}')
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups <= 0:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    B, S = x.shape[0], x.shape[1]
    dim = math.prod(x.shape[2:])
    want = (S, B, dim) if gate_layout == "sbh" else (B, S, dim)
    check_tensor("gate", gate, shape=want)
    if dim % num_groups:
        raise ValueError(f"dim ({dim}) must be a multiple of num_groups ({num_groups})")
    if weight.shape[0] not in (dim, dim // num_groups):
        raise ValueError(f"weight must have shape ({dim},) or ({dim // num_groups},) "
                         f"(dim or dim/num_groups), got {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    # (gate and weight were checked on x's device above: no separate same-device pass)
    opts = dict(num_groups=num_groups, eps=float(eps), gate_layout=gate_layout)
    if torch.compiler.is_compiling():
        return library.group_rms_norm_gate(x, gate, weight, opts)
    return apply_function(_GroupRMSNormGate, x, gate, weight, opts)
