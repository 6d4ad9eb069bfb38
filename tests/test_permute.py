"""MoE permute / unpermute with padded indices (ExpertLayout contract)."""

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.testing import assert_close


def _ids(T, E, k, device):
    if T == 0:
        return torch.zeros(0, k, dtype=torch.int32, device=device)
    return torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(device, torch.int32)


CASES = [(0, 3, 2), (1, 1, 1), (1, 33, 4), (37, 8, 3), (37, 33, 5), (37, 3, 3), (37, 8, 8)]


# GPU subset (also for unpermute): (37, 8, 3) repeats the many-token routing of (37, 33, 5)
# and the power-of-two E of (37, 8, 8); (37, 3, 3) repeats k == E of (37, 8, 8).
GPU_CASES = [c for c in CASES if c not in ((37, 8, 3), (37, 3, 3))]


@pytest.mark.gpu_subset(**{"T,E,k": GPU_CASES})
@pytest.mark.parametrize("T,E,k", CASES)
@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_matches_reference(device, T, E, k, align, dtype):
    H = 100
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    probs = torch.rand(T, k, device=device, requires_grad=True)
    ids = _ids(T, E, k, device)
    rows, prow, lay = linghe.permute(x, ids, probs, num_experts=E, align=align)
    r_rows, r_prow, r_ri, r_off, r_cnt = ref.permute(x.detach(), ids, probs.detach(), E, align)
    assert rows.shape == (T * k + E * (align - 1), H) and rows.dtype == dtype
    assert lay.num_rows == rows.shape[0] and lay.align == align and lay.num_experts == E
    assert torch.equal(rows, r_rows)
    assert torch.equal(prow, r_prow)
    assert torch.equal(lay.row_index.long(), r_ri)
    assert lay.row_index.dtype == torch.int32
    assert torch.equal(lay.offsets.long(), r_off)
    assert torch.equal(lay.tokens_per_expert.long(), r_cnt)
    assert torch.equal(lay.padded_tokens_per_expert.long(), (r_cnt + align - 1) // align * align)
    # gradients of x and probs against autograd through the reference
    g = torch.randn_like(rows)
    gp = torch.randn_like(prow)
    dx, dp = torch.autograd.grad((rows, prow), (x, probs), (g, gp))
    xr = x.detach().float().requires_grad_()
    pr = probs.detach().clone().requires_grad_()
    a, b, *_ = ref.permute(xr, ids, pr, E, align)
    rdx, rdp = torch.autograd.grad((a, b), (xr, pr), (g.float(), gp))
    assert_close(dx, rdx, name="dx")
    assert_close(dp, rdp, name="dprobs")


@pytest.mark.gpu_subset(**{"T,E,k": GPU_CASES})
@pytest.mark.parametrize("T,E,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpermute_matches_reference_and_grads(device, T, E, k, dtype):
    H, align = 72, 4
    ids = _ids(T, E, k, device)
    x = torch.randn(T, H, device=device, dtype=dtype)
    rows, _, lay = linghe.permute(x, ids, num_experts=E, align=align)
    rows = (torch.randn_like(rows) * (rows != 0)).requires_grad_()  # expert outputs
    probs = torch.rand(T, k, device=device, requires_grad=True)
    out = linghe.unpermute(rows, lay, probs)
    rr = rows.detach().double().requires_grad_()
    pr = probs.detach().double().requires_grad_()
    expect = ref.unpermute(rr, lay.row_index, pr)
    assert out.shape == (T, H) and out.dtype == dtype
    assert_close(out, expect)
    g = torch.randn(T, H, device=device, dtype=dtype)
    d_rows, dp = torch.autograd.grad(out, (rows, probs), g)
    r_rows, r_p = torch.autograd.grad(expect, (rr, pr), g.double())
    assert_close(d_rows, r_rows, name="d_rows")
    assert_close(dp, r_p, tol=1e-5 if dtype == torch.float32 else 1e-2, name="dprobs")
    # padding and tail rows get exactly zero gradient
    real = torch.zeros(lay.num_rows, dtype=torch.bool, device=device)
    real[lay.row_index[lay.row_index >= 0].long()] = True
    assert torch.all(d_rows[~real] == 0)
    # without probs: a plain sum
    out2 = linghe.unpermute(rows.detach(), lay)
    assert_close(out2, ref.unpermute(rows.detach().double(), lay.row_index))


@pytest.mark.parametrize("probs_on", [True, False])
def test_unpermute_residual(device, probs_on):
    """``residual`` joins the fp32 sum (rounded once, as the reference does) and gets
    ``dout`` as its gradient; rows and probs get the gradients they get without it. A
    strided residual (a column slice) is read in place; a wrong shape is refused."""
    T, E, k, H = 29, 6, 3, 200
    ids = _ids(T, E, k, device)
    ids[4, 1] = -1  # a dropped copy
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    rows, _, lay = linghe.permute(x, ids, num_experts=E, align=8)
    rows = (torch.randn_like(rows) * (rows != 0)).requires_grad_()
    probs = torch.rand(T, k, device=device, requires_grad=True) if probs_on else None
    base = torch.randn(T, H + 8, device=device, dtype=torch.bfloat16) * 3
    res = base[:, 8:].detach().requires_grad_()  # a view with row stride H + 8
    assert res.stride(0) == H + 8
    out = linghe.unpermute(rows, lay, probs, residual=res)
    expect = ref.unpermute(rows.detach(), lay.row_index,
                           probs.detach() if probs_on else None, residual=res.detach())
    assert out.dtype == torch.bfloat16
    assert_close(out, expect)
    g = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    wrt = (rows, res) + ((probs,) if probs_on else ())
    got = torch.autograd.grad(out, wrt, g)
    plain = linghe.unpermute(rows, lay, probs)
    want = torch.autograd.grad(plain, (rows,) + ((probs,) if probs_on else ()), g)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], g)
    if probs_on:
        assert torch.equal(got[2], want[1])
    with pytest.raises(ValueError, match="residual"):
        linghe.unpermute(rows.detach(), lay, residual=res.detach()[:, :-1])


@pytest.mark.parametrize("T,E,k", [(37, 8, 3), (37, 33, 33), (1, 3, 2)])
def test_round_trip_identity_experts(device, T, E, k):
    x = torch.randn(T, 130, device=device)
    probs = torch.rand(T, k, device=device)
    ids = _ids(T, E, k, device)
    rows, _, lay = linghe.permute(x, ids, num_experts=E, align=16)
    out = linghe.unpermute(rows, lay, probs)
    assert_close(out, probs.sum(1, keepdim=True) * x)


def test_all_tokens_one_expert_and_zero_token_experts(device):
    T, E, k, H = 37, 8, 1, 33
    x = torch.randn(T, H, device=device)
    ids = torch.full((T, k), 5, dtype=torch.int64, device=device)
    rows, _, lay = linghe.permute(x, ids, num_experts=E, align=16)
    cnt = lay.tokens_per_expert.tolist()
    assert cnt == [0, 0, 0, 0, 0, T, 0, 0]
    assert lay.offsets.tolist() == [0] * 6 + [48] * 3
    assert torch.equal(rows[:T], x)  # token order within the expert
    assert torch.all(rows[T:] == 0)


def test_exact_num_rows(device):
    T, E, k = 37, 8, 2
    ids = _ids(T, E, k, device)
    x = torch.randn(T, 40, device=device)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    n = int(((counts + 15) // 16 * 16).sum())
    rows, _, lay = linghe.permute(x, ids, num_experts=E, num_rows=n)
    assert rows.shape == (n, 40) and lay.num_rows == n
    r_rows, *_ = ref.permute(x, ids, None, E, 16, n)
    assert torch.equal(rows, r_rows)
    # too small: copies that do not fit are dropped (debug mode raises)
    rows2, _, lay2 = linghe.permute(x, ids, num_experts=E, num_rows=n - 16)
    r2, _, ri2, *_ = ref.permute(x, ids, None, E, 16, n - 16)
    assert torch.equal(rows2, r2) and torch.equal(lay2.row_index.long(), ri2)
    linghe.set_debug(True)
    try:
        with pytest.raises(ValueError, match="num_rows"):
            linghe.permute(x, ids, num_experts=E, num_rows=n - 16)
    finally:
        linghe.set_debug(False)


def test_out_of_range_ids_dropped_or_raise(device):
    T, E, k = 9, 4, 2
    x = torch.randn(T, 20, device=device)
    ids = _ids(T, E, k, device)
    ids[0, 0] = 7
    ids[3, 1] = -1
    ids[5, 0] = 4
    probs = torch.rand(T, k, device=device)
    rows, prow, lay = linghe.permute(x, ids, probs, num_experts=E, align=2)
    r_rows, r_prow, r_ri, r_off, r_cnt = ref.permute(x, ids, probs, E, 2)
    assert torch.equal(rows, r_rows) and torch.equal(prow, r_prow)
    assert lay.row_index[0, 0] == -1 and lay.row_index[3, 1] == -1 and lay.row_index[5, 0] == -1
    assert int(lay.tokens_per_expert.sum()) == T * k - 3
    out = linghe.unpermute(rows, lay, probs)
    keep = (lay.row_index >= 0).float() * probs
    assert_close(out, keep.sum(1, keepdim=True) * x)
    linghe.set_debug(True)
    try:
        with pytest.raises(ValueError, match="expert_ids"):
            linghe.permute(x, ids, num_experts=E)
        # -1 = "not routed": dropped silently even in debug mode; < -1 still raises
        ids2 = _ids(T, E, k, device)
        ids2[3, 1] = -1
        ids2[6, 0] = -1
        rows2, _, lay2 = linghe.permute(x, ids2, num_experts=E, align=2)
        assert torch.equal(rows2, ref.permute(x, ids2, None, E, 2)[0])
        assert lay2.row_index[3, 1] == -1 and lay2.row_index[6, 0] == -1
        assert int(lay2.tokens_per_expert.sum()) == T * k - 2
        ids2[2, 0] = -2
        with pytest.raises(ValueError, match="expert_ids"):
            linghe.permute(x, ids2, num_experts=E)
    finally:
        linghe.set_debug(False)


def test_fp8_rows_move_with_scales(device):
    T, E, k, H = 37, 8, 3, 300
    x = torch.randn(T, H, device=device) * torch.rand(T, 1, device=device) * 10
    q = linghe.quantize_1x128(x)
    ids = _ids(T, E, k, device)
    probs = torch.rand(T, k, device=device)
    rows, prow, lay = linghe.permute(q, ids, probs, num_experts=E, align=16)
    assert isinstance(rows, linghe.Fp8Tensor)
    assert rows.rowwise_data.shape == (lay.num_rows, H)
    assert rows.rowwise_scale.shape == (lay.num_rows, 3)
    rq, *_ = ref.permute(q.rowwise_data.float(), ids, None, E, 16)
    rs, *_ = ref.permute(q.rowwise_scale, ids, None, E, 16)
    real = torch.zeros(lay.num_rows, dtype=torch.bool, device=device)
    real[lay.row_index.flatten().long()] = True
    assert torch.equal(rows.rowwise_data.float(), rq)
    assert torch.equal(rows.rowwise_scale[real], rs[real])
    assert torch.all(rows.rowwise_scale[~real] == 1)
    ref_rows, *_ = ref.permute(q.dequantize(dtype=torch.float32), ids, None, E, 16)
    assert_close(rows.dequantize(dtype=torch.float32), ref_rows)


def test_fp8_permute_autograd(device):
    # gradient to the high-precision input through an FP8 permute (straight-through)
    T, E, k, H = 21, 5, 2, 130
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    q = linghe.quantize_1x128(x).requires_grad_()
    ids = _ids(T, E, k, device)
    ids[4, 1] = -1
    probs = torch.rand(T, k, device=device, requires_grad=True)
    rows, prow, lay = linghe.permute(q, ids, probs, num_experts=E, align=8)
    assert isinstance(rows, linghe.Fp8Tensor) and rows.requires_grad
    g = torch.randn(lay.num_rows, H, device=device)
    gp = torch.randn(lay.num_rows, device=device)
    ((rows.dequantize(dtype=torch.float32) * g).sum() + (prow * gp).sum()).backward()
    ri = lay.row_index.long()
    ok = (ri >= 0)
    ref_dx = (g[ri.clamp(min=0)] * ok[..., None]).sum(1)
    assert q.grad is not None and not isinstance(q.grad, linghe.Fp8Tensor)
    assert q.grad.dtype == torch.bfloat16 and q.grad.shape == (T, H)
    assert_close(q.grad, ref_dx)
    assert_close(probs.grad, gp[ri.clamp(min=0)] * ok)


@pytest.mark.parametrize("pow2,H,dout_dtype", [(False, 300, torch.bfloat16),
                                               (True, 300, torch.float32),
                                               (True, 50, torch.bfloat16)])
def test_unpermute_backward_fp8_copy_is_the_rows_quantized(device, pow2, H, dout_dtype):
    """The rowwise FP8 copy of unpermute's d_rows written with it by one scatter (the
    expert FFN's hand-off; each token row quantized once) is bit for bit what quantizing
    d_rows gives, padding, tail, dropped copies and a partial 128-group included; d_rows
    is the plain scatter's."""
    from linghe.bwd.permute import unpermute_backward, unpermute_backward_fp8_copy
    from linghe.fwd.grouped_mm import quantize_grouped_fwd

    T, E, k = 23, 5, 3
    ids = _ids(T, E, k, device)
    ids[3, 2] = -1
    x = torch.randn(T, H, device=device)
    _, _, lay = linghe.permute(x, ids, num_experts=E, align=16)
    dout = (torch.randn(T, H, device=device) * torch.rand(T, 1, device=device) * 5
            ).to(dout_dtype)
    dout[7] = 0  # an all-zero token: scale 1
    d_rows, _ = unpermute_backward(dout, lay, torch.bfloat16)
    d_rows2, q, s = unpermute_backward_fp8_copy(dout, lay, torch.bfloat16, pow2_scale=pow2)
    assert torch.equal(d_rows2, d_rows)
    q_ref, s_ref, _, _ = quantize_grouped_fwd(d_rows, lay.tokens_per_expert, 16,
                                              rowwise=True, columnwise=False,
                                              pow2_scale=pow2)
    assert q.shape == (lay.num_rows, H) and s.shape == (lay.num_rows, -(-H // 128))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("H", [300, 50])
def test_token_rows_make_the_fp8_rows(device, H):
    """permute of FP8 tokens records what its rows were made from (TokenRows): made again
    they are the rows' bytes (fp8()), and dequantized by the same scatter they are what
    dequantizing the rows gives, bit for bit (padding and tail rows 0)."""
    from linghe.fp8.quantize import dequantize_1x128_rows
    from linghe.fwd.permute import TokenRows

    T, E, k = 29, 6, 3
    x = torch.randn(T, H, device=device) * torch.rand(T, 1, device=device) * 10
    q = linghe.quantize_1x128(x.to(torch.bfloat16), pow2_scale=True)
    ids = _ids(T, E, k, device)
    ids[5, 0] = -1
    rows, _, lay = linghe.permute(q, ids, num_experts=E, align=16)
    tokens = rows._linghe_token_rows
    assert isinstance(tokens, TokenRows) and tokens.layout is lay
    assert tokens.shape == (lay.num_rows, H)
    data, scale = tokens.fp8()
    assert torch.equal(data.view(torch.uint8), rows.rowwise_data.view(torch.uint8))
    assert torch.equal(scale, rows.rowwise_scale)
    for dtype in (torch.bfloat16, torch.float32):
        expect = dequantize_1x128_rows(rows.rowwise_data, rows.rowwise_scale, dtype)
        assert torch.equal(tokens.dequantized(dtype), expect)


def test_bad_inputs(device):
    x = torch.randn(5, 8, device=device)
    ids = torch.zeros(5, 2, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="expert_ids"):
        linghe.permute(x, ids.float(), num_experts=4)
    with pytest.raises(ValueError, match="expert_ids"):
        linghe.permute(x, ids[:4], num_experts=4)
    with pytest.raises(TypeError, match="x"):
        linghe.permute(x.int(), ids, num_experts=4)
    with pytest.raises(TypeError, match="probs"):
        linghe.permute(x, ids, torch.rand(5, 2, device=device).half(), num_experts=4)
    with pytest.raises(ValueError, match="probs"):
        linghe.permute(x, ids, torch.rand(5, 3, device=device), num_experts=4)
    with pytest.raises(ValueError, match="align"):
        linghe.permute(x, ids, num_experts=4, align=0)
    with pytest.raises(ValueError, match="num_experts"):
        linghe.permute(x, ids, num_experts=0)
    rows, _, lay = linghe.permute(x, ids, num_experts=4)
    with pytest.raises(ValueError, match="rows"):
        linghe.unpermute(rows[:-1], lay)
    with pytest.raises(TypeError, match="layout"):
        linghe.unpermute(rows, None)
    with pytest.raises(ValueError, match="probs"):
        linghe.unpermute(rows, lay, torch.rand(5, 3, device=device))


@pytest.mark.gpu
def test_standard_shape_gpu(device):
    T, E, k, H = 8192, 256, 8, 2048
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=device)
    probs, ids, _ = linghe.topk_route(logits, k, score="sigmoid")
    rows, prow, lay = linghe.permute(x, ids, probs, num_experts=E, align=16)
    r_rows, r_prow, r_ri, r_off, _ = ref.permute(x, ids, probs, E, 16)
    assert torch.equal(rows, r_rows) and torch.equal(prow, r_prow)
    assert torch.equal(lay.row_index.long(), r_ri) and torch.equal(lay.offsets.long(), r_off)
    out = linghe.unpermute(rows, lay, probs)
    assert_close(out, ref.unpermute(rows.double(), lay.row_index, probs.double()))


def test_benchmark_case(device):
    """The ``permute`` benchmark case builds, its rows for the FP8 MoE layer's backward
    (unpermute's d_rows with their FP8 copy; the expert rows made from FP8 tokens) give
    the reference's bits, and the combine with a residual is within its tolerance of the
    float64 reference (CPU: the tiny shapes; the GPU runs it in benchmarks)."""
    if device != "cpu":
        pytest.skip("the benchmark runs the standard shapes on the GPU")
    import benchmark.cases.permute  # noqa: F401  (registers the case)
    from benchmark.harness import Config, cases, max_rel_err

    benches = cases()["permute"](Config(device="cpu", quick=True))
    fp8_rows = [b for b in benches if "FP8" in b.name]
    assert len(fp8_rows) == 2
    for b in fp8_rows:
        assert max_rel_err(b.run["linghe"](), b.run["eager"]()) == 0, b.name
    # the combine with the shared experts' output: one rounding against eager's two
    (b,) = [b for b in benches if "shared" in b.name]
    assert max_rel_err(b.run["linghe"](), b.expected()) <= b.tol, b.name
