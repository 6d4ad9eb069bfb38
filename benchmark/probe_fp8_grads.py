"""Probe of the FP8 training path's gradients and weight copies:
``python -m benchmark.probe_fp8_grads [--cpu] [--width small] [--pretrain-steps N]
[--opt-steps K] [--json PATH]``.

Builds the end-to-end model of ``benchmark.e2e`` (``benchmark/e2e_model.py``; width
"small" on a GPU, a reduced "tiny" on ``--cpu``), optionally trains it ``N`` steps in the
bf16 mode with the loss curve's optimizer and learning-rate schedule (so the weights and
AdamW's moments are not at their initial values), then, on the next batch and the same
weights, computes every parameter's gradient in each of these variants:

- ``ref``: the torch mode (``linghe.reference`` ops) on a float32 copy of the model: the
  reference every other variant is compared with;
- ``torch``: the torch mode in bf16; ``bf16``: linghe's kernels in bf16;
- ``fp8``: ``TrainingContext(fp8="blockwise")`` as ``benchmark.e2e`` runs it (dense
  wgrads in FP8, the experts' wgrads in bf16 from the dequantized FP8 activations);
- ``fp8_xw``: the experts' wgrads in FP8 too (``expert_fp8_wgrad=True``);
- ``fp8_dw16``: the dense layers' wgrads in bf16 (``fp8_wgrad=False``);
- ``bf16_next``: the bf16 mode on the *next* batch (the batch-to-batch gradient noise of
  training: an FP8 error well under it is noise the optimizer already lives with).

Per parameter kind (attention projections, routed experts' gate_up / down, shared expert,
router, norm weights, embedding, LM head) it prints the relative error ``||g - g_ref|| /
||g_ref||``, the cosine and the gain ``<g, g_ref> / <g_ref, g_ref>`` (below 1: the
gradient is systematically shrunk, e.g. by underflow), and the same for the AdamW update
each variant's gradient would make from the optimizer's current moments (clipped as the
step clips: AdamW divides by the second moment, so elements with small gradients can
flip sign; this is what the trajectory sees). And the loss of each variant on the batch.

Then it trains ``K`` steps in the fp8 mode (``linghe.optim.AdamW`` writes the FP8 copies
of every weight bound to a cache) and checks that the copy each FP8 layer would use
(``WeightCache`` lookups as the layers make them) is bit for bit a fresh quantization of
the current weight (both copies, data and scales), and that a forward + backward with
the caches gives the same loss and gradients as one after
``linghe.fp8.cache.invalidate_weight_caches()`` (every copy quantized anew).

The table is printed last; ``--json PATH`` writes everything. ``--cpu`` runs the Triton
interpreter at tiny shapes (its e4m3 rounding differs from the GPU's in ~2% of elements:
a smoke test, not the measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import replace

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    # The interpreter is chosen when a kernel is decorated: before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import linghe  # noqa: E402
from linghe import reference as ref  # noqa: E402
from linghe.fp8 import quantize_128x128  # noqa: E402
from linghe.fp8.cache import invalidate_weight_caches  # noqa: E402
from linghe.functional.grouped_mm import (  # noqa: E402
    cached_grouped_weight,
    quantize_grouped_weight,
)

from . import e2e_model as em  # noqa: E402
from .e2e import deterministic_kernels  # noqa: E402

KINDS = ("attn proj", "experts gate_up", "experts down", "shared expert", "router",
         "norms", "embedding", "lm head")
#: variant -> (model mode, TrainingContext kwargs or None)
VARIANTS = {
    "torch": ("torch", None),
    "bf16": ("bf16", None),
    "fp8": ("fp8", {"fp8_wgrad": True, "expert_fp8_wgrad": False}),
    "fp8_xw": ("fp8", {"fp8_wgrad": True, "expert_fp8_wgrad": True}),
    "fp8_dw16": ("fp8", {"fp8_wgrad": False, "expert_fp8_wgrad": False}),
}
BETAS, EPS, MAX_NORM = (0.9, 0.95), 1e-8, 1.0


def kind_of(name: str) -> str:
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm head"
    if ".qkv_gate." in name or ".o_proj." in name:
        return "attn proj"
    if name.endswith("moe.experts_gate_up"):
        return "experts gate_up"
    if name.endswith("moe.experts_down"):
        return "experts down"
    if ".shared_experts." in name:
        return "shared expert"
    if name.endswith("router_weight"):
        return "router"
    return "norms"


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_fp8_grads",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes, Triton interpreter")
    p.add_argument("--width", default=None, help="e2e preset (default small; tiny on --cpu)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrain-steps", default=None,
                   help="bf16 training steps before the probe, or a comma-separated list of "
                        "increasing step counts to probe at each (default 100; 2 on --cpu)")
    p.add_argument("--schedule-steps", type=int, default=300,
                   help="length of the learning-rate schedule of the pretraining (the loss "
                        "curve's 300 steps)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--opt-steps", type=int, default=3,
                   help="fp8 training steps before the stale-copy check (>= 2: the copies "
                        "checked are then the optimizer's)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}")
    if a.opt_steps < 1:
        p.error("--opt-steps must be >= 1")
    if a.pretrain_steps is not None:
        try:
            a.pretrain_steps = [int(x) for x in a.pretrain_steps.split(",") if x.strip()]
        except ValueError:
            p.error(f"--pretrain-steps must be integers, got {a.pretrain_steps!r}")
        if not a.pretrain_steps or any(x < 0 for x in a.pretrain_steps) or \
                a.pretrain_steps != sorted(set(a.pretrain_steps)):
            p.error("--pretrain-steps must be increasing step counts >= 0")
    return a


# ------------------------------------------------------------------------ statistics
def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() * b.double()).sum())


def compare(g: dict, ref: dict, names: list[str]) -> dict:
    """rel err, cosine and gain of ``g`` against ``ref`` over the tensors ``names`` (one
    concatenated vector)."""
    d2 = r2 = g2 = gr = 0.0
    for n in names:
        a, r = g[n], ref[n]
        d2 += _dot(a - r, a - r)
        r2 += _dot(r, r)
        g2 += _dot(a, a)
        gr += _dot(a, r)
    rel = math.sqrt(d2 / r2) if r2 > 0 else math.sqrt(d2)
    cos = gr / math.sqrt(g2 * r2) if g2 > 0 and r2 > 0 else float("nan")
    gain = gr / r2 if r2 > 0 else float("nan")
    return {"rel": rel, "cos": cos, "gain": gain}


def adam_updates(grads: dict, params: dict, opt) -> dict:
    """The AdamW direction ``m_hat / (sqrt(v_hat) + eps)`` (no weight decay, no lr) that
    the next step would take with these gradients, clipped to ``MAX_NORM`` as the step
    clips, from the optimizer's current moments (zeros before its first step)."""
    norm = math.sqrt(sum(_dot(g, g) for g in grads.values()))
    coef = min(1.0, MAX_NORM / (norm + 1e-6))
    b1, b2 = BETAS
    out = {}
    for n, g in grads.items():
        st = opt.state.get(params[n], {})
        g = g.double() * coef
        if "exp_avg" in st:
            m, v = st["exp_avg"].double(), st["exp_avg_sq"].double()
            t = float(st["step"]) + 1
        else:
            m, v, t = torch.zeros_like(g), torch.zeros_like(g), 1.0
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        out[n] = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + EPS)
    return out


# ------------------------------------------------------------------------ gradients
def routing(moe, x: torch.Tensor) -> torch.Tensor:
    """The experts each token of ``x`` (a MoE layer's input) goes to, sorted ``[T, k]``:
    the reference router (float64 logits) on the given input."""
    logits = ref.router_logits(x.reshape(-1, x.shape[-1]), moe.router_weight.detach())
    _, ids, _ = ref.topk_route(logits, moe.top_k, score=moe.score,
                               expert_bias=moe.expert_bias, num_groups=moe.num_groups,
                               topk_groups=moe.topk_groups)
    return ids.sort(dim=1).values


def run_variant(model, tokens, labels, variant: str, routes: list | None = None):
    """``(loss, {name: float32 gradient})`` of one forward + backward; with ``routes``,
    appends each MoE layer's routing (:func:`routing` of the input it got)."""
    mode, ctx_kw = VARIANTS[variant]
    model.zero_grad(set_to_none=True)
    ctx = (linghe.TrainingContext(fp8="blockwise", **ctx_kw) if ctx_kw is not None
           else contextlib.nullcontext())
    hooks, torch_moe = [], em.torch_moe
    if routes is not None:
        hooks = [layer.moe.register_forward_pre_hook(
            lambda m, a: routes.append(routing(m, a[0].detach()))) for layer in model.layers]

        def recording_torch_moe(moe, x):  # the torch mode calls this, not MoE.forward
            routes.append(routing(moe, x.detach()))
            return torch_moe(moe, x)

        em.torch_moe = recording_torch_moe
    try:
        with ctx:
            loss, _ = model(tokens, labels, mode)
            loss.backward()
    finally:
        em.torch_moe = torch_moe
        for h in hooks:
            h.remove()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def reference_grads(model, tokens, labels, device, routes: list | None = None):
    """The torch mode on a float32 copy of ``model``."""
    m32 = em.E2EModel(model.cfg, device=device, dtype=torch.float32)
    m32.load_state_dict(model.state_dict())
    loss, g = run_variant(m32, tokens, labels, "torch", routes)
    del m32
    return loss, g


# ------------------------------------------------------------------------ MoE layers
def _row_stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-row relative errors ``||out[t] - ref[t]|| / ||ref[t]||``: quantiles, the worst
    row and how many rows are off by more than half (a dropped or misplaced row shows up
    there, however few)."""
    out, ref = out.double().reshape(ref.shape[0], -1), ref.double().reshape(ref.shape[0], -1)
    rn = ref.norm(dim=1)
    rel = (out - ref).norm(dim=1) / rn.clamp_min(1e-30)
    rel = rel[rn > 0]
    q = torch.quantile(rel.float(), torch.tensor([0.5, 0.99], dtype=torch.float32,
                                              device=rel.device))
    return {"rel": float((out - ref).norm() / ref.norm()), "p50": float(q[0]),
            "p99": float(q[1]), "max": float(rel.max()), "rows_over_half": int((rel > 0.5).sum()),
            "rows": int(rel.numel())}


def check_moe_layers(model, tokens, labels) -> list[dict]:
    """Each MoE layer on its own, on the input it gets in the bf16 mode: output and input
    gradient (for a fixed random output gradient) of the bf16 and the fp8 layer against
    the torch mode's layer in float32, per token (same routing in every variant: the
    router reads the same high-precision input)."""
    inputs = []
    hooks = [layer.moe.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
             for layer in model.layers]
    try:
        with torch.no_grad():
            model(tokens, labels, "bf16")
    finally:
        for h in hooks:
            h.remove()
    rows = []
    gen = torch.Generator(device=tokens.device).manual_seed(1234)
    for li, (layer, x) in enumerate(zip(model.layers, inputs)):
        moe = layer.moe
        x2 = x.reshape(-1, x.shape[-1])
        dy = torch.randn(x2.shape, generator=gen, device=x2.device, dtype=torch.float32)
        res, pg = {}, {}
        for v in ("ref", "bf16", "fp8"):
            xi = x2.float() if v == "ref" else x2
            xi = xi.clone().requires_grad_(True)
            if v == "ref":
                cfg = model.cfg
                m32 = linghe.nn.MoE(cfg.hidden, cfg.experts, cfg.topk, cfg.moe_intermediate,
                                    num_shared_experts=cfg.shared_experts, score="sigmoid",
                                    num_groups=cfg.expert_groups,
                                    topk_groups=cfg.topk_groups, align=cfg.align,
                                    device=x2.device, dtype=torch.float32)
                m32.load_state_dict(moe.state_dict())
                y, _ = em.torch_moe(m32, xi)
            else:
                ctx = (linghe.TrainingContext(fp8="blockwise") if v == "fp8"
                       else contextlib.nullcontext())
                with ctx:
                    y, _ = moe(xi)
            y.backward(dy.to(y.dtype))
            res[v] = (y.detach().float(), xi.grad.float())
            owner = m32 if v == "ref" else moe
            pg[v] = {n: p.grad.detach().float().clone()
                     for n, p in owner.named_parameters() if p.grad is not None}
            moe.zero_grad(set_to_none=True)
        for v in ("bf16", "fp8"):
            rows.append({"layer": li, "variant": v, "out": _row_stats(res[v][0], res["ref"][0]),
                         "dx": _row_stats(res[v][1], res["ref"][1]),
                         "grads": {n: compare(pg[v], pg["ref"], [n]) for n in pg["ref"]}})
    return rows


# ------------------------------------------------------------------------ stale copies
def _fp8_equal(a, b) -> dict:
    """Bitwise comparison of two blockwise weight copies (both copies, data and scales)."""
    out = {}
    for part in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
        x, y = getattr(a, part), getattr(b, part)
        if x is None or y is None:
            out[part] = None if x is None and y is None else 1.0
            continue
        if x.dtype != torch.float32:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        out[part] = float((x != y).float().mean()) if x.shape == y.shape else 1.0
    return out


def check_weight_copies(model, prev: dict) -> list[dict]:
    """For every FP8 weight cache of the model: the copy a layer would get now (a cache
    lookup as the layer makes it: ``hit`` means the cached one) against a fresh
    quantization of the current weight (fraction of differing bytes / scales), and the
    dequantized copy's relative distance to the current weight and to the weight before
    the last step (a stale copy sits closer to the latter)."""
    rows = []
    with linghe.TrainingContext(fp8="blockwise"):
        recipe = linghe.current_recipe()
        pow2 = recipe.pow2_scale
        for name, mod in model.named_modules():
            caches = []
            if isinstance(mod, linghe.nn.Linear):
                caches.append((name + ".weight", mod.weight, mod._fp8_weight_cache, "dense"))
            if isinstance(mod, linghe.nn.MoE):
                for pn in ("experts_gate_up", "experts_down"):
                    caches.append((f"{name}.{pn}", getattr(mod, pn),
                                   mod._fp8_weight_caches[pn], "grouped"))
            for pname, w, cache, kind in caches:
                hits, from_opt = cache.hits, cache.from_optimizer
                if kind == "dense":
                    got = cache.get_for_recipe(w, recipe, (id(mod), "w"))
                    fresh = quantize_128x128(w.detach().contiguous(), columnwise=True,
                                             pow2_scale=pow2)
                else:
                    got = cached_grouped_weight(cache, w, pow2)
                    fresh = quantize_grouped_weight(w.detach(), columnwise=True,
                                                    pow2_scale=pow2)
                deq = got.dequantize().reshape(w.shape).float()
                wn = w.detach().float()
                wp = prev[pname].float()
                diff = _fp8_equal(got, fresh)
                rows.append({
                    "param": pname, "hit": cache.hits > hits, "from_optimizer": from_opt,
                    "differing": diff,
                    "ok": all(v in (None, 0.0) for v in diff.values()),
                    "rel_to_current": float((deq - wn).norm() / wn.norm()),
                    "rel_to_previous": float((deq - wp).norm() / wp.norm()),
                    "step_rel": float((wn - wp).norm() / wp.norm()),
                })
    return rows


def cached_vs_fresh(model, tokens, labels) -> dict:
    """fp8 forward + backward with the caches as they are, then after
    ``invalidate_weight_caches()``: loss and gradient differences (0 when every copy the
    layers used is what a fresh quantization gives). Attention runs PyTorch's math SDPA
    here: the GPU's default (cuDNN) attention backward is not deterministic."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        l1, g1 = run_variant(model, tokens, labels, "fp8")
        invalidate_weight_caches()
        l2, g2 = run_variant(model, tokens, labels, "fp8")
    maxdiff = {n: float((g1[n] - g2[n]).abs().max()) for n in g1}
    worst = max(maxdiff, key=maxdiff.get)
    return {"loss_cached": l1, "loss_fresh": l2, "loss_diff": l1 - l2,
            "grad_max_abs_diff": maxdiff[worst], "grad_worst_param": worst,
            "ok": l1 == l2 and maxdiff[worst] == 0.0}


# ------------------------------------------------------------------------ main
def _fmt(v, spec=".3g"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def probe_point(model, opt, batches, step: int, variants: list[str], device) -> dict:
    """Everything measured on batch ``step`` at the model's current weights."""
    tok, lab = batches(step)
    losses, grads, routes = {}, {}, {"ref": []}
    losses["ref"], grads["ref"] = reference_grads(model, tok, lab, device, routes["ref"])
    for v in variants:
        t0 = time.perf_counter()
        routes[v] = []
        losses[v], grads[v] = run_variant(model, tok, lab, v, routes[v])
        print(f"  {v}: loss {losses[v]:.5f} ({time.perf_counter() - t0:.1f} s)", flush=True)
    # fraction of tokens whose expert set differs from the reference's, per layer
    flips = {v: [float((r != q).any(dim=1).float().mean())
                 for r, q in zip(routes[v], routes["ref"])] for v in variants}
    noise_var = "bf16" if "bf16" in variants else variants[0]
    losses["bf16_next"], grads["bf16_next"] = run_variant(model, *batches(step + 1), noise_var)
    params = dict(model.named_parameters())
    names = [n for n in params if n in grads["ref"]]
    by_kind = {k: [n for n in names if kind_of(n) == k] for k in KINDS}
    by_kind = {k: v for k, v in by_kind.items() if v}
    upd = {v: adam_updates(grads[v], params, opt) for v in grads}
    cols = [v for v in grads if v != "ref"]

    def stats(ns, g=grads, u=upd):
        return {v: {**compare(g[v], g["ref"], ns), "upd": compare(u[v], u["ref"], ns)}
                for v in cols}

    per_param = {n: stats([n]) for n in names}
    per_kind = {k: stats(ns) for k, ns in by_kind.items()}
    per_kind["all"] = stats(names)
    return {"step": step, "losses": losses, "routing_flips": flips,
            "per_param": per_param, "per_kind": per_kind,
            "moe_layers": check_moe_layers(model, tok, lab)}


def print_point(pt: dict, per_param: bool) -> None:
    cols = list(pt["per_kind"]["all"])
    if per_param:
        print(f"\nper parameter at step {pt['step']} (rel err vs the float32 torch reference; "
              "fp8 cos, gain):")
        for n, r in pt["per_param"].items():
            print(f"  {n:40s} " + " ".join(f"{v} {_fmt(r[v]['rel'])}" for v in cols) +
                  (f" | fp8 cos {_fmt(r['fp8']['cos'], '.4f')} gain "
                   f"{_fmt(r['fp8']['gain'], '.3f')}" if "fp8" in r else ""))
    print(f"\nMoE layers alone at step {pt['step']} (per-token rel err vs the float32 torch "
          "layer: p50 / p99 / max, tokens off by > 0.5; parameter gradients rel / gain):")
    for r in pt["moe_layers"]:
        print(f"  layer {r['layer']} {r['variant']:5s} " + "  ".join(
            f"{k} {r[k]['rel']:.4f} ({r[k]['p50']:.3f} / {r[k]['p99']:.3f} / {r[k]['max']:.3f},"
            f" {r[k]['rows_over_half']}/{r[k]['rows']})" for k in ("out", "dx")))
        print("      " + ", ".join(
            f"{n.replace('shared_experts.', 'se.').replace('.weight', '')} "
            f"{g['rel']:.4f}/{g['gain']:.3f}" for n, g in r["grads"].items()))
    print("routing: tokens routed unlike the float32 reference, per layer: " +
          "; ".join(f"{v} " + "/".join(f"{x:.3f}" for x in fl)
                    for v, fl in pt["routing_flips"].items()))
    print(f"losses on batch {pt['step']}: " +
          ", ".join(f"{v} {x:.5f}" for v, x in pt["losses"].items()))
    head = (f"{'kind':16s} " + " ".join(f"{v:>9s}" for v in cols) +
            f" {'fp8 cos':>8s} {'fp8 gain':>8s} | update rel: " +
            " ".join(f"{v:>9s}" for v in cols))
    print(f"\nstep {pt['step']}: gradient rel err ||g - g_ref|| / ||g_ref|| (ref: torch mode "
          "in float32; bf16_next: bf16 on the next batch = batch noise); AdamW update rel err")
    print(head)
    print("-" * len(head))
    for k, r in pt["per_kind"].items():
        f8 = r.get("fp8", {})
        print(f"{k:16s} " + " ".join(f"{_fmt(r[v]['rel']):>9s}" for v in cols) +
              f" {_fmt(f8.get('cos'), '.4f'):>8s} {_fmt(f8.get('gain'), '.3f'):>8s} | " +
              " ".join(f"{_fmt(r[v]['upd']['rel']):>9s}" for v in cols))


def main(argv=None) -> int:
    args = _parse(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    device = "cpu" if cpu else "cuda"
    width = args.width or ("tiny" if cpu else "small")
    over = {}
    if cpu and args.width is None:  # 128 tokens: whole 1x128 token groups in the wgrads
        over = {"seq": 64, "batch": 2, "layers": 1}
    for k in ("layers", "seq", "batch"):
        if getattr(args, k) is not None:
            over[k] = getattr(args, k)
    cfg = replace(em.preset(width), **over)
    points = args.pretrain_steps if args.pretrain_steps is not None else ([2] if cpu else [100])
    t_start = time.perf_counter()
    dev_name = torch.cuda.get_device_name() if not cpu else platform.processor() or "cpu"
    print(f"[probe_fp8_grads] {dev_name}; torch {torch.__version__}; width {width} "
          f"{cfg.as_dict()}", flush=True)
    last = points[-1]
    data = em.stdlib_corpus(em.corpus_bytes_needed(cfg, last + args.opt_steps + 4))
    batches = em.ByteBatches(data, cfg.batch, cfg.seq, device)
    result = {"config": cfg.as_dict(), "width": width, "device": dev_name,
              "pretrain_steps": points, "opt_steps": args.opt_steps,
              "variants": args.variants, "points": []}
    with deterministic_kernels():
        model = em.build_model(cfg, device=device, seed=args.seed)
        opt = em.make_optimizer(model, em.lr_at(0, args.schedule_steps, args.lr),
                                mode="bf16")
        pre_losses = []
        for point in points:
            # bf16 training up to the point (the loss curve's schedule), then the probe on
            # the next batch
            for i in range(len(pre_losses), point):
                em.set_lr(opt, em.lr_at(i, args.schedule_steps, args.lr))
                pre_losses.append(em.train_step(model, opt, *batches(i), "bf16"))
            if pre_losses:
                print(f"pretrained {point} bf16 steps: loss {float(pre_losses[0]):.4f} -> "
                      f"{float(pre_losses[-1]):.4f} ({time.perf_counter() - t_start:.1f} s)",
                      flush=True)
            result["points"].append(probe_point(model, opt, batches, point, args.variants,
                                                device))
        result["pretrain_losses"] = [float(v) for v in pre_losses]

        # --------------------------------------------------------- stale-copy check
        t0 = time.perf_counter()
        prev = {}
        for i in range(args.opt_steps):
            if i == args.opt_steps - 1:
                prev = {n: p.detach().clone() for n, p in model.named_parameters()}
            step = last + 2 + i
            em.set_lr(opt, em.lr_at(step, args.schedule_steps, args.lr))
            em.train_step(model, opt, *batches(step), "fp8")
        copies = check_weight_copies(model, prev)
        e2e_check = cached_vs_fresh(model, *batches(last + 2 + args.opt_steps))
        result.update(weight_copies=copies, cached_vs_fresh=e2e_check)
        print(f"  stale-copy check ({args.opt_steps} fp8 steps): "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    result["seconds"] = time.perf_counter() - t_start

    # ------------------------------------------------------------------ report
    print("\nFP8 weight copies after the fp8 steps (hit = the layer would use the cached "
          "copy; ok = bit for bit a fresh quantization of the current weight):")
    for c in copies:
        print(f"  {c['param']:40s} hit {c['hit']!s:5s} from_opt {c['from_optimizer']!s:5s} "
              f"ok {c['ok']!s:5s} rel to current {c['rel_to_current']:.4f}, to previous "
              f"{c['rel_to_previous']:.4f} (step moved {c['step_rel']:.2e})")
    print(f"  cached vs fresh fp8 step: loss {e2e_check['loss_cached']:.6f} vs "
          f"{e2e_check['loss_fresh']:.6f}, max grad diff {e2e_check['grad_max_abs_diff']:.3g}"
          f" ({e2e_check['grad_worst_param']})")
    for j, pt in enumerate(result["points"]):
        print_point(pt, per_param=j == len(result["points"]) - 1)
    stale_ok = all(c["ok"] and c["hit"] for c in copies)
    result["stale_check_pass"] = bool(stale_ok and e2e_check["ok"])
    print(f"weight copies: {sum(c['ok'] for c in copies)}/{len(copies)} equal to a fresh "
          f"quantization, {sum(c['hit'] for c in copies)}/{len(copies)} cache hits; cached "
          f"vs fresh step identical: {e2e_check['ok']}  => stale-copy check "
          f"{'PASS' if result['stale_check_pass'] else 'FAIL'}  ({result['seconds']:.1f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
