"""linghe.nn.MoE (one process, all experts local) against linghe.reference.moe."""

import copy

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.testing import assert_close

# every tensor and module here is made on the test device (CUDA on a GPU machine)
pytestmark = pytest.mark.usefixtures("on_test_device")


def _ref_params(m, dtype):
    sd = m.gather_full_state_dict()
    ps = {k: v.detach().to(dtype).requires_grad_(True) for k, v in sd.items()
          if k != "expert_bias"}
    ps["router_weight"] = sd["router_weight"].detach().clone().requires_grad_(True)
    return ps, sd["expert_bias"]


def _run_ref(m, x, ps, bias):
    return ref.moe(x, ps["router_weight"], ps["experts_gate_up"], ps["experts_down"], m.top_k,
                   score=m.score, expert_bias=bias, num_groups=m.num_groups,
                   topk_groups=m.topk_groups,
                   shared_gate_up=ps.get("shared_experts.gate_up_proj.weight"),
                   shared_down=ps.get("shared_experts.down_proj.weight"))


def _check(m, T, dtype, tol, ref_dtype=torch.float64, fp8=False):
    H = m.hidden_size
    x = torch.randn(T, H, dtype=dtype)
    g = torch.randn(T, H, dtype=dtype)
    # a bias that changes the selection
    m.expert_bias.copy_(torch.randn(m.num_experts) * 0.1)
    xl = x.clone().requires_grad_(True)
    ctx = linghe.TrainingContext(fp8="blockwise") if fp8 else linghe.TrainingContext()
    with ctx:
        out, aux = m(xl)
    ((out.float() * g.float()).sum() + 0.1 * aux.z_loss).backward()

    ps, bias = _ref_params(m, ref_dtype)
    xr = x.to(ref_dtype).requires_grad_(True)
    ro, logits, ids, tpe = _run_ref(m, xr, ps, bias)
    ((ro * g.to(ref_dtype)).sum() + 0.1 * ref.router_z_loss(logits)).backward()

    assert torch.equal(aux.tokens_per_expert.to(torch.int32), tpe)
    assert int(aux.num_dropped) == 0
    assert_close(aux.logits, logits, 1e-5, "logits")
    assert_close(aux.z_loss, ref.router_z_loss(logits), 1e-5, "z_loss")
    assert_close(out, ro, tol, "out")
    assert_close(xl.grad, xr.grad, tol, "dx")
    named = dict(m.named_parameters())
    for k, p in ps.items():
        assert_close(named[k].grad, p.grad, tol, f"d{k}")


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_fp32_sigmoid(shared):
    m = linghe.nn.MoE(16, 6, 2, 8, num_shared_experts=shared, align=4)
    _check(m, 13, torch.float32, 1e-5)


def test_moe_softmax_groups_zero_expert():
    # T=3 tokens, top-2 of 8 experts in 4 groups: most experts get no tokens
    m = linghe.nn.MoE(16, 8, 2, 8, score="softmax", num_groups=4, topk_groups=2, align=1,
                      num_shared_experts=2)
    _check(m, 3, torch.float32, 1e-5)


def test_moe_empty_and_batched_shape():
    m = linghe.nn.MoE(16, 4, 2, 8, align=8)
    out, aux = m(torch.randn(0, 16))
    assert out.shape == (0, 16) and int(aux.tokens_per_expert.sum()) == 0
    x = torch.randn(2, 3, 16, requires_grad=True)
    out, aux = m(x)
    assert out.shape == (2, 3, 16)
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_moe_bf16():
    m = linghe.nn.MoE(32, 4, 2, 16, num_shared_experts=1, align=8, dtype=torch.bfloat16)
    _check(m, 9, torch.bfloat16, 3e-2, ref_dtype=torch.float32)


def test_moe_fp8_blockwise():
    m = linghe.nn.MoE(128, 4, 2, 64, align=16, dtype=torch.bfloat16)
    _check(m, 16, torch.bfloat16, 0.12, ref_dtype=torch.float32, fp8=True)


def test_update_expert_bias_and_state_dict():
    m = linghe.nn.MoE(16, 4, 2, 8)
    m.update_expert_bias(torch.tensor([4, 0, 2, 2], dtype=torch.int32), rate=0.5)
    assert m.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    sd = m.state_dict()
    assert set(sd) == {"router_weight", "expert_bias", "experts_gate_up", "experts_down"}
    assert sd["experts_gate_up"].shape == (4, 16, 16) and sd["experts_down"].shape == (4, 16, 8)
    m2 = linghe.nn.MoE(16, 4, 2, 8)
    m2.load_full_state_dict(m.gather_full_state_dict())
    assert torch.equal(m2.experts_down, m.experts_down)
    assert "num_experts=4" in repr(m)


def test_moe_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        linghe.nn.MoE(16, 4, 5, 8)
    with pytest.raises(ValueError, match="num_experts"):
        linghe.nn.MoE(16, 0, 1, 8)
    with pytest.raises(ValueError, match="score"):
        linghe.nn.MoE(16, 4, 2, 8, score="relu")
    with pytest.raises(ValueError, match="num_groups"):
        linghe.nn.MoE(16, 6, 2, 8, num_groups=4)
    m = linghe.nn.MoE(16, 4, 2, 8)
    with pytest.raises(ValueError, match="hidden_size"):
        m(torch.randn(3, 15))
    with pytest.raises(TypeError, match="dtype"):
        m(torch.randn(3, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        m.update_expert_bias(torch.zeros(3))
    with pytest.raises(ValueError, match="all 4 experts"):
        m.load_full_state_dict({"experts_down": torch.zeros(2, 16, 8)}, strict=False)


def test_moe_fp8_expert_weights_quantized_once_per_step():
    m = linghe.nn.MoE(128, 2, 1, 64, align=16, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    caches = m._fp8_weight_caches
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    with linghe.TrainingContext(fp8="blockwise"):
        for _ in range(2):  # two micro-batches of one step
            out, _ = m(x)
            out.float().sum().backward()
    assert all((c.misses, c.hits) == (1, 1) for c in caches.values())
    opt.step()
    with linghe.TrainingContext(fp8="blockwise"):
        m(x)
    assert all((c.misses, c.hits) == (2, 1) for c in caches.values())
    w = m.experts_down.detach()
    fresh = linghe.quantize_grouped_weight(w, columnwise=True, pow2_scale=True)
    assert torch.equal(caches["experts_down"].value.rowwise_data.float(),
                       fresh.rowwise_data.float())
    m.to(torch.float32)  # module conversion drops the cached copies
    assert all(c.value is None for c in caches.values())


def test_moe_fp8_expert_weights_quantized_by_linghe_adamw(device):
    """With linghe.optim.AdamW the step itself writes the expert weights' FP8 copies: the
    next forward hits (no quantization), and the training is bit for bit the one whose
    layers quantize after each step (``fp8_weight_copies=False``)."""
    torch.manual_seed(0)
    m = linghe.nn.MoE(128, 2, 1, 64, align=16, dtype=torch.bfloat16, device=device)
    m_t = copy.deepcopy(m)
    opt = linghe.optim.AdamW(m.parameters(), lr=1e-2)
    opt_t = linghe.optim.AdamW(m_t.parameters(), lr=1e-2, fp8_weight_copies=False)
    caches = m._fp8_weight_caches
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16, device=device)
    for step in range(3):
        outs = []
        for mod, o in ((m, opt), (m_t, opt_t)):
            with linghe.TrainingContext(fp8="blockwise"):
                out, _ = mod(x)
            out.float().square().sum().backward()
            o.step()
            o.zero_grad()
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), step
        assert all(c.misses == 1 and c.hits == step for c in caches.values())
        assert all(c.from_optimizer for c in caches.values())
        assert all(c.misses == step + 1 and not c.from_optimizer
                   for c in m_t._fp8_weight_caches.values())
    w = m.experts_down.detach()
    fresh = linghe.quantize_grouped_weight(w, columnwise=True, pow2_scale=True)
    assert torch.equal(caches["experts_down"].value.rowwise_data.view(torch.uint8),
                       fresh.rowwise_data.view(torch.uint8))


# ------------------------------------------------------------ grouped_swiglu (expert FFN)
from linghe.functional.moe import grouped_swiglu, quantize_tokens  # noqa: E402
from linghe.layout import make_expert_layout  # noqa: E402

# Two FP8 GEMMs in a row (e4m3: 3 mantissa bits per operand): ~7% relative error on CPU
# and GPU alike, the same as linghe.nn.Linear's FP8 shared experts in the same layer.
FP8_VS_EXACT = 0.12


def _expert_inputs(counts, align, H, I, tail=3):
    c = torch.tensor(counts, dtype=torch.int32)
    segs = ref.expert_segments(counts, align)
    R = sum(p for *_, p in segs) + tail
    layout = make_expert_layout(c, align, R)
    real = ref.real_rows(segs, R, "cpu")
    rows = torch.randn(R, H).to(torch.bfloat16)
    rows[~real] = 0
    probs = torch.rand(R)
    probs[~real] = 0
    E = len(counts)
    w1 = (torch.randn(E, 2 * I, H) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I) / I**0.5).to(torch.bfloat16)
    return rows, probs, w1, w2, layout, real


def _grads_of(fn, inputs, g):
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*ins)
    out.backward(g.to(out.dtype))
    return out.detach(), [t.grad for t in ins]


@pytest.mark.parametrize("case", [([5, 0, 30], 16, 128, 192), ([0, 17, 1], 8, 256, 64),
                                  ([0, 0], 16, 128, 64)],
                         ids=lambda c: f"E{len(c[0])}-a{c[1]}-H{c[2]}-I{c[3]}")
@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8-wgrad", "bf16-wgrad"])
def test_grouped_swiglu_fp8_vs_reference(case, fp8_wgrad):
    counts, align, H, I = case
    rows, probs, w1, w2, layout, real = _expert_inputs(counts, align, H, I)
    g = torch.randn(rows.shape[0], H)
    g[~real] = 0
    caches = (linghe.fp8.WeightCache(), linghe.fp8.WeightCache())
    out, grads = _grads_of(
        lambda r, p, a, b: grouped_swiglu(r, p, a, b, layout, fp8=True, pow2_scale=True,
                                          weight_caches=caches, fp8_wgrad=fp8_wgrad),
        (rows, probs, w1, w2), g)
    rout, rgrads = _grads_of(
        lambda r, p, a, b: ref.grouped_swiglu(r, p, a, b, layout.offsets),
        (rows.double(), probs.double(), w1.double(), w2.double()), g.double())
    assert out.dtype == torch.bfloat16 and torch.all(out[~real] == 0)
    if real.any():
        assert_close(out, rout, FP8_VS_EXACT, "out")
        for name, a, b in zip(("d_rows", "d_probs", "d_gate_up", "d_down"), grads, rgrads):
            assert_close(a, b, FP8_VS_EXACT, name)
    assert torch.all(grads[0][~real] == 0) and torch.all(grads[1][~real] == 0)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(grads[2][e] == 0) and torch.all(grads[3][e] == 0)
    # Forward = the chain of public kernel-level ops it fuses (bit for bit).
    a1 = linghe.quantize_1x128(rows, pow2_scale=True)
    h = linghe.grouped_mm_fp8(a1, caches[0].value, layout)
    a2, _ = linghe.batch_silu_mul_quant(h, probs, layout=layout, pow2_scale=True)
    assert torch.equal(out, linghe.grouped_mm_fp8(a2, caches[1].value, layout))
    # the cache made each weight's copies once and they serve the dgrad too
    assert all(c.misses == 1 for c in caches)


# I = 128: the SwiGLU backward's one-kernel dh + FP8 copy (silu_mul_bwd_rowwise_fp8);
# I = 64, 192: its two-kernel fallback.
@pytest.mark.parametrize("case", [([5, 0, 30], 16, 128, 192), ([0, 17, 1], 8, 256, 64),
                                  ([0, 0], 16, 128, 64), ([3, 6, 0], 4, 128, 64),
                                  ([7, 0, 20], 16, 128, 128)],
                         ids=lambda c: f"E{len(c[0])}-a{c[1]}-H{c[2]}-I{c[3]}")
@pytest.mark.parametrize("fp8_rows", [False, True], ids=["bf16-rows", "fp8-rows"])
def test_grouped_swiglu_fp8_high_precision_wgrad(case, fp8_rows):
    """``fp8_wgrad=False``: the same forward and dgrads as the FP8 wgrad path (bit for
    bit), and weight gradients that are the high-precision products of the gradients and
    the FP8 activations the forward multiplied."""
    counts, align, H, I = case
    rows, probs, w1, w2, layout, real = _expert_inputs(counts, align, H, I)
    g = torch.randn(rows.shape[0], H)
    g[~real] = 0
    offsets = layout.offsets

    def run(fp8_wgrad):
        ins = [t.detach().clone().requires_grad_(True) for t in (rows, probs, w1, w2)]
        r = ins[0]
        if fp8_rows:
            r = linghe.quantize_1x128(r, pow2_scale=True)
            r.requires_grad_(True)
        out = grouped_swiglu(r, ins[1], ins[2], ins[3], layout, fp8=True, pow2_scale=True,
                             fp8_wgrad=fp8_wgrad)
        out.backward(g.to(out.dtype))
        return out.detach(), [t.grad for t in ins], r.grad if fp8_rows else None

    out8, grads8, rg8 = run(True)
    out, grads, rg = run(False)
    assert torch.equal(out, out8)
    # dgrads: the same FP8 kernels on the same values.
    if fp8_rows:
        assert torch.equal(rg, rg8)
    else:
        assert torch.equal(grads[0], grads8[0])
    if I % 128 == 0:
        # the one-kernel dh + FP8 copy sums dprobs' rows in another order on the GPU
        torch.testing.assert_close(grads[1], grads8[1], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(grads[1], grads8[1])
    # d_down against the float64 product of the gradient and the FP8 SwiGLU output the
    # forward multiplied (rebuilt from the public kernel-level ops).
    w1q = linghe.quantize_grouped_weight(w1, pow2_scale=True)
    h = linghe.grouped_mm_fp8(linghe.quantize_1x128(rows, pow2_scale=True), w1q, layout)
    a2, _ = linghe.batch_silu_mul_quant(h, probs, layout=layout, pow2_scale=True)
    w2r = w2.double().requires_grad_(True)
    (ref.grouped_mm(a2.dequantize(dtype=torch.float64), w2r, offsets) * g.double()).sum() \
        .backward()
    assert_close(grads[3], w2r.grad, 0.01, "d_down")
    # d_gate_up: dh from the FP8 dgrad chain (same as the FP8 path), times the rows.
    assert_close(grads[2], grads8[2], FP8_VS_EXACT, "d_gate_up vs FP8 wgrad")
    rgrads = _grads_of(
        lambda r, p, a, b: ref.grouped_swiglu(r, p, a, b, offsets),
        (rows.double(), probs.double(), w1.double(), w2.double()), g.double())[1]
    if real.any():
        assert_close(grads[2], rgrads[2], FP8_VS_EXACT, "d_gate_up")
        assert_close(grads[3], rgrads[3], FP8_VS_EXACT, "d_down vs exact")
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(grads[2][e] == 0) and torch.all(grads[3][e] == 0)


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_moe_follows_recipe_expert_fp8_wgrad(monkeypatch, fp8_wgrad):
    """``TrainingContext(expert_fp8_wgrad=...)`` picks the experts' weight-gradient
    kernels (the dense layers' ``fp8_wgrad`` does not)."""
    from linghe.bwd import grouped_mm as bwd_gm

    calls = {"fp8": 0, "hp": 0}
    fp8_fn, hp_fn = bwd_gm.grouped_mm_fp8_wgrad, bwd_gm.grouped_mm_wgrad

    def fp8_spy(*a, **k):
        calls["fp8"] += 1
        return fp8_fn(*a, **k)

    def hp_spy(*a, **k):
        calls["hp"] += 1
        return hp_fn(*a, **k)

    monkeypatch.setattr(bwd_gm, "grouped_mm_fp8_wgrad", fp8_spy)
    monkeypatch.setattr(bwd_gm, "grouped_mm_wgrad", hp_spy)
    m = linghe.nn.MoE(128, 4, 2, 64, align=16, dtype=torch.bfloat16)
    x = torch.randn(9, 128).to(torch.bfloat16)
    with linghe.TrainingContext(fp8="blockwise", fp8_wgrad=not fp8_wgrad,
                                expert_fp8_wgrad=fp8_wgrad):
        out, _ = m(x)
    out.float().sum().backward()
    assert calls == ({"fp8": 2, "hp": 0} if fp8_wgrad else {"fp8": 0, "hp": 2})


@pytest.mark.parametrize("expert_fp8", [True, False])
def test_moe_follows_recipe_expert_fp8(monkeypatch, expert_fp8):
    """``TrainingContext(expert_fp8=False)`` runs the routed experts in high precision
    (no FP8 tokens, ``grouped_swiglu(fp8=False)``: the same output as the bf16 module's
    routed part) while the shared expert stays FP8."""
    from linghe.nn import moe as nn_moe

    seen = []
    real = nn_moe.grouped_swiglu

    def spy(*a, **k):
        seen.append(k["fp8"])
        return real(*a, **k)

    monkeypatch.setattr(nn_moe, "grouped_swiglu", spy)
    m = linghe.nn.MoE(128, 4, 2, 64, num_shared_experts=1, align=16, dtype=torch.bfloat16)
    x = torch.randn(9, 128).to(torch.bfloat16)
    with linghe.TrainingContext(fp8="blockwise", expert_fp8=expert_fp8):
        out, _ = m(x)
        shared_fp8 = m.shared_experts(x)
    out.float().sum().backward()
    assert seen == [expert_fp8]
    assert m.experts_gate_up.grad is not None
    # the shared expert ran FP8 either way: its output differs from its bf16 output
    assert not torch.equal(shared_fp8, m.shared_experts(x))
    with pytest.raises(ValueError, match="expert_fp8"):
        linghe.TrainingContext(fp8="blockwise", expert_fp8=1)


def test_grouped_swiglu_fp8_rows_and_partial_grads():
    """FP8 rows (quantize_tokens -> permute) and gradients for only some inputs."""
    H, I, E, T, k = 128, 64, 3, 7, 2
    x = torch.randn(T, H).to(torch.bfloat16).requires_grad_(True)
    ids = torch.tensor([[0, 2], [2, 0], [2, 1], [0, 2], [2, 0], [0, 2], [2, 0]])
    probs = torch.rand(T, k)
    w1 = (torch.randn(E, 2 * I, H) / H**0.5).to(torch.bfloat16).requires_grad_(True)
    w2 = (torch.randn(E, H, I) / I**0.5).to(torch.bfloat16)
    xq = quantize_tokens(x, pow2_scale=True)
    assert isinstance(xq, linghe.Fp8Tensor) and xq.requires_grad
    rows, prow, layout = linghe.permute(xq, ids, probs, num_experts=E, align=16)
    assert isinstance(rows, linghe.Fp8Tensor)
    y = grouped_swiglu(rows, prow, w1, w2, layout, fp8=True, pow2_scale=True)
    out = linghe.unpermute(y, layout)
    g = torch.randn(T, H)
    (out.float() * g).sum().backward()
    # reference: the loop over tokens in float64 (probs are constants here)
    xr = x.detach().double().requires_grad_(True)
    w1r = w1.detach().double().requires_grad_(True)
    ro = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            hh = xr[t] @ w1r[e].t()
            ro[t] += ref.silu_mul(hh[None], probs[t, j:j + 1].double())[0] @ \
                w2[e].double().t()
    (ro * g.double()).sum().backward()
    assert_close(out, ro, FP8_VS_EXACT, "out")
    assert_close(x.grad, xr.grad, FP8_VS_EXACT, "dx")
    assert_close(w1.grad, w1r.grad, FP8_VS_EXACT, "d_gate_up")


@pytest.mark.parametrize("second_consumer", [False, True])
def test_fp8_experts_take_dy_copy_from_unpermute(monkeypatch, second_consumer):
    """The FP8 experts' down-GEMM dgrad takes dy's rowwise FP8 copy from unpermute's
    backward (made from the token rows) instead of quantizing dy: no quantization pass
    over dy, and the gradients are those of the unfused path bit for bit. When ``y`` has
    a second consumer its gradient is a sum, the hand-off finds nothing, and the experts
    quantize dy themselves."""
    from linghe.bwd import handoff as fp8_handoff
    from linghe.fwd import grouped_mm as fwd_gm

    H, I, E, T, k = 256, 64, 5, 13, 3
    torch.manual_seed(0)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[2, 1] = -1
    probs = torch.rand(T, k)
    w1 = (torch.randn(E, 2 * I, H) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I) / I**0.5).to(torch.bfloat16)
    g = torch.randn(T, H)
    dy_quantized = []
    real_q = fwd_gm.quantize_grouped_fwd

    def spy(x, *a, **kw):
        if kw.get("rowwise") and not kw.get("columnwise") and x.shape[1] == H:
            dy_quantized.append(x.shape)
        return real_q(x, *a, **kw)

    monkeypatch.setattr(fwd_gm, "quantize_grouped_fwd", spy)

    def run():
        xi = x.clone().requires_grad_(True)
        pi = probs.clone().requires_grad_(True)
        a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        rows, prow, layout = linghe.permute(quantize_tokens(xi, pow2_scale=True), ids, pi,
                                            num_experts=E, align=16)
        y = grouped_swiglu(rows, prow, a, b, layout, fp8=True, pow2_scale=True)
        loss = (linghe.unpermute(y, layout).float() * g).sum()
        if second_consumer:
            loss = loss + y.float().sum() * 1e-3
        loss.backward()
        return [t.grad for t in (xi, pi, a, b)]

    fused = run()
    assert len(dy_quantized) == int(second_consumer)
    monkeypatch.setattr(fp8_handoff, "requested", lambda t: None)
    unfused = run()
    assert len(dy_quantized) == 1 + int(second_consumer)
    for name, a, b in zip(("dx", "dprobs", "d_gate_up", "d_down"), fused, unfused):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("T,E,k,I,shared,fp8_wgrad", [(7, 4, 2, 64, 0, True),
                                                      (3, 4, 1, 64, 1, True),
                                                      (7, 4, 2, 64, 1, False)])
def test_moe_fp8_vs_bf16_layer(T, E, k, I, shared, fp8_wgrad):
    """The FP8 layer (tokens quantized once, FP8 permute, fused FP8 experts) against the
    same layer in bf16: outputs and every gradient within FP8 tolerance; few tokens over
    many experts leave experts without tokens; the experts' weight gradients in FP8 or
    (the default) in bf16."""
    m = linghe.nn.MoE(128, E, k, I, num_shared_experts=shared, align=16,
                      dtype=torch.bfloat16)
    m.expert_bias.copy_(torch.randn(E) * 0.1)
    x = torch.randn(T, 128).to(torch.bfloat16)
    g = torch.randn(T, 128)
    res = []
    for fp8 in (False, True):
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        with linghe.TrainingContext(fp8="blockwise" if fp8 else None,
                                    expert_fp8_wgrad=fp8_wgrad):
            out, aux = m(xi)
        ((out.float() * g).sum() + aux.z_loss).backward()
        res.append((out, xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()},
                    aux.tokens_per_expert))
    (o0, dx0, g0, tpe), (o1, dx1, g1, _) = res
    assert int((tpe == 0).sum()) > 0 or T * k >= E
    assert_close(o1, o0, FP8_VS_EXACT, "out")
    assert_close(dx1, dx0, FP8_VS_EXACT, "dx")
    for n in g0:
        assert_close(g1[n], g0[n], FP8_VS_EXACT, f"d{n}")
    for e in range(E):
        if int(tpe[e]) == 0:
            assert torch.all(g1["experts_gate_up"][e] == 0)


def test_grouped_swiglu_bad_inputs():
    rows, probs, w1, w2, layout, _ = _expert_inputs([3, 4], 16, 128, 64)
    with pytest.raises(TypeError, match="layout must be an ExpertLayout"):
        grouped_swiglu(rows, probs, w1, w2, layout.offsets, fp8=True)
    with pytest.raises(ValueError, match="gate_up must have shape"):
        grouped_swiglu(rows, probs, w1[:, :, :64].contiguous(), w2, layout, fp8=True)
    with pytest.raises(ValueError, match="down must have shape"):
        grouped_swiglu(rows, probs, w1, w2[:, :, :32].contiguous(), layout, fp8=True)
    with pytest.raises(TypeError, match="rows' dtype"):
        grouped_swiglu(rows.float(), probs, w1, w2, layout, fp8=True)
    with pytest.raises(ValueError, match="probs_rows must have shape"):
        grouped_swiglu(rows, probs[:-1], w1, w2, layout, fp8=True)
    with pytest.raises(ValueError, match="num_rows"):
        grouped_swiglu(rows[:-1], probs[:-1], w1, w2, layout, fp8=True)
    with pytest.raises(TypeError, match="weight_caches"):
        grouped_swiglu(rows, probs, w1, w2, layout, fp8=True, weight_caches=(None, None))
    with pytest.raises(TypeError, match="needs fp8=True"):
        grouped_swiglu(linghe.quantize_1x128(rows), probs, w1, w2, layout)
    w1o = (torch.randn(2, 2 * 40, 128) / 11).to(torch.bfloat16)
    w2o = (torch.randn(2, 128, 40) / 7).to(torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_swiglu(rows, probs, w1o, w2o, layout, fp8=True)
    # high precision: any I (grouped_mm -> silu_mul -> grouped_mm)
    y = grouped_swiglu(rows.float(), probs, w1o.float(), w2o.float(), layout)
    assert_close(y, ref.grouped_swiglu(rows.double(), probs.double(), w1o.double(),
                                       w2o.double(), layout.offsets))
    with pytest.raises(TypeError, match="x must be a torch.Tensor|dtype"):
        quantize_tokens(torch.ones(3, 4, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.fp8_autotune()
@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8-wgrad", "bf16-wgrad"])
def test_grouped_swiglu_fp8_standard_shape_gpu(fp8_wgrad):
    """The FP8 expert FFN at the EP-8 shape (32 experts, 65536 routed rows, H 2048,
    I 1024, align 16; the autotuned GEMMs) against float32 math on the same bf16 inputs."""
    torch.manual_seed(0)
    E, T, k, H, I, align = 32, 8192, 8, 2048, 1024, 16
    ids = torch.randn(T, E).topk(k, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    segs = ref.expert_segments(counts, align)
    R = sum(p for *_, p in segs) + 100
    layout = make_expert_layout(counts.cuda(), align, R)
    real = ref.real_rows(segs, R, "cuda")
    rows = torch.randn(R, H, device="cuda").to(torch.bfloat16)
    rows[~real] = 0
    probs = torch.rand(R, device="cuda") * real
    w1 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda") / I**0.5).to(torch.bfloat16)
    g = torch.randn(R, H, device="cuda") * real[:, None]
    caches = (linghe.fp8.WeightCache(), linghe.fp8.WeightCache())
    out, grads = _grads_of(
        lambda r, p, a, b: grouped_swiglu(r, p, a, b, layout, fp8=True, pow2_scale=True,
                                          weight_caches=caches, fp8_wgrad=fp8_wgrad),
        (rows, probs, w1, w2), g)
    rout, rgrads = _grads_of(
        lambda r, p, a, b: ref.grouped_swiglu(r, p, a, b, layout.offsets),
        (rows.float(), probs, w1.float(), w2.float()), g)
    assert torch.all(out[~real] == 0)
    assert_close(out, rout, FP8_VS_EXACT, "out")
    for name, a, b in zip(("d_rows", "d_probs", "d_gate_up", "d_down"), grads, rgrads):
        assert_close(a, b, FP8_VS_EXACT, name)
