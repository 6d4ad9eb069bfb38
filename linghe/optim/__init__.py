"""Optimizer-side kernels: AdamW with fused clipping, grad norm, clip_grad_norm_, count zeros,
FP8 amax bookkeeping."""

from .adamw import AdamW
from .amax import AmaxHistory
from .clip import clip_grad_norm_, clip_grads_with_norm_, get_total_norm, grad_norm
from .count_zeros import count_zeros
from .multi_tensor import clear_plan_cache

__all__ = ["AdamW", "AmaxHistory", "clear_plan_cache", "clip_grad_norm_", "clip_grads_with_norm_",
           "count_zeros", "get_total_norm", "grad_norm"]
