"""Router: fp32-exact router GEMM, fused top-k routing, router z-loss."""

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.testing import assert_close, rel_err


def _exact_tol(device, K: int) -> float:
    """Bound for the fp32-exact router GEMM. Interpreter: IEEE fp32 sums (~1e-7). CUDA:
    Hopper's bf16 tensor-core MMA accumulates in fp32 without IEEE round-to-nearest
    (measured 5e-7..1.5e-6 at K~256, 6.7e-6 at K=2048 on H200), so the bound grows with K;
    still >= 30x under TF32's ~1e-3/1e-4."""
    if torch.device(device).type != "cuda":
        return 5e-7
    return 3e-6 * max(1.0, K / 256)


# GPU subset: (5, 257, 3) repeats the K tail over several K blocks of (40, 130, 8).
@pytest.mark.gpu_subset(**{"T,K,E": [(0, 64, 8), (1, 1, 1), (37, 100, 33), (40, 130, 8)]})
@pytest.mark.parametrize("T,K,E", [(0, 64, 8), (1, 1, 1), (37, 100, 33), (40, 130, 8),
                                   (5, 257, 3)])
@pytest.mark.parametrize("xd,wd", [(torch.bfloat16, torch.float32),
                                   (torch.bfloat16, torch.bfloat16),
                                   (torch.float32, torch.float32),
                                   (torch.float16, torch.float32)])
def test_router_logits_exact(device, T, K, E, xd, wd):
    x = torch.randn(T, K, device=device).to(xd).requires_grad_()
    w = (torch.randn(E, K, device=device) * 0.05).to(wd).requires_grad_()
    y = linghe.router_logits(x, w)
    assert y.dtype == torch.float32 and y.shape == (T, E)
    exact = x.detach().double() @ w.detach().double().t()
    # float32-exact: ~1e-7 here, far under TF32's ~1e-3/1e-4
    assert rel_err(y, exact) < _exact_tol(device, K), rel_err(y, exact)
    g = torch.randn(T, E, device=device)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    assert dx.dtype == xd and dw.dtype == wd
    rdx = g.double() @ w.detach().double()
    rdw = g.double().t() @ x.detach().double()
    assert rel_err(dx, rdx) < (_exact_tol(device, E) if xd == torch.float32 else 1e-2)
    assert rel_err(dw, rdw) < (_exact_tol(device, T) if wd == torch.float32 else 1e-2)


def _check_logits_and_grads(device, x, w):
    x = x.requires_grad_()
    w = w.requires_grad_()
    T, K = x.shape
    E = w.shape[0]
    y = linghe.router_logits(x, w)
    assert y.shape == (T, E)
    exact = x.detach().double() @ w.detach().double().t()
    assert rel_err(y, exact) < _exact_tol(device, K), rel_err(y, exact)
    g = torch.randn(T, E, device=device)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    rdx = g.double() @ w.detach().double()
    rdw = g.double().t() @ x.detach().double()
    # bf16 dx (DX_ORDER 0: bf16(dl) @ bf16(w), then a bf16 store, which the interpreter
    # truncates): up to ~1e-2 relative on a handful of short rows (E = 3), no averaging
    assert rel_err(dx, rdx) < (_exact_tol(device, E) if x.dtype == torch.float32 else 3e-2)
    assert rel_err(dw, rdw) < (_exact_tol(device, T) if w.dtype == torch.float32 else 1e-2)
    if T:
        assert not torch.isnan(dw).any() and not torch.isnan(y).any()


# (BM, BN, BK, num_warps, num_stages, split_k) per role: tiles smaller than the shapes,
# K not a multiple of BK, split-K with a ragged last chunk
_CONFIGS = [(16, 16, 16, 4, 1, 1), (16, 32, 16, 4, 1, 3), (32, 16, 32, 4, 1, 2)]


@pytest.mark.parametrize("cfg", _CONFIGS)
@pytest.mark.parametrize("T,K,E", [(0, 40, 8), (1, 7, 3), (7, 100, 33), (45, 37, 20)])
@pytest.mark.parametrize("wd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("multi_acc", [True, False])
def test_router_logits_configs_and_split_k(device, monkeypatch, cfg, T, K, E, wd, multi_acc):
    from linghe.fwd import router as fwd_router

    monkeypatch.setattr(fwd_router, "MULTI_ACC", multi_acc)
    monkeypatch.setitem(fwd_router.CONFIG, "fwd", cfg)
    monkeypatch.setitem(fwd_router.CONFIG, "dx", cfg)
    monkeypatch.setitem(fwd_router.CONFIG, "dw", cfg)
    x = torch.randn(T, K, device=device).to(torch.bfloat16)
    w = (torch.randn(E, K, device=device) * 0.05).to(wd)
    _check_logits_and_grads(device, x, w)


@pytest.mark.parametrize("xd", [torch.bfloat16, torch.float32])
def test_router_logits_heuristic_split_k(device, monkeypatch, xd):
    # lower the split-K threshold: the heuristic splits dW's token reduction (and the
    # forward's hidden reduction) over programs; partials summed in a second pass
    from linghe.fwd import router as fwd_router

    monkeypatch.setattr(fwd_router, "SPLIT_K_MIN_K", 32)
    monkeypatch.setattr(fwd_router, "_MM_CFG", {})
    M, N, K = 20, 24, 200
    cfg = fwd_router._mm_config(M, N, K, 3, 1, torch.device(device))
    if fwd_router.INTERPRET:
        assert cfg[-1] > 1, cfg
    x = torch.randn(150, 70, device=device).to(xd)
    w = torch.randn(20, 70, device=device) * 0.05
    _check_logits_and_grads(device, x, w)


@pytest.mark.parametrize("ad,bd", [(torch.float32, torch.bfloat16),
                                   (torch.bfloat16, torch.float32),
                                   (torch.float16, torch.float32),
                                   (torch.float32, torch.float32)])
@pytest.mark.parametrize("split_k", [1, 2, 5])
def test_matmul_exact_strided_split_k(device, ad, bd, split_k):
    from linghe.fwd.router import matmul_exact

    a = torch.randn(70, 19, device=device).to(ad).t()  # [19, 70], column-major
    b = torch.randn(70, 33, device=device).to(bd)
    c = matmul_exact(a, b, torch.float32, split_k=split_k)
    exact = a.double() @ b.double()
    assert c.shape == (19, 33) and c.is_contiguous()
    assert rel_err(c, exact) < _exact_tol(device, 70)
    # order 0 (one bf16 pass) and 1, bf16 output
    for order, tol in ((0, 1e-2), (1, 1e-2)):
        c = matmul_exact(a, b, torch.bfloat16, order=order, split_k=split_k)
        assert c.dtype == torch.bfloat16 and rel_err(c, exact) < tol


def test_split_parts_inf_nan(device):
    from linghe.fwd.router import split_parts

    a = torch.randn(3, 50, device=device)
    a[0, 1], a[1, 2], a[2, 3] = float("inf"), float("-inf"), float("nan")
    p = split_parts(a)
    assert p.shape == (3, 3, 50)
    total = p[0].float() + p[1].float() + p[2].float()
    assert torch.allclose(total, a, equal_nan=True)
    fin = torch.isfinite(a)
    assert torch.equal(total[fin], a[fin])
    assert torch.equal(split_parts(a, 1)[0].view(torch.int16), p[0].view(torch.int16))
    ah = a.half()
    ph = split_parts(ah)
    assert ph.shape == (2, 3, 50)
    assert torch.equal((ph[0].float() + ph[1].float())[fin], ah.float()[fin])


def test_split3_parts_sum_exactly(device):
    from linghe.fwd.router import split3

    a = torch.randn(7, 300, device=device) * 3
    p = split3(a.t())  # strided input
    assert p.shape == (3, 300, 7) and p.dtype == torch.bfloat16
    total = p[0].float() + p[1].float() + p[2].float()
    assert torch.equal(total, a.t())


def test_router_logits_leading_dims_and_bad_inputs(device):
    x = torch.randn(2, 3, 48, device=device, dtype=torch.bfloat16)
    w = torch.randn(5, 48, device=device)
    y = linghe.router_logits(x, w)
    assert y.shape == (2, 3, 5)
    assert_close(y, ref.router_logits(x, w), tol=_exact_tol(device, 48))
    with pytest.raises(ValueError, match="weight"):
        linghe.router_logits(x, torch.randn(5, 47, device=device))
    with pytest.raises(TypeError, match="x"):
        linghe.router_logits(x.int(), w)
    with pytest.raises(TypeError, match="weight"):
        linghe.router_logits(x, w.double())


ROUTE_CASES = [
    # T, E, k, groups, topk_groups
    (0, 8, 2, 1, 1), (1, 1, 1, 1, 1), (37, 8, 3, 1, 1), (37, 33, 5, 1, 1), (37, 33, 33, 1, 1),
    (37, 3, 3, 1, 1), (37, 32, 4, 4, 2), (37, 33, 6, 3, 2), (16, 8, 2, 8, 2), (37, 8, 1, 1, 1),
]


# GPU subset: (37, 8, 3) repeats ungrouped routing over a power-of-two E of (37, 8, 1) and
# (37, 33, 5); (37, 3, 3) repeats k == E of (37, 33, 33).
@pytest.mark.gpu_subset(**{"T,E,k,G,TG": [c for c in ROUTE_CASES
                                          if c not in ((37, 8, 3, 1, 1), (37, 3, 3, 1, 1))]})
@pytest.mark.parametrize("T,E,k,G,TG", ROUTE_CASES)
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias", [False, True])
def test_topk_route_matches_reference(device, T, E, k, G, TG, score, bias):
    logits = torch.randn(T, E, device=device, requires_grad=True)
    b = torch.randn(E, device=device) * 0.3 if bias else None
    scale = 2.5
    normalize = k > 1 or score == "sigmoid"
    p, ids, tpe = linghe.topk_route(logits, k, score=score, expert_bias=b, num_groups=G,
                                    topk_groups=TG, normalize=normalize, scale=scale)
    rp, rids, rtpe = ref.topk_route(logits.double(), k, score, b, G, TG, normalize, scale)
    assert p.shape == (T, k) and p.dtype == torch.float32
    assert ids.dtype == torch.int32 and tpe.dtype == torch.int32 and tpe.shape == (E,)
    assert torch.equal(ids, rids)
    assert torch.equal(tpe, rtpe)
    assert_close(p, rp)
    g = torch.randn(T, k, device=device)
    (dl,) = torch.autograd.grad(p, logits, g)
    (rdl,) = torch.autograd.grad(rp, logits, g.double())
    if k == 1 and normalize:
        # p == scale identically: the gradient is exactly zero (the fp32 reference's is
        # rounding noise ~1e-8, so a relative comparison is meaningless here)
        assert torch.count_nonzero(dl) == 0, dl
        assert float(rdl.abs().max()) < 1e-6 if rdl.numel() else True
    else:
        assert_close(dl, rdl)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_route_low_precision_logits(device, dtype):
    # distinct values (no ties to break), exact in bf16/fp16
    logits = torch.stack([torch.randperm(16) for _ in range(37)]).float() / 4 - 2
    logits = logits.to(device, dtype).requires_grad_()
    p, ids, tpe = linghe.topk_route(logits, 4, score="sigmoid", normalize=False)
    rp, rids, _ = ref.topk_route(logits.double(), 4, "sigmoid", None, 1, 1, False, 1.0)
    assert torch.equal(ids, rids)
    assert_close(p, rp)
    g = torch.randn(37, 4, device=device)
    (dl,) = torch.autograd.grad(p, logits, g)
    (rdl,) = torch.autograd.grad(rp, logits, g.double())
    assert dl.dtype == dtype
    assert_close(dl, rdl)


def test_topk_route_bias_selects_only(device):
    T, E = 37, 8
    logits = torch.randn(T, E, device=device)
    b = torch.zeros(E, device=device)
    b[3] = 100.0  # every token picks expert 3 first
    p, ids, tpe = linghe.topk_route(logits, 2, score="sigmoid", expert_bias=b)
    assert torch.all(ids[:, 0] == 3) and int(tpe[3]) == T
    s = torch.sigmoid(logits).gather(1, ids.long())
    assert_close(p, s / s.sum(1, keepdim=True))


def test_topk_route_nan_row_gives_dropped_ids(device):
    logits = torch.randn(5, 8, device=device)
    logits[2, 3] = float("nan")
    p, ids, tpe = linghe.topk_route(logits, 2)
    assert torch.all(ids[2] == -1) and torch.all(p[2].isnan())
    assert int(tpe.sum()) == 8 and torch.all(ids[[0, 1, 3, 4]] >= 0)


def test_topk_route_bad_inputs(device):
    logits = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="k"):
        linghe.topk_route(logits, 9)
    with pytest.raises(ValueError, match="k"):
        linghe.topk_route(logits, 0)
    with pytest.raises(ValueError, match="score"):
        linghe.topk_route(logits, 2, score="relu")
    with pytest.raises(ValueError, match="num_groups"):
        linghe.topk_route(logits, 2, num_groups=3)
    with pytest.raises(ValueError, match="topk_groups"):
        linghe.topk_route(logits, 2, num_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match="k"):
        linghe.topk_route(logits, 5, num_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="expert_bias"):
        linghe.topk_route(logits, 2, expert_bias=torch.zeros(7, device=device))
    with pytest.raises(TypeError, match="logits"):
        linghe.topk_route(logits.long(), 2)


@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (37, 33), (2, 5, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_z_loss(device, shape, dtype):
    logits = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    z = linghe.router_z_loss(logits)
    lr = logits.detach().double().requires_grad_()
    rz = ref.router_z_loss(lr)
    assert z.dtype == torch.float32 and z.shape == ()
    assert_close(z, rz)
    (dl,) = torch.autograd.grad(z * 1.7, logits)
    (rdl,) = torch.autograd.grad(rz * 1.7, lr)
    assert dl.dtype == dtype
    assert_close(dl, rdl)


@pytest.mark.gpu
def test_standard_shapes_gpu(device):
    T, K, E = 8192, 2048, 256
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    for wd in (torch.float32, torch.bfloat16):
        w = (torch.randn(E, K, device=device) * 0.02).to(wd).requires_grad_()
        y = linghe.router_logits(x, w)
        assert rel_err(y, x.double() @ w.double().t()) < _exact_tol(device, K)
        g = torch.randn(T, E, device=device)
        dx, dw = torch.autograd.grad(y, (x, w), g)
        assert rel_err(dx, g.double() @ w.double()) < 1e-2
        assert rel_err(dw, g.double().t() @ x.double()) < (_exact_tol(device, T)
                                                           if wd == torch.float32 else 1e-2)
    b = torch.randn(E, device=device) * 0.1
    logits = torch.randn(T, E, device=device)
    p, ids, tpe = linghe.topk_route(logits, 8, score="sigmoid", expert_bias=b, num_groups=8,
                                    topk_groups=4, scale=2.5)
    rp, rids, rtpe = ref.topk_route(logits, 8, "sigmoid", b, 8, 4, True, 2.5)
    assert torch.equal(ids, rids) and torch.equal(tpe, rtpe)
    assert_close(p, rp)
