"""FP8 GEMMs of a linear layer: fprop ``Y = X·W^T``, dgrad ``dX = dY·W``, wgrad ``dW = dY^T·X``.

Every GEMM here is ``C [M, N] = A [M, K] · B [N, K]^T`` with both FP8 operands K-contiguous
(row-major ``[rows, K]``), each with float32 *dequantization* scales in one of three
layouts (``Fp8Tensor.scaling``):

- ``"1x128"``: ``scale [rows, ceil(K/128)]``, one scale per row per 128 K;
- ``"128x128"``: ``scale [ceil(rows/128), ceil(K/128)]``;
- ``"tensor"``: one scale for the whole operand.

Which copy of an :class:`Fp8Tensor` each GEMM reads (DESIGN.md, "FP8 format"):

==========  =================================  ======================================
GEMM        A                                  B
==========  =================================  ======================================
fprop       X rowwise ``[M, K]``               W rowwise ``[N, K]``
dgrad       dY rowwise ``[M, N]``              W columnwise ``[K, N]``
wgrad       dY columnwise ``[N, M]``           X columnwise ``[K, M]``
==========  =================================  ======================================

so in wgrad the reduction runs over tokens, which is the 1x128 group dimension of both
columnwise copies; every 128-wide K block of every GEMM therefore has one scale per row
of A and one per row (or row block) of B, and the Triton kernel promotes each block's
FP8 product into the float32 accumulator with that scale product
(``acc += dot(a, b) * sa[:, None] * sb[None, :]``; DeepSeek-V3's recipe).

Backends: ``torch._scaled_mm`` where the installed PyTorch and GPU support the needed
scaling (tensorwise on sm89+; cuBLAS blockwise 1x128/128x128 on sm90 with CUDA >= 12.9),
found by a try-once probe per scaling pair that also checks the numbers and is cached;
otherwise (and always on the CPU interpreter) a Triton GEMM. ``LINGHE_FP8_GEMM_BACKEND``
(``auto``/``triton``/``torch``) overrides the choice. Sizes need not be multiples of 128
(the Triton kernel masks; the torch backend is used only where its alignment holds).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import reference as _ref
from ..utils import (
    INTERPRET,
    cdiv,
    check_tensor,
    device_guard,
    empty,
    grouped_tile_order,
    launch,
    may_keep_derived,
    next_power_of_2,
)
from .tensor import Fp8Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_ROWS = {"1x128": 1, "128x128": 128, "tensor": 0}


# ======================================================================================
# Triton kernel
# ======================================================================================


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET,
                     stride_am, stride_bn, stride_cm,
                     stride_sam, stride_sak, stride_sbn, stride_sbk,
                     A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, PROMOTE: tl.constexpr,
                     EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """C = A·B^T. ``A_ROWS``/``B_ROWS``: rows per scale (1: 1x128, 128: 128x128, 0: one
    scale for the tensor; then ``PROMOTE`` is False and the scales multiply the finished
    accumulator). BK is 128, so each K step is exactly one scale group. ``M_BUCKET``
    (M rounded up to a power of two) only keys the autotuner."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    pid_m, pid_n = grouped_tile_order(pid, num_m, num_n, GROUP_M)

    offs_m = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    offs_n = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mmask = offs_m < M
    nmask = offs_n < N
    # Loads use wrapped row indices (rows past M/N re-read valid rows whose results the
    # store mask drops), so only a ragged K tail needs a load mask: unmasked loads stay
    # vectorized and pipelined.
    rows_a = offs_m % M
    rows_b = offs_n % N
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[None, :] * stride_bn + offs_k[:, None]  # [BK, BN] view of B^T
    if A_ROWS == 0:
        sa_ptrs = sa_ptr + rows_a * 0
    else:
        sa_ptrs = sa_ptr + (rows_a // A_ROWS) * stride_sam
    if B_ROWS == 0:
        sb_ptrs = sb_ptr + rows_b * 0
    else:
        sb_ptrs = sb_ptr + (rows_b // B_ROWS) * stride_sbn

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    num_k = tl.cdiv(K, BK)
    for kb in range(num_k):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = offs_k < K - kb * BK
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        if PROMOTE:
            sa = tl.load(sa_ptrs + kb * stride_sak)
            sb = tl.load(sb_ptrs + kb * stride_sbk)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    if not PROMOTE:
        sa = tl.load(sa_ptrs)
        sb = tl.load(sb_ptrs)
        acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        acc += bias[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _tiles(M: int, N: int):
    """(BM, BN, num_warps, num_stages) by shape: 128x128x128 fp8 tiles (32 KB of shared
    memory per stage) with 4 stages on the GPU; narrower M tiles for few tokens."""
    if INTERPRET:
        return 128 if M > 64 else 64, 128, 4, 1
    if M <= 64:
        return 64, 128, 4, 4
    return 128, 128, 8, 4


# A few configs, coarse key (token count bucketed): tuned once per layer shape on the GPU.
_CONFIGS = [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in [(128, 128, 8, 4), (128, 128, 8, 3), (128, 128, 4, 4),
                                  (64, 128, 4, 4)]]
_fp8_gemm_tuned = triton.autotune(
    configs=_CONFIGS, key=["M_BUCKET", "N", "K", "A_ROWS", "B_ROWS", "PROMOTE", "EVEN_K",
                           "HAS_BIAS"])(_fp8_gemm_kernel)


def _autotune() -> bool:
    """Autotune on the GPU unless ``LINGHE_FP8_GEMM_AUTOTUNE=0`` (then :func:`_tiles`)."""
    return not INTERPRET and os.environ.get("LINGHE_FP8_GEMM_AUTOTUNE", "1") != "0"


def _scale_strides(scale: torch.Tensor, scaling: str):
    if scaling == "tensor":
        return 0, 0
    return scale.stride(0), scale.stride(1)


def _triton_gemm(a, sa, a_scaling, b, sb, b_scaling, out_dtype, bias):
    M, K = a.shape
    N = b.shape[0]
    c = empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        c.zero_()
        if bias is not None:
            c += bias.to(out_dtype)
        return c
    sam, sak = _scale_strides(sa, a_scaling)
    sbn, sbk = _scale_strides(sb, b_scaling)
    args = (a, b, c, sa, sb, bias if bias is not None else c, M, N, K,
            next_power_of_2(M), a.stride(0), b.stride(0), c.stride(0), sam, sak, sbn, sbk)
    flags = dict(A_ROWS=_BLOCK_ROWS[a_scaling], B_ROWS=_BLOCK_ROWS[b_scaling],
                 PROMOTE=not (a_scaling == "tensor" and b_scaling == "tensor"),
                 EVEN_K=K % 128 == 0, HAS_BIAS=bias is not None, BK=128, GROUP_M=8)
    with device_guard(a):
        if _autotune():
            grid = lambda meta: (cdiv(M, meta["BM"]) * cdiv(N, meta["BN"]),)
            _fp8_gemm_tuned[grid](*args, **flags)
        else:
            BM, BN, warps, stages = _tiles(M, N)
            launch(_fp8_gemm_kernel, (cdiv(M, BM) * cdiv(N, BN),),
                *args, **flags, BM=BM, BN=BN, num_warps=warps, num_stages=stages)
    return c


# ======================================================================================
# torch._scaled_mm backend (probed once per scaling pair, device and output dtype)
# ======================================================================================

_probe_cache: dict[tuple, bool] = {}


def probed_backends() -> dict[tuple, bool]:
    """What the ``torch._scaled_mm`` probes found so far: ``{(device index, a_scaling,
    b_scaling, a_dtype, b_dtype, out_dtype, K/128 % 4 == 0): usable}`` (for logs)."""
    return dict(_probe_cache)


def _backend_choice() -> str:
    v = os.environ.get("LINGHE_FP8_GEMM_BACKEND", "auto").lower()
    if v not in ("auto", "triton", "torch"):
        raise ValueError(f"LINGHE_FP8_GEMM_BACKEND must be auto, triton or torch, got {v!r}")
    return v


def _torch_shape_ok(M, N, K, a_scaling, b_scaling) -> bool:
    if a_scaling == "tensor" and b_scaling == "tensor":
        return M % 16 == 0 and N % 16 == 0 and K % 16 == 0
    # cuBLAS blockwise: whole 128-K groups, 16-aligned outer dims, whole 128-row B blocks.
    if K % 128 or M % 16 or N % 16:
        return False
    return b_scaling != "128x128" or N % 128 == 0


def _torch_b_scale(sb, b_scaling):
    """B's scale in cuBLAS's layout. 128x128: ``[K/128, N/128]`` with strides ``[1, L4]``,
    L4 = K/128 rounded up to a multiple of 4 (a zero-padded copy); 1x128: ``[K/128, N]``
    contiguous. Weights' 128x128 scales live for a whole optimizer step, so the re-layout is
    cached on the scale tensor itself (keyed by its ``_version``, which the optimizer's
    in-place rewrite of an FP8 copy bumps): no torch ops per GEMM. Not while a CUDA graph
    is captured (the graph must contain the re-layout: a replay after the captured update
    rewrote the scales would read a stale one), nor for scales a captured update rewrites
    (its replays bump no version)."""
    if b_scaling == "1x128" and sb.stride(0) == 1:
        return sb.t()  # already group-major (quantize_1x128_launch(group_major_scales=True))
    if b_scaling == "128x128" and sb.shape[1] % 4 == 0 and sb.is_contiguous():
        return sb.t()  # its rows already are L4 long: the layout itself, no copy
    keep = may_keep_derived(sb)
    cached = getattr(sb, "_linghe_cublas", None)
    if cached is not None and cached[0] == sb._version and keep:
        return cached[1]
    if b_scaling == "128x128":
        gn, gk = sb.shape
        l4 = -(-gk // 4) * 4
        pad = torch.zeros(gn, l4, dtype=torch.float32, device=sb.device)
        pad[:, :gk] = sb
        sb_t = pad[:, :gk].t()
    else:
        sb_t = sb.t().contiguous()
    if not keep:
        return sb_t
    try:
        sb._linghe_cublas = (sb._version, sb_t)
    except (AttributeError, RuntimeError):  # pragma: no cover - e.g. a tensor subclass
        pass
    return sb_t


def _torch_scales(sa, a_scaling, sb, b_scaling, K):
    """Scales in the layouts cuBLAS wants: 1x128 A scales outer-dim-major (stride [1, M]:
    as they are when quantized group-major, else one small transposing copy per call), B
    scales as :func:`_torch_b_scale` says."""
    if a_scaling == "tensor":
        return sa.reshape(()).float(), sb.reshape(()).float()
    if sa.stride(0) != 1:
        sa = sa.t().contiguous().t()
    return sa, _torch_b_scale(sb, b_scaling)


def _torch_gemm(a, sa, a_scaling, b, sb, b_scaling, out_dtype, bias):
    K = a.shape[1]
    s_a, s_b = _torch_scales(sa, a_scaling, sb, b_scaling, K)
    out = torch._scaled_mm(a, b.t(), s_a, s_b, out_dtype=out_dtype)
    if bias is not None:  # (cuBLAS takes no bias with blockwise scales or an fp32 output)
        out = out + bias.to(out_dtype)
    return out


def padded_k(M: int, N: int, K: int, a_scaling: str, b_scaling: str, a_dtype: torch.dtype,
             b_dtype: torch.dtype, out_dtype: torch.dtype, device: torch.device) -> int:
    """The K to give :func:`fp8_gemm` for ``[M, K] x [N, K]^T``: ``K`` itself, or ``K``
    rounded up to a multiple of 512 when ``torch._scaled_mm`` (cuBLAS) declines ``K`` but
    takes the padded one (its 128x128 B scales want ``K/128`` a multiple of 4 here). Zero
    columns appended to both operands leave the product unchanged, so a caller that
    writes its operands anyway (the LM head's gradient, written by the loss kernel) can
    take cuBLAS instead of the slower Triton GEMM. ``K`` when the Triton backend is chosen,
    off the GPU, or when neither shape runs on cuBLAS."""
    if device.type != "cuda" or not (M and N and K) or _backend_choice() == "triton":
        return K
    fmt = (a_scaling, b_scaling, a_dtype, b_dtype, out_dtype)
    if _cublas_takes(device, M, N, K, *fmt):
        return K
    kp = cdiv(K, 512) * 512
    return kp if _cublas_takes(device, M, N, kp, *fmt) else K


def _cublas_takes(device: torch.device, M, N, K, a_scaling, b_scaling, a_dtype, b_dtype,
                  out_dtype) -> bool:
    """Whether ``torch._scaled_mm`` runs this shape and format here: its alignment, and the
    probe of the scaling pair (with K/128 a multiple of 4 or not)."""
    return _torch_shape_ok(M, N, K, a_scaling, b_scaling) and _probe_torch(
        device, a_scaling, b_scaling, a_dtype, b_dtype, out_dtype, cdiv(K, 128) % 4 == 0)


def _probe_torch(device: torch.device, a_scaling, b_scaling, a_dtype, b_dtype,
                 out_dtype, k_groups_mult4: bool) -> bool:
    """Run ``torch._scaled_mm`` once on a small problem with this scaling pair and check it
    against the dequantized product; cache the verdict (no error escapes). K is 512 or 384
    (``k_groups_mult4``), so the padded layout of 128x128 scales is checked too."""
    key = (device.index, a_scaling, b_scaling, a_dtype, b_dtype, out_dtype, k_groups_mult4)
    if key in _probe_cache:
        return _probe_cache[key]
    ok = False
    try:
        if torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm"):
            g = torch.Generator(device=device).manual_seed(0)
            M, N, K = 256, 256, (512 if k_groups_mult4 else 384)
            a = torch.randn(M, K, device=device, generator=g).to(a_dtype)
            b = torch.randn(N, K, device=device, generator=g).to(b_dtype)

            def scale(rows, scaling):
                if scaling == "tensor":
                    return torch.rand(1, device=device, generator=g) + 0.5
                r = rows if scaling == "1x128" else rows // 128
                return torch.exp2(torch.randint(-3, 4, (r, K // 128), device=device,
                                                generator=g).float())

            sa, sb = scale(M, a_scaling), scale(N, b_scaling)
            out = _torch_gemm(a, sa, a_scaling, b, sb, b_scaling, out_dtype, None)
            ref = _ref.fp8_gemm(a, sa, b, sb, a_scaling, b_scaling)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ok = err < 1e-2
    except Exception:  # noqa: BLE001 - any failure means "not supported here"
        ok = False
    _probe_cache[key] = ok
    return ok


# ======================================================================================
# Public functions
# ======================================================================================


def _check_operand(name, data, scale, scaling, rows, K):
    check_tensor(f"{name} data", data, dtypes=FP8_DTYPES, ndim=2, shape=(rows, K),
                 last_dim_contiguous=True)
    check_tensor(f"{name} scale", scale, dtypes=(torch.float32,))
    if scaling == "tensor":
        want = None if scale.numel() == 1 else "1 element"
    else:
        r = rows if scaling == "1x128" else cdiv(rows, 128)
        want = None if tuple(scale.shape) == (r, cdiv(K, 128)) else f"shape ({r}, {cdiv(K, 128)})"
    if want:
        raise ValueError(f"{name} scale for {scaling!r} scaling must have {want}, got shape "
                         f"{tuple(scale.shape)}")


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             *, a_scaling: str = "1x128", b_scaling: str = "128x128",
             out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
             backend: str | None = None) -> torch.Tensor:
    """``C [M, N] = (A * a_scale) · (B * b_scale)^T`` (+ ``bias``) with FP8 operands.

    Args:
        a: ``[M, K]`` float8 (e4m3 or e5m2), K contiguous.
        a_scale: float32 dequantization scales of ``a`` in the ``a_scaling`` layout.
        b: ``[N, K]`` float8, K contiguous.
        b_scale: float32 scales of ``b`` in the ``b_scaling`` layout.
        a_scaling / b_scaling: ``"1x128"``, ``"128x128"`` or ``"tensor"``; ``"tensor"``
            pairs only with ``"tensor"`` (and ``a`` cannot be ``"128x128"``).
        out_dtype: bfloat16 (default), float16 or float32.
        bias: optional ``[N]`` added in float32 before the output cast.
        backend: ``"triton"``, ``"torch"`` or ``None`` (auto, see the module docstring).

    Accumulates in float32; each 128-wide K block's product is scaled before it is added.
    """
    if a_scaling not in ("1x128", "tensor") or b_scaling not in _BLOCK_ROWS:
        raise ValueError(f"a_scaling must be '1x128' or 'tensor' and b_scaling one of "
                         f"{tuple(_BLOCK_ROWS)}, got {a_scaling!r}, {b_scaling!r}")
    if (a_scaling == "tensor") != (b_scaling == "tensor"):
        raise ValueError("tensorwise scaling must be used for both operands or neither, got "
                         f"a_scaling={a_scaling!r}, b_scaling={b_scaling!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of bfloat16, float16, float32, got {out_dtype}")
    check_tensor("a", a, ndim=2)
    check_tensor("b", b, ndim=2)
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K:
        raise ValueError(f"a [M, K] and b [N, K] must share K, got a {tuple(a.shape)} and "
                         f"b {tuple(b.shape)}")
    _check_operand("a", a, a_scale, a_scaling, M, K)
    _check_operand("b", b, b_scale, b_scaling, N, K)
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise TypeError("a and b cannot both be float8_e5m2 (no e5m2 x e5m2 FP8 GEMM)")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(torch.float32, torch.float16, torch.bfloat16),
                     shape=(N,), contiguous=True)
    devs = {t.device for t in (a, a_scale, b, b_scale) + ((bias,) if bias is not None else ())}
    if len(devs) != 1:
        raise ValueError(f"a, b, their scales and bias must be on one device, got {devs}")
    if a.device.type != "cuda" and not (a.device.type == "cpu" and INTERPRET):
        raise ValueError(f"a is on {a.device}; FP8 GEMMs need CUDA tensors (or CPU tensors "
                         "with TRITON_INTERPRET=1)")
    choice = backend or _backend_choice()
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if choice == "torch" and a.device.type == "cuda" and M and N and K and \
            not _torch_shape_ok(M, N, K, a_scaling, b_scaling):
        raise ValueError(f"backend='torch' cannot run M={M}, N={N}, K={K} with "
                         f"{a_scaling}/{b_scaling} scaling (alignment)")
    if torch.compiler.is_compiling():
        from .. import library  # (lazy: linghe.library imports this module)
        return library.fp8_gemm(a, a_scale, b, b_scale, a_scaling, b_scaling, out_dtype, bias,
                                choice)
    return _gemm(a, a_scale, a_scaling, b, b_scale, b_scaling, out_dtype, bias, choice)


# (device, M, N, K, scalings, dtypes, out dtype, backend choice) -> use torch._scaled_mm
_decision_cache: dict[tuple, bool] = {}


def _gemm(a, sa, a_scaling, b, sb, b_scaling, out_dtype, bias, choice=None):
    """Dispatch without validation (callers validated, or built the operands themselves).
    The backend decision is cached per shape/format, so a steady-state call costs a dict
    lookup plus the GEMM (and, for torch, one small A-scale transpose)."""
    if choice is None:
        choice = _backend_choice()
    M, K = a.shape
    N = b.shape[0]
    key = (a.device, M, N, K, a_scaling, b_scaling, a.dtype, b.dtype, out_dtype, choice)
    use_torch = _decision_cache.get(key)
    if use_torch is None:
        use_torch = False
        if a.device.type == "cuda" and M and N and K:
            if choice == "torch":
                use_torch = _torch_shape_ok(M, N, K, a_scaling, b_scaling)
            elif choice == "auto":
                use_torch = _cublas_takes(a.device, M, N, K, a_scaling, b_scaling, a.dtype,
                                          b.dtype, out_dtype)
        _decision_cache[key] = use_torch
    if use_torch:
        return _torch_gemm(a, sa, a_scaling, b, sb, b_scaling, out_dtype, bias)
    return _triton_gemm(a, sa, a_scaling, b, sb, b_scaling, out_dtype, bias)


def _need(t: Fp8Tensor, name: str, copy: str):
    if not isinstance(t, Fp8Tensor):
        raise TypeError(f"{name} must be an Fp8Tensor, got {type(t).__name__}")
    data = getattr(t, copy + "_data")
    if data is None:
        raise ValueError(f"{name} needs its {copy} copy (quantize with {copy}=True)")
    if copy == "columnwise" and t.col_segments is not None:
        # Its groups follow expert segments, not 128-token blocks of the whole tensor:
        # this dense GEMM would scale most groups wrongly.
        raise ValueError(f"{name}'s columnwise copy is grouped by expert segments "
                         "(col_segments, e.g. from batch_silu_mul_quant); this GEMM needs "
                         "plain 1x128 groups: requantize it (quantize_1x128(t.dequantize(), "
                         "columnwise=True)) or use the grouped GEMMs")
    return data, getattr(t, copy + "_scale")


def _act_scaling(t: Fp8Tensor, name: str) -> str:
    if t.scaling not in ("1x128", "tensor"):
        raise ValueError(f"{name} must use '1x128' or 'tensor' scaling, got {t.scaling!r}")
    return t.scaling


def fprop(x: Fp8Tensor, w: Fp8Tensor, bias: torch.Tensor | None = None, *,
          out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None) -> torch.Tensor:
    """``Y [M, N] = X [M, K] · W [N, K]^T (+ bias)`` from X's rowwise copy (1x128 or
    tensor scaling; leading dims of X flattened) and W's rowwise copy (128x128 or tensor)."""
    xd, xs = _need(x, "x", "rowwise")
    wd, ws = _need(w, "w", "rowwise")
    return fp8_gemm(xd, xs, wd, ws, a_scaling=_act_scaling(x, "x"), b_scaling=w.scaling,
                    out_dtype=out_dtype, bias=bias, backend=backend)


def dgrad(dy: Fp8Tensor, w: Fp8Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
          backend: str | None = None) -> torch.Tensor:
    """``dX [M, K] = dY [M, N] · W [N, K]`` from dY's rowwise copy and W's columnwise copy
    ``[K, N]`` (for 128x128 scaling the exact transpose of the rowwise blocks)."""
    dd, ds = _need(dy, "dy", "rowwise")
    wd, ws = _need(w, "w", "columnwise")
    return fp8_gemm(dd, ds, wd, ws, a_scaling=_act_scaling(dy, "dy"), b_scaling=w.scaling,
                    out_dtype=out_dtype, backend=backend)


def wgrad(dy: Fp8Tensor, x: Fp8Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
          backend: str | None = None) -> torch.Tensor:
    """``dW [N, K] = dY^T [N, M] · X [M, K]`` from the columnwise copies of dY ``[N, M]``
    and X ``[K, M]``, both grouped 1x128 along tokens M (the reduction dimension)."""
    dd, ds = _need(dy, "dy", "columnwise")
    xd, xs = _need(x, "x", "columnwise")
    sa, sb = _act_scaling(dy, "dy"), _act_scaling(x, "x")
    return fp8_gemm(dd, ds, xd, xs, a_scaling=sa, b_scaling=sb, out_dtype=out_dtype,
                    backend=backend)


# Unvalidated fprop for linghe's own layers (fp8_linear validated its inputs and built
# the Fp8Tensors itself): no per-call argument checks on the hot path.


def _fprop(x: Fp8Tensor, w: Fp8Tensor, bias, out_dtype) -> torch.Tensor:
    return _gemm(x.rowwise_data, x.rowwise_scale, x.scaling, w.rowwise_data,
                 w.rowwise_scale, w.scaling, out_dtype, bias)

