"""torch.nn.Module wrappers over ``linghe.functional`` (no math lives here)."""

from .loss import CrossEntropyLoss as CrossEntropyLoss
