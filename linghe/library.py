"""linghe's ops registered with ``torch.library``, so that ``torch.compile`` traces them.

Dynamo cannot trace a Triton launch through :func:`linghe.utils.launch` (and need not: a
kernel is one opaque step of the graph). So every launcher pair of ``linghe/fwd`` and
``linghe/bwd`` is wrapped here as a custom op ``linghe::<op>_fwd`` / ``linghe::<op>_bwd``
with

- a fake (meta) implementation that gives the shapes, dtypes and strides the launcher
  gives (its outputs are fresh contiguous buffers), so the graph is built without running
  a kernel;
- ``register_autograd`` wiring the forward op to the backward op.

The public functions in ``linghe/functional`` validate their inputs as always and then call
the wrappers of this module only when ``torch.compiler.is_compiling()`` is true: eager
calls keep their ``autograd.Function`` path, whose host time per call is what the
benchmark measures (``is_compiling()`` costs about 0.1 µs).

Conventions:

- A custom op cannot return ``None``; an output the launcher leaves out (e.g. the ``h`` of
  ``rms_norm`` without a residual) is a 0-element placeholder (:func:`_absent`) that the
  wrapper drops. Outputs never alias inputs or each other (a launcher that returns two
  views of one buffer is given a copy of the small one).
- Ops whose result is an :class:`~linghe.fp8.Fp8Tensor` return its component tensors, and
  the wrapper builds the ``Fp8Tensor`` outside the op. Their gradient is taken with respect
  to the logical high-precision tensor (straight-through the quantization), which no
  component stands for; so their autograd is a small ``autograd.Function`` here that
  dynamo traces (forward: the op plus the ``Fp8Tensor``; backward: the backward op).
- Integer outputs (ids, counts, offsets) are never differentiable; float outputs that
  are not (``rstd``, ``lse``) are marked non-differentiable.

What stays outside a compiled graph (each documented where it applies):

- a compiled region may not *return* an ``Fp8Tensor`` that requires grad: AOTAutograd
  expects the gradient of a subclass output to be of that subclass, and an ``Fp8Tensor``'s
  gradient is a plain tensor. Inside a region (``rms_norm_quant`` -> FP8 ``Linear``) it
  flows normally; dequantize or detach it before returning it;
- FP8 Linear: the ``delayed`` recipe (state updated outside the graph) raises; FP8 weights
  (Linear, grouped GEMMs) are quantized on every call (a graph keeps no ``WeightCache``);
- ``grouped_swiglu(fp8=True)`` (the fused FP8 expert FFN of ``nn.MoE``) runs as the
  unfused FP8 path ``grouped_mm(fp8) -> silu_mul -> grouped_mm(fp8)``
  (:func:`grouped_swiglu_fp8`: a documented fallback, within FP8 rounding of eager);
- vocab-parallel losses (``process_group=``) and expert parallelism across ranks (their
  split sizes are host syncs), and debug mode (``linghe.set_debug``: data checks that
  sync with the host) are graph breaks: ``fullgraph=True`` refuses them.
"""

import functools
import math

import torch
from torch import Tensor
from torch.library import custom_op

from .bwd import activation as _bwd_act
from .bwd import embedding as _bwd_emb
from .bwd import gate as _bwd_gate
from .bwd import grouped_mm as _bwd_gmm
from .bwd import loss as _bwd_loss
from .bwd import norm as _bwd_norm
from .bwd import permute as _bwd_perm
from .bwd import rope as _bwd_rope
from .bwd import router as _bwd_router
from .fp8 import gemm as _gemm
from .fp8 import quantize as _quant
from .fp8.recipe import Fp8Recipe
from .fp8.tensor import Fp8Tensor
from .fwd import activation as _fwd_act
from .fwd import embedding as _fwd_emb
from .fwd import gate as _fwd_gate
from .fwd import grouped_mm as _fwd_gmm
from .fwd import loss as _fwd_loss
from .fwd import norm as _fwd_norm
from .fwd import permute as _fwd_perm
from .fwd import rope as _fwd_rope
from .fwd import router as _fwd_router
from .layout import ExpertLayout
from .utils import cdiv, rows_view

FP8 = torch.float8_e4m3fn
F32 = torch.float32


def _absent(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The placeholder for an output the launcher did not produce."""
    return like.new_empty(0, dtype=dtype or like.dtype)


def _or_absent(t: Tensor | None, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return t if t is not None else _absent(like, dtype)


def _new(like: Tensor, *shape, dtype: torch.dtype | None = None) -> Tensor:
    """A fake output: contiguous, on ``like``'s device."""
    return like.new_empty(shape, dtype=dtype or like.dtype)


def _fake_1x128(x: Tensor, M: int, K: int, rowwise: bool, columnwise: bool):
    """Fake ``(q, s, qt, st)`` of a 1x128 quantization of ``[M, K]`` (placeholders for the
    copies not made)."""
    q = _new(x, M, K, dtype=FP8) if rowwise else _absent(x, FP8)
    s = _new(x, M, cdiv(K, 128), dtype=F32) if rowwise else _absent(x, F32)
    qt = _new(x, K, M, dtype=FP8) if columnwise else _absent(x, FP8)
    st = _new(x, K, cdiv(M, 128), dtype=F32) if columnwise else _absent(x, F32)
    return q, s, qt, st


def _fp8_tensor(shape, dtype, q, s, qt, st, rowwise: bool, columnwise: bool,
                scaling: str = "1x128") -> Fp8Tensor:
    """An ``Fp8Tensor`` from an op's components (placeholders dropped)."""
    return Fp8Tensor(shape, dtype, rowwise_data=q if rowwise else None,
                     rowwise_scale=s if rowwise else None,
                     columnwise_data=qt if columnwise else None,
                     columnwise_scale=st if columnwise else None, scaling=scaling)


def _dense_grad(g: Tensor) -> Tensor:
    """The gradient of an ``Fp8Tensor`` output as a contiguous tensor (a broadcast one,
    e.g. of ``.sum()``, is materialized). Under compile it is always a plain tensor (no
    linghe op returns an ``Fp8Tensor`` gradient through autograd). No ``isinstance`` test
    here: with dynamic shapes dynamo took that branch for the traced gradient, and
    ``.dequantize()`` then resolved to ``aten::dequantize`` (test_dynamic_shapes)."""
    return g.contiguous()


# ======================================================================================
# norm: rms_norm, rms_norm_quant
# ======================================================================================


@custom_op("linghe::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, residual: Tensor | None,
                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(y [M, K], h [M, K] or absent, rstd [M] fp32)`` of ``x [M, K]``."""
    y, h, rstd = _fwd_norm.rms_norm_fwd(x, weight, eps, residual)
    return y, _or_absent(h, x), rstd


@rms_norm_fwd.register_fake
def _(x, weight, residual, eps):
    M, K = x.shape
    h = _new(x, M, K) if residual is not None else _absent(x)
    return _new(x, M, K), h, _new(x, M, dtype=F32)


@custom_op("linghe::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, dh: Tensor | None,
                 need_dweight: bool) -> tuple[Tensor, Tensor]:
    """``(dx [M, K] x.dtype, dweight [K] or absent)``; ``dh`` adds the residual stream's
    gradient."""
    dx, dw = _bwd_norm.rms_norm_bwd(dy, x, weight, rstd, dh, need_dweight=need_dweight)
    return dx, _or_absent(dw, weight)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, dh, need_dweight):
    dw = _new(weight, weight.shape[0]) if need_dweight else _absent(weight)
    return _new(x, *x.shape), dw


def _rms_norm_setup(ctx, inputs, output):
    x, weight, residual, _ = inputs
    _, h, rstd = output
    ctx.has_res = residual is not None
    ctx.save_for_backward(h if ctx.has_res else x, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _rms_norm_backward(ctx, dy, dh, _drstd):
    saved, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1]
    dx, dw = rms_norm_bwd(dy.contiguous(), saved, weight, rstd,
                          dh.contiguous() if ctx.has_res else None, need_dw)
    return dx, (dw if need_dw else None), (dx if ctx.has_res else None), None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None):
    """:func:`linghe.rms_norm` through the custom ops (inputs already validated)."""
    y, h, _ = rms_norm_fwd(rows_view(x), weight.contiguous(),
                           rows_view(residual) if residual is not None else None, float(eps))
    if residual is None:
        return y.view(x.shape)
    return y.view(x.shape), h.view(x.shape)


@custom_op("linghe::rms_norm_quant_fwd", mutates_args=())
def rms_norm_quant_fwd(x: Tensor, weight: Tensor, eps: float, columnwise: bool,
                       pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, s, qt or absent, st or absent, rstd)`` of ``x [M, K]`` (1x128 layout)."""
    q, s, qt, st, rstd = _fwd_norm.rms_norm_quant_fwd(x, weight, eps, columnwise=columnwise,
                                                      pow2_scale=pow2_scale)
    return q, s, _or_absent(qt, q), _or_absent(st, s), rstd


@rms_norm_quant_fwd.register_fake
def _(x, weight, eps, columnwise, pow2_scale):
    M, K = x.shape
    return (*_fake_1x128(x, M, K, True, columnwise), _new(x, M, dtype=F32))


class _RMSNormQuant(torch.autograd.Function):
    """Straight-through autograd of ``rms_norm_quant`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, eps, columnwise, pow2_scale):
        x2 = rows_view(x)
        q, s, qt, st, rstd = rms_norm_quant_fwd(x2, weight, eps, columnwise, pow2_scale)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return _fp8_tensor(x.shape, x.dtype, q, s, qt, st, True, columnwise)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[1]
        dx, dw = rms_norm_bwd(rows_view(_dense_grad(dy)), x2, weight, rstd, None, need_dw)
        return dx.view(ctx.x_shape), (dw if need_dw else None), None, None, None


def rms_norm_quant(x: Tensor, weight: Tensor, eps: float, columnwise: bool,
                   pow2_scale: bool) -> Fp8Tensor:
    """:func:`linghe.rms_norm_quant` through the custom ops (inputs already validated)."""
    return _RMSNormQuant.apply(x, weight.contiguous(), float(eps), bool(columnwise),
                               bool(pow2_scale))


# ======================================================================================
# fp8: quantize_1x128, quantize_128x128 (no autograd, as in eager)
# ======================================================================================


@custom_op("linghe::quantize_1x128", mutates_args=())
def quantize_1x128_op(x: Tensor, rowwise: bool, columnwise: bool,
                      pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q, s, qt, st)`` of ``x [M, K]``, placeholders for the copies not asked for."""
    q, s, qt, st = _quant.quantize_1x128_launch(x, rowwise, columnwise, pow2_scale)
    return (_or_absent(q, x, FP8), _or_absent(s, x, F32), _or_absent(qt, x, FP8),
            _or_absent(st, x, F32))


@quantize_1x128_op.register_fake
def _(x, rowwise, columnwise, pow2_scale):
    M, K = x.shape
    return _fake_1x128(x, M, K, rowwise, columnwise)


def quantize_1x128(x: Tensor, rowwise: bool, columnwise: bool, pow2_scale: bool) -> Fp8Tensor:
    """:func:`linghe.quantize_1x128` through the custom op (inputs already validated)."""
    q, s, qt, st = quantize_1x128_op(rows_view(x.detach()), bool(rowwise), bool(columnwise),
                                     bool(pow2_scale))
    return _fp8_tensor(x.shape, x.dtype, q, s, qt, st, rowwise, columnwise)


@custom_op("linghe::quantize_128x128", mutates_args=())
def quantize_128x128_op(w: Tensor, columnwise: bool,
                        pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q [N, K], s [N/128, K/128], qt [K, N] or absent, st or absent)`` of ``w``."""
    q, s, qt, st = _quant.quantize_128x128_launch(w, columnwise, pow2_scale)
    return q, s, _or_absent(qt, q), _or_absent(st, s)


@quantize_128x128_op.register_fake
def _(w, columnwise, pow2_scale):
    N, K = w.shape
    GN, GK = cdiv(N, 128), cdiv(K, 128)
    if columnwise:
        return (_new(w, N, K, dtype=FP8), _new(w, GN, GK, dtype=F32), _new(w, K, N, dtype=FP8),
                _new(w, GK, GN, dtype=F32))
    return _new(w, N, K, dtype=FP8), _new(w, GN, GK, dtype=F32), _absent(w, FP8), _absent(w, F32)


def quantize_128x128(w: Tensor, columnwise: bool, pow2_scale: bool) -> Fp8Tensor:
    """:func:`linghe.quantize_128x128` through the custom op (inputs already validated)."""
    q, s, qt, st = quantize_128x128_op(w.detach(), bool(columnwise), bool(pow2_scale))
    return _fp8_tensor(w.shape, w.dtype, q, s, qt, st, True, columnwise, scaling="128x128")


# ======================================================================================
# rope: qk_norm_rope, apply_rope
# ======================================================================================


@custom_op("linghe::qk_norm_rope_fwd", mutates_args=())
def qk_norm_rope_fwd(qkv: Tensor, freqs: Tensor, position_ids: Tensor | None,
                     q_norm_weight: Tensor | None, k_norm_weight: Tensor | None,
                     num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                     layout: str, interleaved: bool, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, D])``, contiguous."""
    return _fwd_rope.qk_norm_rope_fwd(
        qkv, freqs, position_ids, q_norm_weight, k_norm_weight, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, layout=layout,
        interleaved=interleaved, eps=eps)


@qk_norm_rope_fwd.register_fake
def _(qkv, freqs, position_ids, q_norm_weight, k_norm_weight, num_heads, num_kv_heads,
      head_dim, rotary_dim, layout, interleaved, eps):
    B, S = (qkv.shape[1], qkv.shape[0]) if layout == "sbh" else (qkv.shape[0], qkv.shape[1])
    return (_new(qkv, B, S, num_heads, head_dim), _new(qkv, B, S, num_kv_heads, head_dim),
            _new(qkv, B, S, num_kv_heads, head_dim))


@custom_op("linghe::qk_norm_rope_bwd", mutates_args=())
def qk_norm_rope_bwd(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor | None, freqs: Tensor,
                     position_ids: Tensor | None, q_norm_weight: Tensor | None,
                     k_norm_weight: Tensor | None, num_heads: int, num_kv_heads: int,
                     head_dim: int, rotary_dim: int, layout: str, interleaved: bool,
                     eps: float, qkv_shape: list[int],
                     qkv_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(dqkv, dq_norm_weight or absent, dk_norm_weight or absent)``; ``qkv`` is needed
    only with a norm weight."""
    dqkv, gq, gk = _bwd_rope.qk_norm_rope_bwd(
        dq, dk, dv, qkv, freqs, position_ids, q_norm_weight, k_norm_weight,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rotary_dim=rotary_dim, layout=layout, interleaved=interleaved, eps=eps,
        qkv_shape=qkv_shape, qkv_dtype=qkv_dtype)
    if gq is not None and gk is not None and \
            gk.untyped_storage().data_ptr() == gq.untyped_storage().data_ptr():
        gk = gk.clone()  # both were reduced in one launch into halves of one buffer
    return dqkv, _or_absent(gq, dqkv), _or_absent(gk, dqkv)


@qk_norm_rope_bwd.register_fake
def _(dq, dk, dv, qkv, freqs, position_ids, q_norm_weight, k_norm_weight, num_heads,
      num_kv_heads, head_dim, rotary_dim, layout, interleaved, eps, qkv_shape, qkv_dtype):
    dqkv = dq.new_empty(qkv_shape, dtype=qkv_dtype)
    gq = _new(q_norm_weight, head_dim) if q_norm_weight is not None else _absent(dqkv)
    gk = _new(k_norm_weight, head_dim) if k_norm_weight is not None else _absent(dqkv)
    return dqkv, gq, gk


_ROPE_OPTS = ("num_heads", "num_kv_heads", "head_dim", "rotary_dim", "layout", "interleaved",
              "eps")


def _qk_norm_rope_setup(ctx, inputs, output):
    qkv, freqs, position_ids, qw, kw = inputs[:5]
    ctx.opts = inputs[5:]
    # As in eager: qkv is saved only when the norm backward needs it.
    ctx.save_for_backward(qkv if (qw is not None or kw is not None) else None, freqs,
                          position_ids, qw, kw)
    ctx.qkv_meta = (list(qkv.shape), qkv.dtype)


def _qk_norm_rope_backward(ctx, dq, dk, dv):
    qkv, freqs, position_ids, qw, kw = ctx.saved_tensors
    dqkv, gq, gk = qk_norm_rope_bwd(dq.contiguous(), dk.contiguous(), dv.contiguous(), qkv,
                                    freqs, position_ids, qw, kw, *ctx.opts, *ctx.qkv_meta)
    return (dqkv, None, None, gq if qw is not None else None, gk if kw is not None else None,
            *([None] * len(_ROPE_OPTS)))


qk_norm_rope_fwd.register_autograd(_qk_norm_rope_backward, setup_context=_qk_norm_rope_setup)


def qk_norm_rope(qkv: Tensor, freqs: Tensor, position_ids: Tensor | None,
                 q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, opts: dict):
    """:func:`linghe.qk_norm_rope` through the custom ops (``opts`` as the functional
    layer builds them; inputs already validated)."""
    return qk_norm_rope_fwd(qkv, freqs, position_ids, q_norm_weight, k_norm_weight,
                            *(opts[k] for k in _ROPE_OPTS))


@custom_op("linghe::apply_rope_fwd", mutates_args=())
def apply_rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                   position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Hugging Face-layout RoPE of ``q``, ``k``: contiguous ``(q_embed, k_embed)``."""
    return _fwd_rope.hf_rope(q, k, cos, sin, position_ids, backward=False)


@custom_op("linghe::apply_rope_bwd", mutates_args=())
def apply_rope_bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor,
                   position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """The adjoint rotation of the gradients: contiguous ``(dq, dk)``."""
    return _fwd_rope.hf_rope(dq, dk, cos, sin, position_ids, backward=True)


def _fake_rope(q, k, cos, sin, position_ids):
    return _new(q, *q.shape), _new(k, *k.shape)


apply_rope_fwd.register_fake(_fake_rope)
apply_rope_bwd.register_fake(_fake_rope)


def _apply_rope_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[2:])


def _apply_rope_backward(ctx, dq, dk):
    cos, sin, position_ids = ctx.saved_tensors
    gq, gk = apply_rope_bwd(dq.contiguous(), dk.contiguous(), cos, sin, position_ids)
    return gq, gk, None, None, None


apply_rope_fwd.register_autograd(_apply_rope_backward, setup_context=_apply_rope_setup)


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None):
    """:func:`linghe.apply_rope` through the custom ops (inputs already validated and
    ``cos``/``sin`` broadcast as the functional layer does)."""
    return apply_rope_fwd(q, k, cos, sin, position_ids)


# ======================================================================================
# gate: group_rms_norm_gate
# ======================================================================================


@custom_op("linghe::group_rms_norm_gate_fwd", mutates_args=())
def group_rms_norm_gate_fwd(x3: Tensor, gate: Tensor, weight: Tensor, num_groups: int,
                            eps: float, gate_layout: str) -> Tensor:
    """``y`` contiguous with the gate's shape, in ``x3``'s dtype."""
    return _fwd_gate.group_rms_norm_gate_fwd(x3, gate, weight, num_groups=num_groups, eps=eps,
                                             gate_layout=gate_layout)


@group_rms_norm_gate_fwd.register_fake
def _(x3, gate, weight, num_groups, eps, gate_layout):
    return _new(gate, *gate.shape, dtype=x3.dtype)


@custom_op("linghe::group_rms_norm_gate_bwd", mutates_args=())
def group_rms_norm_gate_bwd(dy: Tensor, x3: Tensor, gate: Tensor, weight: Tensor,
                            num_groups: int, eps: float,
                            gate_layout: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx3, dgate, dweight)``, contiguous."""
    return _bwd_gate.group_rms_norm_gate_bwd(dy, x3, gate, weight, num_groups=num_groups,
                                             eps=eps, gate_layout=gate_layout)


@group_rms_norm_gate_bwd.register_fake
def _(dy, x3, gate, weight, num_groups, eps, gate_layout):
    return _new(x3, *x3.shape), _new(gate, *gate.shape), _new(weight, *weight.shape)


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.opts = inputs[3:]


def _gate_backward(ctx, dy):
    x3, gate, weight = ctx.saved_tensors
    dx3, dg, dw = group_rms_norm_gate_bwd(dy.contiguous(), x3, gate, weight, *ctx.opts)
    return dx3, dg, dw, None, None, None


group_rms_norm_gate_fwd.register_autograd(_gate_backward, setup_context=_gate_setup)


def group_rms_norm_gate(x: Tensor, gate: Tensor, weight: Tensor, opts: dict) -> Tensor:
    """:func:`linghe.group_rms_norm_gate` through the custom ops (inputs validated)."""
    B, S = x.shape[0], x.shape[1]
    x3 = x.reshape(B, S, math.prod(x.shape[2:]))  # (keeps the autograd link when empty)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    return group_rms_norm_gate_fwd(x3, gate, weight, opts["num_groups"], opts["eps"],
                                   opts["gate_layout"])


# ======================================================================================
# activation: silu_mul, silu_mul_quant
# ======================================================================================


@custom_op("linghe::silu_mul_fwd", mutates_args=())
def silu_mul_fwd(x: Tensor, probs: Tensor | None) -> Tensor:
    """``y [M, N]`` of ``x [M, 2N]`` (times ``probs [M]``)."""
    return _fwd_act.silu_mul_fwd(x, probs)


@silu_mul_fwd.register_fake
def _(x, probs):
    return _new(x, x.shape[0], x.shape[1] // 2)


@custom_op("linghe::silu_mul_bwd", mutates_args=())
def silu_mul_bwd(dy: Tensor, x: Tensor, probs: Tensor | None, need_dprobs: bool,
                 counts: Tensor | None, align: int) -> tuple[Tensor, Tensor]:
    """``(dx [M, 2N], dprobs [M] or absent)``; with ``counts`` the rows are grouped by
    expert (padding rows get zero gradients)."""
    dx, dp = _bwd_act.silu_mul_bwd(dy, x, probs, need_dprobs=need_dprobs, counts=counts,
                                   align=align)
    return dx, _or_absent(dp, x)


@silu_mul_bwd.register_fake
def _(dy, x, probs, need_dprobs, counts, align):
    dp = _new(probs, x.shape[0]) if (need_dprobs and probs is not None) else _absent(x)
    return _new(x, *x.shape), dp


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_backward(ctx, dy):
    x, probs = ctx.saved_tensors
    need_dp = probs is not None and ctx.needs_input_grad[1]
    dx, dp = silu_mul_bwd(dy.contiguous(), x, probs, need_dp, None, 1)
    return dx, (dp if need_dp else None)


silu_mul_fwd.register_autograd(_silu_mul_backward, setup_context=_silu_mul_setup)


def silu_mul(x: Tensor, probs: Tensor | None) -> Tensor:
    """:func:`linghe.silu_mul` through the custom ops (``probs`` already ``[M]``)."""
    y = silu_mul_fwd(rows_view(x), probs)
    return y.view(*x.shape[:-1], x.shape[-1] // 2)


@custom_op("linghe::silu_mul_quant_fwd", mutates_args=())
def silu_mul_quant_fwd(x: Tensor, probs: Tensor | None, columnwise: bool,
                       pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q, s, qt or absent, st or absent)``: 1x128 FP8 of ``silu_mul(x [M, 2N])``."""
    q, s, qt, st = _fwd_act.silu_mul_quant_fwd(x, probs, columnwise=columnwise,
                                               pow2_scale=pow2_scale)
    return q, s, _or_absent(qt, q), _or_absent(st, s)


@silu_mul_quant_fwd.register_fake
def _(x, probs, columnwise, pow2_scale):
    return _fake_1x128(x, x.shape[0], x.shape[1] // 2, True, columnwise)


class _SiluMulQuant(torch.autograd.Function):
    """Straight-through autograd of ``silu_mul_quant`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, probs, columnwise, pow2_scale):
        x2 = rows_view(x)
        q, s, qt, st = silu_mul_quant_fwd(x2, probs, columnwise, pow2_scale)
        ctx.save_for_backward(x2, probs)
        ctx.x_shape = x.shape
        shape = (*x.shape[:-1], x.shape[-1] // 2)
        return _fp8_tensor(shape, x.dtype, q, s, qt, st, True, columnwise)

    @staticmethod
    def backward(ctx, dy):
        x2, probs = ctx.saved_tensors
        need_dp = probs is not None and ctx.needs_input_grad[1]
        dy2 = _dense_grad(dy).view(x2.shape[0], x2.shape[1] // 2)
        dx, dp = silu_mul_bwd(dy2, x2, probs, need_dp, None, 1)
        return dx.view(ctx.x_shape), (dp if need_dp else None), None, None


def silu_mul_quant(x: Tensor, probs: Tensor | None, columnwise: bool,
                   pow2_scale: bool) -> Fp8Tensor:
    """:func:`linghe.silu_mul_quant` through the custom ops (``probs`` already ``[M]``)."""
    return _SiluMulQuant.apply(x, probs, bool(columnwise), bool(pow2_scale))


@custom_op("linghe::batch_silu_mul_quant_fwd", mutates_args=())
def batch_silu_mul_quant_fwd(x: Tensor, probs: Tensor | None, counts: Tensor, align: int,
                             columnwise: bool, pow2_scale: bool
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, s, qt or absent, st or absent, g_off [E+1], seg_off [E+1])`` of rows grouped
    by expert (see ``linghe.fwd.activation.batch_silu_mul_quant_fwd``)."""
    q, s, qt, st, g_off, seg_off = _fwd_act.batch_silu_mul_quant_fwd(
        x, probs, counts, align, columnwise=columnwise, pow2_scale=pow2_scale)
    # (the launcher returns both offsets as rows of one buffer: outputs may not alias)
    return q, s, _or_absent(qt, q), _or_absent(st, s), g_off, seg_off.clone()


@batch_silu_mul_quant_fwd.register_fake
def _(x, probs, counts, align, columnwise, pow2_scale):
    R, N = x.shape[0], x.shape[1] // 2
    E = counts.shape[0]
    q, s, qt, st = _fake_1x128(x, R, N, True, columnwise)
    if columnwise:
        st = _new(x, N, _fwd_act.batch_col_groups(R, E), dtype=F32)
    return q, s, qt, st, _new(x, E + 1, dtype=torch.int32), _new(x, E + 1, dtype=torch.int32)


class _BatchSiluMulQuant(torch.autograd.Function):
    """Straight-through autograd of ``batch_silu_mul_quant`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, probs, counts, align, columnwise, pow2_scale, segments):
        q, s, qt, st, g_off, seg_off = batch_silu_mul_quant_fwd(x, probs, counts, align,
                                                                columnwise, pow2_scale)
        ctx.save_for_backward(x, probs, counts)
        ctx.align = align
        ctx.mark_non_differentiable(g_off)
        y = Fp8Tensor((x.shape[0], x.shape[1] // 2), x.dtype, rowwise_data=q, rowwise_scale=s,
                      columnwise_data=qt if columnwise else None,
                      columnwise_scale=st if columnwise else None, scaling="1x128",
                      col_segments=(segments if segments is not None else seg_off)
                      if columnwise else None)
        return y, g_off

    @staticmethod
    def backward(ctx, dy, _dg_off):
        x, probs, counts = ctx.saved_tensors
        need_dp = probs is not None and ctx.needs_input_grad[1]
        dx, dp = silu_mul_bwd(_dense_grad(dy), x, probs, need_dp, counts, ctx.align)
        return dx, (dp if need_dp else None), None, None, None, None, None


def batch_silu_mul_quant(x: Tensor, probs: Tensor | None, counts: Tensor, align: int,
                         columnwise: bool, pow2_scale: bool, segments: Tensor | None):
    """:func:`linghe.batch_silu_mul_quant` through the custom ops (inputs validated;
    ``segments``: the layout's offsets when a layout was given)."""
    return _BatchSiluMulQuant.apply(x, probs, counts, align, bool(columnwise),
                                    bool(pow2_scale), segments)


# ======================================================================================
# router: router_logits, topk_route, router_z_loss
# ======================================================================================


@custom_op("linghe::router_logits_fwd", mutates_args=())
def router_logits_fwd(x: Tensor, weight: Tensor) -> Tensor:
    """fp32-exact ``x [T, K] @ weight [E, K]^T`` -> ``[T, E]`` float32."""
    return _fwd_router.router_logits_fwd(x, weight)


@router_logits_fwd.register_fake
def _(x, weight):
    return _new(x, x.shape[0], weight.shape[0], dtype=F32)


@custom_op("linghe::router_logits_bwd", mutates_args=())
def router_logits_bwd(dlogits: Tensor, x: Tensor, weight: Tensor, need_dx: bool,
                      need_dw: bool) -> tuple[Tensor, Tensor]:
    """``(dx [T, K] x.dtype or absent, dweight [E, K] float32 or absent)``."""
    dx, dw = _bwd_router.router_logits_bwd(dlogits, x, weight, need_dx=need_dx,
                                           need_dw=need_dw)
    return _or_absent(dx, x), _or_absent(dw, x, F32)


@router_logits_bwd.register_fake
def _(dlogits, x, weight, need_dx, need_dw):
    return (_new(x, *x.shape) if need_dx else _absent(x),
            _new(x, *weight.shape, dtype=F32) if need_dw else _absent(x, F32))


def _router_logits_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _router_logits_backward(ctx, dlogits):
    x, weight = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad
    dx, dw = router_logits_bwd(dlogits.float().contiguous(), x, weight, need_dx, need_dw)
    return (dx if need_dx else None), (dw.to(weight.dtype) if need_dw else None)


router_logits_fwd.register_autograd(_router_logits_backward, setup_context=_router_logits_setup)


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """:func:`linghe.router_logits` through the custom ops (inputs already validated)."""
    return router_logits_fwd(rows_view(x), weight).view(*x.shape[:-1], weight.shape[0])


@custom_op("linghe::topk_route_fwd", mutates_args=())
def topk_route_fwd(logits: Tensor, k: int, sigmoid: bool, bias: Tensor | None,
                   num_groups: int, topk_groups: int, normalize: bool,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(probs [T, k] fp32, ids [T, k] int32, tokens_per_expert [E] int32)``."""
    return _fwd_router.topk_route_fwd(logits, k, sigmoid, bias, num_groups, topk_groups,
                                      normalize, scale)


@topk_route_fwd.register_fake
def _(logits, k, sigmoid, bias, num_groups, topk_groups, normalize, scale):
    T, E = logits.shape
    return (_new(logits, T, k, dtype=F32), _new(logits, T, k, dtype=torch.int32),
            _new(logits, E, dtype=torch.int32))


@custom_op("linghe::topk_route_bwd", mutates_args=())
def topk_route_bwd(dprobs: Tensor, logits: Tensor, ids: Tensor, sigmoid: bool,
                   normalize: bool, scale: float) -> Tensor:
    """``dlogits [T, E]`` in logits' dtype."""
    return _bwd_router.topk_route_bwd(dprobs, logits, ids, sigmoid, normalize, scale)


@topk_route_bwd.register_fake
def _(dprobs, logits, ids, sigmoid, normalize, scale):
    return _new(logits, *logits.shape)


def _topk_setup(ctx, inputs, output):
    logits, _, sigmoid, _, _, _, normalize, scale = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.cfg = (sigmoid, normalize, scale)


def _topk_backward(ctx, dprobs, _dids, _dtpe):
    logits, ids = ctx.saved_tensors
    dl = topk_route_bwd(dprobs.float().contiguous(), logits, ids, *ctx.cfg)
    return (dl,) + (None,) * 7


topk_route_fwd.register_autograd(_topk_backward, setup_context=_topk_setup)


def topk_route(logits: Tensor, k: int, sigmoid: bool, bias: Tensor | None, num_groups: int,
               topk_groups: int, normalize: bool, scale: float):
    """:func:`linghe.topk_route` through the custom ops (``logits`` contiguous, ``bias``
    detached: as the functional layer passes them)."""
    return topk_route_fwd(logits, k, sigmoid, bias, num_groups, topk_groups, normalize, scale)


@custom_op("linghe::router_z_loss_fwd", mutates_args=())
def router_z_loss_fwd(logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(loss [] fp32, lse [T] fp32)`` of ``logits [T, E]``."""
    return _fwd_router.router_z_loss_fwd(logits)


@router_z_loss_fwd.register_fake
def _(logits):
    return _new(logits, dtype=F32), _new(logits, logits.shape[0], dtype=F32)


@custom_op("linghe::router_z_loss_bwd", mutates_args=())
def router_z_loss_bwd(g: Tensor, logits: Tensor, lse: Tensor) -> Tensor:
    """``dlogits [T, E]`` in logits' dtype."""
    return _bwd_router.router_z_loss_bwd(g, logits, lse)


@router_z_loss_bwd.register_fake
def _(g, logits, lse):
    return _new(logits, *logits.shape)


def _z_loss_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.mark_non_differentiable(output[1])


def _z_loss_backward(ctx, g, _dlse):
    logits, lse = ctx.saved_tensors
    return router_z_loss_bwd(g, logits, lse)


router_z_loss_fwd.register_autograd(_z_loss_backward, setup_context=_z_loss_setup)


def router_z_loss(logits: Tensor) -> Tensor:
    """:func:`linghe.router_z_loss` through the custom ops (inputs already validated)."""
    loss, _ = router_z_loss_fwd(rows_view(logits))
    return loss


# ======================================================================================
# loss: cross_entropy, linear_cross_entropy (single process: vocab-parallel needs a host
# sync per call and stays eager)
# ======================================================================================


@custom_op("linghe::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(logits: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                      label_smoothing: float, z_loss: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, lse [N] fp32, inv_n [1] fp32 or absent)``: the loss is a float32 scalar,
    or ``[N]`` for ``reduction="none"`` (then ``inv_n`` is absent)."""
    rows, lse, out, inv_n = _fwd_loss.ce_forward(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
        z_loss=z_loss, reduction=reduction)
    if reduction == "none":
        return rows, lse, _absent(lse)
    return out, lse, inv_n


@cross_entropy_fwd.register_fake
def _(logits, labels, ignore_index, reduction, label_smoothing, z_loss):
    N = logits.shape[0]
    lse = _new(logits, N, dtype=F32)
    if reduction == "none":
        return _new(logits, N, dtype=F32), lse, _absent(lse)
    return _new(logits, dtype=F32), lse, _new(logits, 1, dtype=F32)


@custom_op("linghe::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(logits: Tensor, labels: Tensor, lse: Tensor, grad: Tensor,
                      inv_n: Tensor | None, ignore_index: int, label_smoothing: float,
                      z_loss: float) -> Tensor:
    """``dlogits [N, V]`` in logits' dtype; ``grad`` is a scalar (with ``inv_n``) or
    ``[N]`` (reduction "none")."""
    return _bwd_loss.ce_backward(logits, labels, lse, grad, inv_n, ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, z_loss=z_loss)


@cross_entropy_bwd.register_fake
def _(logits, labels, lse, grad, inv_n, ignore_index, label_smoothing, z_loss):
    return _new(logits, *logits.shape)


def _ce_setup(ctx, inputs, output):
    logits, labels, ignore_index, reduction, label_smoothing, z_loss = inputs
    _, lse, inv_n = output
    ctx.save_for_backward(logits, labels, lse, inv_n if reduction != "none" else None)
    ctx.opts = (ignore_index, label_smoothing, z_loss)
    ctx.mark_non_differentiable(lse, inv_n)


def _ce_backward(ctx, grad, _dlse, _dinv_n):
    logits, labels, lse, inv_n = ctx.saved_tensors
    return (cross_entropy_bwd(logits, labels, lse, grad, inv_n, *ctx.opts),) + (None,) * 5


cross_entropy_fwd.register_autograd(_ce_backward, setup_context=_ce_setup)


def cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                  label_smoothing: float, z_loss: float) -> Tensor:
    """:func:`linghe.cross_entropy` through the custom ops (inputs already validated)."""
    out, _, _ = cross_entropy_fwd(logits, labels, ignore_index, reduction, label_smoothing,
                                  z_loss)
    return out


@custom_op("linghe::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                             labels: Tensor, ignore_index: int, reduction: str,
                             label_smoothing: float, z_loss: float, chunk_size: int,
                             need_dh: bool, need_dw: bool, need_db: bool, fp8: bool,
                             pow2_scale: bool, fp8_wgrad: bool) -> tuple[Tensor, Tensor,
                                                                         Tensor, Tensor,
                                                                         Tensor, Tensor]:
    """The chunked forward of :func:`linghe.linear_cross_entropy`: ``(loss, inv_n, dh, dw,
    db, lse)``, absent where not made. With a "mean"/"sum" reduction and a gradient
    needed, the gradients (times the row weight ``inv_n``; the backward applies
    ``grad_output``) are computed here (``lse`` absent); otherwise ``lse [N]`` is kept for
    the backward's recomputation. ``fp8``: the LM head's blockwise FP8 GEMMs (``lm_head_fp8``;
    the weight quantized in every call: a graph keeps no cache); ``fp8_wgrad``: its weight
    gradient too (the recipe's ``fp8_wgrad``)."""
    from .functional.loss import lce_forward  # (lazy: functional.loss imports this module)

    vocab = dict(vocab_start=0, vocab_total=weight.shape[0])
    out, inv_n, dh, dw, db, lse = lce_forward(
        hidden, weight, bias, labels, ignore_index, reduction, label_smoothing, z_loss,
        chunk_size, (need_dh, need_dw, need_db), vocab, None,
        _lm_head_weight_fp8(weight, fp8, pow2_scale, fp8_wgrad))
    return (out, _or_absent(inv_n, out), _or_absent(dh, hidden), _or_absent(dw, weight),
            _or_absent(db, out), _or_absent(lse, out))


def _lm_head_weight_fp8(weight, fp8: bool, pow2_scale: bool, fp8_wgrad: bool):
    if not fp8:
        return None
    return (_quant.quantize_128x128(weight, columnwise=True, pow2_scale=pow2_scale),
            pow2_scale, fp8_wgrad)


@linear_cross_entropy_fwd.register_fake
def _(hidden, weight, bias, labels, ignore_index, reduction, label_smoothing, z_loss,
      chunk_size, need_dh, need_dw, need_db, fp8, pow2_scale, fp8_wgrad):
    N = hidden.shape[0]
    fused = reduction != "none" and (need_dh or need_dw or need_db)
    out = _new(hidden, N, dtype=F32) if reduction == "none" else _new(hidden, dtype=F32)
    inv_n = _new(hidden, 1, dtype=F32) if reduction != "none" else _absent(out)
    dh = _new(hidden, *hidden.shape) if fused and need_dh else _absent(hidden)
    dw = _new(weight, *weight.shape) if fused and need_dw else _absent(weight)
    db = _new(hidden, weight.shape[0], dtype=F32) if fused and need_db else _absent(out)
    lse = _absent(out) if fused else _new(hidden, N, dtype=F32)
    return out, inv_n, dh, dw, db, lse


@custom_op("linghe::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(grad: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                             labels: Tensor, lse: Tensor, ignore_index: int,
                             label_smoothing: float, z_loss: float, chunk_size: int,
                             need_dh: bool, need_dw: bool, need_db: bool, fp8: bool,
                             pow2_scale: bool, fp8_wgrad: bool) -> tuple[Tensor, Tensor,
                                                                         Tensor]:
    """Backward of ``reduction="none"`` (per-row ``grad [N]``): the logits are recomputed
    chunk by chunk. ``(dhidden, dweight, dbias)``, absent where not needed."""
    from .functional.loss import lce_backward_none

    vocab = dict(vocab_start=0, vocab_total=weight.shape[0])
    gh, gw, gb = lce_backward_none(
        grad, hidden, weight, bias, labels, lse, ignore_index, label_smoothing, z_loss,
        chunk_size, (need_dh, need_dw, need_db), vocab, None,
        _lm_head_weight_fp8(weight, fp8, pow2_scale, fp8_wgrad))
    return _or_absent(gh, hidden), _or_absent(gw, weight), _or_absent(gb, weight)


@linear_cross_entropy_bwd.register_fake
def _(grad, hidden, weight, bias, labels, lse, ignore_index, label_smoothing, z_loss,
      chunk_size, need_dh, need_dw, need_db, fp8, pow2_scale, fp8_wgrad):
    return (_new(hidden, *hidden.shape) if need_dh else _absent(hidden),
            _new(weight, *weight.shape) if need_dw else _absent(weight),
            _new(bias, *bias.shape) if need_db else _absent(weight))


def _lce_setup(ctx, inputs, output):
    (hidden, weight, bias, labels, ignore_index, reduction, ls, z, chunk, nh, nw, nb, fp8,
     pow2, fp8_wgrad) = inputs
    out, inv_n, dh, dw, db, lse = output
    ctx.fused = reduction != "none" and (nh or nw or nb)
    ctx.need = (nh, nw, nb)
    ctx.opts = (ignore_index, ls, z, chunk)
    ctx.fp8 = (fp8, pow2, fp8_wgrad)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    from .functional.loss import row_weight_in_forward

    ctx.row_weight_applied = row_weight_in_forward(hidden.dtype)
    if ctx.fused:
        ctx.save_for_backward(dh, dw, db, inv_n)
    else:
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
    ctx.mark_non_differentiable(inv_n, dh, dw, db, lse)


def _lce_backward(ctx, grad, *_unused):
    nh, nw, nb = ctx.need
    none = (None,) * 12
    if ctx.fused:
        dh, dw, db, inv_n = ctx.saved_tensors
        # (the forward applied the row weight inv_n, except for float16)
        scale = grad.float() if ctx.row_weight_applied else grad.float() * inv_n[0]
        return ((dh * scale).to(dh.dtype) if nh else None,
                (dw * scale).to(dw.dtype) if nw else None,
                (db * scale).to(ctx.bias_dtype) if nb else None, *none)
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    gh, gw, gb = linear_cross_entropy_bwd(grad.contiguous(), hidden, weight, bias, labels, lse,
                                          *ctx.opts, nh, nw, nb, *ctx.fp8)
    return gh if nh else None, gw if nw else None, gb if nb else None, *none


linear_cross_entropy_fwd.register_autograd(_lce_backward, setup_context=_lce_setup)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                         ignore_index: int, reduction: str, label_smoothing: float,
                         z_loss: float, chunk_size: int, need: tuple, fp8: bool = False,
                         pow2_scale: bool = True, fp8_wgrad: bool = False) -> Tensor:
    """:func:`linghe.linear_cross_entropy` through the custom ops (inputs validated and
    made contiguous; ``need``: which of hidden, weight, bias want a gradient; ``fp8``: the
    recipe's ``lm_head_fp8``; ``fp8_wgrad``: its ``fp8_wgrad``)."""
    return linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index, reduction,
                                    label_smoothing, z_loss, chunk_size, *need, bool(fp8),
                                    bool(pow2_scale), bool(fp8_wgrad))[0]


# ======================================================================================
# embedding: token embedding (row gather; sorted, deterministic backward)
# ======================================================================================


@custom_op("linghe::embedding_fwd", mutates_args=())
def embedding_fwd(tokens: Tensor, weight: Tensor, padding_idx: int) -> Tensor:
    """``out [N, H] = weight[tokens]`` of flat ``tokens [N]`` (``padding_idx``, -1 for
    none, is only the backward's)."""
    return _fwd_emb.embedding_fwd(tokens, weight)


@embedding_fwd.register_fake
def _(tokens, weight, padding_idx):
    return _new(weight, tokens.shape[0], weight.shape[1])


@custom_op("linghe::embedding_bwd", mutates_args=())
def embedding_bwd(grad: Tensor, tokens: Tensor, num_embeddings: int, padding_idx: int,
                  w_dtype: torch.dtype) -> Tensor:
    """A fresh ``dW [V, H]`` in ``w_dtype`` (no fused accumulation under compile)."""
    return _bwd_emb.embedding_bwd(tokens, grad, num_embeddings,
                                  None if padding_idx < 0 else padding_idx, w_dtype)


@embedding_bwd.register_fake
def _(grad, tokens, num_embeddings, padding_idx, w_dtype):
    return _new(grad, num_embeddings, grad.shape[1], dtype=w_dtype)


def _embedding_setup(ctx, inputs, output):
    tokens, weight, padding_idx = inputs
    ctx.save_for_backward(tokens)
    ctx.meta = (weight.shape[0], padding_idx, weight.dtype)


def _embedding_backward(ctx, grad):
    (tokens,) = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:
        return None, None, None
    return None, embedding_bwd(grad.contiguous(), tokens, *ctx.meta), None


embedding_fwd.register_autograd(_embedding_backward, setup_context=_embedding_setup)


def embedding(tokens: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
    """:func:`linghe.embedding` through the custom ops (validated; ``tokens`` flat and
    contiguous, ``padding_idx`` normalized). Returns ``[N, H]``."""
    return embedding_fwd(tokens, weight, -1 if padding_idx is None else padding_idx)


# ======================================================================================
# linear: FP8 Linear (blockwise and tensorwise recipes)
# ======================================================================================

#: Recipes whose FP8 Linear compiles: they are functions of the tensors alone. The delayed
#: recipe reads and updates an amax history (state outside the graph) on every call.
COMPILED_RECIPES = ("blockwise", "tensorwise")


@functools.cache
def _recipe(name: str, pow2_scale: bool) -> Fp8Recipe:
    return Fp8Recipe(name, pow2_scale=pow2_scale)


def _fake_act_copy(like: Tensor, rows: int, cols: int, scaling: str):
    """Fake ``(data [rows, cols], scale)`` of an activation copy grouped along ``cols``."""
    s = _new(like, rows, cdiv(cols, 128), dtype=F32) if scaling == "1x128" else \
        _new(like, 1, dtype=F32)
    return _new(like, rows, cols, dtype=FP8), s


@custom_op("linghe::fp8_linear_fwd", mutates_args=())
def fp8_linear_fwd(x: Tensor, x_scale: Tensor | None, x_col: Tensor | None,
                   x_col_scale: Tensor | None, x_dtype: torch.dtype, weight: Tensor,
                   bias: Tensor | None, recipe: str, pow2_scale: bool,
                   need_col: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``y [M, N] = x [M, K] · weight [N, K]^T + bias`` with the recipe's FP8 GEMMs.

    ``x`` is high precision (``x_scale`` None) or the rowwise FP8 data of an input already
    in the recipe's activation format (with its optional columnwise copy); ``x_dtype`` is
    its logical dtype. The weight is quantized here (no cache across calls in a graph).
    Returns ``(y, x_col, x_col_scale, w_col, w_col_scale)``: the columnwise copies the
    backward needs; ``x``'s is made here only when ``need_col`` and not given (else
    absent)."""
    r = _recipe(recipe, pow2_scale)
    if x_scale is None:
        xq = r.quantize_input(x, rowwise=True, columnwise=need_col)
    else:
        xq = Fp8Tensor(x.shape, x_dtype, rowwise_data=x, rowwise_scale=x_scale,
                       columnwise_data=x_col, columnwise_scale=x_col_scale,
                       scaling=r.act_scaling)
        if need_col and x_col is None:  # the missing copy, from the values we have
            fill = r.quantize_input(xq.dequantize(), rowwise=False, columnwise=True)
            xq = xq.with_components(columnwise_data=fill.columnwise_data,
                                    columnwise_scale=fill.columnwise_scale)
    wq = r.quantize_weight(weight)
    out_dtype = x_dtype if x_dtype in _gemm.OUT_DTYPES else torch.bfloat16
    y = _gemm._fprop(xq, wq, bias, out_dtype)
    made = need_col and x_col is None
    return (y, xq.columnwise_data if made else _absent(x, FP8),
            xq.columnwise_scale if made else _absent(x, F32), wq.columnwise_data,
            wq.columnwise_scale)


@fp8_linear_fwd.register_fake
def _(x, x_scale, x_col, x_col_scale, x_dtype, weight, bias, recipe, pow2_scale, need_col):
    M, K = x.shape
    N = weight.shape[0]
    out_dtype = x_dtype if x_dtype in _gemm.OUT_DTYPES else torch.bfloat16
    act = "1x128" if recipe == "blockwise" else "tensor"
    xc, xcs = (_fake_act_copy(x, K, M, act) if need_col and x_col is None
               else (_absent(x, FP8), _absent(x, F32)))
    if recipe == "blockwise":
        wc, wcs = _new(x, K, N, dtype=FP8), _new(x, cdiv(K, 128), cdiv(N, 128), dtype=F32)
    else:
        wc, wcs = _new(x, K, N, dtype=FP8), _new(x, 1, dtype=F32)
    return _new(x, M, N, dtype=out_dtype), xc, xcs, wc, wcs


@custom_op("linghe::fp8_linear_bwd", mutates_args=())
def fp8_linear_bwd(dy: Tensor, w_col: Tensor, w_col_scale: Tensor, x_col: Tensor | None,
                   x_col_scale: Tensor | None, x_hp: Tensor | None, recipe: str,
                   pow2_scale: bool, need_dx: bool, need_dw: bool, x_dtype: torch.dtype,
                   w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(dx [M, K], dweight [N, K])`` (absent where not needed) from ``dy [M, N]``: dY is
    quantized (rowwise for dgrad, columnwise for an FP8 wgrad from ``x_col``; the wgrad
    is ``dy^T @ x_hp`` in high precision when ``x_hp`` is given instead)."""
    r = _recipe(recipe, pow2_scale)
    fp8_dw = need_dw and x_col is not None
    dx = dw = None
    if need_dx or fp8_dw:
        dyq = r.quantize_input(dy, rowwise=need_dx, columnwise=fp8_dw, grad=True)
    if need_dx:
        gdt = x_dtype if x_dtype in _gemm.OUT_DTYPES else torch.bfloat16
        dx = _gemm._gemm(dyq.rowwise_data, dyq.rowwise_scale, dyq.scaling, w_col, w_col_scale,
                         r.weight_scaling, gdt, None)
    if need_dw:
        wdt = w_dtype if w_dtype in _gemm.OUT_DTYPES else F32
        if fp8_dw:
            dw = _gemm._gemm(dyq.columnwise_data, dyq.columnwise_scale, dyq.scaling, x_col,
                             x_col_scale, r.act_scaling, wdt, None)
        else:
            dw = (dy.to(x_hp.dtype).t() @ x_hp).to(wdt)
    return _or_absent(dx, dy, x_dtype), _or_absent(dw, dy, w_dtype)


@fp8_linear_bwd.register_fake
def _(dy, w_col, w_col_scale, x_col, x_col_scale, x_hp, recipe, pow2_scale, need_dx, need_dw,
      x_dtype, w_dtype):
    M, N = dy.shape
    K = w_col.shape[0]
    gdt = x_dtype if x_dtype in _gemm.OUT_DTYPES else torch.bfloat16
    wdt = w_dtype if w_dtype in _gemm.OUT_DTYPES else F32
    return (_new(dy, M, K, dtype=gdt) if need_dx else _absent(dy, x_dtype),
            _new(dy, N, K, dtype=wdt) if need_dw else _absent(dy, w_dtype))


class _Fp8Linear(torch.autograd.Function):
    """FP8 Linear under torch.compile. A Function (traced by dynamo) rather than
    ``register_autograd`` because its input may be an ``Fp8Tensor`` (e.g. from
    ``rms_norm_quant``), whose gradient is the plain high-precision one."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, need_dw):
        K = weight.shape[1]
        lead = x.shape[:-1]
        need_col = need_dw and recipe.fp8_wgrad
        xd = xs = xc = xcs = None
        if isinstance(x, Fp8Tensor) and x.rowwise_data is not None and recipe.accepts(x):
            xd, xs = x.rowwise_data, x.rowwise_scale
            xc, xcs = x.columnwise_data, x.columnwise_scale
        else:
            if isinstance(x, Fp8Tensor):  # another format: requantized from its values
                x = x.dequantize(columnwise=x.rowwise_data is None)
            xd = x.reshape(-1, K)
            if xd.stride(-1) != 1:
                xd = xd.contiguous()
        y, xc_new, xcs_new, wc, wcs = fp8_linear_fwd(
            xd, xs, xc, xcs, x.dtype, weight, bias, recipe.name, recipe.pow2_scale, need_col)
        if xc is None:
            xc, xcs = xc_new, xcs_new
        x_hp = None
        if need_dw and not recipe.fp8_wgrad:
            x_hp = xd if xs is None else x.dequantize().reshape(-1, K)
        ctx.save_for_backward(wc, wcs, xc if need_col else None, xcs if need_col else None,
                              x_hp)
        ctx.meta = (recipe.name, recipe.pow2_scale, x.dtype, weight.dtype, lead, K)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        wc, wcs, xc, xcs, x_hp = ctx.saved_tensors
        name, pow2, x_dtype, w_dtype, lead, K = ctx.meta
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx, dw = fp8_linear_bwd(dy2, wc, wcs, xc, xcs, x_hp, name, pow2, need_dx, need_dw,
                                x_dtype, w_dtype)
        db = dy2.float().sum(0).to(ctx.bias_dtype) if need_db else None
        return (dx.view(*lead, K) if need_dx else None), (dw if need_dw else None), db, None, \
            None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe,
               need_dw: bool) -> Tensor:
    """:func:`linghe.functional.linear.fp8_linear` through the custom ops (inputs already
    validated). The weight is quantized in every call: a compiled graph keeps no
    :class:`~linghe.functional.linear.WeightCache`."""
    if recipe.name not in COMPILED_RECIPES:
        raise RuntimeError(
            f"the {recipe.name!r} FP8 recipe does not run under torch.compile (its amax "
            f"history is state updated outside the graph); use one of {COMPILED_RECIPES}, "
            "or run this module eagerly")
    return _Fp8Linear.apply(x, weight, bias, recipe, bool(need_dw))


# ======================================================================================
# permute: permute, unpermute (rows grouped by expert; the ExpertLayout is rebuilt from
# its tensors outside the ops)
# ======================================================================================


@custom_op("linghe::permute_index", mutates_args=())
def permute_index(expert_ids: Tensor, num_experts: int, align: int, num_rows: int) -> Tensor:
    """int32 ``[T*k + 3E + 1]``: ``row_index | tokens_per_expert | padded | offsets`` of
    the :class:`~linghe.layout.ExpertLayout` (a prefix of the launcher's buffer, whose
    tail is scratch)."""
    buf = _fwd_perm.index_buffer(expert_ids, num_experts, align, num_rows)
    return buf[:expert_ids.numel() + 3 * num_experts + 1]


@permute_index.register_fake
def _(expert_ids, num_experts, align, num_rows):
    return _new(expert_ids, expert_ids.numel() + 3 * num_experts + 1, dtype=torch.int32)


def _layout(row_index: Tensor, tokens_per_expert: Tensor, offsets: Tensor, num_rows: int):
    """The fields of an ExpertLayout that the permute launchers read."""
    E = tokens_per_expert.shape[0]
    return ExpertLayout(num_experts=E, align=1, num_rows=num_rows,
                        tokens_per_expert=tokens_per_expert,
                        padded_tokens_per_expert=tokens_per_expert, offsets=offsets,
                        row_index=row_index)


@custom_op("linghe::permute_fwd", mutates_args=())
def permute_fwd(x: Tensor, x_scale: Tensor | None, probs: Tensor | None, row_index: Tensor,
                tokens_per_expert: Tensor, offsets: Tensor,
                num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows [num_rows, H], rows_scale [num_rows, G] or absent, probs_rows [num_rows] or
    absent)``: ``x [T, H]`` (with its 1x128 scales ``x_scale`` when fp8) scattered by
    expert."""
    rows, rows_s, prow, _ = _fwd_perm.scatter_rows(
        x, _layout(row_index, tokens_per_expert, offsets, num_rows), x_scale=x_scale,
        probs=probs)
    return rows, _or_absent(rows_s, x, F32), _or_absent(prow, x, F32)


@permute_fwd.register_fake
def _(x, x_scale, probs, row_index, tokens_per_expert, offsets, num_rows):
    s = _new(x, num_rows, x_scale.shape[1], dtype=F32) if x_scale is not None else \
        _absent(x, F32)
    p = _new(x, num_rows, dtype=F32) if probs is not None else _absent(x, F32)
    return _new(x, num_rows, x.shape[1]), s, p


@custom_op("linghe::permute_bwd", mutates_args=())
def permute_bwd(d_rows: Tensor, d_probs_rows: Tensor | None, row_index: Tensor,
                x_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(dx [T, H] x_dtype, dprobs [T, k] fp32 or absent)``: the gather-sum adjoint."""
    none = _absent(row_index)  # (the gather reads only row_index)
    layout = _layout(row_index, none, none, d_rows.shape[0])
    dx, dp = _bwd_perm.permute_backward(d_rows, layout, x_dtype, d_probs_rows)
    return dx, _or_absent(dp, d_rows, F32)


@permute_bwd.register_fake
def _(d_rows, d_probs_rows, row_index, x_dtype):
    T, k = row_index.shape
    dp = _new(d_rows, T, k, dtype=F32) if d_probs_rows is not None else _absent(d_rows, F32)
    return _new(d_rows, T, d_rows.shape[1], dtype=x_dtype), dp


def _permute_setup(ctx, inputs, output):
    x, _, probs, row_index = inputs[:4]
    ctx.save_for_backward(row_index)
    ctx.x_dtype = x.dtype
    ctx.has_probs = probs is not None
    ctx.mark_non_differentiable(output[1])


def _permute_backward(ctx, d_rows, _d_scale, d_prow):
    (row_index,) = ctx.saved_tensors
    want_p = ctx.has_probs and ctx.needs_input_grad[2]
    dx, dp = permute_bwd(d_rows.contiguous(), d_prow.float().contiguous() if want_p else None,
                         row_index, ctx.x_dtype)
    return dx, None, (dp if want_p else None), None, None, None, None


permute_fwd.register_autograd(_permute_backward, setup_context=_permute_setup)


class _PermuteFp8(torch.autograd.Function):
    """FP8 rows move with their scales; the gradient of the high-precision input is the
    same gather-sum as for plain rows (straight-through the quantization)."""

    @staticmethod
    def forward(ctx, x, probs, row_index, tokens_per_expert, offsets, num_rows):
        data, scale, prow = permute_fwd(x.rowwise_data, x.rowwise_scale, probs, row_index,
                                        tokens_per_expert, offsets, num_rows)
        ctx.save_for_backward(row_index)
        ctx.x_dtype = x.dtype
        ctx.has_probs = probs is not None
        rows = Fp8Tensor((num_rows, x.shape[1]), x.dtype, rowwise_data=data,
                         rowwise_scale=scale, scaling="1x128")
        return rows, prow

    @staticmethod
    def backward(ctx, d_rows, d_prow):
        (row_index,) = ctx.saved_tensors
        want_p = ctx.has_probs and ctx.needs_input_grad[1]
        dx, dp = permute_bwd(_dense_grad(d_rows), d_prow.float().contiguous() if want_p else None,
                             row_index, ctx.x_dtype)
        return dx, (dp if want_p else None), None, None, None, None


def permute(x, expert_ids: Tensor, probs: Tensor | None, num_experts: int, align: int,
            num_rows: int):
    """:func:`linghe.permute` through the custom ops (inputs already validated;
    ``expert_ids`` and ``probs`` contiguous)."""
    buf = permute_index(expert_ids, num_experts, align, num_rows)
    layout = _fwd_perm.layout_from_index(buf, expert_ids.shape, num_experts, align, num_rows)
    li = (layout.row_index, layout.tokens_per_expert, layout.offsets, num_rows)
    if isinstance(x, Fp8Tensor):
        rows, prow = _PermuteFp8.apply(x, probs, *li)
    else:
        rows, _, prow = permute_fwd(x, None, probs, *li)
    return rows, (prow if probs is not None else None), layout


@custom_op("linghe::unpermute_fwd", mutates_args=())
def unpermute_fwd(rows: Tensor, probs: Tensor | None, row_index: Tensor,
                  tokens_per_expert: Tensor, offsets: Tensor) -> Tensor:
    """``out [T, H] = sum_j probs[t, j] * rows[row_index[t, j]]`` in rows' dtype."""
    layout = _layout(row_index, tokens_per_expert, offsets, rows.shape[0])
    return _fwd_perm.gather_rows(rows, layout, weights=probs)[0]


@unpermute_fwd.register_fake
def _(rows, probs, row_index, tokens_per_expert, offsets):
    return _new(rows, row_index.shape[0], rows.shape[1])


@custom_op("linghe::unpermute_bwd", mutates_args=())
def unpermute_bwd(dout: Tensor, probs: Tensor | None, rows: Tensor | None, row_index: Tensor,
                  tokens_per_expert: Tensor, offsets: Tensor, num_rows: int,
                  rows_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(d_rows [num_rows, H] rows_dtype, dprobs [T, k] fp32 or absent)``: the scatter
    adjoint (padding rows get 0); ``dprobs`` needs the forward's ``rows``."""
    layout = _layout(row_index, tokens_per_expert, offsets, num_rows)
    d_rows, dp = _bwd_perm.unpermute_backward(dout, layout, rows_dtype, probs=probs, rows=rows)
    return d_rows, _or_absent(dp, dout, F32)


@unpermute_bwd.register_fake
def _(dout, probs, rows, row_index, tokens_per_expert, offsets, num_rows, rows_dtype):
    dp = _new(dout, *row_index.shape, dtype=F32) if rows is not None else _absent(dout, F32)
    return _new(dout, num_rows, dout.shape[1], dtype=rows_dtype), dp


def _unpermute_setup(ctx, inputs, output):
    rows, probs, row_index, tpe, offsets = inputs
    want_p = probs is not None and probs.requires_grad
    ctx.save_for_backward(rows if want_p else None, probs, row_index, tpe, offsets)
    ctx.meta = (rows.shape[0], rows.dtype)


def _unpermute_backward(ctx, dout):
    rows, probs, row_index, tpe, offsets = ctx.saved_tensors
    want_p = probs is not None and ctx.needs_input_grad[1]
    d_rows, dp = unpermute_bwd(dout.contiguous(), probs, rows if want_p else None, row_index,
                               tpe, offsets, *ctx.meta)
    return d_rows, (dp if want_p else None), None, None, None


unpermute_fwd.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def unpermute(rows: Tensor, layout: ExpertLayout, probs: Tensor | None) -> Tensor:
    """:func:`linghe.unpermute` through the custom ops (inputs already validated)."""
    return unpermute_fwd(rows, probs, layout.row_index, layout.tokens_per_expert,
                         layout.offsets)


# ======================================================================================
# grouped_mm (bf16 and FP8 blockwise). Re-check after the FP8 MoE work lands: the
# launchers' signatures are the contract here.
# ======================================================================================


@custom_op("linghe::grouped_mm_fwd", mutates_args=())
def grouped_mm_fwd(rows: Tensor, weight: Tensor, offsets: Tensor, backend: str) -> Tensor:
    """``out [R, N] = rows_e @ weight[e]^T`` per segment; ``backend`` "auto" picks
    linghe's warp-specialized kernel on sm_90, else ``torch._grouped_mm`` when the
    operands allow it (decided at run time)."""
    return _fwd_gmm.grouped_mm_fwd(rows, weight, offsets, backend=backend).contiguous()


@grouped_mm_fwd.register_fake
def _(rows, weight, offsets, backend):
    return _new(rows, rows.shape[0], weight.shape[1])


@custom_op("linghe::grouped_mm_bwd", mutates_args=())
def grouped_mm_bwd(d_out: Tensor, rows: Tensor | None, weight: Tensor | None, offsets: Tensor,
                   backend: str, rows_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(d_rows [R, K] or absent, d_weight [E, N, K] or absent)``: the dgrad when
    ``weight`` is given, the wgrad when ``rows`` is."""
    d_rows = d_w = None
    if weight is not None:
        d_rows = _bwd_gmm.grouped_mm_dgrad(d_out, weight, offsets, backend=backend).contiguous()
    if rows is not None:
        d_w = _bwd_gmm.grouped_mm_wgrad(d_out, rows, offsets, out_dtype=rows_dtype,
                                        backend=backend).contiguous()
    return _or_absent(d_rows, d_out), _or_absent(d_w, d_out, rows_dtype)


@grouped_mm_bwd.register_fake
def _(d_out, rows, weight, offsets, backend, rows_dtype):
    R, N = d_out.shape
    d_rows = _new(d_out, R, weight.shape[2]) if weight is not None else _absent(d_out)
    d_w = (_new(d_out, offsets.shape[0] - 1, N, rows.shape[1], dtype=rows_dtype)
           if rows is not None else _absent(d_out, rows_dtype))
    return d_rows, d_w


def _gmm_setup(ctx, inputs, output):
    rows, weight, offsets, backend = inputs
    ctx.save_for_backward(rows, weight, offsets)
    ctx.backend = backend


def _gmm_backward(ctx, d_out):
    rows, weight, offsets = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    d_rows, d_w = grouped_mm_bwd(d_out.contiguous(), rows if need_dw else None,
                                 weight if need_dx else None, offsets, ctx.backend, rows.dtype)
    return (d_rows if need_dx else None), (d_w if need_dw else None), None, None


grouped_mm_fwd.register_autograd(_gmm_backward, setup_context=_gmm_setup)


@custom_op("linghe::grouped_mm_fp8_fwd", mutates_args=())
def grouped_mm_fp8_fwd(rows: Tensor, weight: Tensor, offsets: Tensor, pow2_scale: bool,
                       need_dx: bool,
                       need_dw: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FP8 blockwise ``out [R, N]``: ``rows`` quantized 1x128, ``weight`` 128x128 per expert.
    Also returns the columnwise copies the backward reads: ``rows``' (for the wgrad, when
    ``need_dw``) and the weight's (for the dgrad, when ``need_dx``), absent otherwise."""
    a = _quant.quantize_1x128(rows, rowwise=True, columnwise=need_dw, pow2_scale=pow2_scale)
    w = _fwd_gmm.quantize_grouped_weight(weight, columnwise=need_dx, pow2_scale=pow2_scale)
    out = _fwd_gmm.grouped_mm_fp8_fwd(a, w, offsets, out_dtype=rows.dtype)
    return (out, _or_absent(a.columnwise_data, rows, FP8),
            _or_absent(a.columnwise_scale, rows, F32), _or_absent(w.columnwise_data, rows, FP8),
            _or_absent(w.columnwise_scale, rows, F32))


@grouped_mm_fp8_fwd.register_fake
def _(rows, weight, offsets, pow2_scale, need_dx, need_dw):
    R, K = rows.shape
    E, N, _ = weight.shape
    ac, acs = ((_new(rows, K, R, dtype=FP8), _new(rows, K, cdiv(R, 128), dtype=F32))
               if need_dw else (_absent(rows, FP8), _absent(rows, F32)))
    wc, wcs = ((_new(rows, K, E * N, dtype=FP8), _new(rows, cdiv(K, 128), E * N // 128, dtype=F32))
               if need_dx else (_absent(rows, FP8), _absent(rows, F32)))
    return _new(rows, R, N), ac, acs, wc, wcs


@custom_op("linghe::grouped_mm_fp8_bwd", mutates_args=())
def grouped_mm_fp8_bwd(d_out: Tensor, a_col: Tensor | None, a_col_scale: Tensor | None,
                       w_col: Tensor | None, w_col_scale: Tensor | None, offsets: Tensor,
                       pow2_scale: bool, rows_dtype: torch.dtype, w_dtype: torch.dtype,
                       K: int) -> tuple[Tensor, Tensor]:
    """``(d_rows, d_weight)`` of the FP8 grouped GEMM from the forward's columnwise copies
    (the dgrad when ``w_col`` is given, the wgrad when ``a_col`` is); ``d_out`` quantized
    1x128 (rowwise for the dgrad, columnwise for the wgrad)."""
    R, N = d_out.shape
    E = offsets.shape[0] - 1
    need_dx, need_dw = w_col is not None, a_col is not None
    g = _quant.quantize_1x128(d_out, rowwise=need_dx, columnwise=need_dw, pow2_scale=pow2_scale)
    d_rows = d_w = None
    if need_dx:
        w = Fp8Tensor((E, N, K), w_dtype, columnwise_data=w_col, columnwise_scale=w_col_scale,
                      scaling="128x128")
        d_rows = _bwd_gmm.grouped_mm_fp8_dgrad(g, w, offsets, out_dtype=rows_dtype)
    if need_dw:
        a = Fp8Tensor((R, K), rows_dtype, columnwise_data=a_col, columnwise_scale=a_col_scale,
                      scaling="1x128")
        d_w = _bwd_gmm.grouped_mm_fp8_wgrad(g, a, offsets, out_dtype=w_dtype)
    return _or_absent(d_rows, d_out, rows_dtype), _or_absent(d_w, d_out, w_dtype)


@grouped_mm_fp8_bwd.register_fake
def _(d_out, a_col, a_col_scale, w_col, w_col_scale, offsets, pow2_scale, rows_dtype, w_dtype,
      K):
    R, N = d_out.shape
    E = offsets.shape[0] - 1
    return (_new(d_out, R, K, dtype=rows_dtype) if w_col is not None
            else _absent(d_out, rows_dtype),
            _new(d_out, E, N, K, dtype=w_dtype) if a_col is not None
            else _absent(d_out, w_dtype))


def _gmm_fp8_setup(ctx, inputs, output):
    rows, weight, offsets, pow2_scale, need_dx, need_dw = inputs
    _, ac, acs, wc, wcs = output
    ctx.save_for_backward(ac if need_dw else None, acs if need_dw else None,
                          wc if need_dx else None, wcs if need_dx else None, offsets)
    ctx.meta = (pow2_scale, rows.dtype, weight.dtype, rows.shape[1])
    ctx.mark_non_differentiable(ac, acs, wc, wcs)


def _gmm_fp8_backward(ctx, d_out, *_unused):
    ac, acs, wc, wcs, offsets = ctx.saved_tensors
    d_rows, d_w = grouped_mm_fp8_bwd(d_out.contiguous(), ac, acs, wc, wcs, offsets, *ctx.meta)
    return (d_rows if wc is not None else None), (d_w if ac is not None else None), None, \
        None, None, None


grouped_mm_fp8_fwd.register_autograd(_gmm_fp8_backward, setup_context=_gmm_fp8_setup)


def grouped_mm(rows: Tensor, weight: Tensor, offsets: Tensor, fp8: bool, backend: str,
               pow2_scale: bool) -> Tensor:
    """:func:`linghe.grouped_mm` through the custom ops (inputs validated; ``backend``
    "auto" only where the layout allows ``torch._grouped_mm``)."""
    if not fp8:
        return grouped_mm_fwd(rows, weight, offsets, backend)
    # (the copies each gradient needs are decided here: a custom op sees no requires_grad)
    grad = torch.is_grad_enabled()
    return grouped_mm_fp8_fwd(rows, weight, offsets, pow2_scale,
                              grad and rows.requires_grad, grad and weight.requires_grad)[0]


# ======================================================================================
# kernel-level FP8 GEMMs (no autograd, as in eager): fp8_gemm, grouped_mm_fp8(_dgrad,
# _wgrad). The Fp8Tensor operands travel as their components and are rebuilt in the op.
# ======================================================================================


@custom_op("linghe::fp8_gemm", mutates_args=())
def fp8_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, a_scaling: str,
             b_scaling: str, out_dtype: torch.dtype, bias: Tensor | None,
             backend: str) -> Tensor:
    """``(A * a_scale) · (B * b_scale)^T (+ bias)`` as :func:`linghe.fp8.gemm.fp8_gemm`."""
    return _gemm._gemm(a, a_scale, a_scaling, b, b_scale, b_scaling, out_dtype, bias,
                       backend).contiguous()


@fp8_gemm.register_fake
def _(a, a_scale, b, b_scale, a_scaling, b_scaling, out_dtype, bias, backend):
    return _new(a, a.shape[0], b.shape[0], dtype=out_dtype)


def _grouped_fp8_operand(data, scale, shape, scaling, rowwise: bool,
                         segments: Tensor | None = None) -> Fp8Tensor:
    kw = ({"rowwise_data": data, "rowwise_scale": scale} if rowwise else
          {"columnwise_data": data, "columnwise_scale": scale, "col_segments": segments})
    return Fp8Tensor(shape, torch.bfloat16, scaling=scaling, **kw)


@custom_op("linghe::grouped_mm_fp8_kernel", mutates_args=())
def grouped_mm_fp8_kernel(kind: str, a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
                          offsets: Tensor, N: int, K: int, out_dtype: torch.dtype,
                          segments: bool, align: int) -> Tensor:
    """The kernel-level FP8 grouped GEMMs of ``linghe.functional.grouped_mm`` by ``kind``:
    "fwd" (``a`` rowwise ``[R, K]``, ``b`` the weight's rowwise ``[E*N, K]``) -> ``[R, N]``;
    "dgrad" (``a`` = d_out rowwise ``[R, N]``, ``b`` the weight's columnwise ``[K, E*N]``)
    -> ``[R, K]``; "wgrad" (``a`` = d_out columnwise ``[N, R]``, ``b`` the rows' columnwise
    ``[K, R]``; ``segments``: both grouped per expert segment, ``align`` their alignment)
    -> ``[E, N, K]``."""
    E = offsets.shape[0] - 1
    if kind == "fwd":
        x = _grouped_fp8_operand(a, a_scale, (a.shape[0], K), "1x128", True)
        w = _grouped_fp8_operand(b, b_scale, (E, N, K), "128x128", True)
        return _fwd_gmm.grouped_mm_fp8_fwd(x, w, offsets, out_dtype=out_dtype)
    if kind == "dgrad":
        g = _grouped_fp8_operand(a, a_scale, (a.shape[0], N), "1x128", True)
        w = _grouped_fp8_operand(b, b_scale, (E, N, K), "128x128", False)
        return _bwd_gmm.grouped_mm_fp8_dgrad(g, w, offsets, out_dtype=out_dtype)
    R = a.shape[1]
    seg = offsets if segments else None
    g = _grouped_fp8_operand(a, a_scale, (R, N), "1x128", False, seg)
    x = _grouped_fp8_operand(b, b_scale, (R, K), "1x128", False, seg)
    return _bwd_gmm.grouped_mm_fp8_wgrad(g, x, offsets, out_dtype=out_dtype,
                                         segments=segments, align=align)


@grouped_mm_fp8_kernel.register_fake
def _(kind, a, a_scale, b, b_scale, offsets, N, K, out_dtype, segments, align):
    if kind == "fwd":
        return _new(a, a.shape[0], N, dtype=out_dtype)
    if kind == "dgrad":
        return _new(a, a.shape[0], K, dtype=out_dtype)
    return _new(a, offsets.shape[0] - 1, N, K, dtype=out_dtype)


def grouped_mm_fp8_fwd_kernel(a_fp8: Fp8Tensor, w_fp8: Fp8Tensor, offsets: Tensor,
                              out_dtype: torch.dtype) -> Tensor:
    """:func:`linghe.grouped_mm_fp8` through the custom op (inputs validated)."""
    E, N, K = w_fp8.shape
    return grouped_mm_fp8_kernel("fwd", a_fp8.rowwise_data, a_fp8.rowwise_scale,
                                 w_fp8.rowwise_data, w_fp8.rowwise_scale, offsets, N, K,
                                 out_dtype, False, 1)


def grouped_mm_fp8_dgrad_kernel(dout_fp8: Fp8Tensor, w_fp8: Fp8Tensor, offsets: Tensor,
                                out_dtype: torch.dtype) -> Tensor:
    """:func:`linghe.grouped_mm_fp8_dgrad` through the custom op (inputs validated)."""
    E, N, K = w_fp8.shape
    return grouped_mm_fp8_kernel("dgrad", dout_fp8.rowwise_data, dout_fp8.rowwise_scale,
                                 w_fp8.columnwise_data, w_fp8.columnwise_scale, offsets, N, K,
                                 out_dtype, False, 1)


def grouped_mm_fp8_wgrad_kernel(dout_fp8: Fp8Tensor, a_fp8: Fp8Tensor, offsets: Tensor,
                                out_dtype: torch.dtype, segments: bool, align: int) -> Tensor:
    """:func:`linghe.grouped_mm_fp8_wgrad` through the custom op (inputs validated;
    ``segments``: the copies are grouped per segment of ``offsets``)."""
    return grouped_mm_fp8_kernel("wgrad", dout_fp8.columnwise_data, dout_fp8.columnwise_scale,
                                 a_fp8.columnwise_data, a_fp8.columnwise_scale, offsets,
                                 dout_fp8.shape[1], a_fp8.shape[1], out_dtype, bool(segments),
                                 int(align))


@custom_op("linghe::quantize_grouped_1x128", mutates_args=())
def quantize_grouped_1x128_op(x: Tensor, x_scale: Tensor | None, counts: Tensor, align: int,
                              rowwise: bool, columnwise: bool,
                              pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q, s, qt, st)`` (absent where not asked) of rows grouped by expert, columnwise
    groups per segment; ``x`` fp8 with ``x_scale`` requantizes from the rowwise copy."""
    q, s, qt, st = _fwd_gmm.quantize_grouped_fwd(x, counts, align, x_scale=x_scale,
                                                 rowwise=rowwise, columnwise=columnwise,
                                                 pow2_scale=pow2_scale)
    return (_or_absent(q, x, FP8), _or_absent(s, x, F32), _or_absent(qt, x, FP8),
            _or_absent(st, x, F32))


@quantize_grouped_1x128_op.register_fake
def _(x, x_scale, counts, align, rowwise, columnwise, pow2_scale):
    R, K = x.shape
    q, s, qt, st = _fake_1x128(x, R, K, rowwise, columnwise)
    if columnwise:
        st = _new(x, K, _fwd_act.batch_col_groups(R, counts.shape[0]), dtype=F32)
    return q, s, qt, st


def quantize_grouped_1x128(x, x_scale: Tensor | None, layout: ExpertLayout, rowwise: bool,
                           columnwise: bool, pow2_scale: bool) -> Fp8Tensor:
    """:func:`linghe.functional.grouped_mm.quantize_grouped_1x128` through the custom op
    (inputs validated; an Fp8Tensor ``x`` comes as its rowwise data and ``x_scale``, and
    keeps that rowwise copy)."""
    fp8_in = isinstance(x, Fp8Tensor)
    data = x.rowwise_data if fp8_in else x.detach()
    q, s, qt, st = quantize_grouped_1x128_op(data, x_scale, layout.tokens_per_expert,
                                             layout.align, rowwise and not fp8_in, columnwise,
                                             pow2_scale)
    if fp8_in:
        q, s, rowwise = x.rowwise_data, x.rowwise_scale, True
    return Fp8Tensor(x.shape, x.dtype, rowwise_data=q if rowwise else None,
                     rowwise_scale=s if rowwise else None,
                     columnwise_data=qt if columnwise else None,
                     columnwise_scale=st if columnwise else None, scaling="1x128",
                     col_segments=layout.offsets if columnwise else None)


class _QuantizeTokens(torch.autograd.Function):
    """1x128 rowwise FP8 of tokens with a straight-through gradient."""

    @staticmethod
    def forward(ctx, x, pow2_scale):
        return quantize_1x128(x, True, False, pow2_scale)

    @staticmethod
    def backward(ctx, g):
        return _dense_grad(g), None


def quantize_tokens(x: Tensor, pow2_scale: bool) -> Fp8Tensor:
    """:func:`linghe.functional.moe.quantize_tokens` through the custom op (validated)."""
    return _QuantizeTokens.apply(x, bool(pow2_scale))


def grouped_swiglu_fp8(rows, probs_rows: Tensor | None, gate_up: Tensor, down: Tensor,
                       layout: ExpertLayout, pow2_scale: bool) -> Tensor:
    """:func:`linghe.functional.moe.grouped_swiglu` with ``fp8=True`` under torch.compile:
    a documented fallback to the unfused FP8 path, ``grouped_mm(fp8) -> silu_mul ->
    grouped_mm(fp8)`` (the same FP8 GEMMs; the SwiGLU output and the gradients are
    quantized in plain 1x128 groups by the GEMM ops instead of by the kernels that produce
    them, so the values differ from eager within FP8 rounding, and the weight gradients
    are FP8 whatever ``fp8_wgrad`` says). FP8 ``rows`` are dequantized first (their
    gradient flows straight through). The fused autograd node is not registered yet."""
    if isinstance(rows, Fp8Tensor):
        rows = rows.dequantize()
    backend = "triton"
    h = grouped_mm(rows, gate_up, layout.offsets, True, backend, pow2_scale)
    a = silu_mul(h, probs_rows)
    return grouped_mm(a, down, layout.offsets, True, backend, pow2_scale)
