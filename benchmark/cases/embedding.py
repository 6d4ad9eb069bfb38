"""Token embedding at the e2e shape: ``tokens [8192]`` into ``weight [157184, 2048]`` bf16.

Two token sets: random ids over 256 values (byte-level text uses about 256 distinct ids:
~32 tokens per id, so the backward sums runs of duplicates) and over the whole vocab
(nearly every id once). Rows per set:

- ``fwd``: the gather;
- ``fwd+bwd (fresh dW)``: ``torch.autograd.grad`` of the gather: a new dense ``[V, H]``
  gradient (zero fill + the touched rows);
- ``fwd+bwd accumulating into .grad``: ``.backward()`` onto a weight whose ``.grad``
  already holds a gradient (every micro-batch after the first): linghe adds the touched
  rows in place (fused gradient accumulation); torch builds the dense gradient and its
  ``AccumulateGrad`` adds it (``add_``: 3 passes over ``V x H``). Each provider adds into
  its own copy of the same start, so the first (checked) call gives start + dW.

Providers: ``eager`` = ``torch.nn.functional.embedding`` (its backward sorts and counts
unique ids on the host for more than 3072 tokens: a host sync), ``compile`` =
``torch.compile`` of it, ``linghe`` = :func:`linghe.embedding`. Checked against
:func:`linghe.reference.embedding_backward` (float32 index_add). ``bytes``: the fewest
each op must move (ids, the ``N x H`` rows read and written once, the zero fill of a fresh
``V x H`` gradient, the touched rows written, or read and written when accumulating).
"""

import torch
import torch.nn.functional as F

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, case, compiled


def _torch_embedding(t, w):
    return F.embedding(t, w)


def _benches(cfg: Config, V, H, N, id_range, tag):
    dev, dt = cfg.device, torch.bfloat16
    w = (torch.randn(V, H, device=dev) * 0.02).to(dt)
    t = torch.randint(0, id_range, (N,), device=dev)
    g = torch.randn(N, H, device=dev).to(dt)
    U = int(torch.unique(t).numel())  # touched rows (setup only)
    ids, rows = N * t.element_size(), N * H * 2
    fwd_bytes = ids + 2 * rows
    fns = {"eager": _torch_embedding, "compile": compiled(_torch_embedding),
           "linghe": linghe.embedding}
    out = [Bench(name=f"embedding fwd {tag}", bytes=fwd_bytes, tol=0.0,
                 run={p: (lambda f=f: f(t, w)) for p, f in fns.items()})]

    wg = w.clone().requires_grad_()
    expected = lambda: ref.embedding_backward(t, g, V, dtype=torch.float32)
    out.append(Bench(
        name=f"embedding fwd+bwd (fresh dW) {tag}", tol=1e-2, expected=expected,
        bytes=fwd_bytes + ids + rows + V * H * 2 + U * H * 2,
        run={p: (lambda f=f: torch.autograd.grad(f(t, wg), wg, g)[0]) for p, f in fns.items()},
        note=f"{U} ids touched; fresh dW = zero fill of [V, H] + touched rows"))

    start = (torch.randn(V, H, device=dev) * 1e-3).to(dt)
    params = {}
    for p in fns:
        params[p] = torch.nn.Parameter(w.clone())
        params[p].grad = start.clone()

    def accumulate(p):
        f, prm = fns[p], params[p]

        def run():
            f(t, prm).backward(g)
            return prm.grad
        return run

    out.append(Bench(
        name=f"embedding fwd+bwd accumulating into .grad {tag}", tol=1e-2,
        expected=lambda: start.float() + expected(),
        bytes=fwd_bytes + ids + rows + 2 * U * H * 2,
        run={p: accumulate(p) for p in fns},
        note="linghe: touched rows added in place; torch: dense dW + AccumulateGrad add_"))
    return out


@case("embedding")
def embedding_case(cfg: Config):
    V, H, N = (300, 40, 64) if cfg.cpu else (157184, 2048, 8192)
    few = 16 if cfg.cpu else 256
    out = []
    for id_range, name in ((few, f"{few} ids"), (V, "all ids")):
        out += _benches(cfg, V, H, N, id_range, f"[{N}] ({name}) x [{V},{H}] bf16")
    return out
