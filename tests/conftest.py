"""Picks the device: CUDA when present, else CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported (linghe imports it), so this runs
first. Outputs that linghe allocates are NaN-poisoned, so an unwritten element fails.

GPU subset. On a GPU nearly all of the suite's time is Triton compiling one binary per
compile key (count them with ``--compile-keys``, tests/compile_keys.py), so there a test
marked ``gpu_subset(name=[values], ...)`` runs only the cases whose ``name`` is among the
values (``**{"a,b": [(a, b), ...]}`` for arguments parametrized together; several marks:
their union); the other cases are deselected. The marks drop only cases that repeat
another kept case's code path: a shape whose masks and tails (size-1, empty, odd tail,
exact multiple, zero-token experts) another kept shape exercises, or float16 on shapes
beyond two (float16 shares bfloat16's code path except for the element conversion). The
FP8 GEMM autotunes only in tests marked ``fp8_autotune`` (see ``_fp8_gemm_autotune``).
On CPU every case runs. ``LINGHE_GPU_SUBSET=0`` runs every case on the GPU too;
``LINGHE_GPU_SUBSET=1`` applies the subset on CPU (to see or measure what a GPU runs).

On the GPU the suite runs in several pytest-xdist processes that share one device
(scripts/gpu_check.sh): tests marked ``gpu_big`` (tens of GB) take a file lock so that
only one of them runs at a time, and every test's peak GPU memory is recorded in the
JUnit XML (``gpu_peak_mib``) so the marks can be checked against measurements.
"""

import contextlib
import os
import tempfile
import zlib

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["LINGHE_POISON_OUTPUTS"] = "1"

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def _patch_interpreter_once_per_launch():
    """The Triton interpreter (triton 3.x, ``triton/runtime/interpreter.py``) patches
    ``triton.language`` for the interpreted semantics at each launch (restored after it),
    and again, never restored, at every call of a ``@triton.jit`` helper from a kernel:
    for every program of the grid, an ``inspect.getmembers`` walk of ``tl``, ``tl.core``,
    ``tl.math`` and ``tl.tensor`` (about a quarter of the suite's CPU time). Those repeats
    set the attributes that the launch's own patch already set to equivalent values (the
    patch is idempotent), so a helper whose language modules the running launch has
    patched skips them; any other patches as before. ``LINGHE_TEST_REPATCH=1`` turns this
    off; it does nothing where the interpreter is not the one it was written against."""
    if os.environ.get("LINGHE_TEST_REPATCH") == "1":
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as interp

    ex = getattr(interp, "GridExecutor", None)
    if not (callable(getattr(interp, "_patch_lang", None)) and ex is not None
            and hasattr(interp, "_LangPatchScope") and hasattr(interp, "InterpretedFunction")):
        return
    orig_patch, orig_call = interp._patch_lang, ex.__call__
    state = {"patched": None}  # ids of the language modules the running launch patched

    seen = {}  # id(a helper's globals) -> (globals, their size, their language modules)

    def langs(fn):
        g = fn.__globals__
        hit = seen.get(id(g))
        if hit is None or hit[0] is not g or hit[1] != len(g):
            hit = seen[id(g)] = (g, len(g), frozenset(
                id(v) for v in g.values() if inspect.ismodule(v) and (v is tl or v is tl.core)))
        return hit[2]

    def patch_lang(fn):
        mods, done = langs(fn), state["patched"]
        if done is not None and mods <= done:
            return interp._LangPatchScope()  # already patched by this launch
        scope = orig_patch(fn)
        if done is not None:
            state["patched"] = done | mods
        return scope

    def call(self, *args, **kwargs):
        prev = state["patched"]
        state["patched"] = frozenset()  # the launch's own patch runs first
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            state["patched"] = prev

    interp._patch_lang = patch_lang
    ex.__call__ = call


def _patch_interpreter_dead_work():
    """Three pieces of the Triton interpreter's (triton 3.x) work that change nothing in
    what a kernel computes, done the short way (together about two fifths of the suite's
    CPU time; every launch's outputs keep their bits):

    - Integer ``+``, ``-`` and ``*`` each build an overflow check (both operands cast to
      int64, the operation again, two compares, an ``and``) for a ``device_assert`` that
      does nothing unless the builder's ``options.debug``, which the interpreter's
      ``InterpreterOptions`` leaves off: skipped while it is off.
    - ``_get_np_dtype`` (the numpy dtype of a Triton dtype) builds and hashes a 19-entry
      dict at each of its calls: the answers are remembered.
    - ``tl.reduce`` with a combine function of its own (not sum/max/min) calls the
      function once per element, on scalars. A multi-dimensional input is folded along the
      reduced axis a whole slice at a time instead, in the same order (the combine
      function is elementwise: each output element sees the same operations on the same
      values); a 1-D input of integers pairwise (``tl.reduce`` requires an associative
      combine function, and integer arithmetic is exact: the same values in any grouping).
      Anything else (1-D floats, ``axis=None``) as before.

    ``LINGHE_TEST_INTERPRETER_AS_IS=1`` turns these off; each does nothing where the
    interpreter is not the one it was written against."""
    if os.environ.get("LINGHE_TEST_INTERPRETER_AS_IS") == "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.language import semantic
    from triton.runtime import interpreter as interp

    sem = getattr(semantic, "TritonSemantic", None)
    builder = getattr(interp, "interpreter_builder", None)
    if sem is not None and builder is not None and hasattr(
            sem, "binary_op_sanitize_overflow_impl"):
        orig_check = sem.binary_op_sanitize_overflow_impl

        def overflow_check(self, lhs, rhs, binary_op):
            if self.builder is builder and not self.builder.options.debug:
                return None  # its device_assert would do nothing
            return orig_check(self, lhs, rhs, binary_op)

        sem.binary_op_sanitize_overflow_impl = overflow_check

    orig_np_dtype = getattr(interp, "_get_np_dtype", None)
    if callable(orig_np_dtype):
        np_dtypes = {}

        def get_np_dtype(tt_dtype):
            try:
                return np_dtypes[tt_dtype]
            except KeyError:
                np_dtypes[tt_dtype] = orig_np_dtype(tt_dtype)
                return np_dtypes[tt_dtype]
            except TypeError:  # an unhashable type
                return orig_np_dtype(tt_dtype)

        interp._get_np_dtype = get_np_dtype

    red = getattr(interp, "ReduceOps", None)
    if red is None or not all(hasattr(red, a) for a in ("generic_reduce", "to_tensor")):
        return
    orig_reduce = red.generic_reduce

    def combine(self, acc, vals, input, shape):
        """The combine function on whole arrays, its results as arrays of the inputs'
        numpy dtypes (as the element-wise loop stores them)."""
        ret = self.combine_fn.fn(*(self.to_tensor(a, x.dtype) for a, x in zip(acc, input)),
                                 *(self.to_tensor(v, x.dtype) for v, x in zip(vals, input)))
        ret = ret if isinstance(ret, tuple) else (ret,)
        return [np.broadcast_to(r.handle.data if isinstance(r, tl.core.tensor)
                                else np.asarray(r), shape).astype(a.dtype)
                for r, a in zip(ret, acc)]

    def generic_reduce(self, input):
        axis, data = self.axis, [x.handle.data for x in input]
        if axis is None or data[0].ndim == 0 or data[0].size == 0:
            return orig_reduce(self, input)
        if data[0].ndim == 1:
            if not all(x.dtype.is_int() for x in input):
                return orig_reduce(self, input)
            while data[0].shape[0] > 1:  # neighbours pairwise, in order
                n = data[0].shape[0]
                h = n // 2
                new = combine(self, [d[0:2 * h:2] for d in data],
                              [d[1:2 * h:2] for d in data], input, (h,))
                data = [np.concatenate([a, d[n - 1:]]) if n % 2 else a
                        for a, d in zip(new, data)]
            out = [d.reshape((1,) if self.keep_dims else ()) for d in data]
        else:
            shape = data[0].shape[:axis] + data[0].shape[axis + 1:]
            out = [np.take(d, 0, axis=axis) for d in data]
            for k in range(1, data[0].shape[axis]):
                out = combine(self, out, [np.take(d, k, axis=axis) for d in data], input,
                              shape)
            if self.keep_dims:
                out = [np.expand_dims(o, axis) for o in out]
        return [self.to_tensor(o, x.dtype) for o, x in zip(out, input)]

    generic_reduce.__wrapped__ = orig_reduce  # (tests/test_conftest_interpreter.py)
    red.generic_reduce = generic_reduce


if not ON_GPU:
    _patch_interpreter_once_per_launch()
    _patch_interpreter_dead_work()


def pytest_addoption(parser):
    parser.addoption("--compile-keys", nargs="?", const="-", default=None, metavar="PATH",
                     help="count distinct Triton compile keys per test file (tests/"
                          "compile_keys.py); with PATH, also write them per test as JSON")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu_subset(**kept): on the GPU, run only the listed values of these "
                   "parametrized arguments (several marks: their union; CPU runs every case)")
    config.addinivalue_line(
        "markers", "fp8_autotune(**cases): on the GPU subset, the FP8 GEMM autotunes in these "
                   "cases (all cases without arguments); elsewhere it uses its fixed tiles")
    config.addinivalue_line(
        "markers", "gpu_big: needs tens of GB of GPU memory; on the GPU such tests run one "
                   "at a time across xdist workers (a file lock in tests/conftest.py)")
    if config.getoption("compile_keys"):
        from compile_keys import CompileKeyCounter

        config.pluginmanager.register(CompileKeyCounter(config), "linghe_compile_keys")


_PARAM_SET = type(pytest.param(None))  # what pytest.param(...) returns


def _split(names) -> list[str]:
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def _case_value(item, name: str):
    """The case's value of ``name``: one argument, or a tuple for ``"a,b"``."""
    vals = tuple(item.callspec.params[n] for n in _split(name))
    return vals if len(vals) > 1 else vals[0]


def _declared_values(item, name: str) -> list:
    """The values that the test's ``parametrize`` marks list for ``name`` (one argument,
    or a tuple of several named together as ``"a,b"``)."""
    want = _split(name)
    for mark in item.iter_markers("parametrize"):
        names = _split(mark.args[0])
        if all(w in names for w in want):
            idx = [names.index(w) for w in want]
            rows = [v.values if isinstance(v, _PARAM_SET) else (v,) if len(names) == 1
                    else tuple(v) for v in mark.args[1]]
            return [tuple(r[i] for i in idx) if len(want) > 1 else r[idx[0]] for r in rows]
    return []


def _selects(mark, item) -> bool:
    """Whether a case-selecting mark (``gpu_subset``, ``fp8_autotune``) selects this case:
    each named argument's value is among the listed ones (no arguments: every case)."""
    ok = True
    for name, kept in mark.kwargs.items():
        # A listed value that no case has (a typo, a changed parameter list) would silently
        # select nothing: fail collection instead (checked on CPU too, so CI catches it).
        declared = _declared_values(item, name)
        missing = [v for v in kept if v not in declared]
        if not declared or missing:
            raise pytest.UsageError(f"{item.nodeid}: {mark.name} lists {name}="
                                    f"{missing or kept!r}, which the test's parametrization "
                                    "does not have")
        ok = ok and _case_value(item, name) in kept
    return ok


def _selected(item, name: str) -> bool | None:
    """None when the test has no ``name`` mark, else whether any of its marks selects
    the case (several marks: their union)."""
    marks = list(item.iter_markers(name))
    if not marks:
        return None
    return any([_selects(m, item) for m in marks])  # a list: every mark is validated


#: The GPU subset is in force (see the module docstring).
GPU_SUBSET = os.environ.get("LINGHE_GPU_SUBSET", "1" if ON_GPU else "0") == "1"


def pytest_collection_modifyitems(config, items):
    dropped = [it for it in items if _selected(it, "gpu_subset") is False]
    for it in items:
        _selected(it, "fp8_autotune")  # validates the marks
    if GPU_SUBSET and dropped:
        ids = {id(it) for it in dropped}
        items[:] = [it for it in items if id(it) not in ids]
        config.hook.pytest_deselected(items=dropped)
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fp8_gemm_autotune(request):
    """Under the GPU subset, the FP8 GEMMs (dense and grouped) autotune only in tests
    marked ``fp8_autotune``: autotuning compiles every config for every shape (4-5x the
    compiles) and checks only the winner; the other tests run the fixed-tile path
    (``LINGHE_FP8_GEMM_AUTOTUNE=0``, ``LINGHE_GROUPED_MM_AUTOTUNE=0``).
    Set by hand, not with ``monkeypatch``: an autouse fixture that requests monkeypatch
    makes the test's own patches outlive the other autouse fixtures' teardown."""
    names = [n for n in ("LINGHE_FP8_GEMM_AUTOTUNE", "LINGHE_GROUPED_MM_AUTOTUNE")
             if n not in os.environ]
    if not (ON_GPU and GPU_SUBSET and names
            and not _selected(request.node, "fp8_autotune")):
        yield
        return
    for name in names:
        os.environ[name] = "0"
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name, None)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def fused_on():
    """Fused gradient accumulation on for the test (whatever the environment says)."""
    from linghe.bwd import accumulate

    prev = accumulate.set_fused_grad_accumulation(True)
    yield
    accumulate.set_fused_grad_accumulation(prev)


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)``: wraps ``module.name`` so that each call appends to the
    returned list (e.g. how often a fused path ran), restored after the test."""
    def wrap(module, name):
        calls = []
        real_fn = getattr(module, name)

        def counting(*a, **k):
            calls.append(1)
            return real_fn(*a, **k)

        monkeypatch.setattr(module, name, counting)
        return calls

    return wrap


@pytest.fixture
def on_test_device(device):
    """Tensors and modules made without a device argument land on the test device (CUDA
    on a GPU machine): ``pytestmark = pytest.mark.usefixtures("on_test_device")``."""
    prev = torch.get_default_device()
    torch.set_default_device(device)
    yield
    torch.set_default_device(prev)


@contextlib.contextmanager
def _file_lock(name: str):
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), name), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    """On the GPU: serialises ``gpu_big`` tests across processes, records the peak memory
    and hands cached blocks back after a large test (the other workers need them)."""
    if not ON_GPU:
        yield
        return
    big = request.node.get_closest_marker("gpu_big") is not None
    with _file_lock("linghe-gpu-big-tests.lock") if big else contextlib.nullcontext():
        torch.cuda.reset_peak_memory_stats(DEVICE)
        yield
        try:
            peak = torch.cuda.max_memory_allocated(DEVICE)
        except (RuntimeError, AssertionError):  # a test's patch of torch.cuda still active
            peak = None
        if peak is not None:
            request.node.user_properties.append(("gpu_peak_mib", round(peak / 2**20)))
        if torch.cuda.memory_reserved() > 2 * 2**30:
            torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh inputs for every test, reproducible from its name.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def compile_sm90(device):
    """Runs a script that compiles kernels for an H100/H200 (sm_90) without a GPU: in a
    subprocess without TRITON_INTERPRET, so GPU-only compile errors that the interpreter
    accepts show up on CPU too. The script prints COMPILED when every check passed."""
    if device == "cuda":
        pytest.skip("the GPU tests compile the kernels for real")
    pytest.importorskip("triton.backends.nvidia")
    import subprocess
    import sys

    def run(script: str, timeout: int = 600) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        r = subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 and "ptxas" in r.stderr and "fatal" in r.stderr:
            pytest.skip("this triton's ptxas cannot assemble for sm_90 here")
        assert r.returncode == 0 and "COMPILED" in r.stdout, r.stderr[-3000:]

    return run


@pytest.fixture(autouse=True)
def _autograd_threading():
    """Each test starts with PyTorch's default multithreaded backward: a patched Hugging
    Face model's training forward turns it off for the thread (``caller_thread_backward``)
    until a forward without gradients, which a test need not run."""
    torch._C._set_multithreading_enabled(True)
    yield
    torch._C._set_multithreading_enabled(True)
