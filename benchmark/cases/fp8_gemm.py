"""FP8 GEMMs (fprop, dgrad, wgrad) and linghe.nn.Linear fwd+bwd under the blockwise recipe.

Providers: ``eager`` = bf16 ``torch.matmul`` of the same logical shapes (the rate to beat:
target >= 1.5x); ``linghe`` = the FP8 GEMM with pre-quantized operands (the GEMM alone;
auto backend: ``torch._scaled_mm`` where probed OK, else Triton); ``linghe_triton`` = the
Triton kernel forced. ``compile`` is not meaningful for a single matmul and is omitted.
"""

import torch

import linghe
from linghe.fp8 import gemm

from ..harness import Bench, Config, case


def _shapes(cfg: Config):
    # (M tokens, K in, N out): the Ling-mini attention/MLP projections and 8192^3.
    if cfg.cpu:
        return [(256, 256, 384)]
    return [(8192, 2048, 3072), (8192, 2048, 2048), (8192, 8192, 8192)]


def _gemm_bytes(m, n, k, a_scale_rows, b_scale_rows):
    # fp8 operands + fp32 scales + bf16 output
    ks = -(-k // 128)
    return m * k + n * k + 4 * ks * (a_scale_rows + b_scale_rows) + 2 * m * n


@case("fp8_gemm")
def fp8_gemm_case(cfg: Config):
    return [b for M, K, N in _shapes(cfg) for b in _gemm_benches(cfg.device, M, K, N)]


def _gemm_benches(dev, M, K, N):
    out = []
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16) * 0.01
    xq = linghe.quantize_1x128(x, columnwise=True, pow2_scale=True)
    wq = linghe.quantize_128x128(w, columnwise=True, pow2_scale=True)
    dyq = linghe.quantize_1x128(dy, columnwise=True, pow2_scale=True)
    flops = 2 * M * N * K
    specs = [
        ("fprop", f"Y[{M},{N}] = X[{M},{K}]·W^T", lambda: torch.matmul(x, w.t()),
         lambda b=None: gemm.fprop(xq, wq, backend=b),
         _gemm_bytes(M, N, K, M, -(-N // 128))),
        ("dgrad", f"dX[{M},{K}] = dY[{M},{N}]·W", lambda: torch.matmul(dy, w),
         lambda b=None: gemm.dgrad(dyq, wq, backend=b),
         _gemm_bytes(M, K, N, M, -(-K // 128))),
        ("wgrad", f"dW[{N},{K}] = dY^T·X (K={M} tokens)", lambda: torch.matmul(dy.t(), x),
         lambda b=None: gemm.wgrad(dyq, xq, backend=b),
         _gemm_bytes(N, K, M, N, K)),
    ]
    for name, desc, eager, lin, nbytes in specs:
        out.append(Bench(
            name=f"fp8_gemm blockwise {name} {desc}", bytes=nbytes, tol=7e-2, flops=flops,
            note="eager = bf16 torch.matmul; linghe = FP8 GEMM, operands pre-quantized",
            run={"eager": eager, "linghe": lin,
                 "linghe_triton": lambda lin=lin: lin("triton")}))
    return out


@case("fp8_linear")
def fp8_linear_case(cfg: Config):
    out = []
    dev = cfg.device
    for M, K, N in _shapes(cfg)[:2]:
        lin = linghe.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        base = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        base.load_state_dict(lin.state_dict())
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16) * 0.01
        ctx = linghe.TrainingContext(fp8="blockwise")

        def eager(base=base, x=x, dy=dy):
            y = base(x)
            y.backward(dy)
            return y

        def fp8(lin=lin, x=x, dy=dy, ctx=ctx):
            # Weight quantized once per optimizer step (the cache stays valid while the
            # weight is unchanged), as in training with several micro-batches per step.
            with ctx:
                y = lin(x)
                y.backward(dy)
            return y

        def fp8_requant(lin=lin, x=x, dy=dy, ctx=ctx):
            lin._fp8_weight_cache.clear()  # weight re-quantized every call (1 micro-batch/step)
            with ctx:
                y = lin(x)
                y.backward(dy)
            return y

        out.append(Bench(
            name=f"linghe.nn.Linear fwd+bwd blockwise [{M},{K}]x[{K},{N}]",
            bytes=2 * (M * K + N * K + M * N) * 2, tol=7e-2, flops=3 * 2 * M * N * K,
            note="eager = torch.nn.Linear bf16 fwd+bwd; linghe = FP8 blockwise, x and dY "
                 "quantized every call, W cached (quantized once per optimizer step); "
                 "linghe_wquant = W re-quantized every call too",
            run={"eager": eager, "linghe": fp8, "linghe_wquant": fp8_requant}))
    return out
