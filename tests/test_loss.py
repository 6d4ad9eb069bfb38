"""Cross entropy and fused linear cross entropy vs linghe.reference (float64)."""

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.testing import assert_close

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def _labels(N, V, device, ignore=-100, frac_ignored=0.2):
    lab = torch.randint(0, V, (N,), device=device)
    drop = torch.rand(N, device=device) < frac_ignored
    return torch.where(drop, torch.full_like(lab, ignore), lab)


def _check_ce(device, N, V, dtype, reduction, eps=0.0, z=0.0, inplace=False,
              labels_dtype=torch.int64, ignore=-100, labels=None, scale=3.0):
    x = (torch.randn(N, V, device=device) * scale).to(dtype)
    lab = _labels(N, V, device, ignore) if labels is None else labels
    lab = lab.to(labels_dtype)
    x64 = x.detach().double().requires_grad_()
    r = ref.cross_entropy(x64, lab, ignore, reduction, eps, z)
    xk = x.detach().clone().requires_grad_()
    out = linghe.cross_entropy(xk, lab, ignore_index=ignore, reduction=reduction,
                               label_smoothing=eps, z_loss=z, inplace_backward=inplace)
    assert out.dtype == torch.float32 and out.shape == r.shape
    assert_close(out, r, tol=1e-5, name="loss")
    g = torch.randn(r.shape, device=device, dtype=torch.float32) if r.dim() else \
        torch.tensor(1.7, device=device)
    r.backward(g.double())
    if inplace:
        buf = xk.detach()
        (dx,) = torch.autograd.grad(out, xk, g)
        assert dx.data_ptr() == buf.data_ptr(), "inplace_backward must reuse the logits buffer"
    else:
        (dx,) = torch.autograd.grad(out, xk, g)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close(dx, x64.grad, tol=TOL[dtype], name="dlogits")
    return out, dx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 7, 1000])
@pytest.mark.parametrize("N", [0, 1, 33])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_reference(device, dtype, V, N, reduction):
    _check_ce(device, N, V, dtype, reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_label_smoothing_and_z_loss(device, reduction, dtype):
    _check_ce(device, 33, 1000, dtype, reduction, eps=0.1, z=1e-2)
    _check_ce(device, 5, 7, dtype, reduction, eps=0.3, z=0.5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_rows_split_over_programs(device, reduction):
    # V = 1300 splits each row over 3 programs on the interpreter (512-column ranges)
    from linghe.fwd.loss import block_v, split_v

    if device == "cpu":
        assert split_v(1300, block_v(1300)[0])[1] == 3
    _check_ce(device, 6, 1300, torch.float32, reduction, eps=0.1, z=1e-3)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_inplace_backward(device, reduction):
    _check_ce(device, 33, 1000, torch.bfloat16, reduction, eps=0.05, z=1e-3, inplace=True)
    _check_ce(device, 9, 7, torch.float32, reduction, inplace=True)


@pytest.mark.parametrize("knobs", [dict(fixup=False), dict(row_fastest=True),
                                   dict(stages=1, prefetch=True, fixup=False),
                                   dict(stages=1, evict="evict_first", row_fastest=True)])
@pytest.mark.parametrize("inplace", [False, True])
def test_backward_knobs(device, knobs, inplace):
    """Every launch knob of the backward (linghe.bwd.loss.BWD_CONFIG) gives the same
    gradient: the target column found in the loop or fixed up after it, both program
    orders, with and without prefetch; rows split over 3 programs (V = 1300), the label in
    the first, middle and last column range and on the last column."""
    from linghe.bwd import loss as B

    saved = dict(B.BWD_CONFIG)
    B.BWD_CONFIG.update(knobs)
    try:
        lab = torch.tensor([0, 600, 1299, 1100, -100, 511, 512], device=device)
        _check_ce(device, 7, 1300, torch.bfloat16, "mean", eps=0.1, z=1e-3, inplace=inplace,
                  labels=lab)
        _check_ce(device, 4, 7, torch.float32, "none", inplace=inplace)
    finally:
        B.BWD_CONFIG.clear()
        B.BWD_CONFIG.update(saved)


def test_backward_ignored_rows_with_nonfinite_logits_are_zero(device):
    """An ignored row's gradient is exactly 0 even when its logits are inf/NaN (it is
    written, not read; the prefetched first block must not leak into it)."""
    x = torch.randn(3, 1300, device=device)
    x[1, :700] = float("inf")
    x[1, 800:] = float("nan")
    lab = torch.tensor([5, -100, 1299], device=device)
    xk = x.clone().requires_grad_()
    linghe.cross_entropy(xk, lab).backward()
    assert torch.all(xk.grad[1] == 0)
    x64 = x[[0, 2]].double().requires_grad_()
    ref.cross_entropy(x64, lab[[0, 2]], reduction="sum").backward()
    assert_close(xk.grad[[0, 2]], x64.grad / 2)


def test_inplace_backward_overwrites_logits(device):
    x = torch.randn(4, 300, device=device, requires_grad=True)
    lab = torch.randint(0, 300, (4,), device=device)
    loss = linghe.cross_entropy(x, lab, inplace_backward=True)
    loss.backward()
    # the buffer now holds the gradient (autograd copies it into a leaf's .grad)
    assert torch.equal(x.grad, x.detach())
    # each row of the gradient of a mean CE sums to 0
    assert torch.allclose(x.detach().sum(1), torch.zeros(4, device=device), atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_not_nan(device, reduction):
    lab = torch.full((6,), -100, device=device, dtype=torch.int64)
    out, dx = _check_ce(device, 6, 50, torch.float32, reduction, eps=0.1, z=0.1, labels=lab)
    assert torch.all(out == 0) and torch.all(dx == 0)


def test_custom_ignore_index_and_int32_labels(device):
    lab = torch.randint(0, 40, (20,), device=device)
    lab[::3] = 5
    _check_ce(device, 20, 40, torch.float32, "mean", ignore=5, labels=lab,
              labels_dtype=torch.int32, eps=0.2)


def test_strided_rows_and_large_logits(device):
    base = torch.randn(10, 600, device=device) * 30
    x = base[:, 50:550]  # row stride 600, contiguous rows
    lab = torch.randint(0, 500, (10,), device=device)
    out = linghe.cross_entropy(x, lab, reduction="none")
    assert_close(out, ref.cross_entropy(x.double(), lab, reduction="none"), tol=1e-5)


def test_neg_inf_logits(device):
    x = torch.randn(3, 700, device=device)
    x[:, :300] = float("-inf")  # whole blocks of -inf (masked vocabulary)
    lab = torch.tensor([400, 650, 301], device=device)
    xk = x.clone().requires_grad_()
    out = linghe.cross_entropy(xk, lab, label_smoothing=0.0, z_loss=1e-3)
    x64 = x.double().requires_grad_()
    r = ref.cross_entropy(x64, lab, z_loss=1e-3)
    assert_close(out, r)
    out.backward()
    r.backward()
    assert_close(xk.grad, x64.grad)


def test_out_of_range_labels_ignored_or_error(device):
    x = torch.randn(5, 30, device=device)
    lab = torch.tensor([1, 30, -3, 29, 1000], device=device)
    out = linghe.cross_entropy(x, lab, reduction="none")
    assert torch.all(out[[1, 2, 4]] == 0)
    assert_close(out, ref.cross_entropy(x.double(), lab, reduction="none"))
    assert_close(linghe.cross_entropy(x, lab), ref.cross_entropy(x.double(), lab))
    linghe.set_debug(True)
    try:
        with pytest.raises(ValueError, match=r"labels\[1\] = 30 is out of range"):
            linghe.cross_entropy(x, lab)
        h = torch.randn(5, 8, device=device)
        w = torch.randn(30, 8, device=device)
        with pytest.raises(ValueError, match="out of range"):
            linghe.linear_cross_entropy(h, w, lab)
        ok = torch.tensor([1, -100, 2, 3, 4], device=device)
        linghe.cross_entropy(x, ok)
    finally:
        linghe.set_debug(False)


def test_bad_inputs(device):
    x = torch.randn(4, 10, device=device)
    lab = torch.randint(0, 10, (4,), device=device)
    with pytest.raises(TypeError, match="labels"):
        linghe.cross_entropy(x, lab.float())
    with pytest.raises(TypeError, match="logits"):
        linghe.cross_entropy(x.long(), lab)
    with pytest.raises(ValueError, match="labels must have shape"):
        linghe.cross_entropy(x, lab[:3])
    with pytest.raises(ValueError, match="logits must be 2-D"):
        linghe.cross_entropy(x[None], lab)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        linghe.cross_entropy(x.t(), torch.randint(0, 4, (10,), device=device))
    with pytest.raises(ValueError, match="reduction"):
        linghe.cross_entropy(x, lab, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        linghe.cross_entropy(x, lab, label_smoothing=1.5)
    with pytest.raises(ValueError, match="z_loss"):
        linghe.cross_entropy(x, lab, z_loss=-1.0)
    with pytest.raises(ValueError, match="V >= 1"):
        linghe.cross_entropy(x[:, :0], lab)
    h = torch.randn(4, 6, device=device)
    w = torch.randn(10, 6, device=device)
    with pytest.raises(ValueError, match="weight must have shape"):
        linghe.linear_cross_entropy(h, w[:, :5], lab)
    with pytest.raises(TypeError, match="weight"):
        linghe.linear_cross_entropy(h, w.double(), lab)
    with pytest.raises(ValueError, match="bias"):
        linghe.linear_cross_entropy(h, w, lab, bias=torch.randn(9, device=device))
    with pytest.raises(ValueError, match="labels"):
        linghe.linear_cross_entropy(h, w, lab[:2])
    with pytest.raises(ValueError, match="chunk_size"):
        linghe.linear_cross_entropy(h, w, lab, chunk_size=0)
    if device == "cuda":
        with pytest.raises(ValueError, match="device"):
            linghe.cross_entropy(x, lab.cpu())


def test_module(device):
    m = linghe.nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1, z_loss=1e-4)
    assert "label_smoothing=0.1" in repr(m) and "z_loss=0.0001" in repr(m)
    x = torch.randn(7, 33, device=device, requires_grad=True)
    lab = torch.randint(-1, 33, (7,), device=device)
    out = m(x, lab)
    assert_close(out, ref.cross_entropy(x.double(), lab, -1, "mean", 0.1, 1e-4))


# ------------------------------------------------------------------ linear cross entropy
def _check_linear(device, N, H, V, dtype, reduction, bias, chunk, eps=0.0, z=0.0):
    h = (torch.randn(N, H, device=device)).to(dtype)
    w = (torch.randn(V, H, device=device) / H**0.5 * 2).to(dtype)
    b = (torch.randn(V, device=device)).to(dtype) if bias else None
    lab = _labels(N, V, device)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if bias else None
    r = ref.linear_cross_entropy(h64, w64, lab, b64, -100, reduction, eps, z)
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    bk = b.clone().requires_grad_() if bias else None
    out = linghe.linear_cross_entropy(hk, wk, lab, bias=bk, reduction=reduction,
                                      label_smoothing=eps, z_loss=z, chunk_size=chunk)
    assert out.dtype == torch.float32 and out.shape == r.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(out, r, tol=tol, name="loss")
    g = torch.randn(r.shape, device=device) if r.dim() else torch.tensor(0.7, device=device)
    r.backward(g.double())
    out.backward(g)
    gtol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(hk.grad, h64.grad, tol=gtol, name="dhidden")
    assert_close(wk.grad, w64.grad, tol=gtol, name="dweight")
    if bias:
        assert_close(bk.grad, b64.grad, tol=gtol, name="dbias")
    assert hk.grad.dtype == dtype and wk.grad.dtype == dtype


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy(device, reduction, bias, dtype):
    _check_linear(device, 33, 24, 300, dtype, reduction, bias, chunk=10, eps=0.1, z=1e-3)


@pytest.mark.parametrize("N,V,chunk", [(1, 1, None), (0, 7, None), (17, 7, 16), (5, 1000, 2)])
def test_linear_cross_entropy_shapes(device, N, V, chunk):
    _check_linear(device, N, 16, V, torch.float32, "mean", True, chunk)


def test_linear_cross_entropy_no_grad_and_partial_grads(device):
    h = torch.randn(9, 8, device=device)
    w = torch.randn(20, 8, device=device, requires_grad=True)
    lab = torch.randint(0, 20, (9,), device=device)
    with torch.no_grad():
        out = linghe.linear_cross_entropy(h, w, lab, chunk_size=4)
    assert_close(out, ref.linear_cross_entropy(h.double(), w.double(), lab))
    out = linghe.linear_cross_entropy(h, w, lab, chunk_size=4, reduction="sum")
    out.backward()
    w64 = w.detach().double().requires_grad_()
    ref.linear_cross_entropy(h.double(), w64, lab, reduction="sum").backward()
    assert_close(w.grad, w64.grad)


def test_linear_cross_entropy_gradients_handed_over_once(device):
    """The fused path's gradients (made in the forward) are scaled in place by
    grad_output (skipped on the device when it is 1) and handed over once: a second
    backward through the same call is refused, not silently wrong."""
    h = torch.randn(9, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device, requires_grad=True)
    lab = torch.randint(0, 20, (9,), device=device)
    out = linghe.linear_cross_entropy(h, w, lab, chunk_size=4)
    out.backward(retain_graph=True)  # grad_output 1: the kernel leaves them as they are
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref.linear_cross_entropy(h64, w64, lab).backward()
    assert_close(h.grad, h64.grad)
    assert_close(w.grad, w64.grad)
    with pytest.raises(RuntimeError, match="hands them over once"):
        out.backward()


@pytest.mark.gpu  # 4096 x 2048 logits: 75 s in the interpreter (checked there once)
def test_linear_cross_entropy_float16_many_rows(device):
    """float16: the row weight 1/n_valid is applied in the backward, not to the logits'
    gradient (p / n would flush to zero in float16's range at thousands of rows; applied
    in the forward the error here was 3.7e-3)."""
    N, H, V = 4096, 16, 2048
    h = torch.randn(N, H, device=device).to(torch.float16)
    w = (torch.randn(V, H, device=device) / H**0.5).to(torch.float16)
    lab = _labels(N, V, device)
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    linghe.linear_cross_entropy(hk, wk, lab, chunk_size=1024).backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref.linear_cross_entropy(h64, w64, lab).backward()
    assert_close(hk.grad, h64.grad, tol=2e-3, name="dhidden")
    assert_close(wk.grad, w64.grad, tol=2e-3, name="dweight")


def test_linear_cross_entropy_double_backward_in_grad_output(device):
    """With create_graph the gradients stay differentiable in grad_output."""
    h = torch.randn(9, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device)
    lab = torch.randint(0, 20, (9,), device=device)
    out = linghe.linear_cross_entropy(h, w, lab, chunk_size=4)
    g = torch.tensor(2.0, device=device, requires_grad=True)
    (dh,) = torch.autograd.grad(out, h, g, create_graph=True)
    dh.sum().backward()
    assert_close(g.grad, (dh.detach() / 2).sum())


# ------------------------------------------------------------------ FP8 LM head
def test_fused_loss_kernel_writes_the_gradients_fp8_copy(device):
    """ce_forward(fuse_bwd=True, grad_fp8=...) also writes the 1x128 FP8 copy of the
    gradient it stores: as quantize_1x128 of that stored gradient (partial last group,
    ignored rows, both scale modes; scales group-major as cuBLAS reads them)."""
    from linghe.fp8.quantize import empty_1x128
    from linghe.fwd.loss import ce_forward
    from linghe.testing import assert_fp8_close

    for V, dtype, pow2 in [(300, torch.bfloat16, True), (1000, torch.float32, False),
                           (7, torch.float32, True)]:
        N = 19
        x = (torch.randn(N, V, device=device) * 3).to(dtype)
        lab = _labels(N, V, device)
        q, sc = empty_1x128(N, V, device, rowwise=True, columnwise=False,
                            group_major=True)[:2]
        w = torch.full((1,), 0.25, device=device)
        ce_forward(x, lab, ignore_index=-100, label_smoothing=0.1, z_loss=1e-3,
                   fuse_bwd=True, row_weight=w, grad_fp8=(q, sc, pow2))
        rq, rs = ref.quantize_1x128(x, pow2)  # x now holds the stored gradient
        assert torch.equal(sc, rs), f"scales differ (V={V})"
        assert_fp8_close(q, rq)  # (within a step: the interpreter's e4m3 cast)
        ignored = lab == -100
        assert bool((q[ignored].float() == 0).all()) and bool((sc[ignored] == 1).all())
    with pytest.raises(ValueError, match="fuse_bwd"):
        ce_forward(x, lab, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                   grad_fp8=(q, sc, True))


def _check_linear_fp8(device, N, H, V, dtype, reduction, bias, chunk, pow2=True,
                      fp8_wgrad=True):
    h = torch.randn(N, H, device=device).to(dtype)
    w = (torch.randn(V, H, device=device) / H**0.5 * 2).to(dtype)
    b = torch.randn(V, device=device).to(dtype) if bias else None
    lab = _labels(N, V, device)
    # fp32: a float64 reference; bf16: the reference in bf16 (its logits and their
    # gradient rounded to bf16 before they are quantized, as the kernels do)
    rdt = torch.float64 if dtype == torch.float32 else dtype
    hr, wr = h.to(rdt, copy=True).requires_grad_(), w.to(rdt, copy=True).requires_grad_()
    br = b.to(rdt, copy=True).requires_grad_() if bias else None
    # (the FP8 weight gradient is the head's without a bias only)
    r = ref.linear_cross_entropy_fp8(hr, wr, lab, br, -100, reduction, 0.1, 1e-3,
                                     pow2_scale=pow2, fp8_wgrad=fp8_wgrad and not bias)
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    bk = b.clone().requires_grad_() if bias else None
    with linghe.TrainingContext(fp8="blockwise", lm_head_fp8=True, pow2_scale=pow2,
                                fp8_wgrad=fp8_wgrad):
        out = linghe.linear_cross_entropy(hk, wk, lab, bias=bk, reduction=reduction,
                                          label_smoothing=0.1, z_loss=1e-3, chunk_size=chunk)
    # float32: the products are exact, but Hopper's FP8 tensor cores add them at reduced
    # precision within each 128-deep block (the kernels promote to float32 per block)
    tol = 2e-4 if dtype == torch.float32 else 1e-2
    assert_close(out, r.float(), tol=tol, name="loss")
    # grad_output 1 for the reductions (the fused path quantizes the unit-weight gradient;
    # another grad_output scales its products), per-row weights for "none"
    g = torch.rand(r.shape, device=device) + 0.5 if r.dim() else torch.tensor(1.0, device=device)
    r.backward(g.to(rdt))
    out.backward(g)
    gtol = 2e-4 if dtype == torch.float32 else 3e-2
    # dhidden sums FP8 products of a gradient whose rows sum to ~0: the tensor cores'
    # reduced-precision adds show more there (up to 1.6e-3 on an H100; an unquantized
    # dgrad would be ~3e-2 off this reference)
    assert_close(hk.grad, hr.grad, tol=5e-3 if dtype == torch.float32 else 3e-2,
                 name="dhidden")
    # the FP8 weight gradient: the same quantized operands as the reference's, so its
    # error is the dgrad's kind (a gradient element rounded one ulp apart before the
    # quantization moves its e4m3 value one step)
    assert_close(wk.grad, wr.grad, tol=5e-3 if fp8_wgrad and dtype == torch.float32 else gtol,
                 name="dweight")
    if bias:
        assert_close(bk.grad, br.grad, tol=gtol, name="dbias")
    assert hk.grad.dtype == dtype and wk.grad.dtype == dtype
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_fp8_lm_head(device, reduction, bias, dtype):
    """TrainingContext(lm_head_fp8=True): the logits and dhidden GEMMs in blockwise FP8
    against reference.linear_cross_entropy_fp8 (V off the 128 grid, a chunk tail)."""
    _check_linear_fp8(device, 37, 256, 300, dtype, reduction, bias, chunk=16)


@pytest.mark.parametrize("N,H,V,chunk,pow2", [(1, 128, 1, None, True), (0, 128, 7, None, True),
                                               (40, 136, 384, 40, False),
                                               (48, 256, 1152, 32, True)])
def test_linear_cross_entropy_fp8_lm_head_shapes(device, N, H, V, chunk, pow2):
    """(On a GPU with cuBLAS's blockwise FP8 GEMM, V = 1152 (9 groups of 128) and V = 300
    above take the dgrad with K padded to a multiple of 512.)"""
    _check_linear_fp8(device, N, H, V, torch.float32, "mean", False, chunk, pow2)


@pytest.mark.parametrize("reduction,N,V,chunk", [("mean", 272, 256, 128),
                                                  ("none", 300, 300, 100)])
def test_lm_head_fp8_wgrad_chunks(device, reduction, N, V, chunk):
    """The FP8 weight gradient over several chunks (``chunk`` rounded up to whole 128-row
    groups; N = 272 a multiple of 16: the packed columnwise store, N = 300 not: the plain
    one; V = 256 whole column tiles, V = 300 a tail), fused (``mean``) and recomputed in
    the backward (``none``), against the reference's product of the columnwise copies;
    and with the recipe's ``fp8_wgrad`` off, the 16-bit weight gradient."""
    _check_linear_fp8(device, N, 128, V, torch.float32, reduction, False, chunk)
    _check_linear_fp8(device, 40, 128, V, torch.bfloat16, reduction, False, None,
                      fp8_wgrad=False)


def test_lm_head_fp8_wgrad_spans(device, monkeypatch):
    """When the weight gradient's FP8 operand would pass ``FP8_WGRAD_BUFFER_BYTES``, the
    tokens go in spans of whole chunks, one GEMM each, added up: the same result."""
    from linghe.functional import loss as floss

    spans = []
    real = floss._fp8_wgrad_spans

    def record(N, V, chunk):
        out = real(N, V, chunk)
        spans.append(out)
        return out

    monkeypatch.setattr(floss, "FP8_WGRAD_BUFFER_BYTES", 300 * 256)  # 256 tokens
    monkeypatch.setattr(floss, "_fp8_wgrad_spans", record)
    _check_linear_fp8(device, 300, 128, 300, torch.float32, "mean", False, 128)
    assert spans == [[(0, 256), (256, 300)]]


def _head_micro_batches(device, n, N, H, V, dtype):
    """``n`` micro-batches ``(h, labels, g, dh, dw)`` and the weight gradient of them all:
    the reference's gradients per micro-batch, ``grad_output`` ``g`` times those of the
    unit-weight loss (the fused path quantizes those, then scales their products)."""
    w = (torch.randn(V, H, device=device) / H**0.5 * 2).to(dtype)
    rdt = torch.float64 if dtype == torch.float32 else dtype
    mbs, dw = [], 0
    for i in range(n):
        h = torch.randn(N, H, device=device).to(dtype)
        lab = _labels(N, V, device)
        g = torch.tensor(1.0 / n if i % 2 == 0 else 0.7, device=device)
        hr, wr = h.to(rdt, copy=True).requires_grad_(), w.to(rdt, copy=True).requires_grad_()
        ref.linear_cross_entropy_fp8(hr, wr, lab, None, -100, "mean", 0.1, 1e-3,
                                     pow2_scale=True, fp8_wgrad=True).backward()
        mbs.append((h, lab, g, hr.grad * g.to(rdt), wr.grad * g.to(rdt)))
        dw = dw + mbs[-1][4]
    return w, dw, mbs


def _head_loss(h, w, lab, n, chunk=128):
    """The FP8 head's loss with its weight gradient deferred over ``n`` micro-batches."""
    with linghe.TrainingContext(fp8="blockwise", lm_head_fp8=True, pow2_scale=True):
        return linghe.linear_cross_entropy(h, w, lab, label_smoothing=0.1, z_loss=1e-3,
                                           chunk_size=chunk, wgrad_micro_batches=n)


def _head_step(w, mbs, n, backward=None):
    outs = []
    for h, lab, g, _, _ in mbs:
        hk = h.clone().requires_grad_()
        (backward or torch.autograd.backward)(_head_loss(hk, w, lab, n), g)
        outs.append(hk)
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_fp8_wgrad_deferred(device, dtype):
    """``wgrad_micro_batches=n``: no weight gradient until the ``n``-th backward, which
    hands over all ``n`` micro-batches' as one FP8 GEMM (each ``grad_output`` folded in),
    equal to the sum of the reference's per-micro-batch gradients; the hidden gradients
    are each micro-batch's own (two chunks each, V off the 128 grid)."""
    from linghe.bwd.deferred import pending_micro_batches

    n, N, H, V = 3, 256, 128, 136
    w, dw_ref, mbs = _head_micro_batches(device, n, N, H, V, dtype)
    wk = w.clone().requires_grad_()
    seen = []

    def backward(out, g):
        out.backward(g)
        seen.append((wk.grad is None, pending_micro_batches(wk)))

    hks = _head_step(wk, mbs, n, backward=backward)
    assert seen == [(True, 1), (True, 2), (False, 0)]
    tol = 5e-3 if dtype == torch.float32 else 3e-2
    assert_close(wk.grad, dw_ref, tol=tol, name="dweight")
    assert wk.grad.dtype == dtype
    for hk, (_, _, _, dh_ref, _) in zip(hks, mbs):
        assert_close(hk.grad, dh_ref, tol=tol, name="dhidden")
    if dtype == torch.float32:  # the next step's micro-batches: a new stash, into .grad
        _head_step(wk, mbs, n)
        assert_close(wk.grad, 2 * dw_ref, tol=tol, name="dweight, two steps")


def test_lm_head_fp8_wgrad_deferred_fallbacks(device):
    """The deferred head's other paths, each against the reference's sum: a flush before
    the ``n``-th micro-batch (a GEMM per pending slot); a micro-batch of another size (its
    own gradient, at once); ``torch.autograd.grad`` (its own, the stash untouched); a
    weight changed while micro-batches are pending (an error, the stash dropped)."""
    from linghe.bwd.deferred import pending_micro_batches

    n, N, H, V = 3, 128, 128, 136
    w, dw_2, mbs = _head_micro_batches(device, 2, N, H, V, torch.float32)
    wk = w.clone().requires_grad_()
    _head_step(wk, mbs, n)  # 2 of 3 micro-batches
    assert wk.grad is None and pending_micro_batches(wk) == 2
    assert linghe.flush_deferred_wgrad() == 1
    assert pending_micro_batches(wk) == 0
    assert_close(wk.grad, dw_2, tol=5e-3, name="flushed dweight")

    # another micro-batch size than the stash's (and not whole 128-row groups): at once
    wk = w.clone().requires_grad_()
    _head_step(wk, mbs[:1], n)
    h, lab, g, _, _ = mbs[1]
    _head_loss(h[:100], wk, lab[:100], n).backward(g)
    assert wk.grad is not None and pending_micro_batches(wk) == 1
    linghe.discard_deferred_wgrad()

    # torch.autograd.grad cannot hand a gradient over later: its own, nothing stashed
    wk = w.clone().requires_grad_()
    grads = []
    _head_step(wk, mbs, n, backward=lambda out, g: grads.append(
        torch.autograd.grad(out, wk, g)[0]))
    assert pending_micro_batches(wk) == 0
    assert_close(grads[0] + grads[1], dw_2, tol=5e-3, name="autograd.grad dweight")

    # the weight changed with micro-batches pending: stale products refused
    wk = w.clone().requires_grad_()
    _head_step(wk, mbs[:1], n)
    with torch.no_grad():
        wk.mul_(1.0)
    with pytest.raises(RuntimeError, match="changed"):
        linghe.flush_deferred_wgrad()
    assert pending_micro_batches(wk) == 0
    with pytest.raises(ValueError, match="wgrad_micro_batches"):
        linghe.linear_cross_entropy(mbs[0][0], wk, mbs[0][1], wgrad_micro_batches=0)


def test_lm_head_fp8_wgrad_deferred_reservations(device):
    """The deferred head's slots follow the forwards' graphs: more forwards than ``n``
    before their backwards (the extra one computes its own, the stash in use is kept); a
    forward whose graph dies without a backward frees its slot, so the ``n``-th backward
    still hands everything over; a weight changed with only reservations made is no
    error; backwards that cannot defer leave no stash behind."""
    from linghe.bwd import deferred
    from linghe.bwd.deferred import pending_micro_batches

    n, N, H, V = 2, 128, 128, 136
    w, dw_ref, mbs = _head_micro_batches(device, 3, N, H, V, torch.float32)
    dw_01 = mbs[0][4] + mbs[1][4]

    def fwd(wk, i):
        h, lab, g, _, _ = mbs[i]
        return _head_loss(h, wk, lab, n), g

    # three forwards, then their backwards in reverse order
    wk = w.clone().requires_grad_()
    outs = [fwd(wk, i) for i in range(3)]
    seen = []
    for out, g in reversed(outs):
        out.backward(g)
        seen.append((wk.grad is None, pending_micro_batches(wk)))
    assert seen == [(False, 0), (False, 1), (False, 0)]
    assert_close(wk.grad, dw_ref, tol=5e-3, name="dweight, 3 forwards first")

    # a dropped forward frees its slot: the two micro-batches after it are handed over
    wk = w.clone().requires_grad_()
    out, _ = fwd(wk, 2)
    del out
    for i in range(2):
        out, g = fwd(wk, i)
        out.backward(g)
    assert pending_micro_batches(wk) == 0 and wk.grad is not None
    assert_close(wk.grad, dw_01, tol=5e-3, name="dweight after a dropped forward")

    # the weight changed with only a reservation made: dropped quietly, no error
    wk = w.clone().requires_grad_()
    out0, g0 = fwd(wk, 0)
    with torch.no_grad():
        wk.mul_(1.0)
    out1, g1 = fwd(wk, 1)
    out1.backward(g1)
    out0.backward(g0)
    linghe.flush_deferred_wgrad()
    assert_close(wk.grad, dw_01, tol=5e-3, name="dweight, changed")

    # backwards that cannot defer leave no stash
    wk = w.clone().requires_grad_()
    for i in range(2):
        out, g = fwd(wk, i)
        torch.autograd.grad(out, wk, g)
    assert deferred.stash_of(wk) is None


def test_ce_grad_fp8_kernel(device):
    """``ce_grad_fp8`` writes the rounded gradient's two 1x128 copies: the rowwise one as
    ``quantize_1x128`` of it, the columnwise one transposed at token column ``t0`` of a
    wider buffer (its scales group-major from group ``t0 / 128``); ignored rows are
    zeros; per-row weights (stride 0 too)."""
    from linghe.bwd.loss import ce_backward
    from linghe.fp8.quantize import empty_1x128
    from linghe.fwd.loss import ce_forward, ce_grad_fp8
    from linghe.testing import assert_fp8_close

    N, V, T, t0 = 144, 260, 400, 128
    x = (torch.randn(N, V, device=device) * 3).to(torch.bfloat16)
    lab = _labels(N, V, device)
    opts = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3)
    _, lse, _, _ = ce_forward(x, lab, **opts)
    for w in (torch.full((1,), 0.25, device=device), torch.rand(N, device=device) + 0.5,
              torch.full((1,), 2.0, device=device).expand(N)):
        q, s = empty_1x128(N, V, device, rowwise=True, columnwise=False)[:2]
        qt, st = empty_1x128(T, V, device, rowwise=False, columnwise=True,
                             group_major=True)[2:]
        qt.view(torch.uint8).fill_(0x7F)  # (columns outside [t0, t0 + N): untouched)
        ce_grad_fp8(x, lab, lse, w, **opts, pow2_scale=True, rowwise=(q, s),
                    columnwise=(qt, st, t0))
        d = ce_backward(x, lab, lse, w if w.numel() > 1 else torch.ones((), device=device),
                        None if w.numel() > 1 else w, **opts)
        rq, rs = ref.quantize_1x128(d, True)
        assert_fp8_close(q, rq)
        assert torch.equal(s, rs)
        cq, cs = ref.quantize_1x128_columnwise(d, True)
        assert_fp8_close(qt[:, t0:t0 + N], cq)
        assert torch.equal(st[:, 1:3], cs)
        assert bool((qt.view(torch.uint8)[:, :t0] == 0x7F).all())
        assert bool((qt.view(torch.uint8)[:, t0 + N:] == 0x7F).all())
        ignored = lab == -100
        assert bool((q[ignored].float() == 0).all()) and bool((s[ignored] == 1).all())


def test_lm_head_fp8_dgrad_with_padded_vocab(device, monkeypatch):
    """Where cuBLAS takes the dgrad only with K (the vocabulary) padded to a multiple of
    512, the loss kernel writes the gradient's FP8 copy into a buffer with zero pad
    columns and the weight's columnwise copy is padded the same way: same result as the
    reference. (Forced here, so that the CPU runs the padded operands too.)"""
    from linghe.fp8 import gemm

    asked = []

    def padded(M, N, K, *args):
        asked.append(K)
        return -(-K // 512) * 512

    monkeypatch.setattr(gemm, "padded_k", padded)
    _check_linear_fp8(device, 37, 256, 300, torch.float32, "mean", True, chunk=16)
    assert asked == [300, 300, 300]  # once per chunk of the fused path


def test_padded_columnwise_follows_version(device):
    """The LM head weight's zero-padded columnwise copy (for a vocabulary cuBLAS takes only
    padded) is made once per FP8 copy and made anew when the copy's version counters
    move (AdamW rewrites the copy in place and bumps them)."""
    from linghe.functional.loss import _padded_columnwise

    wq = linghe.quantize_128x128(torch.randn(300, 128, device=device), columnwise=True,
                                 pow2_scale=True)
    data, scale = _padded_columnwise(wq, 512)
    assert data.shape == (128, 512) and scale.shape == (1, 4)
    assert torch.equal(data[:, :300].view(torch.uint8), wq.columnwise_data.view(torch.uint8))
    assert not data[:, 300:].view(torch.uint8).any() and float(scale[0, 3]) == 1.0
    assert _padded_columnwise(wq, 512)[0].data_ptr() == data.data_ptr()  # kept
    new = linghe.quantize_128x128(torch.randn(300, 128, device=device), columnwise=True,
                                  pow2_scale=True)
    wq.columnwise_data.copy_(new.columnwise_data)  # (an in-place copy_ bumps the version)
    wq.columnwise_scale.data.copy_(new.columnwise_scale)
    again, _ = _padded_columnwise(wq, 512)
    assert again.data_ptr() != data.data_ptr()
    assert torch.equal(again[:, :300].view(torch.uint8), new.columnwise_data.view(torch.uint8))


def test_lm_head_fp8_weight_copy_cached_per_step(device):
    """The LM head weight is quantized once per optimizer step (a WeightCache per weight,
    bound so that linghe.optim.AdamW writes the copy in its update), the recipe without
    lm_head_fp8 leaves the op in the input precision, and lm_head_fp8 needs blockwise."""
    from linghe.functional.loss import _WEIGHT_CACHES

    N, H, V = 20, 128, 256
    h = torch.randn(N, H, device=device, dtype=torch.bfloat16)
    w = torch.nn.Parameter((torch.randn(V, H, device=device) / H**0.5).to(torch.bfloat16))
    lab = torch.randint(0, V, (N,), device=device)
    with linghe.TrainingContext(fp8="blockwise"):  # lm_head_fp8 off: unchanged
        plain = linghe.linear_cross_entropy(h, w, lab)
    assert_close(plain, ref.linear_cross_entropy(h, w.detach(), lab), tol=1e-5)
    assert w not in _WEIGHT_CACHES
    opt = linghe.optim.AdamW([w], lr=1e-3)
    ctx = linghe.TrainingContext(fp8="blockwise", lm_head_fp8=True)
    for _ in range(2):  # two micro-batches: one quantization
        with ctx:
            linghe.linear_cross_entropy(h, w, lab).backward()
    cache = _WEIGHT_CACHES[w]
    assert (cache.misses, cache.hits) == (1, 1)
    opt.step()  # AdamW writes the new copy: the next forward hits and matches it
    with ctx:
        out = linghe.linear_cross_entropy(h, w, lab)
    assert cache.misses == 1 and cache.hits == 2
    r = ref.linear_cross_entropy_fp8(h, w.detach(), lab)
    assert_close(out, r, tol=1e-3, name="loss after the step")
    with pytest.raises(ValueError, match="lm_head_fp8 needs the 'blockwise' recipe"):
        linghe.TrainingContext(fp8="tensorwise", lm_head_fp8=True)


def test_default_chunk_size():
    from linghe.functional.loss import default_chunk_size

    c = default_chunk_size(8192, 157184, 2)
    assert c == 2048  # a power of two, 614 MiB of bf16 logits
    assert default_chunk_size(100_000, 157184, 4) == 1024  # fp32: at most 1 GiB
    assert default_chunk_size(100_000, 10**7, 4) == 256  # never fewer than 256 rows
    assert default_chunk_size(5, 10, 4) == 5
    assert default_chunk_size(0, 10, 4) == 1


# ------------------------------------------------------------------ GPU, standard shapes
@pytest.mark.gpu
@pytest.mark.gpu_big  # 8192 x 157184 logits: float32 reference and its gradient
@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_standard_shape(device, inplace):
    N, V = 8192, 157184
    x = torch.randn(N, V, device=device, dtype=torch.bfloat16) * 4
    lab = _labels(N, V, device)
    xr = x.float().requires_grad_()
    r = ref.cross_entropy(xr, lab, label_smoothing=0.1, z_loss=1e-4)
    r.backward()
    xk = x.clone().requires_grad_()
    out = linghe.cross_entropy(xk, lab, label_smoothing=0.1, z_loss=1e-4,
                               inplace_backward=inplace)
    assert_close(out, r, tol=1e-5)
    out.backward()
    assert_close(xk.grad, xr.grad, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.gpu_big
def test_linear_cross_entropy_standard_shape(device):
    N, H, V = 8192, 2048, 157184
    h = torch.randn(N, H, device=device, dtype=torch.bfloat16)
    w = (torch.randn(V, H, device=device) / H**0.5).to(torch.bfloat16)
    lab = _labels(N, V, device)
    hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
    r = ref.linear_cross_entropy(hr, wr, lab)
    r.backward()
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = linghe.linear_cross_entropy(hk, wk, lab)
    out.backward()
    assert_close(out, r, tol=1e-3)
    assert_close(hk.grad, hr.grad, tol=2e-2)
    assert_close(wk.grad, wr.grad, tol=2e-2)


# ------------------------------------------------------------------ offline GPU compile
_COMPILE_SCRIPT = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from linghe.bwd import loss as B
from linghe.fwd import loss as F

def comp(fn, sig, consts, warps):
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in ("stride_x", "stride_dx", "N", "V", "V_total")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    # 16-byte loads, also with a cache hint (ld.global.L1::evict_first...v4), or copies
    assert re.search(r"ld\.global\.[\w:.]*v4|cp\.async", k.asm["ptx"]) or "BLOCK" in consts, \
        fn.__name__
    if "EVICT" in consts:  # 16-byte dlogits stores
        assert re.search(r"st\.global\.[\w:.]*v4", k.asm["ptx"]), fn.__name__
        print(sorted(set(re.findall(r"(?:ld|st)\.global[\w:.]*", k.asm["ptx"]))))
    return k

ptr = "*bf16"
fsig = dict(x_ptr=ptr, stride_x="i32", lab_ptr="*i64", loss_ptr="*fp32", lse_ptr="*fp32",
            part_ptr="*fp32", w_ptr="*fp32", N="i32", V="i32", vocab_start="i32",
            V_total="i32",
            ignore_index="i32", eps="fp32", z_loss="fp32", CHUNK="constexpr",
            BLOCK_V="constexpr", SMOOTH="constexpr", SPLIT="constexpr", FUSE_BWD="constexpr",
            PREFETCH="constexpr", q_ptr="*fp8e4nv", qs_ptr="*fp32", stride_q="i32",
            stride_qs_m="i32", stride_qs_g="i32", QUANT="constexpr", POW2="constexpr")
for split, fuse, quant in [(False, False, False), (True, False, False), (False, True, False),
                           (False, True, True)]:
    comp(F._ce_fwd_kernel, fsig, dict(CHUNK=32768 if split else 4096, BLOCK_V=4096,
                                      SMOOTH=True, SPLIT=split, FUSE_BWD=fuse,
                                      PREFETCH=True, QUANT=quant, POW2=True), 4)
bsig = dict(x_ptr=ptr, stride_x="i32", dx_ptr=ptr, stride_dx="i32", lab_ptr="*i64",
            lse_ptr="*fp32", go_ptr="*fp32", go_stride="i32", inv_n_ptr="*fp32", N="i32",
            S="i32", V="i32", vocab_start="i32", V_total="i32", ignore_index="i32",
            eps="fp32", z_loss="fp32", CHUNK="constexpr", BLOCK_V="constexpr",
            PER_ROW="constexpr", PREFETCH="constexpr", EVICT="constexpr",
            ROW_FASTEST="constexpr", FIXUP="constexpr", STAGES="constexpr",
            INPLACE="constexpr")
for ev, fix, pf, st, inpl in (("evict_first", False, True, 1, False), ("", True, False, 3, True)):
    k = comp(B._ce_bwd_kernel, bsig, dict(CHUNK=32768, BLOCK_V=4096, PER_ROW=True, PREFETCH=pf,
                                          EVICT=ev, ROW_FASTEST=False, FIXUP=fix, STAGES=st,
                                          INPLACE=inpl), 8)
    if st > 1:  # the streaming loop pipelined: 16-byte asynchronous copies
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10",
                         k.asm["ptx"]), "stages"
csig = dict(part_ptr="*fp32", lab_ptr="*i64", loss_ptr="*fp32", lse_ptr="*fp32", N="i32",
            S="i32", V_total="i32", ignore_index="i32", eps="fp32", z_loss="fp32",
            SMOOTH="constexpr", S_P2="constexpr", BLOCK="constexpr")
comp(F._ce_combine_kernel, csig, dict(SMOOTH=True, S_P2=8, BLOCK=256), 4)
rsig = dict(loss_ptr="*fp32", lab_ptr="*i64", out_ptr="*fp32", inv_n_ptr="*fp32", N="i32",
            V_total="i32", ignore_index="i32", MEAN="constexpr", BLOCK="constexpr",
            COUNT_ONLY="constexpr")
for count_only in (False, True):
    comp(F._ce_reduce_kernel, rsig, dict(MEAN=True, BLOCK=8192, COUNT_ONLY=count_only), 16)
ssig = dict(x_ptr=ptr, g_ptr="*fp32", n="i64", BLOCK="constexpr")
comp(B._scale_unless_one_kernel, ssig, dict(BLOCK=4096), 8)
print("COMPILED")
'''


def test_kernels_compile_for_sm90(compile_sm90):
    """Compile the loss kernels for an H100/H200 (sm_90) without a GPU, in a subprocess
    without TRITON_INTERPRET: catches GPU-only compile errors the interpreter accepts, and
    checks the streaming loads vectorize to 16 bytes."""
    compile_sm90(_COMPILE_SCRIPT)
