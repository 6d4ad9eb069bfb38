"""Grouped GEMMs over rows grouped by expert (bf16/fp16/fp32 and FP8 blockwise)."""

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.bwd import grouped_mm as bwd_gm
from linghe.fwd import grouped_mm as fwd_gm
from linghe.layout import make_expert_layout
from linghe.testing import assert_close, assert_fp8_close, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HAS_TORCH_GMM = hasattr(torch, "_grouped_mm")
# e4m3 keeps 3 mantissa bits: a product of two quantized operands is off by a few % (rel).
FP8_VS_EXACT = 0.08


def make_rows(counts, align, K, device, dtype, tail=5, scale=1.0):
    """Rows grouped by expert with zero padding and a zero tail; returns (x, layout, real)."""
    counts = torch.tensor(counts, dtype=torch.int32)
    padded = (counts + align - 1) // align * align
    R = int(padded.sum()) + tail
    layout = make_expert_layout(counts.to(device), align, R)
    real = torch.zeros(R, dtype=torch.bool)
    start = 0
    for c, p in zip(counts.tolist(), padded.tolist()):
        real[start:start + c] = True
        start += p
    x = torch.randn(R, K) * scale
    x[~real] = 0
    return x.to(device=device, dtype=dtype), layout, real.to(device)


def ref_grads(x, w, offsets, g):
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    out = ref.grouped_mm(xr, wr, offsets)
    dx, dw = torch.autograd.grad(out, (xr, wr), g.double())
    return out.detach(), dx, dw


CASES = [
    # (counts, align, K, N)
    ([37], 16, 48, 40),                 # E = 1
    ([5, 0, 20], 16, 70, 50),           # zero-row expert, K/N not multiples of 16
    ([0, 0, 61, 0, 0], 8, 33, 17),      # all rows in one expert, E = 5
    ([9, 31, 1, 0, 17], 1, 64, 32),     # align 1: segments of any size
    ([130, 3, 0], 128, 40, 24),         # align 128 > tile rows
]


# GPU subset: float16 on two cases (it shares bfloat16's path but for the element type).
@pytest.mark.gpu_subset(dtype=[torch.float32, torch.bfloat16])
@pytest.mark.gpu_subset(dtype=[torch.float16], case=[CASES[1], CASES[3]])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{len(c[0])}-a{c[1]}-K{c[2]}-N{c[3]}")
def test_grouped_mm_matches_reference(device, dtype, case):
    counts, align, K, N = case
    E = len(counts)
    x, layout, real = make_rows(counts, align, K, device, dtype)
    w = torch.randn(E, N, K, device=device, dtype=dtype) / K**0.5
    x.requires_grad_()
    w.requires_grad_()
    out = linghe.grouped_mm(x, w, layout, backend="triton")
    g = torch.randn_like(out)
    g[~real] = 0  # padding/tail outputs are dropped downstream
    r, dx, dw = ref_grads(x, w, layout.offsets, g)
    assert out.shape == (x.shape[0], N) and out.dtype == dtype
    assert_close(out, r, name="out")
    assert torch.all(out[~real] == 0), "padding/tail rows must be zero"
    out.backward(g)
    assert_close(x.grad, dx, name="d_rows")
    assert_close(w.grad, dw, name="d_weight")
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(w.grad[e] == 0)


def test_offsets_tensor_instead_of_layout(device):
    x, layout, _ = make_rows([4, 12, 0], 16, 32, device, torch.float32)
    w = torch.randn(3, 16, 32, device=device)
    a = linghe.grouped_mm(x, w, layout)
    b = linghe.grouped_mm(x, w, layout.offsets.long())
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tail_rows_zero_even_if_input_tail_nonzero(device):
    # The tail (rows >= offsets[E]) is zero in the output whatever the input holds there.
    x, layout, real = make_rows([3, 5], 16, 32, device, torch.float32, tail=20)
    x[int(layout.offsets[-1]):] = 1.0
    w = torch.randn(2, 16, 32, device=device)
    out = linghe.grouped_mm(x, w, layout)
    assert torch.all(out[int(layout.offsets[-1]):] == 0)


def test_small_tiles_cross_experts(device):
    # align 16 with a 64-row tile: tiles come from the per-expert schedule, never crossing.
    x, layout, _ = make_rows([20, 3, 40, 0, 17], 16, 32, device, torch.float32, tail=30)
    w = torch.randn(5, 24, 32, device=device)
    r = ref.grouped_mm(x.double(), w.double(), layout.offsets)
    for bm in (16, 64):
        out = fwd_gm.grouped_mm_fwd(x, w, layout.offsets, backend="triton", block_m=bm)
        assert_close(out, r, name=f"BM={bm}")


def test_empty_rows(device):
    layout = make_expert_layout(torch.zeros(4, dtype=torch.int32, device=device), 16, 0)
    x = torch.randn(0, 32, device=device, requires_grad=True)
    w = torch.randn(4, 16, 32, device=device, requires_grad=True)
    out = linghe.grouped_mm(x, w, layout)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert x.grad.shape == (0, 32)
    assert torch.all(w.grad == 0)


def test_only_tail_rows(device):
    # All experts empty but the buffer has rows: everything is tail -> zeros.
    layout = make_expert_layout(torch.zeros(3, dtype=torch.int32, device=device), 16, 40)
    x = torch.randn(40, 32, device=device, requires_grad=True)
    w = torch.randn(3, 16, 32, device=device, requires_grad=True)
    out = linghe.grouped_mm(x, w, layout)
    assert torch.all(out == 0)
    out.backward(torch.randn_like(out))
    assert torch.all(x.grad == 0) and torch.all(w.grad == 0)


@pytest.mark.skipif(not HAS_TORCH_GMM, reason="torch._grouped_mm not available")
def test_torch_backend_matches(device):
    x, layout, real = make_rows([12, 0, 33], 16, 64, device, torch.bfloat16)
    w = (torch.randn(3, 48, 64, device=device) / 8).to(torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    out = linghe.grouped_mm(x, w, layout, backend="torch")
    g = torch.randn_like(out)
    g[~real] = 0
    r, dx, dw = ref_grads(x, w, layout.offsets, g)
    assert_close(out, r)
    assert torch.all(out[~real] == 0)
    out.backward(g)
    assert_close(x.grad, dx, name="d_rows")
    assert_close(w.grad, dw, name="d_weight")


def test_auto_backend_is_triton_off_sm90(device):
    x = torch.randn(16, 32, device=device, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 32, device=device, dtype=torch.bfloat16)
    ok = fwd_gm.torch_grouped_mm_ok(x, w)
    if device == "cpu":
        assert not ok
    assert not fwd_gm.torch_grouped_mm_ok(x.float(), w.float())


# --------------------------------------------------------- bf16/fp16 TMA rows kernel


def _spy_launches(monkeypatch, module=fwd_gm):
    """Record the names of the kernels that ``module`` (default ``linghe.fwd.grouped_mm``)
    launches."""
    names = []
    real = module.launch

    def spy(kernel, *args, **kwargs):
        names.append(getattr(kernel, "fn", kernel).__name__)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(module, "launch", spy)
    return names


TMA_BF16_CASES = [
    # (counts, align, K, N): the forward contracts K, the dgrad N
    ([5, 0, 150], 16, 200, 96),         # zero-row expert; K tail (200 = 6 x 32 + 8)
    ([0, 0, 70, 0], 1, 24, 64),         # all rows in one odd segment; K < BK (zero fill)
    ([33, 64, 0, 9], 8, 64, 136),       # N tail (136 = 2 x 64 + 8): dgrad falls back
]


@pytest.mark.gpu_subset(dtype=[torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", TMA_BF16_CASES,
                         ids=lambda c: f"E{len(c[0])}-a{c[1]}-K{c[2]}-N{c[3]}")
def test_bf16_tma_kernel(device, monkeypatch, case, dtype):
    """The TMA rows kernel on bf16/fp16 operands (``FP8=False``): forward (weights
    K-major, ``[BN, BK]`` boxes) and dgrad (weights N-major, ``[BK, BN]`` boxes) against
    the float64 reference with fp32 outputs (NaN-filled first), at partial row tiles,
    zero-row experts, tail rows, K and N tails, and against the pointer kernel at the
    same tiles. A dgrad whose contraction (N) is no multiple of BK runs the pointer
    kernel (a K box would reach the next expert's rows)."""
    monkeypatch.setattr(fwd_gm, "HP_WS", False)  # (sm_90: the WS kernel's tests are below)
    counts, align, K, N = case
    E = len(counts)
    x, layout, real = make_rows(counts, align, K, device, dtype, tail=7)
    w = (torch.randn(E, N, K, device=device) / K**0.5).to(dtype)
    g = torch.randn(x.shape[0], N, device=device, dtype=dtype)
    off = layout.offsets
    R = x.shape[0]
    bm, bn, bk, warps, stages = (64, 128, 64, 4, 3) if device == "cuda" else (16, 64, 32, 4, 1)
    names = _spy_launches(monkeypatch)
    r_fwd = ref.grouped_mm(x.double(), w.double(), off)
    r_dx = ref.grouped_mm(g.double(), w.double().transpose(1, 2), off)
    outs = {}
    for tma in (True, False):
        cfg = dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages, TMA=tma)
        out = torch.full((R, N), float("nan"), device=device)
        fwd_gm.launch_grouped_rows(x, w, out, off, stride_be=N * K, stride_bi=1,
                                   stride_bj=K, config=cfg)
        dx = torch.full((R, K), float("nan"), device=device)
        fwd_gm.launch_grouped_rows(g, w, dx, off, stride_be=N * K, stride_bi=K,
                                   stride_bj=1, config=cfg)
        outs[tma] = out, dx
        assert_close(out, r_fwd, tol=1e-5, name=f"fwd TMA={tma}")
        assert_close(dx, r_dx, tol=1e-5, name=f"dgrad TMA={tma}")
        assert torch.all(out[~real] == 0) and torch.all(dx[int(off[-1]):] == 0)
    tma_dgrad = N % bk == 0
    assert names == ["_grouped_rows_tma_kernel",
                     "_grouped_rows_tma_kernel" if tma_dgrad else "_grouped_rows_kernel",
                     "_grouped_rows_kernel", "_grouped_rows_kernel"]
    assert torch.equal(outs[True][0], outs[False][0])  # the same products, the same order
    # the public launchers' default (bf16/fp16 outputs): the TMA kernel where it applies
    del names[:]
    out16 = fwd_gm.grouped_mm_fwd(x, w, off, backend="triton")
    dx16 = fwd_gm.launch_grouped_rows(g, w, torch.full_like(x, float("nan")), off,
                                      stride_be=N * K, stride_bi=K, stride_bj=1)
    assert names[0] == "_grouped_rows_tma_kernel"
    assert out16.dtype == dtype and torch.all(out16[~real] == 0)
    assert_close(out16, r_fwd, name="fwd default")
    assert_close(dx16, r_dx, name="dgrad default")


def test_bf16_tma_fallback_and_config(device, monkeypatch):
    """Operands TMA cannot describe (rows of 66 bytes; experts not one 2-D matrix) run
    the pointer kernel with the same result; float32 never takes TMA; bad configs are
    refused with a ValueError; ``BF16_TMA = False`` restores the pointer kernel as the
    default. (The sm_90 warp-specialized kernel is off here: its own tests below.)"""
    monkeypatch.setattr(fwd_gm, "HP_WS", False)
    names = _spy_launches(monkeypatch)
    x, layout, real = make_rows([7, 0, 20], 8, 33, device, torch.bfloat16)
    w = (torch.randn(3, 16, 33, device=device) / 6).to(torch.bfloat16)
    out = fwd_gm.grouped_mm_fwd(x, w, layout.offsets, backend="triton")
    assert names == ["_grouped_rows_kernel"]
    assert_close(out, ref.grouped_mm(x.double(), w.double(), layout.offsets))
    x, layout, real = make_rows([7, 0, 20], 8, 32, device, torch.bfloat16)
    w = (torch.randn(6, 16, 32, device=device) / 6).to(torch.bfloat16)
    g = torch.randn(x.shape[0], 16, device=device, dtype=torch.bfloat16)
    # (a, b, I, J, E, stride_be, stride_bi, stride_bj, BM, BN, BK): the forward's K-major
    # and the dgrad's N-major view of contiguous weights [E, N=16, K=32]; the dgrad needs
    # N % BK == 0; every other expert (expert stride 2 N K) is no 2-D matrix
    assert fwd_gm._tma_operands(x, w, 32, 16, 3, 512, 1, 32, 16, 64, 32) is not None
    assert fwd_gm._tma_operands(g, w, 16, 32, 3, 512, 32, 1, 16, 64, 16) is not None
    assert fwd_gm._tma_operands(g, w, 16, 32, 3, 512, 32, 1, 16, 64, 32) is None
    assert fwd_gm._tma_operands(x, w[::2], 32, 16, 3, 1024, 1, 32, 16, 64, 32) is None
    assert fwd_gm._tma_operands(g, w[::2], 16, 32, 3, 1024, 32, 1, 16, 64, 16) is None
    out = fwd_gm.launch_grouped_rows(x, w[::2], torch.empty(x.shape[0], 16, device=device),
                                     layout.offsets, stride_be=2 * 16 * 32, stride_bi=1,
                                     stride_bj=32)
    assert names[-1] == "_grouped_rows_kernel"
    assert_close(out, ref.grouped_mm(x.double(), w[::2].double(), layout.offsets))
    del names[:]
    xf, wf = x.float(), w[:3].float()
    fwd_gm.grouped_mm_fwd(xf, wf, layout.offsets, backend="triton")
    assert names == ["_grouped_rows_kernel"]
    base = dict(BM=16, BN=64, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="unknown keys"):
        fwd_gm._check_rows_config(dict(base, RESCALE=False), False)
    with pytest.raises(ValueError, match="FP8 grouped GEMM config"):  # removed TMA variants
        fwd_gm._check_fp8_config(dict(base, BN=128, SCALE_AHEAD=1))
    with pytest.raises(ValueError, match="power of two"):
        fwd_gm._check_rows_config(dict(base, BK=48), False)
    with pytest.raises(ValueError, match="bf16/fp16"):
        fwd_gm._check_rows_config(dict(base, TMA=True), True)
    assert fwd_gm._check_rows_config(base, True)["TMA"] is False
    assert fwd_gm._check_rows_config(base, False)["BK"] == 64
    monkeypatch.setattr(fwd_gm, "BF16_TMA", False)
    del names[:]
    fwd_gm.grouped_mm_fwd(x, w[:3].contiguous(), layout.offsets, backend="triton")
    assert names == ["_grouped_rows_kernel"]


def test_auto_rows_on_triton_rule(device, monkeypatch):
    """``ROWS_TRITON_MAX_ROWS_PER_EXPERT`` (off by default): where ``backend="auto"``
    would take ``torch._grouped_mm``, layouts with at most that many rows per expert run
    the forward and dgrad on Triton and the wgrad on its own ``"auto"`` (torch's there,
    the warp-specialized kernel on sm_90); more rows per expert, N no
    multiple of 64, or the knob at 0 keep torch for all three. (torch._grouped_mm is
    pretended available and every call runs the Triton kernels: only the choice is
    checked here.)"""
    import linghe.functional.grouped_mm as F

    seen = []

    def spy(name, real):
        def f(*args, backend, **kwargs):
            seen.append((name, backend))
            return real(*args, backend="triton", **kwargs)
        return f

    monkeypatch.setattr(F.fwd, "torch_grouped_mm_ok", lambda *t: True)
    monkeypatch.setattr(F.fwd, "hp_ws_preferred", lambda t, n=None: False)  # (sm_90: below)
    monkeypatch.setattr(F.fwd, "grouped_mm_fwd", spy("fwd", fwd_gm.grouped_mm_fwd))
    monkeypatch.setattr(F.bwd, "grouped_mm_dgrad", spy("dgrad", bwd_gm.grouped_mm_dgrad))
    monkeypatch.setattr(F.bwd, "grouped_mm_wgrad", spy("wgrad", bwd_gm.grouped_mm_wgrad))
    x, layout, real = make_rows([9, 0, 20], 16, 32, device, torch.bfloat16)  # R = 53
    g = torch.randn(x.shape[0], 64, device=device, dtype=torch.bfloat16)

    def run(limit, N=64, lay=layout):
        monkeypatch.setattr(F, "ROWS_TRITON_MAX_ROWS_PER_EXPERT", limit)
        w = (torch.randn(3, N, 32, device=device) / 6).to(torch.bfloat16).requires_grad_()
        xi = x.clone().requires_grad_()
        del seen[:]
        out = linghe.grouped_mm(xi, w, lay)
        out.backward(g[:, :N])
        r, dx, dw = ref_grads(x, w, layout.offsets, g[:, :N])
        assert_close(out, r)
        assert_close(xi.grad, dx, name="d_rows")
        assert_close(w.grad, dw, name="d_weight")
        return dict(seen)

    assert run(0) == dict(fwd="torch", dgrad="torch", wgrad="torch")
    assert run(18) == dict(fwd="triton", dgrad="triton", wgrad="auto")  # 53 <= 18 * 3
    assert run(17) == dict(fwd="torch", dgrad="torch", wgrad="torch")
    assert run(18, N=48) == dict(fwd="torch", dgrad="torch", wgrad="torch")
    assert run(18, lay=layout.offsets) == dict(fwd="triton", dgrad="triton", wgrad="triton")
    monkeypatch.setattr(fwd_gm, "BF16_TMA", False)
    assert run(18) == dict(fwd="torch", dgrad="torch", wgrad="torch")
    # sm_90 (the warp-specialized rows kernel available): forward and dgrad on it, the
    # wgrad on grouped_mm_wgrad's "auto" (the warp-specialized wgrad there), whatever the
    # knob says
    monkeypatch.setattr(F.fwd, "hp_ws_preferred", lambda t, n=None: True)
    assert run(0) == dict(fwd="triton", dgrad="triton", wgrad="auto")


# ------------------------------------------------------------------------------------ FP8


FP8_CASES = [
    # (counts, align, K, N)
    ([5, 0, 150], 16, 200, 128),       # align 16: wgrad groups straddle experts
    ([100, 28], 128, 256, 128),        # align 128
    ([0, 0, 70], 1, 96, 256),          # all rows in one expert, K < 128
    ([130, 300], 8, 128, 128),         # wgrad: full interior groups plus head/tail groups
]


def _deq(t, columnwise=False):
    return t.dequantize(columnwise=columnwise, dtype=torch.float32).double()


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"E{len(c[0])}-a{c[1]}-K{c[2]}")
def test_fp8_kernels_match_dequantized_reference(device, case):
    counts, align, K, N = case
    E = len(counts)
    x, layout, real = make_rows(counts, align, K, device, torch.bfloat16, scale=3.0)
    w = torch.randn(E, N, K, device=device, dtype=torch.bfloat16) / K**0.5
    g = torch.randn(x.shape[0], N, device=device, dtype=torch.bfloat16)
    g[~real] = 0
    a = linghe.quantize_1x128(x, columnwise=True)
    wq = linghe.quantize_grouped_weight(w, columnwise=True)
    gq = linghe.quantize_1x128(g, columnwise=True)
    off = layout.offsets

    out = linghe.grouped_mm_fp8(a, wq, layout)
    r_deq = ref.grouped_mm_fp8_dequantized(a.rowwise_data, a.rowwise_scale, wq.rowwise_data,
                                           wq.rowwise_scale, off)
    assert out.dtype == torch.bfloat16
    assert_close(out, r_deq, tol=1e-2, name="fwd vs dequantized")
    assert_close(out, ref.grouped_mm(x.double(), w.double(), off), tol=FP8_VS_EXACT,
                 name="fwd vs exact")
    assert torch.all(out[~real] == 0)

    dx = linghe.grouped_mm_fp8_dgrad(gq, wq, layout)
    r_dx = ref.grouped_mm(_deq(gq), _deq(wq).transpose(1, 2), off)
    assert_close(dx, r_dx, tol=1e-2, name="dgrad vs dequantized")

    dw = linghe.grouped_mm_fp8_wgrad(gq, a, layout, out_dtype=torch.float32)
    gc, xc = _deq(gq, columnwise=True), _deq(a, columnwise=True)
    r_dw = torch.stack([gc[off[e]:off[e + 1]].t() @ xc[off[e]:off[e + 1]] for e in range(E)])
    assert dw.dtype == torch.float32
    # Hopper FP8 wgmma accumulates with reduced (not IEEE fp32) precision inside each
    # 128-token step: ~1e-4 relative vs the float64 product of the dequantized operands.
    assert_close(dw, r_dw, tol=1e-3 if device == "cuda" else 1e-5,
                 name="wgrad vs dequantized")
    exact_dw = torch.stack([g.double()[off[e]:off[e + 1]].t() @ x.double()[off[e]:off[e + 1]]
                            for e in range(E)])
    assert_close(dw, exact_dw, tol=FP8_VS_EXACT, name="wgrad vs exact")
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(dw[e] == 0)


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"E{len(c[0])}-a{c[1]}-K{c[2]}")
def test_fp8_tma_kernel_matches_pointer_kernel(device, case):
    """The TMA rows kernel (the FP8 default) and the pointer kernel give the same
    forward and dgrad bit for bit, at pinned and default tiles; operands TMA cannot
    describe (rows of K = 200 bytes: not 16-byte multiples) fall back to the pointer
    kernel."""
    counts, align, K, N = case
    E = len(counts)
    x, layout, real = make_rows(counts, align, K, device, torch.bfloat16, scale=3.0)
    w = torch.randn(E, N, K, device=device, dtype=torch.bfloat16) / K**0.5
    g = torch.randn(x.shape[0], N, device=device, dtype=torch.bfloat16)
    a = linghe.quantize_1x128(x)
    wq = linghe.quantize_grouped_weight(w, columnwise=True)
    gq = linghe.quantize_1x128(g)
    off = layout.offsets
    bm, bn, warps, stages = (64, 128, 4, 3) if device == "cuda" else (32, 64, 4, 1)
    for bn_ in (bn, 256):  # one weight scale per K step, and per 128 columns
        outs = {}
        for tma in (False, True):
            cfg = dict(BM=bm, BN=bn_, num_warps=warps, num_stages=stages, TMA=tma)
            outs[tma] = (fwd_gm.grouped_mm_fp8_fwd(a, wq, off, torch.float32, config=cfg),
                         bwd_gm.grouped_mm_fp8_dgrad(gq, wq, off, torch.float32, config=cfg))
        for i, name in enumerate(("fwd", "dgrad")):
            assert torch.equal(outs[True][i], outs[False][i]), (name, bn_)
    r_deq = ref.grouped_mm_fp8_dequantized(a.rowwise_data, a.rowwise_scale, wq.rowwise_data,
                                           wq.rowwise_scale, off)
    assert_close(fwd_gm.grouped_mm_fp8_fwd(a, wq, off, torch.float32), r_deq, tol=1e-3,
                 name="default launch vs dequantized")
    tma_fwd = fwd_gm._tma_operands(a.rowwise_data, wq.rowwise_data, K, N, E, N * K, 1, K,
                                   bm, bn)
    assert (tma_fwd is None) == (K % 16 != 0)


def test_fp8_autograd_vs_exact(device):
    counts, align, K, N = [7, 0, 40], 16, 160, 128
    x, layout, real = make_rows(counts, align, K, device, torch.bfloat16)
    w = (torch.randn(3, N, K, device=device) / K**0.5).to(torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    out = linghe.grouped_mm(x, w, layout, fp8=True)
    g = torch.randn_like(out)
    g[~real] = 0
    r, dx, dw = ref_grads(x, w, layout.offsets, g)
    assert_close(out, r, tol=FP8_VS_EXACT)
    out.backward(g)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert_close(x.grad, dx, tol=FP8_VS_EXACT, name="d_rows")
    assert_close(w.grad, dw, tol=FP8_VS_EXACT, name="d_weight")
    assert torch.all(w.grad[1] == 0)


def test_fp8_pow2_scales(device):
    x, layout, _ = make_rows([30, 2], 16, 128, device, torch.float32)
    w = torch.randn(2, 128, 128, device=device) / 11
    out = linghe.grouped_mm(x, w, layout, fp8=True, pow2_scale=True)
    assert out.dtype == torch.float32
    assert_close(out, ref.grouped_mm(x.double(), w.double(), layout.offsets),
                 tol=FP8_VS_EXACT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_grouped_weight_layout(device, dtype):
    w = torch.randn(3, 128, 200, device=device, dtype=dtype)
    q = linghe.quantize_grouped_weight(w)
    assert q.shape == w.shape and q.scaling == "128x128"
    assert q.rowwise_data.shape == (384, 200) and q.rowwise_scale.shape == (3, 2)
    assert q.columnwise_data.shape == (200, 384) and q.columnwise_scale.shape == (2, 3)
    # Element-wise against the spec on the [E*N, K] view (pinpoints data vs scales).
    rq, rs = ref.quantize_128x128(w.reshape(384, 200), False)
    torch.testing.assert_close(q.rowwise_scale, rs, rtol=0, atol=0)
    assert_fp8_close(q.rowwise_data, rq)
    assert torch.equal(q.columnwise_data.float(), q.rowwise_data.float().t())
    assert torch.equal(q.columnwise_scale, q.rowwise_scale.t())
    assert_close(q.dequantize(dtype=torch.float32), w.float(), tol=0.07)


# ---------------------------------------------------------------------------- bad inputs


def test_bad_inputs(device):
    x, layout, _ = make_rows([4, 4], 16, 32, device, torch.float32)
    w = torch.randn(2, 16, 32, device=device)
    with pytest.raises(TypeError, match="weight must have rows' dtype"):
        linghe.grouped_mm(x, w.half(), layout)
    with pytest.raises(TypeError, match="rows must have dtype"):
        linghe.grouped_mm(x.long(), w, layout)
    with pytest.raises(ValueError, match="K=32"):
        linghe.grouped_mm(x, torch.randn(2, 16, 31, device=device), layout)
    with pytest.raises(ValueError, match="num_experts"):
        linghe.grouped_mm(x, torch.randn(3, 16, 32, device=device), layout)
    with pytest.raises(ValueError, match="num_rows"):
        linghe.grouped_mm(x[:-1], w, layout)
    with pytest.raises(ValueError, match="offsets must have shape"):
        linghe.grouped_mm(x, w, layout.offsets[:-1])
    with pytest.raises(TypeError, match="offsets must have dtype"):
        linghe.grouped_mm(x, w, layout.offsets.float())
    with pytest.raises(TypeError, match="layout must be"):
        linghe.grouped_mm(x, w, [0, 16, 32])
    with pytest.raises(ValueError, match="weight must be 3-D"):
        linghe.grouped_mm(x, w[0], layout)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        linghe.grouped_mm(torch.randn(32, 64, device=device)[:, ::2], w, layout)
    with pytest.raises(ValueError, match="backend"):
        linghe.grouped_mm(x, w, layout, backend="cublas")
    with pytest.raises(ValueError, match="multiple of 128"):
        linghe.grouped_mm(x, w, layout, fp8=True)
    with pytest.raises(ValueError, match="at least one expert"):
        linghe.grouped_mm(x, torch.randn(0, 16, 32, device=device), layout.offsets[:1])


def test_bad_fp8_inputs(device):
    x, layout, _ = make_rows([4, 4], 16, 128, device, torch.bfloat16)
    w = torch.randn(2, 128, 128, device=device, dtype=torch.bfloat16)
    a = linghe.quantize_1x128(x)
    wq = linghe.quantize_grouped_weight(w, columnwise=False)
    with pytest.raises(TypeError, match="a_fp8 must be an Fp8Tensor"):
        linghe.grouped_mm_fp8(x, wq, layout)
    with pytest.raises(TypeError, match="w_fp8 must be a 3-D"):
        linghe.grouped_mm_fp8(a, w, layout)
    with pytest.raises(ValueError, match="columnwise copy"):
        linghe.grouped_mm_fp8_dgrad(a, wq, layout)
    with pytest.raises(ValueError, match="columnwise copy"):
        linghe.grouped_mm_fp8_wgrad(a, a, layout)
    with pytest.raises(ValueError, match="multiple of 128"):
        linghe.quantize_grouped_weight(torch.randn(2, 100, 128, device=device))
    with pytest.raises(TypeError, match="out_dtype"):
        linghe.grouped_mm_fp8(a, wq, layout, out_dtype=torch.int32)


# -------------------------------------------------------------------- GPU, Ling-mini shape


def _ling_layout(E, T, topk, align, device):
    # Random, balanced-ish routing: tokens per expert around T*topk/E.
    logits = torch.randn(T, E, device=device)
    ids = logits.topk(topk, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    R = T * topk + E * (align - 1)
    layout = make_expert_layout(counts, align, R)
    row = torch.arange(R, device=device)
    seg = torch.searchsorted(layout.offsets[1:].long(), row, right=True).clamp_max(E - 1)
    real = (row < layout.offsets[-1]) & (row - layout.offsets[seg] < counts[seg])
    return layout, real


@pytest.mark.gpu
@pytest.mark.fp8_autotune(backend=["fp8"], E=[32], K=[2048])  # the autotuned FP8 launches
@pytest.mark.parametrize("backend", ["triton", "torch", "fp8"])
@pytest.mark.parametrize("E,K,N", [(32, 2048, 2048), (32, 1024, 2048),
                                   pytest.param(256, 2048, 2048, marks=pytest.mark.gpu_big)])
def test_ling_mini_shapes(device, backend, E, K, N):
    if backend == "torch" and not fwd_gm.torch_grouped_mm_ok(
            torch.empty(8, 8, device=device, dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm needs sm90 here")
    # T 8192 x top-8 = 65536 routed rows, over 256 experts (all local) or 32 (EP 8).
    layout, real = _ling_layout(E, 8192, 8, 128 if backend == "fp8" else 16, device)
    R = layout.num_rows
    x = torch.randn(R, K, device=device, dtype=torch.bfloat16)
    x[~real] = 0
    w = (torch.randn(E, N, K, device=device) / K**0.5).to(torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    fp8 = backend == "fp8"
    out = linghe.grouped_mm(x, w, layout, fp8=fp8, backend="auto" if fp8 else backend)
    g = torch.randn_like(out)
    g[~real] = 0
    out.backward(g)
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    r = ref.grouped_mm(xr, wr, layout.offsets)
    dx, dw = torch.autograd.grad(r, (xr, wr), g.float())
    tol = FP8_VS_EXACT if fp8 else 1e-2
    assert rel_err(out, r) <= tol
    assert torch.all(out[~real] == 0)
    assert rel_err(x.grad, dx) <= tol
    assert rel_err(w.grad, dw) <= tol


@pytest.mark.parametrize("E,align,bm", [(1, 16, 32), (7, 1, 16), (300, 16, 64)])
def test_tile_map(device, E, align, bm):
    counts = torch.randint(0, 40, (E,), dtype=torch.int32)
    counts[torch.rand(E) < 0.3] = 0
    R = int(((counts + align - 1) // align * align).sum()) + 50
    layout = make_expert_layout(counts.to(device), align, R)
    tile_off, tile_expert, n = fwd_gm.tile_map(layout.offsets, R, bm)
    seg = layout.padded_tokens_per_expert.cpu().long()
    want_off = torch.cat([torch.zeros(1, dtype=torch.long), ((seg + bm - 1) // bm).cumsum(0)])
    assert torch.equal(tile_off.cpu().long(), want_off)
    want_e = torch.searchsorted(want_off[1:], torch.arange(n), right=True)
    assert torch.equal(tile_expert.cpu().long(), want_e)
    # The static bound covers every expert tile and the whole tail.
    tail_tiles = -(-(R - int(layout.offsets[-1])) // bm)
    assert int(want_off[-1]) + tail_tiles <= n


def test_many_experts_in_kernel_schedule(device):
    # E = 37 experts (in-kernel tile schedule over a 64-wide vector), zero-row experts,
    # align 1 and a tail; forward and dgrad through the Triton kernel.
    counts = torch.randint(0, 9, (37,)).tolist()
    counts[3] = counts[20] = 0
    x, layout, real = make_rows(counts, 1, 32, device, torch.float32, tail=7)
    w = torch.randn(37, 24, 32, device=device)
    out = linghe.grouped_mm(x, w, layout, backend="triton")
    assert_close(out, ref.grouped_mm(x.double(), w.double(), layout.offsets))
    assert torch.all(out[~real] == 0)
    g = torch.randn_like(out)
    dx = fwd_gm.launch_grouped_rows(g, w, torch.empty_like(x), layout.offsets,
                                    stride_be=24 * 32, stride_bi=32, stride_bj=1, block_m=16)
    assert_close(dx, ref.grouped_mm(g.double(), w.double().transpose(1, 2), layout.offsets))


@pytest.mark.parametrize("R,J,used", [(70, 300, 33), (70, 300, 0), (70, 5, 70), (1, 1, 0)])
def test_zero_tail(device, R, J, used):
    out = torch.randn(R, J, device=device)
    before = out.clone()
    offsets = torch.tensor([0, used], dtype=torch.int32, device=device)
    fwd_gm.zero_tail(out, offsets)
    assert torch.equal(out[:used], before[:used])
    assert torch.all(out[used:] == 0)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("which", ["rows", "weight"])
def test_grad_of_one_operand_only(device, fp8, which):
    x, layout, real = make_rows([9, 0, 20], 16, 128, device, torch.bfloat16)
    w = (torch.randn(3, 128, 128, device=device) / 11).to(torch.bfloat16)
    leaf = x if which == "rows" else w
    leaf.requires_grad_()
    out = linghe.grouped_mm(x, w, layout, fp8=fp8)
    g = torch.randn_like(out)
    g[~real] = 0
    out.backward(g)
    _, dx, dw = ref_grads(x, w, layout.offsets, g)
    assert_close(leaf.grad, dx if which == "rows" else dw,
                 tol=FP8_VS_EXACT if fp8 else 1e-2)
    other = w if which == "rows" else x
    assert other.grad is None


def test_fp8_weight_cache_reuse_and_invalidation(device):
    """The expert weights are quantized once per version: two forwards (micro-batches)
    and their dgrads share one quantization; an optimizer step or an in-place update
    quantizes again; results equal those of an uncached call."""
    from linghe.fp8 import WeightCache

    x, layout, real = make_rows([9, 0, 20], 16, 128, device, torch.bfloat16)
    w = torch.nn.Parameter((torch.randn(3, 128, 128, device=device) / 11).to(torch.bfloat16))
    cache = WeightCache()
    opt = torch.optim.SGD([w], lr=1.0)
    outs = []
    for _ in range(2):
        xi = x.clone().requires_grad_()
        out = linghe.grouped_mm(xi, w, layout, fp8=True, pow2_scale=True, weight_cache=cache)
        out.float().sum().backward()
        outs.append((out.detach(), xi.grad))
    assert (cache.misses, cache.hits) == (1, 1)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # the same as quantizing on every call
    xi = x.clone().requires_grad_()
    out = linghe.grouped_mm(xi, w.detach().clone(), layout, fp8=True, pow2_scale=True)
    out.float().sum().backward()
    assert torch.equal(out, outs[0][0]) and torch.equal(xi.grad, outs[0][1])
    cached = cache.value
    opt.step()  # in-place update: version bump
    out2 = linghe.grouped_mm(x, w, layout, fp8=True, pow2_scale=True, weight_cache=cache)
    assert cache.misses == 2 and cache.value is not cached
    fresh = linghe.quantize_grouped_weight(w.detach(), columnwise=True, pow2_scale=True)
    assert torch.equal(cache.value.rowwise_data.float(), fresh.rowwise_data.float())
    assert torch.equal(cache.value.columnwise_scale, fresh.columnwise_scale)
    assert not torch.equal(out2, outs[0][0])
    with torch.no_grad():
        w.mul_(2)
    linghe.grouped_mm(x, w, layout, fp8=True, pow2_scale=True, weight_cache=cache)
    assert cache.misses == 3
    # another scale format is another key
    linghe.grouped_mm(x, w, layout, fp8=True, pow2_scale=False, weight_cache=cache)
    assert cache.misses == 4
    with pytest.raises(TypeError, match="weight_cache"):
        linghe.grouped_mm(x, w, layout, fp8=True, weight_cache={})


def test_weight_cache_generic(device):
    from linghe.fp8 import WeightCache

    w = torch.randn(130, 200, device=device)
    cache = WeightCache()
    calls = []

    def q(t):
        calls.append(1)
        return linghe.quantize_128x128(t, columnwise=True)

    a = cache.get(w, q, "f")
    assert cache.get(w, q, "f") is a and len(calls) == 1
    w.data = w.data.clone()  # new storage: a miss
    assert cache.get(w, q, "f") is not a and len(calls) == 2
    assert cache.get(w, q, "g") is not None and len(calls) == 3  # format key
    w.add_(1)
    cache.get(w, q, "g")
    assert len(calls) == 4
    cache.clear()
    cache.get(w, q, "g")
    assert len(calls) == 5 and (cache.hits, cache.misses) == (1, 5)

    def bad(t):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        cache.get(w.add_(1), bad, "g")
    assert cache.value is None  # no stale copy left behind
    with pytest.raises(TypeError, match="quantize must return an Fp8Tensor"):
        cache.get(w, lambda t: t, "h")


# ------------------------------------------------------- segment-grouped FP8 (MoE path)
SEG_CASES = [
    # (counts, align, K)
    ([37], 16, 130),                    # one expert, K tail
    ([5, 0, 140, 0], 16, 256),          # zero-row experts, a segment over 128 rows
    ([0, 0, 0], 8, 64),                 # nothing routed: all tail
    ([9, 31, 1, 0, 17], 1, 128),        # align 1: segments of any size
]


def _seg_rows(counts, align, K, device, tail=6):
    x, layout, real = make_rows(counts, align, K, device, torch.bfloat16, tail=tail,
                                scale=3.0)
    x[~real] = float("nan")  # padding/tail rows must not be read
    return x, layout, real


@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: f"E{len(c[0])}-a{c[1]}-K{c[2]}")
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_grouped_1x128(device, case, pow2):
    counts, align, K = case
    x, layout, real = _seg_rows(counts, align, K, device)
    t = linghe.functional.grouped_mm.quantize_grouped_1x128(x, layout, pow2_scale=pow2)
    q, s, qt, st, _ = ref.quantize_grouped_1x128(x.float(), counts, align, pow2)
    torch.testing.assert_close(t.rowwise_scale, s, rtol=0, atol=0)
    torch.testing.assert_close(t.columnwise_scale, st, rtol=0, atol=0)
    assert_fp8_close(t.rowwise_data, q)
    assert_fp8_close(t.columnwise_data, qt)
    assert t.col_segments is layout.offsets
    xr = torch.where(real[:, None], x.float(), 0.0)
    if real.any():
        assert_close(t.dequantize(columnwise=True, dtype=torch.float32), xr, tol=0.07)
    # From FP8 rows (permute's output): the columnwise copy of the dequantized rowwise
    # values; the rowwise copy is kept as it is.
    a = linghe.quantize_1x128(torch.where(real[:, None], x, 0.0), pow2_scale=pow2)
    t2 = linghe.functional.grouped_mm.quantize_grouped_1x128(a, layout, pow2_scale=pow2)
    assert t2.rowwise_data is a.rowwise_data
    _, _, qt2, st2, _ = ref.quantize_grouped_1x128(
        ref.dequantize_1x128(a.rowwise_data, a.rowwise_scale), counts, align, pow2)
    torch.testing.assert_close(t2.columnwise_scale, st2, rtol=0, atol=0)
    assert_fp8_close(t2.columnwise_data, qt2)


@pytest.mark.parametrize("case", [([5, 0, 140, 0], 16, 130, 128), ([9, 31, 1, 0, 17], 1, 64, 256),
                                  ([0, 0], 8, 64, 128)],
                         ids=lambda c: f"E{len(c[0])}-a{c[1]}")
def test_fp8_wgrad_segment_groups(device, case):
    counts, align, K, N = case
    E = len(counts)
    x, layout, real = make_rows(counts, align, K, device, torch.bfloat16, scale=3.0)
    g = torch.randn(x.shape[0], N, device=device, dtype=torch.bfloat16)
    g[~real] = 0
    qg = linghe.functional.grouped_mm.quantize_grouped_1x128
    a, gq = qg(x, layout, rowwise=False), qg(g, layout, rowwise=False)
    dw = linghe.grouped_mm_fp8_wgrad(gq, a, layout, out_dtype=torch.float32)
    off = layout.offsets
    gc, xc = _deq(gq, columnwise=True), _deq(a, columnwise=True)
    r_dw = torch.stack([gc[off[e]:off[e + 1]].t() @ xc[off[e]:off[e + 1]] for e in range(E)])
    assert_close(dw, r_dw, tol=1e-3 if device == "cuda" else 1e-5, name="wgrad vs dequantized")
    exact = torch.stack([g.double()[off[e]:off[e + 1]].t() @ x.double()[off[e]:off[e + 1]]
                         for e in range(E)])
    assert_close(dw, exact, tol=FP8_VS_EXACT, name="wgrad vs exact")
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(dw[e] == 0)
    # The groupings must match: by identity of the layout's offsets.
    plain = linghe.quantize_1x128(g, columnwise=True)
    with pytest.raises(ValueError, match="both have plain columnwise groups"):
        linghe.grouped_mm_fp8_wgrad(plain, a, layout)
    other = make_expert_layout(layout.tokens_per_expert.clone(), align, layout.num_rows)
    with pytest.raises(ValueError, match="different tensors|layout.offsets itself"):
        linghe.grouped_mm_fp8_wgrad(gq, a, other)
    # raw offsets: the very tensor the copies carry
    dw2 = linghe.grouped_mm_fp8_wgrad(gq, a, layout.offsets, out_dtype=torch.float32)
    assert torch.equal(dw, dw2)


_COMPILE_SCRIPT = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from linghe.fwd import grouped_mm as F
from linghe.bwd import grouped_mm as B

def comp(fn, sig, consts, warps, stages, div=()):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or n in div}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})

sig = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", as_ptr="*fp32", bs_ptr="*fp32",
           offsets_ptr="*i32", R="i32", I="i32", J="i32", E="i32", R_BUCKET="i32",
           stride_am="i32", stride_be="i32", stride_bi="i32", stride_bj="i32", stride_cm="i32",
           stride_ask="i32", bs_se="i32", bs_si="i32", bs_sj="i32", BM="constexpr",
           BN="constexpr", BK="constexpr", GROUP_M="constexpr", FP8="constexpr",
           IEEE="constexpr", B_KMAJOR="constexpr", EP2="constexpr", RESCALE="constexpr")
for bm, bn, warps, stages, kmajor in [(128, 128, 8, 3, True), (64, 128, 4, 4, True),
                                      (64, 128, 4, 4, False)]:
    k = comp(F._grouped_rows_kernel, sig, dict(BM=bm, BN=bn, BK=128, GROUP_M=8,
             FP8=True, IEEE=False, B_KMAJOR=kmajor, EP2=256, RESCALE=False), warps, stages,
             ("I", "J", "stride_am", "stride_be", "stride_bj", "stride_cm", "R",
              "stride_ask"))
    assert "wgmma" in k.asm["ptx"], "the FP8 grouped GEMM should use Hopper wgmma"
sig = dict(a_desc="tensordesc<fp8e4nv[64, 128]>", b_desc="tensordesc<fp8e4nv[128, 128]>",
           c_ptr="*bf16", as_ptr="*fp32", bs_ptr="*fp32", offsets_ptr="*i32", R="i32",
           I="i32", J="i32", E="i32", R_BUCKET="i32", b_row_e="i32", b_col_e="i32",
           stride_cm="i32", stride_ask="i32", bs_se="i32", bs_si="i32", bs_sj="i32",
           BM="constexpr", BN="constexpr", BK="constexpr", GROUP_M="constexpr",
           EP2="constexpr", B_NMAJOR="constexpr", RESCALE="constexpr")
# FP8, rescaled form at 128x128 / 8 warps (one accumulator tile)
s = dict(sig, a_desc="tensordesc<fp8e4nv[128, 128]>")
k = comp(F._grouped_rows_tma_kernel, s, dict(BM=128, BN=128, BK=128, GROUP_M=8, EP2=256,
         RESCALE=True), 8, 3, ("I", "J", "R", "stride_cm", "stride_ask"))
assert "wgmma" in k.asm["ptx"] and "cp.async.bulk.tensor" in k.asm["ptx"]
# FP8 at the default tiles (64x128, 4 warps, 3 stages)
k = comp(F._grouped_rows_tma_kernel, sig, dict(BM=64, BN=128, BK=128, GROUP_M=8, EP2=256,
         RESCALE=False), 4, 3, ("I", "J", "R", "stride_cm", "stride_ask"))
ptx = k.asm["ptx"]
assert "wgmma" in ptx and "cp.async.bulk.tensor" in ptx, "TMA loads feeding wgmma"
# pipelined: `stages` buffers of the A and B boxes (24 KiB per K block)
assert k.metadata.shared >= 2 * 24576
# the K loop: one MMA group per K block, one wait
head = re.search(r"(\$L__BB\d+_\d+):\s*// =>This Inner Loop Header", ptx)
loop = ptx[head.end():ptx.index(f"bra \t{head[1]};", head.end())]
assert (loop.count("wgmma.commit_group"), loop.count("wgmma.wait_group")) == (1, 1)
# bf16 descriptors: the forward (weights K-major) and the dgrad (N-major [BK, BN] boxes)
for bm, bn, warps, stages, nmajor in [(64, 128, 4, 4, False), (64, 128, 4, 4, True),
                                      (128, 128, 8, 3, False), (128, 256, 8, 3, True)]:
    box = f"[64, {bn}]" if nmajor else f"[{bn}, 64]"
    s = dict(sig, a_desc=f"tensordesc<bf16[{bm}, 64]>", b_desc=f"tensordesc<bf16{box}>",
             as_ptr="*i32", bs_ptr="*i32")
    k = comp(F._grouped_rows_tma_kernel, s, dict(BM=bm, BN=bn, BK=64, GROUP_M=8,
             EP2=256, B_NMAJOR=nmajor, RESCALE=False), warps, stages,
             ("I", "J", "R", "stride_cm", "b_row_e"))
    ptx = k.asm["ptx"]
    assert "wgmma" in ptx and "cp.async.bulk.tensor" in ptx, "TMA loads feeding wgmma"
    assert k.metadata.shared >= stages * (bm + bn) * 64 * 2, (bm, bn, stages)
    # asynchronous K loop: each step waits for the one before the last (one group in
    # flight), no promotion
    head = re.search(r"(\$L__BB\d+_\d+):\s*// =>This Inner Loop Header", ptx)
    loop = ptx[head.end():ptx.index(f"bra \t{head[1]};", head.end())]
    assert re.findall(r"wgmma.wait_group.sync.aligned (\d+)", loop) == ["1"], (bm, bn, nmajor)
sig = dict(g_ptr="*fp8e4nv", x_ptr="*fp8e4nv", w_ptr="*bf16", gs_ptr="*fp32", xs_ptr="*fp32",
           offsets_ptr="*i32", N="i32", K="i32", R="i32", E="i32", stride_g="i32",
           stride_x="i32", stride_gs="i32", stride_xs="i32", stride_we="i32", stride_wn="i32",
           BN="constexpr", BK="constexpr", BR="constexpr", SEG="constexpr", EP2="constexpr",
           ALIGN16="constexpr", RESCALE="constexpr", VEC_MASK="constexpr")
for seg in (False, True):
    k = comp(B._wgrad_fp8_kernel, sig, dict(BN=128, BK=128, BR=128, SEG=seg, EP2=32,
             ALIGN16=seg, RESCALE=False, VEC_MASK=False), 8, 3,
             ("stride_g", "stride_x", "stride_we", "stride_wn", "K", "N", "stride_gs",
              "stride_xs"))
    assert "wgmma" in k.asm["ptx"], ("the FP8 wgrad should use Hopper wgmma", seg)
sig = dict(x_ptr="*bf16", xs_ptr="*fp32", cnt_ptr="*i32", q_ptr="*fp8e4nv", s_ptr="*fp32",
           qt_ptr="*fp8e4nv", st_ptr="*fp32", R="i32", K="i32", E="i32", stride_x="i32",
           stride_xs="i32", ALIGN="i32", NG="i32", FP8_IN="constexpr", ROWWISE="constexpr",
           COLWISE="constexpr", POW2="constexpr", EP2="constexpr", ALIGN16="constexpr")
for fp8_in in (False, True):
    s = dict(sig, x_ptr="*fp8e4nv" if fp8_in else "*bf16")
    k = comp(F._quantize_grouped_kernel, s, dict(FP8_IN=fp8_in, ROWWISE=not fp8_in,
             COLWISE=True, POW2=True, EP2=64, ALIGN16=True), 4, 1,
             ("K", "stride_x", "R", "ALIGN"))
    # the transposed fp8 stores must be 16-byte vectors (ALIGN16 segment starts)
    assert "st.global.b8" not in k.asm["ptx"], fp8_in
print("COMPILED")
'''


def test_fp8_kernels_compile_for_sm90(compile_sm90):
    """The FP8 grouped GEMM, the wgrad (plain and segment groups) and the grouped
    quantizer compiled for sm_90 without a GPU: GPU-only compile errors, wgmma use,
    vectorized transposed stores."""
    compile_sm90(_COMPILE_SCRIPT)


def test_fp8_autotuned_launch_path(device, monkeypatch):
    """The autotuned launches (GPU, large shapes) take the same arguments as the
    heuristic ones: run them with a one-config list (no benchmarking) at a small shape
    (the pointer kernel: the TMA kernel has fixed tiles)."""
    import triton

    monkeypatch.setattr(fwd_gm, "FP8_TMA", False)
    monkeypatch.setattr(fwd_gm, "FP8_WS", False)
    monkeypatch.setattr(fwd_gm, "AUTOTUNE_MIN_ROWS", 0)
    monkeypatch.setattr(bwd_gm, "AUTOTUNE_MIN_ROWS", 0)
    monkeypatch.setattr(fwd_gm, "_autotune_enabled", lambda: True)
    monkeypatch.setattr(bwd_gm, "_autotune_enabled", lambda: True)
    monkeypatch.setattr(fwd_gm, "_FP8_CONFIGS", [triton.Config(
        {"BM": 32, "BN": 64, "BK": 128, "GROUP_M": 4}, num_warps=4, num_stages=1)])
    monkeypatch.setattr(bwd_gm, "_WGRAD_FP8_CONFIGS", [triton.Config(
        {"BN": 64, "BK": 64}, num_warps=4, num_stages=1)])
    monkeypatch.setattr(fwd_gm, "_rows_tuned", None)
    monkeypatch.setattr(bwd_gm, "_wgrad_tuned", None)
    x, layout, real = make_rows([9, 0, 40], 16, 128, device, torch.bfloat16)
    w = (torch.randn(3, 128, 128, device=device) / 11).to(torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    out = linghe.grouped_mm(x, w, layout, fp8=True)
    g = torch.randn_like(out)
    g[~real] = 0
    out.backward(g)
    r, dx, dw = ref_grads(x, w, layout.offsets, g)
    assert fwd_gm._rows_tuned is not None and bwd_gm._wgrad_tuned is not None
    assert_close(out, r, tol=FP8_VS_EXACT)
    assert_close(x.grad, dx, tol=FP8_VS_EXACT, name="d_rows")
    assert_close(w.grad, dw, tol=FP8_VS_EXACT, name="d_weight")


def test_tma_only_where_the_device_has_it(device, monkeypatch):
    """The default launches take the TMA kernel on sm_90+ (and in the interpreter) only:
    older GPUs (an A100's 164 KiB of shared memory, no tensor-memory copies) keep the
    pointer kernel, with the same result. (sm_90's warp-specialized kernel off here.)"""
    from types import SimpleNamespace

    import linghe.utils as lu

    monkeypatch.setattr(lu, "INTERPRET", False)
    monkeypatch.setitem(lu._CAPABILITY, torch.device("cuda", 7), (8, 0))
    monkeypatch.setitem(lu._CAPABILITY, torch.device("cuda", 6), (9, 0))
    assert not fwd_gm.tma_capable(SimpleNamespace(device=torch.device("cuda", 7)))
    assert fwd_gm.tma_capable(SimpleNamespace(device=torch.device("cuda", 6)))
    assert not fwd_gm.tma_capable(torch.empty(1))          # a CPU tensor off the interpreter
    monkeypatch.undo()
    monkeypatch.setattr(fwd_gm, "HP_WS", False)
    names = _spy_launches(monkeypatch)
    x, layout, real = make_rows([5, 0, 21], 16, 64, device, torch.bfloat16)
    w = (torch.randn(3, 64, 64, device=device) / 8).to(torch.bfloat16)
    want = ref.grouped_mm(x.double(), w.double(), layout.offsets)
    out = fwd_gm.grouped_mm_fwd(x, w, layout.offsets, backend="triton")
    assert names == ["_grouped_rows_tma_kernel"]
    assert_close(out, want)
    monkeypatch.setattr(fwd_gm, "tma_capable", lambda t: False)
    del names[:]
    out = fwd_gm.grouped_mm_fwd(x, w, layout.offsets, backend="triton")
    assert names == ["_grouped_rows_kernel"]
    assert_close(out, want)


# ------------------------------------------------- warp-specialized FP8 rows kernel

from linghe.fwd import grouped_mm_ws as ws_mod  # noqa: E402


@pytest.mark.skipif(ws_mod.gluon is None, reason="needs Gluon (triton >= 3.5)")
def test_ws_descriptor_kept_for_weights():
    """The warp-specialized launches' descriptors: a weight's (``reuse``) is built once
    and handed out again for the same shape, strides and box (a new one for another box
    or after its storage changed); an activation's is not kept; a kept descriptor
    addresses the weight's memory without keeping the weight alive. Built on the CPU (no
    launch): what ``_tma_operands(make=ws_descriptor)`` returns on the GPU."""
    import gc
    import weakref

    w = torch.zeros(3 * 128, 256, dtype=torch.bfloat16)
    a = torch.zeros(64, 256, dtype=torch.bfloat16)
    ops = fwd_gm._tma_operands(a, w, 256, 128, 3, 128 * 256, 1, 256, 64, 128, 64,
                               make=ws_mod.ws_descriptor)
    again = fwd_gm._tma_operands(a, w, 256, 128, 3, 128 * 256, 1, 256, 64, 128, 64,
                                 make=ws_mod.ws_descriptor)
    assert again[1] is ops[1] and again[0] is not ops[0]
    assert ops[1].base.data_ptr() == w.data_ptr() and ops[1].base is not w
    assert ops[1].shape == [3 * 128, 256] and ops[1].block_shape == [128, 64]
    assert ops[0].base is a and not hasattr(a, "_linghe_ws_desc")
    other = ws_mod.ws_descriptor(w, [3 * 128, 256], [256, 1], [64, 64], reuse=True)
    assert other is not ops[1] and other.block_shape == [64, 64]
    # both boxes are kept (the forward's and the dgrad's may differ)
    assert ws_mod.ws_descriptor(w, [3 * 128, 256], [256, 1], [128, 64], reuse=True) is ops[1]
    w.data = torch.ones_like(w)  # a new storage: the kept descriptor no longer fits
    fresh = ws_mod.ws_descriptor(w, [3 * 128, 256], [256, 1], [64, 64], reuse=True)
    assert fresh is not other and fresh.base.data_ptr() == w.data_ptr()
    ref_w = weakref.ref(w)
    del w, ops, again, other, fresh
    gc.collect()
    assert ref_w() is None
    # a Parameter's (whose storage module.to() replaces) is not kept
    p = torch.nn.Parameter(torch.zeros(128, 256, dtype=torch.bfloat16))
    d = ws_mod.ws_descriptor(p, [128, 256], [256, 1], [64, 64], reuse=True)
    assert d.base is p and not hasattr(p, "_linghe_ws_desc")


WS_CASES = [
    # (counts, align, K, N, tail): the forward contracts K into N, the dgrad N into K
    ([0, 37, 300, 0, 129, 1, 64], 16, 384, 256, 0),  # zero-row experts, partial tiles
    ([5, 0, 140], 16, 256, 384, 50),                  # N = 384: half of a 256-column tile
    ([700], 16, 128, 128, 9),                         # one expert, several row tiles, K = 128
    ([3, 0, 0], 16, 1024, 256, 130),                  # mostly tail (zero tiles past offsets[E])
    # 300 experts, nearly all without rows: the in-kernel schedule over EP2 = 512 slots
    ([0] * 150 + [70] + [0] * 120 + [200] + [0] * 28, 16, 256, 128, 3),
]


def _ws_operands(case, device):
    counts, align, K, N, tail = case
    x, layout, real = make_rows(counts, align, K, device, torch.bfloat16, tail=tail)
    w = (torch.randn(len(counts), N, K, device=device) / 11).to(torch.bfloat16)
    dy = torch.randn(x.shape[0], N, device=device).to(torch.bfloat16)
    dy[~real] = 0
    return (linghe.quantize_1x128(x, pow2_scale=True),
            linghe.quantize_grouped_weight(w, columnwise=True, pow2_scale=True),
            linghe.quantize_1x128(dy), layout)


def _ws_wgrad_operands(counts, K, N, tail, device):
    """The wgrad's segment-group columnwise copies of ``g [R, N]`` and ``x [R, K]``
    (rows grouped by ``counts``, aligned to 16; padding and tail rows zero)."""
    x, layout, real = make_rows(counts, 16, K, device, torch.bfloat16, tail=tail)
    g = torch.randn(x.shape[0], N, device=device).to(torch.bfloat16)
    g[~real] = 0
    qg = linghe.functional.grouped_mm.quantize_grouped_1x128
    return qg(g, layout, rowwise=False), qg(x, layout, rowwise=False), layout


@pytest.mark.gpu
@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: f"E{len(c[0])}-K{c[2]}-N{c[3]}")
@pytest.mark.parametrize("tiles", ws_mod.WS_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_fp8_ws_kernel_matches_triton(device, monkeypatch, case, tiles):
    """The warp-specialized FP8 rows kernel (sm_90) gives the Triton rows kernel's bits
    (same promotion arithmetic), forward and dgrad, at every tile shape it takes: zero-row
    experts, partial row and column tiles, tails that are all zeros, NaN-poisoned outputs."""
    if not ws_mod.ws_capable(torch.empty(1, device=device)):
        pytest.skip("needs an sm_90 GPU and Gluon")
    xq, wq, dyq, layout = _ws_operands(case, device)
    bm, bn = tiles
    ws = dict(BM=bm, BN=bn, num_warps=4, num_stages=3 if bn == 256 else 4, WS=True)
    tri = dict(BM=64, BN=128, num_warps=4, num_stages=3, WS=False)
    monkeypatch.setattr(linghe.utils, "_poison", True)  # (restored after the test)
    for run in (lambda c: fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets, config=c),
                lambda c: bwd_gm.grouped_mm_fp8_dgrad(dyq, wq, layout.offsets, config=c)):
        want = run(tri)
        got = run(ws)
        assert not got.isnan().any()
        assert torch.equal(got, want)
    # the WS kernel reads the row scales in their own strides: group-major ones too
    gm = lambda t: t.with_components(rowwise_scale=t.rowwise_scale.t().contiguous().t())
    assert torch.equal(fwd_gm.grouped_mm_fp8_fwd(gm(xq), wq, layout.offsets, config=ws),
                       fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets, config=tri))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [([0, 37, 300, 0, 129, 1, 64], 16, 384, 256, 0),
                                  ([5, 0, 140], 16, 256, 384, 48),
                                  ([700], 16, 128, 128, 16),
                                  ([0] * 200 + [90] + [0] * 99, 16, 256, 128, 16)],
                         ids=lambda c: f"E{len(c[0])}-K{c[2]}-N{c[3]}")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tma_store", [True, False])
@pytest.mark.parametrize("bkw", [128, 256])
def test_fp8_ws_wgrad_matches_triton(device, monkeypatch, case, out_dtype, tma_store, bkw):
    """The warp-specialized FP8 wgrad over segment groups gives the Triton wgrad's bits
    at both tiles (128x256: two sub-MMAs a consumer): partial last groups masked to their
    segment, zero-token experts (zeros), N and K tails (K = 384 at 256 columns: a tile
    half past K), a tail of rows past the segments, 300 experts (the first scale group
    summed over 512 slots). fp32 ``dW`` at 256 columns asked for the TMA store takes the
    register store (its store tiles would leave the ring under 3 stages)."""
    if not ws_mod.ws_capable(torch.empty(1, device=device)):
        pytest.skip("needs an sm_90 GPU and Gluon")
    counts, align, K, N, tail = case
    gs, xs, layout = _ws_wgrad_operands(counts, K, N, tail, device)
    assert ws_mod.wgrad_ws_operands_ok(gs.columnwise_data, xs.columnwise_data)
    tri = dict(BN=128, BK=128, num_warps=8, num_stages=4)
    want = bwd_gm.grouped_mm_fp8_wgrad(gs, xs, layout.offsets, out_dtype, segments=True,
                                       align=16, config=tri)
    monkeypatch.setattr(linghe.utils, "_poison", True)  # (restored after the test)
    for scales_tma in (False, True):
        got = bwd_gm.grouped_mm_fp8_wgrad(
            gs, xs, layout.offsets, out_dtype, segments=True, align=16,
            config=dict(WS=True, BKW=bkw, TMA_STORE=tma_store, SCALES_TMA=scales_tma))
        assert not got.isnan().any(), scales_tma
        assert torch.equal(got, want), scales_tma


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [1, 3])
def test_fp8_ws_persistent_tiles_and_tails(device, monkeypatch, sms):
    """Each program of the persistent warp-specialized kernels walks several tiles (the
    grid capped at ``sms`` programs: the operand ring's stages and phases, the tail
    tiles after the expert tiles, the wgrad's store buffer reused across tiles), with
    contraction and output tails that are not multiples of 128 and every output dtype,
    NaN-poisoned outputs; bit-equal to the Triton kernels. The wgrad's scale rows go by
    TMA where asked and their rows are 16-byte aligned, else (K = 98) by the loads."""
    if not ws_mod.ws_capable(torch.empty(1, device=device)):
        pytest.skip("needs an sm_90 GPU and Gluon")
    monkeypatch.setattr(ws_mod, "num_sms", lambda dev: sms)
    monkeypatch.setattr(linghe.utils, "_poison", True)
    scales_tma_runs = _spy_kwarg(monkeypatch, "SCALES_TMA")
    stores = _spy_kwarg(monkeypatch, "TMA_STORE", kernel_with="SPLIT_N")
    counts = [0, 37, 300, 0, 129, 1, 64]
    xq, wq, dyq, layout = _ws_operands((counts, 16, 336, 384, 21), device)
    tri = dict(BM=64, BN=128, num_warps=4, num_stages=3, WS=False)
    for bn in (128, 256):
        ws = dict(BM=128, BN=bn, num_warps=4, num_stages=3, WS=True)
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for run in (lambda c, dt=dt: fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets,
                                                                   dt, config=c),
                        lambda c, dt=dt: bwd_gm.grouped_mm_fp8_dgrad(dyq, wq, layout.offsets,
                                                                     dt, config=c)):
                assert torch.equal(run(ws), run(tri)), (bn, dt)
                # 16-bit outputs leave through the TMA-store epilogue, fp32 from registers
                assert stores.pop() is (dt != torch.float32), (bn, dt)
                if dt != torch.float32:  # the register stores give the same bits
                    with monkeypatch.context() as m:
                        m.setitem(ws_mod.WS_CONFIG, "TMA_STORE", False)
                        assert torch.equal(run(ws), run(tri)), (bn, dt)
                    assert stores.pop() is False, (bn, dt)
    # wgrad: N = 320 is not a multiple of its 128-row tiles (masked register stores);
    # N = 256 takes the TMA store, its buffers reused from tile to tile; K = 336
    tri_w = dict(BN=128, BK=128, num_warps=8, num_stages=4)
    for N in (320, 256):
        gs, xs, layout = _ws_wgrad_operands(counts, 336, N, 16, device)
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            want = bwd_gm.grouped_mm_fp8_wgrad(gs, xs, layout.offsets, dt, segments=True,
                                               align=16, config=tri_w)
            for bkw, scales_tma in ((128, False), (256, False), (256, True)):
                got = bwd_gm.grouped_mm_fp8_wgrad(
                    gs, xs, layout.offsets, dt, segments=True, align=16,
                    config=dict(WS=True, BKW=bkw, SCALES_TMA=scales_tma))
                assert torch.equal(got, want), (N, dt, bkw, scales_tma)
                assert scales_tma_runs.pop() == scales_tma, (N, dt, bkw)
    # K = 98: the transposed x scales' rows are 392 bytes (not 16-byte aligned), so the
    # default (scale TMA) falls back to the loads
    gs, xs, layout = _ws_wgrad_operands(counts, 98, 256, 16, device)
    want = bwd_gm.grouped_mm_fp8_wgrad(gs, xs, layout.offsets, torch.bfloat16,
                                       segments=True, align=16, config=tri_w)
    got = bwd_gm.grouped_mm_fp8_wgrad(gs, xs, layout.offsets, torch.bfloat16, segments=True,
                                      align=16, config=dict(WS=True, BKW=256))
    assert torch.equal(got, want) and scales_tma_runs.pop() is False


HP_WS_CASES = [
    # (counts, align, K, N, tail): the forward contracts K into N, the dgrad N into K
    ([0, 37, 300, 0, 129, 1, 64], 16, 384, 256, 0),  # zero-row experts, partial tiles
    ([5, 0, 140], 16, 200, 384, 50),                  # K = 200: a partial K step; N = 384
    ([700], 16, 64, 128, 9),                          # one expert, several row tiles
    ([3, 0, 0], 16, 1024, 320, 130),                  # mostly tail; N = 320 (column tail)
    ([0] * 150 + [70] + [0] * 120 + [200] + [0] * 28, 16, 256, 128, 3),  # EP2 = 512
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HP_WS_CASES, ids=lambda c: f"E{len(c[0])}-K{c[2]}-N{c[3]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sms", [None, 3])
def test_hp_ws_rows_matches_reference(device, monkeypatch, case, dtype, sms):
    """The warp-specialized bf16/fp16 rows kernel (sm_90; forward, and the dgrad through
    ``[BK, BN]`` weight boxes) against ``linghe.reference.grouped_mm`` and its gradient:
    zero-row experts, partial row, column and K tiles, tails of zeros, 300 experts,
    NaN-poisoned outputs; with the grid
    capped at 3 programs each walks many tiles. The launches are checked to be the WS
    kernel's."""
    if not ws_mod.ws_capable(torch.empty(1, device=device)):
        pytest.skip("needs an sm_90 GPU and Gluon")
    counts, align, K, N, tail = case
    names = _spy_launches(monkeypatch, ws_mod)
    if sms is not None:
        monkeypatch.setattr(ws_mod, "num_sms", lambda dev: sms)
    monkeypatch.setattr(linghe.utils, "_poison", True)
    x, layout, real = make_rows(counts, align, K, device, dtype, tail=tail)
    w = (torch.randn(len(counts), N, K, device=device) / K ** 0.5).to(dtype)
    dy = torch.randn(x.shape[0], N, device=device).to(dtype)
    tail = int(layout.offsets[-1])
    ref_out, ref_dx, _ = ref_grads(x, w, layout.offsets, dy)  # linghe.reference, float64
    stores = _spy_kwarg(monkeypatch, "TMA_STORE", kernel_with="SPLIT_N")

    def run(direction):
        if direction == "fwd":
            return fwd_gm.grouped_mm_fwd(x, w, layout.offsets, backend="triton")
        return bwd_gm.grouped_mm_dgrad(dy, w, layout.offsets, backend="triton")

    for direction, want in (("fwd", ref_out), ("dgrad", ref_dx)):
        del names[:]
        got = run(direction)
        assert names == ["_hp_rows_ws_kernel"], (direction, names)
        assert not got.isnan().any(), direction
        assert torch.all(got[tail:] == 0), direction
        assert_close(got, want, tol=1e-2, name=direction)
        # the TMA-store epilogue (default) and the register stores: the same bits
        assert stores.pop() is True, direction
        with monkeypatch.context() as m:
            m.setitem(ws_mod.HP_WS_CONFIG, "TMA_STORE", False)
            assert torch.equal(run(direction), got), direction
        assert stores.pop() is False, direction


def _spy_kwarg(monkeypatch, key: str, kernel_with: str | None = None) -> list:
    """Record the launch argument ``key`` of each launch of ``linghe.fwd.grouped_mm_ws``
    that passes it (and, ``kernel_with``, that argument too: ``"SPLIT_N"`` picks the rows
    kernels, not the wgrads), on top of any spy already there."""
    seen = []
    real = ws_mod.launch

    def spy(kernel, grid, *args, **kwargs):
        if key in kwargs and (kernel_with is None or kernel_with in kwargs):
            seen.append(kwargs[key])
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(ws_mod, "launch", spy)
    return seen


def test_ws_store_descriptor_falls_back_to_register_stores():
    """The rows kernels' TMA-store epilogue is taken only where TMA can write the output
    and its buffers fit beside the operand ring: fp32 outputs, rows that are not 16-byte
    aligned, the knob off and buffers that do not fit beside the ring (FP8 128x256 at 4
    stages: 192 KiB + 64 KiB of buffers for both parts) get the register stores (no
    descriptor)."""
    if ws_mod.gluon is None:
        pytest.skip("needs Gluon")
    # (a consumer warpgroup's part: half the rows of a 128-row tile, half the columns of
    # a 64-row one)
    assert ws_mod._consumer_part(dict(BM=128, BN=256)) == (64, 256)
    assert ws_mod._consumer_part(dict(BM=64, BN=256)) == (64, 128)
    cfg = dict(ws_mod.WS_CONFIG, BN=256, STAGES=3)
    ring = lambda c: c["STAGES"] * (c["BM"] + c["BN"]) * 128
    out = torch.empty(64, 256, dtype=torch.bfloat16)
    # (the default tiles fit: 144 KiB + 64 KiB)
    assert ring(cfg) + cfg["BM"] * cfg["BN"] * 2 <= ws_mod._SMEM_BYTES
    for c, o in ((dict(cfg, STAGES=4), out), (dict(cfg, TMA_STORE=False), out),
                 (cfg, out.float()), (cfg, torch.empty(64, 260, dtype=torch.bfloat16)[:, :257])):
        assert ws_mod._store_descriptor(o, 64, 256, (64, 128), c, ring(c),
                                        c["BM"] * c["BN"]) is None


def test_fp8_ws_launch_store_buffers(monkeypatch):
    """The FP8 rows launcher's TMA-store buffers (the kernel is not run: launch stubbed):
    a consumer gets one per 128-column part where they fit beside the ring (128x128 at 4
    stages, 128x256 at 3: two), else one for both (128x256 at 4 stages, the default
    there: ``ws_config``), which fits; fp32 outputs store from registers."""
    if ws_mod.gluon is None:
        pytest.skip("needs Gluon")
    seen = []
    monkeypatch.setattr(ws_mod, "launch", lambda kernel, grid, *a, **kw: seen.append(kw))
    R, I, J, E = 256, 256, 512, 2
    offsets = torch.tensor([0, 100, 256], dtype=torch.int32)
    a = torch.zeros(R, I, dtype=torch.float8_e4m3fn)
    b = torch.zeros(E * J, I, dtype=torch.float8_e4m3fn)
    assert ws_mod.ws_config(R, E, I, J)["STAGES"] == 4  # (128x256 here)
    for (bn, stages), want in (((128, 4), 1), ((256, 3), 2), ((256, 4), 1)):
        cfg = dict(ws_mod.WS_CONFIG, BN=bn, STAGES=stages)
        ops = (ws_mod.ws_descriptor(a, [R, I], [I, 1], [128, 128]),
               ws_mod.ws_descriptor(b, [E * J, I], [I, 1], [bn, 128]), J, 0)
        for out, tma_store in ((torch.empty(R, J, dtype=torch.bfloat16), True),
                               (torch.empty(R, J), False)):
            ws_mod.launch_fp8_rows_ws(ops, out, torch.ones(R, 2), torch.ones(E, 2, 4),
                                      offsets, (8, 4, 1), cfg)
            kw = seen.pop()
            assert (kw["STAGES"], kw["TMA_STORE"]) == (stages, tma_store), (bn, stages)
            if tma_store:
                assert kw["STORE_BUFS"] == want, (bn, stages)
                ring = stages * (128 + bn) * 128
                assert ring + want * 2 * 64 * 128 * 2 <= ws_mod._SMEM_BYTES


def test_hp_ws_dispatch(device, monkeypatch):
    """The bf16/fp16 rows GEMMs take the warp-specialized kernel only where it runs and
    TMA can describe the operands (``LINGHE_HP_WS=0`` turns it off); elsewhere the Triton
    kernels, with the same results within rounding (the documented fallback)."""
    names = _spy_launches(monkeypatch)
    x, layout, real = make_rows([5, 0, 40], 16, 64, device, torch.bfloat16)
    w = (torch.randn(3, 48, 64, device=device) / 8).to(torch.bfloat16)
    # (sm_90 with Gluon pretended: the preference itself; N-major dgrad weights need N a
    # multiple of BK = 64, and float32 never takes it)
    monkeypatch.setattr(fwd_gm, "ws_capable", lambda t: True)
    assert fwd_gm.hp_ws_preferred(x) and fwd_gm.hp_ws_preferred(x, 128)
    assert not fwd_gm.hp_ws_preferred(x, 72)
    assert not fwd_gm.hp_ws_preferred(x.float())
    monkeypatch.setattr(fwd_gm, "ws_capable", lambda t: False)
    assert not fwd_gm.hp_ws_preferred(x)
    want = fwd_gm.grouped_mm_fwd(x, w, layout.offsets, backend="triton")
    assert "_hp_rows_ws_kernel" not in names and names  # a Triton kernel ran
    monkeypatch.setattr(fwd_gm, "HP_WS", False)
    monkeypatch.setattr(fwd_gm, "ws_capable", lambda t: True)
    assert not fwd_gm.hp_ws_preferred(x)
    monkeypatch.setattr(fwd_gm, "ws_capable", lambda t: False)
    del names[:]
    got = fwd_gm.grouped_mm_fwd(x, w, layout.offsets, backend="triton")
    assert "_hp_rows_ws_kernel" not in names
    assert torch.equal(got, want)
    # a config it cannot run is refused before anything is launched
    for bad in (dict(STAGES=1), dict(BM=64, BN=128), dict(BK=32)):
        with pytest.raises(ValueError, match="warp-specialized"):
            ws_mod.launch_hp_rows_ws(None, None, None, False, bad)


@pytest.mark.gpu
def test_hp_ws_is_the_auto_choice_on_sm90(device, monkeypatch):
    """On sm_90 ``linghe.grouped_mm(backend="auto")`` on bf16 runs its forward, dgrad and
    wgrad on the warp-specialized kernels; a weight whose ``N`` is no multiple of 64 (the
    dgrad could not read it by TMA) keeps torch's kernels for all three. Results against
    the float64 reference."""
    if not ws_mod.ws_capable(torch.empty(1, device=device)):
        pytest.skip("needs an sm_90 GPU and Gluon")
    names = _spy_launches(monkeypatch, ws_mod)
    x, layout, real = make_rows([9, 0, 150, 33], 16, 128, device, torch.bfloat16)
    want_ws = ["_hp_rows_ws_kernel", "_hp_rows_ws_kernel", "_hp_wgrad_ws_kernel"]
    for N, want_names in ((128, want_ws), (72, [])):
        w = (torch.randn(4, N, 128, device=device) / 11).to(torch.bfloat16).requires_grad_()
        xi = x.clone().requires_grad_()
        g = torch.randn(x.shape[0], N, device=device, dtype=torch.bfloat16)
        del names[:]
        out = linghe.grouped_mm(xi, w, layout)
        out.backward(g)
        assert names == want_names, (N, names)
        r, dx, dw = ref_grads(x, w, layout.offsets, g)
        assert_close(out, r, name=f"out N={N}")
        assert_close(xi.grad, dx, name=f"d_rows N={N}")
        assert_close(w.grad, dw, name=f"d_weight N={N}")


def test_fp8_ws_dispatch(device, monkeypatch):
    """Where the warp-specialized kernel cannot run (CPU interpreter, other GPUs, no
    Gluon), a launch that asks for it gets the Triton rows kernel, same result (the
    documented fallback); tile choice by shape; invalid WS tiles are refused."""
    names = _spy_launches(monkeypatch)
    # zero-row experts, partial row tiles, one 256-column tile (the dispatch, not the
    # kernels' math, is what is checked: test_fp8_ws_kernel_matches_triton has WS_CASES)
    xq, wq, dyq, layout = _ws_operands(([0, 37, 130, 0, 1], 16, 128, 256, 5), device)
    monkeypatch.setattr(fwd_gm, "ws_capable", lambda t: False)
    ws = dict(BM=128, BN=256, num_warps=4, num_stages=3, WS=True)
    tri = dict(BM=64, BN=128, num_warps=4, num_stages=3, WS=False)
    out = fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets, config=ws)
    assert "_grouped_rows_tma_kernel" in names
    assert torch.equal(out, fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets, config=tri))
    with pytest.raises(ValueError, match="warp-specialized"):
        fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets, config=dict(ws, BN=64))
    with pytest.raises(ValueError, match="warp-specialized"):
        fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets, config=dict(ws, RESCALE=True))
    qg = linghe.functional.grouped_mm.quantize_grouped_1x128
    x, layout2, _ = make_rows([5, 0, 40], 16, 128, device, torch.bfloat16, tail=0)
    xs = qg(x, layout2, rowwise=False)
    wg = bwd_gm.grouped_mm_fp8_wgrad(xs, xs, layout2.offsets, segments=True, align=16,
                                     config=dict(WS=True))
    assert torch.equal(wg, bwd_gm.grouped_mm_fp8_wgrad(xs, xs, layout2.offsets, segments=True,
                                                       align=16))
    # a WS config whose kernel cannot run gets the Triton kernel at its own tiles (no
    # WS-only keys reach it)
    del names[:]
    out = fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets, config=dict(ws, MAXNREG=160))
    assert names == ["_grouped_rows_tma_kernel"]
    assert torch.equal(out, fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets))
    # where it can run: the default takes it, not with FP8_RESCALE or a pinned block_m
    rows_calls, wgrad_calls = [], []
    monkeypatch.setattr(fwd_gm, "ws_capable", lambda t: True)
    monkeypatch.setattr(fwd_gm, "launch_fp8_rows_ws",
                        lambda ops, out, *a: rows_calls.append(a[-1]) or out)
    monkeypatch.setattr(bwd_gm, "launch_fp8_wgrad_ws",
                        lambda gq, xq, gs, xs, dw, off, cfg: wgrad_calls.append(cfg) or dw)
    fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets)
    assert len(rows_calls) == 1 and rows_calls[0]["BM"] == 128
    fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets, block_m=64)
    bwd_gm.grouped_mm_fp8_wgrad(xs, xs, layout2.offsets, segments=True, align=16)
    assert len(rows_calls) == 1 and len(wgrad_calls) == 1
    monkeypatch.setattr(fwd_gm, "FP8_RESCALE", True)
    fwd_gm.grouped_mm_fp8_fwd(xq, wq, layout.offsets)
    bwd_gm.grouped_mm_fp8_wgrad(xs, xs, layout2.offsets, segments=True, align=16)
    assert len(rows_calls) == 1 and len(wgrad_calls) == 1
    monkeypatch.setattr(fwd_gm, "FP8_RESCALE", False)
    with pytest.raises(ValueError, match="warp-specialized"):
        ws_mod.launch_fp8_wgrad_ws(xs.columnwise_data, xs.columnwise_data, None, None, None,
                                   layout2.offsets, dict(BNW=64))
    # the wgrad's settings: 256 columns by default with that width's registers and scale
    # load, 128 where K <= 128 (and its own settings), validated
    cfg = ws_mod.wgrad_ws_config(2048)
    assert (cfg["BKW"], cfg["SX_DIRECT"], cfg["SCALES_TMA"], cfg["CONSUMER_REGS"]) == (
        256, False, True, 240)
    cfg = ws_mod.wgrad_ws_config(96)
    assert (cfg["BKW"], cfg["SX_DIRECT"], cfg["SCALES_TMA"], cfg["CONSUMER_REGS"]) == (
        128, True, False, 232)
    assert ws_mod.wgrad_ws_config(2048, dict(BKW=128))["LOADER_REGS"] == 40
    for bad in (dict(CONSUMER_REGS=250), dict(LOADER_REGS=16), dict(STAGES=0),
                dict(BKW=64), dict(NOPE=1)):
        with pytest.raises(ValueError, match="warp-specialized"):
            ws_mod.wgrad_ws_config(2048, bad)
    # 256 experts' gate_up forward keeps 128-column tiles, everything else takes 256
    assert ws_mod.ws_config(69632, 256, 2048, 2048)["BN"] == 128
    assert ws_mod.ws_config(69632, 256, 1024, 2048)["BN"] == 256
    assert ws_mod.ws_config(65536, 32, 2048, 2048)["BN"] == 256
    for bm, bn in ws_mod.WS_TILES:
        assert bm in (64, 128) and bn in (128, 256)


_WS_COMPILE_SCRIPT = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from linghe.fwd import grouped_mm_ws as W


def sm90(fn, sig, const, maxnreg):
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=maxnreg))


lay = lambda r, c, dt: repr(gl.NVMMASharedLayout.get_default_for([r, c], dt))
STORE = "cp.async.bulk.tensor.2d.global.shared"


def barrier_after_store_wait(ptx, what):
    # A TMA store's wait holds only the threads that issued it: a barrier must come
    # before any thread of the warpgroup writes the store buffers again (Triton puts it).
    lines = [t.strip() for t in ptx.splitlines()]
    for i, t in enumerate(lines):
        if t.startswith("cp.async.bulk.wait_group.read"):
            for u in lines[i + 1:]:
                if u.startswith(("bar.sync", "barrier.sync")):
                    break
                assert not u.startswith(("stmatrix", "st.shared")), (what, u)


for bm, bn, stages, ep2, tma_store, bufs in (
        [(*t, 256, True, 2) for t in W.WS_TILES_STAGES]
        + [(128, 256, 3, 512, True, 2), (128, 256, 3, 256, False, 2), (64, 128, 5, 256, False, 2),
           # the default 128x256 tiles: a fourth stage beside one store buffer a consumer
           (128, 256, 4, 256, True, 1), (128, 256, 4, 256, False, 1)]):
    # the TMA-store epilogue's boxes: a consumer's part of the tile, 128 columns at most
    wm, wn = W._consumer_part(dict(BM=bm, BN=bn))
    cbox = (wm, min(wn, 128))
    sig = dict(a_desc=f"tensordesc<fp8e4nv[{bm}, 128],{lay(bm, 128, gl.float8e4nv)}>",
               b_desc=f"tensordesc<fp8e4nv[{bn}, 128],{lay(bn, 128, gl.float8e4nv)}>",
               c_ptr="*bf16", c_desc=f"tensordesc<bf16[{cbox[0]}, {cbox[1]}],"
                                     f"{lay(*cbox, gl.bfloat16)}>",
               as_ptr="*fp32", bs_ptr="*fp32", offsets_ptr="*i32",
               R="i32", I="i32", J="i32", E="i32", b_row_e="i32", b_col_e="i32",
               stride_cm="i32", stride_asr="i32", stride_ask="i32", bs_se="i32",
               bs_si="i32", bs_sj="i32",
               BM="constexpr", BN="constexpr", BK="constexpr", GROUP_M="constexpr",
               STAGES="constexpr", SPLIT_N="constexpr", EP2="constexpr",
               TMA_STORE="constexpr", STORE_BUFS="constexpr", CONSUMER_REGS="constexpr",
               num_warps="constexpr")
    const = dict(BM=bm, BN=bn, BK=128, GROUP_M=8, STAGES=stages, SPLIT_N=bm == 64,
                 EP2=ep2, TMA_STORE=tma_store, STORE_BUFS=bufs, CONSUMER_REGS=232,
                 num_warps=4)
    k = sm90(W._fp8_rows_ws_kernel, sig, const, W.WS_CONFIG["MAXNREG"])
    ptx = k.asm["ptx"]
    # TMA loads into wgmma, warp specialization with register reallocation, and the
    # promotion waiting for each step's MMA (no accumulator carried across steps in flight)
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx, (bm, bn)
    assert "setmaxnreg" in ptx and "mbarrier.try_wait" in ptx, (bm, bn)
    assert "wgmma.wait_group.sync.aligned 0" in ptx, (bm, bn)
    assert k.metadata.shared >= stages * (bm + bn) * 128, (bm, bn)
    # the TMA stores exactly when asked for: each consumer's 128-column parts; the ring
    # and the store buffers fit sm_90's 227 KiB of shared memory
    assert ptx.count(STORE) == tma_store * 2 * (wn // cbox[1]), (bm, bn, tma_store)
    assert k.metadata.shared <= 227 << 10, (bm, bn, k.metadata.shared)
    barrier_after_store_wait(ptx, (bm, bn))
# the bf16 rows kernel: weight boxes K-major (forward) and N-major (dgrad), 128- and
# 64-row tiles; one wgmma group in flight, no spilled accumulator
for bm, bn, nmajor, tma_store in ((128, 256, False, True), (128, 256, True, True),
                                 (64, 256, True, True), (128, 256, True, False)):
    hl = lambda r, c: lay(r, c, gl.bfloat16)
    box_b = [64, bn] if nmajor else [bn, 64]
    cbox = W._consumer_part(dict(BM=bm, BN=bn))  # a consumer's whole part
    sig = dict(a_desc=f"tensordesc<bf16[{bm}, 64],{hl(bm, 64)}>",
               b_desc=f"tensordesc<bf16[{box_b[0]}, {box_b[1]}],{hl(*box_b)}>",
               c_ptr="*bf16", c_desc=f"tensordesc<bf16[{cbox[0]}, {cbox[1]}],{hl(*cbox)}>",
               offsets_ptr="*i32", R="i32", I="i32", J="i32", E="i32",
               b_row_e="i32", b_col_e="i32", stride_cm="i32",
               BM="constexpr", BN="constexpr", BK="constexpr", GROUP_M="constexpr",
               STAGES="constexpr", SPLIT_N="constexpr", EP2="constexpr",
               B_NMAJOR="constexpr", TMA_STORE="constexpr", CONSUMER_REGS="constexpr",
               num_warps="constexpr")
    const = dict(BM=bm, BN=bn, BK=64, GROUP_M=8, STAGES=3, SPLIT_N=bm == 64, EP2=256,
                 B_NMAJOR=nmajor, TMA_STORE=tma_store, CONSUMER_REGS=232, num_warps=4)
    k = sm90(W._hp_rows_ws_kernel, sig, const, W.HP_WS_CONFIG["MAXNREG"])
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n" in ptx and ".bf16.bf16" in ptx, (bm, nmajor)
    assert "wgmma.wait_group.sync.aligned 1" in ptx, (bm, nmajor)
    assert ptx.count(STORE) == 2 * tma_store, (bm, nmajor, tma_store)
    assert k.metadata.shared <= 227 << 10, (bm, nmajor, k.metadata.shared)
    barrier_after_store_wait(ptx, (bm, nmajor))
# the wgrad, with the TMA-store epilogue (bf16 and fp32 dW) and without, at both tiles
for out, dt, tma_store, bkw in (("bf16", gl.bfloat16, True, 128),
                                ("fp32", gl.float32, True, 128),
                                ("bf16", gl.bfloat16, False, 128),
                                ("bf16", gl.bfloat16, True, 256),
                                ("fp32", gl.float32, False, 256)):
    wd = (f"tensordesc<{out}[64, 128],{lay(64, 128, dt)}>" if tma_store
          else f"tensordesc<fp8e4nv[128, 128],{lay(128, 128, gl.float8e4nv)}>")
    sl = repr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    sig = dict(g_desc=f"tensordesc<fp8e4nv[128, 128],{lay(128, 128, gl.float8e4nv)}>",
               x_desc=f"tensordesc<fp8e4nv[{bkw}, 128],{lay(bkw, 128, gl.float8e4nv)}>",
               gs_desc=f"tensordesc<fp32[1, 128],{sl}>",
               xs_desc=f"tensordesc<fp32[1, {bkw}],{sl}>",
               w_ptr=f"*{out}", w_desc=wd, gs_ptr="*fp32", xs_ptr="*fp32",
               offsets_ptr="*i32", N="i32", K="i32", R="i32", E="i32",
               stride_gs="i32", stride_xs="i32", stride_we="i32", stride_wn="i32",
               BNW="constexpr", BKW="constexpr", STAGES="constexpr", TMA_STORE="constexpr",
               SX_DIRECT="constexpr", SCALES_TMA="constexpr", EP2="constexpr",
               CONSUMER_REGS="constexpr", LOADER_REGS="constexpr", num_warps="constexpr")
    # (the scale rows by TMA in the TMA-store cases at 256 columns; the register-store
    # cases load the column scales directly, SX_DIRECT)
    scales_tma = tma_store and bkw == 256
    stages = W._wgrad_stages(5, 128, bkw, 4 if out == "fp32" else 2, tma_store, scales_tma)
    const = dict(BNW=128, BKW=bkw, STAGES=stages, TMA_STORE=tma_store,
                 SX_DIRECT=not tma_store, SCALES_TMA=scales_tma, EP2=256,
                 CONSUMER_REGS=240, LOADER_REGS=24, num_warps=4)
    k = sm90(W._fp8_wgrad_ws_kernel, sig, const, W.WGRAD_WS_CONFIG["MAXNREG"])
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx, (out, tma_store, bkw)
    # TMA loads (the loader's two boxes, and the two scale rows with SCALES_TMA); the TMA
    # store exactly when asked for: one a 128-column sub-tile in each consumer warpgroup
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared")
    assert ptx.count("cp.async.bulk.tensor") - stores == 2 + 2 * scales_tma, (out, bkw)
    assert stores == 2 * tma_store * (bkw // 128), (out, tma_store, bkw, stores)
    barrier_after_store_wait(ptx, (out, bkw))
    # the ring and the epilogue's tiles fit sm_90's 227 KiB of shared memory
    assert k.metadata.shared <= 227 << 10, (out, tma_store, bkw, k.metadata.shared)
# the 16-bit wgrad over 1-4 operand pairs: TMA-store epilogue (fresh and accumulating, with
# the squares), register epilogues (bf16, fp32 dW), both tile widths, both step sizes, at
# the ring depth the launcher picks; one 64xBKW wgmma chain a consumer, one in flight
for out, bkw, bt, parts, acc, sq, tma_store in (
        ("bf16", 256, 32, 1, False, False, True), ("bf16", 256, 32, 4, True, True, True),
        ("bf16", 256, 64, 3, False, True, False), ("bf16", 256, 32, 2, True, False, False),
        ("fp32", 256, 32, 2, True, True, False),
        ("bf16", 128, 32, 4, False, False, True)):
    cfg = W.hp_wgrad_ws_config(2048 if bkw == 256 else 96, dict(BT=bt))
    stages = W._hp_wgrad_stages(cfg, 2, 4 if out == "fp32" else 2)
    sig = {}
    for p in range(4):
        sig.update({f"g{p}": f"tensordesc<bf16[{bt}, 128],{lay(bt, 128, gl.bfloat16)}>",
                    f"x{p}": f"tensordesc<bf16[{bt}, {bkw}],{lay(bt, bkw, gl.bfloat16)}>",
                    f"o{p}": "*i32", f"R{p}": "i32"})
    sig.update(w_ptr=f"*{out}", sq_ptr="*fp32", N="i32", K="i32", E="i32",
               stride_we="i32", stride_wn="i32")
    sig["w_desc"] = (f"tensordesc<bf16[64, {bkw}],{lay(64, bkw, gl.bfloat16)}>" if tma_store
                     else sig["g0"])
    sig = {k: sig[k] for k in [f"{n}{p}" for p in range(4) for n in "gxoR"]
           + ["w_ptr", "w_desc", "sq_ptr", "N", "K", "E", "stride_we", "stride_wn"]}
    const = dict(BNW=128, BKW=bkw, BT=bt, STAGES=stages, PARTS=parts, ACCUMULATE=acc,
                 SQ=sq, TMA_STORE=tma_store, CONSUMER_REGS=232, num_warps=4)
    sig.update({c: "constexpr" for c in const})
    k = sm90(W._hp_wgrad_ws_kernel, sig, const, W.HP_WGRAD_WS_CONFIG["MAXNREG"])
    ptx = k.asm["ptx"]
    case = (out, bkw, bt, parts, acc, tma_store)
    assert f"wgmma.mma_async.sync.aligned.m64n{bkw}k16" in ptx, case
    assert "wgmma.wait_group.sync.aligned 1" in ptx and "setmaxnreg" in ptx, case
    # (TMA copies of boxes wider than the 128-byte swizzle are split into several)
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == tma_store, case
    assert k.metadata.shared <= 227 << 10, (case, k.metadata.shared)
print("COMPILED")
'''


def test_fp8_ws_kernel_compiles_for_sm90(compile_sm90):
    """The warp-specialized FP8 rows kernel (every tile shape; the schedule over 256 and
    512 expert slots) and wgrad (both tile widths, both epilogues), and the 16-bit rows
    kernel and wgrad (its epilogues, 1-4 parts), compiled for sm_90
    with this triton (Gluon's API moves between triton
    versions: this catches it on CPU)."""
    compile_sm90(_WS_COMPILE_SCRIPT)


# --------------------------------------------------------- bf16/fp16 TMA wgrad kernel

TMA_WGRAD_CASES = [
    # (counts, align, K, N, tail rows): dW [E, N, K] = d_out_e^T @ rows_e
    ([5, 0, 70], 16, 200, 96, 7),       # zero-row expert; K tail past the column boxes
    ([0, 0, 70, 0], 1, 24, 64, 0),      # one odd segment ending at R (TMA zero fill past R)
    ([33, 64, 0, 9], 8, 64, 136, 3),    # 8-aligned segments (masked 16-row box); N tail
    ([9, 31, 1, 0, 17], 1, 48, 40, 5),  # align 1: every kind of partial box
]


def _tma_wgrad_cfg(device, tail):
    if device == "cuda":
        return dict(BN=128, BK=128, BR=64, num_warps=8, num_stages=3, TAIL=tail)
    return dict(BN=32, BK=32, BR=32, num_warps=4, num_stages=1, TAIL=tail)


@pytest.mark.gpu_subset(dtype=[torch.bfloat16])
@pytest.mark.gpu_subset(dtype=[torch.float16], case=[TMA_WGRAD_CASES[3]])
@pytest.mark.parametrize("tail", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", TMA_WGRAD_CASES,
                         ids=lambda c: f"E{len(c[0])}-a{c[1]}-K{c[2]}-N{c[3]}-t{c[4]}")
def test_wgrad_tma_kernel(device, case, dtype, tail):
    """The TMA wgrad (``launch_wgrad_tma``) against the float64 reference's weight
    gradient: fp32 and the operands' dtype out (NaN-filled first), zero-row experts
    (zeros), segments not aligned to the boxes (the next expert's rows masked), rows
    past ``offsets[E]`` (non-zero ``d_out`` there, ignored), K/N tails; every ``TAIL``
    form; ``accumulate=True`` adds to an existing ``dW`` (fp32 and the operands'
    dtype)."""
    counts, align, K, N, tail_rows = case
    E = len(counts)
    x, layout, real = make_rows(counts, align, K, device, dtype, tail=tail_rows)
    R = x.shape[0]
    w = (torch.randn(E, N, K, device=device) / K**0.5).to(dtype)
    g = torch.randn(R, N, device=device, dtype=dtype)  # non-zero in padding and tail rows
    off = layout.offsets
    _, _, r_dw = ref_grads(x, w, off, g)
    cfg = _tma_wgrad_cfg(device, tail)
    for out_dtype, tol in ((torch.float32, 1e-5), (dtype, None)):
        dw = torch.full((E, N, K), float("nan"), device=device, dtype=out_dtype)
        got = bwd_gm.launch_wgrad_tma(g, x, dw, off, config=cfg)
        assert got is dw
        assert_close(dw, r_dw, tol=tol, name=f"dW {out_dtype}")
        for e in range(E):
            if off[e] == off[e + 1]:
                assert torch.all(dw[e] == 0), f"expert {e} has no rows: zeros"
        base = torch.randn(E, N, K, device=device).to(out_dtype)
        dw = base.clone()
        bwd_gm.launch_wgrad_tma(g, x, dw, off, accumulate=True, config=cfg)
        assert_close(dw, base.double() + r_dw, tol=tol, name=f"accumulated dW {out_dtype}")
    # the default tiles
    dw = bwd_gm.launch_wgrad_tma(g, x, torch.full((E, N, K), float("nan"), device=device),
                                 off)
    assert_close(dw, r_dw, tol=1e-5, name="dW default tiles")


def test_wgrad_tma_limits_and_routing(device, monkeypatch):
    """What ``launch_wgrad_tma`` refuses (ValueError: operands TMA cannot describe, wrong
    dtypes, bad configs), an empty buffer (zeros, or ``dW`` unchanged when accumulating),
    and ``WGRAD_TMA`` (``LINGHE_WGRAD_TMA=1``) routing ``grouped_mm_wgrad``'s bf16/fp16
    launches to it, with the pointer kernel for operands it cannot describe."""
    x, layout, real = make_rows([7, 0, 20], 8, 32, device, torch.bfloat16)
    off = layout.offsets
    R = x.shape[0]
    g = torch.randn(R, 16, device=device, dtype=torch.bfloat16)
    dw = torch.empty(3, 16, 32, device=device)
    with pytest.raises(ValueError, match="16-byte aligned"):
        bwd_gm.launch_wgrad_tma(g, torch.zeros(R, 33, device=device, dtype=torch.bfloat16),
                                torch.empty(3, 16, 33, device=device), off)
    with pytest.raises(ValueError, match="16-byte aligned"):
        bwd_gm.launch_wgrad_tma(g, x[:, 1:], torch.empty(3, 16, 31, device=device), off)
    with pytest.raises(ValueError, match="bf16/fp16 operands"):
        bwd_gm.launch_wgrad_tma(g.float(), x.float(), dw, off)
    with pytest.raises(ValueError, match="contiguous dW"):
        bwd_gm.launch_wgrad_tma(g, x, torch.empty(3, 32, 16, device=device).transpose(1, 2),
                                off)
    with pytest.raises(ValueError, match="does not match"):
        bwd_gm.launch_wgrad_tma(g, x, torch.empty(3, 16, 16, device=device), off)
    with pytest.raises(ValueError, match="unknown keys"):
        bwd_gm.launch_wgrad_tma(g, x, dw, off, config=dict(BM=64))
    with pytest.raises(ValueError, match="power of two"):
        bwd_gm.launch_wgrad_tma(g, x, dw, off, config=dict(BR=48))
    with pytest.raises(ValueError, match="TAIL"):
        bwd_gm.launch_wgrad_tma(g, x, dw, off, config=dict(TAIL=3))
    empty_off = torch.zeros(4, dtype=torch.int32, device=device)
    e0 = torch.empty(0, 16, device=device, dtype=torch.bfloat16)
    e1 = torch.empty(0, 32, device=device, dtype=torch.bfloat16)
    assert torch.all(bwd_gm.launch_wgrad_tma(e0, e1, dw.fill_(float("nan")), empty_off) == 0)
    assert torch.all(bwd_gm.launch_wgrad_tma(e0, e1, dw.fill_(2.0), empty_off,
                                             accumulate=True) == 2)
    # routing (LINGHE_WGRAD_TMA=1; the warp-specialized wgrad, sm_90's default, off)
    names = _spy_launches(monkeypatch, bwd_gm)
    monkeypatch.setattr(bwd_gm, "WGRAD_TMA", True)
    monkeypatch.setattr(fwd_gm, "HP_WS", False)
    w = torch.randn(3, 16, 32, device=device, dtype=torch.bfloat16)
    _, _, r_dw = ref_grads(x, w, off, g)
    got = bwd_gm.grouped_mm_wgrad(g, x, off, backend="triton")
    assert names == ["_wgrad_tma_kernel"] and got.dtype == torch.bfloat16
    assert_close(got, r_dw)
    got = bwd_gm.grouped_mm_wgrad(g.float(), x.float(), off, backend="triton")
    assert names[-1] == "_wgrad_kernel"                      # float32: the pointer kernel
    x33 = torch.randn(R, 33, device=device, dtype=torch.bfloat16)
    w33 = torch.randn(3, 16, 33, device=device, dtype=torch.bfloat16)
    got = bwd_gm.grouped_mm_wgrad(g, x33, off, backend="triton")
    assert names[-1] == "_wgrad_kernel"                      # 66-byte rows: no TMA
    assert_close(got, ref_grads(x33, w33, off, g)[2])
    monkeypatch.setattr(bwd_gm, "WGRAD_TMA", False)
    bwd_gm.grouped_mm_wgrad(g, x, off, backend="triton")
    assert names[-1] == "_wgrad_kernel"
