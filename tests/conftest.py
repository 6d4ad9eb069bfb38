"""Picks the device: CUDA when present, else CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported (linghe imports it), so this runs
first. Outputs that linghe allocates are NaN-poisoned, so an unwritten element fails.

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


def pytest_addoption(parser):
    parser.addoption("--compile-keys", nargs="?", const="-", default=None, metavar="PATH",
                     help="count distinct Triton compile keys per test file (tests/"
                          "compile_keys.py); with PATH, also write them per test as JSON")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu_big: needs tens of GB of GPU memory; on the GPU such tests run one "
                   "at a time across xdist workers (a file lock in tests/conftest.py)")
    if config.getoption("compile_keys"):
        from compile_keys import CompileKeyCounter

        config.pluginmanager.register(CompileKeyCounter(config), "linghe_compile_keys")


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


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
        torch.cuda.reset_peak_memory_stats()
        yield
        peak = torch.cuda.max_memory_allocated()
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
