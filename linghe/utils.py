"""Shared helpers: input validation, launch helpers, debug switch, interpreter workarounds.

Every kernel module imports from here instead of re-writing these; interpreter-only
workarounds (TRITON_INTERPRET=1 on CPU) live in this one place.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------
# Interpreter (TRITON_INTERPRET=1) awareness
# --------------------------------------------------------------------------------------

#: True when Triton kernels run through the CPU interpreter. Read once at import: Triton
#: itself decides at ``@triton.jit`` time, so changing the variable later has no effect.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

# A module-level constexpr that jit functions may read (Triton resolves it at compile time).
_INTERPRET_C = tl.constexpr(INTERPRET)


@triton.jit
def dot_f32acc(a, b, acc):
    """``acc + a @ b`` with fp32 accumulation.

    The triton 3.9 interpreter returns garbage for ``tl.dot`` on bf16 operands; upcasting
    the tiles to fp32 there gives the exact product of the bf16 values (bf16*bf16 is exact
    in fp32), which is what the tensor cores compute on the GPU.
    """
    if _INTERPRET_C:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# --------------------------------------------------------------------------------------
# Debug switch (expensive checks such as out-of-range ids)
# --------------------------------------------------------------------------------------

_debug = os.environ.get("LINGHE_DEBUG", "0") not in ("", "0", "false", "False")


def set_debug(enabled: bool) -> None:
    """Turn linghe's debug checks on or off (also set by ``LINGHE_DEBUG=1``).

    In debug mode, ops validate data-dependent inputs (expert ids, labels) and raise a
    clear error; this costs a host sync. Outside debug mode such inputs are handled
    safely (dropped or ignored, as each op documents) and never read out of bounds.
    """
    global _debug
    _debug = bool(enabled)


def debug_enabled() -> bool:
    """Whether debug checks are on (see :func:`set_debug`)."""
    return _debug


# --------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------

def cdiv(a: int, b: int) -> int:
    """Ceiling division of host ints (triton's own is a constexpr function in recent
    releases and costs microseconds a call on the launch path)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (0 for ``n <= 0``, as ``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


_NUM_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small constant on the CPU interpreter).

    Cached per device: a device-properties query on every launch costs host time."""
    key = (device.type, device.index)
    n = _NUM_SMS.get(key)
    if n is None:
        n = 4
        if device.type == "cuda":
            n = torch.cuda.get_device_properties(device).multi_processor_count
        _NUM_SMS[key] = n
    return n


_CAPABILITY: dict = {}  # device -> compute capability (a driver query per call otherwise)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, cached per device."""
    cap = _CAPABILITY.get(device)
    if cap is None:
        cap = _CAPABILITY[device] = torch.cuda.get_device_capability(device)
    return cap


def tma_capable(t: torch.Tensor) -> bool:
    """Whether the default launches may take a TMA (tensor descriptor) kernel for ``t``'s
    device: Hopper or newer (sm_90+: tensor-memory copies, and the shared memory the TMA
    kernels' default tiles need), or the interpreter (which runs the same kernel on the
    CPU). Older GPUs keep the pointer kernels."""
    if INTERPRET:
        return True
    return t.device.type == "cuda" and cuda_capability(t.device) >= (9, 0)


_NO_GUARD = contextlib.nullcontext()

#: Nesting depth of :func:`whole_step_capture` (process-wide: a captured backward runs on
#: the autograd engine's thread).
_WHOLE_STEP_CAPTURE = [0]


@contextlib.contextmanager
def whole_step_capture():
    """Declare that the CUDA graph captures made inside span whole optimizer steps.

    Some of linghe's per-step work keeps state on the host between calls: weight
    gradients deferred over micro-batches (``wgrad_micro_batches``, the FP8 LM head's),
    gradient norms recorded by backward kernels for ``linghe.optim.AdamW``'s clipping
    (``norm_from_backward``), the FP8 weight copies that optimizer writes in its step and
    the next forwards read. A replayed graph repeats kernels, not Python, so by default
    each of these turns itself off while a capture is under way (the captured backward
    computes its own gradient, the clipping reads every gradient, the captured forward
    quantizes the weights itself). A capture that holds
    every micro-batch's forward and backward of a step (and the step's update in the
    same or a following capture, as ``benchmark.e2e --cuda-graph`` does) starts and ends
    with that state empty, so the bookkeeping done once at capture time is what every
    replay needs: inside this context it stays on. Capture a part of a step (one
    micro-batch) outside it.

    The captured forwards then read the FP8 weight copies in the weight caches, which the
    captured update rewrites in place: re-capture after anything that makes those caches
    drop their copies (``load_state_dict``, ``linghe.fp8.invalidate_weight_caches``, an
    eager ``AdamW.prepare_step()`` outside this context), as after any change of the
    model's tensors.
    """
    _WHOLE_STEP_CAPTURE[0] += 1
    try:
        yield
    finally:
        _WHOLE_STEP_CAPTURE[0] -= 1


def in_whole_step_capture() -> bool:
    """Whether :func:`whole_step_capture` is active (its captures hold whole steps)."""
    return _WHOLE_STEP_CAPTURE[0] > 0


def mark_graph_written(t: torch.Tensor) -> None:
    """Mark ``t`` as rewritten by a kernel inside a captured CUDA graph: its replays change
    its contents without bumping its version counter (see :func:`may_keep_derived`)."""
    t._linghe_graph_written = True


def may_keep_derived(t: torch.Tensor) -> bool:
    """Whether data derived from ``t``'s contents (a re-laid-out or padded copy) may be
    kept and reused while ``t._version`` stays: not while a CUDA graph is captured (the
    graph must contain the derivation, or a replay after a captured rewrite reads a stale
    one), and never for a tensor :func:`mark_graph_written` marked."""
    return not (getattr(t, "_linghe_graph_written", False)
                or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def capture_pauses_bookkeeping(t: torch.Tensor) -> bool:
    """Whether host-side per-step bookkeeping for ``t`` must pause: a CUDA graph capture is
    under way on the current stream (``t`` on a GPU) and not inside
    :func:`whole_step_capture`."""
    return (t.is_cuda and not _WHOLE_STEP_CAPTURE[0]
            and torch.cuda.is_current_stream_capturing())


class _Launcher:
    """Launches a compiled Triton kernel with less host work than ``kernel[grid](...)``.

    Triton's own launch path re-derives, on every call, things that do not change between
    calls of one kernel: it reads several environment knobs, formats the launch options
    into a string cache key and checks the kernel's globals. On a slow host that is a
    large share of a small op's time. Here the binder that Triton generated for the kernel
    (which specializes the arguments exactly as Triton does: dtypes, 16-byte alignment of
    pointers, divisibility of integers) still runs on every call, and its result keys a
    small cache of compiled kernels; a miss (first call, new specialization) goes through
    ``kernel.run`` once, which compiles and launches, and fills the cache. Launch hooks
    (``triton.knobs.runtime.launch_enter_hook``, e.g. a Triton profiler) are honoured by
    taking the ordinary path while one is set.
    """

    __slots__ = ("fn", "cache")

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}

    def __call__(self, grid, args, kwargs):
        device = _current_cuda_device()
        stream = _raw_stream(device)
        binder = self.fn.device_caches[device][4]
        bound, spec, options = binder(*args, **kwargs)
        key = (device, tuple(spec), tuple(options.items()))
        kernel = self.cache.get(key)
        if kernel is None or _launch_hook_set():
            kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
            if kernel is not None and not hasattr(kernel, "result"):
                self.cache[key] = kernel
            return kernel
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                   None, None, *bound.values())
        return kernel


def _launch_hook_set() -> bool:
    if _KNOBS_RUNTIME is None:
        return False
    hook = _KNOBS_RUNTIME.launch_enter_hook
    # triton >= 3.5 keeps an (empty by default) HookChain there; older ones None.
    return hook is not None and bool(getattr(hook, "calls", True))


try:  # triton >= 3.4
    from triton import knobs as _knobs

    _KNOBS_RUNTIME = _knobs.runtime
except (ImportError, AttributeError):  # pragma: no cover - older triton
    _KNOBS_RUNTIME = None

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The current CUDA device without torch.cuda.current_device()'s lazy-init check (~1 µs a
# call, twice per launch): only reached with CUDA tensors in hand, so CUDA is initialized.
_current_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_LAUNCHERS: dict = {}


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with a cheaper host path on CUDA (see
    :class:`_Launcher`); under the interpreter, exactly ``kernel[grid](...)``. Returns
    what that returns (the compiled kernel on CUDA)."""
    if INTERPRET or _raw_stream is None or not hasattr(kernel, "device_caches"):
        return kernel[grid](*args, **kwargs)
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = _Launcher(kernel)
    return launcher(grid, args, kwargs)


def device_guard(t: torch.Tensor):
    """Context manager that makes ``t``'s device current for a launch (a no-op, and no
    device switch on the hot path, when it already is)."""
    dev = t.device
    if dev.type == "cuda" and dev.index != _current_cuda_device():
        return torch.cuda.device(dev)
    return _NO_GUARD


class _NoGradCtx:
    """Stands in for an autograd ``ctx`` when no input needs a gradient: forward's
    bookkeeping (saving tensors, flags) becomes a no-op."""

    def save_for_backward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def apply_function(fn: type[torch.autograd.Function], *args):
    """``fn.apply(*args)`` with less host work.

    When grad mode is off or no tensor argument requires grad, nothing would be recorded,
    so ``fn.forward`` runs directly with a :class:`_NoGradCtx` (autograd's per-call cost,
    a large share of a small op's host time, is skipped). Otherwise the C++ apply is
    called directly, skipping ``Function.apply``'s Python prologue (argument re-binding
    and the functorch wrapper scan); under functorch transforms or torch.compile the
    ordinary ``fn.apply`` runs.
    """
    if not torch.is_grad_enabled() or not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn.forward(_NoGradCtx(), *args)
    if (_C_APPLY is None or torch._C._are_functorch_transforms_active()
            or torch.compiler.is_compiling()):
        return fn.apply(*args)
    return _C_APPLY.__get__(None, fn)(*args)


#: autograd's C++ ``apply`` (what ``Function.apply`` calls after its Python prologue).
_C_APPLY = torch._C._FunctionBase.__dict__.get("apply")


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as ``[M, K]`` (a view when the leading dims allow; also for K = 0)."""
    if x.dim() == 2:
        return x
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


# --------------------------------------------------------------------------------------
# Input validation (raise TypeError / ValueError naming the argument)
# --------------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    min_ndim: int | None = None,
    device: torch.device | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument and return it.

    ``shape`` entries that are ``None`` match any size. Raises ``TypeError`` for a
    non-tensor or a wrong dtype and ``ValueError`` for rank, shape, device or layout.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name} must be {' or '.join(map(str, allowed))}-D, got shape "
                             f"{tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        ok = len(shape) == t.dim() and all(s is None or s == d for s, d in zip(shape, t.shape))
        if not ok:
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got "
                         f"strides {t.stride()}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` if the given (non-None) tensors are not on one device."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}; "
                             "all inputs must be on one device")


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA, or on CPU only through the Triton interpreter. They read raw
    memory, so a quantized container (``linghe.Fp8Tensor``, which has no storage of its
    own) is refused with a clear error here rather than failing inside the launch."""
    if type(t) is not torch.Tensor and getattr(t, "_linghe_fp8", False):
        raise TypeError(f"{name} is an Fp8Tensor, but this op takes a high-precision "
                        f"tensor: pass {name}.dequantize()")
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and INTERPRET:
        return
    raise ValueError(
        f"{name} is on {t.device}; linghe kernels need a CUDA tensor (or CPU tensors with "
        "TRITON_INTERPRET=1 set before triton is imported)"
    )


# --------------------------------------------------------------------------------------
# Output allocation (poisoned under test, so an unwritten element fails)
# --------------------------------------------------------------------------------------

_poison = os.environ.get("LINGHE_POISON_OUTPUTS", "0") == "1"


def set_poison_outputs(enabled: bool) -> None:
    """Fill every output buffer linghe allocates with NaN (ints: -1) before its kernel
    runs. The test suite turns this on so that an element a kernel forgets to write fails
    the comparison; it costs one fill per output, so it is off by default."""
    global _poison
    _poison = bool(enabled)


def empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; poisoned when :func:`set_poison_outputs` is on."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    t = torch.empty(shape, dtype=dtype, device=device)
    if _poison and t.numel() > 0:
        if t.dtype.is_floating_point and t.element_size() == 1:
            t.view(torch.uint8).fill_(0x7F)  # fp8 NaN
        elif t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-1)
    return t


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`empty` with ``t``'s shape and device (and dtype unless given)."""
    return empty(t.shape, dtype=dtype or t.dtype, device=t.device)


# --------------------------------------------------------------------------------------
# Reduction of per-program float32 partials (weight gradients of persistent kernels)
# --------------------------------------------------------------------------------------


@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
        acc += tl.load(p_ptr + rows[:, None] * N + cols[None, :],
                       mask=(rows < P)[:, None] & cmask[None, :], other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cmask)


def sum_partials(partial: torch.Tensor, dtype: torch.dtype, *, block_p: int = 64,
                 block_n: int = 32) -> torch.Tensor:
    """Column sums of contiguous float32 ``partial [P, N]`` as ``[N]`` in ``dtype``, in one
    launch (float32 accumulation, then one cast). Used for weight gradients that
    persistent kernels leave as one float32 row per program. Each program sums
    ``block_n`` columns, ``block_p`` rows at a time (``block_p >= P``: all rows' loads
    issued at once, for a latency-bound reduction that sits in L2)."""
    P, N = partial.shape
    out = empty(N, dtype=dtype, device=partial.device)
    if N == 0:
        return out
    if P == 0:
        return out.zero_()
    with device_guard(partial):
        launch(_sum_partials_kernel, (cdiv(N, block_n),), partial, out, P, N,
               BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return out


@triton.jit
def grouped_tile_order(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of GEMM program ``pid`` in grouped order: ``GROUP_M`` row tiles
    sweep the column tiles together, so the ``B`` tiles they share stay in L2."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m
