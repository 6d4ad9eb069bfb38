"""A Hugging Face fine-tuning step, unpatched vs patched by ``linghe.transformers``.

``python -m benchmark.hf_step [--steps N] [--json PATH] [--modes hf,linghe,linghe_fp8,...]
[--shape 1b|a3b] [--compile]``

Model: a Qwen3-MoE-shaped ``Qwen3MoeForCausalLM`` of about 1B parameters, random init
(hidden 1024, 8 layers, 16 query / 4 KV heads of 128 with q/k norms, 64 experts top-8 of
intermediate 384 with renormalized softmax routing, vocab 151936, untied LM head), or with
``--shape a3b`` four layers of Qwen3-30B-A3B's shape (hidden 2048, 32 query / 4 KV
heads, 128 experts top-8 of intermediate 768; about 3.1B parameters); bf16
parameters, sequence 2048 x batch 4 (8192 tokens per step), AdamW. One step = forward
with labels + backward + ``optimizer.step()`` + ``zero_grad``. Modes, each on the same
initial weights and data (the model is rebuilt from the same seed), each in a fresh
process on the GPU (``--in-process``: all in this one):

- ``hf``: plain transformers (its defaults: SDPA attention, ``torch._grouped_mm`` experts
  where available, logits materialized for the loss);
- ``linghe``: ``apply_linghe_kernels(model)``;
- ``linghe_fp8``: ``apply_linghe_kernels(model, fp8="blockwise")`` (GPU only: FP8 GEMMs
  need compute capability >= 8.9);
- ``linghe_fp8_head``: the same with ``lm_head_fp8=True`` (the loss's LM head GEMMs in FP8
  too; opt-in, not in the default set);
- ``linghe_fp8_head_bf16_experts``: the same with ``expert_fp8=False`` (the routed experts
  in bf16; not in the default set).

``--compile`` runs every mode with each decoder layer under ``torch.compile`` (inductor;
rows named ``<mode>+compile``): ``hf+compile`` is the baseline a user who compiles
compares with, and the patched layers trace without graph breaks.

Reported per mode: median step time over ``--steps`` timed steps (after ``--warmup``),
the GPU-busy time of one more step (on the GPU: ``torch.profiler``'s kernel time; a step
whose wall time is well above it is bound by host time), the time Python's cyclic garbage
collector ran per timed step (median/max; ``--gc-freeze`` takes the objects alive after
the warm-up out of its scans; the per-step log also times a fixed pure-Python loop before
each step, a canary of the host CPU's own speed), tokens/s, speedup over
``hf``, peak memory (``torch.cuda.max_memory_allocated`` over the build and the steps),
and the loss of the first step (same weights and batch in every
mode: a correctness check, ``loss diff`` relative to ``hf``) and of the last. The table is
printed last.

On CPU (no GPU) it runs a tiny config through the Triton interpreter (a smoke test;
timings are interpreter timings) with 2 steps and no FP8 mode by default.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    # No GPU: run the same Triton kernels through the interpreter (must precede import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from .harness import host_canary_ms  # noqa: E402

GPU_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 moe_intermediate_size=384, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                 batch=4, seq=2048)
#: Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads, 128 experts of
#: intermediate 768, top-8) with 4 of its 48 layers (``--shape a3b``).
A3B_SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 batch=4, seq=2048)
GPU_SHAPES = {"1b": GPU_SHAPE, "a3b": A3B_SHAPE}
CPU_SHAPE = dict(vocab_size=131, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, num_experts=6, num_experts_per_tok=2,
                 batch=2, seq=9)
MODES = ("hf", "linghe", "linghe_fp8", "linghe_fp8_head", "linghe_fp8_head_bf16_experts")
DEFAULT_GPU_MODES = ("hf", "linghe", "linghe_fp8")


def build(shape: dict, mode: str, device: str, dtype: torch.dtype, seed: int,
          micro_batches: int = 1):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**{k: v for k, v in shape.items() if k not in ("batch", "seq")},
                         norm_topk_prob=True, tie_word_embeddings=False,
                         max_position_embeddings=max(4096, shape["seq"]),
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if mode != "hf":
        from linghe.transformers import apply_linghe_kernels

        fp8 = mode.startswith("linghe_fp8")
        apply_linghe_kernels(model, fp8="blockwise" if fp8 else None,
                             lm_head_fp8=mode.startswith("linghe_fp8_head"),
                             expert_fp8=not mode.endswith("_bf16_experts"),
                             expert_wgrad_micro_batches=micro_batches)
    return model.train()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_mode(mode: str, shape: dict, args, device: str, dtype: torch.dtype) -> dict:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    n_mb = args.micro_batches
    model = build(shape, mode, device, dtype, args.seed, n_mb)
    n_params = sum(p.numel() for p in model.parameters())
    if args.compile:
        # As TorchTitan does: each decoder layer compiled (one graph serves every layer);
        # embedding, final norm and loss stay eager.
        for layer in model.model.layers:
            layer.compile(mode=args.compile_mode)
    graphs = args.compile and args.compile_mode in ("reduce-overhead",
                                                    "max-autotune")
    if args.optimizer == "linghe":
        import linghe

        opt = linghe.optim.AdamW(model.parameters(), lr=1e-5)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5,
                                **({"fused": True} if device == "cuda" else {}))
    g = torch.Generator().manual_seed(args.seed + 1)
    B, S, V = shape["batch"], shape["seq"], shape["vocab_size"]
    batches = [torch.randint(0, V, (B, S), generator=g).to(device)
               for _ in range(max(n_mb, min(4, args.warmup + args.steps)))]

    def step(i: int) -> torch.Tensor:
        """One optimizer step over ``n_mb`` micro-batches (gradient accumulation: the mean
        over them); returns the first micro-batch's loss."""
        for j in range(n_mb):
            if graphs:  # CUDA graphs of the compiled layers: a new iteration starts
                torch.compiler.cudagraph_mark_step_begin()
            ids = batches[(i * n_mb + j) % len(batches)]
            mb_loss = model(input_ids=ids, labels=ids).loss
            (mb_loss / n_mb if n_mb > 1 else mb_loss).backward()
            if j == 0:
                loss = mb_loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses, times, gc_ms, canary_ms = [], [], [], []
    gc_log = _GcLog()
    n_steps = args.warmup + args.steps
    for i in range(n_steps):
        if args.gc_freeze and i == args.warmup:
            gc.collect()
            gc.freeze()  # the model's objects out of every later collection's scan
        _sync(device)
        canary_ms.append(host_canary_ms())
        gc_log.reset()
        t0 = time.perf_counter()
        loss = step(i)
        _sync(device)
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if i >= args.warmup:
            times.append(dt)
            gc_ms.append(gc_log.ms)
        mallocs = (f", {torch.cuda.memory_stats().get('num_device_alloc', 0)} cudaMallocs so "
                   "far" if device == "cuda" else "")
        print(f"  {mode} step {i}: loss {losses[-1]:.4f}, {dt * 1e3:.1f} ms{mallocs}, "
              f"{gc_log}, host canary {canary_ms[-1]:.2f} ms", file=sys.stderr, flush=True)
    gc_log.close()
    if args.gc_freeze:
        gc.unfreeze()
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    busy = prof = None
    if device == "cuda":  # GPU time of one more step: the profiler's kernel sum
        from .e2e import profile_steps

        prof = profile_steps(step, n_steps, 1, top=25)
        busy = prof["busy_ms"]
    suffix = "" if not args.compile else (
        "+compile" if args.compile_mode == "default" else f"+compile({args.compile_mode})")
    row = dict(mode=mode + suffix, params=n_params,
               tokens_per_step=B * S * n_mb,
               step_ms=step_s * 1e3, tokens_per_s=B * S * n_mb / step_s,
               gpu_busy_ms=busy, gpu_families_ms=prof["families_ms"] if prof else None,
               top_kernels=prof["top_kernels"] if prof else None,
               peak_mem_gib=peak, first_loss=losses[0],
               last_loss=losses[-1], step_ms_all=[t * 1e3 for t in times],
               gc_ms_all=gc_ms, host_canary_ms_all=canary_ms[args.warmup:])
    return row


class _GcLog:
    """Python's cyclic garbage collections since :meth:`reset`: how many of each
    generation and their time (``gc.callbacks``), to tell collector pauses from other
    host stalls."""

    def __init__(self):
        self.ms, self.counts, self._t0 = 0.0, [0, 0, 0], None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.counts[info["generation"]] += 1
            self._t0 = None

    def reset(self) -> None:
        self.ms, self.counts = 0.0, [0, 0, 0]

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def __str__(self) -> str:
        return f"gc {self.ms:.1f} ms (collections by generation {self.counts})"


def print_families(rows: list[dict]) -> None:
    """GPU ms per step by op family (the profiled step's kernels), one column per mode:
    the e2e benchmark's table."""
    from .e2e import print_breakdown

    print_breakdown([dict(mode=r["mode"], families_ms=r["gpu_families_ms"],
                          busy_ms=r["gpu_busy_ms"]) for r in rows if r.get("gpu_families_ms")])
    print()


def print_table(rows: list[dict]) -> None:
    base = next((r for r in rows if r["mode"].split("+")[0] == "hf"), None)
    head = ["mode", "step ms", "GPU-busy ms", "gc ms", "tokens/s", "vs hf", "peak GiB",
            "first loss", "loss diff", "last loss"]
    lines = []
    for r in rows:
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        diff = (f"{abs(r['first_loss'] - base['first_loss']) / abs(base['first_loss']):.1e}"
                if base else "-")
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        busy = "-" if r.get("gpu_busy_ms") is None else f"{r['gpu_busy_ms']:.1f}"
        gc_ms = (f"{statistics.median(r['gc_ms_all']):.1f}/{max(r['gc_ms_all']):.1f}"
                 if r.get("gc_ms_all") else "-")
        lines.append([r["mode"], f"{r['step_ms']:.1f}", busy, gc_ms,
                      f"{r['tokens_per_s']:.0f}", vs,
                      mem, f"{r['first_loss']:.4f}", diff, f"{r['last_loss']:.4f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    print(fmt(head))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(fmt(line))


def _run_in_subprocess(mode: str, args) -> dict:
    """One mode in a fresh Python process (its row, from that process's JSON)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "benchmark.hf_step", "--modes", mode, "--json", out,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--seed", str(args.seed), "--shape", args.shape,
               "--micro-batches", str(args.micro_batches), "--optimizer", args.optimizer]
        if args.tiny:
            cmd.append("--tiny")
        if args.gc_freeze:
            cmd.append("--gc-freeze")
        if args.compile:
            cmd += ["--compile", "--compile-mode", args.compile_mode]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["rows"][0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.hf_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per mode (default 10 on GPU, 2 on CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 3 on GPU, 1 on CPU)")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated from {MODES} (default: "
                        f"{','.join(DEFAULT_GPU_MODES)} on GPU, hf,linghe on CPU)")
    p.add_argument("--json", default=None, help="write the rows and device facts here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="1b", choices=sorted(GPU_SHAPES),
                   help="GPU model shape: 1b (default, hidden 1024, 8 layers) or a3b "
                        "(Qwen3-30B-A3B's layers, 4 of them)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient accumulation: forward+backward passes per optimizer step "
                        "(the linghe modes defer the experts' weight gradients over them)")
    p.add_argument("--optimizer", default="torch", choices=("torch", "linghe"),
                   help="torch.optim.AdamW (fused on the GPU; default) or linghe.optim.AdamW "
                        "(which writes the FP8 weight copies in its update)")
    p.add_argument("--in-process", action="store_true",
                   help="run every mode in this process (default on the GPU: one fresh "
                        "process per mode, as a user runs one; a mode run after the "
                        "unpatched one measured up to 40%% slower in the same process)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (default inductor backend; the "
                        "warm-up steps include the compilation), in every mode")
    p.add_argument("--compile-mode", default="default",
                   choices=("default", "reduce-overhead", "max-autotune"),
                   help="torch.compile's mode with --compile (reduce-overhead: the compiled "
                        "layers replay as CUDA graphs)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after the warm-up steps: the objects alive then (the "
                        "model, the optimizer) leave the cyclic collector's scans")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny CPU config on any device (a smoke test)")
    args = p.parse_args(argv)

    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = device == "cpu"
    shape = CPU_SHAPE if cpu or args.tiny else GPU_SHAPES[args.shape]
    dtype = torch.float32 if cpu or args.tiny else torch.bfloat16
    args.steps = args.steps if args.steps is not None else (2 if cpu else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    modes = (args.modes or ("hf,linghe" if cpu else ",".join(DEFAULT_GPU_MODES))).split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or args.steps < 1 or args.warmup < 0 or args.micro_batches < 1:
        p.error(f"--modes must name {MODES}, --steps >= 1, --warmup >= 0, "
                "--micro-batches >= 1")
    dev_name = torch.cuda.get_device_name() if not cpu else platform.processor() or "cpu"
    if cpu:
        print("No GPU: tiny config through the Triton interpreter (smoke test; interpreter "
              "timings).", file=sys.stderr)
    print(f"device: {dev_name}; torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}; shape {shape}", file=sys.stderr)
    if cpu or args.in_process or len(modes) == 1:
        rows = [run_mode(m, shape, args, device, dtype) for m in modes]
    else:
        rows = [_run_in_subprocess(m, args) for m in modes]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "hf_step", "device": dev_name, "torch": torch.__version__,
                       "triton": triton.__version__, "transformers": transformers.__version__,
                       "interpreter": cpu, "dtype": str(dtype), "shape": shape,
                       "steps": args.steps, "warmup": args.warmup,
                       "micro_batches": args.micro_batches, "optimizer": args.optimizer,
                       "rows": rows}, f, indent=1)
    print(f"Qwen3-MoE-shaped model, {rows[0]['params'] / 1e6:.1f}M parameters, "
          f"{rows[0]['tokens_per_step']} tokens/step ({args.micro_batches} micro-batch(es)), "
          f"{dtype}, {args.optimizer} AdamW")
    print_families(rows)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
