"""linghe.nn.Linear under TrainingContext, linghe.nn.convert, and FP8 convergence."""

import os
import sys

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.functional.linear import fp8_linear
from linghe.testing import assert_close, rel_err

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import train_tiny_decoder as tiny  # noqa: E402


def dq_tol(device):
    # vs the dequantized-operand fp32 reference: Hopper FP8 MMA accumulation is not IEEE
    # fp32 (~1e-4 rel err on an H200); the CPU interpreter is exact.
    return 1e-3 if str(device).startswith("cuda") else 1e-5

RECIPES = ["blockwise", "tensorwise", "delayed"]


def _pair(in_f, out_f, device, dtype, bias=True):
    lin = linghe.nn.Linear(in_f, out_f, bias=bias, device=device, dtype=dtype)
    base = torch.nn.Linear(in_f, out_f, bias=bias, device=device, dtype=dtype)
    base.load_state_dict(lin.state_dict())
    return lin, base


def test_same_constructor_state_dict_repr(device):
    lin, base = _pair(48, 80, device, torch.bfloat16)
    assert isinstance(lin, torch.nn.Linear)
    assert repr(lin) == repr(base)
    assert list(lin.state_dict()) == list(base.state_dict()) == ["weight", "bias"]
    assert lin.weight.dtype == torch.bfloat16 and lin.weight.device.type == device
    nb = linghe.nn.Linear(16, 32, bias=False)
    assert nb.bias is None and list(nb.state_dict()) == ["weight"]


@pytest.mark.parametrize("ctx", [None, "none-context"])
def test_outside_fp8_bitwise_equal_to_torch(device, ctx):
    lin, base = _pair(100, 130, device, torch.bfloat16)
    x = torch.randn(3, 37, 100, device=device, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    if ctx is None:
        y1 = lin(x1)
    else:
        with linghe.TrainingContext(fp8="blockwise"), linghe.TrainingContext(fp8=None):
            y1 = lin(x1)
    y2 = base(x2)
    g = torch.randn_like(y2)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(lin.weight.grad, base.weight.grad)
    assert torch.equal(lin.bias.grad, base.bias.grad)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(1, 100, 17), (37, 260, 130), (2, 150, 64, 48)])
def test_fp8_forward_backward(device, recipe, shape):
    *lead, K, N = shape
    lin, base = _pair(K, N, device, torch.float32)
    x = torch.randn(*lead, K, device=device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with linghe.TrainingContext(fp8=recipe):
        y1 = lin(x1)
        g = torch.randn_like(y1) * 1e-2
        y1.backward(g)
    y2 = base(x2)
    y2.backward(g)
    assert y1.shape == y2.shape and y1.dtype == torch.float32
    tol_g = 6e-2 if recipe == "blockwise" else 0.12  # e5m2 gradients in per-tensor recipes
    assert_close(y1, y2, tol=6e-2, name="y")
    assert_close(x1.grad, x2.grad, tol=tol_g, name="dx")
    assert_close(lin.weight.grad, base.weight.grad, tol=tol_g, name="dw")
    assert_close(lin.bias.grad, base.bias.grad, tol=1e-5, name="db")  # dY.sum(0), exact


def test_blockwise_matches_dequantized_reference(device):
    M, K, N = 70, 260, 130
    lin = linghe.nn.Linear(K, N, device=device)
    x = torch.randn(M, K, device=device, requires_grad=True)
    with linghe.TrainingContext(fp8="blockwise", pow2_scale=False):
        y = lin(x)
        dy = torch.randn(M, N, device=device)
        y.backward(dy)
    xq = linghe.quantize_1x128(x.detach(), columnwise=True)
    wq = linghe.quantize_128x128(lin.weight.detach(), columnwise=True)
    dyq = linghe.quantize_1x128(dy, columnwise=True)
    assert_close(y, ref.fp8_gemm(xq.rowwise_data, xq.rowwise_scale, wq.rowwise_data,
                                 wq.rowwise_scale, bias=lin.bias.detach()), tol=dq_tol(device))
    assert_close(x.grad, ref.fp8_gemm(dyq.rowwise_data, dyq.rowwise_scale, wq.columnwise_data,
                                      wq.columnwise_scale), tol=dq_tol(device))
    assert_close(lin.weight.grad, ref.fp8_gemm(dyq.columnwise_data, dyq.columnwise_scale,
                                               xq.columnwise_data, xq.columnwise_scale,
                                               "1x128", "1x128"), tol=dq_tol(device))


def test_bf16_wgrad_option(device):
    lin, base = _pair(96, 80, device, torch.bfloat16)
    x = torch.randn(50, 96, device=device, dtype=torch.bfloat16)
    with linghe.TrainingContext(fp8="blockwise", fp8_wgrad=False):
        y = lin(x)
        y.float().sum().backward()
    base(x).float().sum().backward()
    # dW from the bf16 dY and x (not FP8): bf16-level agreement.
    assert_close(lin.weight.grad, base.weight.grad, tol=1e-2)
    assert lin.weight.grad.dtype == torch.bfloat16


def test_fp8_tensor_input_not_requantized(device, monkeypatch):
    M, K, N = 40, 256, 64
    lin = linghe.nn.Linear(K, N, device=device, dtype=torch.bfloat16)
    x = torch.randn(2, M // 2, K, device=device, dtype=torch.bfloat16)
    xq = linghe.quantize_1x128(x, columnwise=True, pow2_scale=True).requires_grad_()
    calls = []
    real = linghe.fp8.recipe.quantize_1x128
    real_launch = linghe.fp8.recipe.quantize_1x128_launch

    def spy(t, **kw):
        calls.append(tuple(t.shape))
        return real(t, **kw)

    def spy_launch(t, *args):
        calls.append(tuple(t.shape))
        return real_launch(t, *args)

    monkeypatch.setattr(linghe.fp8.recipe, "quantize_1x128", spy)
    monkeypatch.setattr(linghe.fp8.recipe, "quantize_1x128_launch", spy_launch)
    with linghe.TrainingContext(fp8="blockwise"):
        y = lin(xq)
        y.float().sum().backward()
    assert calls == [(M, N)]  # only dY was quantized, never the Fp8Tensor input
    assert y.shape == (2, M // 2, N) and y.dtype == torch.bfloat16
    assert type(xq.grad) is torch.Tensor and xq.grad.shape == x.shape
    # Same numbers as quantizing x inside the layer.
    with linghe.TrainingContext(fp8="blockwise"):
        y2 = lin(x)
    assert torch.equal(y, y2)


def test_fp8_tensor_input_with_one_copy(device):
    lin = linghe.nn.Linear(128, 64, device=device)
    x = torch.randn(33, 128, device=device)
    xr = linghe.quantize_1x128(x, pow2_scale=True).requires_grad_()  # rowwise only
    with linghe.TrainingContext(fp8="blockwise"):
        y = lin(xr)
        y.sum().backward()  # wgrad needs the columnwise copy: quantized from the rowwise one
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
    assert rel_err(lin.weight.grad, torch.ones(33, 64, device=device).t() @ x) < 0.1
    # Another recipe's Fp8Tensor (tensorwise) is dequantized and requantized.
    xt = linghe.fp8.quantize_tensorwise(x)
    with linghe.TrainingContext(fp8="blockwise"):
        y3 = lin(xt)
    assert rel_err(y3, x @ lin.weight.t() + lin.bias) < 0.1


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adam_foreach", "adamw_fused"])
def test_weight_cache_invalidated_by_optimizer_step(device, opt_name):
    # (fused optimizers update the parameters without bumping their version counter: the
    # caches see the step through the optimizer-step hook)
    lin = linghe.nn.Linear(128, 64, device=device)
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.5),
           "adam": lambda p: torch.optim.Adam(p, lr=0.1, foreach=False),
           "adam_foreach": lambda p: torch.optim.Adam(p, lr=0.1, foreach=True),
           "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True)}[opt_name](
        lin.parameters())
    cache = lin._fp8_weight_cache
    x = torch.randn(16, 128, device=device)
    ctx = linghe.TrainingContext(fp8="blockwise")
    with ctx:
        y0 = lin(x)
        y0b = lin(x)  # same step: cached
        y0.sum().backward()
    assert (cache.misses, cache.hits) == (1, 1) and torch.equal(y0, y0b)
    opt.step()
    with ctx:
        y1 = lin(x)
    assert cache.misses == 2
    # The new quantized weight is the one of the updated weight.
    wq = linghe.quantize_128x128(lin.weight.detach(), pow2_scale=True)
    torch.testing.assert_close(cache.value.rowwise_scale, wq.rowwise_scale)
    assert torch.equal(cache.value.rowwise_data.float(), wq.rowwise_data.float())
    assert not torch.equal(y0, y1)
    with torch.no_grad():  # replacing the storage invalidates too
        lin.weight.data = lin.weight.data * 2
    with ctx:
        lin(x)
    assert cache.misses == 3


def test_invalidate_weight_caches(device):
    lin = linghe.nn.Linear(128, 64, device=device)
    x = torch.randn(4, 128, device=device)
    with linghe.TrainingContext(fp8="blockwise"):
        lin(x)
        with torch.no_grad():
            lin.weight.data.mul_(2)  # through .data: a write the cache cannot see
        lin(x)
        assert lin._fp8_weight_cache.misses == 1
        linghe.fp8.invalidate_weight_caches()
        y = lin(x)
    assert lin._fp8_weight_cache.misses == 2
    assert rel_err(y, x @ lin.weight.t() + lin.bias) < 0.1


def test_convert(device):
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Linear(256, 96), torch.nn.Linear(96, 100)),  # 100 % 16
        torch.nn.Linear(100, 8),  # tiny and not a multiple of 16
        torch.nn.Linear(8, 128),
    ).to(device)
    params = {n: p for n, p in model.named_parameters()}
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    out = linghe.nn.convert(model, fp8_filter=lambda name, m: name != "2.0")
    assert out is model
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n}
    assert kinds["0"] == "Linear" and isinstance(model[0], linghe.nn.Linear)
    assert not isinstance(model[2][0], linghe.nn.Linear)  # rejected by the filter
    assert not isinstance(model[2][1], linghe.nn.Linear)  # out 100: not a multiple of 16
    assert not isinstance(model[3], linghe.nn.Linear) and not isinstance(model[4],
                                                                          linghe.nn.Linear)
    for n, p in model.named_parameters():
        assert p is params[n]  # the very same Parameters
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k])
    x = torch.randn(4, 128, device=device)
    with linghe.TrainingContext(fp8="blockwise"):
        y = model(x)
    assert y.shape == (4, 128) and torch.isfinite(y).all()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        linghe.nn.convert([1])
    with pytest.raises(TypeError, match="fp8_filter must be callable"):
        linghe.nn.convert(model, fp8_filter=3)


def test_tied_weights_survive_convert(device):
    emb = torch.nn.Embedding(32, 64)
    head = torch.nn.Linear(64, 32, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "mid": torch.nn.Linear(64, 64)})
    linghe.nn.convert(model)
    assert model["head"].weight is model["emb"].weight  # head not converted (out 32 < 64)
    assert isinstance(model["mid"], linghe.nn.Linear)


def test_bad_inputs(device):
    lin = linghe.nn.Linear(64, 32, device=device)
    with linghe.TrainingContext(fp8="blockwise"):
        with pytest.raises(ValueError, match="last dim 64"):
            lin(torch.randn(4, 48, device=device))
        with pytest.raises(TypeError, match="x must have dtype"):
            lin(torch.ones(4, 64, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="recipe must be an Fp8Recipe"):
        fp8_linear(torch.randn(2, 64, device=device), lin.weight, None, "blockwise")


def test_delayed_linear_over_steps(device):
    lin, base = _pair(128, 64, device, torch.float32)
    ctx = linghe.TrainingContext(fp8="delayed")
    for _ in range(3):
        x = torch.randn(20, 128, device=device)
        lin.zero_grad()
        with ctx:
            y = lin(x)
            y.sum().backward()
        assert rel_err(y, base(x)) < 6e-2
    st = ctx.recipe.state
    assert st.steps == 3
    assert st.history(torch.float8_e4m3fn).scale[:2].ne(1).all()  # x and w slots
    assert st.history(torch.float8_e5m2).scale[0].ne(1)  # dy slot


def _decoder_losses(fp8, steps, device, **kw):
    model = tiny.build_model(device=device, **kw)
    return tiny.train(model, fp8=fp8, steps=steps, batch=kw.get("batch_", 4),
                      seq_len=kw["seq_len"], lr=1e-2, device=device)


def test_convergence_tiny_cpu(device):
    # one layer (every kernel of a layer runs; a second adds none), 3 steps (2 updates):
    # the curves compared step by step, the loss already falling (the long-run tolerance
    # is test_convergence_gpu's)
    kw = dict(vocab=64, dim=32, n_layers=1, n_heads=2, ffn=64, seq_len=16)
    base = _decoder_losses(None, 3, device, **kw)
    fp8 = _decoder_losses("blockwise", 3, device, **kw)
    assert all(torch.isfinite(torch.tensor(fp8)))
    # Same init, same batches: the curves agree step by step within 5%.
    for a, b in zip(base, fp8):
        assert abs(a - b) / a < 0.05, (base, fp8)
    assert fp8[-1] < fp8[0]


@pytest.mark.gpu
@pytest.mark.parametrize("tie", [False, True])
def test_convergence_gpu(device, tie):
    kw = dict(vocab=256, dim=256, n_layers=2, n_heads=4, ffn=512, seq_len=64, tie=tie)
    model_a = tiny.build_model(device=device, **kw)
    model_b = tiny.build_model(device=device, **kw)
    base = tiny.train(model_a, fp8=None, steps=300, batch=16, seq_len=64, device=device)
    fp8 = tiny.train(model_b, fp8="blockwise", steps=300, batch=16, seq_len=64, device=device)
    n = 60
    a, b = sum(base[-n:]) / n, sum(fp8[-n:]) / n
    # Stated tolerance: mean loss of the last 60 of 300 steps within 3% of bf16's, and
    # both well under the uniform-guess loss ln(256) = 5.55.
    assert abs(a - b) / a < 0.03, (a, b)
    assert b < 0.6 * 5.55


def test_no_grad_saves_nothing_for_wgrad(device):
    lin = linghe.nn.Linear(128, 64, device=device)
    x = torch.randn(8, 128, device=device)
    with torch.no_grad(), linghe.TrainingContext(fp8="blockwise"):
        y = lin(x)
    assert not y.requires_grad
    with linghe.TrainingContext(fp8="blockwise"):
        y2 = lin(x)
    assert torch.equal(y, y2.detach())


def test_deepcopy_and_pickle_after_fp8_step(device):
    import copy
    import io

    lin = linghe.nn.Linear(128, 64, device=device)
    with linghe.TrainingContext(fp8="blockwise"):
        lin(torch.randn(4, 128, device=device))
    assert lin._fp8_weight_cache.value is not None
    lin2 = copy.deepcopy(lin)
    assert lin2._fp8_weight_cache.value is None and torch.equal(lin2.weight, lin.weight)
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    lin3 = torch.load(buf, weights_only=False)
    assert isinstance(lin3, linghe.nn.Linear) and lin3._fp8_weight_cache.value is None


def test_rmsnorm_swiglu_blockwise_fused_fp8(device):
    # Under blockwise, RMSNorm returns rms_norm_quant's Fp8Tensor and SwiGLU runs
    # silu_mul_quant between its linghe.nn.Linear projections; state_dicts are unchanged.
    H, I = 128, 192
    norm = linghe.nn.RMSNorm(H, device=device)
    mlp = linghe.nn.SwiGLU(H, I, device=device)
    assert list(mlp.state_dict()) == ["gate_up_proj.weight", "down_proj.weight"]
    assert list(norm.state_dict()) == ["weight"]
    assert isinstance(mlp.gate_up_proj, linghe.nn.Linear)
    x = torch.randn(2, 70, H, device=device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with linghe.TrainingContext(fp8="blockwise"):
        h = norm(x1)
        assert isinstance(h, linghe.Fp8Tensor) and h.columnwise_data is not None
        y1 = mlp(h)
        y1.float().pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in [*mlp.named_parameters(), *norm.named_parameters()]}
    for p in [*mlp.parameters(), *norm.parameters()]:
        p.grad = None
    y2 = mlp(norm(x2))
    assert not isinstance(norm(x2), linghe.Fp8Tensor)  # outside a context: plain tensor
    y2.float().pow(2).sum().backward()
    assert_close(y1, y2, tol=0.12, name="y")  # two chained e4m3 GEMMs
    assert_close(x1.grad, x2.grad, tol=0.15, name="dx")
    for n, p in [*mlp.named_parameters(), *norm.named_parameters()]:
        assert_close(grads[n], p.grad, tol=0.15, name=n)
    norm.quantize_output = False
    with linghe.TrainingContext(fp8="blockwise"):
        assert not isinstance(norm(x), linghe.Fp8Tensor)


def test_convert_rmsnorm(device):
    model = torch.nn.Sequential(torch.nn.RMSNorm(128, eps=None), torch.nn.Linear(128, 128),
                                torch.nn.RMSNorm([4, 8]))
    w = model[0].weight
    linghe.nn.convert(model)
    assert isinstance(model[0], linghe.nn.RMSNorm) and model[0].weight is w
    assert model[0].eps == torch.finfo(torch.float32).eps
    assert type(model[2]) is torch.nn.RMSNorm  # not over one last dim: left alone
    assert list(model.state_dict()) == ["0.weight", "1.weight", "1.bias", "2.weight"]
