"""Train a tiny decoder-only transformer in bf16 or FP8 on a fixed synthetic language.

    python examples/train_tiny_decoder.py --fp8 blockwise --steps 300
    python examples/train_tiny_decoder.py --compare --steps 300     # bf16 vs FP8 curves

The language is a fixed-seed Markov chain over a small vocabulary (each previous token, or
pair of tokens with ``--order 2``, allows only a few next tokens), so the loss has a known
floor, the chain's entropy ln(3), and falls quickly. Projections and the MLP are
``linghe.nn.Linear``, the MLP is ``linghe.nn.SwiGLU`` and the norms ``linghe.nn.RMSNorm``
(under the blockwise recipe the pre-projection norms and the SwiGLU activation emit FP8
directly: ``rms_norm_quant`` / ``silu_mul_quant`` fused, consumed by the FP8 GEMMs without
re-quantizing); attention is ``torch.nn.functional.scaled_dot_product_attention``;
the LM head stays in high precision (tied to the embedding or not). FP8 is turned on with
``linghe.TrainingContext(fp8=...)`` around forward and backward; nothing else changes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import linghe  # noqa: E402


def _rms_norm(dim: int, device, dtype):
    return linghe.nn.RMSNorm(dim, eps=1e-6, device=device, dtype=dtype)


class Block(torch.nn.Module):
    def __init__(self, dim, n_heads, ffn, device, dtype):
        super().__init__()
        L = lambda i, o: linghe.nn.Linear(i, o, bias=False, device=device, dtype=dtype)
        self.n_heads = n_heads
        self.norm1 = _rms_norm(dim, device, dtype)
        self.qkv = L(dim, 3 * dim)
        self.proj = L(dim, dim)
        self.norm2 = _rms_norm(dim, device, dtype)
        self.mlp = linghe.nn.SwiGLU(dim, ffn, device=device, dtype=dtype)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.n_heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(torch.nn.Module):
    def __init__(self, vocab, dim, n_layers, n_heads, ffn, seq_len, tie, device, dtype):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim, device=device, dtype=dtype)
        self.pos = torch.nn.Parameter(torch.randn(seq_len, dim, device=device, dtype=dtype)
                                      * 0.02)
        self.blocks = torch.nn.ModuleList(
            Block(dim, n_heads, ffn, device, dtype) for _ in range(n_layers))
        self.norm = _rms_norm(dim, device, dtype)
        self.norm.quantize_output = False  # it feeds the high-precision LM head
        # LM head in high precision: a plain torch Linear (or the tied embedding).
        self.head = None if tie else torch.nn.Linear(dim, vocab, bias=False, device=device,
                                                     dtype=dtype)

    def forward(self, tokens):
        T = tokens.shape[1]
        x = self.emb(tokens) + self.pos[:T]
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        w = self.emb.weight if self.head is None else self.head.weight
        return F.linear(x, w)  # plain torch: high precision inside a TrainingContext too


def build_model(*, vocab=256, dim=256, n_layers=2, n_heads=4, ffn=512, seq_len=64, tie=False,
                device="cpu", dtype=torch.bfloat16, seed=0) -> TinyDecoder:
    """The decoder with a fixed initialization (``seed``)."""
    with torch.random.fork_rng(devices=[]):  # built on the CPU, then moved
        torch.manual_seed(seed)
        model = TinyDecoder(vocab, dim, n_layers, n_heads, ffn, seq_len, tie, "cpu",
                            torch.float32)
        for name, p in model.named_parameters():
            if p.dim() == 2 and "pos" not in name:
                torch.nn.init.normal_(p, std=0.02 if "emb" in name else 1 / math.sqrt(p.shape[1]))
    return model.to(device=device, dtype=dtype)


class MarkovLanguage:
    """A fixed-seed Markov chain of order ``order`` (1 or 2): each context of the previous
    ``order`` tokens allows ``branch`` next tokens, uniformly. Loss floor: ln(branch)."""

    def __init__(self, vocab: int, branch: int = 3, order: int = 1, seed: int = 1234):
        if order not in (1, 2):
            raise ValueError(f"order must be 1 or 2, got {order}")
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.order = vocab, order
        self.next = torch.randint(0, vocab, (vocab,) * order + (branch,), generator=g)
        self.entropy = math.log(branch)

    def batch(self, batch: int, seq_len: int, step: int, device):
        g = torch.Generator().manual_seed(10_000 + step)
        toks = torch.empty(batch, seq_len + 1, dtype=torch.long)
        o = self.order
        toks[:, :o] = torch.randint(0, self.vocab, (batch, o), generator=g)
        choice = torch.randint(0, self.next.shape[-1], (batch, seq_len + 1), generator=g)
        for t in range(o, seq_len + 1):
            ctx = (toks[:, t - 1],) if o == 1 else (toks[:, t - 2], toks[:, t - 1])
            toks[:, t] = self.next[ctx + (choice[:, t],)]
        toks = toks.to(device)
        return toks[:, :-1], toks[:, 1:]


def train(model: torch.nn.Module, *, fp8: str | None, steps: int, batch: int, seq_len: int,
          lr: float = 2e-3, device="cpu", log_every: int = 0, lang: MarkovLanguage | None = None):
    """Train ``model`` in place with AdamW; return the per-step losses (floats)."""
    vocab = model.emb.num_embeddings
    lang = lang or MarkovLanguage(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    ctx = linghe.TrainingContext(fp8=fp8)
    losses = []
    for step in range(steps):
        inp, tgt = lang.batch(batch, seq_len, step, device)
        with ctx:
            logits = model(inp)
            loss = F.cross_entropy(logits.float().view(-1, vocab), tgt.reshape(-1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"[{fp8 or 'bf16'}] step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fp8", default="blockwise", choices=["none", "blockwise", "tensorwise",
                                                           "delayed"])
    p.add_argument("--compare", action="store_true", help="train bf16 and --fp8, compare")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--order", type=int, default=1, choices=[1, 2], help="Markov order")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(vocab=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
              ffn=args.ffn, seq_len=args.seq_len, tie=args.tie, device=device)
    runs = ["none", args.fp8] if args.compare else [args.fp8]
    lang = MarkovLanguage(args.vocab, order=args.order)
    curves = {}
    for r in runs:
        model = build_model(**kw)
        curves[r] = train(model, fp8=None if r == "none" else r, steps=args.steps,
                          batch=args.batch, seq_len=args.seq_len, lr=args.lr, device=device,
                          log_every=max(1, args.steps // 10), lang=lang)
    if args.compare:
        n = max(1, args.steps // 5)
        a = sum(curves["none"][-n:]) / n
        b = sum(curves[args.fp8][-n:]) / n
        print(f"mean loss of the last {n} steps: bf16 {a:.4f}, {args.fp8} {b:.4f} "
              f"(rel diff {abs(a - b) / a:.2%}); chain entropy "
              f"{lang.entropy:.4f}")


if __name__ == "__main__":
    main()
