"""torch.nn.Module wrappers over ``linghe.functional`` (no math lives here)."""

from .norm import RMSNorm

__all__ = ["RMSNorm"]
