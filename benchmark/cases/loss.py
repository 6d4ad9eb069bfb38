"""Cross entropy (fwd, bwd, bwd in place) and fused linear cross entropy (fwd+bwd, peak
memory)."""

import torch

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, backward_of, case, compiled


def _labels(N, V, device):
    # every label valid (an ignored row is not read, which would flatter the kernel)
    return torch.randint(0, V, (N,), device=device)


@case("cross_entropy")
def cross_entropy_case(cfg: Config):
    N, V = (64, 1000) if cfg.cpu else (8192, 157184)
    x = torch.randn(N, V, device=cfg.device, dtype=torch.bfloat16) * 4
    lab = _labels(N, V, cfg.device)
    shape = f"[{N},{V}] bf16"
    eager = lambda: ref.cross_entropy(x, lab)
    comp = lambda: compiled(ref.cross_entropy)(x, lab)
    kern = lambda: linghe.cross_entropy(x, lab)
    out = [Bench(name=f"cross_entropy fwd {shape}", bytes=N * V * 2 + N * 8, tol=1e-4,
                 run={"eager": eager, "compile": comp, "linghe": kern},
                 note="bytes = logits read once")]

    xg = x.clone().requires_grad_()
    one = torch.tensor(1.0, device=cfg.device)
    bw = {
        "eager": backward_of(lambda: ref.cross_entropy(xg, lab), [xg], one),
        "compile": backward_of(lambda: compiled(ref.cross_entropy)(xg, lab), [xg], one),
        "linghe": backward_of(lambda: linghe.cross_entropy(xg, lab), [xg], one),
    }
    out.append(Bench(name=f"cross_entropy bwd {shape}", bytes=2 * N * V * 2 + N * 12,
                     tol=1e-2, run=bw, note="bytes = read logits + write dlogits"))

    # In place: the gradient overwrites the logits buffer (a private copy: every timed
    # run overwrites it again; the first, checked run sees the real logits).
    xi = x.clone().requires_grad_()
    xe = x.float().requires_grad_()

    def _expected():
        (g,) = torch.autograd.grad(ref.cross_entropy(xe, lab), [xe])
        return (g,)

    inpl = backward_of(lambda: linghe.cross_entropy(xi, lab, inplace_backward=True), [xi], one)
    out.append(Bench(name=f"cross_entropy bwd inplace {shape}", bytes=2 * N * V * 2 + N * 12,
                     tol=1e-2, run={"linghe": inpl}, expected=_expected,
                     note="inplace_backward=True: dlogits written into the logits buffer"))
    return out


def _peak_mb(fn, device) -> tuple[float, float] | None:
    """``(peak MiB above what was allocated before the call, MiB of the returned tensors)``
    of one call of ``fn`` (CUDA only). The peak includes the returned outputs (loss, dh, dW),
    which both providers must produce."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    r = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    outs = sum(t.numel() * t.element_size() for t in r if isinstance(t, torch.Tensor))
    del r
    return peak / 2**20, outs / 2**20


@case("linear_cross_entropy")
def linear_cross_entropy_case(cfg: Config):
    N, H, V = (64, 32, 300) if cfg.cpu else (8192, 2048, 157184)
    dt = torch.bfloat16
    h = torch.randn(N, H, device=cfg.device, dtype=dt).requires_grad_()
    w = (torch.randn(V, H, device=cfg.device) / H**0.5).to(dt).requires_grad_()
    lab = _labels(N, V, cfg.device)

    def eager():
        loss = ref.linear_cross_entropy(h, w, lab)
        return (loss, *torch.autograd.grad(loss, [h, w]))

    def comp():
        loss = compiled(ref.linear_cross_entropy)(h, w, lab)
        return (loss, *torch.autograd.grad(loss, [h, w]))

    def kern():
        loss = linghe.linear_cross_entropy(h, w, lab)
        return (loss, *torch.autograd.grad(loss, [h, w]))

    me, mk = _peak_mb(eager, cfg.device), _peak_mb(kern, cfg.device)
    note = "fwd+bwd (loss, dh, dW); flops = 3 GEMMs"
    if me is not None:
        (pe, oe), (pk, _) = me, mk
        ratio = pe / max(pk, 1e-9)
        note += (f"; peak memory above the inputs (incl. {oe:.0f} MiB of outputs dh, dW): "
                 f"eager {pe:.0f} MiB, linghe {pk:.0f} MiB = {ratio:.1f}x less"
                 + ("" if ratio >= 4 else " (BELOW the 4x target)"))
    out = [Bench(name=f"linear_cross_entropy fwd+bwd N={N} H={H} V={V} bf16",
                 bytes=2 * 2 * (N * H + V * H) + N * 8, flops=6 * N * H * V, tol=3e-2,
                 run={"eager": eager, "compile": comp, "linghe": kern}, note=note)]

    # The FP8 LM head (opt-in): checked against its own reference (the bf16 rows above
    # are the speed baseline); the weight's FP8 copy is cached, as within a step. With the
    # recipe's fp8_wgrad (default) its weight gradient is FP8 too; the second row keeps it
    # in bf16.
    for fp8_wgrad in (True, False):
        fp8_ctx = linghe.TrainingContext(fp8="blockwise", lm_head_fp8=True,
                                         fp8_wgrad=fp8_wgrad)

        def kern_fp8(fp8_ctx=fp8_ctx):
            with fp8_ctx:
                loss = linghe.linear_cross_entropy(h, w, lab)
            return (loss, *torch.autograd.grad(loss, [h, w]))

        def expected_fp8(fp8_wgrad=fp8_wgrad):
            loss = ref.linear_cross_entropy_fp8(h, w, lab, fp8_wgrad=fp8_wgrad)
            return (loss, *torch.autograd.grad(loss, [h, w]))

        what = "all three GEMMs FP8" if fp8_wgrad else "logits and dh GEMMs FP8, dW bf16"
        out.append(Bench(name=f"linear_cross_entropy fwd+bwd N={N} H={H} V={V} lm_head_fp8"
                              + ("" if fp8_wgrad else ", bf16 wgrad"),
                         bytes=2 * 2 * (N * H + V * H) + N * 8, flops=6 * N * H * V,
                         tol=3e-2, run={"linghe": kern_fp8}, expected=expected_fp8,
                         note=f"TrainingContext(lm_head_fp8=True): {what}; compare its "
                              "time with the bf16 row"))
    return out
