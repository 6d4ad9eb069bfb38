"""Measured floors for issue 11's open rows: ``python -m benchmark.probe_roofline
[--json PATH] [--cpu] [--only NAME[,NAME]]``.

Each row times one of linghe's ops (profiler kernel time, L2 flushed:
``harness.device_time_us``) beside the best this GPU does with the same bytes or the same
tensor-core work, timed the same way:

- ``quantize_1x128`` row+col ``[8192, 2048]`` bf16: it must read x once (32 MB) and write
  the two FP8 copies (32 MB); floor: a copy of the same 64 MB (``size_matched_copy_us``).
- ``rms_norm`` forward ``[8192, 2048]`` bf16: reads x and writes y once (64 MB); floor: a
  copy of them.
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
- ``qk_norm_rope`` forward and backward (standard shape of ANCHORS.md: seq 4096 x batch
  2, 16 q / 4 kv heads, head_dim 128, rotary_dim 64, "sbh", interleaved, bf16 weights;
  the launchers of :mod:`linghe.fwd.rope` / :mod:`linghe.bwd.rope`, the backward's two
  kernels summed) and ``batch_silu_mul_quant`` forward (32 experts, ``[65536, 2048]``,
  both FP8 copies, the benchmark case's inputs): floor: a copy of ANCHORS' "min MB"
  (fwd 101.7 MB: read qkv, write q/k/v, plus cos and sin of S x R/2 fp32 angles; bwd
  152.0 MB: read dq/dk/dv and the whole qkv, write dqkv, plus the same 1 MB; batch
  forward 407.2 MB: the case's bytes); floor2 (backward only): a copy of the fewest bytes
  the backward really moves (143.1 MB: v's part of qkv is not read; the benchmark
  case's count).

``% of floor`` = floor µs / ours µs. ``target`` is ANCHORS.md's target µs (85% of its
4296 GB/s 1 GiB copy over "min MB"; absent where it has no row) and ``target % of
floor`` = floor µs / target µs: how fast a size-matched copy of the same bytes the
target asks for (over 100: faster than copying the bytes). ``--only`` picks rows by
name (:data:`ROWS`). The table is printed last. ``--cpu`` runs tiny shapes through the
interpreter (a smoke test of the script; no timing).
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

from .harness import (  # noqa: E402
    Config,
    device_time_us,
    fmt,
    print_columns,
    size_matched_copy_us,
)

#: Row names for ``--only``, in the order the rows run.
ROWS = ("quantize", "rms_norm_fwd", "rms_norm_quant", "router_fwd", "router_bwd", "rope_fwd",
        "rope_bwd", "batch_fwd")
#: ANCHORS.md's targets (µs, H200) of the rows that have one; ``quantize``: issue 11's
#: "85% of copy", i.e. its 67.1 MB at 85% of ANCHORS' 4296 GB/s copy.
TARGET_US = {"quantize": 18.4, "rms_norm_fwd": 18.3, "rms_norm_quant": 18.6,
             "router_fwd": 16.0, "router_bwd": 60.0, "rope_fwd": 27.9, "rope_bwd": 41.6,
             "batch_fwd": 111.0}


def _rows(on_gpu: bool, only=ROWS) -> list[dict]:
    dev = "cuda" if on_gpu else "cpu"
    T, H, E = (8192, 2048, 256) if on_gpu else (256, 128, 16)
    timer = device_time_us if on_gpu else (lambda fn: (fn(), None)[1])
    torch.manual_seed(0)
    out = []

    def row(key, name, ours_fn, floors: dict, note: str, mb=None):
        ours = timer(ours_fn)
        r = dict(key=key, case=name, ours_us=ours, note=note, min_mb=mb,
                 target_us=TARGET_US.get(key))
        for k, fn in floors.items():
            r[k] = fn()
        out.append(r)
        print(f"[probe_roofline] {json.dumps(r)}", flush=True)

    if {"quantize", "rms_norm_fwd", "rms_norm_quant", "router_fwd", "router_bwd"} & set(only):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        _gemm_rows(row, only, on_gpu, dev, timer, x, T, H, E)
    if {"rope_fwd", "rope_bwd"} & set(only):
        _rope_rows(row, only, on_gpu, dev, timer)
    if "batch_fwd" in only:
        _batch_rows(row, on_gpu, dev, timer)
    return out


def _copy_floor(nbytes: int, on_gpu: bool, dev):
    """A size-matched copy of ``nbytes`` (read + written), or ``None`` on the CPU."""
    return (lambda: size_matched_copy_us(nbytes, dev)) if on_gpu else (lambda: None)


def _rope_rows(row, only, on_gpu: bool, dev, timer):
    """qk_norm_rope fwd / bwd at the standard shape (tiny on the CPU)."""
    from linghe.bwd import rope as RB
    from linghe.fwd import rope as RF

    B, S, H, Hkv, D, R = (2, 4096, 16, 4, 128, 64) if on_gpu else (2, 5, 4, 2, 16, 8)
    T, W = B * S, (H + 2 * Hkv) * D
    dt = torch.bfloat16
    qkv = torch.randn(S, B, W, device=dev, dtype=dt)
    freqs = linghe.rope_freqs(S, R, device=dev)
    qw = (torch.rand(D, device=dev) + 0.5).to(dt)
    kw = (torch.rand(D, device=dev) + 0.5).to(dt)
    grads = [torch.randn(B, S, n, D, device=dev, dtype=dt) for n in (H, Hkv, Hkv)]
    opts = dict(num_heads=H, num_kv_heads=Hkv, head_dim=D, rotary_dim=R, layout="sbh",
                interleaved=True, eps=1e-6)
    angles = 2 * S * (R // 2) * 4  # ANCHORS counts cos and sin of the fp32 angles
    fwd_mb = 2 * T * W * 2 + angles
    bwd_mb = 3 * T * W * 2 + angles
    fewest = 2 * T * W * 2 + T * (H + Hkv) * D * 2 + S * (R // 2) * 4
    if "rope_fwd" in only:
        row("rope_fwd", "qk_norm_rope fwd", lambda: RF.qk_norm_rope_fwd(
            qkv, freqs, None, qw, kw, **opts), {"floor_us": _copy_floor(fwd_mb, on_gpu, dev)},
            f"floor: a copy of ANCHORS' {fwd_mb / 1e6:.1f} MB", fwd_mb / 1e6)
    if "rope_bwd" in only:
        row("rope_bwd", "qk_norm_rope bwd (2 kernels)", lambda: RB.qk_norm_rope_bwd(
            *grads, qkv, freqs, None, qw, kw, **opts),
            {"floor_us": _copy_floor(bwd_mb, on_gpu, dev),
             "floor2_us": _copy_floor(fewest, on_gpu, dev)},
            f"floor: a copy of ANCHORS' {bwd_mb / 1e6:.1f} MB; floor2: of the "
            f"{fewest / 1e6:.1f} MB it moves (v of qkv not read)", bwd_mb / 1e6)


def _batch_rows(row, on_gpu: bool, dev, timer):
    """batch_silu_mul_quant fwd, both copies, at the benchmark case's inputs."""
    from .cases.activation import _batch_inputs, _cdiv

    x, probs, counts, align, R, n, E = _batch_inputs(Config(dev, quick=False))
    xd, pd = x.detach(), probs.detach()
    G = _cdiv(R, 128) + E
    nbytes = R * 2 * n * 2 + 4 * R + 2 * R * n + 4 * (R * _cdiv(n, 128) + n * G)
    row("batch_fwd", f"batch_silu_mul_quant fwd ({E} experts, [{R}, {2 * n}])",
        lambda: linghe.batch_silu_mul_quant(xd, pd, counts, align=align),
        {"floor_us": _copy_floor(nbytes, on_gpu, dev)},
        f"floor: a copy of ANCHORS' {nbytes / 1e6:.1f} MB", nbytes / 1e6)


def _gemm_rows(row, only, on_gpu: bool, dev, timer, x, T, H, E):
    """The quantize, rms_norm_quant and router rows."""
    w = torch.rand(H, device=dev, dtype=torch.bfloat16) + 0.5
    rw = torch.randn(E, H, device=dev) * 0.02
    dl = torch.randn(T, E, device=dev)

    # one size-matched copy of x's 64 MB (read + write), the floor of both quantize rows
    copy_us = size_matched_copy_us(2 * T * H * 2, dev) if on_gpu else None
    if "quantize" in only:
        row("quantize", "quantize_1x128 row+col", lambda: linghe.quantize_1x128(
            x, rowwise=True, columnwise=True, pow2_scale=True), {"floor_us": lambda: copy_us},
            "floor: a copy of the same 64 MB", 2 * T * H * 2 / 1e6)

    if "rms_norm_fwd" in only:
        # x read and y written once (ANCHORS' 67 MB; the 4 KB weight is not counted)
        row("rms_norm_fwd", "rms_norm fwd", lambda: linghe.rms_norm(x, w),
            {"floor_us": lambda: copy_us}, "floor: a copy of the same 64 MB (x in, y out)",
            2 * T * H * 2 / 1e6)

    def two_read():
        if not on_gpu:
            return None
        return copy_us + timer(lambda: torch.linalg.vector_norm(x, dim=1, dtype=torch.float32))
    if "rms_norm_quant" in only:
        row("rms_norm_quant", "rms_norm_quant row+col",
            lambda: linghe.rms_norm_quant(x, w, columnwise=True),
            {"floor_us": lambda: copy_us, "floor2_us": two_read},
            "floor: one read (copy of 64 MB); floor2: + a second read of x (row reduction)",
            2 * T * H * 2 / 1e6)

    w3t = F.weight_parts(rw).reshape(3 * E, H).t()  # [H, 3E] bf16 view
    if "router_fwd" in only:
        row("router_fwd", "router_logits fwd (fp32 w)", lambda: linghe.router_logits(x, rw),
            {"floor_us": lambda: timer(lambda: torch.mm(x, w3t))},
            "floor: cuBLAS bf16 [T, H] x [H, 3E] (the three passes as one GEMM)")
    if "router_bwd" not in only:
        return

    wp = F.weight_parts(rw)
    dlp = F.split_parts(dl, 3)
    dl_stack = dlp.reshape(3 * T, E)            # [3T, E]
    x3 = x.repeat(3, 1)                         # [3T, H]

    def gemm_floor():
        return timer(lambda: (torch.mm(dl_stack.t(), x3), torch.mm(dlp[0], wp[0])))
    row("router_bwd", "router_logits bwd (fp32-exact)",
        lambda: B.router_logits_bwd(dl, x, rw, w_parts=wp),
        {"floor_us": gemm_floor},
        "floor: cuBLAS dW [E, 3T] x [3T, H] + dx [T, E] x [E, H], bf16, no split")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]",
                   help="rows to run, comma-separated: " + ",".join(ROWS))
    args = p.parse_args(argv)
    only = ROWS if not args.only else tuple(n.strip() for n in args.only.split(",") if n.strip())
    bad = [n for n in only if n not in ROWS]
    if bad:
        p.error(f"unknown row(s) {bad}; choose from {','.join(ROWS)}")
    on_gpu = torch.cuda.is_available() and not args.cpu
    rows = _rows(on_gpu, only)
    env = dict(device=torch.cuda.get_device_name() if on_gpu else "cpu",
               torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    print(f"issue 11 floors, {env['device']} (profiler kernel µs, L2 flushed)")

    def pct(r, k, of="ours_us"):
        return None if r.get(k) is None or not r.get(of) else 100 * r[k] / r[of]
    print_columns(["case", "min MB", "ours us", "floor us", "% of floor", "floor2 us",
                   "% of floor2", "target us", "target % of floor", "floor"],
                  [[r["case"], fmt(r.get("min_mb"), ".1f"), fmt(r["ours_us"], ".1f"),
                    fmt(r.get("floor_us"), ".1f"), fmt(pct(r, "floor_us"), ".0f"),
                    fmt(r.get("floor2_us"), ".1f"), fmt(pct(r, "floor2_us"), ".0f"),
                    fmt(r.get("target_us"), ".1f"),
                    fmt(pct(r, "floor_us", "target_us") if r.get("min_mb") else None, ".0f"),
                    r["note"]] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
