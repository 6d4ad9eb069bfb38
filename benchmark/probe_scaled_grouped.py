"""Probe: what a cuBLAS/CUTLASS FP8 grouped GEMM would give the MoE experts, next to
linghe's blockwise one: ``python -m benchmark.probe_scaled_grouped [--json PATH]``.

The experts' forward GEMM ``y_e = x_e W_e^T`` (gate_up: N = K = 2048; down: N = 2048,
K = 1024; 8192 tokens top-8 at random over E experts, segments padded to 16), timed four
ways on the same rows:

- ``bf16``: ``torch._grouped_mm`` (CUTLASS; what the bf16 step runs);
- ``linghe blockwise``: :func:`linghe.grouped_mm_fp8` (1x128 activations, 128x128
  weights, fp32 promotion per 128-wide K step: the library's recipe);
- ``torch rowwise``: ``torch._scaled_grouped_mm`` with one scale per row of ``x`` and
  per output channel of ``W`` (the only FP8 scaling PyTorch's grouped GEMM takes on
  sm_90; a coarser recipe than blockwise: one amax over the whole K of a row);
- ``torch rowwise, fast accum``: the same with ``use_fast_accum=True`` (the tensor
  cores' reduced-precision accumulation over the whole K).

The quantization itself is not timed (operands are made once). ``rel err``: against the
float32 product of the bf16 operands. Times: profiler kernel µs
(``benchmark.harness.device_time_us``, L2 flushed). GPU only; the table is printed last.
"""

from __future__ import annotations

import argparse
import json

import torch

import linghe

from .harness import device_time_us, print_columns, random_routing

FP8 = torch.float8_e4m3fn
#: (experts, gemm name, N, K)
CASES = [(E, name, N, K) for E in (256, 32)
         for name, N, K in (("gate_up", 2048, 2048), ("down", 2048, 1024))]


def _rowwise(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 of ``t`` with one float32 dequantization scale per slice along ``dim``."""
    amax = t.float().abs().amax(dim=dim, keepdim=True).clamp_min(1e-12)
    scale = amax / 448.0
    return (t.float() / scale).to(FP8), scale.squeeze(dim)


def _row(E: int, name: str, N: int, K: int) -> dict:
    layout, real, _, _ = random_routing(8192, 8, E, 16, "cuda")
    R = real.numel()
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    x[~real] = 0
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    offs = layout.offsets[1:].to(torch.int32)
    bounds = layout.offsets.tolist()
    ref = torch.zeros(R, N, device="cuda")
    for e in range(E):  # float32 product of the bf16 operands, expert by expert
        ref[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]].float() @ w[e].float().t()

    def err(y):  # over the routed rows (the tail past the last segment is not written)
        return ((y.float() - ref)[real].norm() / ref[real].norm()).item()

    def bf16():
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    xq = linghe.quantize_1x128(x, pow2_scale=True)
    wq = linghe.quantize_grouped_weight(w, columnwise=False, pow2_scale=True)

    def blockwise():
        return linghe.grouped_mm_fp8(xq, wq, layout)

    xr, sx = _rowwise(x, 1)                     # [R, K], [R]
    wr, sw = _rowwise(w, 2)                     # [E, N, K], [E, N]
    wr_t = wr.transpose(1, 2)                   # [E, K, N], column-major as cuBLAS wants

    def rowwise(fast: bool):
        return torch._scaled_grouped_mm(xr, wr_t, sx, sw, offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

    row = dict(E=E, gemm=name, R=R, N=N, K=K)
    for key, fn in (("bf16", bf16), ("blockwise", blockwise),
                    ("rowwise", lambda: rowwise(False)),
                    ("rowwise_fast", lambda: rowwise(True))):
        try:
            row[key + "_err"] = err(fn())
            row[key + "_us"] = device_time_us(fn)
        except Exception as e:  # e.g. a torch build without the FP8 grouped GEMM
            row[key + "_us"] = None
            row[key + "_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_scaled_grouped")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_scaled_grouped times GPU kernels: no GPU here")
    rows = [_row(*c) for c in CASES]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    for r in rows:
        for k, v in r.items():
            if k.endswith("_error"):
                print(f"E={r['E']} {r['gemm']} {k}: {v}")

    def cell(r, key):
        us = r.get(key + "_us")
        if us is None:
            return "-"
        return f"{us:.0f} ({r['bf16_us'] / us:.2f}x, err {r[key + '_err']:.1e})"

    print_columns(["E", "gemm", "rows", "bf16 µs", "linghe blockwise", "torch rowwise",
                   "torch rowwise fast accum"],
                  [[r["E"], r["gemm"], r["R"], f"{r['bf16_us']:.0f}",
                    cell(r, "blockwise"), cell(r, "rowwise"), cell(r, "rowwise_fast")]
                   for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
