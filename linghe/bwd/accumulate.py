"""Fused gradient accumulation: a weight-gradient kernel adds into the parameter's ``.grad``.

With gradient accumulation (several forward/backward passes per optimizer step) PyTorch's
``AccumulateGrad`` adds each backward's weight gradient to ``param.grad``: one more pass
over every gradient (two reads and a write, 6 bytes per bf16 parameter), 47 ms of a
4-micro-batch step of the e2e model on an H100 (``benchmark/NOTES.md``). linghe's expert
weight gradients are instead added in the GEMM's epilogue:

1. the backward asks :func:`grad_to_accumulate` for a ``.grad`` it may add into;
2. once everything that may fail or allocate has run, its kernel adds this backward's
   gradient to that tensor in place (fp32 sum, one rounding, where PyTorch rounds the
   new gradient and then the sum);
3. :func:`take_grad` takes the tensor off the parameter (``param.grad = None``) and the
   backward returns it as the weight's gradient. ``AccumulateGrad``, finding no
   ``.grad`` and no other holder of the returned tensor, installs it without a copy or
   an add: ``param.grad`` is then a new tensor object on the same memory (as PyTorch's
   AccumulateGrad installs a fresh gradient), and post-accumulate hooks (DDP's reducer,
   FSDP, optimizers in backward) run as usual.

The fused path is taken only where it does not change what a user observes: enabled
(``LINGHE_FUSED_GRAD_ACCUMULATION=0`` or :func:`set_fused_grad_accumulation` turn it
off), the weight is a leaf parameter that requires grad and has no tensor hooks
(``register_hook`` would see the accumulated gradient instead of this backward's), the
backward ends in the parameter's AccumulateGrad (``backward()``, not
``torch.autograd.grad`` or ``backward(inputs=...)`` without the parameter), it does not
build a graph (``create_graph``) and is not traced by ``torch.compile`` or compiled
autograd, and ``.grad`` is a plain contiguous tensor of the parameter's dtype and shape
that does not require grad, owns its whole storage (not a view into a flat buffer, such
as a DDP bucket) and has no other holder (a Python name for it, another tensor object on
it). Everything else takes the plain path (a new gradient, added by ``AccumulateGrad``).
One difference remains: pre-hooks on the AccumulateGrad node itself
(``get_gradient_edge(param).node.register_prehook``) see the accumulated total.
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


def grad_to_accumulate(param: torch.Tensor | None,
                       dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """In a backward: ``param.grad`` where this backward may add its weight gradient to
    it in place and return it through :func:`take_grad`, else ``None`` (module
    docstring). ``dtype``: the dtype the accumulating kernel writes (its gradient
    operand's); a ``.grad`` of another dtype takes the plain path."""
    if (param is None or not _enabled or torch.is_grad_enabled()
            or torch.compiler.is_compiling() or _in_compiled_autograd()):
        return None
    grad = param.grad
    if (grad is None or type(grad) is not torch.Tensor or grad.layout != torch.strided
            or grad.dtype != param.dtype or (dtype is not None and grad.dtype != dtype)
            or grad.shape != param.shape
            or grad.device != param.device or not grad.is_contiguous()
            or grad.requires_grad or getattr(param, "_backward_hooks", None)
            or grad._base is not None or grad.storage_offset() != 0
            or grad.untyped_storage().nbytes() != grad.numel() * grad.element_size()):
        return None
    refs = _references(grad)
    unshared = _unshared_references()
    if refs[0] > unshared[0] or refs[1] > unshared[1]:
        return None
    return grad if _accumulate_grad_will_run(param) else None


def _in_compiled_autograd() -> bool:
    """Whether compiled autograd is tracing this backward (looked up, not imported: if
    its module was never loaded it is not running, and the backward does not pay for
    importing dynamo)."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


def _references(grad: torch.Tensor) -> tuple[int, int]:
    """``(Python references, C++ uses)`` of ``grad``, called with the caller's local name
    for it. More than :func:`_unshared_references` means something besides ``param.grad`` holds it:
    a Python name (a user's alias, which would stop being ``.grad`` after the hand-back)
    or a C++ reference (AccumulateGrad would copy the returned tensor)."""
    use_count = getattr(grad, "_use_count", None)
    return sys.getrefcount(grad), use_count() if use_count is not None else 0


#: A CPU parameter whose ``.grad`` nothing else holds: the yardstick of
#: :func:`_unshared_references`.
_PROBE = torch.zeros(1, device="cpu", requires_grad=True)
_PROBE.grad = torch.zeros(1, device="cpu")


def _unshared_references() -> tuple[int, int]:
    """:func:`_references` of a ``.grad`` that nothing else holds, taken at the call depth
    of :func:`grad_to_accumulate` (a local name, then the call) and at the same moment:
    the counts differ between PyTorch versions (how a tensor owns its Python object) and
    within a process (e.g. while dynamo's frame callback is installed, which after a
    ``torch.compile`` that raised can stay so: a once-measured count then refused every
    ``.grad``)."""
    grad = _PROBE.grad
    return _references(grad)


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
    installs again as ``param.grad`` without adding. Call it last in the backward,
    after every step that may fail: a failure between this and the return would lose
    the accumulated gradient."""
    param.grad = None
    return grad
