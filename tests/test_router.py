"""Router: fp32-exact router GEMM, fused top-k routing, router z-loss."""

import sys

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.testing import assert_close, rel_err
from linghe.utils import cdiv


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
    from linghe.bwd import router as bwd_router
    from linghe.fwd import router as fwd_router

    # the pointer kernels' configs (the backward's TMA kernels: test_router_bwd_tma_*)
    monkeypatch.setattr(bwd_router, "BWD_TMA", False)
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


def _spy_launches(monkeypatch, *modules):
    """Record the names of the kernels that ``modules`` launch."""
    names = []
    for module in modules:
        real = module.launch

        def spy(kernel, *args, _real=real, **kwargs):
            names.append(getattr(kernel, "fn", kernel).__name__)
            return _real(kernel, *args, **kwargs)

        monkeypatch.setattr(module, "launch", spy)
    return names


def _bwd_refs(dl, x, w):
    return dl.double() @ w.double(), dl.double().t() @ x.double()


# (DW_CONFIG, DX_CONFIG): the interpreter's defaults (32x32x32, one K chunk; dx 8
# persistent programs), a ragged K split summed by the sum kernel, tiles smaller than the
# shapes for both kernels (dx: more tiles than programs), a K split of 2 with 32-row dW tiles
_TMA_KNOBS = [
    (None, None),
    (dict(BM=16, BN=32, BK=16, SPLIT=3), None),
    (dict(BM=16, BN=16, BK=16, SPLIT=2), dict(BM=16, BN=32, BK=16)),
    (dict(BM=32, BN=16, BK=16, SPLIT=2, num_stages=2), dict(BM=16, BN=16, BK=16, GROUP_M=2)),
]


@pytest.mark.gpu_subset(**{"T,H,E": [(45, 72, 24)]})
@pytest.mark.parametrize("T,H,E", [(45, 72, 24), (130, 40, 16), (7, 64, 8)])
@pytest.mark.parametrize("wd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("knobs", _TMA_KNOBS, ids=range(len(_TMA_KNOBS)))
def test_router_bwd_tma(device, monkeypatch, T, H, E, wd, knobs):
    """The TMA backward (dW: parts stacked along the token rows, T not a multiple of BK so
    boxes reach into the next part's rows; dx) against float64, deterministic across calls,
    and the kernels it should launch."""
    from linghe.bwd import router as B
    from linghe.fwd import router as F

    dwc, dxc = knobs
    monkeypatch.setattr(B, "DW_CONFIG", dwc)
    monkeypatch.setattr(B, "DX_CONFIG", dxc)
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    w = (torch.randn(E, H, device=device) * 0.05).to(wd)
    dl = torch.randn(T, E, device=device)
    wp = F.weight_parts(w)
    names = _spy_launches(monkeypatch, B, F)
    dx, dw = B.router_logits_bwd(dl, x, w, w_parts=wp)
    assert names[0] == "_split_kernel" and names.count("_split_kernel") == 1
    assert names.index("_dw_kernel") < names.index("_dx_kernel") and "_mm_kernel" not in names
    c = dict(B._dw_config(E, H, T, 3 if wd == torch.float32 else 2, x.device), **(dwc or {}))
    k_per = cdiv(cdiv(T, c["SPLIT"]), c["BK"]) * c["BK"]
    assert ("_sum_splits_kernel" in names) == (cdiv(T, k_per) > 1)
    rdx, rdw = _bwd_refs(dl, x, w)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert rel_err(dx, rdx) < 2e-2
    assert rel_err(dw, rdw) < (_exact_tol(device, T) if wd == torch.float32 else 1e-4)
    dx2, dw2 = B.router_logits_bwd(dl, x, w)  # the weight split here (custom-op path)
    assert torch.equal(dw2, dw) and torch.equal(dx2, dx)


def test_router_bwd_tma_one_grad_and_empty(device, monkeypatch):
    """need_dx / need_dw alone, and no tokens (dW zeros)."""
    from linghe.bwd import router as B

    names = _spy_launches(monkeypatch, B, sys.modules["linghe.fwd.router"])
    T, H, E = 37, 48, 16
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    w = torch.randn(E, H, device=device) * 0.05
    dl = torch.randn(T, E, device=device)
    rdx, rdw = _bwd_refs(dl, x, w)
    dx, dw = B.router_logits_bwd(dl, x, w, need_dw=False)
    assert dw is None and rel_err(dx, rdx) < 2e-2
    assert names.count("_split_kernel") == 2  # dlogits' and the weight's
    assert "_dw_kernel" not in names and "_dx_kernel" in names
    names.clear()
    dx, dw = B.router_logits_bwd(dl, x, w, need_dx=False)
    assert dx is None and rel_err(dw, rdw) < _exact_tol(device, T)
    assert names == ["_split_kernel", "_dw_kernel"]
    assert B.router_logits_bwd(dl, x, w, need_dx=False, need_dw=False) == (None, None)
    dx, dw = B.router_logits_bwd(dl[:0], x[:0], w)
    assert dx.shape == (0, H) and torch.equal(dw, torch.zeros(E, H, device=device))


def test_router_bwd_tma_unknown_config_key(device, monkeypatch):
    """A config key the kernels do not take (e.g. the removed dW ``FORM``) is an error,
    not silently ignored."""
    from linghe.bwd import router as B

    x = torch.randn(37, 48, device=device).to(torch.bfloat16)
    w = torch.randn(16, 48, device=device) * 0.05
    dl = torch.randn(37, 16, device=device)
    monkeypatch.setattr(B, "DW_CONFIG", dict(FORM="chain"))
    with pytest.raises(ValueError, match="FORM"):
        B.router_logits_bwd(dl, x, w)
    monkeypatch.setattr(B, "DW_CONFIG", None)
    monkeypatch.setattr(B, "DX_CONFIG", dict(PERSIST=2))
    with pytest.raises(ValueError, match="PERSIST"):
        B.router_logits_bwd(dl, x, w)


def test_router_bwd_tma_fp16_x(device, monkeypatch):
    """float16 x: dx (one bf16 pass, float16 output) by the TMA kernel, dW (x in 2 bf16
    parts) by the pointer kernel."""
    from linghe.bwd import router as B

    names = _spy_launches(monkeypatch, B, sys.modules["linghe.fwd.router"])
    T, H, E = 45, 72, 24
    x = torch.randn(T, H, device=device).half()
    w = torch.randn(E, H, device=device) * 0.05
    dl = torch.randn(T, E, device=device)
    dx, dw = B.router_logits_bwd(dl, x, w)
    assert "_dx_kernel" in names and "_mm_kernel" in names and "_dw_kernel" not in names
    rdx, rdw = _bwd_refs(dl, x, w)
    assert dx.dtype == torch.float16 and rel_err(dx, rdx) < 2e-2
    assert rel_err(dw, rdw) < _exact_tol(device, T)


@pytest.mark.parametrize("P,ns", [(3, 3), (2, 4)])
def test_router_bwd_heuristics_standard_shape(monkeypatch, P, ns):
    """The GPU heuristics at the router's shape (132 SMs): dW 128x128 tiles, one wave of
    programs (32 tiles x 4 chunks) within the shared memory; dx 128x256 tiles."""
    from linghe.bwd import router as B

    monkeypatch.setattr(B, "INTERPRET", False)
    monkeypatch.setattr(B, "num_sms", lambda dev: 132)
    monkeypatch.setattr(B, "_DW_CFG", {})
    monkeypatch.setattr(B, "_DX_CFG", {})
    c = B._dw_config(256, 2048, 8192, P, "cuda")
    assert c == dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=ns, SPLIT=4, GROUP_M=8)
    c = B._dx_config(8192, 2048, 256, "cuda")
    assert c == dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, GROUP_M=8)


@pytest.mark.parametrize("T,H,E", [(37, 36, 16), (37, 48, 33)])
def test_router_bwd_tma_fallback(device, monkeypatch, T, H, E):
    """Rows TMA cannot address (x's 72-byte rows; dlogits parts' 66-byte rows) take the
    pointer kernels."""
    from linghe.bwd import router as B

    names = _spy_launches(monkeypatch, B, sys.modules["linghe.fwd.router"])
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    w = torch.randn(E, H, device=device) * 0.05
    dl = torch.randn(T, E, device=device)
    dx, dw = B.router_logits_bwd(dl, x, w)
    assert "_mm_kernel" in names
    rdx, rdw = _bwd_refs(dl, x, w)
    assert rel_err(dx, rdx) < 2e-2 and rel_err(dw, rdw) < _exact_tol(device, T)


@pytest.mark.parametrize("dwc", [None, dict(BM=16, BN=16, BK=16, SPLIT=2)])
def test_router_bwd_tma_nonfinite(device, monkeypatch, dwc):
    """A NaN / Inf in dlogits spoils only its expert's dW row and its token's dx row:
    boxes that reach past the last token into the next part's first rows (the hi part's
    NaN row 0 is never read that way; mid/lo parts are zero there) add exact zeros."""
    from linghe.bwd import router as B

    monkeypatch.setattr(B, "DW_CONFIG", dwc)
    T, H, E = 45, 40, 24
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    w = torch.randn(E, H, device=device) * 0.05
    dl = torch.randn(T, E, device=device)
    dl[0, 3] = float("nan")
    dl[1, 5] = float("inf")
    dx, dw = B.router_logits_bwd(dl, x, w)
    rdx, rdw = _bwd_refs(dl, x, w)
    bad = torch.zeros(E, dtype=torch.bool, device=device)
    bad[[3, 5]] = True
    assert not torch.isfinite(dw[bad]).any() and torch.isfinite(dw[~bad]).all()
    assert rel_err(dw[~bad], rdw[~bad]) < _exact_tol(device, T)
    assert not torch.isfinite(dx[:2]).any() and torch.isfinite(dx[2:]).all()
    assert rel_err(dx[2:], rdx[2:]) < 2e-2


@pytest.mark.gpu
def test_router_bwd_standard_shape_exact_gpu(device, monkeypatch):
    """dW at the router's shape is fp32-exact (~2e-6 against float64: Hopper's MMA
    accumulation) and deterministic, for the default and two other tilings / K splits."""
    from linghe.bwd import router as B
    from linghe.fwd import router as F

    T, H, E = 8192, 2048, 256
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    w = torch.randn(E, H, device=device) * 0.02
    dl = torch.randn(T, E, device=device)
    rdx, rdw = _bwd_refs(dl, x, w)
    wp = F.weight_parts(w)
    for cfg in (None, dict(BM=64, BN=256), dict(BK=32, num_stages=4, SPLIT=8)):
        monkeypatch.setattr(B, "DW_CONFIG", cfg)
        dx, dw = B.router_logits_bwd(dl, x, w, w_parts=wp)
        assert rel_err(dw, rdw) < 1e-5, (cfg, rel_err(dw, rdw))
        assert rel_err(dx, rdx) < 1e-2
        assert torch.equal(B.router_logits_bwd(dl, x, w, w_parts=wp)[1], dw)


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
