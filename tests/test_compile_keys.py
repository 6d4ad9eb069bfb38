"""tests/compile_keys.py (the per-file compile-key counter used to measure the GPU subset):
its key must tell apart exactly what Triton compiles separately."""

import torch
import triton
import triton.language as tl
from compile_keys import compile_key


@triton.jit
def _k(x_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def test_key_follows_triton_specialization(device):
    x = torch.zeros(64, device=device)
    key = lambda *a, **kw: compile_key(_k, a, {"BLOCK": 16, **kw})
    base = key(x, 37, 0.5)
    assert base == key(x, 39, 2.0)  # same width, divisibility, dtypes: one binary
    assert base == key(x, 37, 0.5, FLAG=False)  # an explicit default is the default
    assert base == key(x, 37, 0.5, grid=(1,), warmup=False)  # not launch options
    others = [
        key(x, 32, 0.5),  # divisible by 16
        key(x, 1, 0.5),  # == 1
        key(x, 2**31, 0.5),  # int64
        key(x[1:], 37, 0.5),  # pointer not 16-byte aligned
        key(x.bfloat16(), 37, 0.5),  # dtype
        key(x, 37, 0.5, FLAG=True),  # constexpr
        key(x, 37, 0.5, num_warps=8),  # launch option
        compile_key(_k, (x, 37, 0.5), {"BLOCK": 32}),
    ]
    assert len({base, *others}) == len(others) + 1
    assert base.startswith(f"{__name__}._k[")
