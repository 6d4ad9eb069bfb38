"""``linghe.nn.convert``: swap a model's ``torch.nn`` layers for linghe's in place."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..functional.linear import WeightCache
from .linear import Linear
from .norm import RMSNorm

#: Smallest in/out features worth an FP8 GEMM (below it quantization costs more than it saves).
MIN_FEATURES = 64


def fp8_suitable(module: torch.nn.Linear) -> bool:
    """Whether a Linear's dims suit FP8: in and out features multiples of 16 and at least
    :data:`MIN_FEATURES`."""
    return all(d % 16 == 0 and d >= MIN_FEATURES
               for d in (module.in_features, module.out_features))


def _swap_linear(mod: torch.nn.Linear) -> Linear:
    new = Linear.__new__(Linear)
    new.__dict__.update(mod.__dict__)  # the very same Parameters (no copy), hooks, flags
    new._fp8_weight_cache = WeightCache()
    return new


def _swap_rmsnorm(mod: torch.nn.Module) -> RMSNorm | None:
    """A ``linghe.nn.RMSNorm`` sharing ``mod``'s weight Parameter, or None when ``mod`` is
    not over one last dimension with an affine weight (then it stays as is)."""
    shape = tuple(mod.normalized_shape)
    if len(shape) != 1 or getattr(mod, "weight", None) is None:
        return None
    eps = mod.eps if mod.eps is not None else torch.finfo(mod.weight.dtype).eps
    new = RMSNorm(shape[0], eps=eps, device="meta", dtype=mod.weight.dtype)
    new.weight = mod.weight  # the very same Parameter
    new.train(mod.training)
    return new


def convert(model: torch.nn.Module, *,
            fp8_filter: Callable[[str, torch.nn.Module], bool] | None = None) -> torch.nn.Module:
    """Swap ``torch.nn.Linear`` for :class:`linghe.nn.Linear` and ``torch.nn.RMSNorm`` (over
    the last dim, with a weight) for :class:`linghe.nn.RMSNorm` in place, keeping the very
    same Parameters (no copy: optimizers and tied weights stay valid). ``eps=None`` becomes
    the weight dtype's machine epsilon (what ``torch.nn.RMSNorm`` uses for that dtype).

    A Linear stays in high precision (untouched) when its dims do not suit FP8 (in or out
    features not a multiple of 16, or under :data:`MIN_FEATURES`) or when
    ``fp8_filter(qualified_name, module)`` returns False. Subclasses of ``torch.nn.Linear``
    other than plain ``torch.nn.Linear`` are left alone. Returns ``model``; ``model`` itself
    is converted when it is a Linear only through its parent, so pass a container.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if fp8_filter is not None and not callable(fp8_filter):
        raise TypeError(f"fp8_filter must be callable (name, module) -> bool, got "
                        f"{type(fp8_filter).__name__}")
    torch_rms = getattr(torch.nn, "RMSNorm", None)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is torch.nn.Linear:
                if not fp8_suitable(child):
                    continue
                if fp8_filter is not None and not fp8_filter(name, child):
                    continue
                setattr(parent, child_name, _swap_linear(child))
            elif torch_rms is not None and type(child) is torch_rms:
                if fp8_filter is not None and not fp8_filter(name, child):
                    continue
                new = _swap_rmsnorm(child)
                if new is not None:
                    setattr(parent, child_name, new)
    return model
