"""Split + qk-norm + half RoPE + transpose (qk_norm_rope) forward and backward, and HF
``apply_rope``.

Standard shape: seq 4096 x batch 2, 16 q heads, 4 kv heads, head_dim 128, rotary_dim 64,
qk-norm (bf16 weights), layout "sbh", Megatron-interleaved qkv, bf16.
"""

import torch

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, backward_of, case, compiled


def _shape(cfg: Config):
    if cfg.cpu:
        return dict(B=1, S=8, H=4, Hkv=2, D=16, R=8)
    return dict(B=2, S=4096, H=16, Hkv=4, D=128, R=64)


@case("qk_norm_rope")
def qk_norm_rope_case(cfg: Config):
    p = _shape(cfg)
    B, S, H, Hkv, D, R = p["B"], p["S"], p["H"], p["Hkv"], p["D"], p["R"]
    dev, dt = cfg.device, torch.bfloat16
    W = (H + 2 * Hkv) * D
    T = B * S
    qkv = torch.randn(S, B, W, device=dev, dtype=dt, requires_grad=True)
    freqs = linghe.rope_freqs(S, R, device=dev)
    qw = (torch.rand(D, device=dev) + 0.5).to(dt).requires_grad_()
    kw = (torch.rand(D, device=dev) + 0.5).to(dt).requires_grad_()
    kwargs = dict(num_heads=H, num_kv_heads=Hkv, rotary_dim=R, layout="sbh",
                  interleaved=True)

    def eager():
        return ref.qk_norm_rope(qkv, freqs, q_norm_weight=qw, k_norm_weight=kw, **kwargs)

    def comp():
        return compiled(ref.qk_norm_rope)(qkv, freqs, q_norm_weight=qw, k_norm_weight=kw,
                                          **kwargs)

    def ours():
        return linghe.qk_norm_rope(qkv, freqs, q_norm_weight=qw, k_norm_weight=kw, **kwargs)

    freq_bytes = S * (R // 2) * 4
    # fwd: read qkv once, write q, k, v once (+ the angles of S positions).
    fwd_bytes = 2 * T * W * 2 + freq_bytes
    # bwd: read dq, dk, dv and the q/k part of qkv (rstd and the weight gradient need
    # it; v is not read), write dqkv.
    bwd_bytes = T * W * 2 + T * (H + Hkv) * D * 2 + T * W * 2 + freq_bytes
    name = f"qk_norm_rope [S{S},B{B},{H}q/{Hkv}kv,D{D},R{R}] sbh bf16"
    grads = [torch.randn(B, S, H, D, device=dev, dtype=dt),
             torch.randn(B, S, Hkv, D, device=dev, dtype=dt),
             torch.randn(B, S, Hkv, D, device=dev, dtype=dt)]
    ins = [qkv, qw, kw]
    return [
        Bench(name=name + " fwd", bytes=fwd_bytes, tol=1e-2,
              run={"eager": eager, "compile": comp, "linghe": ours}),
        Bench(name=name + " bwd", bytes=bwd_bytes, tol=1e-2,
              run={"eager": backward_of(eager, ins, grads),
                   "compile": backward_of(comp, ins, grads),
                   "linghe": backward_of(ours, ins, grads)},
              note="bytes count only q/k of qkv re-read"),
    ]


@case("apply_rope")
def apply_rope_case(cfg: Config):
    B, H, Hk, S, D = (1, 4, 2, 8, 16) if cfg.cpu else (2, 16, 4, 4096, 128)
    dev, dt = cfg.device, torch.bfloat16
    q = torch.randn(B, S, H, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, Hk, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    ang = linghe.rope_freqs(S, D, device=dev)
    emb = torch.cat([ang, ang], -1)[None].expand(B, S, D)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)

    def eager():
        return ref.apply_rope(q, k, cos, sin)

    def ours():
        return linghe.apply_rope(q, k, cos, sin)

    nbytes = 2 * B * S * (H + Hk) * D * 2 + 2 * S * D * 2
    name = f"apply_rope HF [B{B},{H}q/{Hk}k,S{S},D{D}] bf16"
    gs = [torch.randn(B, H, S, D, device=dev, dtype=dt),
          torch.randn(B, Hk, S, D, device=dev, dtype=dt)]
    return [
        Bench(name=name + " fwd", bytes=nbytes, tol=1e-2,
              run={"eager": eager, "compile": lambda: compiled(ref.apply_rope)(q, k, cos, sin),
                   "linghe": ours}),
        Bench(name=name + " bwd", bytes=nbytes, tol=1e-2,
              run={"eager": backward_of(eager, [q, k], gs),
                   "linghe": backward_of(ours, [q, k], gs)}),
    ]
