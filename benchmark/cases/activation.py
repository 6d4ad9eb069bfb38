"""SwiGLU: silu_mul fwd/bwd, silu_mul_quant fwd/bwd (+ quantized-dx backward kernel),
batch_silu_mul_quant fwd/bwd (32 experts), and the batch quantized-dx backward at the FP8
MoE step's shape (256 experts). ``[M, 2048]`` is the input ``x`` (n = 1024)."""

import torch

import linghe
from linghe import reference as ref
from linghe.bwd.activation import silu_mul_bwd_quant, silu_mul_bwd_rowwise_fp8

from ..harness import Bench, Config, backward_of, case, compiled


def _cdiv(a, b):
    return -(-a // b)


def _ref_silu_mul_quant(x):
    return ref.silu_mul_quant(x)


def _ref_silu_mul(x, probs=None):
    return ref.silu_mul(x, probs)


def _ref_bwd_quant(x, dy):
    x = x.detach().float().requires_grad_()  # fp32 dx, as the kernel quantizes
    (dx,) = torch.autograd.grad(ref.silu_mul(x), x, dy.float())
    return (*ref.quantize_1x128(dx), *ref.quantize_1x128_columnwise(dx))


def _fp8_bytes(M, K):
    """Both fp8 copies of ``[M, K]`` and their 1x128 scales."""
    return 2 * M * K + 4 * (M * _cdiv(K, 128) + K * _cdiv(M, 128))


@case("silu_mul")
def silu_mul_case(cfg: Config):
    M, n = (300, 200) if cfg.cpu else (8192, 1024)
    x = torch.randn(M, 2 * n, device=cfg.device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, n, device=cfg.device, dtype=torch.bfloat16)
    xb = M * 2 * n * 2
    return [
        Bench(name=f"silu_mul fwd [{M},{2 * n}] bf16", bytes=xb + M * n * 2, tol=1e-2,
              run={"eager": lambda: ref.silu_mul(x),
                   "compile": lambda: compiled(_ref_silu_mul)(x),
                   "linghe": lambda: linghe.silu_mul(x)}),
        Bench(name=f"silu_mul bwd [{M},{2 * n}] bf16", bytes=2 * xb + M * n * 2, tol=1e-2,
              run={"eager": backward_of(lambda: ref.silu_mul(x), [x], dy),
                   "compile": backward_of(lambda: compiled(_ref_silu_mul)(x), [x], dy),
                   "linghe": backward_of(lambda: linghe.silu_mul(x), [x], dy)}),
    ]


@case("silu_mul_quant")
def silu_mul_quant_case(cfg: Config):
    M, n = (300, 200) if cfg.cpu else (8192, 1024)
    x = torch.randn(M, 2 * n, device=cfg.device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, n, device=cfg.device, dtype=torch.bfloat16)
    xb = M * 2 * n * 2
    return [
        Bench(name=f"silu_mul_quant fwd row+col [{M},{2 * n}] bf16",
              bytes=xb + _fp8_bytes(M, n), tol=1e-2,
              run={"eager": lambda: _ref_silu_mul_quant(x),
                   "compile": lambda: compiled(_ref_silu_mul_quant)(x),
                   "linghe": lambda: linghe.silu_mul_quant(x)}),
        # Straight-through backward: dx (bf16) from x and dy.
        Bench(name=f"silu_mul_quant bwd [{M},{2 * n}] bf16", bytes=2 * xb + M * n * 2,
              tol=1e-2,
              run={"eager": backward_of(lambda: ref.silu_mul(x), [x], dy),
                   "compile": backward_of(lambda: compiled(_ref_silu_mul)(x), [x], dy),
                   "linghe": backward_of(lambda: linghe.silu_mul_quant(x), [x], dy)}),
        # Kernel-level: dx emitted quantized (row+col) for an FP8 linear layer.
        Bench(name=f"silu_mul bwd -> fp8 dx row+col [{M},{2 * n}] bf16",
              bytes=xb + M * n * 2 + _fp8_bytes(M, 2 * n), tol=1e-2,
              run={"eager": lambda: _ref_bwd_quant(x, dy),
                   "compile": lambda: compiled(_ref_bwd_quant)(x, dy),
                   "linghe": lambda: silu_mul_bwd_quant(dy, x.detach(), None)[0]}),
    ]


def _batch_inputs(cfg: Config):
    if cfg.cpu:
        R, n, E = 300, 200, 3
    else:
        R, n, E = 65536, 1024, 32
    align = 16
    g = torch.Generator().manual_seed(0)
    # Random counts whose padded segments fill (nearly) all R rows.
    w = torch.rand(E, generator=g) + 0.5
    counts = (w / w.sum() * (R - E * align)).floor().long()
    counts[0] = 0  # one expert with no tokens
    real = ref.real_rows(ref.expert_segments(counts, align), R, "cpu")
    x = torch.randn(R, 2 * n, dtype=torch.bfloat16)
    x[~real] = 0  # the layout contract: padding and tail rows are zeros
    x = x.to(cfg.device).requires_grad_()
    probs = torch.rand(R, device=cfg.device, requires_grad=True)
    return x, probs, counts.to(cfg.device, torch.int32), align, R, n, E


def _ref_batch_fwd(x, probs, counts_host, align):
    return ref.batch_silu_mul_quant(x, probs, counts_host, align)


@case("batch_silu_mul_quant")
def batch_silu_mul_quant_case(cfg: Config):
    x, probs, counts, align, R, n, E = _batch_inputs(cfg)
    counts_host = counts.cpu()
    dy = torch.randn(R, n, device=cfg.device, dtype=torch.bfloat16)
    G = _cdiv(R, 128) + E
    xb = R * 2 * n * 2
    fwd_bytes = xb + 4 * R + 2 * R * n + 4 * (R * _cdiv(n, 128) + n * G)
    bwd_bytes = 2 * xb + R * n * 2 + 8 * R
    xd, pd = x.detach(), probs.detach()

    def lin_fwd():
        return linghe.batch_silu_mul_quant(xd, pd, counts, align=align)

    return [
        Bench(name=f"batch_silu_mul_quant fwd {E} experts [{R},{2 * n}] bf16",
              bytes=fwd_bytes, tol=1e-2,
              run={"eager": lambda: _ref_batch_fwd(xd, pd, counts_host, align),
                   "compile": lambda: compiled(_ref_batch_fwd)(xd, pd, counts_host, align),
                   "linghe": lin_fwd}),
        # Straight-through backward: dx (bf16) and dprobs. Padding rows of x are zero, so
        # the plain reference's gradients there are zero too.
        Bench(name=f"batch_silu_mul_quant bwd {E} experts [{R},{2 * n}] bf16",
              bytes=bwd_bytes, tol=1e-2,
              run={"eager": backward_of(lambda: ref.silu_mul(x, probs), [x, probs], dy),
                   "compile": backward_of(lambda: compiled(_ref_silu_mul)(x, probs),
                                          [x, probs], dy),
                   "linghe": backward_of(
                       lambda: linghe.batch_silu_mul_quant(x, probs, counts, align=align),
                       [x, probs], dy)}),
    ]


@case("batch_silu_mul_bwd_rowwise_fp8")
def batch_silu_mul_bwd_rowwise_fp8_case(cfg: Config):
    """The SwiGLU backward of the FP8 MoE step with the experts' bf16 (deferred) weight
    gradient (``_backward_hp_wgrad``): dh in bf16 for the wgrad and its rowwise FP8 copy
    for the dgrad, from one kernel; 256 experts, 65536 routed rows, as
    ``batch_silu_mul_bwd_quant``."""
    routed, n, E = (256, 128, 8) if cfg.cpu else (65536, 1024, 256)
    inp = moe_grouped_inputs(E, routed, n, cfg.device, seed=0)
    R, align = inp["R"], inp["align"]
    x, dy, probs, cnt = (inp[k] for k in ("x", "dy", "probs", "counts"))
    K = 2 * n
    # Fewest bytes: real rows of x, dy and probs read once; dh (bf16) and its FP8 copy
    # with scales and dprobs written once, every row.
    nbytes = routed * (K * 2 + n * 2 + 4) + R * (K * 2 + K + 4 * _cdiv(K, 128) + 4)
    return [
        # (tol: dx one bf16 ulp apart in places moves the pow2 scale of a few groups and
        # with it their FP8 values: torch.compile's sigmoid, the interpreter's truncating
        # fp32 -> bf16 stores (DESIGN.md) both land at ~4e-2; ours on the H200 at 5e-5;
        # the tests check the FP8 copy bit for bit against quantizing dx)
        Bench(name=f"silu_mul bwd -> bf16 dx + fp8 rowwise {E} experts [{R},{K}] bf16",
              bytes=nbytes, tol=5e-2,
              run={"eager": lambda: _ref_batch_bwd_rowwise_fp8(x, dy, probs),
                   "compile": lambda: compiled(_ref_batch_bwd_rowwise_fp8)(x, dy, probs),
                   "linghe": lambda: silu_mul_bwd_rowwise_fp8(
                       dy, x, probs, need_dprobs=True, counts=cnt, align=align,
                       pow2_scale=True)}),
    ]


def _ref_batch_bwd_quant(x, dy, probs, counts_host, align):
    """dx quantized 1x128 rowwise and per segment columnwise with pow2 scales, and dprobs;
    padding rows of x and dy are zeros. dx as the kernels quantize it: in fp32 (the fused
    kernel), rounded to x's dtype first (the default two-kernel form,
    ``linghe.fwd.activation.QUANT_BWD_MODE``)."""
    from linghe.fwd import activation as A
    from linghe.testing import as_stored

    xf = x.detach().float().requires_grad_()
    pf = probs.detach().float().requires_grad_()
    dx, dp = torch.autograd.grad(ref.silu_mul(xf, pf), [xf, pf], dy.float())
    if A.QUANT_BWD_MODE == "two_kernel":
        dx = as_stored(dx, x.dtype)
    q, s, qt, st, _ = ref.quantize_grouped_1x128(dx, counts_host, align, pow2_scale=True)
    return q, s, qt, st, dp


def _ref_batch_bwd_rowwise_fp8(x, dy, probs):
    """dx in x's dtype, its rowwise 1x128 FP8 copy (pow2 scales) and dprobs, the SwiGLU
    gradient written out (so that ``torch.compile`` takes it whole); padding rows of x and
    dy are zeros, so are their gradients."""
    n = dy.shape[1]
    g, u = x[:, :n].float(), x[:, n:].float()
    d, p = dy.float(), probs.float()
    sig = 1.0 / (1.0 + torch.exp(-g))  # (the kernel's form: sigmoid rounds differently)
    silu = g * sig
    dp = (d * silu * u).sum(1)
    dpp = d * p[:, None]
    dg = dpp * u * (sig * (1.0 + g * (1.0 - sig)))
    dx = torch.cat([dg, dpp * silu], 1).to(x.dtype)
    q, s = ref.quantize_1x128(dx.float(), True)
    return dx, q, s, dp


def moe_grouped_inputs(E: int, routed: int, n: int, device: str, seed: int):
    """Rows grouped by expert as the FP8 MoE step holds them: ``routed`` rows with random
    expert ids over ``E`` experts, segments padded to 16 in a buffer of the static bound
    ``max_grouped_rows`` rows, zero padding/tail rows; ``x [R, 2n]``, ``dy [R, n]`` bf16,
    ``probs [R]``."""
    from linghe.layout import make_expert_layout, max_grouped_rows

    align, topk = 16, 8
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(E, (routed,), generator=g), minlength=E)
    R = max_grouped_rows(routed // topk, topk, E, align)
    real = ref.real_rows(ref.expert_segments(counts, align), R, "cpu")
    gd = torch.Generator(device=device).manual_seed(seed)  # (large tensors: on the device)
    real = real.to(device)
    x = torch.randn(R, 2 * n, generator=gd, device=device).to(torch.bfloat16)
    dy = torch.randn(R, n, generator=gd, device=device).to(torch.bfloat16)
    probs = torch.rand(R, generator=gd, device=device)
    x[~real], dy[~real], probs[~real] = 0, 0, 0  # the layout contract: zero padding rows
    cnt = counts.to(device, torch.int32)
    layout = make_expert_layout(cnt, align, R)
    return dict(E=E, R=R, n=n, align=align, routed=routed, counts=cnt,
                counts_host=counts, offsets=layout.offsets, real=real, x=x, dy=dy,
                probs=probs)


@case("batch_silu_mul_bwd_quant")
def batch_silu_mul_bwd_quant_case(cfg: Config):
    """The batch quantized-dx backward as the FP8 MoE step runs it (``_GroupedSwiGLUFp8``
    backward): T x top-8 = 65536 routed rows with random expert ids over 256 experts,
    segments padded to 16 in a buffer of ``max_grouped_rows`` rows (zero padding rows),
    columnwise copy, pow2 scales, dprobs. (No compile provider: the reference quantizes
    expert by expert in a host loop over 256 segments.)"""
    routed, n, E = (256, 128, 8) if cfg.cpu else (65536, 1024, 256)
    inp = moe_grouped_inputs(E, routed, n, cfg.device, seed=0)
    R, align = inp["R"], inp["align"]
    x, dy, probs, cnt, offsets = (inp[k] for k in ("x", "dy", "probs", "counts", "offsets"))
    counts = inp["counts_host"]
    K, G = 2 * n, _cdiv(R, 128) + E
    # Fewest bytes: real rows of x, dy and probs read once; both fp8 copies, their scales
    # and dprobs written once.
    nbytes = (routed * (K * 2 + n * 2 + 4) + 2 * R * K + 4 * (R * _cdiv(K, 128) + K * G)
              + 4 * R)
    return [
        Bench(name=f"silu_mul bwd -> fp8 dx row+col {E} experts [{R},{K}] bf16",
              bytes=nbytes, tol=1e-2,
              run={"eager": lambda: _ref_batch_bwd_quant(x, dy, probs, counts, align),
                   "linghe": lambda: silu_mul_bwd_quant(
                       dy, x, probs, columnwise=True, pow2_scale=True, need_dprobs=True,
                       counts=cnt, align=align, segments=offsets)}),
    ]
