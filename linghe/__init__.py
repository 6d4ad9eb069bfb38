"""linghe: fused Triton kernels for training LLMs, above all FP8 Mixture-of-Experts models.

Public surface: functional ops (``linghe.rms_norm`` ...), the FP8 format (``linghe.fp8``),
modules (``linghe.nn``), optimizer-side kernels (``linghe.optim``) and expert parallelism
(``linghe.dist``).
"""

from . import fp8, nn, reference
from .context import TrainingContext, current_recipe
from .fp8 import Fp8Tensor, quantize_1x128, quantize_128x128
from .fp8.recipe import Fp8Recipe
from .utils import debug_enabled, set_debug

__version__ = "0.4.0.dev0"

__all__ = [
    "Fp8Recipe",
    "Fp8Tensor",
    "TrainingContext",
    "current_recipe",
    "debug_enabled",
    "fp8",
    "nn",
    "quantize_1x128",
    "quantize_128x128",
    "reference",
    "set_debug",
]
