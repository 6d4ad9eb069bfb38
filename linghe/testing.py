"""Comparison helpers shared by the test suite and the benchmark's correctness check."""

from __future__ import annotations

import torch

from .fp8.tensor import Fp8Tensor

#: Default relative-error bound by output dtype (DESIGN.md: fp32 far under 1e-5, bf16 1e-2).
REL_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3,
           torch.bfloat16: 1e-2}


def as_stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (float32) rounded to ``dtype`` the way a kernel's store rounds it: to
    nearest even on the GPU; on the Triton interpreter bf16 stores truncate (a known
    quirk of its casts), so there the low 16 bits are dropped. Returned as float32."""
    from .utils import INTERPRET

    if INTERPRET and dtype == torch.bfloat16 and t.dtype == torch.float32:
        return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)
    return t.to(dtype).float()


#: Elements compared per step (float64 temporaries of ~0.5 GB): a standard-shape
#: cross-entropy gradient (1.3 G elements) then fits beside its reference on an 80 GB GPU.
_CHUNK = 1 << 26


def _pieces(out: torch.Tensor, ref: torch.Tensor):
    """``(out, ref)`` as float64 (integers as they are) flat chunks of ``_CHUNK``."""
    if isinstance(out, Fp8Tensor):
        out = out.dequantize(dtype=torch.float32)
    if isinstance(ref, Fp8Tensor):
        ref = ref.dequantize(dtype=torch.float32)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    for i in range(0, o.numel(), _CHUNK):
        oc, rc = o[i:i + _CHUNK], r[i:i + _CHUNK]
        yield ((oc.double() if oc.is_floating_point() else oc),
               (rc.double() if rc.is_floating_point() else rc))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 over finite entries of ``ref`` (``||out - ref||``
    when ``ref`` is all zeros). ``inf`` if ``out`` has NaN where ``ref`` does not.
    Integer tensors: the number of differing entries. Computed in chunks (bounded
    memory for very large tensors)."""
    d2 = n2 = 0.0
    mismatches = None
    for o, r in _pieces(out, ref):
        if not o.is_floating_point():
            mismatches = (mismatches or 0) + int((o != r).sum().item())
            continue
        finite = torch.isfinite(r)
        if bool(((~torch.isfinite(o)) & finite).any()):
            return float("inf")
        d2 += float(((o - r)[finite] ** 2).sum().item())
        n2 += float((r[finite] ** 2).sum().item())
    if mismatches is not None:
        return float(mismatches)
    d, n = d2 ** 0.5, n2 ** 0.5
    return d / n if n > 0 else d


def assert_close(out, ref, tol: float | None = None, name: str = "output") -> None:
    """Assert ``rel_err(out, ref) <= tol`` (default by ``out``'s dtype) and that non-finite
    entries of ``ref`` are non-finite in ``out`` too."""
    if tol is None:
        tol = REL_TOL.get(out.dtype, 1e-5)
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
    for o, r in _pieces(out, ref):
        if r.is_floating_point():
            nonfinite = ~torch.isfinite(r)
            if bool(nonfinite.any()):
                assert bool((~torch.isfinite(o[nonfinite])).all()), \
                    f"{name}: NaN/Inf not propagated"


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values at magnitude ``|v|`` (2^-9 in the subnormal range)."""
    a = v.float().abs().clamp_min(2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


def assert_fp8_close(q: torch.Tensor, ref_q: torch.Tensor, name: str = "fp8 data") -> None:
    """Assert fp8 data equals the reference quantization within one e4m3 step."""
    a, b = q.float(), ref_q.float()
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    both_nan = a.isnan() & b.isnan()
    # a NaN on one side only is a mismatch (an unwritten, NaN-poisoned output element
    # would otherwise pass: NaN > step is False)
    bad = ~both_nan & ((a - b).abs() > e4m3_step(b)) | (a.isnan() != b.isnan())
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements off by more than one step"
