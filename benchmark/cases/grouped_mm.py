"""Grouped GEMMs at the Ling-mini MoE shapes: fwd, dgrad, wgrad; TFLOP/s.

Rows: T 8192 tokens x top-8 = 65536 routed rows (random, balanced-ish routing), grouped by
expert and padded; the buffer has the static bound ``max_grouped_rows`` of rows (the tail
is written as zeros). Two expert counts: 32 local experts (EP 8, align 128) and 256 (all
local, align 16). GEMMs: gate/up ``[R, 2048] x [E, 2048, 2048]`` and down
``[R, 1024] x [E, 2048, 1024]``.

Providers: ``eager`` = a per-expert loop of ``torch.matmul`` (offsets read to the host
once, outside the timing), ``linghe`` = the Triton kernels (bf16), ``torch`` =
``torch._grouped_mm`` through linghe (where available), ``linghe_fp8`` = the FP8 blockwise
kernels on pre-quantized operands (GEMM only; checked against the bf16 result within e4m3
error), ``dense`` = one bf16 cuBLAS matmul with the same total FLOPs (no check).
FLOPs count routed (real) rows only: padding is overhead.

The FP8 rows carry ``torch_bf16`` (``torch._grouped_mm`` in bf16, the bar: FP8 should be
>= 1.4x faster) beside ``linghe_fp8``, so the two compare in one block; the wgrad has a
second FP8 row with the operands the MoE layer uses (columnwise groups per expert
segment, ``quantize_grouped_1x128``). ``quantize_grouped_1x128`` (row+col, bf16 in) and
its FP8-in form (the columnwise copy of permuted FP8 rows) have rows too.
"""

import torch

import linghe
import linghe.functional.grouped_mm
from linghe import reference as ref
from linghe.bwd import grouped_mm as bwd_gm
from linghe.fwd import grouped_mm as fwd_gm

from ..harness import Bench, Config, case, random_routing

HAS_TORCH_GMM = hasattr(torch, "_grouped_mm")


def _configs(cfg: Config):
    if cfg.cpu:
        return [dict(T=40, topk=2, E=3, align=16, gemms=[("gate_up", 256, 128)])]
    out = [dict(T=8192, topk=8, E=32, align=128,
                gemms=[("gate_up", 2048, 2048), ("down", 2048, 1024)])]
    if not cfg.quick:
        out.append(dict(T=8192, topk=8, E=256, align=16,
                        gemms=[("gate_up", 2048, 2048), ("down", 2048, 1024)]))
    return out


def _gemm_benches(cfg: Config, layout, real, offs, used, gname, N, K):
    dev, dt = cfg.device, torch.bfloat16
    E, R, off = layout.num_experts, layout.num_rows, layout.offsets
    x = torch.randn(R, K, device=dev, dtype=dt)
    x[~real] = 0
    w = (torch.randn(E, N, K, device=dev) / K**0.5).to(dt)
    g = torch.randn(R, N, device=dev, dtype=dt)
    g[~real] = 0
    dw_buf = torch.empty(E, N, K, device=dev, dtype=dt)
    xq = linghe.quantize_1x128(x, columnwise=True)
    gq = linghe.quantize_1x128(g, columnwise=True)
    wq = linghe.quantize_grouped_weight(w, columnwise=True)
    flops = 2 * used * N * K
    tag = f"E{E} a{layout.align} {gname} [{R},{K}]x[{E},{N},{K}]"

    def eager_fwd():
        out = x.new_zeros(R, N)
        for e in range(E):
            torch.matmul(x[offs[e]:offs[e + 1]], w[e].t(), out=out[offs[e]:offs[e + 1]])
        return out

    def eager_dgrad():
        out = g.new_zeros(R, K)
        for e in range(E):
            torch.matmul(g[offs[e]:offs[e + 1]], w[e], out=out[offs[e]:offs[e + 1]])
        return out

    def eager_wgrad():
        for e in range(E):
            torch.matmul(g[offs[e]:offs[e + 1]].t(), x[offs[e]:offs[e + 1]], out=dw_buf[e])
        return dw_buf

    passes = {
        "fwd": dict(
            eager=eager_fwd,
            linghe=lambda: fwd_gm.grouped_mm_fwd(x, w, off, backend="triton"),
            torch=lambda: fwd_gm.grouped_mm_fwd(x, w, off, backend="torch"),
            fp8=lambda: linghe.grouped_mm_fp8(xq, wq, layout),
            bytes=2 * (R * K + E * N * K + R * N), dense=(used, K, N)),
        "dgrad": dict(
            eager=eager_dgrad,
            linghe=lambda: bwd_gm.grouped_mm_dgrad(g, w, off, backend="triton"),
            torch=lambda: bwd_gm.grouped_mm_dgrad(g, w, off, backend="torch"),
            fp8=lambda: linghe.grouped_mm_fp8_dgrad(gq, wq, layout),
            bytes=2 * (R * N + E * N * K + R * K), dense=(used, N, K)),
        "wgrad": dict(
            eager=eager_wgrad,
            linghe=lambda: bwd_gm.grouped_mm_wgrad(g, x, off, backend="triton"),
            torch=lambda: bwd_gm.grouped_mm_wgrad(g, x, off, backend="torch"),
            fp8=lambda: linghe.grouped_mm_fp8_wgrad(gq, xq, layout),
            bytes=2 * (R * N + R * K + E * N * K), dense=(N, used, K)),
    }
    qg = linghe.functional.grouped_mm.quantize_grouped_1x128
    xs, gs = qg(x, layout, rowwise=False), qg(g, layout, rowwise=False)
    torch_ok = HAS_TORCH_GMM and (cfg.cpu or fwd_gm.torch_grouped_mm_ok(x, w))
    benches = []
    for pname, p in passes.items():
        run = {"eager": p["eager"], "linghe": p["linghe"]}
        if torch_ok:
            run["torch"] = p["torch"]
        benches.append(Bench(name=f"grouped_mm {pname} {tag} bf16", bytes=p["bytes"],
                             run=run, tol=1e-2, flops=flops))
        fp8_run = {"torch_bf16": p["torch"]} if torch_ok else {}
        fp8_run["linghe_fp8"] = p["fp8"]
        benches.append(Bench(
            name=f"grouped_mm {pname} {tag} fp8 (pre-quantized operands)",
            bytes=p["bytes"] // 2, run=fp8_run, tol=0.08, expected=p["eager"], flops=flops,
            note="torch_bf16 = torch._grouped_mm bf16 (target: fp8 >= 1.4x faster)"))
        if pname == "wgrad":
            benches.append(_accumulate_bench(g, x, off, layout, eager_wgrad, torch_ok,
                                             tag, flops))
            benches.append(Bench(
                name=f"grouped_mm wgrad {tag} fp8 segment groups (MoE path)",
                bytes=p["bytes"] // 2,
                run={"linghe_fp8": lambda: linghe.grouped_mm_fp8_wgrad(gs, xs, layout)},
                tol=0.08, expected=p["eager"], flops=flops))
        m, k, n = p["dense"]
        a = torch.randn(m, k, device=dev, dtype=dt)
        b = torch.randn(k, n, device=dev, dtype=dt)
        benches.append(Bench(
            name=f"grouped_mm {pname} {tag} dense cuBLAS [{m},{k}]x[{k},{n}]",
            bytes=2 * (m * k + k * n + m * n), run={"dense": lambda a=a, b=b: a @ b},
            tol=1e-2, flops=flops, note="same FLOPs, one matmul; not checked"))
    return benches


def _accumulate_bench(g, x, off, layout, eager_wgrad, torch_ok, tag, flops) -> Bench:
    """The wgrad added into an existing gradient (fused gradient accumulation,
    :func:`~linghe.bwd.grouped_mm.grouped_mm_wgrad_accumulate_`) against computing it and
    adding it (what PyTorch's AccumulateGrad does). Each provider accumulates into its own
    copy of the same start, so the first call (the checked one) gives start + dW."""
    E, N, K = layout.num_experts, g.shape[1], x.shape[1]
    start = torch.randn(E, N, K, device=x.device).to(x.dtype)
    bufs = {name: start.clone() for name in ("eager", "torch", "linghe")}
    run = {"eager": lambda: bufs["eager"].add_(eager_wgrad()),
           "linghe": lambda: bwd_gm.grouped_mm_wgrad_accumulate_(bufs["linghe"], g, x, off)}
    if torch_ok:
        run["torch"] = lambda: bufs["torch"].add_(
            bwd_gm.grouped_mm_wgrad(g, x, off, backend="torch"))
    return Bench(name=f"grouped_mm wgrad accumulate into .grad {tag} bf16",
                 bytes=2 * (g.numel() + x.numel() + 2 * E * N * K), run=run, tol=1e-2,
                 expected=lambda: start.float() + eager_wgrad().float(), flops=flops,
                 note="eager/torch: wgrad then add_ (AccumulateGrad's pass)")


def _quant_benches(cfg: Config, layout, real, K):
    """``quantize_grouped_1x128`` of ``[R, K]`` grouped rows: bf16 in (row + segment
    columnwise) and FP8 rows in (columnwise only), against ``quantize_1x128``."""
    R = layout.num_rows
    counts = layout.tokens_per_expert.tolist()
    x = torch.randn(R, K, device=cfg.device, dtype=torch.bfloat16)
    x[~real] = 0
    xq = linghe.quantize_1x128(x)
    qg = linghe.functional.grouped_mm.quantize_grouped_1x128
    tag = f"E{layout.num_experts} a{layout.align} [{R},{K}]"
    return [
        Bench(name=f"quantize_grouped_1x128 row+col {tag} bf16", bytes=R * K * 4,
              run={"eager": lambda: ref.quantize_grouped_1x128(x.float(), counts,
                                                               layout.align)[:4],
                   "linghe": lambda: qg(x, layout)}, tol=0.07),
        Bench(name=f"quantize_1x128 row+col {tag} bf16 (plain groups, for comparison)",
              bytes=R * K * 4, run={"linghe": lambda: linghe.quantize_1x128(
                  x, columnwise=True)}, tol=0.07, note="not checked"),
        Bench(name=f"quantize_grouped_1x128 col from fp8 rows {tag}", bytes=R * K * 2,
              run={"linghe": lambda: qg(xq, layout)}, tol=0.07,
              expected=lambda: qg(xq.dequantize(dtype=torch.float32), layout)),
    ]


@case("grouped_mm")
def grouped_mm_case(cfg: Config):
    benches = []
    for c in _configs(cfg):
        T, topk, E, align = c["T"], c["topk"], c["E"], c["align"]
        layout, real, offs, _ = random_routing(T, topk, E, align, cfg.device)
        for gname, N, K in c["gemms"]:
            benches += _gemm_benches(cfg, layout, real, offs, T * topk, gname, N, K)
        benches += _quant_benches(cfg, layout, real, c["gemms"][0][2])
    return benches


@case("grouped_mm_deferred")
def grouped_mm_deferred_case(cfg: Config):
    """The expert wgrad of 4 micro-batches (E = 256, 8192 tokens top-8 each, align 16;
    each its own routing and row buffer) as one deferred launch
    (:func:`linghe.bwd.deferred.wgrad_parts` over the 4 parts) against ``eager`` (a
    per-expert ``torch.matmul`` loop per micro-batch, accumulated) and ``torch``
    (``torch._grouped_mm`` per micro-batch, added as AccumulateGrad does). Bytes: every
    part's ``d_out`` and rows read once, ``dW`` written once."""
    from linghe.bwd.deferred import WgradPart, wgrad_parts

    if cfg.cpu:
        T, topk, E, align, gemms, M = 40, 2, 3, 16, [("gate_up", 64, 48)], 3
    else:
        T, topk, E, align, M = 8192, 8, 256, 16, 4
        gemms = [("gate_up", 2048, 2048), ("down", 2048, 1024)]
    dev, dt = cfg.device, torch.bfloat16
    routings = [random_routing(T, topk, E, align, dev, seed=s) for s in range(M)]
    benches = []
    for gname, N, K in gemms:
        parts, offs_list = [], []
        for layout, real, offs, _ in routings:
            R = layout.num_rows
            g = torch.randn(R, N, device=dev, dtype=dt)
            x = torch.randn(R, K, device=dev, dtype=dt)
            g[~real] = 0
            x[~real] = 0
            parts.append(WgradPart(g, x, None, layout.offsets))
            offs_list.append(offs)
        dw = torch.empty(E, N, K, device=dev, dtype=torch.float32)

        def eager(parts=parts, offs_list=offs_list, dw=dw):
            dw.zero_()
            for p, offs in zip(parts, offs_list):
                for e in range(E):
                    dw[e] += (p.d_out[offs[e]:offs[e + 1]].t().float()
                              @ p.rows[offs[e]:offs[e + 1]].float())
            return dw

        def torch_acc(parts=parts):
            out = bwd_gm.grouped_mm_wgrad(parts[0].d_out, parts[0].rows, parts[0].offsets,
                                          backend="torch")
            for p in parts[1:]:
                out.add_(bwd_gm.grouped_mm_wgrad(p.d_out, p.rows, p.offsets, backend="torch"))
            return out

        run = {"eager": eager, "linghe": lambda parts=parts: wgrad_parts(parts, None)}
        if HAS_TORCH_GMM and not cfg.cpu:
            run["torch"] = torch_acc
        rows = sum(p.d_out.shape[0] for p in parts)
        benches.append(Bench(
            name=f"grouped_mm wgrad deferred, {M} micro-batches E{E} a{align} {gname} "
                 f"[{M}x{routings[0][0].num_rows},{K}] -> [{E},{N},{K}] bf16",
            bytes=2 * (rows * (N + K) + E * N * K), run=run, tol=1e-2,
            flops=2 * M * T * topk * N * K,
            note="eager: per-expert matmul loop per micro-batch; torch: _grouped_mm per "
                 "micro-batch + add_"))
    return benches
