"""Optimizer-side kernels: grad norm, clip_grad_norm_, count zeros, FP8 amax bookkeeping."""
