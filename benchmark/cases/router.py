"""Router: fp32-exact router GEMM fwd/bwd, fused top-k routing, z-loss."""

import torch

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, backward_of, case, compiled


def _ref_route(logits, b):
    return ref.topk_route(logits, 8, "sigmoid", b, 1, 1, True, 2.5)


def _torch_fp32(x, w):
    return torch.nn.functional.linear(x.float(), w.float())


def _bwd_bench(x, w, T, K, E):
    wd = w.dtype
    we = w.element_size()
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    g = torch.randn(T, E, device=x.device)

    def expected_bwd():
        return ((g.double() @ w.double()).to(x.dtype), (g.double().t() @ x.double()).to(wd))

    return Bench(
        name=f"router_logits bwd (dx, dw) bf16 x {str(wd)[6:]} w",
        bytes=T * E * 4 + 2 * T * K * 2 + 2 * E * K * we, flops=4 * T * K * E, tol=1e-2,
        expected=expected_bwd, note="dw fp32-exact for fp32 w",
        run={"eager": backward_of(lambda: ref.router_logits(xg, wg), [xg, wg], g),
             "compile": backward_of(lambda: compiled(ref.router_logits)(xg, wg), [xg, wg], g),
             "linghe": backward_of(lambda: linghe.router_logits(xg, wg), [xg, wg], g)})


@case("router_logits")
def router_logits_case(cfg: Config):
    T, K, E = (64, 96, 40) if cfg.cpu else (8192, 2048, 256)
    out = []
    x = torch.randn(T, K, device=cfg.device, dtype=torch.bfloat16)
    for wd in (torch.float32, torch.bfloat16):
        w = (torch.randn(E, K, device=cfg.device) * 0.02).to(wd)
        we = w.element_size()
        exact = lambda x=x, w=w: ref.router_logits(x, w)
        out.append(Bench(
            name=f"router_logits fwd [{T},{K}]x[{E},{K}] bf16 x {str(wd)[6:]} w",
            bytes=T * K * 2 + E * K * we + T * E * 4, flops=2 * T * K * E,
            # the test's bound: IEEE sums on CPU; Hopper MMA fp32 accumulation is not
            # round-to-nearest, error grows with K (6.7e-6 measured at K=2048; TF32 ~1e-3)
            tol=5e-7 if cfg.cpu else 3e-6 * max(1.0, K / 256),
            expected=exact,
            note="fp32-exact (no TF32); eager = float64 reference",
            run={"eager": exact, "compile": lambda x=x, w=w: compiled(ref.router_logits)(x, w),
                 "torch_fp32": lambda x=x, w=w: _torch_fp32(x, w),
                 "linghe": lambda x=x, w=w: linghe.router_logits(x, w)}))
        out.append(_bwd_bench(x, w, T, K, E))
    return out


@case("topk_route")
def topk_route_case(cfg: Config):
    T, E, k = (64, 32, 8) if cfg.cpu else (8192, 256, 8)
    logits = torch.randn(T, E, device=cfg.device)
    b = torch.randn(E, device=cfg.device) * 0.1
    lg = logits.clone().requires_grad_()
    g = torch.randn(T, k, device=cfg.device)
    return [
        Bench(name=f"topk_route [{T},{E}] k={k} sigmoid+bias", bytes=T * E * 4 + T * k * 8 + E * 8,
              tol=1e-5,
              run={"eager": lambda: _ref_route(logits, b),
                   "compile": lambda: compiled(_ref_route)(logits, b),
                   "linghe": lambda: linghe.topk_route(logits, k, score="sigmoid", expert_bias=b,
                                                       scale=2.5)}),
        Bench(name=f"topk_route bwd [{T},{E}] k={k}", bytes=T * E * 8 + T * k * 8, tol=1e-5,
              run={"eager": backward_of(lambda: _ref_route(lg, b), [lg], g),
                   "compile": backward_of(lambda: compiled(_ref_route)(lg, b), [lg], g),
                   "linghe": backward_of(lambda: linghe.topk_route(
                       lg, k, score="sigmoid", expert_bias=b, scale=2.5), [lg], g)}),
        Bench(name=f"router_z_loss [{T},{E}]", bytes=T * E * 4, tol=1e-5,
              run={"eager": lambda: ref.router_z_loss(logits),
                   "compile": lambda: compiled(ref.router_z_loss)(logits),
                   "linghe": lambda: linghe.router_z_loss(logits)}),
    ]
