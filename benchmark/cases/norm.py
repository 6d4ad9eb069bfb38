"""RMSNorm: forward, backward (dx, dweight) and RMSNorm + 1x128 quantization (row+col)."""

import torch

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, backward_of, case, compiled


def _ref_norm(x, w):
    return ref.rms_norm(x, w, 1e-6)


def _ref_norm_quant(x, w):
    return ref.rms_norm_quant(x, w, 1e-6, columnwise=True)


def _linghe_norm(x, w):
    return linghe.rms_norm(x, w, 1e-6)


def _shapes(cfg: Config):
    if cfg.cpu:
        return [(300, 520)]
    return [(8192, 2048), (8192, 4096), (8192, 8192)]


def _cdiv(a, b):
    return -(-a // b)


@case("norm")
def norm_case(cfg: Config):
    out = []
    for M, K in _shapes(cfg):
        dt = torch.bfloat16
        x = torch.randn(M, K, device=cfg.device, dtype=dt)
        w = (torch.rand(K, device=cfg.device) + 0.5).to(dt)
        e = dt.itemsize
        tag = f"[{M},{K}] bf16"
        out.append(Bench(
            name=f"rms_norm fwd {tag}", bytes=2 * M * K * e + K * e, tol=1e-2,
            expected=lambda x=x, w=w: ref.rms_norm(x.double(), w.double(), 1e-6),
            run={"eager": lambda x=x, w=w: _ref_norm(x, w),
                 "compile": lambda x=x, w=w: compiled(_ref_norm)(x, w),
                 "torch": lambda x=x, w=w: torch.nn.functional.rms_norm(x, w.shape, w, 1e-6),
                 "linghe": lambda x=x, w=w: _linghe_norm(x, w)}))

        xg = x.clone().requires_grad_()
        wg = w.clone().requires_grad_()
        dy = torch.randn(M, K, device=cfg.device, dtype=dt)

        def expected_bwd(xg=xg, wg=wg, dy=dy):
            xd = xg.detach().double().requires_grad_()
            wd = wg.detach().double().requires_grad_()
            return torch.autograd.grad(ref.rms_norm(xd, wd, 1e-6), (xd, wd), dy.double())

        out.append(Bench(
            name=f"rms_norm bwd (dx, dw) {tag}",
            bytes=3 * M * K * e + 4 * M + 2 * K * e, tol=1e-2, expected=expected_bwd,
            run={"eager": backward_of(lambda xg=xg, wg=wg: _ref_norm(xg, wg), (xg, wg), dy),
                 "compile": backward_of(lambda xg=xg, wg=wg: compiled(_ref_norm)(xg, wg),
                                        (xg, wg), dy),
                 "linghe": backward_of(lambda xg=xg, wg=wg: _linghe_norm(xg, wg), (xg, wg),
                                       dy)}))

        qbytes = (M * K * e + K * e + 2 * M * K
                  + 4 * (M * _cdiv(K, 128) + K * _cdiv(M, 128)))
        out.append(Bench(
            name=f"rms_norm_quant row+col {tag}", bytes=qbytes, tol=1e-2,
            note="fp8 data compared as values (one e4m3 step ~ 6%: tol is on the norm)",
            run={"eager": lambda x=x, w=w: _ref_norm_quant(x, w),
                 "compile": lambda x=x, w=w: compiled(_ref_norm_quant)(x, w),
                 "linghe": lambda x=x, w=w: linghe.rms_norm_quant(x, w, 1e-6,
                                                                   columnwise=True)}))
    return out
