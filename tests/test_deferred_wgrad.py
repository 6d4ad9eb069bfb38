"""Deferred expert weight gradients (linghe.bwd.deferred): the multi-part wgrad kernel,
the stash across micro-batches, its hand-over and flushes, and where it steps aside."""

import pytest
import torch
from test_grad_accumulation import _ref_wgrad, expert_micro_batches
from test_grouped_mm import _spy_launches, make_rows, ref_grads

import linghe
from linghe.bwd import deferred
from linghe.bwd import grouped_mm as bwd_gm
from linghe.functional.moe import grouped_swiglu
from linghe.fwd import grouped_mm as fwd_gm
from linghe.fwd import grouped_mm_ws as ws_mod
from linghe.testing import assert_close

pytestmark = pytest.mark.usefixtures("on_test_device")


@pytest.fixture(autouse=True)
def _empty_stash():
    yield
    linghe.discard_deferred_wgrad()


def _parts(device, dtype, specs, K, N):
    """``[(d_out, rows, offsets), ...]`` of ``specs = [(counts, align), ...]`` (rows grouped
    by expert, zero padding and tail) and the float64 sum of their wgrads."""
    parts, expect = [], 0
    for counts, align in specs:
        rows, layout, real = make_rows(counts, align, K, device, dtype)
        d_out = torch.randn(rows.shape[0], N, device=device).to(dtype)
        d_out[~real] = 0
        parts.append((d_out, rows, layout.offsets))
        expect = expect + _ref_wgrad(d_out, rows, layout.offsets)
    return parts, expect


# (counts, align) per micro-batch, over E = 3 experts: zero-row experts, a part without
# any routed row, unaligned tails; six parts: two launches (MAX_PARTS = 4)
SPECS = [([5, 0, 20], 16), ([0, 0, 0], 16), ([17, 1, 3], 1), ([33, 2, 0], 8), ([1, 1, 1], 16),
         ([0, 40, 9], 16)]


@pytest.mark.parametrize("n_parts", [1, 2, 6])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tail", [0, 1, 2])
def test_parts_kernel(device, n_parts, out_dtype, tail):
    K, N = 40, 24  # no multiples of the tiles
    parts, expect = _parts(device, torch.bfloat16, SPECS[:n_parts], K, N)
    dw = torch.full((3, N, K), float("nan"), device=device, dtype=out_dtype)
    out = bwd_gm.launch_wgrad_tma_parts(parts, dw, config={"TAIL": tail})
    assert out is dw
    tol = None if out_dtype == torch.float32 else 1e-2
    assert_close(dw, expect, tol, "dw")
    # accumulate: added to what dw holds
    dw0 = torch.randn(3, N, K, device=device).to(out_dtype)
    dw = bwd_gm.launch_wgrad_tma_parts(parts, dw0.clone(), accumulate=True)
    assert_close(dw, dw0.double() + expect, tol, "dw accumulated")


@pytest.mark.parametrize("n_parts", [1, 6])
@pytest.mark.parametrize("accumulate", [False, True])
def test_parts_kernel_squares(device, n_parts, accumulate):
    """``sq_out``: per output tile, the squares of the final float32 values summed (the
    gradient's squared norm, linghe.bwd.grad_norms), also over two launches and with an
    empty operand list."""
    K, N = 40, 24
    parts, _ = _parts(device, torch.bfloat16, SPECS[:n_parts], K, N)
    dw = torch.randn(3, N, K, device=device)
    sq = torch.full((bwd_gm.wgrad_sq_size(dw),), float("nan"), device=device)
    bwd_gm.launch_wgrad_tma_parts(parts, dw, accumulate=accumulate, sq_out=sq)
    assert_close(sq.sum(), dw.double().square().sum(), 1e-5, "squared norm")
    bwd_gm.launch_wgrad_tma_parts(parts[:0] + [(parts[0][0][:0], parts[0][1][:0],
                                                parts[0][2])], dw, accumulate=True,
                                  sq_out=sq)
    assert_close(sq.sum(), dw.double().square().sum(), 1e-5, "squared norm, no rows")
    with pytest.raises(ValueError, match="sq_out"):
        bwd_gm.launch_wgrad_tma_parts(parts, dw, sq_out=sq[1:])


def test_parts_kernel_bad_inputs(device):
    parts, _ = _parts(device, torch.bfloat16, SPECS[:1], 32, 16)
    dw = torch.empty(3, 16, 32, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at least one"):
        bwd_gm.launch_wgrad_tma_parts([], dw)
    with pytest.raises(ValueError, match="TAIL must be 0, 1 or 2"):
        bwd_gm.launch_wgrad_tma_parts(parts, dw, config={"TAIL": 3})
    g, x, o = parts[0]
    with pytest.raises(ValueError, match="bf16/fp16 operands"):
        bwd_gm.launch_wgrad_tma_parts([(g.float(), x.float(), o)], dw)


# ---------------------------------------------- the warp-specialized 16-bit wgrad (sm_90)

# (parts' (counts, align) over E = 4 experts, K, N): N a multiple of the 128-row tile
# (TMA-store epilogue) or not (register stores), K past one 256-column tile with a tail,
# K <= 128 (128-column tiles); zero-row experts, an empty part, unaligned segments, rows
# past a segment belonging to the next expert, the last one ending at R (TMA zero fill);
# five parts: two launches (4 a launch)
WS_SPECS = [([5, 0, 150, 40], 16), ([0, 0, 0, 0], 16), ([17, 1, 3, 70], 1),
            ([33, 2, 0, 9], 8), ([1, 1, 1, 1], 16)]
WS_CASES = [(1, 200, 96), (2, 296, 256), (5, 136, 128), (3, 40, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: f"P{c[0]}-K{c[1]}-N{c[2]}")
def test_ws_wgrad_matches_reference(device, monkeypatch, case, out_dtype):
    """The warp-specialized bf16 wgrad (through :func:`launch_wgrad_parts`, the deferred
    path's launch, and ``grouped_mm_wgrad`` / ``grouped_mm_wgrad_accumulate_`` for one
    part) against the float64 sum of the parts' wgrads: fresh into a NaN-poisoned ``dW``,
    accumulating onto random values, with the squared norm; the grid capped at 3
    programs so each walks many tiles (the accumulating epilogue's barrier phases)."""
    if not ws_mod.ws_capable(torch.empty(1, device=device)):
        pytest.skip("needs an sm_90 GPU and Gluon")
    n_parts, K, N = case
    monkeypatch.setattr(ws_mod, "num_sms", lambda dev: 3)
    names = _spy_launches(monkeypatch, ws_mod)
    parts, expect = _parts(device, torch.bfloat16, WS_SPECS[:n_parts], K, N)
    tol = None if out_dtype == torch.float32 else 1e-2
    dw = torch.full((4, N, K), float("nan"), device=device, dtype=out_dtype)
    g0, x0, o0 = parts[0]
    empty_part = (g0[:0], x0[:0], torch.zeros_like(o0))  # no rows: left out of the launch
    out, sq = bwd_gm.launch_wgrad_parts(parts + [empty_part], dw)
    assert out is dw and sq is None
    assert_close(dw, expect, tol, "dw")
    launches = len(names)
    assert names == ["_hp_wgrad_ws_kernel"] * launches and launches == (2 if n_parts > 4
                                                                      else 1)
    dw0 = torch.randn(4, N, K, device=device).to(out_dtype)
    dw = dw0.clone()
    _, sq = bwd_gm.launch_wgrad_parts(parts, dw, accumulate=True, norm_sq=True)
    assert_close(dw, dw0.double() + expect, tol, "dw accumulated")
    # (the squares of the fp32 values before their rounding to dW's dtype)
    sq_tol = 1e-5 if out_dtype == torch.float32 else 1e-4
    assert_close(sq.sum(), dw.double().square().sum(), sq_tol, "squared norm")
    if n_parts == 1:  # the single-part entry points
        g, x, o = parts[0]
        del names[:]
        got = bwd_gm.grouped_mm_wgrad(g, x, o, out_dtype=out_dtype)
        assert_close(got, expect, tol, "grouped_mm_wgrad")
        got = bwd_gm.grouped_mm_wgrad_accumulate_(dw0.clone(), g, x, o)
        assert_close(got, dw0.double() + expect, tol, "grouped_mm_wgrad_accumulate_")
        assert names == ["_hp_wgrad_ws_kernel"] * 2


@pytest.mark.gpu
def test_ws_wgrad_fp16_and_int64_offsets(device, monkeypatch):
    """fp16 operands and ``dW``, int64 offsets, a single expert."""
    if not ws_mod.ws_capable(torch.empty(1, device=device)):
        pytest.skip("needs an sm_90 GPU and Gluon")
    parts, expect = _parts(device, torch.float16, [([77], 1), ([0], 16), ([130], 16)], 264,
                           128)
    parts = [(g, x, o.long()) for g, x, o in parts]
    dw = torch.full((1, 128, 264), float("nan"), device=device, dtype=torch.float16)
    ws_mod.launch_hp_wgrad_ws([p for p in parts if p[0].shape[0] > 0], dw)
    assert_close(dw, expect, 1e-2, "dw fp16")


def test_ws_wgrad_dispatch(device, monkeypatch):
    """Where the warp-specialized wgrad runs (pretended here: sm_90 with Gluon),
    ``grouped_mm_wgrad`` (``"auto"`` and ``"triton"``), the fused accumulation and the
    multi-part launch take it, with its own squares' length; ``LINGHE_HP_WS=0``, operands
    TMA cannot describe, ``backend="torch"`` and empty parts do not; settings, offsets
    and the launcher's own arguments are validated."""
    calls = []

    def fake(parts, dw, *, accumulate=False, sq_out=None, config=None):
        calls.append((len(parts), accumulate, None if sq_out is None else sq_out.numel()))
        return dw

    monkeypatch.setattr(bwd_gm, "launch_hp_wgrad_ws", fake)
    monkeypatch.setattr(fwd_gm, "ws_capable", lambda t: True)
    parts, _ = _parts(device, torch.bfloat16, SPECS[:3], 40, 24)
    g, x, o = parts[0]
    dw = torch.zeros(3, 24, 40, device=device, dtype=torch.bfloat16)
    bwd_gm.grouped_mm_wgrad(g, x, o)
    bwd_gm.grouped_mm_wgrad(g, x, o, backend="triton")
    bwd_gm.grouped_mm_wgrad_accumulate_(dw, g, x, o)
    _, sq = bwd_gm.launch_wgrad_parts(parts + [(g[:0], x[:0], o)], dw, norm_sq=True)
    # (the part without rows is left out; 2 half tiles x 3 experts x 1 x 1 tiles)
    assert calls == [(1, False, None), (1, False, None), (1, True, None), (3, False, 6)]
    assert sq.numel() == ws_mod.hp_wgrad_ws_sq_size(dw) == 6
    del calls[:]
    torch_calls = []
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: torch_calls.append(1)
                        or torch.zeros(3, 24, 40, device=device, dtype=torch.bfloat16))
    bwd_gm.grouped_mm_wgrad(g, x, o, backend="torch")
    assert torch_calls == [1]
    bwd_gm.grouped_mm_wgrad(g.float(), x.float(), o)            # fp32 operands: no TMA
    bwd_gm.grouped_mm_wgrad(g[:0], x[:0], torch.zeros_like(o))   # no rows
    x33 = torch.randn(x.shape[0], 33, device=device, dtype=torch.bfloat16)
    bwd_gm.grouped_mm_wgrad(g, x33, o)                           # 66-byte rows: no TMA
    monkeypatch.setattr(fwd_gm, "HP_WS", False)
    bwd_gm.grouped_mm_wgrad(g, x, o)
    _, sq = bwd_gm.launch_wgrad_parts(parts, dw, norm_sq=True)
    assert not calls and sq.numel() == bwd_gm.wgrad_sq_size(dw)
    # the settings: 128 columns where K <= 128; bad ones refused
    assert ws_mod.hp_wgrad_ws_config(96)["BKW"] == 128
    assert ws_mod.hp_wgrad_ws_config(2048)["BKW"] == 256
    for bad in (dict(STAGES=1), dict(BT=16), dict(BNW=64), dict(FOO=1)):
        with pytest.raises(ValueError, match="warp-specialized"):
            ws_mod.hp_wgrad_ws_config(2048, bad)
    # the ring's depth fits shared memory beside the epilogue's tiles
    cfg = ws_mod.hp_wgrad_ws_config(2048)
    assert ws_mod._hp_wgrad_stages(cfg, 2, 2) == 6
    assert ws_mod._hp_wgrad_stages(dict(cfg, BT=64), 2, 2) == 3
    with pytest.raises(ValueError, match="at least one"):
        bwd_gm.launch_wgrad_parts([], dw)
    for bad_o in (o[:-1], o.float(), o.repeat_interleave(2)[::2]):
        with pytest.raises(ValueError, match="offsets must be"):
            bwd_gm.launch_wgrad_parts([(g, x, bad_o)], dw)
    # the launcher's own checks, before any descriptor or launch
    monkeypatch.setattr(fwd_gm, "HP_WS", True)
    with pytest.raises(ValueError, match="contiguous bf16/fp16/fp32"):
        ws_mod.launch_hp_wgrad_ws(parts[:1], dw.transpose(1, 2))
    with pytest.raises(ValueError, match="sq_out"):
        ws_mod.launch_hp_wgrad_ws(parts[:1], dw, sq_out=torch.empty(5, device=device))
    with pytest.raises(ValueError, match="each with rows"):
        ws_mod.launch_hp_wgrad_ws([(g[:0], x[:0], o)], dw)
    with pytest.raises(ValueError, match="warp-specialized"):
        ws_mod.hp_wgrad_ws_config(2048, dict(CONSUMER_REGS=230))


def _micro_batches(device, n, N=40, K=48, dtype=torch.bfloat16):
    """``n`` micro-batches ``(rows, layout, d_out)`` over 3 experts with different routings."""
    out = []
    for counts, align in SPECS[:n]:
        rows, layout, real = make_rows(counts, align, K, device, dtype)
        g = torch.randn(rows.shape[0], N, device=device).to(dtype)
        g[~real] = 0
        out.append((rows, layout, g))
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused-acc", "plain-acc"])
@pytest.mark.parametrize("preexisting", [False, True], ids=["no-grad", "grad"])
def test_grouped_mm_defers(device, fused, preexisting, count_calls, fused_on):
    """``wgrad_micro_batches=3``: the first two backwards stash (``.grad`` untouched, the
    rows' gradients as usual), the third hands over the sum of all three in one launch."""
    linghe.set_fused_grad_accumulation(fused)
    mbs = _micro_batches(device, 3)
    w = torch.nn.Parameter(torch.randn(3, 40, 48, device=device).to(torch.bfloat16))
    g0 = torch.randn_like(w) if preexisting else None
    w.grad = None if g0 is None else g0.clone()
    calls = count_calls(bwd_gm, "launch_wgrad_parts")
    expect = 0 if g0 is None else g0.double()
    for i, (rows, layout, g) in enumerate(mbs):
        r = rows.clone().requires_grad_(True)
        linghe.grouped_mm(r, w, layout, wgrad_micro_batches=3).backward(g)
        expect = expect + _ref_wgrad(g, rows, layout.offsets)
        # the rows' gradient never waits
        assert_close(r.grad, ref_grads(rows, w, layout.offsets, g)[1], 1e-2, "d_rows")
        if i < 2:
            assert deferred.pending_micro_batches(w) == i + 1
            assert (w.grad is None) if g0 is None else torch.equal(w.grad, g0)
    assert deferred.pending_micro_batches(w) == 0 and len(calls) == 1
    assert_close(w.grad, expect, 1e-2, "deferred dw")


def test_grouped_mm_defer_matches_plain(device):
    """The deferred gradient equals three plain backwards' (one rounding vs three)."""
    mbs = _micro_batches(device, 3)
    w0 = torch.randn(3, 40, 48, device=device).to(torch.bfloat16)
    grads = []
    for n in (1, 3):
        w = torch.nn.Parameter(w0.clone())
        for rows, layout, g in mbs:
            linghe.grouped_mm(rows, w, layout, wgrad_micro_batches=n).backward(g)
        grads.append(w.grad)
    assert_close(grads[1], grads[0].double(), 1e-2, "deferred vs plain")


def test_leftover_flushed_by_optimizer_and_clip(device):
    """Fewer micro-batches than ``wgrad_micro_batches``: any torch.optim step computes the
    pending ones first (step pre-hook); linghe.optim.clip_grad_norm_ too."""
    mbs = _micro_batches(device, 2)
    w0 = torch.randn(3, 40, 48, device=device)
    expect = sum(_ref_wgrad(g, rows, lay.offsets) for rows, lay, g in mbs)

    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=1.0)
    for rows, layout, g in mbs:
        linghe.grouped_mm(rows.float(), w, layout, wgrad_micro_batches=4).backward(g.float())
    assert w.grad is None and deferred.pending_micro_batches(w) == 2
    opt.step()
    assert deferred.pending_micro_batches(w) == 0
    assert_close(w.grad, expect, None, "flushed dw")
    assert_close(w.detach(), w0.double() - expect, None, "stepped weight")

    w = torch.nn.Parameter(w0.clone())
    w.grad = torch.ones_like(w)
    for rows, layout, g in mbs:
        linghe.grouped_mm(rows.float(), w, layout, wgrad_micro_batches=4).backward(g.float())
    norm = linghe.optim.clip_grad_norm_([w], 1e30)
    assert_close(w.grad, expect + 1, None, "flushed into .grad")
    assert_close(norm, (expect + 1).norm(), None, "norm")

    # linghe's AdamW is a torch.optim optimizer: the pre-hook runs before its step too
    w = torch.nn.Parameter(w0.clone())
    opt = linghe.optim.AdamW([w], lr=1e-3)
    for rows, layout, g in mbs:
        linghe.grouped_mm(rows.float(), w, layout, wgrad_micro_batches=4).backward(g.float())
    opt.step()
    assert deferred.pending_micro_batches(w) == 0
    assert_close(w.grad, expect, None, "flushed by linghe.optim.AdamW")

    # explicit flush / discard
    w = torch.nn.Parameter(w0.clone())
    rows, layout, g = mbs[0]
    linghe.grouped_mm(rows.float(), w, layout, wgrad_micro_batches=2).backward(g.float())
    assert linghe.discard_deferred_wgrad([w]) == 1 and w.grad is None
    assert linghe.flush_deferred_wgrad() == 0


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_steps_aside(device):
    """autograd.grad, backward(inputs=...) without the weight and create_graph compute
    their own gradient and leave the stash alone; a weight changed in place while
    micro-batches are pending raises."""
    (rows, layout, g1), (rows2, layout2, g2) = _micro_batches(device, 2, dtype=torch.float32)
    w = torch.nn.Parameter(torch.randn(3, 40, 48, device=device))
    linghe.grouped_mm(rows, w, layout, wgrad_micro_batches=3).backward(g1)
    assert deferred.pending_micro_batches(w) == 1
    (dw,) = torch.autograd.grad(linghe.grouped_mm(rows2, w, layout2, wgrad_micro_batches=3),
                                w, g2)
    assert_close(dw, _ref_wgrad(g2, rows2, layout2.offsets), None, "autograd.grad dw")
    r = rows2.clone().requires_grad_(True)
    linghe.grouped_mm(r, w, layout2, wgrad_micro_batches=3).backward(g2, inputs=[r])
    linghe.grouped_mm(rows2, w, layout2, wgrad_micro_batches=3).backward(g2,
                                                                         create_graph=True)
    assert deferred.pending_micro_batches(w) == 1
    assert_close(w.grad, _ref_wgrad(g2, rows2, layout2.offsets), None, "create_graph dw")

    with torch.no_grad():
        w.mul_(0.5)
    with pytest.raises(RuntimeError, match="changed"):
        linghe.grouped_mm(rows2, w, layout2, wgrad_micro_batches=3).backward(g2)
    assert deferred.pending_micro_batches(w) == 0
    # a replaced storage (p.data = ...) is caught too
    linghe.grouped_mm(rows, w, layout, wgrad_micro_batches=3).backward(g1)
    w.data = w.data.clone()
    with pytest.raises(RuntimeError, match="replaced"):
        linghe.flush_deferred_wgrad()


def test_whole_step_capture_keeps_bookkeeping_on(monkeypatch):
    """While a CUDA graph is captured, the host-side per-step bookkeeping (deferral, the
    FP8 head's slots, recorded gradient norms) pauses, except inside
    ``linghe.whole_step_capture`` (nestable; off again after it, also after an error);
    nothing pauses outside a capture or for a CPU tensor."""
    from types import SimpleNamespace

    from linghe import utils

    gpu, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert not utils.capture_pauses_bookkeeping(gpu)
    capturing[0] = True
    assert utils.capture_pauses_bookkeeping(gpu)
    assert not utils.capture_pauses_bookkeeping(cpu)
    with linghe.whole_step_capture():
        assert not utils.capture_pauses_bookkeeping(gpu)
        with linghe.whole_step_capture():
            assert not utils.capture_pauses_bookkeeping(gpu)
        assert not utils.capture_pauses_bookkeeping(gpu)
    assert utils.capture_pauses_bookkeeping(gpu)
    with pytest.raises(KeyError):
        with linghe.whole_step_capture():
            raise KeyError("x")
    assert utils.capture_pauses_bookkeeping(gpu)


def test_grad_norm_record_survives_a_look(device):
    """``grad_norms.take(w, consume=False)`` returns the record and leaves it for the
    step (what AdamW.prepare_step does before a captured step); ``take`` consumes it."""
    from linghe.bwd import grad_norms

    w = torch.nn.Parameter(torch.randn(4, 8, device=device))
    w.grad = torch.randn(4, 8, device=device)
    sq = (w.grad.float() ** 2).sum().reshape(1)
    grad_norms.record(w, w.grad, sq)
    assert grad_norms.take(w, consume=False) is sq
    assert grad_norms.take(w) is sq
    assert grad_norms.take(w) is None


@pytest.mark.gpu
def test_cuda_graph_whole_step_capture_defers(device):
    """Inside ``linghe.whole_step_capture`` a capture of both micro-batches' backwards
    defers the first and hands both over in the second, and the replay computes them."""
    if device != "cuda":
        pytest.skip("needs a GPU")
    (rows1, layout1, g1), (rows2, layout2, g2) = _micro_batches(device, 2)
    w = torch.nn.Parameter(torch.randn(3, 40, 48, device=device).to(torch.bfloat16))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (compiles)
        for rows, layout, g in ((rows1, layout1, g1), (rows2, layout2, g2)):
            linghe.grouped_mm(rows, w, layout, wgrad_micro_batches=2).backward(g)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    w.grad = None
    graph = torch.cuda.CUDAGraph()
    with linghe.whole_step_capture(), torch.cuda.graph(graph):
        linghe.grouped_mm(rows1, w, layout1, wgrad_micro_batches=2).backward(g1)
        assert deferred.pending_micro_batches(w) == 1
        linghe.grouped_mm(rows2, w, layout2, wgrad_micro_batches=2).backward(g2)
    assert deferred.pending_micro_batches(w) == 0
    w.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expect = (_ref_wgrad(g1, rows1, layout1.offsets).double()
              + _ref_wgrad(g2, rows2, layout2.offsets).double())
    assert_close(w.grad, expect, 1e-2, "captured dw of two micro-batches")


@pytest.mark.gpu
def test_cuda_graph_capture_steps_aside(device):
    """Inside a CUDA graph capture nothing is stashed (a replay would not run the
    bookkeeping): the captured backward computes its own gradient."""
    if device != "cuda":
        pytest.skip("needs a GPU")
    (rows, layout, g), = _micro_batches(device, 1)
    w = torch.nn.Parameter(torch.randn(3, 40, 48, device=device).to(torch.bfloat16))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (compiles)
        linghe.grouped_mm(rows, w, layout).backward(g)
    torch.cuda.current_stream().wait_stream(stream)
    w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linghe.grouped_mm(rows, w, layout, wgrad_micro_batches=2).backward(g)
    assert deferred.pending_micro_batches(w) == 0
    graph.replay()
    torch.cuda.synchronize()
    assert_close(w.grad, _ref_wgrad(g, rows, layout.offsets), 1e-2, "captured dw")


def test_fallback_without_tma(device, monkeypatch):
    """Where the multi-part TMA kernel cannot run: the first part's wgrad, then
    accumulating ones (the documented fallback), FP8 rows included."""
    monkeypatch.setattr(deferred, "tma_capable", lambda t: False)
    K, N = 200, 24
    parts, expect = _parts(device, torch.bfloat16, SPECS[:3], K, N)
    q = linghe.quantize_1x128(parts[1][1], pow2_scale=False)
    fp8_part = deferred.WgradPart(parts[1][0], q.rowwise_data, q.rowwise_scale, parts[1][2])
    wparts = [deferred.WgradPart(g, x, None, o) for g, x, o in parts]
    wparts[1] = fp8_part
    expect = (expect - _ref_wgrad(*parts[1])
              + _ref_wgrad(parts[1][0], q.dequantize(dtype=torch.float64), parts[1][2]))
    dw = deferred.wgrad_parts(wparts, None, out_dtype=torch.float32)
    assert_close(dw, expect, 1e-2, "fallback dw")
    dw0 = torch.randn(3, N, K, device=device)
    dw = deferred.wgrad_parts(wparts, dw0.clone())
    assert_close(dw, dw0.double() + expect, 1e-2, "fallback dw accumulated")


@pytest.mark.parametrize("fp8_rows", [False, True], ids=["bf16-rows", "fp8-rows"])
def test_grouped_swiglu_fp8_defers(monkeypatch, fused_on, fp8_rows, count_calls):
    """The FP8 expert FFN's high-precision wgrads deferred over 2 micro-batches: the same
    gradients as without deferral (up to bf16 rounding), one multi-part launch each."""
    rows, probs, w1, w2, layout, gs = expert_micro_batches()
    calls = count_calls(bwd_gm, "launch_wgrad_parts")

    def run(n):
        p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        drows = []
        for i, g in enumerate(gs):
            r = rows.clone().requires_grad_(True)
            x = linghe.quantize_tokens(r, pow2_scale=True) if fp8_rows else r
            out = grouped_swiglu(x, probs, p1, p2, layout, fp8=True, pow2_scale=True,
                                 wgrad_micro_batches=n)
            out.backward(g.to(out.dtype))
            drows.append(r.grad)
            if n > 1 and i == 0:
                assert p1.grad is None and p2.grad is None
        return p1.grad, p2.grad, drows

    d1, d2, dr = run(2)
    assert len(calls) == 2
    p1, p2, pr = run(1)
    assert_close(d1, p1, 1e-2, "d_gate_up deferred vs plain")
    assert_close(d2, p2, 1e-2, "d_down deferred vs plain")
    for a, b in zip(dr, pr):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_moe_module_defers(device, fp8):
    """linghe.nn.MoE with ``wgrad_micro_batches=2``: after two micro-batches every
    gradient equals the undeferred module's; after the first the expert weights have
    none. extra_repr shows the setting; bad values raise."""
    torch.manual_seed(0)
    base = linghe.nn.MoE(128, 4, 2, 64, device=device, dtype=torch.bfloat16)
    xs = [torch.randn(n, 128, device=device, dtype=torch.bfloat16) for n in (37, 20)]

    def run(n):
        m = linghe.nn.MoE(128, 4, 2, 64, wgrad_micro_batches=n, device=device,
                          dtype=torch.bfloat16)
        m.load_state_dict(base.state_dict())
        with linghe.TrainingContext(fp8="blockwise" if fp8 else None):
            for i, x in enumerate(xs):
                m(x)[0].float().square().mean().backward()
                if n > 1 and i == 0:
                    assert m.experts_gate_up.grad is None and m.experts_down.grad is None
                    assert m.router_weight.grad is not None
        return m, {k: p.grad.clone() for k, p in m.named_parameters()}

    m, deferred_grads = run(2)
    assert "wgrad_micro_batches=2" in repr(m)
    _, plain = run(1)
    for k in plain:
        assert_close(deferred_grads[k], plain[k].double(), 1e-2, k)
    with pytest.raises(ValueError, match="wgrad_micro_batches"):
        linghe.nn.MoE(128, 4, 2, 64, wgrad_micro_batches=0)


def test_fp8_moe_stashes_tokens_not_rows(device, monkeypatch):
    """The FP8 layer's deferred gate_up wgrad keeps the FP8 tokens its rows were permuted
    from (TokenRows: k times fewer bytes pending) and makes the rows at the hand-over: the
    same gradients, bit for bit, as keeping the FP8 rows."""
    from linghe.functional import permute as fperm
    from linghe.fwd.permute import TokenRows

    torch.manual_seed(0)
    base = linghe.nn.MoE(128, 4, 2, 64, device=device, dtype=torch.bfloat16)
    xs = [torch.randn(n, 128, device=device, dtype=torch.bfloat16) for n in (37, 20)]

    def run():
        m = linghe.nn.MoE(128, 4, 2, 64, wgrad_micro_batches=2, device=device,
                          dtype=torch.bfloat16)
        m.load_state_dict(base.state_dict())
        pending = []
        with linghe.TrainingContext(fp8="blockwise"):
            for x in xs:
                m(x)[0].float().square().mean().backward()
                stash = deferred._STASHES.get(m.experts_gate_up)
                if stash is not None:
                    pending += [p.rows for p in stash.parts]
        return pending, {k: p.grad.clone() for k, p in m.named_parameters()}

    pending, grads = run()
    assert len(pending) == 1 and isinstance(pending[0], TokenRows)
    monkeypatch.setattr(fperm, "TokenRows", lambda *a: None)  # rows kept as before
    pending, plain = run()
    assert len(pending) == 1 and not isinstance(pending[0], TokenRows)
    for k in plain:
        assert torch.equal(grads[k], plain[k]), k


@pytest.mark.parametrize("reentrant", [False, True])
def test_moe_under_activation_checkpointing(device, reentrant):
    """Activation checkpointing (the forward recomputed in backward): the deferred
    gradients equal the undeferred ones."""
    torch.manual_seed(0)
    base = linghe.nn.MoE(64, 4, 2, 48, device=device, dtype=torch.bfloat16)
    xs = [torch.randn(n, 64, device=device, dtype=torch.bfloat16) for n in (21, 30)]
    grads = []
    for n in (1, 2):
        m = linghe.nn.MoE(64, 4, 2, 48, wgrad_micro_batches=n, device=device,
                          dtype=torch.bfloat16)
        m.load_state_dict(base.state_dict())
        for x in xs:
            x = x.clone().requires_grad_(True)
            out = torch.utils.checkpoint.checkpoint(lambda t, m=m: m(t)[0], x,
                                                    use_reentrant=reentrant)
            out.float().square().mean().backward()
        assert deferred.pending_micro_batches(m.experts_gate_up) == 0
        grads.append({k: p.grad for k, p in m.named_parameters()})
    for k in grads[0]:
        assert_close(grads[1][k], grads[0][k].double(), 1e-2, k)


def test_bad_settings(device):
    rows, layout, _ = make_rows([3, 4], 16, 128, device, torch.bfloat16)
    w = torch.randn(2, 128, 128, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="int >= 1"):
        linghe.grouped_mm(rows, w, layout, wgrad_micro_batches=0)
    with pytest.raises(ValueError, match="cannot be deferred"):
        linghe.grouped_mm(rows, w, layout, fp8=True, wgrad_micro_batches=2)


def test_benchmark_case(device):
    """The ``grouped_mm_deferred`` benchmark case builds and its deferred launch matches
    the eager per-micro-batch loop (CPU: the tiny shapes; the GPU runs it in benchmarks)."""
    if device != "cpu":
        pytest.skip("the benchmark runs the standard shapes on the GPU")
    import benchmark.cases.grouped_mm  # noqa: F401  (registers the case)
    from benchmark.harness import Config, cases, max_rel_err

    (bench,) = cases()["grouped_mm_deferred"](Config(device="cpu", quick=True))
    assert max_rel_err(bench.run["linghe"](), bench.run["eager"]().clone()) <= bench.tol
