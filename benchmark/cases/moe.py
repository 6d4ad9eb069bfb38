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
eager within FP8 error) with the FP8 expert weights cached (a later micro-batch of a
step); ``linghe_fp8_requant`` = the same with the weight caches cleared before every call
(the first micro-batch of a step: weights quantized in the call). ``bytes`` = expert
weights read twice (fwd, dgrad) and their gradients written once, plus x, out and their
gradients. FLOPs = routed rows only, fwd+bwd.

Case ``moe_experts``: the expert FFN alone (``grouped_swiglu``: gate/up GEMM, SwiGLU with
router weights, down GEMM) forward+backward on 32 local experts (EP 8 shape: 65536 routed
rows, H 2048, I 1024, align 16): ``torch`` = ``torch._grouped_mm`` + torch SwiGLU (bf16,
autograd), ``linghe`` = ``grouped_swiglu`` bf16, ``linghe_fp8`` = ``grouped_swiglu`` FP8
end to end (cached weights). Target: linghe_fp8 >= 1.4x torch.
"""

import torch
import torch.nn.functional as F

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, case, random_routing

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
    def requant_run():
        for c in m._fp8_weight_caches.values():
            c.clear()
        return linghe_run(True)

    benches.append(Bench(name=f"moe fwd+bwd {tag} fp8 blockwise", bytes=nbytes // 2,
                         run={"linghe": linghe_run, "linghe_fp8": lambda: linghe_run(True),
                              "linghe_fp8_requant": requant_run}, tol=0.12,
                         expected=eager_run, flops=flops,
                         note="linghe = bf16 layer; checked against eager within FP8 error"))
    return benches


def _experts_shape(cfg: Config):
    if cfg.cpu:
        return dict(T=24, k=2, E=3, H=128, I=64, align=16)
    return dict(T=8192, k=8, E=32, H=2048, I=1024, align=16)


@case("moe_experts")
def moe_experts_case(cfg: Config):
    from linghe.functional.moe import grouped_swiglu

    s = _experts_shape(cfg)
    T, k, E, H, In, align = s["T"], s["k"], s["E"], s["H"], s["I"], s["align"]
    dev, dt = cfg.device, torch.bfloat16
    # Exact row count (no tail), so torch._grouped_mm defines every output row.
    layout, real, _, _ = random_routing(T, k, E, align, dev, exact_rows=True)
    R = layout.num_rows
    rows = torch.randn(R, H, device=dev, dtype=dt)
    rows[~real] = 0
    probs = torch.rand(R, device=dev)
    probs[~real] = 0
    w1 = (torch.randn(E, 2 * In, H, device=dev) / H**0.5).to(dt)
    w2 = (torch.randn(E, H, In, device=dev) / In**0.5).to(dt)
    gy = torch.randn(R, H, device=dev, dtype=dt)
    gy[~real] = 0
    ins = [t.requires_grad_(True) for t in (rows, probs, w1, w2)]
    caches = (linghe.fp8.WeightCache(), linghe.fp8.WeightCache())
    seg_ends = layout.offsets[1:]

    def run_of(fn):
        def run():
            y = fn()
            torch.autograd.grad(y, ins, gy)
            return y.detach()
        return run

    def torch_ffn():
        h = torch._grouped_mm(rows, w1.transpose(1, 2), offs=seg_ends)
        a = (F.silu(h[:, :In].float()) * h[:, In:].float() * probs[:, None]).to(dt)
        return torch._grouped_mm(a, w2.transpose(1, 2), offs=seg_ends)

    def eager_ffn():
        return ref.grouped_swiglu(rows, probs, w1, w2, layout.offsets)

    run = {"eager": run_of(eager_ffn),
           "linghe": run_of(lambda: grouped_swiglu(rows, probs, w1, w2, layout)),
           "linghe_fp8": run_of(lambda: grouped_swiglu(rows, probs, w1, w2, layout, fp8=True,
                                                       pow2_scale=True,
                                                       weight_caches=caches))}
    if HAS_TORCH_GMM and not cfg.cpu:
        run["torch"] = run_of(torch_ffn)
    flops = 3 * 2 * T * k * 3 * H * In
    nbytes = 3 * E * 3 * H * In * 2 + 4 * R * H * 2
    tag = f"R{R} H{H} E{E} I{In} a{align}"
    return [Bench(name=f"moe_experts grouped_swiglu fwd+bwd {tag}", bytes=nbytes, run=run,
                  tol=0.12, flops=flops,
                  note="linghe_fp8 checked within FP8 error; target >= 1.4x torch")]
