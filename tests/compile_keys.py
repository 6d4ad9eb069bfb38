"""Counts the distinct Triton compile keys that each test file launches.

On a GPU nearly all of a kernel test's time is Triton compiling one binary per compile key
(the kernel, its constexpr values, the dtypes and 16-byte alignment of its pointers, the
width and divisibility by 16 of its integer arguments, whether an integer is 1, and the
launch options such as ``num_warps``). This plugin records that key for every launch and
prints, per test file, how many distinct keys the file needs; the union over all files is
what a run compiles with a shared Triton cache. It works the same on CPU (the interpreter
compiles nothing, but the key a GPU would compile is computed from the same arguments),
so a change that thins the GPU suite can be measured without a GPU.

The key is computed here, not read from Triton (whose specialisation lives in C and
changes between versions); it follows Triton 3.x's rules closely enough to count.

Use: ``pytest tests --compile-keys`` (table at the end) or ``--compile-keys=PATH`` (also
writes ``{test id: [keys]}`` as JSON). Works with pytest-xdist (workers send their keys).
"""

from __future__ import annotations

import inspect
import json
from collections import defaultdict

import pytest
import torch

_KEYS: dict[str, set[str]] = defaultdict(set)  # test id -> compile keys
_current = ["<outside tests>"]
_params: dict = {}  # python function -> (signature, names of constexpr params)
_SPEC_CACHE_OPTIONS = ("warmup", "grid")


def _kernel_params(fn):
    info = _params.get(fn)
    if info is None:
        sig = inspect.signature(fn)
        const = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
        info = _params[fn] = (sig, const)
    return info


def _spec(v) -> str:
    """What Triton specialises a runtime (non-constexpr) argument on."""
    if isinstance(v, torch.Tensor):
        return f"*{str(v.dtype)[6:]}{'/16' if v.data_ptr() % 16 == 0 else ''}"
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        if v == 1:
            return "=1"
        width = "i32" if -2**31 <= v < 2**31 else ("i64" if v < 2**63 else "u64")
        return width + ("/16" if v % 16 == 0 else "")
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return "None"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_spec(x) for x in v) + ")"
    return repr(v)


def compile_key(kernel, args, kwargs) -> str:
    """The compile key of ``kernel[grid](*args, **kwargs)`` (a readable string)."""
    fn = getattr(kernel, "fn", kernel)
    while hasattr(fn, "fn"):  # Autotuner / Heuristics wrap a JITFunction
        fn = fn.fn
    sig, const = _kernel_params(fn)
    names = list(sig.parameters)
    values = dict(zip(names, args))
    options = {}
    for k, v in kwargs.items():
        if k in sig.parameters:
            values[k] = v
        elif k not in _SPEC_CACHE_OPTIONS:
            options[k] = v  # launch options (num_warps, num_stages, ...)
    for n, p in sig.parameters.items():
        if n not in values and p.default is not inspect.Parameter.empty:
            values[n] = p.default
    parts = [f"{n}={v!r}" if n in const else _spec(v) for n, v in values.items()]
    parts += [f"{k}={v!r}" for k, v in sorted(options.items())]
    return f"{fn.__module__}.{fn.__qualname__}[{', '.join(parts)}]"


def _record(kernel, args, kwargs):
    try:
        _KEYS[_current[0]].add(compile_key(kernel, args, kwargs))
    except Exception as e:  # never let the counter break a test
        _KEYS[_current[0]].add(f"<uncounted {type(e).__name__}>")


def _wrap_run(cls):
    orig = cls.run

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup", False):
            _record(self, args, kwargs)
        return orig(self, *args, **kwargs)

    run.__wrapped__ = orig
    cls.run = run


def _wrap_launcher(cls):
    orig = cls.__call__

    def call(self, grid, args, kwargs):
        _record(self.fn, args, kwargs)
        return orig(self, grid, args, kwargs)

    call.__wrapped__ = orig
    cls.__call__ = call


class CompileKeyCounter:
    """The pytest plugin (registered by tests/conftest.py for ``--compile-keys``)."""

    def __init__(self, config):
        self.config = config
        self.path = config.getoption("compile_keys")
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        import linghe.utils

        # Every launch reaches one of these: the interpreter's run, Triton's own launch
        # path (autotuned kernels, first call of a key), or linghe's cached launcher.
        _wrap_run(InterpretedFunction)
        _wrap_run(JITFunction)
        _wrap_launcher(linghe.utils._Launcher)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        _current[0] = item.nodeid
        yield
        _current[0] = "<outside tests>"

    def pytest_sessionfinish(self, session):
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: hand the keys to the controller
            workeroutput["linghe_compile_keys"] = {f: sorted(k) for f, k in _KEYS.items()}

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        for f, keys in getattr(node, "workeroutput", {}).get("linghe_compile_keys", {}).items():
            _KEYS[f].update(keys)

    def pytest_terminal_summary(self, terminalreporter):
        if getattr(self.config, "workeroutput", None) is not None:
            return
        tr = terminalreporter
        tr.section("distinct Triton compile keys per test file")
        files: dict[str, set[str]] = defaultdict(set)
        for test, keys in _KEYS.items():
            files[test.split("::", 1)[0]] |= keys
        total: set[str] = set()
        for f in sorted(files):
            kernels = {k.split("[", 1)[0] for k in files[f]}
            tr.write_line(f"{len(files[f]):6d} keys {len(kernels):4d} kernels  {f}")
            total |= files[f]
        kernels = {k.split("[", 1)[0] for k in total}
        if not total:  # xdist workers send their keys only when they finish
            tr.write_line("no compile keys recorded (did the run finish?)")
            return
        tr.write_line(f"{len(total):6d} keys {len(kernels):4d} kernels  all files (distinct)")
        if self.path and self.path != "-":
            with open(self.path, "w") as fh:
                json.dump({t: sorted(k) for t, k in sorted(_KEYS.items())}, fh, indent=0)
            tr.write_line(f"keys per test written to {self.path}")
