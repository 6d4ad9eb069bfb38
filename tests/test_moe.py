"""linghe.nn.MoE (one process, all experts local) against linghe.reference.moe."""

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.testing import assert_close


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
    m = linghe.nn.MoE(128, 4, 2, 64, align=16, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    caches = m._fp8_weight_caches
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
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
