"""linghe: fused Triton kernels for training LLMs, above all FP8 Mixture-of-Experts models.

Public surface: functional ops (``linghe.rms_norm`` ...), the FP8 format (``linghe.fp8``),
modules (``linghe.nn``), optimizer-side kernels (``linghe.optim``) and expert parallelism
(``linghe.dist``).
"""

from . import fp8, nn, reference
from .fp8 import Fp8Tensor, quantize_1x128, quantize_128x128
from .functional.loss import cross_entropy, linear_cross_entropy
from .utils import debug_enabled, set_debug

__version__ = "0.4.0.dev0"

__all__ = [
    "Fp8Tensor",
    "cross_entropy",
    "linear_cross_entropy",
    "nn",
    "debug_enabled",
    "fp8",
    "quantize_1x128",
    "quantize_128x128",
    "reference",
    "set_debug",
]
