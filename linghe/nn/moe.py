"""``MoE``: a routed mixture-of-experts layer with optional expert parallelism (no math
here: it chains ``router_logits`` -> ``topk_route`` -> ``ExpertParallelDispatcher`` ->
``grouped_swiglu`` (``grouped_mm`` -> ``silu_mul`` -> ``grouped_mm``, or its FP8 form) ->
combine, plus shared experts)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..context import current_recipe
from ..dist.collectives import group_size_rank
from ..dist.dispatcher import ExpertParallelDispatcher
from ..fp8.cache import WeightCache
from ..functional.grouped_mm import check_wgrad_micro_batches
from ..functional.moe import grouped_swiglu, quantize_tokens
from ..functional.router import router_logits, router_z_loss, topk_route
from ..utils import FLOAT_DTYPES, check_tensor
from .activation import SwiGLU

__all__ = ["MoE", "MoEAux"]

_EXPERT_PARAMS = ("experts_gate_up", "experts_down")


@dataclass
class MoEAux:
    """Auxiliary router outputs of :class:`MoE`.

    Attributes:
        tokens_per_expert: ``[E]`` int32 routed copies per expert, summed over the
            expert-parallel group (before any capacity drop); feed it to
            :meth:`MoE.update_expert_bias`.
        z_loss: float32 scalar router z-loss of this rank's tokens (differentiable; scale
            it by your coefficient and add it to the loss).
        logits: ``[T, E]`` float32 router logits (differentiable).
        num_dropped: int64 device scalar, routed copies dropped by the capacity limit.
    """

    tokens_per_expert: torch.Tensor
    z_loss: torch.Tensor
    logits: torch.Tensor
    num_dropped: torch.Tensor


def balanced_logits(logits: torch.Tensor) -> torch.Tensor:
    """Standard-normal random routing logits of ``logits``' shape whose gradient goes
    straight through to ``logits`` (benchmarks: :attr:`MoE.force_balanced_routing`)."""
    return torch.randn_like(logits) + (logits - logits.detach())


class MoE(nn.Module):
    """Routed MoE with SwiGLU experts, DeepSeek-V3-style routing and expert parallelism.

    Args:
        hidden_size: ``H``.
        num_experts: routed experts ``E`` (divisible by the ``ep_group`` size).
        top_k: experts per token, ``1 <= top_k <= E``.
        intermediate_size: ``I`` of each routed expert.
        num_shared_experts: shared experts, fused into one ``SwiGLU(H, I *
            num_shared_experts)`` applied to every token.
        score: ``"sigmoid"`` or ``"softmax"`` (see :func:`linghe.topk_route`).
        num_groups, topk_groups: group-limited routing.
        ep_group: expert-parallel process group (``None``: all experts local). Rank ``r``
            of the group holds experts ``r*E/W .. (r+1)*E/W - 1``.
        align: expert segment alignment in rows (a multiple of 8 lets bf16 use
            ``torch._grouped_mm`` on Hopper).
        capacity_factor: static-shape dispatch without host syncs (see
            :class:`~linghe.dist.ExpertParallelDispatcher`).
        fp8_payload: send the dispatched tokens as 1x128 FP8.
        wgrad_micro_batches: defer the expert weight gradients over this many
            micro-batches (the attribute of that name, below; 1: off).
        device, dtype: for the expert and shared-expert weights (the router weight and
            the expert bias are always float32).

    Parameters / buffers (state_dict names):

    - ``router_weight [E, H]`` float32 (replicated);
    - ``expert_bias [E]`` float32 buffer (aux-loss-free load balancing; selection only);
    - ``experts_gate_up [E_local, 2I, H]`` (gate rows first, then up rows) and
      ``experts_down [E_local, H, I]``: only this rank's experts (``E_local = E / W``);
      :meth:`gather_full_state_dict` all-gathers a full one and
      :meth:`load_full_state_dict` loads a full one into any sharding;
    - ``shared_experts.*`` (a :class:`SwiGLU`) when ``num_shared_experts > 0``.

    With ``ep_group`` the shared experts run while the routed tokens are in flight
    (``overlap_shared_experts``, default on). ``force_balanced_routing`` (default off,
    benchmarks only) routes by random logits, so that every expert gets an even share.

    ``forward(x [..., H])`` returns ``(out [..., H], aux: MoEAux)``. ``x`` must have the
    experts' dtype. The router probabilities weight each expert's SwiGLU output
    (``silu_mul(h, probs_rows)``), so combine is a plain sum. Under
    ``linghe.TrainingContext(fp8="blockwise")`` the experts run FP8 blockwise end to end
    (:func:`linghe.functional.moe.grouped_swiglu` with ``fp8=True``, which needs ``2I``
    and ``H`` multiples of 128): on one rank the tokens are quantized once
    (:func:`~linghe.functional.moe.quantize_tokens`) and ``permute`` moves the FP8 rows
    with their scales; the SwiGLU output is quantized by ``batch_silu_mul_quant`` for the
    down GEMM; gradients are quantized by the kernels that produce them; the expert
    weights are quantized once per optimizer step (a ``WeightCache`` per weight); the
    combine (unpermute) stays in high precision. With expert parallelism the rows arrive
    in high precision and are quantized per segment on arrival; with ``fp8_payload``
    they arrive as FP8 rows (quantized once, by the dispatcher's send kernel, with the
    recipe's ``pow2_scale``) that the first GEMM reads as they are. (Outside the FP8
    recipe, ``fp8_payload`` rows are dequantized on arrival.)

    Gradient accumulation: when ``experts_gate_up`` / ``experts_down`` already have a
    ``.grad`` (the second and later micro-batches), their weight gradients are added into
    it by the wgrad kernel instead of by PyTorch's AccumulateGrad
    (:mod:`linghe.bwd.accumulate`; ``linghe.set_fused_grad_accumulation(False)`` turns it
    off).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 *, num_shared_experts: int = 0, score: str = "sigmoid", num_groups: int = 1,
                 topk_groups: int = 1, ep_group=None, align: int = 16,
                 capacity_factor: float | None = None, fp8_payload: bool = False,
                 wgrad_micro_batches: int = 1, device=None, dtype=None):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts),
                        ("top_k", top_k), ("intermediate_size", intermediate_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got "
                             f"{num_shared_experts!r}")
        if score not in ("sigmoid", "softmax"):
            raise ValueError(f"score must be 'sigmoid' or 'softmax', got {score!r}")
        if not isinstance(num_groups, int) or num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"num_groups must be an int >= 1 dividing num_experts="
                             f"{num_experts}, got {num_groups!r}")
        if not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_groups must be in [1, num_groups={num_groups}], got "
                             f"{topk_groups!r}")
        eligible = num_experts if num_groups == 1 else topk_groups * (num_experts // num_groups)
        if top_k > eligible:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts}; "
                             f"{eligible} eligible with groups {topk_groups}/{num_groups})")
        world, rank = group_size_rank(ep_group)
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the ep_group "
                             f"size ({world})")
        check_wgrad_micro_batches(wgrad_micro_batches, fp8_wgrad=False)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32/float16/bfloat16, got {dtype}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.intermediate_size = intermediate_size
        self.num_shared_experts = num_shared_experts
        self.score, self.num_groups, self.topk_groups = score, num_groups, topk_groups
        self.ep_group, self.ep_size, self.ep_rank = ep_group, world, rank
        self.num_local_experts = num_experts // world
        self.dispatcher = ExpertParallelDispatcher(
            num_experts, group=ep_group, align=align, capacity_factor=capacity_factor,
            fp8_payload=fp8_payload)
        #: With ``ep_group``: run the shared experts while the dispatch's exchange is in
        #: flight (``dispatch(async_op=True)``); ``False`` runs them once the dispatch
        #: has completed (same result; for measuring the overlap). Either way their output
        #: is added by the combine (its ``residual``).
        self.overlap_shared_experts = True
        #: For benchmarks only (as Megatron-LM's ``moe_router_force_load_balancing``):
        #: route by standard-normal random logits, drawn per token from the default
        #: generator, instead of the router's, so that every expert gets ~``T * top_k /
        #: E`` rows whatever the model has learnt. The router's logits still pass their
        #: gradient straight through (``random + (logits - logits.detach())``), so every
        #: kernel of a training step runs; the output is not a trained model's (and
        #: ``aux.z_loss`` / ``aux.logits`` are those of the random logits).
        self.force_balanced_routing = False
        #: Deferred expert weight gradients (:mod:`linghe.bwd.deferred`): ``n > 1``
        #: computes ``experts_gate_up``'s and ``experts_down``'s gradients once every
        #: ``n`` backward passes, over the routed rows of all ``n`` in one launch each
        #: (the others keep their operands, ~``R x (H + 2I)`` elements for each weight per
        #: micro-batch). Set it to the micro-batches per optimizer step: their
        #: ``.grad`` is complete after the last one's backward (pending ones are also
        #: computed before any ``torch.optim`` step and in
        #: ``linghe.optim.clip_grad_norm_``; else call ``linghe.flush_deferred_wgrad()``).
        #: Not with the recipe's ``expert_fp8_wgrad``. ``1`` (default): off.
        self.wgrad_micro_batches = wgrad_micro_batches
        fk = {"device": device, "dtype": dtype}
        El, H, In = self.num_local_experts, hidden_size, intermediate_size
        self.router_weight = nn.Parameter(torch.empty(num_experts, H, device=device,
                                                      dtype=torch.float32))
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device,
                                                        dtype=torch.float32))
        self.experts_gate_up = nn.Parameter(torch.empty(El, 2 * In, H, **fk))
        self.experts_down = nn.Parameter(torch.empty(El, H, In, **fk))
        self.shared_experts = (SwiGLU(H, In * num_shared_experts, **fk)
                               if num_shared_experts else None)
        # FP8 copies of the expert weights, made once per optimizer step (see WeightCache).
        self._fp8_weight_caches = {name: WeightCache() for name in _EXPERT_PARAMS}
        self.reset_parameters()

    def _apply(self, fn, *args, **kwargs):
        for cache in self._fp8_weight_caches.values():
            cache.clear()
        return super()._apply(fn, *args, **kwargs)

    @property
    def expert_range(self) -> tuple[int, int]:
        """Global ids ``[first, last + 1)`` of this rank's experts."""
        return self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init per expert (uniform ``+-1/sqrt(fan_in)``), router
        normal(0, 0.02), expert bias 0."""
        with torch.no_grad():
            nn.init.normal_(self.router_weight, std=0.02)
            self.expert_bias.zero_()
            b1, b2 = 1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.intermediate_size)
            self.experts_gate_up.uniform_(-b1, b1)
            self.experts_down.uniform_(-b2, b2)

    def extra_repr(self) -> str:
        d = self.dispatcher
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k="
                f"{self.top_k}, intermediate_size={self.intermediate_size}, "
                f"num_shared_experts={self.num_shared_experts}, score={self.score!r}, "
                f"num_groups={self.num_groups}, topk_groups={self.topk_groups}, ep_size="
                f"{self.ep_size}, local_experts={self.expert_range}, align={d.align}, "
                f"capacity_factor={d.capacity_factor}, fp8_payload={d.fp8_payload}"
                + (f", wgrad_micro_batches={self.wgrad_micro_batches}"
                   if self.wgrad_micro_batches != 1 else ""))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor):
        check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
        H = self.hidden_size
        if x.shape[-1] != H:
            raise ValueError(f"x must have last dim hidden_size={H}, got shape "
                             f"{tuple(x.shape)}")
        w1, w2 = self.experts_gate_up, self.experts_down
        if x.dtype != w1.dtype:
            raise TypeError(f"x must have the experts' dtype {w1.dtype}, got {x.dtype}")
        if x.device != w1.device:
            raise ValueError(f"x is on {x.device} but the MoE weights are on {w1.device}")
        shape = x.shape
        x2 = x.reshape(-1, H)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        logits = router_logits(x2, self.router_weight)
        if self.force_balanced_routing:
            logits = balanced_logits(logits)
        probs, ids, tpe = topk_route(logits, self.top_k, score=self.score,
                                     expert_bias=self.expert_bias, num_groups=self.num_groups,
                                     topk_groups=self.topk_groups)
        z_loss = router_z_loss(logits)
        recipe = current_recipe()
        fp8 = recipe is not None and recipe.fp8_experts
        pow2 = fp8 and recipe.pow2_scale
        tokens = x2
        if fp8 and self.ep_size == 1 and not self.dispatcher.fp8_payload:
            # Quantize each token once; permute then moves FP8 rows with their scales
            # (k times fewer bytes quantized, half the bytes moved).
            tokens = quantize_tokens(x2, pow2_scale=pow2)
        # FP8 experts with an FP8 payload: the rows arrive as FP8 (no second quantization)
        fp8_rows = fp8 and self.dispatcher.fp8_payload
        shared = None
        if self.ep_group is not None and self.overlap_shared_experts:
            # The shared expert runs while the routed tokens travel (the dispatch's
            # exchange is asynchronous until wait()).
            pending = self.dispatcher.dispatch(tokens, ids, probs, async_op=True,
                                               fp8_rows=fp8_rows, pow2_scale=pow2)
            if self.shared_experts is not None:
                shared = self.shared_experts(x2)
            rows, prow, handle = pending.wait()
        else:
            rows, prow, handle = self.dispatcher.dispatch(tokens, ids, probs,
                                                          fp8_rows=fp8_rows, pow2_scale=pow2)
            if self.shared_experts is not None:
                # (added inside the combine below: one pass over its output)
                shared = self.shared_experts(x2)
        caches = self._fp8_weight_caches
        y = grouped_swiglu(rows, prow, w1, w2, handle.layout, fp8=fp8, pow2_scale=pow2,
                           weight_caches=(caches["experts_gate_up"], caches["experts_down"]),
                           fp8_wgrad=fp8 and recipe.expert_fp8_wgrad,
                           wgrad_micro_batches=self.wgrad_micro_batches)
        out = self.dispatcher.combine(y, handle, residual=shared)
        if self.ep_group is not None:
            tpe = tpe.clone()
            dist.all_reduce(tpe, group=self.ep_group)
        aux = MoEAux(tokens_per_expert=tpe, z_loss=z_loss, logits=logits,
                     num_dropped=handle.num_dropped)
        return out.view(shape), aux

    # ------------------------------------------------------------------ balancing
    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3,
                           group=None) -> None:
        """DeepSeek-V3 auxiliary-loss-free balancing: ``expert_bias += rate *
        sign(mean(count) - count)``. ``tokens_per_expert [E]`` (e.g. ``aux.tokens_per_expert``,
        or their sum over micro-batches) is first summed over ``group`` (e.g. the
        data-parallel group; ``None``: as given). No host sync."""
        check_tensor("tokens_per_expert", tokens_per_expert, shape=(self.num_experts,))
        counts = tokens_per_expert.to(device=self.expert_bias.device, dtype=torch.float32)
        if group is not None:
            counts = counts.clone()
            dist.all_reduce(counts, group=group)
        self.expert_bias.add_(torch.sign(counts.mean() - counts), alpha=float(rate))

    # ------------------------------------------------------------------ state dicts
    def gather_full_state_dict(self) -> dict:
        """A full (unsharded) state dict: this module's ``state_dict()`` with the expert
        weights all-gathered over ``ep_group`` to ``[E, ...]`` in global expert order.
        A collective: every rank of ``ep_group`` must call it. Load it into a layer of any
        sharding with :meth:`load_full_state_dict`."""
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        if self.ep_group is None:
            return sd
        for name in _EXPERT_PARAMS:
            local = getattr(self, name).detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(self.ep_size)]
            dist.all_gather(parts, local, group=self.ep_group)
            sd[name] = torch.cat(parts)
        return sd

    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a full state dict (experts ``[E, ...]``): each rank keeps its slice."""
        sd = dict(state_dict)
        lo, hi = self.expert_range
        for name in _EXPERT_PARAMS:
            if name in sd:
                w = sd[name]
                if w.shape[0] != self.num_experts:
                    raise ValueError(f"{name} must hold all {self.num_experts} experts, got "
                                     f"shape {tuple(w.shape)}")
                sd[name] = w[lo:hi]
        return self.load_state_dict(sd, strict=strict)
