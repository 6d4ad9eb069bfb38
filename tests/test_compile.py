"""torch.compile of linghe ops: every public op traces with ``fullgraph=True`` (no graph
break) through its ``torch.library`` registration (linghe/library.py), and the compiled
forward and backward match eager linghe bit for bit (the same kernels run; eager linghe
is checked against linghe/reference.py by the per-family tests). A small model compiles
whole. On CPU the backend is ``aot_eager`` (AOTAutograd traces forward and backward, then
runs the graph eagerly: the custom ops, so the Triton interpreter); the GPU test runs
inductor.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._library.custom_ops import CustomOpDef

import linghe
from linghe import library
from linghe.fp8.tensor import Fp8Tensor
from linghe.functional.grouped_mm import quantize_grouped_1x128
from linghe.functional.moe import grouped_swiglu, quantize_tokens
from linghe.testing import assert_fp8_close, rel_err

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


ON_GPU = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _default_device(device):
    # On a GPU every tensor and module of these tests is made there. (Not set on CPU, the
    # default already: the default-device mode costs interpreter time.)
    if device != "cpu":
        torch.set_default_device(device)
    yield
    if device != "cpu":
        torch.set_default_device(None)


def _same(a, b, name):
    """Bit-identical tensors (fp8 compared as bytes), or both None. On a GPU, where
    kernels may pick other tiles or reduction orders per call site, within rounding
    (fp8 data within one e4m3 step)."""
    assert (a is None) == (b is None), name
    if a is None:
        return
    assert isinstance(a, Fp8Tensor) == isinstance(b, Fp8Tensor), name
    if isinstance(a, Fp8Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype and a.scaling == b.scaling, name
        for c in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
            _same(getattr(a, c), getattr(b, c), f"{name}.{c}")
        return
    assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
    if ON_GPU and a.dtype in FP8_DTYPES:
        assert_fp8_close(a, b, name)
    elif ON_GPU:
        torch.testing.assert_close(a, b, equal_nan=True, msg=name)
    else:
        if a.dtype in FP8_DTYPES:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)


def _loss(outs, cots):
    total = 0
    for o, c in zip(outs, cots):
        if c is not None:
            o = o.dequantize() if isinstance(o, Fp8Tensor) else o
            total = total + (o.float() * c).sum()
    return total


def check_compiles(fn, *args, backward=True, params=()):
    """Compile ``fn`` (fullgraph, aot_eager), check no graph break, and that outputs and
    the gradients of every input requiring grad (and of ``params``) equal eager linghe's."""
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out_c = _flat(compiled(*args))
    out_e = _flat(fn(*args))
    assert len(out_c) == len(out_e)
    for i, (a, b) in enumerate(zip(out_c, out_e)):
        _same(a, b, f"output {i}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    leaves += list(params)
    if not backward or not leaves:
        return out_c
    # The same random cotangent for every differentiable output, compiled and eager.
    cots = [torch.randn(o.shape) if (o is not None and o.requires_grad) else None
            for o in out_e]
    g_c = torch.autograd.grad(_loss(out_c, cots), leaves, allow_unused=True)
    g_e = torch.autograd.grad(_loss(out_e, cots), leaves, allow_unused=True)
    for i, (a, b) in enumerate(zip(g_c, g_e)):
        _same(a, b, f"grad {i}")
    return out_c


def fp8_parts(t: Fp8Tensor):
    """An Fp8Tensor as plain outputs: its components and its (differentiable) dequantized
    value. (A compiled region cannot return an Fp8Tensor that requires grad: AOTAutograd
    would expect an Fp8Tensor gradient for it; see linghe/library.py.)"""
    parts = [getattr(t, c) for c in ("rowwise_data", "rowwise_scale", "columnwise_data",
                                     "columnwise_scale")]
    return (*parts, t.dequantize(columnwise=t.rowwise_data is None))


def _leaf(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


# ------------------------------------------------------------------------------ norm
def test_rms_norm():
    x, w, r = _leaf(3, 5, 200), _leaf(200), _leaf(3, 5, 200)
    check_compiles(lambda x, w, r: (linghe.rms_norm(x, w, 1e-5), linghe.rms_norm(x, w, 1e-5, r)),
                   x, w, r)


def test_rms_norm_quant():
    x, w = _leaf(130, 136, dtype=torch.bfloat16), _leaf(136)
    # fp8_parts dequantizes inside the region: the Fp8Tensor carries autograd there.
    out = check_compiles(lambda x, w: fp8_parts(linghe.rms_norm_quant(x, w)), x, w)
    assert out[2] is not None  # the columnwise copy
    check_compiles(lambda x, w: fp8_parts(linghe.rms_norm_quant(x, w, columnwise=False,
                                                                pow2_scale=True)), x, w)


def test_quantize():
    x, w = _leaf(3, 43, 200, grad=False), _leaf(130, 200, grad=False)
    check_compiles(lambda x, w: (
        linghe.quantize_1x128(x, columnwise=True),
        linghe.quantize_1x128(x, rowwise=False, columnwise=True, pow2_scale=True),
        linghe.quantize_128x128(w, columnwise=True), linghe.quantize_128x128(w)), x, w)


# ------------------------------------------------------------------------------ rope
@pytest.mark.parametrize("norm,packed", [(True, True), (False, False)])
def test_qk_norm_rope(norm, packed):
    B, S, H, Hkv, D = 1, 3, 2, 1, 8
    qkv = _leaf(S, B, (H + 2 * Hkv) * D)
    freqs = linghe.rope_freqs(16, 4)
    w = (_leaf(D), _leaf(D)) if norm else (None, None)
    pos = torch.randint(0, 16, (B, S)) if packed else None
    check_compiles(lambda qkv, qw, kw, pos: linghe.qk_norm_rope(
        qkv, freqs, num_heads=H, num_kv_heads=Hkv, q_norm_weight=qw, k_norm_weight=kw,
        rotary_dim=4, position_ids=pos), qkv, *w, pos)


def test_apply_rope():
    B, H, Hk, S, D = 2, 3, 1, 5, 8
    q, k = _leaf(B, S, H, D).transpose(1, 2), _leaf(B, Hk, S, D)
    cos, sin = torch.randn(S, D), torch.randn(S, D)
    check_compiles(lambda q, k: linghe.apply_rope(q, k, cos, sin), q, k)


# ------------------------------------------------------------------------------ gate
def test_group_rms_norm_gate():
    B, S, H, d = 2, 3, 4, 6
    x, gate, w = _leaf(B, S, H, d), _leaf(S, B, H * d), _leaf(H * d)
    check_compiles(lambda x, g, w: linghe.group_rms_norm_gate(x, g, w, num_groups=2), x, gate, w)


# ------------------------------------------------------------------------------ activation
def test_silu_mul():
    x, p = _leaf(3, 4, 2 * 37), _leaf(3, 4)
    check_compiles(lambda x, p: (linghe.silu_mul(x), linghe.silu_mul(x, p)), x, p)


def test_silu_mul_quant():
    x, p = _leaf(131, 2 * 40, dtype=torch.bfloat16), _leaf(131)
    check_compiles(lambda x, p: fp8_parts(linghe.silu_mul_quant(x, p)), x, p)
    check_compiles(lambda x: fp8_parts(linghe.silu_mul_quant(x, columnwise=False)), x)


# ------------------------------------------------------------------------------ router
def test_router():
    T, E, K = 9, 12, 24
    x, w = _leaf(T, K, dtype=torch.bfloat16), _leaf(E, K)
    bias = torch.randn(E)

    def route(x, w):
        logits = linghe.router_logits(x, w)
        probs, ids, tpe = linghe.topk_route(logits, 3, score="sigmoid", expert_bias=bias,
                                            num_groups=4, topk_groups=2, scale=2.5)
        return logits, probs, ids, tpe, linghe.router_z_loss(logits)

    check_compiles(route, x, w)
    check_compiles(lambda l: linghe.topk_route(l, 2), _leaf(T, E))


# ------------------------------------------------------------------------------ loss
def test_cross_entropy():
    N, V = 9, 300
    logits = _leaf(N, V, dtype=torch.bfloat16)
    labels = torch.randint(0, V, (N,))
    labels[2] = -100
    check_compiles(lambda l: [linghe.cross_entropy(l, labels, reduction=r, label_smoothing=0.1,
                                                   z_loss=1e-3) for r in ("mean", "none")],
                   logits)


@pytest.mark.parametrize("reduction,bias", [("mean", True), ("none", False)])
def test_linear_cross_entropy(reduction, bias):
    N, H, V = 11, 24, 70
    h, w = _leaf(N, H), _leaf(V, H)
    b = _leaf(V) if bias else None
    labels = torch.randint(0, V, (N,))
    labels[0] = -100
    check_compiles(lambda h, w, b: linghe.linear_cross_entropy(
        h, w, labels, bias=b, reduction=reduction, chunk_size=4), h, w, b)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_fp8_lm_head(reduction):
    N, H, V = 11, 128, 70
    h, w = _leaf(N, H), _leaf(V, H)
    labels = torch.randint(0, V, (N,))
    with linghe.TrainingContext(fp8="blockwise", lm_head_fp8=True):
        check_compiles(lambda h, w: linghe.linear_cross_entropy(
            h, w, labels, reduction=reduction, chunk_size=4), h, w)


# ------------------------------------------------------------------------------ Linear
@pytest.mark.parametrize("recipe,fp8_wgrad,inputs", [("blockwise", True, "both"),
                                                     ("blockwise", False, "fp8"),
                                                     ("tensorwise", True, "plain")])
def test_fp8_linear(recipe, fp8_wgrad, inputs):
    norm = linghe.nn.RMSNorm(136)
    lin = linghe.nn.Linear(136, 40)
    x = _leaf(2, 9, 136, dtype=torch.bfloat16)
    params = [norm.weight, lin.weight, lin.bias]

    def fn(x):
        # blockwise: RMSNorm returns an Fp8Tensor that the Linear consumes as is ("fp8").
        return ((lin(norm(x)),) if inputs != "plain" else ()) + \
            ((lin(x),) if inputs != "fp8" else ())

    with linghe.TrainingContext(fp8=recipe, fp8_wgrad=fp8_wgrad):
        check_compiles(fn, x, params=params)


def test_linear_recipe_guard_and_delayed():
    lin = linghe.nn.Linear(136, 40)
    x = _leaf(20, 136)
    f = torch.compile(lambda x: lin(x), fullgraph=True, backend="aot_eager")
    with linghe.TrainingContext(fp8="blockwise"):
        y_fp8 = f(x)
        _same(y_fp8, lin(x), "blockwise")
    # Outside the context the compiled function must not reuse the FP8 graph.
    y_hp = f(x)
    _same(y_hp, torch.nn.functional.linear(x, lin.weight, lin.bias), "no recipe")
    assert not torch.equal(y_fp8, y_hp)
    with linghe.TrainingContext(fp8="delayed"), \
            pytest.raises(RuntimeError, match="'delayed' FP8 recipe does not run under"):
        f(x)


# ------------------------------------------------------------------------------ permute
# (plain rows and the bf16 grouped GEMM run in test_model_compiles_fullgraph)
def test_permute_unpermute_fp8_rows():
    T, H, E, k = 13, 136, 5, 2
    x = _leaf(T, H, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    ids[3, 1] = -1  # not routed
    probs, w = _leaf(T, k), _leaf(H)

    def moe_move(x, probs, w):
        # FP8 rows: an Fp8Tensor that carries autograd (straight-through) to x and w.
        src = linghe.rms_norm_quant(x, w, columnwise=False)
        rows, prow, layout = linghe.permute(src, ids, probs, num_experts=E, align=4)
        out = linghe.unpermute(rows.dequantize() * 2, layout, probs)
        return out, prow, layout.row_index, layout.offsets, layout.tokens_per_expert

    check_compiles(moe_move, x, probs, w)


# ------------------------------------------------------------------------------ grouped_mm
def test_grouped_mm_fp8():
    E, N, K, T, k = 2, 128, 72, 5, 2
    x = _leaf(T, K, dtype=torch.bfloat16)
    w = _leaf(E, N, K, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)

    def experts(x, w):
        rows, _, layout = linghe.permute(x, ids, num_experts=E, align=8)
        return linghe.grouped_mm(rows, w, layout, fp8=True)

    check_compiles(experts, x, w)


def test_grouped_swiglu_fp8_fallback():
    # Under compile, grouped_swiglu(fp8=True) runs the unfused FP8 path (documented in
    # linghe.library.grouped_swiglu_fp8): bit-exact with that path in eager, and within
    # FP8 rounding of eager's fused autograd node.
    E, H, I, T = 2, 128, 64, 3
    ids = torch.randint(0, E, (T, 2), dtype=torch.int32)
    x, pr = _leaf(T, H, dtype=torch.bfloat16), _leaf(T, 2)
    w1, w2 = _leaf(E, 2 * I, H, dtype=torch.bfloat16), _leaf(E, H, I, dtype=torch.bfloat16)
    leaves = (x, pr, w1, w2)

    def experts(x, pr, w1, w2, unfused=False):
        # FP8 tokens as nn.MoE moves them: quantized once, permuted with their scales
        rows, prow, layout = linghe.permute(quantize_tokens(x), ids, pr, num_experts=E,
                                            align=8)
        if unfused:
            rows = rows.dequantize()
            h = linghe.grouped_mm(rows, w1, layout, fp8=True, backend="triton")
            return linghe.grouped_mm(linghe.silu_mul(h, prow), w2, layout, fp8=True,
                                     backend="triton")
        return grouped_swiglu(rows, prow, w1, w2, layout, fp8=True)

    counters.clear()
    out_c = torch.compile(experts, fullgraph=True, backend="aot_eager")(*leaves)
    assert not counters["graph_break"]
    cot = torch.randn(out_c.shape)
    g_c = torch.autograd.grad((out_c.float() * cot).sum(), leaves)
    for unfused, check in ((True, _same), (False, None)):
        out_e = experts(*leaves, unfused=unfused)
        g_e = torch.autograd.grad((out_e.float() * cot).sum(), leaves)
        for i, (a, b) in enumerate(zip((out_c, *g_c), (out_e, *g_e))):
            if check is not None:
                check(a, b, f"unfused {i}")
            else:
                # two FP8 chains that group the SwiGLU output and dy differently: about
                # 1-3% apart (e4m3 keeps 3 mantissa bits)
                assert rel_err(a, b) < 0.06, (i, rel_err(a, b))


def test_fp8_gemm_kernels():
    # The kernel-level FP8 GEMMs (no autograd) on operands quantized inside the region.
    E, N, K, T = 2, 128, 40, 3
    ids = torch.randint(0, E, (T, 2), dtype=torch.int32)
    x, w, d = _leaf(T, K, grad=False), _leaf(E, N, K, grad=False), _leaf(40, N, grad=False)

    def kernels(x, w, d):
        rows, _, layout = linghe.permute(x, ids, num_experts=E, align=8)
        a = linghe.quantize_1x128(rows, columnwise=True)
        wq = linghe.quantize_grouped_weight(w)
        g = linghe.quantize_1x128(d[:rows.shape[0]], columnwise=True)
        w2 = linghe.quantize_128x128(w[0], columnwise=True)
        # wgrad with columnwise groups per expert segment on both sides
        a_seg = quantize_grouped_1x128(rows, layout)
        g_seg = quantize_grouped_1x128(d[:rows.shape[0]], layout)
        return (linghe.grouped_mm_fp8(a, wq, layout), linghe.grouped_mm_fp8_dgrad(g, wq, layout),
                linghe.grouped_mm_fp8_wgrad(g, a, layout), linghe.fp8.gemm.fprop(a, w2),
                linghe.grouped_mm_fp8_wgrad(g_seg, a_seg, layout), a_seg.col_segments)

    check_compiles(kernels, x, w, d)


def test_batch_silu_mul_quant():
    E, T, k, n = 3, 20, 2, 40
    x = _leaf(T, 2 * n, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)

    def experts(x, probs):
        rows, prow, layout = linghe.permute(x, ids, probs, num_experts=E, align=8)
        y, g_off = linghe.batch_silu_mul_quant(rows, prow, layout=layout)
        return (*fp8_parts(y)[:4], y.col_segments, g_off, y.dequantize(),
                y.dequantize(columnwise=True))

    check_compiles(experts, x, _leaf(T, k))


def test_dynamic_shapes():
    # One graph for several token counts (symbolic shapes through the fake implementations
    # and the Fp8Tensor autograd Functions).
    w = _leaf(40)

    def fn(x):
        q = linghe.rms_norm_quant(x, w)
        return q.dequantize(columnwise=True).square().sum() + linghe.rms_norm(x, w).sum()

    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for M in (9, 5):
        x = _leaf(M, 40)
        out_c, out_e = compiled(x), fn(x)
        _same(out_c, out_e, f"M={M}")
        for a, b in zip(torch.autograd.grad(out_c, (x, w)), torch.autograd.grad(out_e, (x, w))):
            _same(a, b, f"grad M={M}")
    assert counters["stats"]["unique_graphs"] == 1


# ------------------------------------------------------------------------------ a model
class TinyMoEModel(torch.nn.Module):
    """RMSNorm -> Linear -> SwiGLU -> MoE (router, permute, grouped GEMMs, shared expert)
    -> RMSNorm -> linear cross entropy, with linghe.nn modules."""

    def __init__(self, H, I, V, E, num_groups=1, align=16, dtype=torch.float32, device=None):
        super().__init__()
        fk = {"dtype": dtype, "device": device}
        self.norm = linghe.nn.RMSNorm(H, **fk)
        self.proj = linghe.nn.Linear(H, H, bias=False, **fk)
        self.mlp = linghe.nn.SwiGLU(H, I, **fk)
        self.moe = linghe.nn.MoE(H, E, 2, I, num_shared_experts=1, num_groups=num_groups,
                                 align=align, **fk)
        self.out_norm = linghe.nn.RMSNorm(H, **fk)
        self.out_norm.quantize_output = False  # feeds the high-precision LM head
        self.head = torch.nn.Parameter(torch.randn(V, H, **fk) * 0.05)

    def forward(self, x, labels):
        h = self.proj(self.norm(x))
        h = h + self.mlp(h)
        m, aux = self.moe(h)
        h = (h + m).reshape(-1, h.shape[-1])
        loss = linghe.linear_cross_entropy(self.out_norm(h), self.head, labels)
        return loss + 1e-3 * aux.z_loss


def _check_model(model, x, labels, backend):
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    loss_c = compiled(x, labels)
    loss_c.backward()
    grads_c = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss_e = model(x, labels)
    loss_e.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    return loss_c, loss_e, grads_c, [p.grad for p in model.parameters()]


def test_model_compiles_fullgraph():
    torch.manual_seed(0)
    # (small: the interpreter runs every kernel twice, compiled and eager)
    model = TinyMoEModel(H=40, I=24, V=77, E=3, align=8)
    x, labels = torch.randn(1, 5, 40), torch.randint(0, 77, (5,))
    loss_c, loss_e, grads_c, grads_e = _check_model(model, x, labels, "aot_eager")
    _same(loss_c, loss_e, "loss")
    for i, (a, b) in enumerate(zip(grads_c, grads_e)):
        _same(a, b, f"grad of parameter {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [None, "blockwise"])
def test_model_inductor_gpu(fp8):
    # Inductor generates its own kernels around linghe's ops, so the result matches eager
    # linghe within rounding, not bit for bit.
    torch.manual_seed(0)
    model = TinyMoEModel(H=256, I=128, V=1000, E=8, num_groups=4, dtype=torch.bfloat16,
                         device="cuda")
    x = torch.randn(2, 96, 256, dtype=torch.bfloat16, device="cuda")
    labels = torch.randint(0, 1000, (192,), device="cuda")
    with linghe.TrainingContext(fp8=fp8):
        loss_c, loss_e, grads_c, grads_e = _check_model(model, x, labels, "inductor")
    torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_c, grads_e):
        assert rel_err(a, b) < 5e-2


# ------------------------------------------------------------------------------ opcheck
def _opcheck_cases():
    """``(op, args, full)`` for every linghe custom op, at small shapes with tails (rows
    past a 128-group, partial blocks). ``full``: every opcheck test (schema: no mutation
    or aliasing; the autograd registration; AOT dispatch); otherwise the fake
    implementation against the real outputs (shapes, dtypes, strides), which is what a
    compiled graph relies on."""
    L = torch.ops.linghe
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    r = lambda *s, dtype=f32, grad=False: torch.randn(*s, dtype=dtype).requires_grad_(grad)
    x, w = r(130, 136, dtype=bf), r(136)
    _, _, rstd = L.rms_norm_fwd(x, w, None, 1e-6)
    qkv, freqs, qw = r(3, 2, 32), linghe.rope_freqs(16, 4), r(8)
    rope = (2, 1, 8, 4, "sbh", True, 1e-6)
    x3, gate, gw = r(2, 3, 12), r(3, 2, 12), r(12)
    xs, p = r(5, 74), r(5)
    xr, wr = r(9, 24, dtype=bf), r(12, 24)
    logits = r(9, 12)
    probs, ids, _ = L.topk_route_fwd(logits, 3, True, r(12), 4, 2, True, 2.5)
    _, lse_z = L.router_z_loss_fwd(logits)
    cl, labels = r(9, 300, dtype=bf), torch.randint(0, 300, (9,))
    _, lse, inv_n = L.cross_entropy_fwd(cl, labels, -100, "mean", 0.1, 1e-3)
    h, wv = r(11, 24), r(70, 24)
    lab11 = torch.randint(0, 70, (11,))
    _, _, _, _, _, lse_h = L.linear_cross_entropy_fwd(h, wv, None, lab11, -100, "none", 0.0,
                                                      0.0, 4, False, False, False, False,
                                                      True, False)
    xl, wl = r(20, 136, dtype=bf), r(40, 136)
    _, xc, xcs, wc, wcs = L.fp8_linear_fwd(xl, None, None, None, bf, wl, None, "blockwise",
                                           True, True)
    T, k, E, H = 13, 2, 5, 136
    eids = torch.randint(0, E, (T, k), dtype=i32)
    xp, pp = r(T, H, dtype=bf), r(T, k)
    rows, prow, lay = linghe.permute(xp, eids, pp, num_experts=E, align=8)
    li = (lay.row_index, lay.tokens_per_expert, lay.offsets)
    R = lay.num_rows
    # grouped GEMMs: fewer rows (the interpreter's GEMMs are slow)
    g_rows, _, g_lay = linghe.permute(r(5, 72, dtype=bf), eids[:5] % 2, num_experts=2,
                                      align=8)
    go, gR = g_lay.offsets, g_lay.num_rows
    wg = r(2, 128, 72, dtype=bf)
    _, ac, acs, wgc, wgcs = L.grouped_mm_fp8_fwd(g_rows, wg, go, False, True, True)
    gq = linghe.quantize_1x128(r(gR, 128), columnwise=True)
    aq = linghe.quantize_1x128(g_rows, rowwise=True, columnwise=True)
    wgq = linghe.quantize_grouped_weight(wg)
    return [
        (L.rms_norm_fwd, (r(7, 136, grad=True), r(136, grad=True), r(7, 136, grad=True),
                          1e-6), True),
        (L.rms_norm_bwd, (r(130, 136, dtype=bf), x, w, rstd, None, True), False),
        (L.rms_norm_quant_fwd, (x, w, 1e-6, True, False), False),
        (L.quantize_1x128, (x, True, True, True), False),
        (L.quantize_128x128, (r(130, 136), True, False), False),
        (L.qk_norm_rope_fwd, (qkv, freqs, None, qw, r(8), *rope), False),
        (L.qk_norm_rope_bwd, (r(2, 3, 2, 8), r(2, 3, 1, 8), r(2, 3, 1, 8), qkv, freqs, None,
                              qw, r(8), *rope, [3, 2, 32], f32), False),
        (L.apply_rope_fwd, (r(1, 2, 3, 8), r(1, 1, 3, 8), r(1, 3, 8), r(1, 3, 8), None),
         False),
        (L.apply_rope_bwd, (r(1, 2, 3, 8), r(1, 1, 3, 8), r(1, 3, 8), r(1, 3, 8), None),
         False),
        (L.group_rms_norm_gate_fwd, (x3, gate, gw, 2, 1e-6, "sbh"), False),
        (L.group_rms_norm_gate_bwd, (r(3, 2, 12), x3, gate, gw, 2, 1e-6, "sbh"), False),
        (L.silu_mul_fwd, (r(5, 74, grad=True), r(5, grad=True)), True),
        (L.silu_mul_bwd, (r(5, 37), xs, p, True, None, 1), False),
        (L.silu_mul_quant_fwd, (r(130, 80, dtype=bf), r(130), True, False), False),
        (L.batch_silu_mul_quant_fwd, (r(R, 80, dtype=bf), prow, lay.tokens_per_expert, 8,
                                      True, False), False),
        (L.router_logits_fwd, (xr, wr), False),
        (L.router_logits_bwd, (r(9, 12), xr, wr, True, True), False),
        (L.topk_route_fwd, (logits, 3, True, r(12), 4, 2, True, 2.5), False),
        (L.topk_route_bwd, (r(9, 3), logits, ids, True, True, 2.5), False),
        (L.router_z_loss_fwd, (r(9, 12),), False),
        (L.router_z_loss_bwd, (r(()), logits, lse_z), False),
        (L.cross_entropy_fwd, (r(9, 300, dtype=bf), labels, -100, "mean", 0.1, 1e-3), False),
        (L.cross_entropy_bwd, (cl, labels, lse, r(()), inv_n, -100, 0.1, 1e-3), False),
        (L.linear_cross_entropy_fwd, (h, wv, r(70), lab11, -100, "mean", 0.0, 0.0, 4, True,
                                      True, True, False, True, False), False),
        # the FP8 head, its weight gradient FP8 (fp8_wgrad) and not
        (L.linear_cross_entropy_fwd, (h, wv, None, lab11, -100, "sum", 0.0, 0.0, 4, True,
                                      True, False, True, True, True), False),
        (L.linear_cross_entropy_fwd, (h, wv, None, lab11, -100, "sum", 0.0, 0.0, 4, True,
                                      True, False, True, True, False), False),
        (L.linear_cross_entropy_bwd, (r(11), h, wv, None, lab11, lse_h, -100, 0.0, 0.0, 4,
                                      True, True, False, False, True, False), False),
        (L.linear_cross_entropy_bwd, (r(11), h, wv, None, lab11, lse_h, -100, 0.0, 0.0, 4,
                                      True, True, False, True, True, True), False),
        (L.fp8_linear_fwd, (xl, None, None, None, bf, wl, r(40), "tensorwise", False, True),
         False),
        (L.fp8_linear_bwd, (r(20, 40, dtype=bf), wc, wcs, xc, xcs, None, "blockwise", True,
                            True, True, bf, f32), False),
        (L.permute_index, (eids, E, 8, R), False),
        (L.permute_fwd, (xp, None, pp, *li, R), False),
        (L.permute_bwd, (r(R, H), r(R), lay.row_index, bf), False),
        (L.unpermute_fwd, (rows, pp, *li), False),
        (L.unpermute_bwd, (r(T, H), pp, rows, *li, R, bf), False),
        (L.embedding_fwd, (torch.randint(0, 30, (13,)), r(30, 24, grad=True), 2), True),
        (L.embedding_bwd, (r(13, 24, dtype=bf), torch.randint(0, 30, (13,)), 30, -1, bf), False),
        (L.grouped_mm_fwd, (g_rows, r(2, 40, 72, dtype=bf), go, "auto"), False),
        (L.grouped_mm_bwd, (r(gR, 40, dtype=bf), g_rows, r(2, 40, 72, dtype=bf), go, "auto",
                            bf), False),
        (L.grouped_mm_fp8_fwd, (g_rows, wg, go, False, True, True), False),
        (L.grouped_mm_fp8_bwd, (r(gR, 128, dtype=bf), ac, acs, wgc, wgcs, go, False, bf, bf,
                                72), False),
        (L.grouped_mm_fp8_kernel, ("fwd", aq.rowwise_data, aq.rowwise_scale, wgq.rowwise_data,
                                   wgq.rowwise_scale, go, 128, 72, bf, False, 1), False),
        (L.grouped_mm_fp8_kernel, ("dgrad", gq.rowwise_data, gq.rowwise_scale,
                                   wgq.columnwise_data, wgq.columnwise_scale, go, 128, 72, bf,
                                   False, 1), False),
        (L.grouped_mm_fp8_kernel, ("wgrad", gq.columnwise_data, gq.columnwise_scale,
                                   aq.columnwise_data, aq.columnwise_scale, go, 128, 72, f32,
                                   False, 1), False),
        (L.quantize_grouped_1x128, (g_rows, None, g_lay.tokens_per_expert, 8, True, True,
                                    False), False),
        (L.fp8_gemm, (xc.t().contiguous(), r(20, 2).abs(), wc.t().contiguous(),
                      r(1, 2).abs(), "1x128", "128x128", f32, r(40), "auto"), False),
    ]


def test_opcheck():
    """Fake implementations give exactly the real outputs' metadata, for every op."""
    cases = _opcheck_cases()
    registered = {v._qualname for v in vars(library).values() if isinstance(v, CustomOpDef)}
    checked = {op._qualified_op_name for op, _, _ in cases}
    assert registered <= checked, f"ops without an opcheck case: {registered - checked}"
    for op, args, full in cases:
        kw = {} if full else {"test_utils": ("test_faketensor",)}
        torch.library.opcheck(op, args, **kw)
