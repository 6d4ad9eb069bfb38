"""linghe: fused Triton kernels for training LLMs, above all FP8 Mixture-of-Experts models.

Public surface: functional ops (``linghe.rms_norm`` ...), the FP8 format (``linghe.fp8``),
modules (``linghe.nn``), optimizer-side kernels (``linghe.optim``) and expert parallelism
(``linghe.dist``).
"""

from . import fp8, reference
from .fp8 import Fp8Tensor, quantize_1x128, quantize_128x128
from .functional.gate import group_rms_norm_gate
from .functional.rope import apply_rope, qk_norm_rope, rope_freqs
from .utils import debug_enabled, set_debug

__version__ = "0.4.0.dev0"

__all__ = [
    "Fp8Tensor",
    "apply_rope",
    "debug_enabled",
    "fp8",
    "group_rms_norm_gate",
    "qk_norm_rope",
    "quantize_1x128",
    "quantize_128x128",
    "reference",
    "rope_freqs",
    "set_debug",
]
