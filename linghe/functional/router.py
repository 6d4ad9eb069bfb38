"""Router ops: fp32-exact router GEMM, fused top-k routing, router z-loss."""

from __future__ import annotations

import torch

from .. import library
from ..bwd.router import router_logits_bwd, router_z_loss_bwd, topk_route_bwd
from ..fwd.router import router_logits_fwd, router_z_loss_fwd, topk_route_fwd, weight_parts
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    check_kernel_device,
    check_same_device,
    check_tensor,
    rows_view,
)


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        x2 = rows_view(x)
        wp = weight_parts(weight)  # bf16 parts of the weight, reused by the backward's dx
        ctx.save_for_backward(x2, weight, wp)
        ctx.x_shape = x.shape
        out = router_logits_fwd(x2, weight, wp)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dlogits):
        x2, weight, wp = ctx.saved_tensors
        dl = rows_view(dlogits.float()).contiguous()
        dx, dw = router_logits_bwd(dl, x2, weight, need_dx=ctx.needs_input_grad[0],
                                   need_dw=ctx.needs_input_grad[1], w_parts=wp)
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        if dw is not None:
            dw = dw.to(weight.dtype)
        return dx, dw


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router GEMM ``x @ weight^T`` in float32 **without TF32 rounding**.

    Args:
        x: ``[..., K]`` bfloat16/float16/float32 with a contiguous last dim.
        weight: ``[E, K]`` bfloat16/float16/float32 (typically fp32 master or bf16).

    Returns float32 logits ``[..., E]``: each operand is read in its own dtype and the
    products are accumulated in fp32, so the result is float32-accurate for the given
    inputs (relative error ~1e-7 against a float64 matmul), whatever
    ``torch.backends.cuda.matmul.allow_tf32`` says. Cost: one bf16 tensor-core GEMM for bf16
    x bf16; an fp32 operand is split into 3 bf16 parts (3 GEMM passes with bf16 ``x``).

    Backward: ``dx = dlogits @ weight`` in ``x``'s dtype (fp32-exact for fp32 ``x``; for
    bf16/fp16 ``x`` one bf16 GEMM, see ``linghe.bwd.router.DX_ORDER``) and ``dweight =
    dlogits^T @ x`` accumulated in fp32 (returned in ``weight``'s dtype; fp32-exact for an
    fp32 weight). On Hopper, "fp32-exact" means fp32 tensor-core accumulation (not IEEE
    round-to-nearest): relative error ~1e-6 at K ~ 2048.
    Saves ``x``, ``weight`` and the weight's bf16 parts (``[3, E, K]`` bf16 for an fp32
    weight, ``[2, E, K]`` for fp16; a view of the weight itself for bf16).
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1, last_dim_contiguous=True)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (E, {x.shape[-1]}) to match x's last dim, "
                         f"got {tuple(weight.shape)}")
    check_same_device(x=x, weight=weight)
    check_kernel_device("x", x)
    if torch.compiler.is_compiling():
        return library.router_logits(x, weight)
    return apply_function(_RouterLogits, x, weight)


class _TopkRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, sigmoid, bias, num_groups, topk_groups, normalize, scale):
        probs, ids, tpe = topk_route_fwd(logits, k, sigmoid, bias, num_groups, topk_groups,
                                         normalize, scale)
        ctx.save_for_backward(logits, ids)
        ctx.cfg = (sigmoid, normalize, scale)
        ctx.mark_non_differentiable(ids, tpe)
        return probs, ids, tpe

    @staticmethod
    def backward(ctx, dprobs, _dids, _dtpe):
        logits, ids = ctx.saved_tensors
        sigmoid, normalize, scale = ctx.cfg
        if dprobs is None:
            return (None,) * 8
        dl = topk_route_bwd(dprobs.float().contiguous(), logits, ids, sigmoid, normalize,
                            scale)
        return dl, None, None, None, None, None, None, None


def topk_route(logits: torch.Tensor, k: int, *, score: str = "softmax",
               expert_bias: torch.Tensor | None = None, num_groups: int = 1,
               topk_groups: int = 1, normalize: bool = True, scale: float = 1.0):
    """Fused top-k MoE routing (DeepSeek-V3 style), one kernel per call.

    Args:
        logits: ``[T, E]`` float32/bfloat16/float16 router logits.
        k: experts per token, ``1 <= k <= E`` (``<= topk_groups * E / num_groups``).
        score: ``"softmax"`` (over all ``E``) or ``"sigmoid"``; computed in fp32.
        expert_bias: optional ``[E]`` float (load-balancing bias): added to the scores for
            the **selection only**; the returned probabilities never include it.
        num_groups, topk_groups: group-limited routing. ``E`` must be divisible by
            ``num_groups``; experts ``[g*E/G, (g+1)*E/G)`` form group ``g``. A group's score
            is the **sum of its top-2** selection scores for ``score="sigmoid"`` (DeepSeek-V3)
            and its **max** for ``"softmax"`` (DeepSeek-V2); only the ``topk_groups``
            best groups are eligible.
        normalize: divide the selected scores by their sum (per token).
        scale: multiply the final probabilities (``routed_scaling_factor``).

    Returns ``(probs [T, k] float32, expert_ids [T, k] int32, tokens_per_expert [E] int32)``:
    ids in descending order of selection score (ties: lower expert id first); probs are the
    unbiased scores of those experts (normalized, scaled); ``tokens_per_expert`` counted on
    device (no host sync). A row with NaN logits gets NaN probs and ids ``-1`` (which
    ``permute`` drops). Backward: ``dlogits`` (logits' dtype) through scale,
    normalization and softmax/sigmoid; selection is not differentiable. Saves ``logits``
    and ``expert_ids`` (scores are recomputed).
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    T, E = logits.shape
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    if not isinstance(num_groups, int) or num_groups < 1 or E % num_groups:
        raise ValueError(f"num_groups must be an int >= 1 dividing E={E}, got {num_groups!r}")
    if not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be an int in [1, num_groups={num_groups}], got "
                         f"{topk_groups!r}")
    eligible = E if num_groups == 1 else topk_groups * (E // num_groups)
    if not isinstance(k, int) or not 1 <= k <= eligible:
        raise ValueError(f"k must be an int in [1, {eligible}] (E={E}, groups "
                         f"{topk_groups}/{num_groups}), got {k!r}")
    if expert_bias is not None:
        check_tensor("expert_bias", expert_bias, dtypes=FLOAT_DTYPES, shape=(E,))
    check_same_device(logits=logits, expert_bias=expert_bias)
    check_kernel_device("logits", logits)
    bias = expert_bias.detach().contiguous() if expert_bias is not None else None
    if torch.compiler.is_compiling():
        return library.topk_route(logits.contiguous(), k, score == "sigmoid", bias, num_groups,
                                  topk_groups, bool(normalize), float(scale))
    return apply_function(_TopkRoute, logits.contiguous(), k, score == "sigmoid", bias, num_groups,
                          topk_groups, bool(normalize), float(scale))


class _ZLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        l2 = rows_view(logits)
        loss, lse = router_z_loss_fwd(l2)
        ctx.save_for_backward(l2, lse)
        ctx.shape = logits.shape
        return loss

    @staticmethod
    def backward(ctx, g):
        l2, lse = ctx.saved_tensors
        return router_z_loss_bwd(g, l2, lse).view(ctx.shape)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``mean over tokens of logsumexp(logits[t])^2``.

    ``logits [..., E]`` float32/bfloat16/float16 with a contiguous last dim; returns a
    float32 scalar (0 for no tokens; multiply by your coefficient). Backward:
    ``dlogits = g * 2 * lse[t] / T * softmax(logits[t])`` in logits' dtype; saves logits
    and the per-token ``lse`` (fp32).
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_ndim=1, last_dim_contiguous=True)
    check_kernel_device("logits", logits)
    if torch.compiler.is_compiling():
        return library.router_z_loss(logits)
    return apply_function(_ZLoss, logits)
