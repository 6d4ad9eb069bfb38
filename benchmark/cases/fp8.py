"""FP8 blockwise quantization: quantize_1x128 (rowwise + columnwise), quantize_128x128."""

import torch

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, case, compiled


def _ref_1x128_both(x):
    return (*ref.quantize_1x128(x), *ref.quantize_1x128_columnwise(x))


def _ref_128x128(w):
    return ref.quantize_128x128(w)


def _shapes(cfg: Config):
    if cfg.cpu:
        return [(300, 520)]
    return [(8192, 2048), (8192, 4096), (8192, 8192)]


@case("quantize_1x128")
def quantize_1x128_case(cfg: Config):
    out = []
    for M, K in _shapes(cfg):
        x = torch.randn(M, K, device=cfg.device, dtype=torch.bfloat16)
        nbytes = M * K * 2 + 2 * M * K + 4 * (M * -(-K // 128) + K * -(-M // 128))
        out.append(Bench(
            name=f"quantize_1x128 row+col [{M},{K}] bf16", bytes=nbytes, tol=1e-2,
            run={"eager": lambda x=x: _ref_1x128_both(x),
                 "compile": lambda x=x: compiled(_ref_1x128_both)(x),
                 "linghe": lambda x=x: linghe.quantize_1x128(x, columnwise=True)}))
    return out


@case("quantize_128x128")
def quantize_128x128_case(cfg: Config):
    N, K = (300, 260) if cfg.cpu else (8192, 8192)
    w = torch.randn(N, K, device=cfg.device, dtype=torch.bfloat16)
    nbytes = N * K * 3 + 4 * -(-N // 128) * -(-K // 128)
    return [Bench(
        name=f"quantize_128x128 [{N},{K}] bf16", bytes=nbytes, tol=1e-2,
        run={"eager": lambda: _ref_128x128(w), "compile": lambda: compiled(_ref_128x128)(w),
             "linghe": lambda: linghe.quantize_128x128(w)})]
