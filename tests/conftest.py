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
