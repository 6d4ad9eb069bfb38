"""``TrainingContext``: turns FP8 training on for a region; ``current_recipe()`` reads it.

The active recipe lives in a :class:`contextvars.ContextVar` (per thread / per asyncio
task): entering a context sets it, leaving restores what was there before, on normal exit
and on exceptions alike.

``torch.compile`` cannot trace a ``ContextVar`` read, so code being compiled reads a
process-wide mirror instead (:data:`_compiled_recipe`), set and restored together with
the ``ContextVar`` by every enter and exit. Dynamo guards on the mirror's value: a compiled
function called under another recipe (or none) recompiles. The one limit: the mirror is
per process, so threads that run compiled code under different contexts at the same time
would see the latest entered one; eager code always reads the per-thread ``ContextVar``.
A context created and entered inside code being compiled sets and restores only the
mirror, and leaves the autograd threading setting alone (:func:`swap_compiled_recipe` does
the same for a context made outside, which Dynamo cannot enter).
"""

from __future__ import annotations

import contextvars
import threading

import torch

from .fp8.recipe import RECIPES, Fp8Recipe
from .utils import INTERPRET, cuda_capability

_RECIPE: contextvars.ContextVar[Fp8Recipe | None] = contextvars.ContextVar(
    "linghe_fp8_recipe", default=None)

#: The innermost active recipe, mirrored for code under ``torch.compile`` (module docstring).
_compiled_recipe: Fp8Recipe | None = None
#: ``TrainingContext._token`` of a context entered inside a compiled region.
_COMPILED_TOKEN = object()


def current_recipe() -> Fp8Recipe | None:
    """The FP8 recipe of the innermost active :class:`TrainingContext` (``None``: high
    precision). Under ``torch.compile`` the process-wide mirror of it (module docstring)."""
    if torch.compiler.is_compiling():
        return _compiled_recipe
    return _RECIPE.get()


def swap_compiled_recipe(recipe: Fp8Recipe | None) -> Fp8Recipe | None:
    """Set the mirror that code under ``torch.compile`` reads as the current recipe (see
    the module docstring); returns the previous value, to restore afterwards. For code
    being compiled that must switch recipes without entering a :class:`TrainingContext`
    (Dynamo enters only a context created inside the compiled region)."""
    global _compiled_recipe
    outer, _compiled_recipe = _compiled_recipe, recipe
    return outer


def check_fp8_device() -> None:
    """Raise ``RuntimeError`` unless FP8 GEMMs can run here: a CUDA GPU of compute
    capability >= 8.9 (Ada, Hopper or newer), or the CPU Triton interpreter."""
    if torch.cuda.is_available():
        # (cached per device: a driver query costs tens of µs, and a context is entered
        # once per micro-batch)
        cap = cuda_capability(torch.device("cuda", torch.cuda.current_device()))
        if tuple(cap) < (8, 9):
            name = torch.cuda.get_device_name()
            raise RuntimeError(
                f"FP8 training needs a GPU with compute capability >= 8.9 (Ada/Hopper or "
                f"newer); {name} has {cap[0]}.{cap[1]}. Use TrainingContext(fp8=None).")
        return
    if not INTERPRET:
        raise RuntimeError("FP8 training needs a CUDA GPU with compute capability >= 8.9 "
                           "(or TRITON_INTERPRET=1 set before importing triton, for CPU tests)")


class TrainingContext:
    """Context manager selecting the FP8 recipe of ``linghe.nn`` modules inside it.

    Args:
        fp8: ``None`` (high precision; an inner ``fp8=None`` context turns FP8 off for a
            region such as the first and last layers), ``"blockwise"``, ``"tensorwise"`` or
            ``"delayed"`` (see :mod:`linghe.fp8.recipe`).
        pow2_scale: round scales up to powers of two (blockwise, tensorwise).
        amax_group: process group over which the delayed recipe reduces amaxes (MAX) once
            per step; ``None``: no reduction (single process).
        history_len, amax_compute (``"max"``/``"most_recent"``), margin: delayed scaling.
        fp8_wgrad: compute the weight gradients of ``linghe.nn.Linear`` (and the other
            dense FP8 layers, the FP8 LM head of ``lm_head_fp8`` included) in FP8 (else in
            the input's precision).
        caller_thread_backward: run a ``backward()`` called inside the context on the
            calling thread (``torch.autograd.set_multithreading_enabled(False)`` while
            the context is active; thread-local, restored on exit) instead of handing it
            to the autograd engine's device thread. linghe's ops are Python autograd
            Functions, and every backward call's round trip to that thread is paid per
            op: on the H200 host, ``linghe.nn.Linear`` FP8 forward+backward costs 879 µs
            of host time with the hand-off and 332 µs without (bf16 ``torch.nn.Linear``
            184 vs 120 µs; ``benchmark.host``'s "caller-thread bwd" rows). Turn it off
            for a process that drives several GPUs from one thread and wants their
            backwards to run in parallel. (The setting is per thread, the recipe per
            thread or asyncio task: tasks sharing a thread share the setting.)
        expert_fp8_wgrad: compute the routed experts' weight gradients
            (:class:`linghe.nn.MoE`) in FP8; by default they are computed in the input's
            precision from the gradients as they arrive and the dequantized FP8
            activations: with few tokens per expert (8192 tokens over 256 experts) the
            FP8 grouped wgrad's short contraction per output tile loses to the bf16 grouped
            GEMM, and no columnwise copies are made (``benchmark/NOTES.md``).
        expert_fp8: run the routed experts (:class:`linghe.nn.MoE`, the Hugging Face
            Qwen3-MoE experts) in FP8 under the blockwise recipe (default). ``False``
            keeps them in the input's precision while the dense layers (and the shared
            experts) stay FP8: with few tokens per expert the expert GEMMs are bound by
            reading the weights, and the FP8 copies of those weights (written once per
            optimizer step) cost about what the FP8 expert GEMMs save (the e2e
            benchmark's ``--expert-fp8``; ``benchmark/NOTES.md``).
        lm_head_fp8: run :func:`linghe.linear_cross_entropy`'s logits GEMM and its
            hidden-gradient GEMM in FP8 (blockwise recipe only; off by default, as FP8
            recipes keep the output layer in high precision): the hidden states are
            quantized 1x128, the LM head weight 128x128 (cached per optimizer step, and
            written by :class:`linghe.optim.AdamW` in its update pass), the logits'
            gradient 1x128 by the loss kernel that computes it; with ``fp8_wgrad`` (the
            default) the weight-gradient GEMM too, from the gradient's and the hidden
            states' 1x128 copies along the tokens (a head with a bias or vocab-parallel
            keeps it in the input's precision). On an H200 the e2e LM head's
            forward+backward (hidden 2048, vocab 157184) takes 16.7 ms against bf16's 24.8
            (19.5 with the weight gradient in bf16; ``benchmark/probe_fp8_lm_head.py``); at
            vocabularies cuBLAS takes only padded (vocab / 128 not a multiple of 4, e.g.
            151936) the gradient's FP8 copy is written zero-padded so that cuBLAS runs
            that GEMM too. At the e2e benchmark's small width the FP8 head ends ~0.7% above
            bf16's training loss after 300 steps (held-out loss ~1.2%; 16 seeds, standard
            error 0.7%): measure
            your shape and check your loss curve before relying on it (``benchmark.e2e
            --lm-head-fp8``, ``benchmark.hf_step``).

    Use::

        ctx = linghe.TrainingContext(fp8="blockwise")
        for batch in data:
            with ctx:
                loss = model(batch)
                loss.backward()
            opt.step()

    The same instance may be entered again after it exits (the delayed recipe keeps its
    amax history in it, and updates the scales once per exit: keep backward inside the
    block so its gradient amaxes belong to the step); entering it while it is active
    raises ``RuntimeError``. Modules capture the recipe in forward, so a backward that
    runs after the block still uses the forward's recipe. Entering an FP8 context on a GPU
    without FP8 support raises ``RuntimeError``.
    """

    def __init__(self, fp8: str | None = None, *, pow2_scale: bool = True, amax_group=None,
                 history_len: int = 16, amax_compute: str = "max", margin: float = 0,
                 fp8_wgrad: bool = True, expert_fp8_wgrad: bool = False,
                 expert_fp8: bool = True, lm_head_fp8: bool = False,
                 caller_thread_backward: bool = True):
        if fp8 is not None and not isinstance(fp8, str):
            raise ValueError(f"fp8 must be None or one of {RECIPES}, got {fp8!r}")
        self.recipe: Fp8Recipe | None = None
        if fp8 is not None:
            self.recipe = Fp8Recipe(fp8, pow2_scale=pow2_scale, fp8_wgrad=fp8_wgrad,
                                    expert_fp8_wgrad=expert_fp8_wgrad,
                                    expert_fp8=expert_fp8, lm_head_fp8=lm_head_fp8,
                                    history_len=history_len, amax_compute=amax_compute,
                                    margin=margin, amax_group=amax_group)
        self.caller_thread_backward = bool(caller_thread_backward)
        self._token: contextvars.Token | None = None
        self._outer_mirror: Fp8Recipe | None = None
        self._outer_multithreading: bool | None = None

    @property
    def active(self) -> bool:
        return self._token is not None

    def __enter__(self) -> TrainingContext:
        if self._token is not None:
            raise RuntimeError("this TrainingContext is already active; nest a new "
                               "TrainingContext(...) instead of re-entering one")
        if torch.compiler.is_compiling():
            # Entered inside a compiled region: the mirror only, which Dynamo traces as a
            # global (a ContextVar or the autograd threading switch would break the graph).
            self._token = _COMPILED_TOKEN
        else:
            if self.recipe is not None:
                check_fp8_device()
            self._token = _RECIPE.set(self.recipe)
            if self.caller_thread_backward:
                self._outer_multithreading = torch._C._is_multithreading_enabled()
                torch._C._set_multithreading_enabled(False)
        self._outer_mirror = swap_compiled_recipe(self.recipe)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        token, self._token = self._token, None
        compiled = token is _COMPILED_TOKEN
        try:
            if not compiled:
                _RECIPE.reset(token)  # raises if exited in another contextvars.Context
        finally:
            swap_compiled_recipe(self._outer_mirror)
            self._outer_mirror = None
            if self._outer_multithreading is not None:
                torch._C._set_multithreading_enabled(self._outer_multithreading)
                self._outer_multithreading = None
        if (not compiled and exc_type is None and self.recipe is not None
                and self.recipe.state is not None):
            self.recipe.state.update()

    def __repr__(self) -> str:
        return (f"TrainingContext(recipe={self.recipe!r}, caller_thread_backward="
                f"{self.caller_thread_backward}, active={self.active})")


# ---------------------------------------------------------------------------------------
# Caller-thread backward for a module (when the backward runs outside any TrainingContext
# block, as in a Hugging Face training loop)
# ---------------------------------------------------------------------------------------

_THREAD = threading.local()  # .turned_off: a module's forward turned multithreading off


def _before_forward(module, args) -> None:
    if torch.compiler.is_compiling():  # a compiled backward is one autograd node: one hand-off
        return
    if torch.is_grad_enabled():
        if torch._C._is_multithreading_enabled():
            torch._C._set_multithreading_enabled(False)
            _THREAD.turned_off = True
    elif getattr(_THREAD, "turned_off", False):
        torch._C._set_multithreading_enabled(True)
        _THREAD.turned_off = False


def backward_on_caller_thread(module: torch.nn.Module):
    """Run backwards on the thread that calls ``backward()`` once ``module`` has trained.

    What :class:`TrainingContext` does for its block (``caller_thread_backward``), for a
    model whose backward runs outside any block: a forward of ``module`` with gradients
    enabled turns ``torch.autograd.set_multithreading_enabled`` off for the calling
    thread, and a forward without gradients (evaluation, generation) turns it back on if
    this turned it off. In between, every backward that thread runs runs on it (the same
    gradients; backwards on several GPUs driven from that thread no longer overlap). It
    cannot be undone at the end of each backward: PyTorch restores the thread's autograd
    state when a backward finishes, so a change made inside one does not outlive it.

    Returns the hook's handle (``handle.remove()`` stops it; turn the setting back on
    yourself if a forward had turned it off).
    """
    return module.register_forward_pre_hook(_before_forward)
