"""The end-to-end model of ``python -m benchmark.e2e``: a Ling-mini-2.0-shaped MoE decoder
that runs in three modes on the same parameters.

- ``"torch"``: plain PyTorch. Every op is its ``linghe/reference.py`` spec (torch ops), so
  the math has one source of truth; the expert GEMMs are ``torch._grouped_mm`` on a CUDA
  GPU that has it for bf16 (the fastest plain-PyTorch grouped GEMM), else the reference's
  per-expert loop; ``torch.nn.functional.embedding`` and ``torch.nn.utils.clip_grad_norm_``.
  Data-dependent shapes (``reference.permute``) make it host-synchronising: it is the
  eager baseline, never captured in a CUDA graph.
- ``"bf16"``: linghe's fused ops (``rms_norm``, ``qk_norm_rope``, ``group_rms_norm_gate``,
  ``nn.MoE``: router GEMM, ``topk_route``, ``permute``, ``grouped_mm``, ``silu_mul``,
  ``unpermute``; ``linear_cross_entropy``; ``optim.clip_grad_norm_``), bf16 GEMMs, under
  ``linghe.TrainingContext(fp8=None)`` (which runs the backward on the calling thread).
- ``"fp8"``: the same under ``linghe.TrainingContext(fp8="blockwise")``: the attention
  projections, the shared expert and the expert GEMMs run FP8 blockwise; the LM head
  (inside ``linear_cross_entropy``) stays bf16.

Attention is ``torch.nn.functional.scaled_dot_product_attention`` (causal, GQA) in every
mode. The token embedding of the linghe modes is ``linghe.embedding``: its backward sorts
the ids on the device and sums each id's rows in one program (float64, one rounding)
instead of PyTorch's sort-based embedding backward, which synchronises with the host for
more than 3072 indices (pytorch/pytorch#82886) and so cannot be captured in a CUDA graph;
from the second micro-batch on it adds the touched rows into ``.grad`` in place (fused
gradient accumulation) instead of building a dense ``[V, H]`` gradient.

Layer: ``x += o_proj(group_rms_norm_gate(sdpa(qk_norm_rope(qkv)), gate))`` with ``qkv`` and
``gate`` from one projection of ``rms_norm(x)``, then ``x += MoE(rms_norm(x))``; after the
last layer ``rms_norm`` and the linear cross entropy against the next token. The expert
bias (aux-loss-free balancing) is updated from each step's token counts.
"""

from __future__ import annotations

import contextlib
import math
import sysconfig
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import linghe
from linghe import reference as ref
from linghe.nn.moe import balanced_logits

MODES = ("torch", "bf16", "fp8")


# ======================================================================================
# configuration
# ======================================================================================


@dataclass(frozen=True)
class E2EConfig:
    """Shapes of the decoder and of one training step's batch."""

    hidden: int = 2048
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64
    gate_groups: int = 4          # groups of the RMSNorm gate on the attention output
    experts: int = 256
    topk: int = 8
    expert_groups: int = 8        # group-limited routing: 8 groups, best 4 eligible
    topk_groups: int = 4
    moe_intermediate: int = 1024
    shared_experts: int = 1
    vocab: int = 157184
    seq: int = 4096
    batch: int = 2
    align: int = 16               # expert segment alignment (torch._grouped_mm needs 8)
    eps: float = 1e-6
    rope_base: float = 10000.0
    micro_batches: int = 1        # forward+backward passes per optimizer step
    deferred_wgrad: bool = False  # linghe modes: expert (and FP8 head) wgrad once per step
    deferred_head_wgrad: bool = True  # with deferred_wgrad: the FP8 head's too

    @property
    def tokens(self) -> int:
        """Tokens of one forward pass (one micro-batch)."""
        return self.batch * self.seq

    @property
    def step_tokens(self) -> int:
        """Tokens of one optimizer step (every micro-batch)."""
        return self.tokens * self.micro_batches

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim

    def as_dict(self) -> dict:
        return asdict(self)


#: Ling-mini-2.0 shapes (the benchmark's default), a smaller width of the same structure
#: for the 300-step loss curves (2 layers: an eager step of that size is host-bound, so
#: its time grows with the layers, not the width; 300 steps of three modes plus their
#: compiles fit ~2 minutes of an H200), and a tiny one for the CPU interpreter (tests).
PRESETS = {
    "ling-mini": E2EConfig(),
    "small": E2EConfig(hidden=512, layers=2, heads=4, kv_heads=1, head_dim=128,
                       rotary_dim=64, experts=64, topk=8, expert_groups=8, topk_groups=4,
                       moe_intermediate=256, vocab=256, seq=512, batch=8),
    "tiny": E2EConfig(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, rotary_dim=32,
                      experts=4, topk=2, expert_groups=2, topk_groups=1,
                      moe_intermediate=64, vocab=259, seq=5, batch=2, align=4),
}


def preset(name: str, **overrides) -> E2EConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown width {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# ======================================================================================
# FLOPs and parameter counts
# ======================================================================================


def active_params_per_layer(cfg: E2EConfig) -> int:
    """Parameters one token multiplies with in one layer (norm weights left out): the
    attention projections, the router, ``topk`` routed experts and the shared experts."""
    H, I = cfg.hidden, cfg.moe_intermediate
    attn = H * (cfg.qkv_width + cfg.attn_width) + cfg.attn_width * H
    router = cfg.experts * H
    experts = (cfg.topk + cfg.shared_experts) * 3 * H * I
    return attn + router + experts


def total_params(cfg: E2EConfig) -> int:
    """All parameters (norm weights included)."""
    H, I, E = cfg.hidden, cfg.moe_intermediate, cfg.experts
    attn = H * (cfg.qkv_width + cfg.attn_width) + cfg.attn_width * H
    moe = E * H + E * 3 * H * I + cfg.shared_experts * 3 * H * I
    norms = 2 * H + 2 * cfg.head_dim + cfg.attn_width
    return cfg.layers * (attn + moe + norms) + 2 * cfg.vocab * H + H


def step_flops(cfg: E2EConfig) -> dict:
    """Model FLOPs of one training step (forward + backward), counted as
    ``6 * N_active * tokens`` for the matmuls (the LM head included, the embedding lookup
    not) plus causal attention ``3 * (2 * 2 * B * S^2 * heads * head_dim) / 2``: the two
    attention matmuls, forward and twice that backward, half of the score matrix (causal);
    no recomputation, no padding rows of the expert GEMMs. Every micro-batch counts."""
    T = cfg.step_tokens
    dense = 6 * (cfg.layers * active_params_per_layer(cfg) + cfg.vocab * cfg.hidden) * T
    attn = (cfg.micro_batches * cfg.layers * 3 * 2 * cfg.batch * cfg.seq * cfg.seq
            * cfg.heads * cfg.head_dim)
    return {"dense": dense, "attention": attn, "total": dense + attn}


def estimate_layers(cfg: E2EConfig, memory_bytes: int, modes=MODES) -> int:
    """How many layers fit in ``memory_bytes`` (at least 2), from a model of the memory of
    a step: bf16 weights, gradients and AdamW's two moments (8 bytes per parameter), the
    FP8 copies of the weights in FP8 mode (2 bytes per parameter), the saved activations
    of a layer (the MoE rows, the expert GEMM outputs, the attention tensors; doubled for
    the torch mode, whose reference ops keep float32 copies), the deferred expert wgrad's
    stash (``deferred_wgrad``: each micro-batch but the last keeps both expert GEMMs'
    ``d_out`` and rows, counted in bf16; in FP8 mode also the LM head's FP8 copies, in
    case its head is FP8) and a fixed part (embedding, LM head, the logits
    of the torch mode's cross entropy and workspace). 10% headroom."""
    H, T = cfg.hidden, cfg.tokens
    one = replace(cfg, layers=1)
    layer_params = total_params(one) - total_params(replace(cfg, layers=0))
    rows = T * cfg.topk + cfg.experts * (cfg.align - 1)
    act = 2 * (rows * (H + 3 * cfg.moe_intermediate + H)
               + T * (cfg.qkv_width + 2 * cfg.attn_width + 5 * H
                      + 3 * cfg.shared_experts * cfg.moe_intermediate))
    per_byte = 10 if "fp8" in modes else 8
    per_layer = layer_params * per_byte + act * (2 if "torch" in modes else 1)
    if cfg.deferred_wgrad and cfg.micro_batches > 1:
        # gate_up: d_out [rows, 2I], rows [rows, H]; down: d_out [rows, H], a [rows, I]
        I = cfg.moe_intermediate
        per_layer += (cfg.micro_batches - 1) * rows * (3 * I + 2 * H) * 2
    logits = T * cfg.vocab * (2 + 4 + 4) if "torch" in modes else 0
    fixed = 2 * cfg.vocab * H * 8 + logits + (4 << 30)
    if ("fp8" in modes and cfg.deferred_wgrad and cfg.deferred_head_wgrad
            and cfg.micro_batches > 1):
        # an FP8 head's deferred weight gradient: the columnwise copies of the others
        fixed += (cfg.micro_batches - 1) * T * (cfg.vocab + H)
    return max(2, int((0.9 * memory_bytes - fixed) // per_layer))


# ======================================================================================
# the model
# ======================================================================================


def _torch_grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                      align: int) -> torch.Tensor:
    """Plain-PyTorch grouped GEMM ``rows_e @ weight[e]^T``: ``torch._grouped_mm`` for bf16
    on a CUDA GPU of compute capability 9.0 or newer when segments start on multiples of 8
    rows (its weight gradient needs 16-byte aligned segments), else the reference's
    per-expert loop."""
    if (rows.is_cuda and rows.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and align % 8 == 0 and torch.cuda.get_device_capability(rows.device) >= (9, 0)):
        return torch._grouped_mm(rows, weight.transpose(1, 2),
                                 offs=offsets[1:].to(torch.int32))
    return ref.grouped_mm(rows, weight, offsets)


def torch_moe(moe: linghe.nn.MoE, x: torch.Tensor):
    """What :class:`linghe.nn.MoE` computes, with the reference ops (torch mode):
    ``(out [T, H], tokens_per_expert [E])``. Host syncs: ``reference.permute`` and the
    exact row count (data-dependent shapes)."""
    logits = ref.router_logits(x, moe.router_weight)
    if moe.force_balanced_routing:
        logits = balanced_logits(logits)
    probs, ids, tpe = ref.topk_route(logits, moe.top_k, score=moe.score,
                                     expert_bias=moe.expert_bias, num_groups=moe.num_groups,
                                     topk_groups=moe.topk_groups)
    align = moe.dispatcher.align
    rows, prow, row_index, offsets, _ = ref.permute(x, ids, probs, num_experts=moe.num_experts,
                                                    align=align)
    n = int(offsets[-1])  # the rows in use (a host sync: plain PyTorch has no static bound)
    h = _torch_grouped_mm(rows[:n], moe.experts_gate_up, offsets, align)
    a = ref.silu_mul(h.float(), prow[:n]).to(x.dtype)   # fp32 math, as linghe.silu_mul
    y = _torch_grouped_mm(a, moe.experts_down, offsets, align)
    out = ref.unpermute(y, row_index)
    if moe.shared_experts is not None:
        se = moe.shared_experts
        s = ref.silu_mul(F.linear(x, se.gate_up_proj.weight).float()).to(x.dtype)
        out = out + F.linear(s, se.down_proj.weight)
    return out, tpe


class Block(nn.Module):
    """One decoder layer (attention with qk-norm, half RoPE and an output gate; MoE)."""

    def __init__(self, cfg: E2EConfig, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        nk = {"device": device, "dtype": torch.float32}   # norm weights: see E2EModel
        H, D = cfg.hidden, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = linghe.nn.RMSNorm(H, eps=cfg.eps, **nk)
        # q, k, v (plain [q | k | v] head order) and the output gate in one projection
        self.qkv_gate = linghe.nn.Linear(H, cfg.qkv_width + cfg.attn_width, bias=False, **fk)
        self.q_norm = nn.Parameter(torch.ones(D, **nk))
        self.k_norm = nn.Parameter(torch.ones(D, **nk))
        self.gate_norm = nn.Parameter(torch.ones(cfg.attn_width, **nk))
        self.o_proj = linghe.nn.Linear(cfg.attn_width, H, bias=False, **fk)
        # p.split (not two slices of p): the backward writes p's gradient with one
        # concatenation, where two slices cost two zero-filled copies of p and their sum
        self._split = (cfg.qkv_width, cfg.attn_width)
        self.moe_norm = linghe.nn.RMSNorm(H, eps=cfg.eps, **nk)
        self.moe_norm.quantize_output = False   # the router reads it in high precision
        self.moe = linghe.nn.MoE(H, cfg.experts, cfg.topk, cfg.moe_intermediate,
                                 num_shared_experts=cfg.shared_experts, score="sigmoid",
                                 num_groups=cfg.expert_groups, topk_groups=cfg.topk_groups,
                                 align=cfg.align, wgrad_micro_batches=(
                                     cfg.micro_batches if cfg.deferred_wgrad else 1), **fk)

    def _attention(self, q, k, v):
        # [B, S, h, D] -> SDPA's [B, h, S, D] views; output back to [B, S, h, D]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        return o.transpose(1, 2)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mode: str,
                pending: torch.Tensor | None = None):
        """``(x, m, tokens_per_expert)``: the residual stream after the attention and the
        MoE output ``m`` not yet added to it (``x + m`` is this layer's output). The
        linghe modes add ``pending`` (the previous layer's ``m``) and each residual
        branch inside the following RMSNorm (``RMSNorm(x, residual)``: one kernel, and
        the residual gradient added inside the norm's backward); the torch mode adds
        them with ``+`` (the same sums, rounded the same)."""
        cfg = self.cfg
        B, S, H = x.shape
        rope_kw = dict(num_heads=cfg.heads, num_kv_heads=cfg.kv_heads,
                       rotary_dim=cfg.rotary_dim, layout="bsh", interleaved=False,
                       eps=cfg.eps)
        if mode == "torch":
            if pending is not None:
                x = x + pending
            h = ref.rms_norm(x, self.attn_norm.weight, cfg.eps)
            p = F.linear(h, self.qkv_gate.weight)
            qkv, gate = p.split(self._split, dim=-1)
            q, k, v = ref.qk_norm_rope(qkv, freqs, q_norm_weight=self.q_norm,
                                       k_norm_weight=self.k_norm, **rope_kw)
            a = ref.group_rms_norm_gate(self._attention(q, k, v), gate, self.gate_norm,
                                        num_groups=cfg.gate_groups, eps=cfg.eps,
                                        gate_layout="bsh")
            x = x + F.linear(a, self.o_proj.weight)
            m, tpe = torch_moe(self.moe, ref.rms_norm(x, self.moe_norm.weight, cfg.eps)
                               .view(B * S, H))
            return x, m.view(B, S, H), tpe
        if pending is None:
            hn = self.attn_norm(x)
        else:
            hn, x = self.attn_norm(pending, x)
        p = self.qkv_gate(hn)
        qkv, gate = p.split(self._split, dim=-1)
        q, k, v = linghe.qk_norm_rope(qkv, freqs, q_norm_weight=self.q_norm,
                                      k_norm_weight=self.k_norm, **rope_kw)
        a = linghe.group_rms_norm_gate(self._attention(q, k, v), gate, self.gate_norm,
                                       num_groups=cfg.gate_groups, eps=cfg.eps,
                                       gate_layout="bsh")
        hn, x = self.moe_norm(self.o_proj(a), x)
        m, aux = self.moe(hn)
        return x, m, aux.tokens_per_expert


class E2EModel(nn.Module):
    """The decoder; ``forward(tokens [B, S], labels [B, S], mode)`` returns ``(loss,
    tokens_per_expert per layer)``. Parameters are the same in every mode.

    Weights are ``dtype`` (bf16; AdamW keeps its moments in it too), except the router
    (float32, as :class:`linghe.nn.MoE` has it) and the 1-D norm weights, kept in float32:
    they start at 1, where a bf16 step is 2^-8..2^-7, so bf16 would round AdamW's updates
    of about ``lr`` away and they would never train. The embedding is initialised with
    std 0.02 (bf16 resolves updates of 1e-3 on it), the projections as ``nn.Linear``."""

    def __init__(self, cfg: E2EConfig, device=None, dtype=torch.bfloat16):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, **fk)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(Block(cfg, **fk) for _ in range(cfg.layers))
        self.final_norm = linghe.nn.RMSNorm(cfg.hidden, eps=cfg.eps, device=device,
                                            dtype=torch.float32)
        self.final_norm.quantize_output = False  # feeds the high-precision LM head
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, **fk)
        self.register_buffer("freqs", linghe.rope_freqs(cfg.seq, cfg.rotary_dim,
                                                        cfg.rope_base, device=device),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        cfg = self.cfg
        if mode == "torch":
            x = F.embedding(tokens, self.embed.weight)
        else:
            x = linghe.embedding(tokens, self.embed.weight)
        tpes = []
        m = None
        for layer in self.layers:
            x, m, tpe = layer(x, self.freqs, mode, m)
            tpes.append(tpe)
        lab = labels.reshape(-1)
        if mode == "torch":
            h = (x + m).reshape(-1, cfg.hidden)
            loss = ref.linear_cross_entropy(ref.rms_norm(h, self.final_norm.weight, cfg.eps),
                                            self.lm_head.weight, lab)
        else:
            hn, _ = self.final_norm(m.reshape(-1, cfg.hidden), x.reshape(-1, cfg.hidden))
            # (deferred: the FP8 head's FP8 weight gradient once per step, like the experts')
            loss = linghe.linear_cross_entropy(
                hn, self.lm_head.weight, lab,
                wgrad_micro_batches=(cfg.micro_batches if cfg.deferred_wgrad
                                     and cfg.deferred_head_wgrad else 1))
        return loss, tpes

    @torch.no_grad()
    def update_expert_bias(self, tpes, rate: float = 1e-3) -> None:
        for layer, tpe in zip(self.layers, tpes):
            layer.moe.update_expert_bias(tpe, rate)


def build_model(cfg: E2EConfig, *, device, dtype=torch.bfloat16, seed: int = 0) -> E2EModel:
    """The model with a fixed initialisation: the same ``seed`` on the same device gives
    the same weights, whatever mode runs them."""
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda"
                               else []):
        torch.manual_seed(seed)
        return E2EModel(cfg, device=device, dtype=dtype)


# ======================================================================================
# the training step
# ======================================================================================


#: The fp8 mode's dense layers' weight gradients in FP8 (``True``, the recipe's default) or
#: in bf16 (``benchmark.e2e --fp8-wgrad bf16``), and the MoE experts' (bf16 by default;
#: ``--expert-fp8-wgrad fp8``).
FP8_WGRAD = True
EXPERT_FP8_WGRAD = False
#: linghe modes, eager: the experts' gradient norms from the wgrad kernels
#: (``linghe.optim.AdamW(norm_from_backward=True)``; ``benchmark.e2e --norm-from-backward``).
NORM_FROM_BACKWARD = False
#: The fp8 mode's routed experts in FP8 (``True``) or bf16 (``benchmark.e2e --expert-fp8
#: bf16``: ``TrainingContext(expert_fp8=False)``; the dense layers stay FP8).
EXPERT_FP8 = True
#: The fp8 mode's LM head (logits and hidden-gradient GEMMs) in FP8 (``benchmark.e2e
#: --lm-head-fp8``: ``TrainingContext(lm_head_fp8=True)``; default bf16).
LM_HEAD_FP8 = False


def fp8_context(mode: str):
    """The context a step of ``mode`` runs in: linghe's modes run in a
    ``TrainingContext`` (its backward on the calling thread), the plain PyTorch mode as a
    PyTorch user runs it (the backward on the autograd engine's device thread)."""
    if mode == "fp8":
        return linghe.TrainingContext(fp8="blockwise", fp8_wgrad=FP8_WGRAD,
                                      expert_fp8_wgrad=EXPERT_FP8_WGRAD,
                                      expert_fp8=EXPERT_FP8, lm_head_fp8=LM_HEAD_FP8)
    if mode == "bf16":
        return linghe.TrainingContext(fp8=None)
    return contextlib.nullcontext()


def make_optimizer(model: nn.Module, lr: float = 1e-3, *, mode: str = "torch",
                   capturable: bool = False, lr_tensor: bool = False,
                   weight_decay: float = 0.01, max_norm: float = 1.0,
                   optimizer: str = "auto") -> torch.optim.Optimizer:
    """AdamW (betas 0.9/0.95) with gradient clipping to ``max_norm``, each mode with its
    library's best form (``optimizer="auto"``):

    * torch: PyTorch's fused AdamW (``fused=True`` on CUDA; the default form on the CPU);
      :func:`update` clips with ``torch.nn.utils.clip_grad_norm_`` first;
    * linghe modes: ``linghe.optim.AdamW(max_grad_norm=max_norm)``: the norm in one
      launch, the clip coefficient applied inside the update, one update launch per dtype
      (with :data:`NORM_FROM_BACKWARD`, eager only: the experts' gradient norms come from
      their wgrad kernels).

    ``optimizer="torch"`` gives the linghe modes PyTorch's fused AdamW too (clipped with
    ``linghe.optim.clip_grad_norm_``): the setup of the runs before linghe had an
    optimizer, to separate the optimizer's share of a speed-up.

    PyTorch's fused kernel: one multi-tensor launch per ~21M elements (342 per step at the
    Ling-mini shapes with 4 layers, 7.2 B parameters), 46 ms on an H200 for the ~100 GB it
    must move (14 bytes per bf16 parameter, >= 23 ms at 4.3 TB/s); the foreach form took
    ~105 ms and its capturable form falls back to non-vectorized per-tensor kernels.

    ``capturable``: step counts on the device and no host reads, for CUDA-graph capture
    (linghe's AdamW always is); ``lr_tensor`` holds the learning rate in a device tensor,
    so that :func:`set_lr` changes it between replays of a captured step."""
    if optimizer not in ("auto", "torch"):
        raise ValueError(f"optimizer must be 'auto' or 'torch', got {optimizer!r}")
    device = next(model.parameters()).device
    lr_arg = torch.tensor(lr, dtype=torch.float32, device=device) if lr_tensor else lr
    if mode != "torch" and optimizer == "auto":
        return linghe.optim.AdamW(model.parameters(), lr=lr_arg, betas=(0.9, 0.95),
                                  weight_decay=weight_decay, max_grad_norm=max_norm,
                                  norm_from_backward=NORM_FROM_BACKWARD)
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=lr_arg, betas=(0.9, 0.95),
                             weight_decay=weight_decay, capturable=capturable,
                             fused=fused or None)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate (in place when it is a device tensor: no host sync, and a
    captured graph sees the new value)."""
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def grad_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that have a gradient (the list the clipping reads)."""
    return [p for p in model.parameters() if p.grad is not None]


def forward_backward(model: E2EModel, opt: torch.optim.Optimizer, tokens: torch.Tensor,
                     labels: torch.Tensor, mode: str, *, accumulate: bool = False,
                     loss_scale: float = 1.0) -> tuple[torch.Tensor, list]:
    """Gradients set to None, then forward and backward under the mode's TrainingContext:
    ``(loss, tokens_per_expert per layer)``. ``accumulate``: keep the gradients and add
    this backward's to them (a later micro-batch); ``loss_scale`` multiplies the loss
    that is differentiated (``1 / micro-batches``: the gradient of the mean loss).

    Why None and not zeros: backward then hands each parameter the gradient tensor it has
    just computed (AccumulateGrad's steal, in the parameter's layout: contiguous), instead
    of adding it into a zeroed persistent one: that saves a zero fill and an add over
    every gradient (~14 GB written and ~43 GB moved at the Ling-mini shapes, ~14 ms on an
    H200), and frees the gradients' memory during the forward. A captured step allocates
    the gradients from the graph's pool, at the same addresses on every replay."""
    if not accumulate:
        opt.zero_grad(set_to_none=True)
    with fp8_context(mode):
        loss, tpes = model(tokens, labels, mode)
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
    return loss.detach(), tpes


def accumulate_grads(model: E2EModel, opt: torch.optim.Optimizer, micro: list,
                     mode: str) -> tuple[torch.Tensor, list]:
    """Forward and backward over each ``(tokens, labels)`` of ``micro`` (the micro-batches
    of one optimizer step), the gradients summed into one set, each loss scaled by
    ``1 / len(micro)``: ``(mean loss, tokens per expert per layer summed)``. The FP8
    weight copies the optimizer wrote are reused by every micro-batch."""
    losses, tpes = [], None
    for j, (tok, lab) in enumerate(micro):
        loss, t = forward_backward(model, opt, tok, lab, mode, accumulate=j > 0,
                                   loss_scale=1.0 / len(micro))
        losses.append(loss)
        tpes = t if tpes is None else [a + b for a, b in zip(tpes, t)]
    return torch.stack(losses).mean(), tpes


@torch.no_grad()
def routing_load(model: E2EModel, tokens: torch.Tensor, labels: torch.Tensor,
                 mode: str) -> list[torch.Tensor]:
    """Tokens per expert of each layer for one batch (a forward without gradients)."""
    with fp8_context(mode):
        _, tpes = model(tokens, labels, mode)
    return [t.float() for t in tpes]


def load_stats(tpes: list[torch.Tensor]) -> dict:
    """How even the experts' loads are, over the layers: the busiest expert's tokens over
    the mean (``max_over_mean``, the mean over layers and the worst layer), the experts
    with no token (mean per layer) and the coefficient of variation (mean). One host
    sync (a statistic for the report, not the step)."""
    t = torch.stack([x.float() for x in tpes]).cpu()     # [layers, E]
    mean = t.mean(dim=1)
    ratio = t.max(dim=1).values / mean.clamp_min(1e-9)
    return {"max_over_mean": float(ratio.mean()), "max_over_mean_worst": float(ratio.max()),
            "empty_experts": float((t == 0).float().sum(dim=1).mean()),
            "cv": float((t.std(dim=1) / mean.clamp_min(1e-9)).mean())}


def force_balanced_routing(model: E2EModel, on: bool = True) -> None:
    """Route every layer by random logits (:attr:`linghe.nn.MoE.force_balanced_routing`;
    the torch mode's reference MoE follows the same flag): even expert loads, as a
    trained model's balancing keeps them. Why: this fresh model on byte-level text sends
    most tokens to a few experts (measured on an H100 at lr 1e-3: the busiest expert took
    29-32x the mean, ~240 of 256 experts none), which makes the grouped GEMMs few and
    large, unlike the ~``T * topk / E`` rows per expert of real training; fitting the
    expert biases to even loads on one batch did not carry to the next batches (8.8x)."""
    for layer in model.layers:
        layer.moe.force_balanced_routing = on


def update(model: E2EModel, opt: torch.optim.Optimizer, tpes: list, mode: str,
           max_norm: float = 1.0) -> None:
    """Clip, AdamW, expert-bias update. ``linghe.optim.AdamW`` clips inside its step (to
    its ``max_grad_norm``); with PyTorch's AdamW the gradients are clipped first
    (``torch.nn.utils.clip_grad_norm_`` in the torch mode, linghe's otherwise)."""
    if not isinstance(opt, linghe.optim.AdamW):
        params = grad_params(model)
        if mode == "torch":
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            linghe.optim.clip_grad_norm_(params, max_norm)
    opt.step()
    model.update_expert_bias(tpes)


def train_step(model: E2EModel, opt: torch.optim.Optimizer, tokens: torch.Tensor,
               labels: torch.Tensor, mode: str, max_norm: float = 1.0,
               on_grads: Callable[[], None] | None = None) -> torch.Tensor:
    """One step: :func:`forward_backward` then :func:`update`. Returns the loss (a device
    scalar, detached). No host sync in the linghe modes. ``on_grads`` is called between
    backward and clipping (tests read the raw gradients there)."""
    loss, tpes = forward_backward(model, opt, tokens, labels, mode)
    if on_grads is not None:
        on_grads()
    update(model, opt, tpes, mode, max_norm)
    return loss


# ======================================================================================
# data: the Python installation's own standard library, byte-level
# ======================================================================================


def stdlib_files() -> list[Path]:
    """The ``.py`` files of the standard library (``sysconfig``'s ``stdlib`` path, without
    ``site-packages``), sorted by relative path: a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if "site-packages" not in p.relative_to(root).parts and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's source files concatenated in
    :func:`stdlib_files` order (each followed by a newline)."""
    parts, n = [], 0
    for p in stdlib_files():
        b = p.read_bytes() + b"\n"
        parts.append(b)
        n += len(b)
        if n >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


class ByteBatches:
    """Next-token batches of byte tokens (ids 0..255) from a corpus held on the device:
    step ``i`` reads ``batch`` consecutive windows of ``seq + 1`` bytes starting at window
    ``i * batch`` (wrapping around the corpus)."""

    def __init__(self, data: bytes, batch: int, seq: int, device):
        if len(data) < seq + 2:
            raise ValueError(f"corpus has {len(data)} bytes, need at least seq + 2")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(
            device=device, dtype=torch.long)
        self.batch, self.seq = batch, seq
        self.windows = (len(data) - 1) // (seq + 1)
        self._offs = torch.arange(seq + 1, device=device)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (step * self.batch + torch.arange(self.batch, device=self._offs.device)) \
            % self.windows
        win = self.tokens[w[:, None] * (self.seq + 1) + self._offs[None, :]]
        return win[:, :-1], win[:, 1:]


def corpus_bytes_needed(cfg: E2EConfig, steps: int) -> int:
    return steps * cfg.batch * (cfg.seq + 1) + 1


def lr_at(step: int, steps: int, peak: float, warmup: int = 20, floor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
