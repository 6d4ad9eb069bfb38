"""Split + qk-norm + RoPE + transpose (``qk_norm_rope``) and HF-layout ``apply_rope``."""

import zlib

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.testing import assert_close

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}


def _qkv(layout, B, S, H, Hkv, D, dtype, device, scale=1.0):
    W = (H + 2 * Hkv) * D
    shape = (S, B, W) if layout == "sbh" else (B, S, W)
    return (torch.randn(shape, device=device) * scale).to(dtype)


def _check_qk_norm_rope(device, *, B, S, H, Hkv, D, R, layout, interleaved, norm, packed,
                        dtype, max_pos=None, qkv=None, which=(0, 1, 2)):
    """Forward and every gradient vs autograd through the float32 reference."""
    max_pos = max_pos or S + 4
    if qkv is None:
        qkv = _qkv(layout, B, S, H, Hkv, D, dtype, device)
    freqs = linghe.rope_freqs(max_pos, R, device=device)
    qw = kw = None
    if norm in ("both", "q"):
        qw = (torch.rand(D, device=device) + 0.5)
    if norm in ("both", "k"):
        kw = (torch.randn(D, device=device))
    pos = torch.randint(0, max_pos, (B, S), device=device) if packed else None
    kwargs = dict(num_heads=H, num_kv_heads=Hkv, rotary_dim=R, layout=layout,
                  interleaved=interleaved, position_ids=pos)

    x = qkv.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_() if w is not None else None for w in (qw, kw)]
    out = linghe.qk_norm_rope(x, freqs, q_norm_weight=ws[0], k_norm_weight=ws[1], **kwargs)

    xr = qkv.detach().float().clone().requires_grad_()
    wr = [w.detach().clone().requires_grad_() if w is not None else None for w in (qw, kw)]
    outr = ref.qk_norm_rope(xr, freqs, q_norm_weight=wr[0], k_norm_weight=wr[1], **kwargs)

    assert [tuple(o.shape) for o in out] == [(B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, D)]
    for o, r, n in zip(out, outr, "qkv"):
        assert o.dtype == dtype and o.is_contiguous()
        assert_close(o, r, tol=TOL[dtype], name=n)

    grads = [torch.randn_like(r) for r in outr]
    used = [i for i in which]
    loss = sum((out[i].float() * grads[i]).sum() for i in used)
    loss_r = sum((outr[i] * grads[i]).sum() for i in used)
    ins = [x] + [w for w in ws if w is not None]
    ins_r = [xr] + [w for w in wr if w is not None]
    g = torch.autograd.grad(loss, ins, allow_unused=True)
    gr = torch.autograd.grad(loss_r, ins_r, allow_unused=True)
    gr = [torch.zeros_like(i) if a is None else a for a, i in zip(gr, ins_r)]
    assert g[0].shape == qkv.shape and g[0].dtype == dtype
    for a, b, n in zip(g, gr, ["dqkv", "dw", "dw"]):
        assert_close(a, b, tol=TOL[dtype] if n == "dqkv" else max(TOL[dtype], 1e-5) * 2,
                     name=n)


@pytest.mark.parametrize("layout", ["sbh", "bsh"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("norm", ["both", "none", "q"])
@pytest.mark.parametrize("packed", [False, True])
def test_qk_norm_rope_small(device, layout, interleaved, norm, packed):
    # The odd shape: 3 q heads, 1 kv head, head_dim 6, rotary_dim 2, S 5.
    B = 1 + zlib.crc32(f"{layout}{interleaved}{norm}{packed}".encode()) % 3
    _check_qk_norm_rope(device, B=B, S=5, H=3, Hkv=1, D=6, R=2, layout=layout,
                        interleaved=interleaved, norm=norm, packed=packed,
                        dtype=torch.float32)


@pytest.mark.parametrize("B", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qk_norm_rope_half_precision(device, B, dtype):
    _check_qk_norm_rope(device, B=B, S=5, H=3, Hkv=1, D=6, R=2, layout="sbh",
                        interleaved=True, norm="both", packed=B == 2, dtype=dtype)


@pytest.mark.parametrize("H,Hkv,D,R", [(4, 2, 8, None), (5, 5, 10, 4), (1, 1, 2, 2),
                                       (6, 2, 12, 6), (2, 1, 16, 8)])
def test_qk_norm_rope_head_shapes(device, H, Hkv, D, R):
    _check_qk_norm_rope(device, B=2, S=3, H=H, Hkv=Hkv, D=D, R=R or D, layout="bsh",
                        interleaved=True, norm="both", packed=False, dtype=torch.float32)


@pytest.mark.parametrize("tokens,programs", [(1, 1), (4, 1), (2, 2)])
def test_qk_norm_rope_many_tokens(device, monkeypatch, tokens, programs):
    # More token blocks than persistent backward programs: each program loops over them;
    # 39 tokens are not a multiple of the token block (masked tail).
    from linghe.bwd import rope as bwd_rope
    from linghe.fwd import rope as fwd_rope

    monkeypatch.setattr(fwd_rope, "FWD_TOKENS", tokens)
    monkeypatch.setattr(fwd_rope, "BWD_TOKENS", tokens)
    monkeypatch.setattr(bwd_rope, "PROGRAMS_PER_SM", programs)
    _check_qk_norm_rope(device, B=3, S=13, H=2, Hkv=1, D=4, R=2, layout="sbh",
                        interleaved=True, norm="both", packed=True, dtype=torch.float32)


@pytest.mark.parametrize("approx,stages,row_order,layout,D,R", [
    (False, 1, False, "bsh", 12, 8), (True, 3, True, "sbh", 12, 8),
    (False, 2, True, "sbh", 16, 8), (True, 3, False, "sbh", 16, 8)])
def test_qk_norm_rope_kernel_knobs(device, monkeypatch, approx, stages, row_order, layout,
                                   D, R):
    # The kernels' knobs: the polynomial or the MUFU cos/sin (the interpreter evaluates
    # the MUFU path with tl.cos/tl.sin), the backward's persistent token loop unpipelined
    # or pipelined, token blocks in the "sbh" row order or the output order, and a
    # weight-gradient reduction over several row blocks (4 SMs x 8 programs = 32 partial
    # rows on the CPU, 16 rows per block, 4 columns per program; 39 tokens: 7 programs
    # take two). D=16, R=8 has every piece full (unmasked "EVEN" kernels), D=12, R=8 a
    # rest narrower than the halves.
    from linghe.bwd import rope as bwd_rope
    from linghe.fwd import rope as fwd_rope

    monkeypatch.setattr(fwd_rope, "COS_SIN_APPROX", approx)
    monkeypatch.setattr(fwd_rope, "BWD_STAGES", stages)
    monkeypatch.setattr(fwd_rope, "ROW_ORDER", row_order)
    monkeypatch.setattr(bwd_rope, "PROGRAMS_PER_SM", 8)
    monkeypatch.setattr(bwd_rope, "DW_BLOCK_P", 16)
    monkeypatch.setattr(bwd_rope, "DW_BLOCK_N", 4)
    _check_qk_norm_rope(device, B=3, S=13, H=2, Hkv=1, D=D, R=R, layout=layout,
                        interleaved=True, norm="both", packed=True, dtype=torch.float32)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("norm", ["both", "k"])
def test_qk_norm_rope_several_head_blocks(device, monkeypatch, interleaved, norm):
    # A tile cap of 4096 elements at head_dim 256 caps a head tile at 16 heads: 17 q heads
    # take two blocks, the 1 kv head one (the head-block loops of both kernels).
    from linghe.fwd import rope as fwd_rope

    monkeypatch.setattr(fwd_rope, "TILE_CAP", 4096)
    monkeypatch.setattr(fwd_rope, "FWD_TOKENS", 2)
    _check_qk_norm_rope(device, B=1, S=3, H=17, Hkv=1, D=256, R=128, layout="bsh",
                        interleaved=interleaved, norm=norm, packed=False,
                        dtype=torch.float32)


def test_qk_norm_rope_default_rotary_dim(device):
    H, Hkv, D = 2, 1, 6
    qkv = _qkv("sbh", 2, 4, H, Hkv, D, torch.float32, device)
    freqs = linghe.rope_freqs(4, D, device=device)
    out = linghe.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv)
    outr = ref.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv, rotary_dim=D)
    for o, r in zip(out, outr):
        assert_close(o, r)


def test_qk_norm_rope_non_interleaved_any_heads(device):
    # [all q | all k | all v] needs no divisibility of H by Hkv.
    _check_qk_norm_rope(device, B=2, S=3, H=3, Hkv=2, D=4, R=4, layout="sbh",
                        interleaved=False, norm="both", packed=True, dtype=torch.float32)


def test_qk_norm_rope_strided_input(device):
    # A slice of a wider buffer: last dim contiguous, token strides not packed.
    H, Hkv, D = 3, 1, 6
    big = torch.randn(5, 2, (H + 2 * Hkv) * D + 7, device=device)
    qkv = big[..., 3:3 + (H + 2 * Hkv) * D]
    assert not qkv.is_contiguous()
    _check_qk_norm_rope(device, B=2, S=5, H=H, Hkv=Hkv, D=D, R=4, layout="sbh",
                        interleaved=True, norm="both", packed=False, dtype=torch.float32,
                        qkv=qkv)


@pytest.mark.parametrize("which", [(0,), (1,), (2,), (0, 2)])
def test_qk_norm_rope_partial_outputs_in_loss(device, which):
    _check_qk_norm_rope(device, B=2, S=3, H=3, Hkv=1, D=6, R=2, layout="bsh",
                        interleaved=True, norm="both", packed=False, dtype=torch.float32,
                        which=which)


def test_qk_norm_rope_large_positions(device):
    # Angles up to ~8200 rad: the kernel reduces them before sin/cos.
    H, Hkv, D = 2, 1, 8
    qkv = _qkv("bsh", 1, 3, H, Hkv, D, torch.float32, device)
    freqs = linghe.rope_freqs(8192, D, device=device)
    pos = torch.tensor([[4095, 8000, 8191]], device=device)
    out = linghe.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv, layout="bsh",
                              position_ids=pos)
    outr = ref.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv, layout="bsh",
                            position_ids=pos)
    for o, r in zip(out, outr):
        assert_close(o, r, tol=1e-5)


def test_qk_norm_rope_empty(device):
    H, Hkv, D = 3, 1, 6
    for layout in ("sbh", "bsh"):
        shape = (0, 2) if layout == "sbh" else (2, 0)  # B = 2, S = 0 either way
        qkv = torch.randn(*shape, (H + 2 * Hkv) * D, device=device, requires_grad=True)
        qw = torch.randn(D, device=device, requires_grad=True)
        freqs = linghe.rope_freqs(4, 2, device=device)
        q, k, v = linghe.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv,
                                      rotary_dim=2, layout=layout, q_norm_weight=qw)
        assert q.shape == (2, 0, H, D) and k.shape == (2, 0, Hkv, D)
        (q.sum() + k.sum() + v.sum()).backward()
        assert qkv.grad.shape == qkv.shape
        assert torch.equal(qw.grad, torch.zeros_like(qw))


def test_qk_norm_rope_nonfinite_propagates(device):
    H, Hkv, D = 2, 1, 4
    qkv = _qkv("bsh", 1, 2, H, Hkv, D, torch.float32, device)
    qkv[0, 1, 1] = float("nan")  # inside q head 0 of token 1
    freqs = linghe.rope_freqs(4, D, device=device)
    q, k, v = linghe.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv, layout="bsh",
                                  q_norm_weight=torch.ones(D, device=device))
    assert q[0, 1, 0].isnan().all() and not q[0, 0].isnan().any()
    assert not k.isnan().any()


def test_qk_norm_rope_out_of_range_positions(device):
    H, Hkv, D = 2, 1, 4
    qkv = _qkv("bsh", 1, 2, H, Hkv, D, torch.float32, device)
    freqs = linghe.rope_freqs(4, D, device=device)
    pos = torch.tensor([[1, 9]], device=device)
    # Outside debug mode: no out-of-bounds read, that token is not rotated.
    q, k, v = linghe.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv, layout="bsh",
                                  position_ids=pos)
    qr = ref.qk_norm_rope(qkv, freqs[:1], num_heads=H, num_kv_heads=Hkv, layout="bsh",
                          position_ids=torch.zeros_like(pos))[0]
    assert_close(q[0, 1], qr[0, 1])
    linghe.set_debug(True)
    try:
        with pytest.raises(ValueError, match="position_ids must lie in"):
            linghe.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv, layout="bsh",
                                position_ids=pos)
    finally:
        linghe.set_debug(False)


def test_qk_norm_rope_bad_inputs(device):
    H, Hkv, D = 3, 1, 6
    qkv = _qkv("sbh", 2, 5, H, Hkv, D, torch.float32, device)
    freqs = linghe.rope_freqs(8, 2, device=device)
    kw = dict(num_heads=H, num_kv_heads=Hkv, rotary_dim=2)
    with pytest.raises(ValueError, match="last dim"):
        linghe.qk_norm_rope(qkv, freqs, num_heads=4, num_kv_heads=1, rotary_dim=2)
    with pytest.raises(ValueError, match="head_dim must be even"):
        linghe.qk_norm_rope(qkv[..., :25], freqs, **kw)
    with pytest.raises(ValueError, match="rotary_dim"):
        linghe.qk_norm_rope(qkv, linghe.rope_freqs(8, 8, device=device), num_heads=H,
                            num_kv_heads=Hkv, rotary_dim=8)
    with pytest.raises(ValueError, match="rotary_dim"):
        linghe.qk_norm_rope(qkv, freqs, num_heads=H, num_kv_heads=Hkv, rotary_dim=3)
    with pytest.raises(ValueError, match="freqs must have shape"):
        linghe.qk_norm_rope(qkv, linghe.rope_freqs(8, 4, device=device), **kw)
    with pytest.raises(TypeError, match="freqs must have dtype"):
        linghe.qk_norm_rope(qkv, freqs.double(), **kw)
    with pytest.raises(ValueError, match="freqs has 4 positions"):
        linghe.qk_norm_rope(qkv, freqs[:4], **kw)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        linghe.qk_norm_rope(_qkv("sbh", 2, 5, 3, 2, 4, torch.float32, device),
                            linghe.rope_freqs(8, 4, device=device), num_heads=3,
                            num_kv_heads=2)
    with pytest.raises(TypeError, match="qkv must have dtype"):
        linghe.qk_norm_rope(qkv.to(torch.int32), freqs, **kw)
    with pytest.raises(ValueError, match="qkv must be 3-D"):
        linghe.qk_norm_rope(qkv[0], freqs, **kw)
    with pytest.raises(ValueError, match="q_norm_weight must have shape"):
        linghe.qk_norm_rope(qkv, freqs, q_norm_weight=torch.ones(5, device=device), **kw)
    with pytest.raises(ValueError, match="position_ids must have shape"):
        linghe.qk_norm_rope(qkv, freqs, position_ids=torch.zeros(5, 2, dtype=torch.long,
                                                                 device=device), **kw)
    with pytest.raises(TypeError, match="position_ids must have dtype"):
        linghe.qk_norm_rope(qkv, freqs, position_ids=torch.zeros(2, 5, device=device), **kw)
    with pytest.raises(ValueError, match="layout"):
        linghe.qk_norm_rope(qkv, freqs, layout="hsb", **kw)
    with pytest.raises(ValueError, match="last dimension"):
        linghe.qk_norm_rope(qkv.transpose(1, 2).contiguous().transpose(1, 2), freqs, **kw)
    if device == "cpu":
        meta = torch.empty(D, device="meta")
        with pytest.raises(ValueError, match="q_norm_weight must be on"):
            linghe.qk_norm_rope(qkv, freqs, q_norm_weight=meta, **kw)
    else:
        with pytest.raises(ValueError, match="freqs must be on"):
            linghe.qk_norm_rope(qkv, freqs.cpu(), **kw)


def test_rope_freqs(device):
    f = linghe.rope_freqs(7, 6, base=500.0, device=device)
    assert f.shape == (7, 3) and f.dtype == torch.float32
    inv = 500.0 ** (-torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    torch.testing.assert_close(f.cpu().double(), torch.arange(7.0).double()[:, None] * inv,
                               rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="rotary_dim"):
        linghe.rope_freqs(7, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["sbh", "bsh"])
def test_qk_norm_rope_standard_shape(device, layout):
    _check_qk_norm_rope(device, B=2, S=4096, H=16, Hkv=4, D=128, R=64, layout=layout,
                        interleaved=True, norm="both", packed=layout == "bsh",
                        dtype=torch.bfloat16, max_pos=4096)


# --------------------------------------------------------------------------------------
# apply_rope (Hugging Face layout)
# --------------------------------------------------------------------------------------


def _hf_cos_sin(B, S, D, device, batched):
    # As HF's rotary embedding returns them: [B, S, D], halves duplicated.
    pos = torch.randint(0, 50, (B, S), device=device) if batched else \
        torch.arange(S, device=device)[None]
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    ang = pos[..., None].float() * inv
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos(), emb.sin()


def _check_apply_rope(device, q, k, cos, sin, pos=None, dtype=torch.float32):
    qa, ka = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qo, ko = linghe.apply_rope(qa, ka, cos, sin, pos)
    qr, kr = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    qro, kro = ref.apply_rope(qr, kr, cos, sin, pos)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == q.dtype
    assert_close(qo, qro, tol=TOL[dtype], name="q_embed")
    assert_close(ko, kro, tol=TOL[dtype], name="k_embed")
    gq, gk = torch.randn_like(qro), torch.randn_like(kro)
    (qo.float() * gq).sum().add((ko.float() * gk).sum()).backward()
    ((qro * gq).sum() + (kro * gk).sum()).backward()
    assert_close(qa.grad, qr.grad, tol=TOL[dtype], name="dq")
    assert_close(ka.grad, kr.grad, tol=TOL[dtype], name="dk")


@pytest.mark.parametrize("B,H,Hk,S,D", [(1, 3, 1, 5, 6), (3, 2, 2, 4, 8), (2, 4, 1, 1, 4)])
@pytest.mark.parametrize("cos_kind", ["SD", "BSD", "1SD"])
def test_apply_rope(device, B, H, Hk, S, D, cos_kind):
    q = torch.randn(B, H, S, D, device=device)
    k = torch.randn(B, Hk, S, D, device=device)
    cos, sin = _hf_cos_sin(B, S, D, device, batched=cos_kind == "BSD")
    if cos_kind == "SD":
        cos, sin = cos[0], sin[0]
    elif cos_kind == "1SD":
        cos, sin = cos[:1], sin[:1]
    _check_apply_rope(device, q, k, cos, sin)


def test_apply_rope_several_head_blocks(device):
    B, H, S, D = 1, 17, 2, 256
    q, k = torch.randn(B, H, S, D, device=device), torch.randn(B, 17, S, D, device=device)
    cos, sin = _hf_cos_sin(B, S, D, device, batched=False)
    _check_apply_rope(device, q, k, cos, sin)


def test_apply_rope_random_cos_sin(device):
    # Not duplicated halves: each dim uses its own cos/sin entry, as HF's formula does.
    B, H, S, D = 2, 3, 5, 6
    q, k = torch.randn(B, H, S, D, device=device), torch.randn(B, 1, S, D, device=device)
    cos, sin = torch.randn(B, S, D, device=device), torch.randn(B, S, D, device=device)
    _check_apply_rope(device, q, k, cos, sin)


def test_apply_rope_position_ids_tables(device):
    B, H, S, D = 2, 3, 5, 6
    q, k = torch.randn(B, H, S, D, device=device), torch.randn(B, 3, S, D, device=device)
    cos, sin = torch.randn(20, D, device=device), torch.randn(20, D, device=device)
    pos = torch.randint(0, 20, (B, S), device=device)
    _check_apply_rope(device, q, k, cos, sin, pos)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_apply_rope_transposed_views_half(device, dtype):
    # HF: q = proj(x).view(B, S, H, D).transpose(1, 2) -- a strided view.
    B, H, Hk, S, D = 2, 3, 1, 5, 6
    q = torch.randn(B, S, H, D, device=device).to(dtype).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device=device).to(dtype).transpose(1, 2)
    cos, sin = _hf_cos_sin(B, S, D, device, batched=True)
    _check_apply_rope(device, q, k, cos, sin, dtype=dtype)


def test_apply_rope_broadcast_gradient(device):
    # .sum() hands back gradients broadcast from a scalar (stride 0 in every dim).
    B, H, S, D = 1, 2, 3, 8
    q = torch.randn(B, H, S, D, device=device, requires_grad=True)
    k = torch.randn(B, 1, S, D, device=device, requires_grad=True)
    cos, sin = torch.randn(S, D, device=device), torch.randn(S, D, device=device)
    qo, ko = linghe.apply_rope(q, k, cos, sin)
    gq, gk = torch.autograd.grad(qo.sum() + ko.sum(), (q, k))
    qro, kro = ref.apply_rope(q, k, cos, sin)
    rq, rk = torch.autograd.grad(qro.sum() + kro.sum(), (q, k))
    assert_close(gq, rq, name="dq")
    assert_close(gk, rk, name="dk")


def test_apply_rope_bad_inputs(device):
    q, k = torch.randn(2, 3, 5, 6, device=device), torch.randn(2, 1, 5, 6, device=device)
    cos, sin = torch.randn(5, 6, device=device), torch.randn(5, 6, device=device)
    with pytest.raises(ValueError, match="even"):
        linghe.apply_rope(q[..., :5], k[..., :5], cos[:, :5], sin[:, :5])
    with pytest.raises(ValueError, match="k must have shape"):
        linghe.apply_rope(q, torch.randn(2, 1, 4, 6, device=device), cos, sin)
    with pytest.raises(TypeError, match="k must have dtype"):
        linghe.apply_rope(q, k.double(), cos, sin)
    with pytest.raises(ValueError, match="cos must have shape"):
        linghe.apply_rope(q, k, cos[:4], sin[:4])
    with pytest.raises(ValueError, match="sin must have cos's shape"):
        linghe.apply_rope(q, k, cos, sin[None])
    with pytest.raises(ValueError, match="batch size"):
        linghe.apply_rope(q, k, cos.expand(3, 5, 6), sin.expand(3, 5, 6))
    with pytest.raises(ValueError, match="requires grad"):
        linghe.apply_rope(q, k, cos.requires_grad_(), sin)
    with pytest.raises(ValueError, match="q must be 4-D"):
        linghe.apply_rope(q[0], k[0], cos, sin)


# --------------------------------------------------------------------------------------
# Offline sm_90 compile (no GPU) and the probe's CPU smoke run
# --------------------------------------------------------------------------------------

_ROPE_COMPILE_SCRIPT = r'''
from benchmark.probe_rope import compile_sm90, kernel_args
from linghe.bwd import rope as B
from linghe.fwd import rope as F

fargs, bargs, base = kernel_args()
cfg = dict(F.launch_config(16, 4, 128, 64, 8192, 1, 4, True, "sbh", 2))
nw = cfg.pop("num_warps")
assert cfg["EVEN"] and cfg["SAME"], cfg
ptx = compile_sm90(F._qk_norm_rope_fwd_kernel, fargs, dict(base, **cfg), nw).asm["ptx"]
# The rotation partner is in-thread, the per-head sums stay in a warp (no shared
# memory, no barrier), cos/sin are MUFU ops, the pieces move in 8-byte vectors at
# 4 warps, token indices are int32 (no 64-bit division) and no store is masked.
assert "bar.sync" not in ptx and "cos.approx" in ptx and "sin.approx" in ptx
assert "ld.global.v2" in ptx and "st.global.v2" in ptx
assert "div.s64" not in ptx and "div.u64" not in ptx
assert not [ln for ln in ptx.splitlines() if "st.global" in ln and "@" in ln]
for stages, prefetch in ((1, True), (1, False), (2, False)):
    ptx = compile_sm90(B._qk_norm_rope_bwd_kernel, bargs,
                       dict(base, STAGES=stages, PREFETCH=prefetch, **cfg), nw).asm["ptx"]
    assert ("cp.async" in ptx) == (stages > 1), stages
    assert "div.s64" not in ptx and "div.u64" not in ptx
print("COMPILED")
'''


def test_qk_norm_rope_compiles_for_sm90(compile_sm90):
    """The qk_norm_rope kernels compile for an H100/H200 (sm_90) without a GPU, with the
    properties the tile layout is for (see linghe/fwd/rope.py): no shared-memory
    exchange in the forward, MUFU cos/sin, vector accesses, int32 token math, a
    cp.async-pipelined backward loop when BWD_STAGES > 1 (and the plain loop with and
    without the register prefetch of the next token block, BWD_PREFETCH)."""
    compile_sm90(_ROPE_COMPILE_SCRIPT)


def test_probe_rope_cpu_smoke(device, tmp_path):
    """``python -m benchmark.probe_rope --cpu`` (tiny shapes, interpreter): every row
    (main's kernels from git and the new ones at each knob value) matches the
    reference."""
    if device != "cpu":
        pytest.skip("the GPU runs the probe itself (python -m benchmark.probe_rope)")
    import json
    import subprocess

    from benchmark import probe_rope

    if subprocess.run(["git", "cat-file", "-e", probe_rope.OLD_REV],
                      capture_output=True).returncode != 0:
        pytest.skip("main's revision is not in this checkout (no git history)")
    assert probe_rope.main(["--cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "probe_rope.json").read_text())["rows"]
    assert rows and all(r["ok"] for r in rows)
    assert {r["impl"] for r in rows} == {"main", "new"}


@pytest.mark.parametrize("layout", ["sbh", "bsh"])
def test_qk_norm_rope_eps0_padded_heads(device, layout):
    """eps = 0 with a head count that pads the head tile (3 q heads): the padded lanes
    (x = 0, rstd = inf) must not put NaN into the norm weights' gradients."""
    B, S, H, Hkv, D, R = 2, 4, 3, 1, 16, 8
    qkv = _qkv(layout, B, S, H, Hkv, D, torch.float32, device)
    freqs = linghe.rope_freqs(S, R, device=device)
    kw = dict(num_heads=H, num_kv_heads=Hkv, rotary_dim=R, layout=layout, eps=0.0)
    ws = [torch.rand(D, device=device) + 0.5 for _ in range(2)]
    outs, grads = [], []
    for fn in (linghe.qk_norm_rope, ref.qk_norm_rope):
        x = qkv.detach().clone().requires_grad_()
        w = [t.detach().clone().requires_grad_() for t in ws]
        out = fn(x, freqs, q_norm_weight=w[0], k_norm_weight=w[1], **kw)
        torch.manual_seed(1)
        loss = sum((o.float() * torch.randn_like(o.float())).sum() for o in out)
        grads.append(torch.autograd.grad(loss, [x, *w]))
        outs.append(out)
    for o, r in zip(*outs):
        assert_close(o, r)
    for a, b, n in zip(*grads, ["dqkv", "dq_norm_weight", "dk_norm_weight"]):
        assert torch.isfinite(a).all(), n
        assert_close(a, b, name=n)
