"""How many programs of a compiled Triton kernel fit one SM at once, for persistent grids.

A persistent grid larger than what fits leaves programs waiting for a whole earlier
program to finish (a tail that can double the time); one smaller than what fits leaves
latency hiding unused. The fit is learned from the first launch's register and shared
memory use (``CompiledKernel.n_regs`` / ``metadata.shared``) and cached per key; before
that (and on the CPU interpreter) the caller's default is used. Any launch is correct
whatever the grid: only speed depends on it.
"""

from __future__ import annotations

from ..utils import _sum_partials_kernel, cdiv, device_guard, empty, launch, sum_partials

_RESIDENT: dict = {}

#: Hopper/Ampere per-SM limits: 64K 32-bit registers, 64 warps, 32 blocks, 227 KiB smem.
_REGS, _WARPS, _BLOCKS, _SMEM = 65536, 64, 32, 232448


def resident_programs(key, default: int) -> int:
    """Programs per SM for ``key`` (learned by :func:`learn_resident`, else ``default``)."""
    return _RESIDENT.get(key, default)


def learn_resident(key, compiled, num_warps: int, cap: int) -> None:
    """Record programs per SM (at most ``cap``) of the kernel ``compiled`` (what a launch
    returned); silently does nothing when the launch gave no register count."""
    if key in _RESIDENT:
        return
    try:
        regs = int(compiled.n_regs)
        shared = int(compiled.metadata.shared)
    except Exception:  # interpreter (no compiled kernel) or another triton version
        return
    if regs <= 0:
        return
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in 256s
    n = min(_REGS // (per_warp * num_warps), _WARPS // num_warps, _BLOCKS)
    if shared > 0:
        n = min(n, _SMEM // (shared + 1024))
    _RESIDENT[key] = max(1, min(n, cap))


def sum_partials_tall(partial, dtype):
    """:func:`linghe.utils.sum_partials` for tall ``[P, N]`` partials (hundreds of rows,
    few columns): the same kernel with narrower column blocks and taller row blocks, so
    more programs share the work and each walks fewer row blocks (it is latency-bound)."""
    P, N = partial.shape
    if N == 0 or P == 0:
        return sum_partials(partial, dtype)
    out = empty(N, dtype=dtype, device=partial.device)
    BLOCK_N = 16
    with device_guard(partial):
        launch(_sum_partials_kernel, (cdiv(N, BLOCK_N),), partial, out, P, N, BLOCK_P=128,
               BLOCK_N=BLOCK_N, num_warps=4)
    return out
