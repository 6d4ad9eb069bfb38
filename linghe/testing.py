"""Comparison helpers shared by the test suite and the benchmark's correctness check."""

from __future__ import annotations

import torch

from .fp8.tensor import Fp8Tensor

#: Default relative-error bound by output dtype (DESIGN.md: fp32 far under 1e-5, bf16 1e-2).
REL_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3,
           torch.bfloat16: 1e-2}


def _as_float(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, Fp8Tensor):
        t = t.dequantize(dtype=torch.float32)
    return t.detach().double() if t.is_floating_point() else t.detach()


def as_stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (float32) rounded to ``dtype`` the way a kernel's store rounds it: to
    nearest even on the GPU; on the Triton interpreter bf16 stores truncate (a known
    quirk of its casts), so there the low 16 bits are dropped. Returned as float32."""
    from .utils import INTERPRET

    if INTERPRET and dtype == torch.bfloat16 and t.dtype == torch.float32:
        return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)
    return t.to(dtype).float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 over finite entries of ``ref`` (``||out - ref||``
    when ``ref`` is all zeros). ``inf`` if ``out`` has NaN where ``ref`` does not."""
    o, r = _as_float(out), _as_float(ref)
    if o.shape != r.shape:
        raise AssertionError(f"shape {tuple(o.shape)} != reference shape {tuple(r.shape)}")
    if o.numel() == 0:
        return 0.0
    if not o.is_floating_point():
        return float((o != r).sum().item())
    finite = torch.isfinite(r)
    if bool(((~torch.isfinite(o)) & finite).any()):
        return float("inf")
    d = (o - r)[finite].norm().item()
    n = r[finite].norm().item()
    return d / n if n > 0 else d


def assert_close(out, ref, tol: float | None = None, name: str = "output") -> None:
    """Assert ``rel_err(out, ref) <= tol`` (default by ``out``'s dtype) and that non-finite
    entries of ``ref`` are non-finite in ``out`` too."""
    if tol is None:
        tol = REL_TOL.get(out.dtype, 1e-5)
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
    r = _as_float(ref)
    if r.is_floating_point() and r.numel():
        nonfinite = ~torch.isfinite(r)
        if bool(nonfinite.any()):
            o = _as_float(out)
            assert bool((~torch.isfinite(o[nonfinite])).all()), f"{name}: NaN/Inf not propagated"


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values at magnitude ``|v|`` (2^-9 in the subnormal range)."""
    a = v.float().abs().clamp_min(2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


def assert_fp8_close(q: torch.Tensor, ref_q: torch.Tensor, name: str = "fp8 data") -> None:
    """Assert fp8 data equals the reference quantization within one e4m3 step."""
    a, b = q.float(), ref_q.float()
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    both_nan = a.isnan() & b.isnan()
    bad = ~both_nan & ((a - b).abs() > e4m3_step(b))
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements off by more than one step"
