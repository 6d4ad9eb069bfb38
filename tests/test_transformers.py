"""linghe.transformers: Hugging Face models patched with linghe's kernels against the same
models unpatched (tiny random configs from the config classes; nothing is downloaded).

Tolerances: the parity tests run in float32 on both sides, so the patched and unpatched
models differ only in summation order and in where fp32 results are rounded (fused
kernels round once): relative errors land near 1e-6 (seen: <= 1e-6), and 1e-5 (outputs)
/ 5e-5 (gradients, a longer chain) leave margin while a wrong routing choice, a missing
term or a wrong shift would be O(1e-1) or more.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

import linghe  # noqa: E402
from linghe.testing import assert_close, rel_err  # noqa: E402
from linghe.transformers import (  # noqa: E402
    AutoLinghePatchedModelForCausalLM,
    apply_linghe_kernels,
)
from linghe.transformers import modules as hf_modules  # noqa: E402

V = 97  # vocab: not a multiple of 16
COMMON = dict(vocab_size=V, hidden_size=48, intermediate_size=40, num_hidden_layers=1,
              num_attention_heads=3, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=64)


def _config(family: str):
    if family == "llama":
        return LlamaConfig(**COMMON, mlp_bias=True, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**COMMON)
    if family == "qwen3":
        return Qwen3Config(**COMMON)
    # one MoE layer (the dense MLP is the other families'), 5 experts top-2
    return Qwen3MoeConfig(**COMMON, moe_intermediate_size=24, num_experts=5,
                          num_experts_per_tok=2, norm_topk_prob=True,
                          output_router_logits=True, router_aux_loss_coef=0.01)


def _pair(family: str, device, **patch):
    ref = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).to(device)
    pat = apply_linghe_kernels(copy.deepcopy(ref), **patch)
    return ref, pat


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


EXPECTED = {
    "llama": {"RMSNorm": 3, "Attention": 1, "MLP": 1},
    "qwen2": {"RMSNorm": 3, "Attention": 1, "MLP": 1},
    "qwen3": {"RMSNorm": 5, "Attention": 1, "MLP": 1},
    "qwen3_moe": {"RMSNorm": 5, "Attention": 1, "TopKRouter": 1, "Experts": 1},
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_patched_matches_unpatched(family, device):
    ref, pat = _pair(family, device)
    assert pat.linghe_patched == {**EXPECTED[family], "LinearCrossEntropy": 1}
    B, S = 2, 5
    ids = torch.randint(0, V, (B, S), device=device)
    labels = ids.clone()
    labels[0, 1] = -100  # an ignored position
    mask = torch.ones(B, S, dtype=torch.long, device=device)
    mask[1, 0] = 0  # left padding

    out_r = ref(ids, attention_mask=mask, labels=labels)
    out_p = pat(ids, attention_mask=mask, labels=labels)
    assert out_p.logits is None  # the [N, V] logits were never built
    assert_close(out_p.loss, out_r.loss, 1e-5, "loss")
    if family == "qwen3_moe":
        assert_close(out_p.aux_loss, out_r.aux_loss, 1e-5, "aux_loss")
        for lp, lr in zip(out_p.router_logits, out_r.router_logits):
            assert_close(lp, lr, 1e-5, "router_logits")
    out_r.loss.backward()
    out_p.loss.backward()
    gr, gp = _grads(ref), _grads(pat)
    assert gr.keys() == gp.keys()
    for name in gr:
        assert gp[name] is not None, f"{name}: no gradient"
        assert_close(gp[name], gr[name], 5e-5, f"d {name}")

    with torch.no_grad():  # no labels: logits as before
        assert_close(pat(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits,
                     1e-5, "logits")


def test_generate(device):
    """Greedy generation (prefill, then a decode step of one token with the KV cache) picks
    the same tokens; the MoE family routes single tokens too."""
    ref, pat = _pair("qwen3_moe", device)
    prompt = torch.randint(0, V, (1, 3), device=device)
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert torch.equal(pat.generate(prompt, **kw), ref.generate(prompt, **kw))


def test_loss_options(device):
    """Trainer-style ``num_items_in_batch`` (sum / count), ``shift_labels`` and
    ``return_dict=False``."""
    ref, pat = _pair("llama", device)
    ids = torch.randint(0, V, (2, 4), device=device)
    n = torch.tensor(5, device=device)
    shifted = torch.randint(0, V, (2, 4), device=device)
    shifted[1, 2] = -100
    with torch.no_grad():
        lr = ref(ids, labels=ids, num_items_in_batch=n).loss
        tup = pat(ids, labels=ids, num_items_in_batch=n, return_dict=False)
        sr = ref(ids, shift_labels=shifted, labels=ids).loss
        sp = pat(ids, shift_labels=shifted, labels=ids).loss
    assert isinstance(tup, tuple)
    assert_close(tup[0], lr, 1e-5, "loss / num_items_in_batch")
    assert_close(sp, sr, 1e-5, "loss with shift_labels")


def test_save_load_round_trip(tmp_path, device):
    ref, pat = _pair("llama", device)
    assert pat.state_dict().keys() == ref.state_dict().keys()
    pat.save_pretrained(tmp_path)
    again = AutoLinghePatchedModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert again.linghe_patched and not hasattr(plain, "linghe_patched")
    for (name, a), b, c in zip(pat.state_dict().items(), again.state_dict().values(),
                               plain.state_dict().values()):
        assert torch.equal(a.cpu(), b) and torch.equal(a.cpu(), c), name
    again.to(device)
    ids = torch.randint(0, V, (1, 4), device=device)
    with torch.no_grad():
        assert_close(again(ids).logits, ref(ids).logits, 1e-5, "logits after reload")


def test_parameters_kept_and_flags(device):
    ref = AutoModelForCausalLM.from_config(_config("qwen3_moe"), dtype=torch.float32)
    params = dict(ref.named_parameters())
    apply_linghe_kernels(ref, rope=False, swiglu=False, cross_entropy=False)
    assert all(p is params[n] for n, p in ref.named_parameters())  # the same objects
    assert ref.linghe_patched == {"RMSNorm": 5, "TopKRouter": 1, "Experts": 1}
    assert "forward" not in ref.__dict__  # loss path left alone
    layer = ref.model.layers[0]
    assert isinstance(layer.mlp.experts, transformers.models.qwen3_moe.modeling_qwen3_moe
                      .Qwen3MoeExperts)  # still the HF class (subclass)
    assert type(layer.self_attn).__name__ == "Qwen3MoeAttention"
    with pytest.raises(ValueError, match="already patched"):
        apply_linghe_kernels(ref)


def test_deferred_expert_wgrad(device):
    """``expert_wgrad_micro_batches=2``: after the first micro-batch the experts have no
    gradient yet; after the second every gradient matches the unpatched model's
    accumulated over both (bf16 experts: fp32 here, so tight)."""
    ref = AutoModelForCausalLM.from_config(_config("qwen3_moe"), dtype=torch.float32).to(device)
    pat = AutoLinghePatchedModelForCausalLM.from_config(
        _config("qwen3_moe"), dtype=torch.float32, expert_wgrad_micro_batches=2).to(device)
    pat.load_state_dict(ref.state_dict())
    experts = pat.model.layers[0].mlp.experts
    assert experts.linghe_wgrad_micro_batches == 2
    batches = [torch.randint(0, V, (2, 5), device=device) for _ in range(2)]
    for i, ids in enumerate(batches):
        ref(ids, labels=ids).loss.backward()
        pat(ids, labels=ids).loss.backward()
        if i == 0:
            assert experts.gate_up_proj.grad is None and experts.down_proj.grad is None
    gr, gp = _grads(ref), _grads(pat)
    for name in gr:
        assert_close(gp[name], gr[name], 5e-5, f"d {name}")
    with pytest.raises(ValueError, match="wgrad_micro_batches"):
        apply_linghe_kernels(AutoModelForCausalLM.from_config(_config("qwen3_moe")),
                             expert_wgrad_micro_batches=0)


def test_errors():
    gpt2 = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=17)
    with pytest.raises(ValueError, match=r"'llama'.*'qwen2'.*'qwen3'.*'qwen3_moe'.*gpt2"):
        AutoLinghePatchedModelForCausalLM.from_config(gpt2)
    model = AutoModelForCausalLM.from_config(gpt2)
    with pytest.raises(ValueError, match="supports the model types"):
        apply_linghe_kernels(model)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        apply_linghe_kernels("llama")
    llama = AutoModelForCausalLM.from_config(_config("llama"))
    with pytest.raises(TypeError, match="rope must be a bool"):
        apply_linghe_kernels(llama, rope=1)
    with pytest.raises(ValueError, match="fp8 must be None or one of"):
        apply_linghe_kernels(llama, fp8="tensorwise")
    with pytest.raises(ValueError, match="hidden_act"):
        apply_linghe_kernels(AutoModelForCausalLM.from_config(
            LlamaConfig(**COMMON, hidden_act="gelu")))
    with pytest.raises(OSError, match="from_config"):
        AutoLinghePatchedModelForCausalLM()


def test_rope_fallback(device, monkeypatch):
    """Inside a patched attention, RoPE calls that linghe.apply_rope computes take its
    kernel; others (here ``unsqueeze_dim=2``, a [B, S, H, D] layout) take the original
    Hugging Face function (the documented fallback). Outside, the original always runs."""
    mm = transformers.models.llama.modeling_llama
    hf_modules.install_rope(mm)
    dispatch, original = mm.apply_rotary_pos_emb, mm.apply_rotary_pos_emb.original
    calls = []
    real = hf_modules.apply_rope
    monkeypatch.setattr(hf_modules, "apply_rope", lambda *a: calls.append(1) or real(*a))
    q, k = torch.randn(2, 3, 5, 8, device=device), torch.randn(2, 1, 5, 8, device=device)
    cos, sin = torch.randn(2, 5, 8, device=device), torch.randn(2, 5, 8, device=device)
    qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()

    dispatch(q, k, cos, sin)
    assert calls == []  # not inside a patched attention
    token = hf_modules._LINGHE_ROPE.set(True)
    try:
        fused = dispatch(q, k, cos, sin)
        assert calls == [1]
        other = dispatch(qt, kt, cos, sin, unsqueeze_dim=2)
        assert calls == [1]
    finally:
        hf_modules._LINGHE_ROPE.reset(token)
    for a, b in zip(fused, original(q, k, cos, sin)):
        assert_close(a, b, 1e-6, "rope")
    for a, b in zip(other, original(qt, kt, cos, sin, unsqueeze_dim=2)):
        assert torch.equal(a, b)


def test_fp8_blockwise(device):
    """fp8="blockwise": Linears become linghe.nn.Linear and the decoder layers run FP8 (MoE
    grouped GEMMs too: 2I and H multiples of 128; the attention's input norm emits FP8).
    Against the fp32 model, as tests/test_e2e.py does: e4m3 rounds each element by ~3.6%
    rms in every GEMM operand, forward and backward, so the loss stays within 2% (seen:
    5e-4), the logits within 12% (seen: 6.4%) and every gradient within 40% (seen: <= 19%
    on CPU, the second layer's q projection; on an H200, whose random inputs differ, 34%
    for the router weight, whose gradient sums FP8 expert outputs over only 10 tokens,
    and 31% for an expert's down projection); wrong scales, a wrong columnwise copy or a
    missing term give errors of order 1."""
    # layer 0 MoE, layer 1 dense (mlp_only_layers): both FP8 MLP paths
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=128, intermediate_size=64,
                         moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, num_experts=3,
                         num_experts_per_tok=2, max_position_embeddings=64,
                         mlp_only_layers=[1])
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    pat = apply_linghe_kernels(copy.deepcopy(ref), fp8="blockwise")
    # q, k, v, o in both layers and gate, up, down of the dense MLP (experts are 3-D
    # parameters, the router is not a Linear, the LM head is outside the layers)
    assert pat.linghe_patched["Linear"] == 11
    assert isinstance(pat.model.layers[0].self_attn.q_proj, linghe.nn.Linear)
    assert type(pat.lm_head) is torch.nn.Linear
    seen = []
    pat.model.layers[0].input_layernorm.register_forward_hook(
        lambda m, i, o: seen.append(type(o)))
    ids = torch.randint(0, V, (2, 5), device=device)
    lr = ref(ids, labels=ids).loss
    lp = pat(ids, labels=ids).loss
    assert seen == [linghe.Fp8Tensor]  # rms_norm_quant, shared by q/k/v
    assert abs(lp.item() - lr.item()) < 0.02 * lr.item()
    lp.backward()
    lr.backward()
    gr = _grads(ref)
    errs = {n: rel_err(p.grad, gr[n]) for n, p in pat.named_parameters()}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] < 0.4, worst
    with torch.no_grad():
        assert rel_err(pat(ids).logits, ref(ids).logits) < 0.12
    # the expert weights' FP8 copies are cached (made once per optimizer step)
    assert [c.misses for c in pat.model.layers[0].mlp.experts._linghe_fp8_caches] == [1, 1]


def test_fp8_with_experts_in_input_precision(device):
    """expert_fp8=False: the Linears run FP8, the routed experts in the input's precision
    (no FP8 weight copies made); each decoder layer enters one TrainingContext of its own
    at every forward."""
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=128, intermediate_size=64,
                         moe_intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, num_experts=3,
                         num_experts_per_tok=2, max_position_embeddings=64)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    pat = apply_linghe_kernels(copy.deepcopy(ref), fp8="blockwise", expert_fp8=False)
    layer = pat.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, linghe.nn.Linear)
    recipes = []
    layer.mlp.experts.register_forward_hook(lambda m, i, o: recipes.append(
        linghe.current_recipe()))
    ids = torch.randint(0, V, (2, 5), device=device)
    lp = pat(ids, labels=ids).loss
    lr = ref(ids, labels=ids).loss
    assert abs(lp.item() - lr.item()) < 0.02 * lr.item()
    lp.backward()
    assert recipes[0].name == "blockwise" and not recipes[0].fp8_experts
    assert "_linghe_fp8_caches" not in layer.mlp.experts.__dict__  # no FP8 expert copies
    assert layer.mlp.experts.gate_up_proj.grad is not None
    ctx = layer._linghe_context
    with torch.no_grad():
        pat(ids)
    assert layer._linghe_context is ctx and not ctx.active


def test_fp8_lm_head(device):
    """lm_head_fp8=True: the decoder layers as with fp8="blockwise" alone, and the loss's
    LM head GEMMs in FP8 (reference.linear_cross_entropy_fp8 of the final hidden states),
    its weight's FP8 copy cached; it needs fp8 and a *ForCausalLM model."""
    from linghe import reference as ref
    from linghe.functional.loss import _WEIGHT_CACHES

    cfg = Qwen3Config(vocab_size=V, hidden_size=128, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=64, max_position_embeddings=64)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    pat = apply_linghe_kernels(copy.deepcopy(base), fp8="blockwise", lm_head_fp8=True)
    ids = torch.randint(0, V, (2, 7), device=device)
    loss = pat(ids, labels=ids).loss
    hidden = pat.model(ids).last_hidden_state.reshape(-1, 128).detach().requires_grad_()
    w = pat.lm_head.weight.detach().clone().requires_grad_()
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
    expect = ref.linear_cross_entropy_fp8(hidden.double(), w.double(), labels, fp8_wgrad=True)
    assert_close(loss, expect.float(), 2e-4, "loss")
    loss.backward()
    expect.backward()
    assert_close(pat.lm_head.weight.grad, w.grad, 2e-4, "lm_head grad")
    assert _WEIGHT_CACHES[pat.lm_head.weight].misses == 1
    with pytest.raises(ValueError, match="lm_head_fp8=True needs fp8='blockwise'"):
        apply_linghe_kernels(copy.deepcopy(base), lm_head_fp8=True)
    with pytest.raises(ValueError, match="needs a \\*ForCausalLM"):
        apply_linghe_kernels(copy.deepcopy(base.model), fp8="blockwise", lm_head_fp8=True)


def test_import_linghe_does_not_import_transformers():
    code = "import sys, linghe; assert 'transformers' not in sys.modules, 'imported'"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_caller_thread_backward(device):
    """apply_linghe_kernels runs the backward on the calling thread by default (autograd's
    multithreading off from a training forward until a forward without gradients), with
    the same gradients as with PyTorch's default (caller_thread_backward=False)."""
    enabled = torch._C._is_multithreading_enabled
    ref = AutoModelForCausalLM.from_config(_config("qwen3_moe"), dtype=torch.float32).to(device)
    pat = apply_linghe_kernels(copy.deepcopy(ref))
    off = apply_linghe_kernels(copy.deepcopy(ref), caller_thread_backward=False)
    ids = torch.randint(0, V, (2, 7), device=device)
    try:
        out = pat(ids, labels=ids)
        assert not enabled()
        out.loss.backward()
        with torch.no_grad():
            pat(ids)
        assert enabled()
        out_off = off(ids, labels=ids)
        assert enabled()
        out_off.loss.backward()
    finally:
        torch._C._set_multithreading_enabled(True)
    assert torch.equal(out.loss, out_off.loss)
    for (name, g), g_off in zip(_grads(pat).items(), _grads(off).values()):
        assert_close(g, g_off, tol=1e-6, name=name)
    with pytest.raises(TypeError, match="caller_thread_backward must be a bool"):
        apply_linghe_kernels(copy.deepcopy(ref), caller_thread_backward=1)


@pytest.mark.parametrize("fp8", [None, "blockwise"])
def test_torch_compile_fullgraph(fp8, device):
    """``torch.compile(patched, fullgraph=True)`` traces the whole patched model (no graph
    break: the RoPE switch, the decoder layers' FP8 context and the caller-thread hook
    have compile-time forms) and matches the same model in eager mode (FP8 experts within
    FP8 rounding: see below). The compiled graph holds linghe's ops (RoPE, router,
    experts, loss), not the Hugging Face fallbacks."""
    if fp8 is None:
        cfg = _config("qwen3_moe")
    else:  # FP8-sized (H and 2I multiples of 128), one MoE and one dense layer
        cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=128, intermediate_size=64,
                             moe_intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                             num_experts=3, num_experts_per_tok=2, max_position_embeddings=64,
                             mlp_only_layers=[1])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    pat = apply_linghe_kernels(model, fp8=fp8, lm_head_fp8=fp8 is not None)
    ids = torch.randint(0, V, (2, 7), device=device)
    try:
        eager = pat(ids, labels=ids).loss
        eager.backward()
        g_eager = {n: p.grad.clone() for n, p in pat.named_parameters()}
        pat.zero_grad(set_to_none=True)
        ops = set()

        def backend(gm, example_inputs):
            ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(pat, backend=backend, fullgraph=True)
        loss = compiled(ids, labels=ids).loss
        loss.backward()
    finally:
        torch._dynamo.reset()
        torch._C._set_multithreading_enabled(True)
    for op in ("apply_rope_fwd", "router_logits_fwd", "permute_fwd", "linear_cross_entropy"):
        assert any(op in o for o in ops), (op, sorted(ops))
    assert_close(loss, eager, 1e-6, "loss")
    for name, p in pat.named_parameters():
        # Compiled FP8 experts take the documented unfused path, whose weight gradients
        # are FP8 GEMMs (eager: high precision from the dequantized rows); seen 2.7%.
        tol = 0.1 if fp8 and ".experts." in name else 1e-5
        assert_close(p.grad, g_eager[name], tol, f"d {name}")


def test_bf16_and_gradient_checkpointing(device, monkeypatch):
    """bf16 parameters (the training dtype on the GPU), with Hugging Face's gradient
    checkpointing on the patched model only (its recomputed forward runs in backward and
    must take linghe's RoPE again). bf16 results of both differ from the exact ones by
    rounding, so each is compared with the same model in fp32: the patched model's error
    must be at most twice the unpatched model's (+1e-3). On CPU four times: the triton
    interpreter truncates fp32->bf16 stores instead of rounding them (DESIGN.md), a
    one-sided error that accumulates (seen: up to 2.9x, on the q/k weight gradients)."""
    cfg = _config("llama")
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device)
    pat = apply_linghe_kernels(copy.deepcopy(ref))
    exact = copy.deepcopy(ref).float()
    # transformers >= 5.23 renames gradient_checkpointing_enable
    enable = getattr(pat, "activation_checkpointing_enable", None)
    (enable or pat.gradient_checkpointing_enable)()
    pat.train()
    calls = []
    real = hf_modules.apply_rope
    monkeypatch.setattr(hf_modules, "apply_rope", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, V, (2, 5), device=device)
    outs = [m(ids, labels=ids) for m in (exact, ref, pat)]
    for o in outs:
        o.loss.backward()
    assert len(calls) == 2  # the forward and its recomputation in backward
    assert outs[2].loss.dtype == torch.float32

    factor = 2 if device == "cuda" else 4

    def check(name, x, r, p):
        e_hf, e_linghe = rel_err(r, x), rel_err(p, x)
        assert e_linghe <= factor * e_hf + 1e-3, f"{name}: {e_linghe:.2e} vs hf {e_hf:.2e}"

    check("loss", outs[0].loss, outs[1].loss, outs[2].loss)
    gx, gr = _grads(exact), _grads(ref)
    for name, g in _grads(pat).items():
        assert g is not None and g.dtype == torch.bfloat16, name
        check(f"d {name}", gx[name], gr[name], g)


def test_hf_finetune_example_compiled():
    """``examples/hf_finetune.py --compile``: the patched layers compiled (aot_eager on
    CPU) train, and the loss falls."""
    if torch.cuda.is_available():
        pytest.skip("the GPU run compiles with inductor (minutes); CPU covers the script")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "hf_finetune.py"),
                        "--steps", "3", "--compile", "default"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split()[3]) for line in r.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0], r.stdout


def test_hf_step_benchmark_smoke(tmp_path, capsys):
    """``python -m benchmark.hf_step --tiny``: the tiny config, one step per mode, JSON out,
    the table printed last; both modes start from the same weights and batch."""
    from benchmark import hf_step

    out = tmp_path / "hf_step.json"
    assert hf_step.main(["--tiny", "--modes", "hf,linghe", "--steps", "1", "--warmup", "0",
                         "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["hf", "linghe"]
    assert abs(rows[1]["first_loss"] - rows[0]["first_loss"]) < 1e-4 * rows[0]["first_loss"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("hf ") and lines[-1].startswith("linghe ")
