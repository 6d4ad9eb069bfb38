"""Fused gradient accumulation (linghe.bwd.accumulate): expert weight gradients added into
an existing ``.grad`` by the wgrad kernel, and the autograd hand-back to AccumulateGrad."""

import pytest
import torch
from test_grouped_mm import make_rows
from test_moe import _expert_inputs

import linghe
from linghe import reference as ref
from linghe.bwd import accumulate
from linghe.bwd import grouped_mm as bwd_gm
from linghe.functional.moe import grouped_swiglu
from linghe.testing import assert_close

CASES = [
    # (counts, align, K, N)
    ([5, 0, 20], 16, 70, 50),        # zero-row expert, K/N not multiples of 16
    ([9, 31, 1, 0, 17], 1, 64, 32),  # align 1
    ([0, 0], 8, 40, 24),             # no rows at all: dw unchanged
]


def _ref_wgrad(d_out, rows, offsets):
    """float64 ``dW[e] = d_out_e^T @ rows_e`` through the reference grouped GEMM."""
    E = offsets.numel() - 1
    w = torch.zeros(E, d_out.shape[1], rows.shape[1], dtype=torch.float64,
                    device=rows.device, requires_grad=True)
    ref.grouped_mm(rows.double(), w, offsets).backward(d_out.double())
    return w.grad


# every tensor and module here is made on the test device (CUDA on a GPU machine)
pytestmark = pytest.mark.usefixtures("on_test_device")


@pytest.fixture(params=[True, False], ids=["tma", "pointer"])
def kernel(request, monkeypatch):
    """The accumulating wgrad's two kernels: TMA (Hopper+, the interpreter) and pointer."""
    monkeypatch.setattr(bwd_gm, "WGRAD_ACCUMULATE_TMA", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{len(c[0])}-a{c[1]}-K{c[2]}-N{c[3]}")
def test_wgrad_accumulate_kernel(device, dtype, case, kernel):
    counts, align, K, N = case
    rows, layout, real = make_rows(counts, align, K, device, dtype)
    d_out = torch.randn(rows.shape[0], N, device=device).to(dtype)
    d_out[~real] = 0
    dw0 = torch.randn(len(counts), N, K, device=device).to(dtype)
    dw = dw0.clone()
    out = bwd_gm.grouped_mm_wgrad_accumulate_(dw, d_out, rows, layout.offsets)
    assert out is dw
    expect = dw0.double() + _ref_wgrad(d_out, rows, layout.offsets)
    assert_close(dw, expect, None if dtype == torch.float32 else 1e-2, "dw")
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], dw0[e])


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"E{len(c[0])}-a{c[1]}")
def test_wgrad_accumulate_kernel_fp8_rows(device, case, kernel):
    """FP8 rows (rowwise 1x128 copy + scales) dequantized in the kernel: the same as
    accumulating the product with ``dequantize_1x128_rows`` of them."""
    counts, align, _, N = case
    K = 200  # two scale groups, the second partial
    rows, layout, real = make_rows(counts, align, K, device, torch.bfloat16)
    rq = linghe.quantize_1x128(rows, pow2_scale=False)
    d_out = torch.randn(rows.shape[0], N, device=device).to(torch.bfloat16)
    d_out[~real] = 0
    dw0 = torch.randn(len(counts), N, K, device=device).to(torch.bfloat16)
    dw = bwd_gm.grouped_mm_wgrad_accumulate_(dw0.clone(), d_out, rq.rowwise_data,
                                             layout.offsets, rows_scale=rq.rowwise_scale)
    expect = dw0.double() + _ref_wgrad(d_out, rq.dequantize(dtype=torch.float64),
                                       layout.offsets)
    assert_close(dw, expect, 1e-2, "dw")


def test_wgrad_accumulate_bad_inputs(device):
    rows, layout, _ = make_rows([3, 4], 1, 16, device, torch.bfloat16)
    d_out = torch.randn(rows.shape[0], 8, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dw must be"):
        bwd_gm.grouped_mm_wgrad_accumulate_(torch.zeros(2, 16, 8, device=device,
                                                        dtype=torch.bfloat16),
                                            d_out, rows, layout.offsets)
    dw = torch.zeros(2, 8, 16, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="d_out's dtype"):
        bwd_gm.grouped_mm_wgrad_accumulate_(dw, d_out, rows.float(), layout.offsets)


def expert_micro_batches(n: int = 2):
    """The expert FFN's inputs (E = 3 with a zero-row expert, align 16, H 128, I 64: the
    SwiGLU backward's two-kernel path, as at I 192, the down projection's K a partial
    128-group; test_moe's cases also take I 192 and 128) and
    ``n`` output gradients, zero on padding and tail rows: ``(rows, probs, w1, w2,
    layout, gs)``."""
    H = 128
    rows, probs, w1, w2, layout, real = _expert_inputs([5, 0, 30], 16, H, 64)
    gs = [torch.randn(rows.shape[0], H) for _ in range(n)]
    for g in gs:
        g[~real] = 0
    return rows, probs, w1, w2, layout, gs


def _two_passes(w, rows, layout, gs, hook=None):
    """Two backward passes of ``grouped_mm(rows, w)`` into ``w.grad``; returns the grad
    tensor identities seen after each pass."""
    ptrs = []
    for g in gs:
        linghe.grouped_mm(rows, w, layout).backward(g)
        ptrs.append(w.grad.data_ptr())
    return ptrs


def test_grouped_mm_accumulates_in_place(device, monkeypatch, fused_on, count_calls):
    counts, align, K, N = [5, 0, 20], 16, 48, 40
    rows, layout, real = make_rows(counts, align, K, device, torch.bfloat16)
    gs = [torch.randn(rows.shape[0], N, device=device).to(torch.bfloat16) for _ in range(3)]
    for g in gs:
        g[~real] = 0
    w_init = torch.randn(len(counts), N, K, device=device).to(torch.bfloat16)
    calls = count_calls(bwd_gm, "grouped_mm_wgrad_accumulate_")

    w = torch.nn.Parameter(w_init.clone())
    ptrs = _two_passes(w, rows, layout, gs)
    # the first pass makes .grad, the later ones add into that same tensor
    assert len(calls) == 2 and len(set(ptrs)) == 1
    expect = sum(_ref_wgrad(g, rows, layout.offsets) for g in gs)
    assert_close(w.grad, expect, 1e-2, "accumulated dw")

    # the plain path (AccumulateGrad adds) gives the same sums up to bf16 rounding
    accumulate.set_fused_grad_accumulation(False)
    w2 = torch.nn.Parameter(w_init.clone())
    _two_passes(w2, rows, layout, gs)
    assert len(calls) == 2
    assert_close(w.grad, w2.grad, 1e-2, "fused vs plain")


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_grouped_mm_accumulation_falls_back(device, monkeypatch, fused_on, count_calls):
    """Tensor hooks, create_graph and a non-leaf weight take the plain path; a grad
    that AccumulateGrad cannot take back (another reference) still ends up right."""
    counts, align, K, N = [4, 7], 8, 32, 16
    rows, layout, real = make_rows(counts, align, K, device, torch.float32)
    g1, g2 = (torch.randn(rows.shape[0], N, device=device) for _ in range(2))
    calls = count_calls(bwd_gm, "grouped_mm_wgrad_accumulate_")
    expect = _ref_wgrad(g1, rows, layout.offsets) + _ref_wgrad(g2, rows, layout.offsets)

    # a tensor hook sees each backward's own gradient
    w = torch.nn.Parameter(torch.randn(2, N, K, device=device))
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))
    _two_passes(w, rows, layout, [g1, g2])
    assert not calls
    assert_close(seen[1], _ref_wgrad(g2, rows, layout.offsets), None, "hook grad")
    assert_close(w.grad, expect, None, "hooked dw")

    # create_graph: the backward builds a graph, no in-place accumulation
    w = torch.nn.Parameter(torch.randn(2, N, K, device=device))
    linghe.grouped_mm(rows, w, layout).backward(g1)
    linghe.grouped_mm(rows, w, layout).backward(g2, create_graph=True)
    assert not calls
    assert_close(w.grad, expect, None, "create_graph dw")

    # torch.autograd.grad returns this backward's gradient and leaves .grad alone;
    # backward(inputs=[rows]) does not reach the weight's AccumulateGrad
    w = torch.nn.Parameter(torch.randn(2, N, K, device=device))
    linghe.grouped_mm(rows, w, layout).backward(g1)
    before = w.grad.clone()
    (dw,) = torch.autograd.grad(linghe.grouped_mm(rows, w, layout), w, g2)
    assert not calls and torch.equal(w.grad, before)
    assert_close(dw, _ref_wgrad(g2, rows, layout.offsets), None, "autograd.grad dw")
    r = rows.clone().requires_grad_(True)
    linghe.grouped_mm(r, w, layout).backward(g2, inputs=[r])
    assert not calls and torch.equal(w.grad, before) and r.grad is not None

    # a non-leaf weight (e.g. a cast of the parameter): AccumulateGrad is not ours to feed
    p = torch.nn.Parameter(torch.randn(2, N, K, device=device))
    for g in (g1, g2):
        linghe.grouped_mm(rows, p * 1.0, layout).backward(g)
    assert not calls
    assert_close(p.grad, expect, None, "non-leaf dw")

    # another reference to .grad (a user's name for it): PyTorch's in-place add, so the
    # alias stays .grad
    w = torch.nn.Parameter(torch.randn(2, N, K, device=device))
    linghe.grouped_mm(rows, w, layout).backward(g1)
    alias = w.grad
    linghe.grouped_mm(rows, w, layout).backward(g2)
    assert not calls and w.grad is alias
    assert_close(w.grad, expect, None, "aliased dw")
    # ... and without it, the fused path (the same .grad tensor afterwards)
    del alias
    ptr = w.grad.data_ptr()
    linghe.grouped_mm(rows, w, layout).backward(g1)
    assert len(calls) == 1 and w.grad.data_ptr() == ptr
    assert_close(w.grad, expect + _ref_wgrad(g1, rows, layout.offsets), None, "dw")


@pytest.mark.parametrize("fp8_rows", [False, True], ids=["bf16-rows", "fp8-rows"])
def test_grouped_swiglu_fp8_accumulates_in_place(monkeypatch, fused_on, fp8_rows, kernel,
                                                  count_calls):
    """The FP8 expert FFN's high-precision wgrads (the default) add into the weights'
    gradients: the same as the plain path up to one bf16 rounding per micro-batch."""
    rows, probs, w1, w2, layout, gs = expert_micro_batches()
    calls = count_calls(bwd_gm, "grouped_mm_wgrad_accumulate_")

    def run(fused):
        accumulate.set_fused_grad_accumulation(fused)
        p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        ptrs = []
        for g in gs:
            r = rows.clone().requires_grad_(True)
            if fp8_rows:
                r = linghe.quantize_1x128(r, pow2_scale=True)
                r.requires_grad_(True)
            out = grouped_swiglu(r, probs, p1, p2, layout, fp8=True, pow2_scale=True)
            out.backward(g.to(out.dtype))
            ptrs.append((p1.grad.data_ptr(), p2.grad.data_ptr()))
        return p1.grad, p2.grad, ptrs

    d1, d2, ptrs = run(True)
    assert len(calls) == 2 and ptrs[0] == ptrs[1]
    p1, p2, _ = run(False)
    assert len(calls) == 2
    assert_close(d1, p1, 1e-2, "d_gate_up fused vs plain")
    assert_close(d2, p2, 1e-2, "d_down fused vs plain")


def test_moe_module_accumulates(monkeypatch, fused_on, device, count_calls):
    """linghe.nn.MoE (bf16 experts): two micro-batches, the expert gradients accumulated
    by the wgrad kernel; the same as the plain path."""
    torch.manual_seed(0)
    m = linghe.nn.MoE(64, 4, 2, 48, device=device, dtype=torch.bfloat16)
    xs = [torch.randn(37, 64, device=device, dtype=torch.bfloat16) for _ in range(2)]
    calls = count_calls(bwd_gm, "grouped_mm_wgrad_accumulate_")

    def run(fused):
        accumulate.set_fused_grad_accumulation(fused)
        m.zero_grad(set_to_none=True)
        for x in xs:
            m(x)[0].float().square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    fused = run(True)
    assert len(calls) == 2  # gate_up and down on the second micro-batch
    plain = run(False)
    for n in plain:
        assert_close(fused[n], plain[n], 1e-2, n)


def test_flat_buffer_view_grad_takes_plain_path(device, monkeypatch, fused_on, count_calls):
    """A .grad that is a view into a flat buffer (e.g. DDP's bucket views): PyTorch's
    in-place add keeps it in the buffer; the fused path steps aside."""
    counts, align, K, N = [4, 7], 8, 32, 16
    rows, layout, real = make_rows(counts, align, K, device, torch.float32)
    g1, g2 = (torch.randn(rows.shape[0], N, device=device) for _ in range(2))
    calls = count_calls(bwd_gm, "grouped_mm_wgrad_accumulate_")
    w = torch.nn.Parameter(torch.randn(2, N, K, device=device))
    buf = torch.zeros(2 * N * K + 64, device=device)
    w.grad = buf[64:].view(2, N, K)
    for g in (g1, g2):
        linghe.grouped_mm(rows, w, layout).backward(g)
    assert not calls
    assert w.grad._base is buf  # still the buffer's view
    expect = _ref_wgrad(g1, rows, layout.offsets) + _ref_wgrad(g2, rows, layout.offsets)
    assert_close(buf[64:].view(2, N, K), expect, None, "buffer")


def test_failed_backward_leaves_gradients(monkeypatch, fused_on):
    """An error in the FP8 expert FFN's backward (here: its dgrad) after the fused path
    was chosen leaves the accumulated gradients as they were, as PyTorch does: the
    in-place adds run last."""
    counts, align, H, I = [5, 0, 30], 16, 128, 192
    rows, probs, w1, w2, layout, real = _expert_inputs(counts, align, H, I)
    g = torch.randn(rows.shape[0], H)
    g[~real] = 0
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    grouped_swiglu(rows.clone().requires_grad_(), probs, p1, p2, layout, fp8=True,
                   pow2_scale=True).backward(g.to(torch.bfloat16))
    before = p1.grad.clone(), p2.grad.clone()

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(bwd_gm, "grouped_mm_fp8_dgrad", fail)
    out = grouped_swiglu(rows.clone().requires_grad_(), probs, p1, p2, layout, fp8=True,
                         pow2_scale=True)
    with pytest.raises(torch.OutOfMemoryError):
        out.backward(g.to(torch.bfloat16))
    assert p1.grad is not None and p2.grad is not None
    assert torch.equal(p1.grad, before[0]) and torch.equal(p2.grad, before[1])


def test_fused_after_a_compile_that_raised(device, monkeypatch, fused_on, count_calls):
    """A ``torch.compile``d call that raised (here: the delayed FP8 recipe refusing to
    run under compile) used to leave one more Python reference on every ``.grad`` for the
    rest of the process, so a reference count measured once at import refused every
    later ``.grad`` and the fused path silently stopped: the unshared count is now taken
    beside each check."""
    lin = linghe.nn.Linear(136, 40)
    f = torch.compile(lambda x: lin(x), fullgraph=True, backend="aot_eager")
    with linghe.TrainingContext(fp8="delayed"), pytest.raises(RuntimeError):
        f(torch.randn(20, 136))
    rows, layout, real = make_rows([5, 0, 20], 16, 48, device, torch.bfloat16)
    g = torch.randn(rows.shape[0], 40, device=device).to(torch.bfloat16)
    g[~real] = 0
    w = torch.nn.Parameter(torch.randn(3, 40, 48, device=device).to(torch.bfloat16))
    calls = count_calls(bwd_gm, "grouped_mm_wgrad_accumulate_")
    ptrs = _two_passes(w, rows, layout, [g, g])
    assert len(calls) == 1 and len(set(ptrs)) == 1
