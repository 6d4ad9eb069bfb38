"""Key Nsight Compute metrics of kernel launches side by side, from "raw page" CSVs:
``python -m benchmark.ncu_metrics RAW.csv[.gz] [RAW2.csv[.gz] ...] [--json PATH]``.

Each CSV is what ``ncu -i REPORT.ncu-rep --page raw --csv`` prints for a report taken
with ``ncu --set full -k regex:KERNEL -o REPORT python ...``: a row of metric names, a
row of units, then one row per profiled launch. Prints one table (a row per metric, a
column per launch of every file; times in µs, clocks in GHz, bytes in GB) and, last, a
verdict per launch: its busiest unit (tensor pipe, issue slots, L2, DRAM or shared
memory banks) and whether that unit bounds it (80% of peak or more) or nothing does
(latency-bound). ``--json`` writes the rows of :func:`summarize`.

Reads the committed ``benchmark/results/*ncu_raw*.csv.gz`` as they are.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os

from .harness import print_columns
from .ncu_source import read_csv

# (label, metric names tried in order; a pattern matches by fnmatch)
METRICS: list[tuple[str, tuple[str, ...]]] = [
    ("duration us", ("gpu__time_duration.sum",)),
    ("SM clock GHz", ("sm__cycles_elapsed.avg.per_second",)),
    ("tensor pipe active %", ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",)),
    ("FP8 tensor ops", ("sm__ops_path_tensor_src_fp8_sparsity_off.sum",)),
    ("issue slots busy %", ("smsp__issue_active.avg.pct_of_peak_sustained_active",)),
    ("FMA pipe %", ("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",)),
    ("warps active / SM", ("sm__warps_active.avg.per_cycle_active",)),
    ("shared bank reads %", ("l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed",)),
    ("shared bank writes %", ("l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed",)),
    ("L1 throughput %", ("l1tex__throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("L2 throughput %", ("lts__throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("L2 hit %", ("lts__t_sector_hit_rate.pct",)),
    ("DRAM throughput %", ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                           "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                           "dram__cycles_active.avg.pct_of_peak_sustained_elapsed")),
    ("DRAM read GB", ("dram__bytes_read.sum",)),
    ("DRAM write GB", ("dram__bytes_write.sum",)),
    ("local spill requests", ("l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum",
                              "*local_op_ld.sum")),
]
# the units the verdict compares, by the short name it prints
UNITS = {"tensor pipe": "tensor pipe active %", "issue slots": "issue slots busy %",
         "L2": "L2 throughput %", "DRAM": "DRAM throughput %",
         "shared bank reads": "shared bank reads %"}
# unit (lower case) -> factor into µs, GHz or GB; other units are kept as they are
_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
          "s": 1e6, "second": 1e6, "hz": 1e-9, "khz": 1e-6, "mhz": 1e-3, "ghz": 1.0,
          "byte": 1e-9, "kbyte": 1e-6, "mbyte": 1e-3, "gbyte": 1.0, "tbyte": 1e3}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(paths: list[str]) -> list[dict]:
    """One dict per launch (each data row of each raw-page CSV, plain or gzipped):
    ``{"file": name without .csv[.gz], "kernel": ..., label: value or None, ...}``."""
    out = []
    for path in paths:
        rows = [r for r in read_csv(path) if r]
        if len(rows) < 3 or "Kernel Name" not in rows[0]:
            raise ValueError(f"{path}: no launch rows (not an ncu --page raw CSV?)")
        head, units = rows[0], rows[1]
        cols = {}
        for label, names in METRICS:
            found = [n for pat in names for n in fnmatch.filter(head, pat)]
            cols[label] = head.index(found[0]) if found else None
        name = os.path.basename(path).removesuffix(".gz").removesuffix(".csv")
        i_kernel = head.index("Kernel Name")
        for r in rows[2:]:
            d = {"file": name, "kernel": r[i_kernel]}
            for label, i in cols.items():
                v = _number(r[i]) if i is not None and i < len(r) else None
                d[label] = None if v is None else v * _SCALE.get(units[i].lower(), 1.0)
            out.append(d)
    return out


def busiest(row: dict) -> tuple[str, float]:
    """The unit of :data:`UNITS` nearest its peak in ``row``, and its %."""
    return max(((u, row[label]) for u, label in UNITS.items() if row[label] is not None),
               key=lambda t: t[1], default=("none", 0.0))


def _short(names: list[str]) -> list[str]:
    """``names`` without the prefix and suffix they all share (cut at a ``_``)."""
    if len(set(names)) < 2:
        return names
    pre = os.path.commonprefix(names)
    suf = os.path.commonprefix([n[::-1] for n in names])[::-1]
    pre = pre[:pre.rfind("_") + 1]
    suf = suf[suf.find("_"):] if "_" in suf else ""
    return [n[len(pre):len(n) - len(suf)] or n for n in names]


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1e6:
        return f"{v:.3e}"
    return str(int(v)) if v == int(v) else f"{v:.4g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.ncu_metrics")
    p.add_argument("csv", nargs="+", help="ncu --page raw --csv output (.gz ok)")
    p.add_argument("--json", help="write the launches' metrics here")
    args = p.parse_args(argv)
    rows = summarize(args.csv)
    heads = [f"{f} ({r['kernel']})" for f, r in zip(_short([r["file"] for r in rows]), rows)]
    print_columns(["metric"] + heads,
                  [[label] + [_fmt(r[label]) for r in rows] for label, _ in METRICS])
    for h, r in zip(heads, rows):
        unit, pct = busiest(r)
        bound = f"{unit}-bound" if pct >= 80 else "none above 80%: latency-bound"
        print(f"{h}: busiest unit {unit} {pct:.1f}%; {bound}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
