"""Probe: the warp-specialized rows GEMMs' TMA-store epilogue against their register
stores: ``python -m benchmark.probe_ws_tma_store [--json PATH]``.

The MoE experts' forward and dgrad GEMMs (gate_up: N = K = 2048; down: N = 2048, K =
1024; 8192 tokens top-8 at random over E = 256 and 32 experts, segments padded to 16),
FP8 (:func:`~linghe.fwd.grouped_mm_ws.launch_fp8_rows_ws`, the launcher's tiles) and bf16
(:func:`~linghe.fwd.grouped_mm_ws.launch_hp_rows_ws`), each at the default
(``TMA_STORE`` on: a consumer's output part goes through shared memory and a TMA copy
that overlaps the next tile) and with ``TMA_STORE`` off (masked stores from registers
through a coalescing layout), in the same process. Checks in the same run: the two
outputs bit for bit, and the default against the float32 product of the bf16 operands
(relative error over the real rows). Times: profiler kernel µs, L2 flushed
(:func:`benchmark.harness.device_time_us`). GPU (sm_90) only; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import linghe
from linghe.bwd.grouped_mm import grouped_mm_dgrad, grouped_mm_fp8_dgrad
from linghe.fwd import grouped_mm_ws as ws
from linghe.fwd.grouped_mm import grouped_mm_fp8_fwd, grouped_mm_fwd

from .harness import device_time_us, print_columns, random_routing

#: (experts, gemm, N, K): out [R, N] from rows [R, K] (fwd) / d_out [R, N] (dgrad, K out)
CASES = [(E, name, N, K) for E in (256, 32)
         for name, N, K in (("gate_up", 2048, 2048), ("down", 2048, 1024))]


def make_case(E: int, name: str, N: int, K: int):
    """One case's inputs: ``(runs, refs, real)``, ``runs`` the four GEMMs keyed
    ``(kind, dir)`` as calls of the public grouped GEMMs (which take the WS kernels on
    sm_90), ``refs`` their float32 products of the bf16 operands (a function of the
    key, computed when called), ``real`` the routed rows' mask."""
    layout, real, bounds, _ = random_routing(8192, 8, E, 16, "cuda")
    R = real.numel()
    off = layout.offsets
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
    dy = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
    xq = linghe.quantize_1x128(x, pow2_scale=True)
    dyq = linghe.quantize_1x128(dy, pow2_scale=True)
    wq = linghe.quantize_grouped_weight(w, columnwise=True, pow2_scale=True)
    runs = {("fp8", "fwd"): partial(grouped_mm_fp8_fwd, xq, wq, off),
            ("fp8", "dgrad"): partial(grouped_mm_fp8_dgrad, dyq, wq, off),
            ("bf16", "fwd"): partial(grouped_mm_fwd, x, w, off, backend="triton"),
            ("bf16", "dgrad"): partial(grouped_mm_dgrad, dy, w, off, backend="triton")}

    def ref(direction: str) -> torch.Tensor:
        a, b = (x, w.transpose(1, 2)) if direction == "fwd" else (dy, w)
        out = torch.zeros(R, b.shape[2], device="cuda")
        for e in range(E):
            sl = slice(bounds[e], bounds[e + 1])
            out[sl] = a[sl].float() @ b[e].float()
        return out

    return runs, ref, real


def _case_rows(E: int, name: str, N: int, K: int) -> list[dict]:
    runs, refs, real = make_case(E, name, N, K)
    R = real.numel()
    rows = []
    for (kind, direction), run in runs.items():
        ref = refs(direction)
        config = ws.WS_CONFIG if kind == "fp8" else ws.HP_WS_CONFIG
        row = dict(E=E, gemm=name, kind=kind, dir=direction, R=R, N=N, K=K)
        outs = {}
        default = config["TMA_STORE"]
        for key, tma_store in (("tma_store", True), ("reg_store", False)):
            config["TMA_STORE"] = tma_store
            try:
                outs[key] = run()
                row[key + "_us"] = device_time_us(run)
            finally:
                config["TMA_STORE"] = default
        y = outs["tma_store"]
        row["same_bits"] = bool(torch.equal(y, outs["reg_store"]))
        row["rel_err"] = ((y.float() - ref)[real].norm() / ref[real].norm()).item()
        row["speedup"] = row["reg_store_us"] / row["tma_store_us"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_ws_tma_store")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not ws.ws_capable(torch.empty(1, device="cuda")):
        print("probe_ws_tma_store: needs an sm_90 GPU with Gluon")
        return 1
    rows = []
    for case in CASES:
        rows += _case_rows(*case)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), fh, indent=1)
    return print_ab(f"WS rows GEMMs, TMA-store epilogue vs register stores "
                    f"({torch.cuda.get_device_name()}; kernel µs, L2 flushed)", rows,
                    ("tma_store", "TMA store"), ("reg_store", "register"))


def print_ab(title: str, rows: list[dict], new: tuple[str, str], old: tuple[str, str]) -> int:
    """The A/B table of these probes (printed last): per case the ``new`` and ``old``
    sides' µs (``(row key prefix, column name)``), the speedup, the bit check and the
    error; the exit code: 0 when every case has the same bits, else 2."""
    print(title)
    print_columns(["E", "gemm", "kind", "dir", f"{new[1]} µs", f"{old[1]} µs", "speedup",
                   "same bits", "rel err"],
                  [[r["E"], r["gemm"], r["kind"], r["dir"], f"{r[new[0] + '_us']:.1f}",
                    f"{r[old[0] + '_us']:.1f}", f"{r['speedup']:.3f}x", r["same_bits"],
                    f"{r['rel_err']:.2e}"] for r in rows])
    return 0 if all(r["same_bits"] for r in rows) else 2


if __name__ == "__main__":
    raise SystemExit(main())
