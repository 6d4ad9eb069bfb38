"""End-to-end training benchmark: a Ling-mini-2.0-shaped MoE decoder, three modes.

    python -m benchmark.e2e [--layers N|auto] [--steps N] [--mode torch,bf16,fp8]
                            [--cuda-graph] [--json PATH]
    python -m benchmark.e2e --train-steps 300 --width small [--out-dir DIR]
    python -m benchmark.e2e --steps 5 --cuda-graph --loss-json LOSS.json --json OUT.json

Throughput job (default): per mode (plain PyTorch reference, linghe bf16, linghe FP8
blockwise; same initial weights, same data, AdamW with clipping in each library's best
form: PyTorch's fused AdamW + ``clip_grad_norm_`` for torch, ``linghe.optim.AdamW`` with
fused clipping for the linghe modes (``--optimizer torch``: PyTorch's for all); gradients
set to None before each backward) it trains ``--steps`` timed steps after ``--warmup``
steps and reports tokens/s, model TFLOP/s and MFU, peak memory, the wall time of a step
against its GPU-busy time (the summed kernel time of ``--profile-steps`` steps from
``torch.profiler``; host-bound fraction = 1 - busy / wall), the step's GPU time by op
family and its longest kernels (``--top-kernels``). ``--cuda-graph`` adds rows for the
linghe modes with the whole step (forward, backward, clipping, AdamW, expert-bias update)
captured in CUDA graphs (two, replayed back to back: see :func:`make_stepper`). It
prints the issue's targets (bf16 vs torch >= 1.5x, FP8 vs bf16 >= 1.3x, eager wall /
GPU-busy <= 1.15, and with ``--loss-json`` the FP8 loss gap <= 1%) and a GEMM bound: the
step time of the bf16 row with every GEMM at 0 ms (Amdahl's limit on what FP8 GEMMs can
give) and with GEMMs at twice the bf16 throughput.

Loss-curve job (``--train-steps N``): trains each mode ``N`` steps from the same
initialisation on the Python installation's standard-library sources (byte tokens, the
same batches in every mode and run), with a warmup + cosine learning rate and PyTorch's
deterministic kernels, writes ``e2e_loss_<width>.csv`` (step, loss per mode) and
``e2e_loss_<width>.png`` under ``--out-dir``, and reports the final-loss gap of FP8
against bf16 (mean of the last 20 steps; target within 1%), with ``--seeds N`` over
``N`` seeds, next to the bf16-vs-torch gap (the noise floor: the same math, another
rounding) and a held-out evaluation (``--eval-batches``, ``--eval-every``:
``e2e_eval_<width>.csv``; see :func:`loss_curve_job`).

Model, modes and data: :mod:`benchmark.e2e_model`. On a machine without a GPU everything
runs through the Triton interpreter at the ``tiny`` width (interpreter timings).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    # No GPU: run the same Triton kernels through the interpreter (must precede import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

import linghe  # noqa: E402
from linghe.bwd.accumulate import (  # noqa: E402
    fused_grad_accumulation,
    set_fused_grad_accumulation,
)

from . import e2e_model  # noqa: E402
from .e2e_model import (  # noqa: E402
    MODES,
    ByteBatches,
    E2EConfig,
    accumulate_grads,
    build_model,
    corpus_bytes_needed,
    estimate_layers,
    force_balanced_routing,
    forward_backward,
    grad_params,
    load_stats,
    lr_at,
    make_optimizer,
    preset,
    routing_load,
    set_lr,
    stdlib_corpus,
    step_flops,
    total_params,
    update,
)
from .harness import GpuClockLog, fmt, host_canary_ms  # noqa: E402

#: Dense tensor-core peaks (TFLOP/s, without sparsity) of SXM parts: (bf16, fp8).
PEAK_TFLOPS = {"H200": (989.4, 1978.9), "H100": (989.4, 1978.9)}

# ======================================================================================
# kernel names -> op families
# ======================================================================================

FAMILIES = ("gemm", "grouped_gemm", "attention", "norm", "rope", "activation",
            "moe_routing_permute", "embedding", "loss", "optimizer", "quantize", "other")

# First match wins: the specific names (linghe's Triton kernels, PyTorch's) before the
# generic GEMM patterns, since e.g. "group_rms_norm_gate" and "GroupProblemShape" both
# contain "group".
_RULES = [
    ("attention", r"flash|fmha|attention|sdpa|_attn"),
    ("rope", r"rope|rotary"),
    ("norm", r"rms_norm|norm_gate|layer_norm|_sum_rows_kernel|_sum_partials_kernel"),
    ("loss", r"_ce_|cross_entropy|log_softmax|nll_loss|logsumexp"),
    ("optimizer", r"adam|multi_tensor|_norm_partials|_norm_reduce|_norm_finish|_scale_kernel"
                  r"|foreach|lpnorm"),
    ("activation", r"silu|swiglu|glu_|act_and_mul"),
    ("grouped_gemm", r"_grouped_rows|_fp8_rows_ws|_fp8_wgrad_ws|_hp_rows_ws|_hp_wgrad_ws"
                     r"|_wgrad_kernel|_wgrad_tma"
                     r"|_wgrad_fp8|_tile_map|_zero_tail|groupproblemshape|grouped"),
    ("quantize", r"quantize|_amax|fp8_cast|to_fp8"),
    ("embedding", r"embedding"),
    ("moe_routing_permute", r"_mm_kernel|_dw_kernel|_dx_kernel|topk|_zloss|router|permute"
                            r"|_scatter_kernel|_gather_kernel|_hist_kernel|_index_kernel|sort|radix|bincount"
                            r"|histogram|index|scatter|gather|cumsum|scan"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|splitk|sm90_|sm80_"),
]
_RULES_RE = [(fam, re.compile(pat)) for fam, pat in _RULES]


def classify_kernel(name: str) -> str:
    """The op family of a GPU kernel, from its name (see ``_RULES``). Index kernels
    (``index_add``, ``index_select``, gathers, sorts) count as MoE routing/permute: the
    torch mode's permutation is made of them (so are its embedding lookup and the sort
    in linghe's embedding backward); kernels named for the embedding count as such."""
    n = name.lower()
    for fam, rx in _RULES_RE:
        if rx.search(n):
            return fam
    return "other"


# ======================================================================================
# stepping (eager or one CUDA graph per step)
# ======================================================================================


def make_stepper(model, opt, batches: ByteBatches, mode: str, *, graph: bool,
                 warmup: int, micro_batches: int = 1) -> Callable[[int], torch.Tensor]:
    """``step(i) -> loss`` (a device scalar) training on batch ``i``. Runs ``warmup``
    steps first (Triton compiles, autotuning, optimizer state, cached pointer tables).
    ``micro_batches > 1``: step ``i`` accumulates the gradients of batches ``i *
    micro_batches ..`` before one update (:func:`~benchmark.e2e_model.accumulate_grads`).

    With ``graph`` the whole step is captured in two CUDA graphs that share one memory
    pool and are replayed back to back: every micro-batch's forward + backward, then
    clipping + AdamW + expert-bias update. Each call copies the step's batches into the
    static input buffers and replays both. The captures run inside
    :func:`linghe.whole_step_capture`: they hold whole steps, so the deferred expert and
    FP8-head weight gradients and the gradient norms recorded in the backward stay on
    (their bookkeeping runs once, at capture). Why two graphs: the gradients are set to
    None before the backward (see :func:`~benchmark.e2e_model.forward_backward`), so they
    first exist inside the capture, and ``linghe.optim.clip_grad_norm_`` builds its
    pointer table for new gradient addresses with a pinned host buffer, an allocation
    that stream capture does not allow in every torch version. Between the captures the
    first graph is replayed once and the clipping run eagerly (or
    ``linghe.optim.AdamW.prepare_step``), which builds the table for the graph's
    gradient addresses (the same on every replay); the second capture then reuses it."""
    n = micro_batches

    def micro(i):
        return [batches(i * n + j) for j in range(n)]

    def forward_backwards(mbs):  # -> (loss, tokens per expert)
        if n == 1:
            return forward_backward(model, opt, *mbs[0], mode)
        return accumulate_grads(model, opt, mbs, mode)

    def eager_step(i, step_batches=None):
        loss, tpes = forward_backwards(step_batches if step_batches is not None else micro(i))
        update(model, opt, tpes, mode)
        return loss

    if not graph:
        for i in range(warmup):
            eager_step(i)
        return eager_step

    static = [(tok.clone(), lab.clone()) for tok, lab in micro(0)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture wants
        for _ in range(max(1, warmup)):
            eager_step(0, static)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # Free the warm-up's gradients before the capture (inside it they would be freed to
    # the ordinary pool, which the graph's pool cannot reuse: one more copy of them), and
    # hand the eager steps' cached blocks back to the device for the graph's pool.
    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    g_grad, g_update = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with linghe.whole_step_capture():
        with torch.cuda.graph(g_grad):
            s_loss, s_tpes = forward_backwards(static)
        g_grad.replay()  # real gradients, so the eager clipping below scales finite values
        if isinstance(opt, linghe.optim.AdamW):
            opt.prepare_step()  # its tables for the graph's gradients, nothing updated
        else:
            clip = (torch.nn.utils.clip_grad_norm_ if mode == "torch"
                    else linghe.optim.clip_grad_norm_)
            clip(grad_params(model), 1.0)
        torch.cuda.synchronize()
        with torch.cuda.graph(g_update, pool=g_grad.pool()):
            update(model, opt, s_tpes, mode)

    def replay(i):
        for (s_tok, s_lab), (tok, lab) in zip(static, micro(i)):
            s_tok.copy_(tok)
            s_lab.copy_(lab)
        g_grad.replay()
        g_update.replay()
        return s_loss.clone()

    # The graphs and their static inputs/outputs live as long as the stepper (a graph's
    # outputs stay valid only while referenced; the second graph reads the first's).
    replay.graphs = (g_grad, g_update)
    replay.static = (s_loss, s_tpes, static)
    return replay


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def profile_steps(step, first: int, n: int, top: int = 60) -> dict:
    """GPU kernel time of ``n`` steps from ``torch.profiler``: per step, in total and by
    op family, plus the ``top`` longest kernels (names up to 600 characters: the functor
    of a PyTorch elementwise kernel comes late in its template name)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            step(first + i)
        torch.cuda.synchronize()
    fam = dict.fromkeys(FAMILIES, 0.0)
    kernels = []
    for e in prof.key_averages():
        us = e.self_device_time_total
        if us <= 0:
            continue
        f = classify_kernel(e.key)
        fam[f] += us / n / 1e3
        kernels.append((us / n / 1e3, e.count / n, f, e.key[:600]))
    kernels.sort(reverse=True)
    idle_ms, gaps = gpu_idle_gaps(prof.events())
    return {"busy_ms": sum(fam.values()), "families_ms": fam,
            "top_kernels": [{"ms": k[0], "calls": k[1], "family": k[2], "name": k[3]}
                            for k in kernels[:top]],
            "idle_ms": idle_ms / n, "top_gaps": gaps}


def gpu_idle_gaps(events, top: int = 10, min_us: float = 20.0) -> tuple[float, list]:
    """Where the GPU waited for the host inside the profiled steps: ``(idle ms in all,
    the ``top`` longest gaps)``, a gap being time between two kernels (any stream) with
    none running; each ``{"us", "after", "before"}`` names the kernels around it. Gaps
    shorter than ``min_us`` (launch latency between back-to-back kernels) are counted in
    the idle time but not listed."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    idle, gaps = 0.0, []
    if not spans:
        return 0.0, []
    end, last = spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
        if s > end:
            idle += s - end
            if s - end >= min_us:
                gaps.append((s - end, last, name))
        if e > end:
            end, last = e, name
    gaps.sort(reverse=True)
    return idle / 1e3, [{"us": g, "after": a[:200], "before": b[:200]}
                        for g, a, b in gaps[:top]]


def peak_tflops(device) -> tuple[float | None, float | None]:
    if torch.device(device).type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name and "PCIe" not in name:
            return peaks
    return None, None


def measure(cfg: E2EConfig, mode: str, *, device, graph: bool, steps: int, warmup: int,
            prof_steps: int, data: bytes, seed: int, lr: float,
            optimizer: str = "auto", clocks: GpuClockLog | None = None,
            balance: bool = False) -> dict:
    """Train ``mode`` for ``warmup + steps (+ prof_steps)`` steps and measure them
    (``clocks``: the GPU's clocks and power over the timed steps, ``row["clocks"]``;
    ``balance``: :func:`~benchmark.e2e_model.force_balanced_routing`). The row records
    how even the experts' loads were after the timed steps (``routing_load``)."""
    row = {"mode": mode, "cuda_graph": graph, "optimizer": optimizer, "error": None}
    model = opt = step = None
    try:
        model = build_model(cfg, device=device, seed=seed)
        opt = make_optimizer(model, lr, mode=mode, capturable=graph, optimizer=optimizer)
        batches = ByteBatches(data, cfg.batch, cfg.seq, device)
        if balance:
            force_balanced_routing(model)
            row["balanced_routing"] = True
        if torch.device(device).type == "cuda":
            # from here: warm-up steps (optimizer state) and the capture are included
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        step = make_stepper(model, opt, batches, mode, graph=graph, warmup=warmup,
                            micro_batches=cfg.micro_batches)
        _sync(device)
        row["warmup_s"] = time.perf_counter() - t0
        losses = []
        canary = [host_canary_ms()]
        t0, e0 = time.perf_counter(), time.time()
        for i in range(steps):
            losses.append(step(warmup + i))
        _sync(device)
        wall = (time.perf_counter() - t0) / steps
        canary.append(host_canary_ms())
        row["host_canary_ms"] = canary  # before and after the timed steps (harness)
        row["clocks"] = clocks.summary(e0, time.time()) if clocks is not None else None
        row["step_ms"] = wall * 1e3
        row["losses"] = torch.stack(losses).float().cpu().tolist()
        row["tokens_per_s"] = cfg.step_tokens / wall
        flops = step_flops(cfg)["total"]
        row["tflops"] = flops / wall / 1e12
        pb, pf = peak_tflops(device)
        row["mfu_bf16_peak"] = row["tflops"] / pb if pb else None
        row["mfu_fp8_peak"] = row["tflops"] / pf if (pf and mode == "fp8") else None
        if torch.device(device).type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
            if prof_steps:
                p = profile_steps(step, warmup + steps, prof_steps)
                row.update(p)
                row["host_bound_frac"] = 1 - p["busy_ms"] / row["step_ms"]
        # after the memory peak is read: a forward of its own
        row["routing_load"] = load_stats(routing_load(model, *batches(warmup + steps), mode))
    except Exception as e:  # one failing mode must not stop the others
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        traceback.print_exc()
    finally:
        del model, opt, step
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return row


# ======================================================================================
# output
# ======================================================================================



def _print_rows(head, lines, file=None):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: " | ".join(str(c).rjust(w) for c, w in zip(cells, widths))
    print(fmt(head), file=file)
    print("-+-".join("-" * w for w in widths), file=file)
    for line in lines:
        print(fmt(line), file=file)


def _label(r) -> str:
    return r["mode"] + (" +graph" if r.get("cuda_graph") else "")


def print_breakdown(rows, file=None) -> None:
    ok = [r for r in rows if r.get("families_ms")]
    if not ok:
        return
    print("\nGPU time per step by op family (ms, torch.profiler kernel time):", file=file)
    head = ["family"] + [_label(r) for r in ok]
    lines = [[fam] + [fmt(r["families_ms"][fam], ".2f") for r in ok] for fam in FAMILIES]
    lines.append(["total (busy)"] + [fmt(r["busy_ms"], ".2f") for r in ok])
    _print_rows(head, lines, file)


def print_table(rows, cfg: E2EConfig, file=None, loss_gap: float | None = None) -> None:
    base = {(r["mode"], r["cuda_graph"]): r.get("step_ms") for r in rows if not r["error"]}
    head = ["mode", "step ms", "GPU-busy ms", "host-bound", "tokens/s", "TFLOP/s",
            "MFU(bf16 pk)", "MFU(fp8 pk)", "peak GiB", "vs torch", "vs bf16", "last loss"]
    lines = []
    for r in rows:
        if r["error"]:
            lines.append([_label(r), "error: " + r["error"][:70]] + [""] * (len(head) - 2))
            continue
        vs = lambda k, ms=r["step_ms"]: (fmt(base[k] / ms, ".2f") + "x") if base.get(k) else "-"
        g = r["cuda_graph"]
        hb = r.get("host_bound_frac")
        lines.append([
            _label(r), fmt(r["step_ms"], ".1f"), fmt(r.get("busy_ms"), ".1f"),
            "-" if hb is None else f"{100 * hb:.0f}%", fmt(r["tokens_per_s"], ",.0f"),
            fmt(r["tflops"], ".1f"),
            "-" if r["mfu_bf16_peak"] is None else f"{100 * r['mfu_bf16_peak']:.1f}%",
            "-" if r["mfu_fp8_peak"] is None else f"{100 * r['mfu_fp8_peak']:.1f}%",
            fmt(r.get("peak_mem_gib"), ".1f"), vs(("torch", False)), vs(("bf16", g)),
            fmt(r["losses"][-1], ".4f")])
    f = step_flops(cfg)
    print(f"\nLing-mini-2.0-shaped MoE decoder: {cfg.layers} layers, hidden {cfg.hidden}, "
          f"{cfg.experts} experts top-{cfg.topk}, vocab {cfg.vocab}, batch {cfg.batch} x seq "
          f"{cfg.seq}"
          + (f" x {cfg.micro_batches} micro-batches per optimizer step (linghe modes: "
             f"fused expert gradient accumulation "
             f"{'on' if fused_grad_accumulation() else 'off'}, deferred expert wgrad "
             f"{'on' if cfg.deferred_wgrad else 'off'}, deferred FP8 head wgrad "
             f"{'on' if cfg.deferred_wgrad and cfg.deferred_head_wgrad else 'off'})"
             if cfg.micro_batches > 1 else "")
          + f"; {total_params(cfg) / 1e9:.2f} B parameters; "
          f"{f['total'] / 1e12:.1f} model TFLOP per step (6 N_active tokens + causal "
          f"attention). MFU against the dense bf16 peak (989 TFLOP/s on H100/H200) for every "
          f"mode; the FP8 mode also against the FP8 peak (1979). Every mode uses the "
          f"AdamW of its library (torch: fused AdamW + clip_grad_norm_; linghe: "
          f"linghe.optim.AdamW with fused clipping, unless --optimizer torch) and sets "
          f"gradients to None before backward.",
          file=file)
    _print_rows(head, lines, file)
    clk = [(r, r.get("clocks")) for r in rows if not r["error"] and r.get("clocks")]
    if clk:
        print("GPU during the timed steps (nvidia-smi every 100 ms): " + "; ".join(
            f"{_label(r)} SM {c['sm_mhz']:.0f} MHz (min {c['sm_mhz_min']:.0f}), memory "
            f"{c['mem_mhz']:.0f} MHz, {c['power_w']:.0f} W (max {c['power_w_max']:.0f}), "
            f"max {c['temp_c_max']:.0f} C" for r, c in clk), file=file)
    canaries = [r for r in rows if not r["error"] and r.get("host_canary_ms")]
    if canaries:
        print("Host canary (a fixed pure-Python loop, ~1 ms on a fast core; a slow one "
              "means a slow host CPU, not linghe) before/after the timed steps: "
              + "; ".join(f"{_label(r)} " + "/".join(f"{c:.2f}" for c in r["host_canary_ms"])
                          + " ms" for r in canaries), file=file)
    loads = [r for r in rows if not r["error"] and r.get("routing_load")]
    if loads:
        print("Expert loads after the timed steps (busiest expert / mean, worst layer; "
              "empty experts per layer): " + "; ".join(
                  f"{_label(r)} {r['routing_load']['max_over_mean']:.1f}x "
                  f"({r['routing_load']['max_over_mean_worst']:.1f}x), "
                  f"{r['routing_load']['empty_experts']:.0f} empty"
                  + (" (random routing)" if r.get("balanced_routing") else "")
                  for r in loads), file=file)
    print_targets(targets(rows, loss_gap), file)
    print_gemm_bound(gemm_bound(rows, cfg), file)


def _target(value: float, target: str, met: bool) -> dict:
    return {"value": value, "target": target, "met": met}


#: Issue 10's FP8 step target: FP8 at least this many times faster than bf16.
FP8_SPEEDUP_TARGET = 1.3


def targets(rows, loss_gap: float | None = None) -> dict:
    """The issue's targets, where the rows allow them: bf16 vs torch step >= 1.5x, FP8 vs
    bf16 step >= 1.3x, eager wall / GPU-busy <= 1.15, and (``loss_gap``, the relative
    final-loss gap of FP8 against bf16 from the loss-curve job) |gap| <= 1%."""
    ms = {(r["mode"], r["cuda_graph"]): r for r in rows if not r["error"]}
    out = {}
    if ("torch", False) in ms and ("bf16", False) in ms:
        v = ms["torch", False]["step_ms"] / ms["bf16", False]["step_ms"]
        out["bf16 vs torch speedup"] = _target(v, ">= 1.5", v >= 1.5)
    for g in (False, True):
        if ("bf16", g) in ms and ("fp8", g) in ms:
            v = ms["bf16", g]["step_ms"] / ms["fp8", g]["step_ms"]
            k = "fp8 vs bf16 speedup" + (" (graphs)" if g else "")
            out[k] = _target(v, f">= {FP8_SPEEDUP_TARGET}", v >= FP8_SPEEDUP_TARGET)
    for m in ("bf16", "fp8"):
        r = ms.get((m, False))
        if r and r.get("busy_ms"):
            v = r["step_ms"] / r["busy_ms"]
            out[f"{m} eager wall/busy"] = _target(v, "<= 1.15", v <= 1.15)
    if loss_gap is not None:
        out["fp8 vs bf16 final loss gap"] = _target(loss_gap, "|gap| <= 0.01",
                                                    abs(loss_gap) <= 0.01)
    return out


def print_targets(t: dict, file=None) -> None:
    if t:
        print("targets (issue 10): " + "; ".join(
            f"{k} {v['value']:.{4 if 'gap' in k else 2}f} "
            f"({'met' if v['met'] else 'not met'}: {v['target']})"
            for k, v in t.items()), file=file)


def lm_head_share(cfg: E2EConfig) -> float:
    """The LM head's share of the ``gemm`` family's FLOPs (the dense GEMMs: attention
    projections, shared experts, LM head; the routed experts are ``grouped_gemm``)."""
    H, I = cfg.hidden, cfg.moe_intermediate
    lm = cfg.vocab * H
    attn = H * (cfg.qkv_width + cfg.attn_width) + cfg.attn_width * H
    layers = cfg.layers * (attn + cfg.shared_experts * 3 * H * I)
    return lm / (lm + layers)


def gemm_bound(rows, cfg: E2EConfig | None = None) -> dict:
    """Amdahl's bound on what FP8 GEMMs can give over bf16, per bf16 row with a profile:
    the GEMM families' GPU time (``gemm`` + ``grouped_gemm``) taken out of the step. With
    every GEMM at 0 ms, no GEMM speedup makes the step faster than ``step / (step -
    gemm)``. A realistic bound: FP8 GEMMs at twice the bf16 GEMMs' throughput (the ratio
    of the tensor-core peaks) plus the quantization time of the FP8 row of the same kind
    (eager or graph), ``step / (step - gemm / 2 + quantize)``.

    With ``cfg``, also the bound for what FP8 recipes actually quantize: the LM head stays
    bf16 (its time is estimated as :func:`lm_head_share` of the ``gemm`` family, i.e. at
    the family's average throughput), so only the other GEMMs (``fp8_gemm_ms``) can get
    faster: ``step / (step - fp8_gemm)`` with them free, ``step / (step - fp8_gemm / 2 +
    quantize)`` at the 2x peak ratio.

    With the FP8 row's profile, on GPU-busy time: how fast its GEMMs run against bf16's
    (``fp8_gemm_ratio``), and how fast they would have to run for the FP8 step to take
    1/1.3 of bf16's with its other GPU work as measured (``fp8_gemm_ratio_needed``; None
    when that other work alone is longer)."""
    ms = {(r["mode"], r["cuda_graph"]): r for r in rows if not r["error"]}
    out = {}
    for (mode, g), r in ms.items():
        fam = r.get("families_ms")
        if mode != "bf16" or not fam:
            continue
        step, gemm = r["step_ms"], fam["gemm"] + fam["grouped_gemm"]
        fp8 = ms.get(("fp8", g), {}).get("families_ms")
        q = fp8["quantize"] if fp8 else 0.0
        half = step - gemm / 2 + q
        b = out[_label(r)] = {
            "step_ms": step, "gemm_ms": gemm, "step_without_gemm_ms": step - gemm,
            "max_speedup_gemms_free": step / (step - gemm) if step > gemm else None,
            "fp8_quantize_ms": q if fp8 else None, "step_fp8_gemms_2x_ms": half,
            "max_speedup_fp8_gemms_2x": step / half if half > 0 else None}
        fr = ms.get(("fp8", g), {})
        if fp8 and r.get("busy_ms") and fr.get("busy_ms"):
            g8 = fp8["gemm"] + fp8["grouped_gemm"]
            other8 = fr["busy_ms"] - g8
            allowed = r["busy_ms"] / FP8_SPEEDUP_TARGET - other8
            b.update(fp8_gemm_ms_now=g8, fp8_other_ms=other8,
                     bf16_other_ms=r["busy_ms"] - gemm,
                     fp8_gemm_ratio=gemm / g8 if g8 > 0 else None,
                     fp8_gemm_ratio_needed=gemm / allowed if allowed > 0 else None)
        if cfg is not None:
            lm = fam["gemm"] * lm_head_share(cfg)
            f8 = gemm - lm
            half8 = step - f8 / 2 + q
            b.update(lm_head_ms=lm, fp8_gemm_ms=f8,
                     max_speedup_fp8_gemms_free=step / (step - f8) if step > f8 else None,
                     max_speedup_fp8_gemms_2x_lm_bf16=step / half8 if half8 > 0 else None)
    return out


def print_gemm_bound(bounds: dict, file=None) -> None:
    for label, b in bounds.items():
        q = ("" if b["fp8_quantize_ms"] is None else
             f" plus the FP8 row's quantization ({b['fp8_quantize_ms']:.1f} ms)")
        print(f"GEMM bound ({label} row): GEMMs (gemm + grouped_gemm) take "
              f"{b['gemm_ms']:.1f} of {b['step_ms']:.1f} ms; with every GEMM at 0 ms the "
              f"step is {b['step_without_gemm_ms']:.1f} ms, so faster GEMMs give at most "
              f"{fmt(b['max_speedup_gemms_free'], '.2f')}x over bf16; with FP8 GEMMs at 2x "
              f"the bf16 GEMM throughput{q}: {b['step_fp8_gemms_2x_ms']:.1f} ms, "
              f"{fmt(b['max_speedup_fp8_gemms_2x'], '.2f')}x.", file=file)
        if "fp8_gemm_ratio" in b:
            print(f"  FP8 row (GPU-busy): its GEMMs take {b['fp8_gemm_ms_now']:.1f} ms, "
                  f"{fmt(b['fp8_gemm_ratio'], '.2f')}x faster than bf16's; its other GPU "
                  f"work {b['fp8_other_ms']:.1f} ms (bf16 {b['bf16_other_ms']:.1f}); for "
                  f"{FP8_SPEEDUP_TARGET}x bf16's busy time its GEMMs would have to run "
                  f"{fmt(b['fp8_gemm_ratio_needed'], '.2f')}x bf16's.", file=file)
        if "fp8_gemm_ms" in b:
            print(f"  with the LM head in bf16 (as FP8 recipes keep it; ~{b['lm_head_ms']:.1f}"
                  f" ms by its FLOP share): the FP8-eligible GEMMs take "
                  f"{b['fp8_gemm_ms']:.1f} ms, so FP8 gives at most "
                  f"{fmt(b['max_speedup_fp8_gemms_free'], '.2f')}x with them free and "
                  f"{fmt(b['max_speedup_fp8_gemms_2x_lm_bf16'], '.2f')}x at 2x.", file=file)


def _short(name: str, width: int = 150) -> str:
    """A kernel name cut in the middle: its start and its end (where a template's functor
    is named) stay readable."""
    if len(name) <= width:
        return name
    h = (width - 5) // 2
    return f"{name[:h]} ... {name[-h:]}"


def print_top_kernels(rows, n: int, file=None) -> None:
    for r in rows:
        if r["error"] or not r.get("top_kernels") or n <= 0:
            continue
        print(f"\ntop kernels, {_label(r)} (GPU ms per step, calls per step):", file=file)
        for k in r["top_kernels"][:n]:
            print(f"  {k['ms']:8.2f} {k['calls']:7.1f}  {k['family']:<20} "
                  f"{_short(k['name'])}", file=file)
        if r.get("top_gaps"):
            print(f"GPU idle between kernels, {_label(r)}: {r['idle_ms']:.2f} ms a step; "
                  "longest gaps (us, after -> before):", file=file)
            for g in r["top_gaps"][:5]:
                print(f"  {g['us']:8.1f}  {_short(g['after'], 50)} -> "
                      f"{_short(g['before'], 50)}", file=file)


def environment() -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return {"device": torch.cuda.get_device_name() if dev == "cuda" else
            f"cpu ({platform.processor() or platform.machine()}), TRITON_INTERPRET=1",
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "host": platform.node()}


# ======================================================================================
# jobs
# ======================================================================================


def throughput_job(args, cfg: E2EConfig, device) -> dict:
    modes = args.mode
    steps_total = args.warmup + args.steps + args.profile_steps + 1
    data = stdlib_corpus(corpus_bytes_needed(cfg, steps_total * cfg.micro_batches))
    rows = []
    clocks = GpuClockLog() if torch.device(device).type == "cuda" else None
    for mode in modes:
        print(f"[e2e] {mode}: {cfg.layers} layers ...", flush=True)
        rows.append(measure(cfg, mode, device=device, graph=False, steps=args.steps,
                            warmup=args.warmup, prof_steps=args.profile_steps, data=data,
                            seed=args.seed, lr=args.lr, optimizer=args.optimizer,
                            clocks=clocks, balance=args.balance_routing))
    if args.cuda_graph:
        for mode in modes:
            if mode == "torch":
                continue  # data-dependent shapes and host syncs: not capturable
            print(f"[e2e] {mode} + CUDA graph ...", flush=True)
            rows.append(measure(cfg, mode, device=device, graph=True, steps=args.steps,
                                warmup=args.warmup, prof_steps=args.profile_steps,
                                data=data, seed=args.seed, lr=args.lr,
                                optimizer=args.optimizer, clocks=clocks,
                                balance=args.balance_routing))
    if clocks is not None:
        clocks.close()
    loss_gap = None
    if args.loss_json:
        with open(args.loss_json) as fh:
            loss_gap = json.load(fh).get("fp8_vs_bf16_rel_gap")
    print_top_kernels(rows, args.top_kernels)
    print_breakdown(rows)
    print_table(rows, cfg, loss_gap=loss_gap)
    return {"job": "throughput", "config": cfg.as_dict(), "flops_per_step": step_flops(cfg),
            "params": total_params(cfg), "peak_tflops": dict(zip(
                ("bf16", "fp8"), peak_tflops(device))), "rows": rows,
            "targets": targets(rows, loss_gap), "gemm_bound": gemm_bound(rows, cfg),
            "loss_json": args.loss_json, "corpus_bytes": len(data), "lr": args.lr,
            "balance_routing": args.balance_routing}


@contextlib.contextmanager
def deterministic_kernels():
    """PyTorch's deterministic kernels where it has them (the flash-attention backward),
    a warning where it has none (linghe's embedding backward is deterministic itself);
    uninitialised memory is left as it is (filling it would add a kernel per allocation).
    linghe's kernels accumulate in a fixed order (their only atomics are integer counts
    and tickets). Within one process the same run then gives the same curve bit for bit;
    across processes Triton's autotuner may pick another tile (another summation order)."""
    prev = (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = prev[2]


def copy_batch(cfg: E2EConfig, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An in-context copying (induction) probe: ``batch`` sequences of random printable
    bytes ``r`` (``seq // 2`` of them, fixed by ``seed``) written twice, ``[r, r]``, with
    labels only where the next byte is a repeat (the second copy's bytes after its first):
    a model that has learned to copy from its context (induction heads: two attention
    layers) predicts them almost exactly, one that has not pays about ln(95) = 4.6 nats.
    Its loss moves by several nats when the copying circuit forms, so it shows whether
    two runs differ in that (a phase change whose timing is sensitive to any
    perturbation) or in the rest of the model."""
    g = torch.Generator().manual_seed(seed)
    L = cfg.seq // 2
    r = torch.randint(32, 127, (cfg.batch, L), generator=g)
    tokens = torch.full((cfg.batch, cfg.seq), 32, dtype=torch.long)
    tokens[:, :L] = r
    tokens[:, L:2 * L] = r
    labels = torch.full_like(tokens, -100)
    labels[:, L:2 * L - 1] = tokens[:, L + 1:2 * L]
    return tokens.to(device), labels.to(device)


@torch.no_grad()
def evaluate(model, mode: str, batches: list) -> float:
    """Mean loss of ``model`` over ``batches`` (``[(tokens, labels), ...]``) in ``mode``'s
    forward (under its TrainingContext), without gradients. A host sync."""
    with e2e_model.fp8_context(mode):
        losses = [model(tok, lab, mode)[0].float() for tok, lab in batches]
    return float(torch.stack(losses).mean())


def train_curve(cfg: E2EConfig, mode: str, data: bytes, *, steps: int, lr: float, seed: int,
                device, graph: bool = False, optimizer: str = "auto",
                eval_batches: list | None = None, eval_every: int = 0,
                copy: tuple | None = None) -> tuple[list[float], dict]:
    """The losses of ``steps`` training steps of ``mode`` from the seeded initialisation
    (warmup + cosine learning rate), and ``{"first_step_s", "rest_s"}`` (the first step
    includes Triton's compiles; evaluation time left out) plus, with ``eval_batches``
    (held-out ``(tokens, labels)``, the same for every mode), ``"eval"``: the steps
    evaluated (every ``eval_every`` steps, 0: only after the last), the held-out loss in
    the mode's own forward (``heldout``) and in the bf16 forward (``heldout_bf16_fwd``,
    for the fp8 mode: its weights without the FP8 forward's noise) and, with ``copy``
    (:func:`copy_batch`), the copying probe's loss."""
    model = build_model(cfg, device=device, seed=seed)
    opt = make_optimizer(model, lr_at(0, steps, lr), mode=mode, capturable=graph,
                         lr_tensor=graph, optimizer=optimizer)
    batches = ByteBatches(data, cfg.batch, cfg.seq, device)
    if graph:
        # The capture's warm-up steps run at learning rate 0, so the weights keep the
        # common initialisation (and the FP8 copies the captured forwards read stay
        # theirs: resetting the weights after the capture would leave the graphs on
        # stale copies); the expert biases and the optimizer state are reset.
        set_lr(opt, 0.0)
        init = {k: v.detach().clone() for k, v in model.named_buffers()}
        step = make_stepper(model, opt, batches, mode, graph=True, warmup=2)
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(init[k])
        for st in opt.state.values():
            for v in st.values():
                v.zero_()  # moments and the step count back to a fresh optimizer
        del init
    else:
        step = make_stepper(model, opt, batches, mode, graph=False, warmup=0)
    ev = None
    if eval_batches:
        ev = {"steps": [], "heldout": []}
        if mode == "fp8":
            ev["heldout_bf16_fwd"] = []
        if copy is not None:
            ev["copy"] = []
    eval_s = 0.0

    def run_eval(m, done: int) -> None:
        nonlocal eval_s
        t = time.perf_counter()
        ev["steps"].append(done)
        ev["heldout"].append(evaluate(m, mode, eval_batches))
        if "heldout_bf16_fwd" in ev:
            ev["heldout_bf16_fwd"].append(evaluate(m, "bf16", eval_batches))
        if "copy" in ev:
            ev["copy"].append(evaluate(m, mode, [copy]))
        eval_s += time.perf_counter() - t

    losses = []
    t0 = time.perf_counter()
    first = None
    for i in range(steps):
        set_lr(opt, lr_at(i, steps, lr))
        losses.append(step(i))
        if i == 0:
            _sync(device)
            first = time.perf_counter() - t0
        if (i + 1) % max(1, steps // 5) == 0:
            print(f"  step {i + 1}: loss {losses[-1].item():.4f}", flush=True)
        if ev is not None and (i + 1 == steps or (eval_every and (i + 1) % eval_every == 0)):
            run_eval(model, i + 1)
    curve = torch.stack(losses).float().cpu().tolist()
    _sync(device)
    rest = time.perf_counter() - t0 - first - eval_s
    del model, opt, step
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    info = {"first_step_s": first, "rest_s": rest}
    if ev is not None:
        info["eval"] = ev
    return curve, info


def _write_curves_csv(path: str, curves: dict, steps: int) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step"] + [f"loss_{m}" for m in curves])
        for i in range(steps):
            w.writerow([i] + [f"{curves[m][i]:.6f}" for m in curves])
    print(f"wrote {path}")


def heldout_batches(cfg: E2EConfig, data: bytes, steps: int, n: int, device) -> list:
    """``n`` batches of the windows after the ``steps`` training batches (never trained
    on; ``data`` must hold ``corpus_bytes_needed(cfg, steps + n)`` bytes)."""
    bb = ByteBatches(data, cfg.batch, cfg.seq, device)
    return [bb(steps + j) for j in range(n)]


def _rel(a, b):
    return None if a is None or b is None else (a - b) / b


def loss_curve_job(args, cfg: E2EConfig, device) -> dict:
    """Loss curves of every mode for ``args.seeds`` seeds (``args.seed``, ``+1``, ...):
    one CSV per seed (the first seed's is ``e2e_loss_<width>.csv`` and is plotted), the
    FP8-vs-bf16 final-loss gap per seed and its mean (the target is read on the mean: one
    run's gap moves by several percent with the seed, see :func:`gap_over_seeds`).

    Beside it, to read that gap against the noise: the bf16-vs-torch gap (two runs of
    the same math that differ only in rounding: the spread a perturbation alone gives
    after ``N`` steps), and with ``--eval-batches`` the held-out loss (batches after the
    training windows, the same for every mode and seed) every ``--eval-every`` steps and
    at the end, the fp8 mode's also in the bf16 forward, and an in-context copying
    probe (:func:`copy_batch`); their gaps over seeds; ``e2e_eval_<width>.csv``."""
    steps = args.train_steps
    n_eval = args.eval_batches
    data = stdlib_corpus(corpus_bytes_needed(cfg, steps + n_eval))
    held = heldout_batches(cfg, data, steps, n_eval, device) if n_eval else None
    copy = copy_batch(cfg, device) if n_eval else None
    seeds = [args.seed + k for k in range(args.seeds)]
    runs, times, evals = {}, {}, {}
    with deterministic_kernels():
        for seed in seeds:
            curves = runs[seed] = {}
            for mode in args.mode:
                print(f"[e2e] loss curve {mode}, seed {seed}: {steps} steps ...", flush=True)
                curves[mode], tm = train_curve(
                    cfg, mode, data, steps=steps, lr=args.lr, seed=seed, device=device,
                    graph=args.cuda_graph and mode != "torch", optimizer=args.optimizer,
                    eval_batches=held, eval_every=args.eval_every, copy=copy)
                ev = tm.pop("eval", None)
                if ev is not None:
                    evals.setdefault(seed, {})[mode] = ev
                    print(f"  {mode}: held-out loss {ev['heldout'][-1]:.4f}" +
                          (f" (bf16 forward {ev['heldout_bf16_fwd'][-1]:.4f})"
                           if "heldout_bf16_fwd" in ev else "") +
                          (f", copy probe {ev['copy'][-1]:.4f}" if "copy" in ev else ""),
                          flush=True)
                times.setdefault(mode, tm)
                print(f"  {mode}: first step {tm['first_step_s']:.1f} s (compiles), then "
                      f"{1e3 * tm['rest_s'] / max(1, steps - 1):.1f} ms per step", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"e2e_loss_{args.width}")
    for seed in seeds:
        _write_curves_csv(stem + (".csv" if seed == seeds[0] else f"_seed{seed}.csv"),
                          runs[seed], steps)
    curves = runs[seeds[0]]
    plot = write_plot(curves, stem + ".png", _plot_title(cfg, args.width))
    summaries = {seed: summarize_curves(runs[seed]) for seed in seeds}
    summary = summaries[seeds[0]]
    over = gap_over_seeds([summaries[s]["fp8_vs_bf16_rel_gap"] for s in seeds])
    floor = gap_over_seeds([summaries[s]["bf16_vs_torch_rel_gap"] for s in seeds])
    if len(seeds) > 1 and over["mean"] is not None:
        print(f"FP8 vs bf16 over seeds {seeds}: mean {100 * over['mean']:+.2f}% (standard "
              f"error {100 * over['stderr']:.2f}%), per seed " +
              ", ".join(f"{100 * g:+.2f}%" for g in over["per_seed"]))
    if len(seeds) > 1 and floor["mean"] is not None:
        print(f"noise floor, bf16 vs torch over seeds: mean {100 * floor['mean']:+.2f}% "
              f"(standard error {100 * floor['stderr']:.2f}%, rms {100 * floor['rms']:.2f}%)"
              ", per seed " + ", ".join(f"{100 * g:+.2f}%" for g in floor["per_seed"]))
    eval_summary = summarize_evals(evals, seeds) if evals else None
    if evals:
        _write_eval_csv(os.path.join(args.out_dir, f"e2e_eval_{args.width}.csv"), evals)
    t = targets([], over["mean"])
    print_targets(t)
    out = {"job": "loss_curve", "config": cfg.as_dict(), "steps": steps, "lr": args.lr,
           "seeds": seeds, "curves": curves, **summary,
           "fp8_vs_bf16_rel_gap_first_seed": summary["fp8_vs_bf16_rel_gap"],
           "fp8_vs_bf16_rel_gap": over["mean"], "fp8_vs_bf16_gap_over_seeds": over,
           "bf16_vs_torch_gap_over_seeds": floor,
           "curves_per_seed": {str(s): runs[s] for s in seeds[1:]}, "targets": t,
           "seconds": times, "csv": stem + ".csv", "png": plot, "corpus_bytes": len(data)}
    if evals:
        out.update(eval_batches=n_eval, eval_every=args.eval_every,
                   eval={str(s): evals[s] for s in seeds}, eval_summary=eval_summary)
    return out


def summarize_evals(evals: dict, seeds: list) -> dict:
    """Final held-out (and copy-probe) losses: per seed and mode, and the gaps fp8 vs
    bf16 and bf16 vs torch over seeds; printed."""
    final = {s: {m: {k: v[-1] for k, v in ev.items() if k != "steps"}
                 for m, ev in evals[s].items()} for s in seeds}
    out = {"final": {str(s): final[s] for s in seeds}}
    lines = []
    for key in ("heldout", "copy"):
        for name, a, b, ka in (("fp8_vs_bf16", "fp8", "bf16", key),
                               ("fp8_bf16fwd_vs_bf16", "fp8", "bf16", "heldout_bf16_fwd"),
                               ("bf16_vs_torch", "bf16", "torch", key)):
            if key == "copy" and ka != key:
                continue
            gaps = [_rel(final[s].get(a, {}).get(ka), final[s].get(b, {}).get(key))
                    for s in seeds]
            if all(g is None for g in gaps):
                continue
            g = out[f"{key}_{name}"] = gap_over_seeds(gaps)
            lines.append(f"  {key} {name}: mean {100 * g['mean']:+.2f}% (s.e. "
                         f"{100 * g['stderr']:.2f}%), per seed " +
                         ", ".join("-" if x is None else f"{100 * x:+.2f}%"
                                   for x in g["per_seed"]))
    print("held-out evaluation after the last step (mean over seeds):")
    for m in final[seeds[0]]:
        vals = [final[s][m]["heldout"] for s in seeds if m in final[s]]
        cp = [final[s][m]["copy"] for s in seeds if m in final[s] and "copy" in final[s][m]]
        print(f"  {m}: held-out {sum(vals) / len(vals):.4f}" +
              (f", copy probe {sum(cp) / len(cp):.4f}" if cp else ""))
    for ln in lines:
        print(ln)
    return out


def _write_eval_csv(path: str, evals: dict) -> None:
    keys = ("heldout", "heldout_bf16_fwd", "copy")
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["seed", "mode", "step", *keys])
        for seed, by_mode in evals.items():
            for mode, ev in by_mode.items():
                for j, st in enumerate(ev["steps"]):
                    w.writerow([seed, mode, st] + [f"{ev[k][j]:.6f}" if k in ev else ""
                                                   for k in keys])
    print(f"wrote {path}")


def gap_over_seeds(gaps: list) -> dict:
    """Mean and standard error of the per-seed FP8-vs-bf16 gaps (None entries skipped).
    Why several seeds: the two modes' trajectories drift apart chaotically (FP8 rounding
    flips with any perturbation), so one 300-step run's gap at the small width was seen
    anywhere between -5.5% and +4.5% on an H100 (seeds 0 and 1, two AdamW
    implementations), while bf16 against bf16 with another optimizer moved 0.2%."""
    g = [x for x in gaps if x is not None]
    if not g:
        return {"per_seed": gaps, "mean": None, "stderr": None, "rms": None}
    mean = sum(g) / len(g)
    var = sum((x - mean) ** 2 for x in g) / (len(g) - 1) if len(g) > 1 else 0.0
    return {"per_seed": gaps, "mean": mean, "stderr": math.sqrt(var / len(g)),
            "rms": math.sqrt(sum(x * x for x in g) / len(g))}


def summarize_curves(curves: dict, window: int = 20) -> dict:
    """Final loss per mode (mean of the last ``window`` steps) and the relative gap of FP8
    against bf16; printed."""
    n = min(window, min(len(c) for c in curves.values()))
    final = {m: sum(c[-n:]) / n for m, c in curves.items()}
    gap = _rel(final.get("fp8"), final.get("bf16"))
    floor = _rel(final.get("bf16"), final.get("torch"))
    print(f"\nfinal loss (mean of the last {n} steps): " +
          ", ".join(f"{m} {v:.4f}" for m, v in final.items()) +
          ("" if gap is None else f"; FP8 vs bf16 {100 * gap:+.2f}% (target within 1%)") +
          ("" if floor is None else f"; bf16 vs torch {100 * floor:+.2f}% (noise floor)"))
    return {"final_mean_last": final, "final_window": n, "fp8_vs_bf16_rel_gap": gap,
            "bf16_vs_torch_rel_gap": floor}


def read_curves(path: str) -> dict:
    """The curves of a loss-curve CSV (``step, loss_<mode>...``)."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    modes = [h.removeprefix("loss_") for h in rows[0][1:]]
    return {m: [float(r[j + 1]) for r in rows[1:]] for j, m in enumerate(modes)}


def _plot_title(cfg: E2EConfig, width: str) -> str:
    return (f"e2e decoder, width {width}: hidden {cfg.hidden}, {cfg.layers} layers, "
            f"{cfg.experts} experts top-{cfg.topk}; stdlib bytes")


def write_plot(curves: dict, path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m, c in curves.items():
        ax.plot(range(len(c)), c, label=m, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


# ======================================================================================
# command line
# ======================================================================================


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmark.e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default=None,
                   help="decoder layers, or 'auto' (as many as fit the GPU's memory by "
                        "estimate_layers); default 4 (the width's preset off the GPU)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per mode (default 10; 2 on the CPU interpreter)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 3; 1 on the CPU interpreter)")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps profiled for GPU-busy time and the op breakdown (0: none)")
    p.add_argument("--mode", default=",".join(MODES),
                   help="comma-separated subset of torch,bf16,fp8")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also capture the linghe modes' whole step in a CUDA graph")
    p.add_argument("--train-steps", type=int, default=0,
                   help="run the loss-curve job for this many steps instead")
    p.add_argument("--width", default=None,
                   help="preset: ling-mini (throughput default on GPU), small (loss-curve "
                        "default), tiny (CPU default)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per layer (default: the preset's, 256 for "
                        "ling-mini); e.g. 32, the experts one GPU holds at expert "
                        "parallelism 8, each seeing 8x the rows: an EP-8 step's expert "
                        "GEMMs on one GPU, without its all-to-all")
    p.add_argument("--balance-routing", action=argparse.BooleanOptionalAction, default=True,
                   help="throughput runs: route by random logits (linghe.nn.MoE."
                        "force_balanced_routing, as Megatron-LM's benchmark option), so "
                        "every expert gets ~T*topk/E rows as in balanced real training; "
                        "--no-balance-routing: the fresh model's own routing, which sends "
                        "most tokens to a few experts (every run before 2026-11-26's third "
                        "session)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="forward+backward passes per optimizer step, gradients accumulated "
                        "(throughput runs, eager and --cuda-graph; default 1, the issue's "
                        "configuration)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default 1e-3; 2e-3 for the loss curves)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="loss-curve job: train every mode from this many seeds (--seed, "
                        "+1, ...) and read the FP8 loss gap on their mean")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="loss-curve job: held-out batches (after the training windows) "
                        "evaluated in every mode, plus the copying probe (0: none)")
    p.add_argument("--eval-every", type=int, default=50,
                   help="loss-curve job: evaluate every this many steps too (0: only after "
                        "the last)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot-csv", default=None,
                   help="only plot an existing loss-curve CSV (e.g. from a GPU machine "
                        "without matplotlib) next to it, and print the final-loss gap")
    p.add_argument("--out-dir", default=os.path.join("benchmark", "results"),
                   help="where the loss-curve CSV and PNG go")
    p.add_argument("--loss-json", default=None,
                   help="a loss-curve job's JSON: its FP8-vs-bf16 final-loss gap joins the "
                        "throughput job's targets")
    p.add_argument("--optimizer", choices=("auto", "torch"), default="auto",
                   help="auto: the linghe modes train with linghe.optim.AdamW (clipping "
                        "fused), the torch mode with PyTorch's fused AdamW; torch: every mode "
                        "with PyTorch's fused AdamW (the earlier setup)")
    p.add_argument("--fp8-wgrad", choices=("fp8", "bf16"), default="fp8",
                   help="the fp8 mode's dense layers' weight gradients: in FP8 (the "
                        "recipe's default) or in bf16 (TrainingContext(fp8_wgrad=False))")
    p.add_argument("--expert-fp8-wgrad", choices=("fp8", "bf16"), default="bf16",
                   help="the fp8 mode's MoE experts' weight gradients: in bf16 (the "
                        "recipe's default) or in FP8 (TrainingContext(expert_fp8_wgrad=True))")
    p.add_argument("--expert-fp8", choices=("fp8", "bf16"), default="fp8",
                   help="the fp8 mode's routed experts: FP8 (default) or bf16 with the dense "
                        "layers still FP8 (TrainingContext(expert_fp8=False))")
    p.add_argument("--lm-head-fp8", action=argparse.BooleanOptionalAction, default=False,
                   help="the fp8 mode's LM head: logits and hidden-gradient GEMMs in FP8 "
                        "(TrainingContext(lm_head_fp8=True); default bf16)")
    p.add_argument("--norm-from-backward", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="linghe modes, eager: the clipping norm takes the MoE experts' "
                        "gradient norms from their wgrad kernels "
                        "(linghe.optim.AdamW(norm_from_backward=True))")
    p.add_argument("--fused-grad-accumulation", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="linghe modes: expert weight gradients added into the existing "
                        ".grad by the wgrad kernel (linghe.bwd.accumulate; matters with "
                        "--micro-batches > 1)")
    p.add_argument("--deferred-wgrad", action=argparse.BooleanOptionalAction, default=False,
                   help="linghe modes with --micro-batches > 1: the MoE experts' weight "
                        "gradients once per optimizer step over every micro-batch's rows "
                        "(linghe.nn.MoE(wgrad_micro_batches=...), linghe.bwd.deferred), "
                        "and with --lm-head-fp8 the head's FP8 weight gradient too "
                        "(linear_cross_entropy(wgrad_micro_batches=...))")
    p.add_argument("--deferred-head-wgrad", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="with --deferred-wgrad and --lm-head-fp8: defer the head's FP8 "
                        "weight gradient too (its stash: micro-batches x tokens x vocab "
                        "bytes, 5.2 GB at the Ling-mini shape with 4 micro-batches). "
                        "Default: on where the GPU has >= 100 GiB (the 4-layer FP8 step "
                        "with it does not fit an 80 GB H100)")
    p.add_argument("--top-kernels", type=int, default=10,
                   help="print the N longest kernels of each profiled row (0: none)")
    args = p.parse_args(argv)
    args.mode = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in args.mode if m not in MODES]
    if bad or not args.mode:
        p.error(f"--mode must be a comma-separated subset of {','.join(MODES)}, got {bad}")
    gpu = torch.cuda.is_available()
    if args.steps is None:
        args.steps = 10 if gpu else 2
    if args.warmup is None:
        args.warmup = 3 if gpu else 1
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.eval_batches < 0 or args.eval_every < 0:
        p.error("--eval-batches and --eval-every must be >= 0")
    return args


def config_from_args(args, device) -> E2EConfig:
    on_gpu = torch.device(device).type == "cuda"
    if args.width is None:
        args.width = ("small" if args.train_steps else "ling-mini") if on_gpu else "tiny"
    over = {k: v for k, v in (("seq", args.seq), ("batch", args.batch),
                              ("experts", args.experts)) if v is not None}
    cfg = preset(args.width, **over)
    if args.micro_batches < 1:
        raise SystemExit("--micro-batches must be >= 1")
    if args.micro_batches > 1:
        if args.train_steps:
            raise SystemExit("--micro-batches > 1 is for throughput runs (no "
                             "--train-steps)")
        head = args.deferred_head_wgrad
        if head is None:
            head = (not on_gpu or torch.cuda.get_device_properties(device).total_memory
                    >= 100 << 30)
        cfg = replace(cfg, micro_batches=args.micro_batches,
                      deferred_wgrad=bool(args.deferred_wgrad),
                      deferred_head_wgrad=bool(head))
    # (the micro-batch settings first: the layer estimate counts the deferred stash)
    if args.layers == "auto":
        mem = (torch.cuda.get_device_properties(device).total_memory if on_gpu else 8 << 30)
        n = estimate_layers(cfg, mem, args.mode)
        print(f"[e2e] --layers auto: {n} layers estimated to fit {mem / 2**30:.0f} GiB")
        cfg = replace(cfg, layers=n)
    elif args.layers is not None:
        cfg = replace(cfg, layers=int(args.layers))
    elif args.width == "ling-mini":
        cfg = replace(cfg, layers=4)
    if args.lr is None:
        args.lr = 2e-3 if args.train_steps else 1e-3
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_csv:
        curves = read_curves(args.plot_csv)
        summarize_curves(curves)
        stem = os.path.splitext(args.plot_csv)[0]
        write_plot(curves, stem + ".png", f"e2e decoder loss curves ({os.path.basename(stem)})")
        return 0
    if args.train_steps:
        # cuBLAS reproducible under deterministic_kernels (read when its workspace is
        # first made; must precede the first GEMM)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = config_from_args(args, device)
    e2e_model.FP8_WGRAD = args.fp8_wgrad == "fp8"
    e2e_model.EXPERT_FP8_WGRAD = args.expert_fp8_wgrad == "fp8"
    e2e_model.EXPERT_FP8 = args.expert_fp8 == "fp8"
    e2e_model.LM_HEAD_FP8 = bool(args.lm_head_fp8)
    e2e_model.NORM_FROM_BACKWARD = bool(args.norm_from_backward)
    set_fused_grad_accumulation(args.fused_grad_accumulation)
    env = environment()
    print(f"[e2e] {env['device']}; torch {env['torch']}, triton {env['triton']}")
    if args.train_steps:
        result = loss_curve_job(args, cfg, device)
    else:
        result = throughput_job(args, cfg, device)
    result.update(env=env, width=args.width, fp8_wgrad=args.fp8_wgrad,
                  expert_fp8_wgrad=args.expert_fp8_wgrad, expert_fp8=args.expert_fp8,
                  lm_head_fp8=bool(args.lm_head_fp8),
                  norm_from_backward=bool(args.norm_from_backward),
                  fused_grad_accumulation=args.fused_grad_accumulation,
                  argv=sys.argv[1:] if argv is None else argv)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.json}")
    failed = [r for r in result.get("rows", []) if r["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
