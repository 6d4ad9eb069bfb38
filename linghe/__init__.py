"""linghe: fused Triton kernels for training LLMs, above all FP8 Mixture-of-Experts models.

Public surface: functional ops (``linghe.rms_norm`` ...), the FP8 format (``linghe.fp8``),
modules (``linghe.nn``), optimizer-side kernels (``linghe.optim``) and expert parallelism
(``linghe.dist``).
"""

from . import fp8, nn, optim, reference
from .context import TrainingContext, current_recipe
from .fp8 import Fp8Tensor, quantize_1x128, quantize_128x128
from .fp8.recipe import Fp8Recipe
from .functional.activation import batch_silu_mul_quant, silu_mul, silu_mul_quant
from .functional.gate import group_rms_norm_gate
from .functional.grouped_mm import (
    grouped_mm,
    grouped_mm_fp8,
    grouped_mm_fp8_dgrad,
    grouped_mm_fp8_wgrad,
    quantize_grouped_weight,
)
from .functional.norm import rms_norm, rms_norm_quant
from .functional.permute import permute, unpermute
from .functional.rope import apply_rope, qk_norm_rope, rope_freqs
from .functional.router import router_logits, router_z_loss, topk_route
from .layout import ExpertLayout, max_grouped_rows
from .utils import debug_enabled, set_debug

__version__ = "0.4.0.dev0"

__all__ = [
    "ExpertLayout",
    "Fp8Tensor",
    "batch_silu_mul_quant",
    "debug_enabled",
    "fp8",
    "grouped_mm",
    "grouped_mm_fp8",
    "grouped_mm_fp8_dgrad",
    "grouped_mm_fp8_wgrad",
    "nn",
    "max_grouped_rows",
    "permute",
    "apply_rope",
    "debug_enabled",
    "fp8",
    "group_rms_norm_gate",
    "qk_norm_rope",
    "optim",
    "Fp8Recipe",
    "Fp8Tensor",
    "TrainingContext",
    "current_recipe",
    "debug_enabled",
    "fp8",
    "nn",
    "quantize_1x128",
    "quantize_128x128",
    "quantize_grouped_weight",
    "reference",
    "rms_norm",
    "rms_norm_quant",
    "rope_freqs",
    "set_debug",
    "silu_mul",
    "silu_mul_quant",
    "router_logits",
    "router_z_loss",
    "set_debug",
    "topk_route",
    "unpermute",
]
