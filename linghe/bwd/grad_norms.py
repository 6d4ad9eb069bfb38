"""Squared norms of expert weight gradients from the wgrad kernel that wrote them.

Gradient clipping reads every gradient once to compute the total norm (on the e2e model,
4.75 ms of a ~105 ms step, 90% of it the routed experts' gradients). The expert wgrad
kernel (:func:`~linghe.bwd.grouped_mm.launch_wgrad_parts`) can sum the squares of the
values it stores, so the clipping need not read those gradients again. Opt-in:
``linghe.optim.AdamW(max_grad_norm=..., norm_from_backward=True)``.

1. the optimizer :func:`watch`\\ es its parameters;
2. a backward that writes a watched weight's final gradient (the tensor that becomes or
   is ``.grad``) through the TMA wgrad :func:`record`\\ s the per-tile squared sums, with
   the gradient's storage (its Python object outlives AccumulateGrad's ``detach()``) and
   version counter;
3. the optimizer's clipping :func:`take`\\ s a record only while ``.grad`` is exactly what
   was recorded: the same storage, shape and version. Any in-place change through PyTorch
   (``mul_``, ``copy_``, AccumulateGrad adding a later micro-batch) bumps the version, and
   linghe's own in-place gradient kernels write a new record or bump it, so the record is
   dropped and the gradient is read as usual.

Not seen (hence opt-in): writes that do not bump the version counter, e.g.
``torch.distributed`` collectives on ``.grad`` (``all_reduce`` leaves ``_version``
unchanged) or writes through ``.data``. Reduce such gradients through the clipping's
``group=`` instead, or leave ``norm_from_backward`` off.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..utils import capture_pauses_bookkeeping

#: weights whose gradients' squared norms are recorded -> how many watchers
_WATCHED: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: weight -> (weakref to the gradient's storage, version, shape, per-tile squared sums)
_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def watch(params, owner=None) -> None:
    """Record the gradients' squared norms of these weights from now on (until
    :func:`unwatch`, or until ``owner``, e.g. the optimizer, is garbage-collected)."""
    params = [p for p in params if isinstance(p, torch.Tensor)]
    for p in params:
        _WATCHED[p] = _WATCHED.get(p, 0) + 1
    if owner is not None:
        weakref.finalize(owner, unwatch, params)


def unwatch(params) -> None:
    """Undo one :func:`watch` of these weights."""
    for p in params:
        n = _WATCHED.get(p, 0) - 1
        if n > 0:
            _WATCHED[p] = n
        else:
            _WATCHED.pop(p, None)
            _RECORDS.pop(p, None)


def watched(weight: torch.Tensor | None) -> bool:
    """Whether a backward should record ``weight``'s gradient norm (a cheap test)."""
    return (weight is not None and bool(_WATCHED) and weight in _WATCHED
            and not capture_pauses_bookkeeping(weight))


def record(weight: torch.Tensor, grad: torch.Tensor, sq: torch.Tensor) -> None:
    """``sq`` (float32, any shape) sums to ``||grad||^2``, and ``grad`` is (or becomes, by
    AccumulateGrad) ``weight.grad``. Call it after the last write to ``grad``."""
    _RECORDS[weight] = (weakref.ref(grad.untyped_storage()), grad._version,
                        tuple(grad.shape), sq)


def take(weight: torch.Tensor, consume: bool = True) -> torch.Tensor | None:
    """The recorded squared sums of ``weight.grad`` if it is still what was recorded, else
    ``None``; the record is forgotten either way unless ``consume`` is False (a look that
    leaves it for the step, e.g. to prepare a captured step's tables)."""
    rec = _RECORDS.pop(weight, None) if consume else _RECORDS.get(weight)
    grad = weight.grad
    if rec is None or grad is None:
        return None
    storage, version, shape, sq = rec
    if (storage() is not grad.untyped_storage() or grad._version != version
            or tuple(grad.shape) != shape or type(grad) is not torch.Tensor):
        return None
    return sq
