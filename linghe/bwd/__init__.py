"""Backward Triton kernels and their launchers, same module names as ``linghe.fwd``."""
