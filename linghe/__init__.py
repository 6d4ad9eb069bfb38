"""linghe: fused Triton kernels for training LLMs, above all FP8 Mixture-of-Experts models.

Public surface: functional ops (``linghe.rms_norm`` ...), the FP8 format (``linghe.fp8``),
modules (``linghe.nn``), optimizer-side kernels (``linghe.optim``) and expert parallelism
(``linghe.dist``).
"""

from . import fp8, nn, optim, reference
from .bwd.accumulate import fused_grad_accumulation, set_fused_grad_accumulation
from .bwd.deferred import discard_deferred_wgrad, flush_deferred_wgrad
from .context import TrainingContext, backward_on_caller_thread, current_recipe
from .fp8 import Fp8Tensor, quantize_1x128, quantize_128x128
from .fp8.recipe import Fp8Recipe
from .functional.activation import batch_silu_mul_quant, silu_mul, silu_mul_quant
from .functional.embedding import embedding
from .functional.gate import group_rms_norm_gate
from .functional.grouped_mm import (
    grouped_mm,
    grouped_mm_fp8,
    grouped_mm_fp8_dgrad,
    grouped_mm_fp8_wgrad,
    quantize_grouped_1x128,
    quantize_grouped_weight,
)
from .functional.loss import cross_entropy, linear_cross_entropy
from .functional.moe import grouped_swiglu, quantize_tokens
from .functional.norm import rms_norm, rms_norm_quant
from .functional.permute import permute, unpermute
from .functional.rope import apply_rope, qk_norm_rope, rope_freqs
from .functional.router import router_logits, router_z_loss, topk_route
from .layout import ExpertLayout, max_grouped_rows
from .utils import debug_enabled, set_debug, whole_step_capture

__version__ = "0.4.0.dev0"

__all__ = [
    "apply_rope",
    "backward_on_caller_thread",
    "batch_silu_mul_quant",
    "cross_entropy",
    "current_recipe",
    "debug_enabled",
    "discard_deferred_wgrad",
    "embedding",
    "ExpertLayout",
    "flush_deferred_wgrad",
    "fp8",
    "Fp8Recipe",
    "Fp8Tensor",
    "fused_grad_accumulation",
    "group_rms_norm_gate",
    "grouped_mm",
    "grouped_mm_fp8",
    "grouped_mm_fp8_dgrad",
    "grouped_mm_fp8_wgrad",
    "grouped_swiglu",
    "linear_cross_entropy",
    "max_grouped_rows",
    "nn",
    "optim",
    "permute",
    "qk_norm_rope",
    "quantize_128x128",
    "quantize_1x128",
    "quantize_grouped_1x128",
    "quantize_grouped_weight",
    "quantize_tokens",
    "reference",
    "rms_norm",
    "rms_norm_quant",
    "rope_freqs",
    "router_logits",
    "router_z_loss",
    "set_debug",
    "set_fused_grad_accumulation",
    "silu_mul",
    "silu_mul_quant",
    "topk_route",
    "TrainingContext",
    "unpermute",
    "whole_step_capture",
]
