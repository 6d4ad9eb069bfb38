"""Picks the device: CUDA when present, else CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported (linghe imports it), so this runs
first. Outputs that linghe allocates are NaN-poisoned, so an unwritten element fails.
"""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["LINGHE_POISON_OUTPUTS"] = "1"

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


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
