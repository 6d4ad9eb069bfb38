"""Deferred weight gradients: the wgrad of several micro-batches as one GEMM (the routed
experts' here; the FP8 LM head's in :mod:`linghe.functional.loss` on the same registry).

With gradient accumulation every micro-batch's backward computes the routed experts'
weight gradients and adds them to ``.grad``. With many experts each one sees few rows
per micro-batch (256 experts, 8192 tokens top-8: ~256), so each wgrad GEMM has a short
contraction and still reads and writes the whole gradient (``[E, N, K]``: 2.1 GB in bf16
for the gate_up weight of one Ling-mini layer). On an H100, 4 micro-batches cost 8.5 ms
per layer for that weight; one launch over all four micro-batches' rows costs 4.2 ms
(``benchmark/probe_deferred_wgrad.py``).

``wgrad_micro_batches=n`` (:class:`linghe.nn.MoE`'s attribute, the ``grouped_swiglu`` /
``grouped_mm`` argument) turns that on for the expert weights:

1. a backward keeps its wgrad operands (``d_out``, and the rows as the GEMM multiplied
   them: FP8 rows stay FP8 until used) in the weight's stash instead of computing the
   gradient, and returns no gradient for the weight;
2. the ``n``-th backward since the last hand-over computes the gradient of all pending
   micro-batches and its own in one launch (:func:`launch_wgrad_parts`; elsewhere a
   documented fallback: one wgrad, then accumulating ones) and hands it over as any
   backward does (added into ``.grad`` by the wgrad kernel where
   :mod:`linghe.bwd.accumulate` allows, else by ``AccumulateGrad``; hooks run then).

Set ``n`` to the number of micro-batches per optimizer step. Until the ``n``-th backward,
the expert weights' ``.grad`` lacks the pending micro-batches, and the stash holds their
operands (``R x (N + K)`` elements per weight and micro-batch: ~0.9 GB per Ling-mini layer
in bf16). Pending micro-batches are computed into ``.grad`` by
:func:`flush_deferred_wgrad`, which runs by itself before every ``torch.optim``
optimizer's ``step()`` (a global step pre-hook, so a step that ran fewer than ``n``
micro-batches is still exact) and in :func:`linghe.optim.clip_grad_norm_`; call it
yourself before reading ``.grad`` otherwise (e.g. ``torch.nn.utils.clip_grad_norm_``).
:func:`discard_deferred_wgrad` drops them.

A backward does not defer (it computes its own gradient, as without the setting, and
leaves the stash alone) when it cannot hand a gradient to ``.grad`` later: under
``torch.autograd.grad`` or ``backward(inputs=...)`` without the weight, with
``create_graph``, under ``torch.compile`` / compiled autograd, or while a CUDA graph is
being captured (a replayed graph does not run this bookkeeping), unless the capture spans
whole steps (:func:`linghe.whole_step_capture`). A stash made before the
weight changed in place (its version counter moved) or was replaced (``p.data = ...``,
a move to another device) raises ``RuntimeError`` instead of adding stale products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..fp8.quantize import dequantize_1x128_rows
from ..fwd.grouped_mm import tma_capable
from ..utils import capture_pauses_bookkeeping
from . import grad_norms
from . import grouped_mm as bwd_gm
from .accumulate import _accumulate_grad_will_run, _in_compiled_autograd


@dataclass
class WgradPart:
    """One micro-batch's operands of ``dW_e = d_out_e^T @ rows_e``: ``d_out [R, N]``,
    ``rows [R, K]`` in ``d_out``'s dtype, or FP8 e4m3 with ``rows_scale [R, cdiv(K,
    128)]`` (the rowwise 1x128 copy the forward GEMM multiplied), or a
    :class:`~linghe.fwd.permute.TokenRows` (those FP8 rows as the tokens they were
    permuted from; ``rows_scale`` None: made by :func:`prepare_wgrad_parts`),
    ``offsets [E + 1]``."""

    d_out: torch.Tensor
    rows: torch.Tensor
    rows_scale: torch.Tensor | None
    offsets: torch.Tensor


class Stash:
    """A weight's pending micro-batches (``parts``) and what the weight was when the
    first was stashed (a later change makes them stale). The experts' stash holds
    :class:`WgradPart` s; other deferring ops subclass it (the FP8 LM head:
    :class:`linghe.functional.loss.HeadWgradStash`) and override :meth:`flush`."""

    __slots__ = ("parts", "version", "data_ptr")

    def __init__(self, weight: torch.Tensor):
        self.parts: list = []
        self.version, self.data_ptr = weight._version, weight.data_ptr()

    def flush(self, w: torch.Tensor) -> None:
        """Compute the pending micro-batches into ``w.grad`` (the experts' parts: one
        multi-part wgrad launch, into ``.grad`` in place where it can)."""
        grad = w.grad
        norm_weight = w if grad_norms.watched(w) else None
        if (grad is not None and grad.dtype == w.dtype and grad.is_contiguous()
                and grad.shape == w.shape):
            # a kernel writes it in place: bump its version (before the norm's record)
            torch.autograd.graph.increment_version(grad)
            wgrad_parts(self.parts, grad, norm_weight=norm_weight)
        elif grad is None:
            w.grad = wgrad_parts(self.parts, None, out_dtype=w.dtype,
                                 norm_weight=norm_weight)
        else:
            grad.add_(wgrad_parts(self.parts, None, out_dtype=w.dtype))


#: weight -> its pending micro-batches.
_STASHES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def deferrable(weight: torch.Tensor, micro_batches: int) -> torch.Tensor | None:
    """In a forward: ``weight`` where its backward may defer its gradient (``micro_batches
    > 1``, a leaf that requires grad, not under ``torch.compile``), else ``None``. Keep the
    result on ``ctx`` and pass it to :func:`defer` in the backward."""
    if (micro_batches > 1 and weight.is_leaf and weight.requires_grad
            and not torch.compiler.is_compiling()):
        return weight
    return None


def defer(weight: torch.Tensor | None, micro_batches: int,
          part: WgradPart) -> list[WgradPart] | None:
    """In a backward, for ``weight`` (from :func:`deferrable`): ``None`` when ``part`` was
    stashed (return no gradient for the weight), else the parts whose wgrads sum to the
    gradient to hand over now: the pending ones and ``part`` (just ``[part]`` when this
    backward cannot defer, see the module docstring)."""
    if weight is None or not can_defer(weight):
        return [part]
    stash = _STASHES.get(weight)
    if stash is None:
        stash = _STASHES[weight] = Stash(weight)
    _check_version(weight, stash)
    if len(stash.parts) + 1 < micro_batches:
        stash.parts.append(part)
        return None
    del _STASHES[weight]
    return stash.parts + [part]


def can_defer(weight: torch.Tensor) -> bool:
    """In a backward: whether ``weight``'s gradient may be handed over later (see the
    module docstring for when it may not)."""
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling()
                or _in_compiled_autograd()
                or capture_pauses_bookkeeping(weight)
                or not _accumulate_grad_will_run(weight))


def _stale(weight: torch.Tensor, stash: Stash) -> bool:
    """Whether ``weight`` changed in place or was replaced since ``stash`` was made."""
    return weight._version != stash.version or weight.data_ptr() != stash.data_ptr


def _check_version(weight: torch.Tensor, stash: Stash) -> None:
    if _stale(weight, stash):
        n = len(stash.parts)
        del _STASHES[weight]
        raise RuntimeError(
            f"a weight changed (in place or replaced) while {n} micro-batch(es) of its "
            "deferred gradient were pending (wgrad_micro_batches): their products are "
            "stale and were dropped. Call linghe.flush_deferred_wgrad() before changing the "
            "weights (torch.optim optimizers do it in step()) or discard_deferred_wgrad() "
            "to drop them")


def stash_of(weight: torch.Tensor) -> Stash | None:
    """``weight``'s stash, if it has one, checked against the weight's changes: one with
    pending micro-batches raises (:func:`_check_version`), one with none (only
    reservations, e.g. the FP8 head's) is dropped and ``None`` returned."""
    stash = _STASHES.get(weight)
    if stash is not None and not stash.parts and _stale(weight, stash):
        del _STASHES[weight]
        return None
    if stash is not None:
        _check_version(weight, stash)
    return stash


def set_stash(weight: torch.Tensor, stash: Stash | None) -> None:
    """Register ``stash`` as ``weight``'s (``None``: drop it, without computing it)."""
    if stash is None:
        _STASHES.pop(weight, None)
    else:
        _STASHES[weight] = stash


def pending_micro_batches(weight: torch.Tensor) -> int:
    """How many micro-batches of ``weight``'s gradient are pending (stashed)."""
    stash = _STASHES.get(weight)
    return 0 if stash is None else len(stash.parts)


def prepare_wgrad_parts(parts: list[WgradPart]) -> list[WgradPart]:
    """``parts`` as :func:`wgrad_parts` reads them: FP8 rows dequantized to ``d_out``'s
    dtype where its launch reads 16-bit rows (as
    :func:`~linghe.bwd.grouped_mm.wgrad_accumulate_operand`), so that a backward can
    allocate everything before it adds into any ``.grad``."""
    out = []
    for p in parts:
        x, s = bwd_gm.wgrad_accumulate_operand(p.rows, p.rows_scale, p.d_out.dtype)
        out.append(p if x is p.rows else WgradPart(p.d_out, x, s, p.offsets))
    return out


def wgrad_parts(parts: list[WgradPart], out: torch.Tensor | None, *,
                out_dtype: torch.dtype | None = None,
                norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_p dW(parts[p])`` over the parts' segments, added into ``out`` (``[E, N, K]``,
    contiguous) when given, else a new tensor of ``out_dtype``. FP8 rows are dequantized
    first (:func:`prepare_wgrad_parts`; prepared parts allocate nothing more when
    ``out`` is given). One launch (Hopper, TMA-describable operands: fp32 sum, one
    rounding per up to :data:`~linghe.bwd.grouped_mm.MAX_PARTS` parts); the fallback
    elsewhere: the first part's wgrad, then accumulating wgrads (a rounding per part).

    ``norm_weight``: the weight whose gradient the result is (or becomes); the one-launch
    kernel then also sums its squares and records them for that weight's gradient norm
    (:mod:`linghe.bwd.grad_norms`; the fallback records nothing). Call it after any other
    write to ``out``."""
    parts = prepare_wgrad_parts(parts)
    g0 = parts[0].d_out
    E, N, K = parts[0].offsets.numel() - 1, g0.shape[1], parts[0].rows.shape[1]
    fresh = out is None
    if fresh:
        out = torch.empty(E, N, K, dtype=out_dtype or g0.dtype, device=g0.device)
    if (all(p.rows_scale is None for p in parts) and tma_capable(out)
            and all(bwd_gm.wgrad_tma_unsupported(p.d_out, p.rows, out) is None
                    for p in parts)):
        _, sq = bwd_gm.launch_wgrad_parts([(p.d_out, p.rows, p.offsets) for p in parts], out,
                                          accumulate=not fresh,
                                          norm_sq=norm_weight is not None)
        if sq is not None:
            grad_norms.record(norm_weight, out, sq)
        return out
    for i, p in enumerate(parts):  # fallback: a launch per part
        if i == 0 and fresh:
            x = p.rows
            if p.rows_scale is not None:
                x = dequantize_1x128_rows(x, p.rows_scale, p.d_out.dtype)
            out = bwd_gm.grouped_mm_wgrad(p.d_out, x, p.offsets, out_dtype=out.dtype,
                                          backend="triton")
        else:
            bwd_gm.grouped_mm_wgrad_accumulate_(out, p.d_out, p.rows, p.offsets,
                                                rows_scale=p.rows_scale)
    return out


def parts_wgrad(parts: list[WgradPart], out: torch.Tensor | None, *,
                out_dtype: torch.dtype | None = None, backend: str = "auto",
                norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The weight gradient a backward hands over for ``parts`` (what :func:`defer`
    returned), added into ``out`` (fused accumulation) or a new tensor of ``out_dtype``:
    several parts, or a weight whose squared norm is recorded (``norm_weight``), take the
    one multi-part launch (:func:`wgrad_parts`); a single micro-batch takes its own wgrad
    (the accumulating kernel into ``out``, else ``grouped_mm_wgrad`` of ``backend`` on its
    rows, FP8 rows dequantized)."""
    if len(parts) > 1 or norm_weight is not None:
        return wgrad_parts(parts, out, out_dtype=out_dtype, norm_weight=norm_weight)
    p = prepare_wgrad_parts(parts)[0]  # (rows kept as tokens are made here)
    if out is not None:
        bwd_gm.grouped_mm_wgrad_accumulate_(out, p.d_out, p.rows, p.offsets,
                                            rows_scale=p.rows_scale)
        return out
    x = p.rows if p.rows_scale is None else dequantize_1x128_rows(p.rows, p.rows_scale,
                                                                  p.d_out.dtype)
    return bwd_gm.grouped_mm_wgrad(p.d_out, x, p.offsets, out_dtype=out_dtype,
                                   backend=backend)


def _pending(parameters) -> list[torch.Tensor]:
    """The weights with pending micro-batches among ``parameters`` (``None``: all)."""
    if parameters is None:
        return list(_STASHES.keys())
    return [p for p in parameters if p in _STASHES]


@torch.no_grad()
def flush_deferred_wgrad(parameters=None) -> int:
    """Compute the pending micro-batches of deferred expert weight gradients (module
    docstring) into ``.grad``: of ``parameters`` (an iterable of tensors) or, with
    ``None``, of every weight. Returns how many weights had pending micro-batches. Runs
    by itself before every ``torch.optim`` optimizer's ``step()`` and in
    :func:`linghe.optim.clip_grad_norm_`."""
    if not _STASHES:
        return 0
    n = 0
    for w in _pending(parameters):
        stash = _STASHES[w]
        if stash.parts:  # (a stash of reservations only is dropped, changed weight or not)
            _check_version(w, stash)
            stash.flush(w)
            n += 1
        del _STASHES[w]
    return n


def discard_deferred_wgrad(parameters=None) -> int:
    """Drop the pending micro-batches of ``parameters`` (``None``: of every weight)
    without computing them. Returns how many weights had some."""
    n = 0
    for w in _pending(parameters):
        n += bool(_STASHES[w].parts)
        del _STASHES[w]
    return n


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    if _STASHES:
        flush_deferred_wgrad(p for group in optimizer.param_groups for p in group["params"])


register_optimizer_step_pre_hook(_before_optimizer_step)
