"""torch.nn.Module wrappers over ``linghe.functional`` (no math lives here)."""

from .convert import convert
from .linear import Linear

__all__ = ["Linear", "convert"]
