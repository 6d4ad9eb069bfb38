"""Hugging Face ``transformers`` drop-in: patch Llama, Qwen2, Qwen3 and Qwen3-MoE models with
linghe's kernels.

Needs the ``hf`` extra (``pip install -e ".[hf]"``); ``import linghe`` never imports this
package (nor ``transformers``)::

    from linghe.transformers import apply_linghe_kernels, AutoLinghePatchedModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    apply_linghe_kernels(model)            # in place: same Parameters, same state_dict keys
    loss = model(input_ids, labels=labels).loss   # linear cross entropy: no [N, V] logits
"""

from .patch import (
    FP8_RECIPES,
    SUPPORTED_MODEL_TYPES,
    AutoLinghePatchedModelForCausalLM,
    apply_linghe_kernels,
)

__all__ = ["FP8_RECIPES", "SUPPORTED_MODEL_TYPES", "AutoLinghePatchedModelForCausalLM",
           "apply_linghe_kernels"]
