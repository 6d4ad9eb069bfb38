"""torch.nn.Module wrappers over ``linghe.functional`` (no math lives here)."""

from .activation import SwiGLU
from .norm import RMSNorm

__all__ = ["RMSNorm", "SwiGLU"]
