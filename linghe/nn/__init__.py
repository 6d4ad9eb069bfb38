"""torch.nn.Module wrappers over ``linghe.functional`` (no math lives here)."""

from .activation import SwiGLU
from .convert import convert
from .embedding import Embedding
from .linear import Linear
from .loss import CrossEntropyLoss
from .moe import MoE, MoEAux
from .norm import RMSNorm

__all__ = ["CrossEntropyLoss", "Embedding", "Linear", "MoE", "MoEAux", "RMSNorm", "SwiGLU",
           "convert"]
