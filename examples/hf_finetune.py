"""Fine-tune a small randomly initialised Hugging Face model patched with linghe's kernels.

    python examples/hf_finetune.py                        # Qwen3-MoE; CPU: 15 steps
    python examples/hf_finetune.py --arch llama --steps 100 --save /tmp/tiny-llama
    python examples/hf_finetune.py --fp8 blockwise        # GPU with compute capability >= 8.9
    python examples/hf_finetune.py --compile reduce-overhead   # GPU: layers as CUDA graphs

The model is built from its config class (no download) by
``linghe.transformers.AutoLinghePatchedModelForCausalLM.from_config``: RMSNorm, RoPE,
SwiGLU, the MoE block and the loss (linear cross entropy, no ``[N, V]`` logits) run
linghe's kernels; the rest of the training loop is plain PyTorch + transformers. The task
is counting: each sequence starts at a random token and continues ``+stride mod V``, so
every next token is determined by the current one and the loss falls from ``ln V`` towards
0 within a few dozen steps. On CPU the kernels run through the Triton interpreter (slow:
a small model and few steps by default).

``--compile MODE`` compiles each decoder layer (``torch.compile`` mode ``default`` or
``reduce-overhead``; the patched layers trace without graph breaks). ``reduce-overhead``
replays each layer's forward and backward as CUDA graphs, which removes the host time that
bounds small models; a new step then starts with ``torch.compiler.cudagraph_mark_step_begin()``.
On CPU the layers compile with the ``aot_eager`` backend (the mode is ignored).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linghe.transformers import AutoLinghePatchedModelForCausalLM  # noqa: E402


def make_config(arch: str, vocab: int, hidden: int, layers: int):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden // 4, max_position_embeddings=512)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=hidden,
                                           num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    return cls(**common)


def batch(vocab: int, batch_size: int, seq: int, stride: int, device) -> torch.Tensor:
    start = torch.randint(0, vocab, (batch_size, 1), device=device)
    return (start + stride * torch.arange(seq, device=device)) % vocab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "llama", "qwen2",
                                                           "qwen3"))
    p.add_argument("--steps", type=int, default=None, help="default 15 (GPU: 200)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--fp8", default=None, choices=(None, "blockwise"))
    p.add_argument("--compile", default=None, choices=(None, "default", "reduce-overhead"),
                   help="torch.compile each decoder layer in this mode")
    p.add_argument("--save", default=None, help="save_pretrained the result here")
    args = p.parse_args()

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    # CPU: a tiny fp32 model (the interpreter is slow); GPU: a small bf16 one.
    vocab, hidden, layers, bsz, seq = (1000, 256, 2, 8, 256) if gpu else (61, 64, 1, 2, 16)
    dtype = torch.bfloat16 if gpu else torch.float32
    steps = args.steps or (200 if gpu else 15)
    torch.manual_seed(0)
    config = make_config(args.arch, vocab, hidden, layers)
    model = AutoLinghePatchedModelForCausalLM.from_config(config, dtype=dtype, fp8=args.fp8)
    model.to(device).train()
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters on {device}; patched: {model.linghe_patched}")
    if args.compile:
        for layer in model.model.layers:
            if gpu:
                layer.compile(mode=args.compile)
            else:
                layer.compile(backend="aot_eager")
    graphs = gpu and args.compile == "reduce-overhead"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    t0 = time.perf_counter()
    for step in range(steps):
        ids = batch(vocab, bsz, seq, stride=7, device=device)
        if graphs:  # the layers' CUDA graphs may overwrite the last step's buffers now
            torch.compiler.cudagraph_mark_step_begin()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if args.save:
        model.save_pretrained(args.save)
        print(f"saved to {args.save} (loads with transformers or "
              "AutoLinghePatchedModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    main()
