"""Probe of ``linghe.linear_cross_entropy``'s chunk size at the e2e LM head:
``python -m benchmark.probe_lce_chunk [--json PATH] [--cpu]``.

``hidden [8192, 2048]`` bf16, ``weight [157184, 2048]`` bf16, mean reduction; one call is
forward + backward (the fused forward computes the gradients chunk by chunk: logits GEMM,
loss/gradient kernel, ``dh`` GEMM, ``dW`` GEMM accumulating over chunks). Rows: the
default chunk (~256 MiB of logits) and fixed chunk sizes, plus PyTorch's unchunked
``F.linear`` + ``F.cross_entropy`` (the logits materialized). Columns: profiler kernel
µs (``benchmark.harness.device_time_us``, L2 flushed), the peak memory allocated
during one call above what was allocated before it, and the loss and gradients' relative
error against the default chunk. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import linghe  # noqa: E402
from linghe.functional.loss import default_chunk_size  # noqa: E402
from linghe.testing import rel_err  # noqa: E402

from .harness import device_time_us, fmt, print_columns, wall_us  # noqa: E402

CHUNKS = [1024, 1536, 2048, 2752, 4096, 8192]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    dev = "cuda" if gpu else "cpu"
    N, H, V = (8192, 2048, 157184) if gpu else (100, 64, 300)
    chunks = CHUNKS if gpu else [32, 64]
    timer = device_time_us if gpu else wall_us
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(N, H, generator=g) * 0.5).to(dev, torch.bfloat16).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.02).to(dev, torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, V, (N,), generator=g).to(dev)

    def run(chunk):
        h.grad = w.grad = None
        if chunk == "torch":
            loss = F.cross_entropy(F.linear(h, w).float(), y)
        else:
            loss = linghe.linear_cross_entropy(h, w, y, chunk_size=chunk)
        loss.backward()
        return loss.detach()

    def peak(fn):
        if not gpu:
            return None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    default = default_chunk_size(N, V, 2)
    ref_loss = run(None)
    ref_dh, ref_dw = h.grad.clone(), w.grad.clone()
    rows = []
    for chunk in [None] + chunks + ["torch"]:
        label = (f"default ({default} rows)" if chunk is None else
                 "torch F.linear + F.cross_entropy" if chunk == "torch" else f"{chunk} rows")
        try:
            loss = run(chunk)
            err = max(rel_err(loss, ref_loss), rel_err(h.grad, ref_dh), rel_err(w.grad, ref_dw))
            us = timer(lambda c=chunk: run(c))
            mib = peak(lambda c=chunk: run(c))
        except torch.OutOfMemoryError:
            err = us = mib = None
        rows.append(dict(path=label, chunk=chunk, us=us, peak_mib=mib, rel_err=err))
    env = {"device": torch.cuda.get_device_name() if gpu else "cpu",
           "torch": torch.__version__, "triton": triton.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"N": N, "H": H, "V": V, "rows": rows, "env": env}, f, indent=1)
    base = rows[0]["us"]
    print(f"\nlinear_cross_entropy fwd+bwd, [{N}, {H}] x [{V}, {H}] bf16 "
          f"({'kernel' if gpu else 'interpreter wall'} us; {env['device']})")
    print_columns(["path", "us", "vs default", "peak MiB", "rel err"],
                  [[r["path"], fmt(r["us"], ".0f"),
                    fmt(base / r["us"] if r["us"] else None, ".3f") + "x",
                    fmt(r["peak_mib"], ".0f"), fmt(r["rel_err"], ".1e")] for r in rows])


if __name__ == "__main__":
    main()
