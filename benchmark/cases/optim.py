"""linghe.optim: total grad norm, clip_grad_norm_, count_zeros over lists of tensors.

Two lists (GPU): 300 fp32 tensors of mixed shapes totalling ~300M elements (bandwidth), and
2000 small tensors (per-call overhead). Providers: eager (the reference: one concatenated
vector), compile, linghe, and "torch" (``torch.nn.utils.get_total_norm`` /
``clip_grad_norm_(foreach=True)``, PyTorch's multi-tensor path).
"""

import torch

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, case, compiled

# a repeating pattern of 5 shapes (~4.97M elements), 60 times: 300 tensors, ~298M elements
_BIG_PATTERN = [(2048, 1024), (1024, 1000), (2048,), (512, 1000), (1000, 1333)]


def _lists(cfg: Config):
    if cfg.cpu:
        big = [(64, 33), (100,), (3, 70_000 // 3), (7,), (1000, 2)] * 2
        small = [((i * 97) % 300 + 1,) for i in range(60)]
    else:
        big = _BIG_PATTERN * 60
        small = [((i * 997) % 5000 + 1,) for i in range(2000)]
    return [("300 fp32" if not cfg.cpu else "10 fp32", big),
            ("2000 small fp32" if not cfg.cpu else "60 small fp32", small)]


def _make(shapes, device, zeros=False):
    ts = [torch.randn(s, device=device) for s in shapes]
    if zeros:
        for t in ts:
            t.view(-1)[::7] = 0
    return ts


def _params(ts):
    ps = []
    for t in ts:
        p = torch.nn.Parameter(torch.empty_like(t))
        p.grad = t
        ps.append(p)
    return ps


def _eager_norm(ts):
    return ref.total_norm(ts, 2.0, torch.float32)


def _eager_clip(ps):
    return ref.clip_grad_norm_(ps, 1e9)


def _eager_zeros(ts):
    return torch.stack([(t == 0).sum() for t in ts]).sum()


def _numel(ts):
    return sum(t.numel() for t in ts)


@case("grad_norm")
def grad_norm_case(cfg: Config):
    out = []
    for label, shapes in _lists(cfg):
        ts = _make(shapes, cfg.device)
        n = _numel(ts)
        run = {"eager": lambda ts=ts: _eager_norm(ts),
               "linghe": lambda ts=ts: linghe.optim.grad_norm(ts),
               "torch": lambda ts=ts: torch.nn.utils.get_total_norm(ts, 2.0, foreach=True)}
        if len(ts) <= 300:  # compiling a 2000-input graph takes minutes
            run["compile"] = lambda ts=ts: compiled(_eager_norm)(ts)
        out.append(Bench(name=f"grad_norm {label} ({n / 1e6:.1f}M)", bytes=4 * n, tol=1e-5,
                         run=run, expected=lambda ts=ts: ref.total_norm(ts, 2.0)))
    return out


@case("clip_grad_norm")
def clip_grad_norm_case(cfg: Config):
    # max_norm far above the norm: coefficient 1, so repeated runs leave the grads unchanged
    # (every provider still multiplies every gradient, as PyTorch does)
    out = []
    for label, shapes in _lists(cfg):
        ts = _make(shapes, cfg.device)
        ps = _params(ts)
        n = _numel(ts)
        run = {"eager": lambda ps=ps: _eager_clip(ps),
               "linghe": lambda ps=ps: linghe.optim.clip_grad_norm_(ps, 1e9),
               "torch": lambda ps=ps: torch.nn.utils.clip_grad_norm_(ps, 1e9, foreach=True)}
        if len(ts) <= 300:
            run["compile"] = lambda ps=ps: compiled(_eager_clip)(ps)
        out.append(Bench(name=f"clip_grad_norm_ {label} ({n / 1e6:.1f}M)", bytes=12 * n,
                         tol=1e-5, run=run, expected=lambda ts=ts: ref.total_norm(ts, 2.0),
                         note="bytes: read for the norm + read/write for the scaling"))
    return out


@case("count_zeros")
def count_zeros_case(cfg: Config):
    out = []
    for label, shapes in _lists(cfg):
        ts = _make(shapes, cfg.device, zeros=True)
        n = _numel(ts)
        run = {"eager": lambda ts=ts: _eager_zeros(ts),
               "linghe": lambda ts=ts: linghe.optim.count_zeros(ts)}
        if len(ts) <= 300:
            run["compile"] = lambda ts=ts: compiled(_eager_zeros)(ts)
        out.append(Bench(name=f"count_zeros {label} ({n / 1e6:.1f}M)", bytes=4 * n, tol=0,
                         run=run, expected=lambda ts=ts: ref.count_zeros(ts)))
    return out


def _adamw_copies(shapes, device, n_copies):
    """``n_copies`` independent (params, steps) sets with the same initial values and
    gradients (bf16; every provider steps its own set)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    base = [(torch.randn(s, generator=g).to(device, torch.bfloat16),
             torch.randn(s, generator=g).to(device, torch.bfloat16)) for s in shapes]
    sets = []
    for _ in range(n_copies):
        ps = []
        for w, gr in base:
            p = torch.nn.Parameter(w.clone())
            p.grad = gr.clone()
            ps.append(p)
        sets.append(ps)
    return sets


_ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


@case("adamw")
def adamw_case(cfg: Config):
    """One AdamW step with gradient clipping (max norm far above the norm: coefficient 1,
    every gradient still read for the norm) over 300 bf16 parameters (~300M elements).
    eager: the reference (``linghe.reference``: clip, then the update per tensor in
    float64); torch: ``clip_grad_norm_(foreach=True)`` + ``torch.optim.AdamW(fused=True)``;
    compile: ``torch.compile`` of clip + foreach AdamW; linghe: ``linghe.optim.AdamW(
    max_grad_norm=...)``. Bytes: 16 per element (parameter, gradient and both moments read,
    three written, the gradient read once more for the norm by the others; linghe reads it
    once for the norm and once in the update)."""
    shapes = _lists(cfg)[0][1]
    on_gpu = not cfg.cpu
    eager_ps, torch_ps, comp_ps, lin_ps = _adamw_copies(shapes, cfg.device, 4)
    n = _numel(eager_ps)
    max_norm = 1e9
    eager_state = {"m": [torch.zeros_like(p) for p in eager_ps],
                   "v": [torch.zeros_like(p) for p in eager_ps], "step": [0]}

    def eager():
        eager_state["step"][0] += 1
        ref.clip_grad_norm_(eager_ps, max_norm)
        ref.adamw_step([p.data for p in eager_ps], [p.grad for p in eager_ps],
                       eager_state["m"], eager_state["v"],
                       [eager_state["step"][0]] * len(eager_ps), lr=_ADAMW["lr"],
                       beta1=_ADAMW["betas"][0], beta2=_ADAMW["betas"][1],
                       eps=_ADAMW["eps"], weight_decay=_ADAMW["weight_decay"])
        return [p.detach() for p in eager_ps]

    torch_opt = torch.optim.AdamW(torch_ps, fused=on_gpu or None, **_ADAMW)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(torch_ps, max_norm, foreach=True)
        torch_opt.step()
        return [p.detach() for p in torch_ps]

    comp_opt = torch.optim.AdamW(comp_ps, foreach=True, **_ADAMW)

    def comp_step():
        torch.nn.utils.clip_grad_norm_(comp_ps, max_norm, foreach=True)
        comp_opt.step()

    lin_opt = linghe.optim.AdamW(lin_ps, max_grad_norm=max_norm, **_ADAMW)

    def lin_step():
        lin_opt.step()
        return [p.detach() for p in lin_ps]

    def comp_run():
        compiled(comp_step)()
        return [p.detach() for p in comp_ps]

    run = {"eager": eager, "linghe": lin_step, "torch": torch_step, "compile": comp_run}
    return [Bench(name=f"adamw+clip {len(shapes)} bf16 ({n / 1e6:.1f}M)", bytes=16 * n,
                  tol=1e-2, run=run,
                  note="bytes: p, g, m, v read, p, m, v written, g read for the norm")]


@case("adamw_fp8_weights")
def adamw_fp8_weights_case(cfg: Config):
    """One AdamW step of an MoE expert weight ``[E, 2048, 2048]`` bf16 plus its 128x128 FP8
    copies (rowwise and columnwise), as the next FP8 forward needs them. linghe: the step
    writes the copies (``linghe.optim.AdamW`` with the weight bound to an FP8
    ``WeightCache``); separate: the same AdamW with ``fp8_weight_copies=False``, then
    ``quantize_grouped_weight`` (what the layer did before); torch: ``torch.optim.AdamW(
    fused=True)`` then ``quantize_grouped_weight``; eager: the foreach AdamW then the
    reference quantization. Bytes: 16 per element (p, g, m, v read; p, m, v written; two
    FP8 copies written)."""
    from linghe.fp8 import WeightCache
    from linghe.functional.grouped_mm import cached_grouped_weight, quantize_grouped_weight

    E, N, K = (2, 128, 136) if cfg.cpu else (64, 2048, 2048)
    eager_p, torch_p, sep_p, lin_p = (ps[0] for ps in _adamw_copies([(E, N, K)], cfg.device,
                                                                     4))
    n = eager_p.numel()
    cache = WeightCache()
    cached_grouped_weight(cache, lin_p, True)  # binds the weight, as the MoE layer does
    lin_opt = linghe.optim.AdamW([lin_p], **_ADAMW)

    def lin_step():
        lin_opt.step()
        return lin_p.detach()

    sep_opt = linghe.optim.AdamW([sep_p], fp8_weight_copies=False, **_ADAMW)

    def sep_step():
        sep_opt.step()
        quantize_grouped_weight(sep_p.detach(), pow2_scale=True)
        return sep_p.detach()

    torch_opt = torch.optim.AdamW([torch_p], fused=not cfg.cpu or None, **_ADAMW)

    def torch_step():
        torch_opt.step()
        quantize_grouped_weight(torch_p.detach(), pow2_scale=True)
        return torch_p.detach()

    eager_opt = torch.optim.AdamW([eager_p], foreach=True, **_ADAMW)

    def eager():
        eager_opt.step()
        ref.quantize_128x128(eager_p.detach().reshape(E * N, K), pow2_scale=True)
        return eager_p.detach()

    run = {"eager": eager, "linghe": lin_step, "separate": sep_step, "torch": torch_step}
    return [Bench(name=f"adamw + fp8 copies [{E},{N},{K}] bf16 ({n / 1e6:.1f}M)",
                  bytes=16 * n, tol=1e-2, run=run,
                  note="bytes: p, g, m, v read, p, m, v and two FP8 copies written")]
