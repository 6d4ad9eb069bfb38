"""Probe of ``linghe.embedding``'s kernels against the bytes they must move:
``python -m benchmark.probe_embedding [--json PATH] [--cpu] [--old DIR]``.

Shape: the e2e step's micro-batch, ``tokens [8192]`` int64 into ``weight [157184, 2048]``
bf16, with ids drawn from 256 values (byte-level text) and from the whole vocab. Rows
(kernel µs from ``torch.profiler`` per call, the L2 flushed before each; GB/s from the
fewest bytes; % of a 1 GiB device copy):

- ``fwd``: linghe's gather at the default tile and at other tile sizes
  (``fwd.TILE_ELEMS``), ``F.embedding``;
- ``sort``: the backward's key kernel + ``torch.sort`` alone (its share of a backward);
- ``bwd fresh``: :func:`linghe.bwd.embedding.embedding_bwd` (zero fill + kernels),
  PyTorch's ``embedding_dense_backward`` (host-synchronising), and with ``--old DIR``
  (a folder holding main's ``e2e_model.py``) the e2e's former ``_EmbeddingIndexAdd``
  backward (float32 zero fill, ``index_add_``, cast);
- ``bwd accumulate``: :func:`linghe.bwd.embedding.embedding_bwd_accumulate_` at the
  default knobs and at other ``(CHUNK, BLOCK_H, NUM_WARPS)``; against the dense
  backward + ``add_`` (what AccumulateGrad does) of torch and of the old e2e path;
- ``step``: one micro-batch through autograd (forward + ``.backward()``) onto a
  ``.grad`` that already holds a gradient (fused accumulation for linghe), and the host
  µs of linghe's (a GPU spin hides the device).

Fewest bytes: fwd ``N*8 + 2*N*H*2``; bwd fresh ``N*8 + N*H*2 + V*H*2 + U*H*2`` (ids, the
gradient rows, the zero fill, the ``U`` touched rows written); bwd accumulate
``N*8 + N*H*2 + 2*U*H*2``. Checks, every row, in the same run: outputs NaN-poisoned
before the kernels (:func:`linghe.utils.set_poison_outputs`, the float64 scratch too),
then against :func:`linghe.reference.embedding_backward` (float32 index_add, relative
error) and, for linghe's variants, bit for bit against the default (the float64 sums
are exact here, so every chunking gives the same bits) and against a second run.
``--cpu``: tiny shapes on the interpreter (a smoke test of this script). The table is
printed last; ``--json`` gets every row.
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

import linghe  # noqa: E402
from linghe import reference as ref  # noqa: E402
from linghe.bwd import embedding as B  # noqa: E402
from linghe.fwd import embedding as FW  # noqa: E402
from linghe.testing import rel_err  # noqa: E402
from linghe.utils import set_poison_outputs  # noqa: E402

from .harness import (  # noqa: E402
    Config,
    copy_bandwidth_gbps,
    device_time_us,
    fmt,
    host_us,
    interpreter_matches,
    load_module_at,
    print_columns,
    wall_us,
)

#: (CHUNK, BLOCK_H, NUM_WARPS) of the accumulating backward besides the default.
BWD_VARIANTS = [(16, 512, 2), (64, 512, 2), (32, 256, 1), (16, 256, 1), (32, 1024, 4),
                (32, 512, 4)]
FWD_TILES = [2048, 8192, 16384]


class _Knobs:
    """Set module knobs for a block, restore them after."""

    def __init__(self, mod, **kv):
        self.mod, self.kv, self.prev = mod, kv, {}

    def __enter__(self):
        for k, v in self.kv.items():
            self.prev[k] = getattr(self.mod, k)
            setattr(self.mod, k, v)

    def __exit__(self, *exc):
        for k, v in self.prev.items():
            setattr(self.mod, k, v)


def _probe_ids(t, g, w, V, tag, row, check, rows, old, device, gen):
    """The rows and checks of one token set (``t [N]``, gradient ``g [N, H]``)."""
    N, H = g.shape
    dt = w.dtype
    U = int(torch.unique(t).numel())
    print(f"[{tag}] N={N} V={V} H={H}: {U} distinct ids")
    ids = N * 8
    fwd_b = ids + 2 * N * H * 2
    fresh_b = ids + N * H * 2 + V * H * 2 + U * H * 2
    acc_b = ids + N * H * 2 + 2 * U * H * 2
    want = ref.embedding_backward(t, g, V, dtype=torch.float32)
    start = (torch.randn(V, H, generator=gen) * 1e-3).to(device, dt)

    # ---- forward
    set_poison_outputs(True)
    out = linghe.embedding(t, w)
    set_poison_outputs(False)
    check(f"fwd {tag}", out, F.embedding(t, w))
    row("fwd linghe", lambda: linghe.embedding(t, w), fwd_b, tag,
        f"TILE_ELEMS={FW.TILE_ELEMS}*")
    for te in FWD_TILES:
        with _Knobs(FW, TILE_ELEMS=te):
            check(f"fwd TILE_ELEMS={te} {tag}", linghe.embedding(t, w), F.embedding(t, w))
            row("fwd linghe", lambda: linghe.embedding(t, w), fwd_b, tag, f"TILE_ELEMS={te}")
    row("fwd F.embedding", lambda: F.embedding(t, w), fwd_b, tag)

    # ---- sort alone
    row("sort (keys + torch.sort)", lambda: B.sort_keys(t, V, None), ids + N * 16, tag)

    # ---- fresh backward
    set_poison_outputs(True)
    base = B.embedding_bwd(t, g, V, None, dt)
    set_poison_outputs(False)
    check(f"bwd fresh {tag}", base, want)
    check(f"bwd fresh, second run {tag}", B.embedding_bwd(t, g, V, None, dt), want, base)
    row("bwd fresh linghe", lambda: B.embedding_bwd(t, g, V, None, dt), fresh_b, tag,
        "zero fill + sort + kernels")
    dense = lambda: torch.ops.aten.embedding_dense_backward(g, t, V, -1, False)
    check(f"bwd fresh torch {tag}", dense(), want)
    row("bwd fresh torch embedding_dense_backward", dense, fresh_b, tag, "host sync")
    wg = w.clone().requires_grad_()
    if old is not None:
        out_old = old.apply(wg, t)
        old_bwd = lambda: torch.autograd.grad(out_old, wg, g, retain_graph=True)[0]
        check(f"bwd fresh e2e _EmbeddingIndexAdd {tag}", old_bwd(), want)
        row("bwd fresh e2e _EmbeddingIndexAdd (main)", old_bwd, fresh_b, tag,
            "fp32 zero fill + index_add_ + cast")

    # ---- accumulating backward
    dw = start.clone()
    set_poison_outputs(True)
    B.embedding_bwd_accumulate_(dw, t, g, None)
    set_poison_outputs(False)
    acc_want = start.float() + want
    check(f"bwd accumulate {tag}", dw, acc_want)
    acc_base = dw.clone()
    dw.copy_(start)
    row("bwd accumulate linghe", lambda: B.embedding_bwd_accumulate_(dw, t, g, None), acc_b,
        tag, f"CHUNK={B.CHUNK} BLOCK_H={B.BLOCK_H} warps={B.NUM_WARPS}*")
    for C, BH, nw in BWD_VARIANTS:
        if device == "cpu" and BH > 256:
            continue
        with _Knobs(B, CHUNK=C, BLOCK_H=BH, NUM_WARPS=nw):
            dw.copy_(start)
            B.embedding_bwd_accumulate_(dw, t, g, None)
            check(f"bwd accumulate C={C} BH={BH} w={nw} {tag}", dw, acc_want, acc_base)
            row("bwd accumulate linghe", lambda: B.embedding_bwd_accumulate_(dw, t, g, None),
                acc_b, tag, f"CHUNK={C} BLOCK_H={BH} warps={nw}")
    dw.copy_(start)
    row("bwd accumulate torch dense + add_", lambda: dw.add_(dense()), acc_b, tag,
        "what AccumulateGrad does")
    if old is not None:
        row("bwd accumulate e2e _EmbeddingIndexAdd + add_ (main)",
            lambda: dw.add_(old_bwd()), acc_b, tag)

    # ---- one micro-batch through autograd, .grad already there
    def step(fn, prm):
        def run():
            fn(prm).backward(g)
        return run

    steps = {"linghe (fused .grad)": lambda p: linghe.embedding(t, p),
             "F.embedding (AccumulateGrad)": lambda p: F.embedding(t, p)}
    if old is not None:
        steps["e2e _EmbeddingIndexAdd (main)"] = lambda p: old.apply(p, t)
    for name, fn in steps.items():
        prm = torch.nn.Parameter(w.clone())
        prm.grad = start.clone()
        step(fn, prm)()
        check(f"step {name} {tag}", prm.grad, acc_want)
        row(f"step {name}", step(fn, prm), fwd_b + acc_b, tag, "fwd + bwd")
        if device == "cuda" and name.startswith("linghe"):
            us, waited = host_us(step(fn, prm))
            rows.append({"row": "step linghe host µs", "ids": tag, "kernel_us": None,
                         "gbps": None, "pct_copy": None, "host_us": us,
                         "note": "waited for the GPU" if waited else ""})
        del prm
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.probe_embedding")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--old", default=None, help="a folder holding an e2e_model.py from "
                    "before f7ec1ca (rows 'e2e _EmbeddingIndexAdd'; a later one adds none)")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    if not interpreter_matches(device == "cpu", "benchmark.probe_embedding"):
        return 2
    V, H, N, few = (300, 40, 64, 16) if device == "cpu" else (157184, 2048, 8192, 256)
    timer = device_time_us if device == "cuda" else wall_us
    copy_gbps = copy_bandwidth_gbps(Config(device=device, quick=False))
    old = None
    if args.old:
        old = getattr(load_module_at("", "benchmark/e2e_model.py", "benchmark._e2e_model_old",
                                     src_dir=args.old), "_EmbeddingIndexAdd", None)
        if old is None:  # main since f7ec1ca: the e2e model uses linghe.embedding itself
            print(f"--old: {args.old}/e2e_model.py has no _EmbeddingIndexAdd (it is from "
                  "after the e2e model moved to linghe.embedding): no 'e2e' rows")
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(V, H, generator=gen) * 0.02).to(device, torch.bfloat16)
    rows, checks = [], []

    def row(name, fn, nbytes, ids, note=""):
        us = timer(fn)
        gbps = nbytes / us / 1e3
        rows.append({"row": name, "ids": ids, "kernel_us": us, "gbps": gbps,
                     "pct_copy": 100 * gbps / copy_gbps, "note": note})

    def check(name, got, want, same_as=None):
        err = rel_err(got, want)
        bits = None if same_as is None else bool(torch.equal(got, same_as))
        checks.append({"row": name, "rel_err": err, "bit_identical": bits})
        flag = "" if err <= 1e-2 and bits in (None, True) else "  <-- FAIL"
        print(f"check {name}: rel err {err:.2e}"
              + ("" if bits is None else f", bits equal to default: {bits}") + flag)

    for id_range, tag in ((few, f"{few} ids"), (V, "all ids")):
        t = torch.randint(0, id_range, (N,), generator=gen).to(device)
        g = torch.randn(N, H, generator=gen).to(device, w.dtype)
        _probe_ids(t, g, w, V, tag, row, check, rows, old, device, gen)

    print(f"1 GiB copy {copy_gbps:.0f} GB/s")
    failed = [c for c in checks if c["rel_err"] > 1e-2 or c["bit_identical"] is False]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "copy_gbps": copy_gbps, "checks": checks, "rows": rows,
                       "failed_checks": len(failed)}, f, indent=1)
    print_columns(["row", "ids", "kernel µs", "GB/s", "% copy", "note"],
                  [[r["row"], r["ids"],
                    fmt(r["kernel_us"], ".1f") if r["kernel_us"] is not None
                    else f"host {r['host_us']:.1f}",
                    fmt(r["gbps"], ".0f"), fmt(r["pct_copy"], ".0f"), r["note"]] for r in rows])
    if failed:
        print(f"{len(failed)} check(s) FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
