"""``apply_linghe_kernels``: patch a Hugging Face model in place with linghe's kernels, and
``AutoLinghePatchedModelForCausalLM``, which builds one patched."""

from __future__ import annotations

import importlib
import types

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from ..context import backward_on_caller_thread
from ..fp8.recipe import RECIPES
from ..functional.grouped_mm import check_wgrad_micro_batches
from ..nn.convert import convert
from ..nn.linear import Linear as LingheLinear
from . import modules as M

__all__ = ["SUPPORTED_MODEL_TYPES", "AutoLinghePatchedModelForCausalLM", "apply_linghe_kernels"]

#: config.model_type -> the class-name prefix of its modeling file.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3Moe",
}

#: FP8 recipes the patch supports (the blockwise one: no per-step state to manage).
FP8_RECIPES = ("blockwise",)

_SILU = ("silu", "swish")


def _supported_names() -> str:
    return ", ".join(f"{t!r} ({p})" for t, p in SUPPORTED_MODEL_TYPES.items())


def _model_type(config) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"linghe.transformers supports the model types {_supported_names()}; "
                         f"got model_type={model_type!r}")
    return model_type


def _check_options(flags: dict, fp8) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if fp8 is not None and fp8 not in FP8_RECIPES:
        hint = f" ({fp8!r} is a linghe recipe but not supported here)" if fp8 in RECIPES else ""
        raise ValueError(f"fp8 must be None or one of {FP8_RECIPES}, got {fp8!r}{hint}")


def _swap(module: torch.nn.Module, mixin: type) -> None:
    module.__class__ = M.patched_class(type(module), mixin)


def apply_linghe_kernels(model: torch.nn.Module, *, rms_norm: bool = True, rope: bool = True,
                         swiglu: bool = True, moe: bool = True, cross_entropy: bool = True,
                         fp8: str | None = None, lm_head_fp8: bool = False,
                         expert_fp8: bool = True, expert_wgrad_micro_batches: int = 1,
                         caller_thread_backward: bool = True) -> torch.nn.Module:
    """Patch a Hugging Face Llama, Qwen2, Qwen3 or Qwen3-MoE model in place with linghe's
    kernels; returns ``model``.

    Modules are swapped (their class becomes a linghe subclass of the Hugging Face class,
    see :mod:`linghe.transformers.modules`); Parameters, buffers and ``state_dict`` keys
    stay what they were, so optimizers built before the patch, tied weights,
    ``save_pretrained`` and ``from_pretrained`` keep working.

    Args:
        model: a ``*ForCausalLM`` or base ``*Model`` of a supported family, on a CUDA GPU
            (or on CPU under ``TRITON_INTERPRET=1``); any float dtype.
        rms_norm: every ``*RMSNorm`` (layer norms, final norm, Qwen3's q/k norms) through
            :func:`linghe.rms_norm`.
        rope: rotary embedding of the attention through :func:`linghe.apply_rope` (fused
            q and k, forward and backward). The modeling file's ``apply_rotary_pos_emb`` is
            replaced once by a dispatcher that takes linghe's kernel only inside a patched
            attention module (unpatched models in the process keep Hugging Face's), and
            Hugging Face's function for calls the kernel does not cover.
        swiglu: dense ``*MLP`` (``silu``) as one gate/up GEMM + :func:`linghe.silu_mul`.
        moe: Qwen3-MoE's sparse block: router through :func:`linghe.router_logits` and
            :func:`linghe.topk_route` (softmax top-k, renormalized as the config's
            ``norm_topk_prob`` says), experts through :func:`linghe.permute`,
            :func:`linghe.grouped_mm`, :func:`linghe.silu_mul`, :func:`linghe.unpermute`.
        cross_entropy: when ``labels`` are given, the causal LM loss is
            :func:`linghe.linear_cross_entropy` of the last hidden states and the LM head:
            the ``[N, V]`` logits are never built and the output's ``logits`` is ``None``.
            Without labels (e.g. ``generate()``) the logits are computed as before.
        fp8: ``None`` or ``"blockwise"``. With ``"blockwise"``, the decoder layers' FP8-suited
            ``nn.Linear`` (in/out features multiples of 16, at least 64; the router and the
            LM head stay high precision) become :class:`linghe.nn.Linear`, and each decoder
            layer runs inside ``linghe.TrainingContext(fp8="blockwise")`` (unless a context
            is already active): its Linears, dense SwiGLU and MoE grouped GEMMs (when ``2I``
            and ``H`` are multiples of 128) run FP8. Needs compute capability >= 8.9.
        lm_head_fp8: with ``fp8="blockwise"`` and ``cross_entropy``, the loss's LM head
            GEMMs (logits and hidden gradient) run FP8 too
            (``TrainingContext(lm_head_fp8=True)`` around :func:`linghe.linear_cross_entropy`,
            unless a context is already active: then that context decides). Off by
            default: FP8 recipes keep the output layer in high precision; check the loss
            curve of your model first.
        expert_fp8: with ``fp8`` and ``moe``, the routed experts run FP8 too (default).
            ``False`` keeps their GEMMs in the input's precision while the Linears (and the
            LM head with ``lm_head_fp8``) run FP8 (``TrainingContext(expert_fp8=False)``):
            with few tokens per expert the expert GEMMs are bound by reading the weights,
            and their FP8 copies cost about what the FP8 GEMMs save.
        expert_wgrad_micro_batches: with ``moe``, ``n > 1`` defers the experts' weight
            gradients over ``n`` backward passes (:mod:`linghe.bwd.deferred`): set it to
            the Trainer's ``gradient_accumulation_steps``. Each ``n``-th backward computes
            them over all ``n`` micro-batches' rows in one launch per weight, so
            ``.grad`` is complete before the clipping and the step. A window of fewer
            micro-batches (the end of an epoch) is completed before the optimizer's step,
            but after ``torch.nn.utils.clip_grad_norm_``, whose norm then misses it
            (call ``linghe.flush_deferred_wgrad()`` first, or use
            ``linghe.optim.clip_grad_norm_``). ``1``: off.
        caller_thread_backward: run the model's backward on the thread that calls
            ``loss.backward()`` instead of PyTorch's autograd device thread
            (:func:`linghe.backward_on_caller_thread`: a forward with gradients turns
            ``torch.autograd.set_multithreading_enabled`` off for the calling thread, a
            forward without gradients turns it back on). linghe's ops are Python autograd
            Functions, and the hand-off to that thread costs host time per op: on the H200
            host, ``benchmark.hf_step``'s 1B step took 60.4 instead of 67.4 ms (median,
            ``benchmark/NOTES.md``). ``False``: PyTorch's default (e.g. for one process
            driving several GPUs whose backwards should overlap).

    Sets ``model.linghe_patched`` (how many modules of each kind were swapped, e.g.
    ``{"RMSNorm": 9, "Attention": 2, ...}``) and ``model.linghe_fp8``.

    The patched model (or each decoder layer) traces under ``torch.compile(...,
    fullgraph=True)`` without graph breaks; ``layer.compile(mode="reduce-overhead")`` per
    decoder layer replays its forward and backward as CUDA graphs, which removes the host
    time that bounds small models (README, "Hugging Face models"). Compiled, FP8 weights
    are quantized in every call, the experts' weight gradients are not deferred, and the
    fused FP8 expert FFN runs as its unfused FP8 path (``linghe.library``).

    Raises ``ValueError`` for an unsupported model type (naming the supported ones), a model
    patched already, experts stored in a layout other than Qwen3-MoE's (concatenated
    gate/up, not transposed) or a model sharded by Hugging Face's expert parallelism;
    ``TypeError`` for a non-module or a non-bool flag.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("model must be a Hugging Face model (with a .config); supported model "
                         f"types: {_supported_names()}")
    model_type = _model_type(config)
    _check_patch_kwargs(dict(rms_norm=rms_norm, rope=rope, swiglu=swiglu, moe=moe,
                             cross_entropy=cross_entropy, fp8=fp8, lm_head_fp8=lm_head_fp8,
                             expert_fp8=expert_fp8,
                             expert_wgrad_micro_batches=expert_wgrad_micro_batches,
                             caller_thread_backward=caller_thread_backward))
    if getattr(model, "linghe_patched", None) is not None:
        raise ValueError(f"model is already patched by linghe ({model.linghe_patched}); "
                         "patch a fresh model instead")
    prefix = SUPPORTED_MODEL_TYPES[model_type]
    mm = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")

    def hf(name):
        return getattr(mm, prefix + name, None)

    causal_lm = hf("ForCausalLM")
    is_causal_lm = causal_lm is not None and isinstance(model, causal_lm)
    if lm_head_fp8 and not is_causal_lm:
        raise ValueError("lm_head_fp8=True needs a *ForCausalLM model (the LM head's loss), "
                         f"got {type(model).__name__}")

    wanted = []  # (HF class, mixin)
    if rms_norm:
        wanted.append((hf("RMSNorm"), M.RMSNormMixin))
    if rope:
        wanted.append((hf("Attention"), M.AttentionMixin))
    if swiglu:
        wanted.append((hf("MLP"), M.MLPMixin))
    if moe and hf("Experts") is not None:
        wanted.append((hf("TopKRouter"), M.TopKRouterMixin))
        wanted.append((hf("Experts"), M.ExpertsMixin))
    if fp8 is not None:
        wanted.append((hf("DecoderLayer"), M.DecoderLayerMixin))
    mixin_of = {cls: mixin for cls, mixin in wanted if cls is not None}

    targets = [(name, m) for name, m in model.named_modules() if type(m) in mixin_of]
    for name, m in targets:
        if mixin_of[type(m)] is M.MLPMixin and getattr(m.config, "hidden_act", None) not in _SILU:
            raise ValueError(f"{name}: swiglu=True needs hidden_act in {_SILU}, got "
                             f"{m.config.hidden_act!r} (pass swiglu=False)")
        if mixin_of[type(m)] is M.ExpertsMixin:
            if getattr(m, "is_transposed", False) or not getattr(m, "is_concatenated", True):
                raise ValueError(f"{name}: experts must store gate_up_proj [E, 2I, H] "
                                 "(concatenated, not transposed) for moe=True")
            if getattr(m, "_is_expert_parallel", False):
                raise ValueError(f"{name}: Hugging Face expert parallelism is not supported "
                                 "by moe=True (use linghe.nn.MoE with linghe.dist)")
            if getattr(m.config, "hidden_act", "silu") not in _SILU:
                raise ValueError(f"{name}: moe=True needs hidden_act in {_SILU}")

    if rope:
        M.install_rope(mm)
    counts: dict[str, int] = {}
    for _, m in targets:
        mixin = mixin_of[type(m)]
        _swap(m, mixin)
        if mixin is M.ExpertsMixin and expert_wgrad_micro_batches != 1:
            m.linghe_wgrad_micro_batches = expert_wgrad_micro_batches
        kind = mixin.__name__.removesuffix("Mixin")
        counts[kind] = counts.get(kind, 0) + 1

    if fp8 is not None:
        layer_cls = M.patched_class(hf("DecoderLayer"), M.DecoderLayerMixin)
        for layer in model.modules():
            if isinstance(layer, layer_cls):
                layer.linghe_fp8 = fp8
                layer.linghe_expert_fp8 = expert_fp8
                n = _convert_linears(layer)
                counts["Linear"] = counts.get("Linear", 0) + n
                _quantize_attention_input(layer)

    if cross_entropy and is_causal_lm:
        fwd = M.make_causal_lm_forward(type(model).forward,
                                       (CausalLMOutputWithPast, MoeCausalLMOutputWithPast,
                                        getattr(mm, "load_balancing_loss_func", None)))
        model.forward = types.MethodType(fwd, model)
        counts["LinearCrossEntropy"] = 1
        model.linghe_lm_head_fp8 = lm_head_fp8
    if caller_thread_backward:
        backward_on_caller_thread(model)
    model.linghe_patched = counts
    model.linghe_fp8 = fp8
    return model


def _convert_linears(layer: torch.nn.Module) -> int:
    """``nn.Linear`` -> ``linghe.nn.Linear`` in one decoder layer (FP8-suited ones, not the
    router); returns how many."""
    before = sum(type(m) is torch.nn.Linear for m in layer.modules())
    convert(layer, fp8_filter=lambda name, m: type(m) is torch.nn.Linear)
    after = sum(type(m) is torch.nn.Linear for m in layer.modules())
    return before - after


def _quantize_attention_input(layer: torch.nn.Module) -> None:
    """Let the attention's input norm emit FP8 (``rms_norm_quant``) when it is patched and
    all of q/k/v are linghe Linears (its only consumers in these families)."""
    norm, attn = getattr(layer, "input_layernorm", None), getattr(layer, "self_attn", None)
    projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if isinstance(norm, M.RMSNormMixin) and all(isinstance(p, LingheLinear) for p in projs):
        norm.linghe_quantize_output = True


_PATCH_FLAGS = ("rms_norm", "rope", "swiglu", "moe", "cross_entropy", "lm_head_fp8",
                "expert_fp8", "caller_thread_backward")


def _split_patch_kwargs(kwargs: dict) -> dict:
    names = (*_PATCH_FLAGS, "fp8", "expert_wgrad_micro_batches")
    return {k: kwargs.pop(k) for k in names if k in kwargs}


def _check_patch_kwargs(patch: dict) -> None:
    """:func:`apply_linghe_kernels`'s checks of its keyword arguments, run before any
    weight is built or loaded."""
    _check_options({k: v for k, v in patch.items() if k in _PATCH_FLAGS}, patch.get("fp8"))
    if patch.get("lm_head_fp8") and (patch.get("fp8") is None
                                     or not patch.get("cross_entropy", True)):
        raise ValueError("lm_head_fp8=True needs fp8='blockwise' and cross_entropy=True "
                         "(the FP8 LM head is linghe.linear_cross_entropy's)")
    check_wgrad_micro_batches(patch.get("expert_wgrad_micro_batches", 1), fp8_wgrad=False)


class AutoLinghePatchedModelForCausalLM:
    """``transformers.AutoModelForCausalLM`` that returns the model patched by
    :func:`apply_linghe_kernels` (its keyword arguments ``rms_norm``, ``rope``, ``swiglu``,
    ``moe``, ``cross_entropy``, ``fp8``, ``lm_head_fp8``, ``expert_fp8``,
    ``expert_wgrad_micro_batches``, ``caller_thread_backward`` are taken out; the rest goes
    to Hugging Face).
    The model type is checked before any weight is built or loaded."""

    def __init__(self, *args, **kwargs):
        raise OSError("use AutoLinghePatchedModelForCausalLM.from_config(config) or "
                      ".from_pretrained(name_or_path)")

    @classmethod
    def from_config(cls, config, **kwargs) -> torch.nn.Module:
        patch = _split_patch_kwargs(kwargs)
        _model_type(config)
        _check_patch_kwargs(patch)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        return apply_linghe_kernels(model, **patch)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> torch.nn.Module:
        patch = _split_patch_kwargs(kwargs)
        config = kwargs.get("config")
        if config is None or isinstance(config, str):
            config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path,
                                                trust_remote_code=kwargs.get(
                                                    "trust_remote_code", False))
        _model_type(config)
        _check_patch_kwargs(patch)
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args,
                                                     **kwargs)
        return apply_linghe_kernels(model, **patch)
