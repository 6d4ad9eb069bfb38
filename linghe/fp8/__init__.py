"""The FP8 format: the quantized-tensor container and blockwise quantization kernels."""

from .quantize import FP8_DTYPE, FP8_MAX, quantize_1x128, quantize_128x128
from .tensor import Fp8Tensor

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Tensor", "quantize_1x128", "quantize_128x128"]

from . import gemm  # noqa: E402
from .cache import WeightCache, invalidate_weight_caches  # noqa: E402
from .recipe import Fp8Recipe  # noqa: E402
from .tensorwise import quantize_tensorwise  # noqa: E402

__all__ += ["Fp8Recipe", "WeightCache", "gemm", "invalidate_weight_caches", "quantize_tensorwise"]
