"""``WeightCache``: a weight's quantized copy, made once per optimizer step.

FP8 layers quantize their weights for every forward (and need the columnwise copy again
in the backward's dgrad). With gradient accumulation a weight is unchanged across the
micro-batches of a step, so quantizing it again is wasted GPU time and launches. A
``WeightCache`` keeps the last quantized copy and hands it out while the weight is the
same tensor with the same contents, judged on the host with no GPU work:

- the optimizer-step generation: every ``step()`` of any ``torch.optim.Optimizer`` bumps
  it (a global step post-hook), so all caches miss after a step. The version counter
  alone is not enough: PyTorch's fused optimizers (``AdamW(fused=True)``) update the
  parameters in place without bumping it. An optimizer outside ``torch.optim`` must call
  :func:`invalidate_weight_caches` after it changes the weights;
- ``weight._version``: bumped by in-place updates through the parameter (for-loop and
  foreach optimizers, ``p.mul_(...)``, ``p.copy_(...)`` under ``torch.no_grad()``,
  ``load_state_dict``);
- ``weight.data_ptr()``, shape, dtype and device: a replaced storage (``p.data = ...``,
  ``module.to(...)``);
- a format key from the caller (what ``quantize`` makes: recipe, scaling, pow2 scales).

Not seen (call :meth:`WeightCache.clear`): writes through a separate alias of the same
storage, e.g. ``p.data.add_(...)`` (``.data`` has its own version counter) or a view
taken before the update. The cache holds the quantized copy (about 2 bytes per
parameter with both copies) until the next miss or :meth:`clear`.

**Filled by the optimizer.** A cache whose copy is ``quantize_128x128`` of the weight (or
of a 2-D view of it) binds itself to the weight (:meth:`WeightCache.bind_128x128`);
:class:`linghe.optim.AdamW` then writes that copy in the same pass as its update
(:mod:`linghe.optim.fp8_weights`) and puts it in the cache
(:meth:`WeightCache.put_from_optimizer`), so the next forward hits instead of reading the
weight again. Such a copy is checked against the weight's version, address, shape,
dtype and device and against :func:`invalidate_weight_caches`, not against the
generation (other optimizers' steps do not touch it); the AdamW that made it clears it
when it steps the weight without making a new one. The optimizer rewrites its copy in
place (the same buffers every step), so a forward captured in a CUDA graph that read it
reads what a captured update wrote. While a graph is being captured such a copy is
handed out only inside :func:`linghe.whole_step_capture` (whose captures also hold the
update); otherwise it is a miss: the captured forward contains its own quantization,
because an optimizer step captured alone does not fill caches.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..utils import capture_pauses_bookkeeping
from .tensor import Fp8Tensor

#: Bumped after every optimizer step (and by :func:`invalidate_weight_caches`); part of
#: every cache key.
_GENERATION = [0]
#: Bumped by :func:`invalidate_weight_caches` only: what a copy put by an optimizer
#: (:meth:`WeightCache.put_from_optimizer`) is checked against instead of the generation.
_EPOCH = [0]


def invalidate_weight_caches() -> None:
    """Make every :class:`WeightCache` miss once: call it after changing weights in a way
    the caches cannot see (an optimizer that is not a ``torch.optim.Optimizer``, writes
    through ``p.data`` or another alias, another optimizer updating a weight that
    :class:`linghe.optim.AdamW` also steps). ``torch.optim`` steps do this automatically
    for the copies they do not make themselves."""
    _GENERATION[0] += 1
    _EPOCH[0] += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    _GENERATION[0] += 1


register_optimizer_step_post_hook(_after_optimizer_step)

#: weight -> {id(cache): (weakref to the cache, format key, pow2_scale, 2-D shape)}: the
#: caches an optimizer may fill for that weight (:meth:`WeightCache.bind_128x128`).
_BINDINGS = WeakIdKeyDictionary()


def bound_caches(weight: torch.Tensor) -> list[tuple]:
    """The live bindings of ``weight``: ``[(cache, fmt, pow2_scale, (N, K)), ...]``."""
    out = []
    for ref, fmt, pow2, shape2d in _BINDINGS.get(weight, {}).values():
        cache = ref()
        if cache is not None:
            out.append((cache, fmt, pow2, shape2d))
    return out


class WeightCache:
    """Holds one weight's quantized copy between optimizer steps.

    ``get(weight, quantize, fmt)`` returns the cached copy when the key (see the module
    docstring) matches, else runs ``quantize(weight.detach())`` under ``torch.no_grad()``
    and keeps its result. ``hits``/``misses`` count the lookups. A copied or pickled
    cache starts empty (it is derived data).
    """

    def __init__(self):
        self.key = None
        self.value: Fp8Tensor | None = None
        self.amax: torch.Tensor | None = None  # the delayed recipe's amax of the weight
        self.from_optimizer = False  # the value was put by an optimizer's step
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        """Drop the cached copy (the next ``get`` quantizes)."""
        self.key = self.value = self.amax = None
        self.from_optimizer = False

    def bind_128x128(self, weight: torch.Tensor, fmt: Hashable, pow2_scale: bool,
                     shape2d: tuple[int, int]) -> None:
        """Declare that this cache holds ``quantize_128x128(weight.reshape(shape2d),
        columnwise=True, pow2_scale=pow2_scale)`` (as an :class:`Fp8Tensor` of
        ``weight``'s shape and dtype) under format key ``fmt``, so that an optimizer may
        make that copy in its step (see the module docstring). Held weakly on both
        sides."""
        _BINDINGS.setdefault(weight, {})[id(self)] = (weakref.ref(self), fmt,
                                                      bool(pow2_scale), tuple(shape2d))

    def put_from_optimizer(self, weight: torch.Tensor, value: Fp8Tensor,
                           fmt: Hashable) -> None:
        """Hold ``value`` as ``weight``'s copy in format ``fmt``: for an optimizer that has
        just updated ``weight`` in ``step()`` and quantized it there. Valid while the
        weight's version, address, shape, dtype and device stay and
        :func:`invalidate_weight_caches` is not called (the generation is not checked:
        the step's own post-hook advances it)."""
        self.value, self.amax, self.from_optimizer = value, None, True
        self.key = (_EPOCH[0],) + self.key_of(weight, fmt)[1:]

    def __deepcopy__(self, memo):
        return WeightCache()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    @staticmethod
    def key_of(weight: torch.Tensor, fmt: Hashable) -> tuple:
        """The cache key of ``weight`` quantized in format ``fmt`` (host-only)."""
        return (_GENERATION[0], weight._version, weight.data_ptr(), weight.shape,
                weight.dtype, weight.device, fmt)

    def get(self, weight: torch.Tensor, quantize: Callable[[torch.Tensor], Fp8Tensor],
            fmt: Hashable = None) -> Fp8Tensor:
        """The quantized copy of ``weight``: cached while ``weight`` and ``fmt`` are
        unchanged, else ``quantize(weight.detach())`` (kept for the next call)."""
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        key = self.key_of(weight, fmt)
        if self.from_optimizer:
            hit = (self.key[0] == _EPOCH[0] and self.key[1:] == key[1:]
                   and not capture_pauses_bookkeeping(weight))
        else:
            hit = self.key == key
        if hit and self.value is not None:
            self.hits += 1
            return self.value
        self.misses += 1
        self.value = self.amax = None  # never hand out a stale copy if quantize raises
        self.from_optimizer = False
        with torch.no_grad():
            value = quantize(weight.detach())
        if not isinstance(value, Fp8Tensor):
            raise TypeError(f"quantize must return an Fp8Tensor, got {type(value).__name__}")
        self.value, self.key = value, key
        return value

    def get_for_recipe(self, weight: torch.Tensor, recipe, slot) -> Fp8Tensor:
        """``weight [N, K]`` quantized by ``recipe.quantize_weight`` (both copies).

        The delayed recipe records the weight's amax in ``slot`` on every call, hit or
        miss, so its amax history advances as if the weight were quantized each time."""
        state = recipe.state
        hits = self.hits

        fmt = (recipe.name, recipe.pow2_scale, id(state))

        def quantize(w):
            if recipe.name == "blockwise" and w.dim() == 2:  # (bind the weight itself)
                self.bind_128x128(weight, fmt, recipe.pow2_scale, tuple(w.shape))
            return recipe.quantize_weight(w.contiguous(), key=slot)

        value = self.get(weight, quantize, fmt)
        if state is not None:
            if self.hits > hits:
                state.record(slot, self.amax, recipe.fwd_dtype)
            else:
                self.amax = weight.detach().abs().amax().float().reshape(1)
        return value
