"""RMSNorm (+ residual add) and RMSNorm + 1x128 FP8 quantization, forward and backward."""

import contextlib
import zlib

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.fwd import norm as fwd_norm
from linghe.testing import REL_TOL, assert_close, assert_fp8_close, rel_err
from linghe.utils import INTERPRET

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]

# (shape, dtype): a representative subset of hidden {1, 3, 127, 1000, 5120} x rows
# {0, 1, 7, 300} x dtypes (the interpreter is slow), plus N-D input and a hidden size
# above the single-tile limit (multi-pass path).
CASES = [
    ((1, 1), F32), ((7, 1), BF16), ((300, 3), F32), ((7, 3), F16), ((1, 127), BF16),
    ((300, 127), F16), ((7, 127), F32), ((0, 127), BF16), ((7, 1000), BF16),
    ((300, 1000), F32), ((1, 5120), F16), ((7, 5120), BF16), ((0, 5120), F32),
    ((2, 5, 127), BF16), ((3, 9000), F32), ((2, 9000), BF16),
]
IDS = [f"{'x'.join(map(str, s))}-{str(d)[6:]}" for s, d in CASES]


def _ref_grads(x, w, r, eps, grads):
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    rr = r.detach().double().requires_grad_() if r is not None else None
    out = ref.rms_norm(xr, wr, eps, rr)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [g.double() for g in grads])
    return outs, xr.grad, wr.grad, (rr.grad if rr is not None else None)


def _assert_dx_close(dx, dx_ref, x, w, dy, eps, name="dx"):
    """Relative to ``||rstd * dy * w||`` (dx's natural scale): dx = rstd*(g - xhat*c)
    cancels when K is tiny, so ``||dx_ref||`` alone is not a fair yardstick."""
    xf = x.detach().double()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scale = (rstd * dy.double() * w.detach().double()).norm().item()
    err = (dx.detach().double() - dx_ref).norm().item() / max(scale, 1e-30)
    assert err <= REL_TOL[dx.dtype], f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize("shape,dtype", CASES, ids=IDS)
def test_rms_norm_matches_reference(device, shape, dtype):
    K = shape[-1]
    eps = 1e-6
    x = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    w = (torch.rand(K, device=device) + 0.5).to(dtype).requires_grad_()
    y = linghe.rms_norm(x, w, eps)
    assert y.shape == x.shape and y.dtype == dtype
    dy = torch.randn(shape, device=device).to(dtype)
    y.backward(dy)
    (y_ref,), dx_ref, dw_ref, _ = _ref_grads(x, w, None, eps, [dy])
    assert_close(y, y_ref, name="y")
    _assert_dx_close(x.grad, dx_ref, x, w, dy, eps)
    assert w.grad.dtype == dtype
    assert_close(w.grad, dw_ref, name="dweight")


@pytest.mark.parametrize("shape,dtype", [((7, 127), F32), ((300, 1000), BF16),
                                         ((1, 3), F16), ((0, 5), F32), ((2, 9000), F16),
                                         ((2, 3, 130), BF16)])
def test_rms_norm_residual(device, shape, dtype):
    K = shape[-1]
    eps = 1e-5
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    r = torch.randn(shape, device=device).to(dtype).requires_grad_()
    w = torch.randn(K, device=device).to(dtype).requires_grad_()
    y, h = linghe.rms_norm(x, w, eps, residual=r)
    assert y.dtype == h.dtype == dtype and y.shape == h.shape == x.shape
    dy = torch.randn(shape, device=device).to(dtype)
    dh = torch.randn(shape, device=device).to(dtype)
    torch.autograd.backward([y, h], [dy, dh])
    (y_ref, h_ref), dx_ref, dw_ref, dr_ref = _ref_grads(x, w, r, eps, [dy, dh])
    assert_close(y, y_ref, name="y")
    hh = (x + r).detach()
    if device == "cuda":  # the interpreter truncates fp32 -> bf16/fp16 stores
        assert torch.equal(h, hh), "h must be x + residual rounded to x's dtype"
    assert_close(h, h_ref, name="h")
    _assert_dx_close(x.grad, dx_ref, hh, w, dy, eps, "dx")
    _assert_dx_close(r.grad, dr_ref, hh, w, dy, eps, "dresidual")
    assert_close(w.grad, dw_ref, name="dweight")


def test_rms_norm_residual_only_one_output_used(device):
    x = torch.randn(7, 130, device=device, requires_grad=True)
    r = torch.randn(7, 130, device=device, requires_grad=True)
    w = torch.randn(130, device=device, requires_grad=True)
    y, h = linghe.rms_norm(x, w, residual=r)
    (h * 2).sum().backward()  # y unused: dx = dr = 2
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    torch.testing.assert_close(r.grad, torch.full_like(r, 2.0))
    assert w.grad is None
    x.grad = r.grad = None
    y, h = linghe.rms_norm(x, w, residual=r)
    y.sum().backward()  # h unused
    (y_ref, _), dx_ref, dw_ref, dr_ref = _ref_grads(x, w, r, 1e-6, [torch.ones_like(x),
                                                                       torch.zeros_like(x)])
    assert_close(x.grad, dx_ref)
    assert_close(r.grad, dr_ref)
    assert_close(w.grad, dw_ref)


def test_rms_norm_weight_dtype_differs(device):
    x = torch.randn(7, 200, device=device, dtype=BF16, requires_grad=True)
    w = torch.randn(200, device=device, dtype=F32, requires_grad=True)
    y = linghe.rms_norm(x, w)
    assert y.dtype == BF16
    y.float().square().sum().backward()
    assert w.grad.dtype == F32 and x.grad.dtype == BF16
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    ref.rms_norm(xr, wr).square().sum().backward()
    assert_close(w.grad, wr.grad, tol=2e-2)


def test_rms_norm_matches_torch(device):
    x = torch.randn(5, 300, device=device)
    w = torch.randn(300, device=device)
    torch.testing.assert_close(linghe.rms_norm(x, w, 1e-6),
                               torch.nn.functional.rms_norm(x, (300,), w, 1e-6),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", [100, 9000])
def test_rms_norm_strided_rows(device, K):
    # Rows of a wider buffer (stride(0) != K), a strided weight, residual too.
    big = torch.randn(5, K + 30, device=device)
    x = big[:, :K].requires_grad_()
    r = torch.randn(5, K + 7, device=device)[:, 3:K + 3].requires_grad_()
    w = torch.randn(2 * K, device=device)[::2].requires_grad_()
    y, h = linghe.rms_norm(x, w, residual=r)
    dy = torch.randn(5, 2 * K, device=device)[:, ::2]  # non-contiguous gradient
    y.backward(dy)
    (y_ref, _), dx_ref, dw_ref, dr_ref = _ref_grads(x, w, r, 1e-6,
                                                     [dy, torch.zeros(5, K, device=device)])
    assert_close(y, y_ref)
    assert_close(x.grad, dx_ref)
    assert_close(r.grad, dr_ref)
    assert_close(w.grad, dw_ref)
    t = linghe.rms_norm_quant(x.detach(), w.detach())
    q, s, qt, st = ref.rms_norm_quant(x.detach(), w.detach())
    assert_fp8_close(t.rowwise_data, q)
    assert_fp8_close(t.columnwise_data, qt)


@pytest.mark.parametrize("prefetch", [True, False])
def test_rms_norm_persistent_loops(device, monkeypatch, prefetch):
    # Few programs, many row blocks each: both the prefetching and the plain loops.
    from linghe.bwd import norm as bwd_norm
    monkeypatch.setattr(fwd_norm, "FWD_PREFETCH", prefetch)
    monkeypatch.setattr(fwd_norm, "FWD_PREFETCH_MIN_K", 0)
    monkeypatch.setattr(bwd_norm, "BWD_PREFETCH", prefetch)
    monkeypatch.setattr(fwd_norm, "FWD_PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(bwd_norm, "BWD_PROGRAMS_PER_SM", 1)
    x = torch.randn(301, 200, device=device, dtype=BF16, requires_grad=True)
    r = torch.randn(301, 200, device=device, dtype=BF16, requires_grad=True)
    w = torch.randn(200, device=device, dtype=BF16, requires_grad=True)
    y, h = linghe.rms_norm(x, w, residual=r)
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward([y, h], [dy, dh])
    (y_ref, h_ref), dx_ref, dw_ref, dr_ref = _ref_grads(x, w, r, 1e-6, [dy, dh])
    assert_close(y, y_ref)
    assert_close(h, h_ref)
    assert_close(x.grad, dx_ref)
    assert_close(r.grad, dr_ref)
    assert_close(w.grad, dw_ref)


def test_rms_norm_dweight_deterministic(device):
    x = torch.randn(300, 127, device=device, requires_grad=True)
    w = torch.randn(127, device=device, requires_grad=True)
    dy = torch.randn(300, 127, device=device)
    grads = []
    for _ in range(2):
        w.grad = None
        linghe.rms_norm(x, w).backward(dy)
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1])


# --------------------------------------------------------------------------- quant
QCASES = [((300, 260), F32, False), ((7, 127), BF16, True), ((129, 1000), F16, False),
          ((1, 3), BF16, False), ((2, 70, 128), BF16, True), ((0, 256), F32, False),
          ((130, 1300), BF16, True)]


@pytest.mark.parametrize("shape,dtype,pow2", QCASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}-{p}" for s, d, p in QCASES])
@pytest.mark.parametrize("columnwise", [True, False])
def test_rms_norm_quant_matches_reference(device, shape, dtype, pow2, columnwise):
    K = shape[-1]
    x = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
    w = (torch.randn(K, device=device)).to(dtype).requires_grad_()
    t = linghe.rms_norm_quant(x, w, 1e-6, columnwise=columnwise, pow2_scale=pow2)
    assert isinstance(t, linghe.Fp8Tensor)
    assert t.shape == x.shape and t.dtype == dtype and t.requires_grad and t.grad_fn
    expect = ref.rms_norm_quant(x.detach(), w.detach(), 1e-6, columnwise=columnwise,
                                pow2_scale=pow2)
    assert_fp8_close(t.rowwise_data, expect[0], "rowwise data")
    assert_close(t.rowwise_scale, expect[1], tol=1e-5, name="rowwise scale")
    if columnwise:
        assert_fp8_close(t.columnwise_data, expect[2], "columnwise data")
        assert_close(t.columnwise_scale, expect[3], tol=1e-5, name="columnwise scale")
    else:
        assert t.columnwise_data is None
    # Straight-through backward == rms_norm's backward.
    dy = torch.randn(shape, device=device).to(dtype)
    t.backward(dy)
    dxq, dwq = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    linghe.rms_norm(x, w, 1e-6).backward(dy)
    # Same kernel; rstd may differ in its last bit (another summation order), so the
    # gradients agree to a rounding of the output dtype.
    assert_close(dxq, x.grad, tol=REL_TOL[dtype] / 10, name="dx")
    assert_close(dwq, w.grad, tol=REL_TOL[dtype] / 10, name="dweight")


@pytest.mark.parametrize("shape,dtype", [((37, 256), BF16), ((2, 3, 130), F32), ((0, 128), BF16)])
def test_rms_norm_quant_residual(device, shape, dtype):
    """``rms_norm_quant(x, w, residual=r)``: the FP8 copies of ``rms_norm_quant(x + r)``
    bit for bit, ``h = x + r``, and the gradients of the unfused add-then-norm (the
    residual stream's gradient added inside the norm's backward: one rounding, so equal
    to a rounding of the output dtype); also when only ``h`` is used."""
    K = shape[-1]
    x = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
    r = torch.randn(shape, device=device).to(dtype).requires_grad_()
    w = torch.randn(K, device=device).to(dtype).requires_grad_()
    y, h = linghe.rms_norm_quant(x, w, 1e-6, residual=r, pow2_scale=True)
    x2, r2 = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    h2 = x2 + r2
    y2 = linghe.rms_norm_quant(h2, w2, 1e-6, pow2_scale=True)
    assert torch.equal(h, h2) and h.shape == x.shape
    for a in ("rowwise_data", "columnwise_data"):
        assert torch.equal(getattr(y, a).view(torch.uint8), getattr(y2, a).view(torch.uint8))
    assert torch.equal(y.rowwise_scale, y2.rowwise_scale)
    assert torch.equal(y.columnwise_scale, y2.columnwise_scale)
    dy = torch.randn(shape, device=device).to(dtype)
    dh = torch.randn(shape, device=device).to(dtype)
    torch.autograd.backward([y, h], [dy, dh])
    torch.autograd.backward([y2, h2], [dy, dh])
    tol = REL_TOL[dtype]
    assert_close(x.grad, x2.grad, tol=tol, name="dx")
    assert torch.equal(x.grad, r.grad)
    assert_close(r.grad, r2.grad, tol=tol, name="dresidual")
    assert_close(w.grad, w2.grad, tol=tol / 10, name="dweight")
    # only h carries a gradient: it passes to x and the residual unchanged
    x.grad = r.grad = None
    _, h = linghe.rms_norm_quant(x, w, residual=r)
    h.backward(dh)
    assert torch.equal(x.grad, dh) and torch.equal(r.grad, dh)
    with pytest.raises(ValueError, match="residual must have shape"):
        linghe.rms_norm_quant(x, w, residual=r[..., :-1])


def test_rms_norm_quant_dequantize_backprops(device):
    x = torch.randn(130, 256, device=device, requires_grad=True)
    w = torch.randn(256, device=device, requires_grad=True)
    t = linghe.rms_norm_quant(x, w)
    assert_close(t.dequantize(), ref.rms_norm(x.detach(), w.detach()), tol=0.07)
    assert_close(t.dequantize(columnwise=True), ref.rms_norm(x.detach(), w.detach()),
                 tol=0.07)
    proj = torch.randn(256, 5, device=device)
    (t.dequantize() @ proj).square().sum().backward()
    g1 = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    # Any torch op on the Fp8Tensor itself backprops too.
    t2 = linghe.rms_norm_quant(x, w)
    (t2 @ proj).square().sum().backward()
    assert rel_err(x.grad, g1[0]) < 1e-6 and rel_err(w.grad, g1[1]) < 1e-6
    # and the gradient equals rms_norm's for the same upstream gradient
    dy = 2 * (t.dequantize().detach() @ proj) @ proj.t()
    x.grad = w.grad = None
    linghe.rms_norm(x, w).backward(dy)
    assert rel_err(g1[0], x.grad) < 1e-6 and rel_err(g1[1], w.grad) < 1e-6


def test_rms_norm_quant_group_major_scales_read_right(device):
    """``rms_norm_quant`` (eager) stores its scales group-major (what the FP8 Linear's
    cuBLAS GEMMs read); every consumer of its Fp8Tensor gives what the same values with
    contiguous scales give: dequantize, permute's FP8 rows (and the token rows it keeps),
    the grouped columnwise requantization, the rows' dequantization and the accumulating
    wgrad that reads FP8 rows."""
    from linghe.bwd import grouped_mm as bwd_gm
    from linghe.fp8.quantize import dequantize_1x128_rows

    T, H, E = 37, 256, 3
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w = torch.rand(H, device=device, dtype=torch.bfloat16) + 0.5
    t = linghe.rms_norm_quant(x, w)
    s, st = t.rowwise_scale, t.columnwise_scale
    assert s.stride() == (1, T) and st.stride() == (1, H)
    c = t.with_components(rowwise_scale=s.contiguous(), columnwise_scale=st.contiguous())
    assert torch.equal(t.dequantize(), c.dequantize())
    assert torch.equal(t.dequantize(columnwise=True), c.dequantize(columnwise=True))
    assert torch.equal(dequantize_1x128_rows(t.rowwise_data, s),
                       dequantize_1x128_rows(c.rowwise_data, c.rowwise_scale))
    ids = torch.randint(0, E, (T, 2), device=device, dtype=torch.int32)
    rows, _, layout = linghe.permute(t, ids, num_experts=E, align=16)
    rows_c, _, _ = linghe.permute(c, ids, num_experts=E, align=16)
    assert torch.equal(rows.rowwise_scale, rows_c.rowwise_scale)
    assert torch.equal(rows.rowwise_data.view(torch.uint8), rows_c.rowwise_data.view(torch.uint8))
    tok, tok_c = rows._linghe_token_rows, rows_c._linghe_token_rows
    assert torch.equal(tok.dequantized(torch.bfloat16), tok_c.dequantized(torch.bfloat16))
    # rows grouped by expert with group-major scales (a transposed copy of permute's)
    gm = rows.with_components(rowwise_scale=rows.rowwise_scale.t().contiguous().t())
    q1 = linghe.quantize_grouped_1x128(gm, layout, rowwise=False)
    q2 = linghe.quantize_grouped_1x128(rows, layout, rowwise=False)
    assert torch.equal(q1.columnwise_scale, q2.columnwise_scale)
    R = layout.num_rows
    d_out = torch.randn(R, 128, device=device, dtype=torch.bfloat16)
    dw1 = torch.zeros(E, 128, H, device=device, dtype=torch.bfloat16)
    dw2 = dw1.clone()
    bwd_gm.grouped_mm_wgrad_accumulate_(dw1, d_out, gm.rowwise_data, layout.offsets,
                                        rows_scale=gm.rowwise_scale)
    bwd_gm.grouped_mm_wgrad_accumulate_(dw2, d_out, rows.rowwise_data, layout.offsets,
                                        rows_scale=rows.rowwise_scale)
    assert torch.equal(dw1, dw2)


def test_rms_norm_quant_columnwise_is_not_transpose(device):
    x = torch.randn(256, 128, device=device)
    x[0] *= 100
    w = torch.ones(128, device=device)
    t = linghe.rms_norm_quant(x, w)
    assert not torch.equal(t.columnwise_data.t().float(), t.rowwise_data.float())


# The two kernels of rms_norm_quant (rows: rstd + rowwise copy; tiles: columnwise copy) and
# their knobs: the alternative split (rstd only, then the tiles write both copies), tile
# order and size, the multi-pass rows path (rows wider than the rows config's max_bk), odd
# shapes (M and K not multiples of 128, M = 1), NaN in the input.
NQ_KNOBS = [
    dict(),
    dict(QUANT_MODE="rstd_tiles"),
    dict(QUANT_TILE_REVERSE=False, QUANT_TILE_COLS=dict(bm=128, bn=32, warps=2,
                                                         k_fast=False)),
    dict(QUANT_MODE="rstd_tiles", QUANT_TILE_ROWCOL=dict(bm=128, bn=128, warps=8,
                                                         k_fast=True)),
    dict(QUANT_ROWS_CONFIG=dict(rows=2, elems=8192, warps=4, max_bk=256)),
    dict(QUANT_ROWS_CONFIG=dict(rows=2, elems=8192, warps=4, max_bk=8192, per_sm=1)),
    dict(QUANT_ROWS_CONFIG=dict(rows=2, elems=8192, warps=4, max_bk=256, per_sm=1),
         QUANT_MODE="rstd_tiles"),
    dict(QUANT_ROWS_CONFIG=dict(rows=2, elems=8192, warps=4, max_bk=256),
         QUANT_MODE="rstd_tiles"),
]


def _nq_cases():
    """``(knobs, columnwise)``: every knob set with the columnwise copy; rowwise only, the
    rows kernel alone runs (QUANT_MODE and the tile configs do not apply), so one knob set
    per distinct QUANT_ROWS_CONFIG."""
    cases = [pytest.param(k, True, id=f"True-{i}") for i, k in enumerate(NQ_KNOBS)]
    seen = []
    for i, k in enumerate(NQ_KNOBS):
        rows_cfg = k.get("QUANT_ROWS_CONFIG")
        if rows_cfg not in seen:
            seen.append(rows_cfg)
            cases.append(pytest.param(k, False, id=f"False-{i}"))
    return cases


_NQ_DEFAULT = {}


def _nq_default(M, K, columnwise, device, nan):
    """``(x, w, rms_norm_quant(x, w) under the default kernels)`` for
    test_rms_norm_quant_kernels on the interpreter: one input per shape (seeded by it;
    row 0 all NaN where ``nan``), the defaults' outputs once per set of copies."""
    key = (M, K, columnwise, str(device))
    if key not in _NQ_DEFAULT:
        g = torch.Generator().manual_seed(zlib.crc32(f"{M}x{K}".encode()))
        x = torch.randn(M, K, generator=g).to(device)
        w = torch.randn(K, generator=g).to(device)
        if nan:
            x[0, 0] = float("nan")  # row 0 is all NaN (its rstd is NaN)
        _NQ_DEFAULT[key] = x, w, linghe.rms_norm_quant(x, w, columnwise=columnwise)
    return _NQ_DEFAULT[key]


# (130, 300): M past one 128-row tile, K two 128-groups and a 44-column tail (two passes of
# the max_bk=256 rows configs, a partial last column tile); (5, 9000): rows wider than the
# default max_bk (8192), more rows than the CPU's persistent programs (4).
@pytest.mark.gpu_subset(**{"M,K": [(130, 300), (5, 9000)]})
@pytest.mark.parametrize("M,K", [(130, 300), (1, 1000), (257, 128), (5, 9000)])
@pytest.mark.parametrize("knobs,columnwise", _nq_cases())
def test_rms_norm_quant_kernels(device, monkeypatch, M, K, knobs, columnwise):
    nan = M > 1
    rows_cfg = knobs.get("QUANT_ROWS_CONFIG")
    per_sm = rows_cfg is not None and rows_cfg.get("per_sm")
    if INTERPRET:
        # one input per shape; the defaults' outputs computed once per shape and copies
        x, w, want = _nq_default(M, K, columnwise, device, nan)
        x = x.clone().requires_grad_(True)
    else:
        x = torch.randn(M, K, device=device, requires_grad=True)
        w = torch.randn(K, device=device)
        if nan:
            with torch.no_grad():
                x[0, 0] = float("nan")  # row 0 is all NaN (its rstd is NaN)
    if per_sm:
        # the persistent rows kernel against the same tiles one block per program
        monkeypatch.setattr(fwd_norm, "QUANT_ROWS_CONFIG", dict(rows_cfg, per_sm=0))
    if per_sm or not INTERPRET:
        want = linghe.rms_norm_quant(x.detach(), w, columnwise=columnwise)
    for k, v in knobs.items():
        monkeypatch.setattr(fwd_norm, k, v)
    t = linghe.rms_norm_quant(x, w, columnwise=columnwise)
    # The tile kernel's knobs and the persistent rows kernel give the same bits as the
    # defaults (as the same rows tiles): the same rstd and fp32 y. (Another rows tile, or
    # the rstd-only rows kernel of "rstd_tiles", may lay the row out otherwise on the GPU
    # and sum it in another order: rstd may differ in its last bits.)
    if "QUANT_MODE" not in knobs and (rows_cfg is None or rows_cfg.get("per_sm")):
        for a, b in zip([t.rowwise_data, t.rowwise_scale, t.columnwise_data,
                         t.columnwise_scale],
                        [want.rowwise_data, want.rowwise_scale, want.columnwise_data,
                         want.columnwise_scale]):
            assert (a is None and b is None) or torch.equal(
                a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))
    expect = ref.rms_norm_quant(x.detach(), w, columnwise=columnwise)
    r0 = 1 if nan else 0
    assert t.rowwise_data[:r0].float().isnan().all()
    assert_fp8_close(t.rowwise_data[r0:], expect[0][r0:])
    assert_close(t.rowwise_scale[r0:], expect[1][r0:])
    if columnwise:
        # Token 0's NaN: NaN data in its column, and the reference's NaN group amax makes
        # its whole column group NaN, so the groups of tokens 128... are compared.
        assert t.columnwise_data[:, :r0].float().isnan().all()
        assert_fp8_close(t.columnwise_data[:, 128:], expect[2][:, 128:])
        assert_close(t.columnwise_scale[:, 1:], expect[3][:, 1:])
    else:
        assert t.columnwise_data is None
    # The backward gets what the forward saved (rstd): rms_norm's gradient.
    dy = torch.randn(M, K, device=device)
    t.backward(dy)
    gq = x.grad[r0:].clone()
    x.grad = None
    linghe.rms_norm(x, w).backward(dy)
    assert_close(gq, x.grad[r0:], tol=1e-6)


# ---------------------------------------------------------------------------- module
def test_nn_rmsnorm_like_torch(device):
    m = linghe.nn.RMSNorm(300, eps=1e-5, device=device)
    t = torch.nn.RMSNorm(300, eps=1e-5, device=device)
    assert torch.equal(m.weight, torch.ones(300, device=device))
    assert [n for n, _ in m.named_parameters()] == ["weight"]
    assert "300" in repr(m) and "eps=1e-05" in repr(m)
    with torch.no_grad():
        t.weight.normal_()
    m.load_state_dict(t.state_dict())
    x = torch.randn(4, 3, 300, device=device, requires_grad=True)
    y = m(x)
    y_t = t(x)
    assert_close(y, y_t)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, m.weight), dy)
    gx_t, gw_t = torch.autograd.grad(y_t, (x, t.weight), dy)
    assert_close(gx, gx_t)
    assert_close(gw, gw_t)
    # and back the other way
    with torch.no_grad():
        m.weight.uniform_()
    t.load_state_dict(m.state_dict())
    assert torch.equal(t.weight, m.weight)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.ones_like(m.weight))


@pytest.mark.parametrize("recipe", [None, "blockwise"])
def test_nn_rmsnorm_residual(device, recipe):
    """``RMSNorm(x, residual)`` = the residual add then the norm: ``(y, h)`` with ``h = x +
    residual`` bit for bit, and gradients to ``x``, ``residual`` and the weight as the
    unfused ``x + residual`` then the norm has them (fused kernel; with the blockwise
    recipe the documented separate add before rms_norm_quant)."""
    m = linghe.nn.RMSNorm(256, eps=1e-5, device=device)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(37, 256, device=device).to(torch.bfloat16).requires_grad_()
    r = torch.randn(37, 256, device=device).to(torch.bfloat16).requires_grad_()
    ctx = linghe.TrainingContext(fp8=recipe) if recipe else contextlib.nullcontext()
    with ctx:
        y, h = m(x, r)
        y_ref = m(x + r)
    if device == "cuda" or recipe:  # (the interpreter truncates the fused kernel's h)
        assert torch.equal(h, x + r)
    tol = REL_TOL[torch.bfloat16]
    assert_close(h, x + r, tol=tol)
    if recipe:
        assert isinstance(y, linghe.Fp8Tensor)
        y, y_ref = y.dequantize(), y_ref.dequantize()
    assert_close(y, y_ref, tol=tol)
    dy = torch.randn_like(y)
    dh = torch.randn_like(h)
    gx, gr, gw = torch.autograd.grad((y, h), (x, r, m.weight), (dy, dh))
    x2, r2 = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    with ctx:
        h2 = x2 + r2
        y2 = m(h2)
    if recipe:
        y2 = y2.dequantize()
    gx2, gr2, gw2 = torch.autograd.grad((y2, h2), (x2, r2, m.weight), (dy, dh))
    assert_close(gx, gx2, tol=tol)
    assert_close(gr, gr2, tol=tol)
    assert_close(gw, gw2, tol=tol)


def test_nn_rmsnorm_dtype_moves(device):
    m = linghe.nn.RMSNorm(64).to(device).to(torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16 and m.weight.device.type == device
    x = torch.randn(3, 64, device=device, dtype=torch.bfloat16)
    y = m(x)
    assert y.dtype == torch.bfloat16
    assert_close(y, ref.rms_norm(x.double(), m.weight.double().detach()).to(torch.bfloat16))
    m2 = linghe.nn.RMSNorm(64, dtype=torch.float16, device=device)
    assert m2.weight.dtype == torch.float16


# ------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("fn", ["rms_norm", "rms_norm_quant"])
def test_bad_inputs(device, fn):
    op = getattr(linghe, fn)
    x = torch.randn(4, 16, device=device)
    w = torch.ones(16, device=device)
    with pytest.raises(TypeError, match="x must have dtype"):
        op(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="x must have dtype"):
        op(x.double(), w)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        op([1.0], w)
    with pytest.raises(TypeError, match="weight must have dtype"):
        op(x, w.to(torch.int64))
    with pytest.raises(ValueError, match=r"weight must have shape \(16,\)"):
        op(x, torch.ones(15, device=device))
    with pytest.raises(ValueError, match="weight must be 1-D"):
        op(x, torch.ones(1, 16, device=device))
    with pytest.raises(ValueError, match="x must have a contiguous last dimension"):
        op(torch.randn(16, 4, device=device).t(), torch.ones(4, device=device))
    with pytest.raises(ValueError, match="x must have a non-empty last"):
        op(torch.randn(4, 0, device=device), torch.ones(0, device=device))
    with pytest.raises(ValueError, match="eps"):
        op(x, w, -1.0)
    if device == "cuda":
        with pytest.raises(ValueError, match="weight is on cpu"):
            op(x, w.cpu())
    else:
        with pytest.raises(ValueError, match="x is on meta"):
            op(x.to("meta"), w.to("meta"))


def test_bad_residual(device):
    x = torch.randn(4, 16, device=device)
    w = torch.ones(16, device=device)
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 16\)"):
        linghe.rms_norm(x, w, residual=torch.randn(4, 15, device=device))
    with pytest.raises(TypeError, match="residual must have dtype"):
        linghe.rms_norm(x, w, residual=torch.randn(4, 16, device=device).half())
    with pytest.raises(ValueError, match="residual must have a contiguous last"):
        linghe.rms_norm(x, w, residual=torch.randn(16, 4, device=device).t())
    with pytest.raises(ValueError, match="hidden_size"):
        linghe.nn.RMSNorm(0)


# ------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("K", [2048, 4096, 65536])
def test_gpu_standard_and_wide(device, K):
    M = 8192 if K <= 8192 else 256
    x = torch.randn(M, K, device=device, dtype=BF16, requires_grad=True)
    w = (torch.rand(K, device=device) + 0.5).to(BF16).requires_grad_()
    y = linghe.rms_norm(x, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    (y_ref,), dx_ref, dw_ref, _ = _ref_grads(x, w, None, 1e-6, [dy])
    assert_close(y, y_ref)
    _assert_dx_close(x.grad, dx_ref, x, w, dy, 1e-6)
    assert_close(w.grad, dw_ref)
    t = linghe.rms_norm_quant(x, w)
    q, s, qt, st = ref.rms_norm_quant(x.detach(), w.detach())
    assert_fp8_close(t.rowwise_data, q)
    assert_fp8_close(t.columnwise_data, qt)
    assert_close(t.rowwise_scale, s)
    assert_close(t.columnwise_scale, st)
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    t.backward(dy)
    assert_close(x.grad, dx, tol=1e-3)
    assert_close(w.grad, dw, tol=1e-3)


@pytest.mark.gpu
def test_gpu_residual_standard(device):
    x = torch.randn(8192, 2048, device=device, dtype=BF16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(2048, device=device, dtype=BF16, requires_grad=True)
    y, h = linghe.rms_norm(x, w, residual=r)
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward([y, h], [dy, dh])
    (y_ref, _), dx_ref, dw_ref, dr_ref = _ref_grads(x, w, r, 1e-6, [dy, dh])
    assert_close(y, y_ref)
    assert_close(x.grad, dx_ref)
    assert_close(r.grad, dr_ref)
    assert_close(w.grad, dw_ref)
