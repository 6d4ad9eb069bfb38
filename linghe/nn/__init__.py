"""torch.nn.Module wrappers over ``linghe.functional`` (no math lives here)."""

from .activation import SwiGLU
from .norm import RMSNorm

__all__ = ["RMSNorm", "SwiGLU"]
from .convert import convert
from .linear import Linear

__all__ = ["Linear", "convert"]
