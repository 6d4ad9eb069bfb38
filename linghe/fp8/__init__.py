"""The FP8 format: the quantized-tensor container and blockwise quantization kernels."""

from .quantize import FP8_DTYPE, FP8_MAX, quantize_1x128, quantize_128x128
from .tensor import Fp8Tensor

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Tensor", "quantize_1x128", "quantize_128x128"]
