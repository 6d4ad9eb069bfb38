"""The linghe versions of Hugging Face ``transformers`` modules (no math here: each forward
calls :mod:`linghe.functional`).

:func:`linghe.transformers.apply_linghe_kernels` swaps a module for its linghe version by
setting its ``__class__`` to a subclass of the original class made by :func:`patched_class`
(a mixin below + the Hugging Face class). So the module keeps its Parameters (the very same
objects: optimizers and tied weights stay valid), buffers, hooks, attribute names and
``state_dict`` keys, and ``isinstance`` checks against the Hugging Face class (weight init,
output recording of router logits) still hold.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

import torch
import torch.nn.functional as F

from ..context import TrainingContext, current_recipe, swap_compiled_recipe
from ..fp8.cache import WeightCache
from ..functional.activation import silu_mul, silu_mul_quant
from ..functional.linear import fp8_linear
from ..functional.loss import linear_cross_entropy
from ..functional.moe import grouped_swiglu, quantize_tokens
from ..functional.norm import rms_norm, rms_norm_quant
from ..functional.permute import permute, unpermute
from ..functional.rope import apply_rope
from ..functional.router import router_logits, topk_route
from ..nn.linear import Linear as LingheLinear

__all__ = ["causal_lm_loss", "patched_class"]

_CLASSES: dict[tuple[type, type], type] = {}


def patched_class(hf_cls: type, mixin: type) -> type:
    """``class Linghe<Name>(mixin, hf_cls)``, made once per pair and kept in this module's
    namespace (so that unpickling a patched module finds it in a process that has patched
    a model of the same family)."""
    key = (hf_cls, mixin)
    cls = _CLASSES.get(key)
    if cls is None:
        name = f"Linghe{hf_cls.__name__}"
        cls = type(name, (mixin, hf_cls), {"__module__": __name__, "__qualname__": name})
        _CLASSES[key] = cls
        globals()[name] = cls
    return cls


def is_fp8_blockwise() -> bool:
    recipe = current_recipe()
    return recipe is not None and recipe.name == "blockwise"


# ------------------------------------------------------------------------------ RMSNorm
class RMSNormMixin:
    """``LlamaRMSNorm`` and its copies (Qwen2/Qwen3/Qwen3-MoE, also the q/k norms) through
    :func:`linghe.rms_norm`.

    Hugging Face rounds the normalized value to the input dtype and then multiplies by the
    weight (result dtype: the promotion of both); linghe multiplies in fp32 and rounds once.
    Same value in fp32, within one rounding of the input dtype otherwise; the result keeps
    Hugging Face's dtype (e.g. float32 for a bf16 input and an fp32 weight under autocast).

    ``linghe_quantize_output`` (set by the patch with ``fp8="blockwise"`` on a norm whose
    only consumers are FP8 :class:`linghe.nn.Linear`, i.e. the attention's input norm):
    under the blockwise recipe the forward is :func:`linghe.rms_norm_quant`, whose
    :class:`~linghe.Fp8Tensor` the q/k/v projections share without quantizing again.
    """

    linghe_quantize_output: bool = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (self.linghe_quantize_output and w.dtype == hidden_states.dtype
                and is_fp8_blockwise()):
            recipe = current_recipe()
            return rms_norm_quant(hidden_states, w, self.variance_epsilon,
                                  columnwise=recipe.fp8_wgrad and torch.is_grad_enabled(),
                                  pow2_scale=recipe.pow2_scale)
        y = rms_norm(hidden_states, w, self.variance_epsilon)
        out_dtype = torch.promote_types(hidden_states.dtype, w.dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)


# ------------------------------------------------------------------------------ RoPE
# Hugging Face attention modules call their modeling file's module-level
# ``apply_rotary_pos_emb``. linghe replaces that name (once per modeling file) with
# :func:`rope_dispatch`, which runs linghe's fused kernel only inside the forward of a
# patched attention module (this flag), so unpatched models in the same process keep the
# original function.
_LINGHE_ROPE: contextvars.ContextVar[bool] = contextvars.ContextVar("linghe_hf_rope",
                                                                    default=False)
#: The flag for code under ``torch.compile``, which cannot trace a ``ContextVar`` (as
#: :mod:`linghe.context` mirrors its recipe): a global that Dynamo traces and guards on.
_compiled_rope: bool = False


def _in_patched_attention() -> bool:
    if torch.compiler.is_compiling():
        return _compiled_rope
    return _LINGHE_ROPE.get()


def install_rope(modeling_module) -> None:
    """Point ``modeling_module.apply_rotary_pos_emb`` at a dispatcher to :func:`linghe.apply_rope`
    (idempotent; the original stays reachable as ``dispatcher.original``)."""
    current = modeling_module.apply_rotary_pos_emb
    if getattr(current, "linghe_rope", False):
        return
    original = current

    @functools.wraps(original)
    def dispatch(q, k, cos, sin, *args, **kwargs):
        if _in_patched_attention() and rope_fits(q, k, cos, args, kwargs):
            return apply_rope(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    dispatch.linghe_rope = True
    dispatch.original = original
    modeling_module.apply_rotary_pos_emb = dispatch


def rope_fits(q, k, cos, args, kwargs) -> bool:
    """Whether a call is one :func:`linghe.apply_rope` computes: ``[B, H, S, D]`` q and k of
    one dtype, ``unsqueeze_dim=1`` (the default) and the rotation over the whole head
    (``cos.shape[-1] == D``). Other calls (partial rotary, another layout) take the
    original Hugging Face function (a documented fallback)."""
    unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
    extra = len(args) > 1 or any(key != "unsqueeze_dim" for key in kwargs)
    return (not extra and unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4
            and q.dtype == k.dtype and cos.shape[-1] == q.shape[-1])


class AttentionMixin:
    """The Hugging Face attention forward, unchanged, with its RoPE through
    :func:`linghe.apply_rope` (see :func:`install_rope`)."""

    def forward(self, *args, **kwargs):
        global _compiled_rope
        if torch.compiler.is_compiling():
            outer, _compiled_rope = _compiled_rope, True
            try:
                return super().forward(*args, **kwargs)
            finally:
                _compiled_rope = outer
        token = _LINGHE_ROPE.set(True)
        try:
            return super().forward(*args, **kwargs)
        finally:
            _LINGHE_ROPE.reset(token)


# ------------------------------------------------------------------------------ FP8 scope
class DecoderLayerMixin:
    """The Hugging Face decoder layer, run inside ``TrainingContext(fp8=self.linghe_fp8)``
    unless a recipe is already active. Entering it per layer (not per model) keeps the
    recomputation of gradient checkpointing, which runs during backward, in FP8 too."""

    linghe_fp8: str | None = None
    #: the routed experts in FP8 too (``TrainingContext(expert_fp8=...)``)
    linghe_expert_fp8: bool = True

    def forward(self, *args, **kwargs):
        if self.linghe_fp8 is None or current_recipe() is not None:
            return super().forward(*args, **kwargs)
        # One context per layer, entered again at every forward (no recipe built per
        # call); a new one only if this layer's is active (a re-entrant call).
        ctx = self.__dict__.get("_linghe_context")
        if ctx is None or ctx.active:
            ctx = TrainingContext(fp8=self.linghe_fp8, expert_fp8=self.linghe_expert_fp8)
            self._linghe_context = ctx
        if torch.compiler.is_compiling():  # Dynamo cannot enter a context made outside
            outer = swap_compiled_recipe(ctx.recipe)
            try:
                return super().forward(*args, **kwargs)
            finally:
                swap_compiled_recipe(outer)
        with ctx:
            return super().forward(*args, **kwargs)


# ------------------------------------------------------------------------------ SwiGLU MLP
class MLPMixin:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` as one GEMM over the gate and up
    weights concatenated (gate rows first), :func:`linghe.silu_mul`, and ``down_proj``.

    The concatenation copies the ``[2I, H]`` weight once per forward (and its gradient is
    split once per backward): small next to the GEMMs at training batch sizes, and it keeps
    the model's own ``gate_proj``/``up_proj`` Parameters. Under the blockwise FP8 recipe
    (when ``down_proj`` is a :class:`linghe.nn.Linear`) the gate/up GEMM runs FP8 (its
    weight quantized each forward: it is a fresh tensor), the activation is
    :func:`linghe.silu_mul_quant` and ``down_proj`` consumes that ``Fp8Tensor``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj, self.up_proj
        w = torch.cat((gate.weight, up.weight))
        b = torch.cat((gate.bias, up.bias)) if gate.bias is not None else None
        if is_fp8_blockwise() and isinstance(self.down_proj, LingheLinear):
            recipe = current_recipe()
            h = fp8_linear(x, w, b, recipe, owner=id(self))
            a = silu_mul_quant(h, columnwise=recipe.fp8_wgrad and torch.is_grad_enabled(),
                               pow2_scale=recipe.pow2_scale)
        else:
            a = silu_mul(F.linear(x, w, b))
        return self.down_proj(a)


# ------------------------------------------------------------------------------ MoE
class TopKRouterMixin:
    """Qwen3-MoE's router: :func:`linghe.router_logits` (fp32, no TF32) and
    :func:`linghe.topk_route` (softmax over all experts, top-k, renormalized when the
    config's ``norm_topk_prob`` says so): Hugging Face's routing semantics.

    Returns ``(router_logits [T, E] float32, probs [T, k] float32, expert_ids [T, k]
    int32)``. Hugging Face computes the logits in the input dtype and rounds the
    probabilities to it; linghe keeps both in fp32 (the expert outputs are weighted in
    fp32)."""

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = router_logits(x, self.weight)
        probs, ids, _ = topk_route(logits, self.top_k, score="softmax",
                                   normalize=bool(self.norm_topk_prob))
        return logits, probs, ids


class ExpertsMixin:
    """Qwen3-MoE's experts (``gate_up_proj [E, 2I, H]`` gate rows first, ``down_proj
    [E, H, I]``) through :func:`linghe.permute` (rows grouped by expert, padded by index),
    :func:`linghe.functional.moe.grouped_swiglu` (grouped GEMM, SwiGLU weighted by the
    routing weight, grouped GEMM) and :func:`linghe.unpermute` (the sum over a token's
    ``k`` experts): the expert path of :class:`linghe.nn.MoE`.

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
    in ``hidden_states``' dtype (the experts' dtype). The routing weight scales each
    expert's SwiGLU output before the down projection (Hugging Face scales after it: the
    same value, as the projection is linear). Under the blockwise FP8 recipe, when ``2I``
    and ``H`` are multiples of 128 (else high precision), it runs as ``nn.MoE`` does: each
    token quantized once (``quantize_tokens``) and moved in FP8 by ``permute``, FP8
    grouped GEMMs, the expert weights quantized once per optimizer step (a
    :class:`~linghe.fp8.WeightCache` per weight).
    """

    #: segment alignment in rows (a multiple of 8 lets bf16 use torch._grouped_mm on Hopper)
    linghe_align: int = 16
    #: deferred expert weight gradients over this many micro-batches (``grouped_swiglu``'s
    #: ``wgrad_micro_batches``; ``apply_linghe_kernels(expert_wgrad_micro_batches=...)``)
    linghe_wgrad_micro_batches: int = 1

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.gate_up_proj, self.down_proj
        x = hidden_states if hidden_states.dtype == w1.dtype else hidden_states.to(w1.dtype)
        x = x.contiguous()
        recipe = current_recipe()
        fp8 = (recipe is not None and recipe.fp8_experts and w1.shape[1] % 128 == 0
               and w1.shape[2] % 128 == 0)
        pow2, caches = False, None
        if fp8:
            caches = self.__dict__.get("_linghe_fp8_caches")
            if caches is None:  # made here: Hugging Face built the module
                caches = self._linghe_fp8_caches = (WeightCache(), WeightCache())
            pow2 = recipe.pow2_scale
            x = quantize_tokens(x, pow2_scale=pow2)
        rows, prow, layout = permute(x, top_k_index, top_k_weights.to(torch.float32),
                                     num_experts=w1.shape[0], align=self.linghe_align)
        y = grouped_swiglu(rows, prow, w1, w2, layout, fp8=fp8, pow2_scale=pow2,
                           weight_caches=caches,
                           wgrad_micro_batches=self.linghe_wgrad_micro_batches)
        return unpermute(y, layout).to(hidden_states.dtype)


# ------------------------------------------------------------------------------ loss
def causal_lm_loss(hidden: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor | None,
                   *, num_items_in_batch=None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` of ``lm_head(hidden)`` through
    :func:`linghe.linear_cross_entropy` (the ``[N, V]`` logits are never built).

    ``hidden [B, S, H]``; ``labels [B, S]`` are shifted left by one (the last position gets
    ``ignore_index``) unless ``shift_labels [B, S]`` is given. The mean over non-ignored
    tokens, or the sum divided by ``num_items_in_batch`` when that is given (what the
    Trainer passes under gradient accumulation). float32 scalar.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    w, b = lm_head.weight, lm_head.bias
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.dtype != w.dtype:  # e.g. fp32 weights under autocast: the head's own dtype
        h = h.to(w.dtype)
    y = shift_labels.reshape(-1).to(h.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(h, w, y, bias=b, ignore_index=ignore_index,
                                reduction=reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _slice_to_keep(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
    return hidden[:, logits_to_keep, :]


def make_causal_lm_forward(original, output_classes):
    """A ``forward`` for a ``*ForCausalLM`` model (set on the instance): with ``labels`` the
    loss comes from :func:`causal_lm_loss` (``shift_labels``, ``num_items_in_batch``,
    ``ignore_index`` from the keyword arguments, as Hugging Face reads them) and the output's
    ``logits`` is ``None``; without, the original forward runs (logits, e.g. for
    ``generate()``). MoE models add ``router_aux_loss_coef * aux_loss`` as Hugging Face
    does. ``output_classes = (dense_output_cls, moe_output_cls, load_balancing_loss_func)``.
    """
    sig = inspect.signature(original)
    dense_out, moe_out, balancing_loss = output_classes

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        extra = dict(arguments.pop("kwargs", {}))
        labels = arguments.pop("labels", None)
        if labels is None:  # as Hugging Face: no loss without labels, logits as before
            return original(self, *args, **kwargs)
        arguments.pop("self")
        logits_to_keep = arguments.pop("logits_to_keep", 0)
        return_dict = extra.pop("return_dict", None)
        is_moe = hasattr(self, "router_aux_loss_coef")
        if is_moe:
            orl = arguments.get("output_router_logits")
            arguments["output_router_logits"] = (orl if orl is not None
                                                 else self.config.output_router_logits)
        outputs = self.model(**arguments, **extra)
        hidden = _slice_to_keep(outputs.last_hidden_state, logits_to_keep)
        fp8_head = getattr(self, "linghe_lm_head_fp8", False) and current_recipe() is None
        with (TrainingContext(fp8="blockwise", lm_head_fp8=True) if fp8_head
              else contextlib.nullcontext()):
            loss = causal_lm_loss(hidden, self.lm_head, labels,
                                  num_items_in_batch=extra.get("num_items_in_batch"),
                                  ignore_index=extra.get("ignore_index", -100),
                                  shift_labels=extra.get("shift_labels"))
        common = dict(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        if is_moe:
            aux_loss = None
            if arguments["output_router_logits"]:
                aux_loss = balancing_loss(outputs.router_logits, self.num_experts,
                                          self.num_experts_per_tok,
                                          arguments.get("attention_mask"))
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
                common["loss"] = loss
            out = moe_out(aux_loss=aux_loss, router_logits=outputs.router_logits, **common)
        else:
            out = dense_out(**common)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()

    forward.linghe_patched = True
    return forward
