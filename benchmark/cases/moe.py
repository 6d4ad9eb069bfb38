"""nn.MoE forward+backward at the Ling-mini MoE shape (single GPU, all experts local).

Shape: T 8192 tokens, hidden 2048, 256 experts (all local: ~3.2 GB of bf16 expert weights
plus their gradients fit one H100/H200), top-8, expert intermediate 1024, sigmoid routing,
align 16, no shared experts. Each call runs forward and backward (``torch.autograd.grad``
of ``sum(out * g)`` w.r.t. the input, the router weight and both expert weights) and
returns the output.

Providers: ``eager`` = :func:`linghe.reference.moe` (a Python loop over experts, bf16
GEMMs, fp64 router GEMM); ``torch`` = plain PyTorch with ``torch._grouped_mm`` for both
expert GEMMs (argsort permute padded to 16 rows per expert, one host sync for the padded
size; where torch provides ``_grouped_mm`` on the device); ``linghe`` = ``nn.MoE`` bf16;
``linghe_fp8`` = ``nn.MoE`` under ``TrainingContext(fp8="blockwise")`` (checked against
eager within FP8 error). ``bytes`` = expert weights read twice (fwd, dgrad) and their
gradients written once, plus x, out and their gradients. FLOPs = routed rows only, fwd+bwd.
"""

import torch
import torch.nn.functional as F

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, case

HAS_TORCH_GMM = hasattr(torch, "_grouped_mm")


def _shape(cfg: Config):
    if cfg.cpu:
        return dict(T=32, H=128, E=4, k=2, I=64)
    return dict(T=8192, H=2048, E=256, k=8, I=1024)


def _torch_grouped_moe(x, router_w, w1, w2, k, bias, align=16):
    """MoE in plain PyTorch with torch._grouped_mm (the reference for the GEMM backend)."""
    T, H = x.shape
    E = w1.shape[0]
    In = w2.shape[2]
    logits = x.float() @ router_w.t()
    s = torch.sigmoid(logits)
    ids = (s.detach() + bias).topk(k, dim=-1).indices
    p = s.gather(1, ids)
    p = p / p.sum(-1, keepdim=True)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    e_sorted = flat[order]
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + align - 1) // align * align
    pstart = torch.cumsum(padded, 0) - padded
    ustart = torch.cumsum(counts, 0) - counts
    pos = pstart[e_sorted] + torch.arange(flat.numel(), device=x.device) - ustart[e_sorted]
    R = int(padded.sum())  # host sync (reference only)
    tok = order // k
    rows = x.new_zeros(R, H).index_copy(0, pos, x[tok])
    prow = x.new_zeros(R, dtype=torch.float32).index_copy(0, pos, p.flatten()[order])
    offs = torch.cumsum(padded, 0).to(torch.int32)
    h = torch._grouped_mm(rows, w1.transpose(1, 2), offs=offs)
    a = (F.silu(h[:, :In].float()) * h[:, In:].float() * prow[:, None]).to(x.dtype)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    out = out.index_add(0, tok, y[pos].float())
    return out.to(x.dtype)


@case("moe")
def moe_case(cfg: Config):
    s = _shape(cfg)
    T, H, E, k, In = s["T"], s["H"], s["E"], s["k"], s["I"]
    dev, dt = cfg.device, torch.bfloat16
    torch.manual_seed(0)
    m = linghe.nn.MoE(H, E, k, In, align=16, device=dev, dtype=dt)
    x = torch.randn(T, H, device=dev, dtype=dt).requires_grad_(True)
    g = torch.randn(T, H, device=dev, dtype=dt)
    params = [m.router_weight, m.experts_gate_up, m.experts_down]

    def linghe_run(fp8=False):
        with linghe.TrainingContext(fp8="blockwise" if fp8 else None):
            out, _ = m(x)
            torch.autograd.grad(out, [x, *params], g)
        return out.detach()

    def eager_run():
        out = ref.moe(x, m.router_weight, m.experts_gate_up, m.experts_down, k,
                      score="sigmoid", expert_bias=m.expert_bias)[0]
        torch.autograd.grad(out, [x, *params], g)
        return out.detach()

    def torch_run():
        out = _torch_grouped_moe(x, m.router_weight, m.experts_gate_up, m.experts_down, k,
                                 m.expert_bias)
        torch.autograd.grad(out, [x, *params], g)
        return out.detach()

    wbytes = E * 3 * H * In * 2
    nbytes = 3 * wbytes + 4 * T * H * 2
    flops = 3 * 2 * T * k * 3 * H * In
    run = {"eager": eager_run, "linghe": linghe_run}
    if HAS_TORCH_GMM and not cfg.cpu:
        run["torch"] = torch_run
    tag = f"T{T} H{H} E{E} top{k} I{In}"
    benches = [Bench(name=f"moe fwd+bwd {tag} bf16", bytes=nbytes, run=run, tol=2e-2,
                     flops=flops)]
    benches.append(Bench(name=f"moe fwd+bwd {tag} fp8 blockwise", bytes=nbytes // 2,
                         run={"linghe_fp8": lambda: linghe_run(True)}, tol=0.1,
                         expected=eager_run, flops=flops,
                         note="FP8 grouped GEMMs; checked against eager within FP8 error"))
    return benches
