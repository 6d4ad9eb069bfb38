"""Fused gradient accumulation: a weight-gradient kernel adds into the parameter's ``.grad``.

With gradient accumulation (several forward/backward passes per optimizer step) PyTorch's
``AccumulateGrad`` adds each backward's weight gradient to ``param.grad``: one more pass
over every gradient (two reads and a write, 6 bytes per bf16 parameter), 47 ms of a
4-micro-batch step of the e2e model on an H100 (``benchmark/NOTES.md``). linghe's expert
weight gradients are instead added in the GEMM's epilogue:

1. the backward asks :func:`grad_to_accumulate` for a ``.grad`` it may add into;
2. its kernel adds this backward's gradient to that tensor in place (fp32 sum, one
   rounding, where PyTorch rounds the new gradient and then the sum);
3. :func:`take_grad` takes the tensor off the parameter (``param.grad = None``) and the
   backward returns it as the weight's gradient. ``AccumulateGrad``, finding no
   ``.grad``, installs the returned tensor as it is (no copy, no add): ``param.grad`` is
   the same tensor as before, and post-accumulate hooks (DDP's reducer, FSDP, optimizers
   in backward) run as usual. Should another reference keep ``AccumulateGrad`` from
   taking the tensor (e.g. a DDP bucket view), it copies it: slower, same values.

The fused path is taken only where it cannot change what a user observes: enabled
(``LINGHE_FUSED_GRAD_ACCUMULATION=0`` or :func:`set_fused_grad_accumulation` turn it
off), the weight is a leaf parameter that requires grad and has no tensor hooks
(``register_hook`` would see the accumulated gradient instead of this backward's), the
backward ends in the parameter's AccumulateGrad (``backward()``, not
``torch.autograd.grad`` or ``backward(inputs=...)`` without the parameter), it does not
build a graph (``create_graph``) and is not traced by ``torch.compile``, and ``.grad`` is
a plain contiguous tensor of the parameter's dtype and shape that does not require
grad. Everything else takes the plain path (a new gradient, added by
``AccumulateGrad``).
"""

from __future__ import annotations

import os
import sys

import torch

_enabled: bool = os.environ.get("LINGHE_FUSED_GRAD_ACCUMULATION", "1") != "0"


def set_fused_grad_accumulation(enabled: bool) -> bool:
    """Turn fused gradient accumulation on or off (process-wide); returns the previous
    setting. The default comes from ``LINGHE_FUSED_GRAD_ACCUMULATION`` (on unless "0")."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def fused_grad_accumulation() -> bool:
    """Whether fused gradient accumulation is on."""
    return _enabled


def accumulation_param(weight: torch.Tensor) -> torch.Tensor | None:
    """In a Function's forward: ``weight`` itself where its backward may accumulate into
    ``weight.grad`` later (a leaf that requires grad, outside ``torch.compile``), else
    ``None``. Keep the result on ``ctx`` (not in ``save_for_backward``: only its
    ``.grad`` is used)."""
    if (_enabled and weight.is_leaf and weight.requires_grad
            and not torch.compiler.is_compiling()):
        return weight
    return None


def grad_to_accumulate(param: torch.Tensor | None) -> torch.Tensor | None:
    """In a backward: ``param.grad`` where this backward may add its weight gradient to
    it in place and return it through :func:`take_grad`, else ``None`` (module
    docstring)."""
    if param is None or not _enabled or torch.is_grad_enabled():
        return None
    grad = param.grad
    if (grad is None or type(grad) is not torch.Tensor or grad.layout != torch.strided
            or grad.dtype != param.dtype or grad.shape != param.shape
            or grad.device != param.device or not grad.is_contiguous()
            or grad.requires_grad or getattr(param, "_backward_hooks", None)):
        return None
    refs, unshared = _references(grad), _unshared_references()
    if refs[0] > unshared[0] or refs[1] > unshared[1]:
        return None
    return grad if _accumulate_grad_will_run(param) else None


def _references(grad: torch.Tensor) -> tuple[int, int]:
    """``(Python references, C++ uses)`` of ``grad``, called with the caller's local name
    for it. More than :func:`_unshared_references` means something besides
    ``param.grad`` holds it: a Python name (a user's alias) or a C++ reference (e.g. a
    DDP bucket view); AccumulateGrad would then copy the returned tensor instead of
    installing it, and the holder would lose track of ``.grad`` (PyTorch's own in-place
    add keeps them together)."""
    use_count = getattr(grad, "_use_count", None)
    return sys.getrefcount(grad), use_count() if use_count is not None else 0


_UNSHARED: tuple[int, int] | None = None


def _unshared_references() -> tuple[int, int]:
    """:func:`_references` of a ``.grad`` that nothing else holds, measured once on a
    small parameter (PyTorch versions differ in how a tensor owns its Python object)."""
    global _UNSHARED
    if _UNSHARED is None:
        p = torch.zeros(1, requires_grad=True)
        p.grad = torch.zeros(1)

        def probe(param):  # the same call depth as grad_to_accumulate's
            grad = param.grad
            return _references(grad)

        _UNSHARED = probe(p)
    return _UNSHARED


def _accumulate_grad_will_run(param: torch.Tensor) -> bool:
    """Whether this backward ends in ``param``'s AccumulateGrad: ``backward()`` does,
    ``backward(inputs=...)`` without ``param`` and ``torch.autograd.grad`` (which returns
    the gradient instead, and must leave ``param.grad`` alone) do not."""
    try:
        node = torch.autograd.graph.get_gradient_edge(param).node
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):
        # autograd.grad() refuses the question for a leaf's node: it is not accumulating
        return False


def take_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Clear ``param.grad`` (which is ``grad``, now holding the accumulated sum) and
    return ``grad``: the backward's result for the weight, which ``AccumulateGrad``
    installs again as ``param.grad`` without adding."""
    param.grad = None
    return grad
