"""A target for Nsight Compute: the MoE grouped GEMM kernels at the e2e shapes.

``ncu --clock-control none -k regex:"_fp8_rows_ws|_wgrad_ws" --launch-skip 2
--launch-count 2 --section SpeedOfLight --section WarpStateStats --section Occupancy
--section MemoryWorkloadAnalysis python3 -m benchmark.ncu_grouped`` (add ``--section
SourceCounters --import-source yes -o REPORT``, then ``ncu -i REPORT.ncu-rep --page
source --csv --print-source sass > src.csv`` and ``python -m benchmark.ncu_source src.csv``
to see which instructions the warps stall on; or ``--set full -o REPORT``, then ``ncu -i
REPORT.ncu-rep --page raw --csv > raw.csv`` and ``python -m benchmark.ncu_metrics raw.csv``
for the units' throughputs side by side). On sm_90 the kernels are the warp-specialized
ones, ``_fp8_rows_ws_kernel`` and ``_hp_wgrad_ws_kernel``; ``LINGHE_FP8_WS=0`` /
``LINGHE_HP_WS=0`` profile the Triton kernels instead.

Runs (twice: the first round compiles) the FP8 rows kernel on the gate_up forward
(256 experts, 8192 tokens top-8, segments aligned to 16: ~256 rows per expert) and the
TMA wgrad accumulating into an existing gradient (the fused gradient accumulation of a
second micro-batch), each checked against a float32 product once. No timing here: the
profiler reports each kernel's stall reasons, throughputs and occupancy.
"""

from __future__ import annotations

import torch

import linghe
from linghe.bwd import grouped_mm as bwd_gm

from .harness import random_routing


def main() -> int:
    torch.manual_seed(0)
    dev = "cuda"
    T, k, E, align, H, N = 8192, 8, 256, 16, 2048, 2048
    layout, real, offs, counts = random_routing(T, k, E, align, dev)
    R = real.numel()
    x = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
    x[~real] = 0
    g = torch.randn(R, N, device=dev, dtype=torch.bfloat16)
    g[~real] = 0
    w = (torch.randn(E, N, H, device=dev) / H**0.5).to(torch.bfloat16)
    xq = linghe.quantize_1x128(x, pow2_scale=True)
    wq = linghe.quantize_grouped_weight(w, pow2_scale=True)
    dw = torch.zeros(E, N, H, device=dev, dtype=torch.bfloat16)
    for _ in range(2):
        y = linghe.grouped_mm_fp8(xq, wq, layout)
        bwd_gm.grouped_mm_wgrad_accumulate_(dw, g, x, layout.offsets)
    torch.cuda.synchronize()
    e = next(i for i, c in enumerate(counts.tolist()) if c > 0)
    ref = (xq.dequantize(dtype=torch.float32)[offs[e]:offs[e] + int(counts[e])]
           @ wq.dequantize(dtype=torch.float32)[e].t())
    err = (y[offs[e]:offs[e] + int(counts[e])].float() - ref).norm() / ref.norm()
    ref_dw = 2 * g[offs[e]:offs[e + 1]].float().t() @ x[offs[e]:offs[e + 1]].float()
    err_dw = (dw[e].float() - ref_dw).norm() / ref_dw.norm()
    print(f"rows kernel rel err {err:.2e}, accumulated wgrad rel err {err_dw:.2e}")
    return 0 if err < 1e-2 and err_dw < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
