"""Measured floors for issue 11's open rows: ``python -m benchmark.probe_roofline
[--json PATH] [--cpu]``.

Each row times one of linghe's ops (profiler kernel time, L2 flushed:
``harness.device_time_us``) beside the best this GPU does with the same bytes or the same
tensor-core work, timed the same way:

- ``quantize_1x128`` row+col ``[8192, 2048]`` bf16: it must read x once (32 MB) and write
  the two FP8 copies (32 MB); floor: a copy of the same 64 MB (``size_matched_copy_us``).
- ``rms_norm_quant`` row+col: the same bytes if x were read once; but the columnwise
  groups need the rstd of 128 whole rows (512 KB of x per row block, more than an SM's
  shared memory and registers hold), so every design on Hopper without cluster shared
  memory reads x twice (the second time partly from L2); floors: the one-read copy, and
  that copy plus a row reduction of x (``torch.linalg.vector_norm(x, dim=1,
  dtype=torch.float32)``, one more read).
- ``router_logits`` forward, fp32 weight, fp32-exact: three bf16 passes (the weight's
  bf16 parts) = one bf16 GEMM ``[8192, 2048] x [2048, 3 * 256]``; floor: cuBLAS on that
  stacked GEMM (bf16 output; ours also sums the parts into fp32 logits).
- ``router_logits`` backward (fp32-exact dW from dlogits' three bf16 parts, dx from one
  bf16 pass): floor: cuBLAS ``dW = [dl_hi | dl_mid | dl_lo]^T @ [x; x; x]`` (the parts
  stacked along the tokens) plus cuBLAS ``dx = dl_hi @ W_hi``, both in bf16 (the split
  of dlogits into parts is not counted: the floor only has the GEMMs).

``% of floor`` = floor µs / ours µs. The table is printed last. ``--cpu`` runs tiny
shapes through the interpreter (a smoke test of the script; no timing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv[1:] or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

import linghe  # noqa: E402
from linghe.bwd import router as B  # noqa: E402
from linghe.fwd import router as F  # noqa: E402

from .harness import device_time_us, fmt, print_columns, size_matched_copy_us  # noqa: E402


def _rows(on_gpu: bool) -> list[dict]:
    dev = "cuda" if on_gpu else "cpu"
    T, H, E = (8192, 2048, 256) if on_gpu else (256, 128, 16)
    timer = device_time_us if on_gpu else (lambda fn: (fn(), None)[1])
    torch.manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w = torch.rand(H, device=dev, dtype=torch.bfloat16) + 0.5
    rw = torch.randn(E, H, device=dev) * 0.02
    dl = torch.randn(T, E, device=dev)
    out = []

    def row(name, ours_fn, floors: dict, note: str):
        ours = timer(ours_fn)
        r = dict(case=name, ours_us=ours, note=note)
        for k, fn in floors.items():
            r[k] = fn()
        out.append(r)
        print(f"[probe_roofline] {json.dumps(r)}", flush=True)

    # one size-matched copy of x's 64 MB (read + write), the floor of both quantize rows
    copy_us = size_matched_copy_us(2 * T * H * 2, dev) if on_gpu else None
    row("quantize_1x128 row+col", lambda: linghe.quantize_1x128(
        x, rowwise=True, columnwise=True, pow2_scale=True), {"floor_us": lambda: copy_us},
        "floor: a copy of the same 64 MB")

    def two_read():
        if not on_gpu:
            return None
        return copy_us + timer(lambda: torch.linalg.vector_norm(x, dim=1, dtype=torch.float32))
    row("rms_norm_quant row+col", lambda: linghe.rms_norm_quant(x, w, columnwise=True),
        {"floor_us": lambda: copy_us, "floor2_us": two_read},
        "floor: one read (copy of 64 MB); floor2: + a second read of x (row reduction)")

    w3t = F.weight_parts(rw).reshape(3 * E, H).t()  # [H, 3E] bf16 view
    row("router_logits fwd (fp32 w)", lambda: linghe.router_logits(x, rw),
        {"floor_us": lambda: timer(lambda: torch.mm(x, w3t))},
        "floor: cuBLAS bf16 [T, H] x [H, 3E] (the three passes as one GEMM)")

    wp = F.weight_parts(rw)
    dlp = F.split_parts(dl, 3)
    dl_stack = dlp.reshape(3 * T, E)            # [3T, E]
    x3 = x.repeat(3, 1)                         # [3T, H]

    def gemm_floor():
        return timer(lambda: (torch.mm(dl_stack.t(), x3), torch.mm(dlp[0], wp[0])))
    row("router_logits bwd (fp32-exact)",
        lambda: B.router_logits_bwd(dl, x, rw, w_parts=wp),
        {"floor_us": gemm_floor},
        "floor: cuBLAS dW [E, 3T] x [3T, H] + dx [T, E] x [E, H], bf16, no split")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.cpu
    rows = _rows(on_gpu)
    env = dict(device=torch.cuda.get_device_name() if on_gpu else "cpu",
               torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    print(f"issue 11 floors, {env['device']} (profiler kernel µs, L2 flushed)")

    def pct(r, k):
        return None if r.get(k) is None or not r["ours_us"] else 100 * r[k] / r["ours_us"]
    print_columns(["case", "ours us", "floor us", "% of floor", "floor2 us", "% of floor2",
                   "floor"],
                  [[r["case"], fmt(r["ours_us"], ".1f"), fmt(r.get("floor_us"), ".1f"),
                    fmt(pct(r, "floor_us"), ".0f"), fmt(r.get("floor2_us"), ".1f"),
                    fmt(pct(r, "floor2_us"), ".0f"), r["note"]] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
