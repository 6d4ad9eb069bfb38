"""Where a kernel's warps stall, instruction by instruction, from an Nsight Compute
source page: ``python -m benchmark.ncu_source REPORT.csv[.gz] [--top N] [--min-samples S]``.

The CSV is what ``ncu -i REPORT.ncu-rep --page source --csv --print-source sass`` prints
for a report taken with ``--section SourceCounters`` (warp-state sampling; see
:mod:`benchmark.ncu_grouped` for the command). Prints, last, two tables:

- **regions**: runs of consecutive SASS instructions that executed the same number of
  times (a loop body, a per-tile prologue, the idle warps' park at the
  warp-specialize barrier, ...), with their share of the samples and their top stall
  reasons; a region executed once a CTA per idle warp is where padding warps wait, and
  costs nothing;
- **top instructions**: the most-sampled instructions with their stall reasons.

Reads the committed ``benchmark/results/*ncu_source*.csv.gz`` as they are.
"""

from __future__ import annotations

import argparse
import csv
import gzip
from collections import Counter
from dataclasses import dataclass

from .harness import print_columns


@dataclass
class Instruction:
    index: int
    sass: str
    executed: int
    samples: int
    stalls: Counter


def read_csv(path: str) -> list[list[str]]:
    """The rows of an ncu CSV export, plain or gzipped (``.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as fh:
        return list(csv.reader(fh))


def read_source_csv(path: str) -> list[Instruction]:
    """The per-instruction rows of an ncu source-page CSV (plain or gzipped): the SASS
    text, the executed count, the warp-state samples and the samples by stall reason
    (``stall_*`` columns, without the "not issued" ones)."""
    rows = read_csv(path)
    start = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    hdr = rows[start]
    i_src = hdr.index("Source")
    i_all = hdr.index("Warp Stall Sampling (All Samples)")
    i_exe = hdr.index("Instructions Executed")
    stall = [(i, h[len("stall_"):]) for i, h in enumerate(hdr)
             if h.startswith("stall_") and "(Not" not in h]
    out = []
    for r in rows[start + 1:]:
        if len(r) < len(hdr) or not r[i_all].strip().isdigit():
            continue
        c = Counter({name: int(r[i]) for i, name in stall if r[i].strip().isdigit()
                     and int(r[i])})
        out.append(Instruction(len(out), r[i_src].strip(), int(r[i_exe] or 0),
                               int(r[i_all]), c))
    if not out:
        raise ValueError(f"{path}: no instruction rows (not an ncu --page source CSV?)")
    return out


def regions(ins: list[Instruction]) -> list[tuple[int, int, int, int, Counter]]:
    """``(first, last, executed, samples, stalls)`` for each run of consecutive
    instructions with the same executed count."""
    out = []
    start = 0
    for k in range(1, len(ins) + 1):
        if k == len(ins) or ins[k].executed != ins[start].executed:
            part = ins[start:k]
            out.append((start, k - 1, ins[start].executed, sum(i.samples for i in part),
                        sum((i.stalls for i in part), Counter())))
            start = k
    return out


def _reasons(c: Counter, n: int = 3) -> str:
    return ", ".join(f"{name} {v}" for name, v in c.most_common(n))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.ncu_source")
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz ok)")
    p.add_argument("--top", type=int, default=15, help="instructions listed")
    p.add_argument("--min-share", type=float, default=0.5,
                   help="regions with at least this %% of the samples are listed")
    args = p.parse_args(argv)
    ins = read_source_csv(args.csv)
    total = sum(i.samples for i in ins)
    reasons = sum((i.stalls for i in ins), Counter())
    print(f"{len(ins)} SASS instructions, {total} warp-state samples; by reason: "
          f"{_reasons(reasons, 6)}")
    rows = [[f"{a}-{b}", ex, s, f"{100 * s / total:.1f}%", _reasons(c)]
            for a, b, ex, s, c in regions(ins) if 100 * s / total >= args.min_share]
    print("regions (consecutive instructions executed the same number of times):")
    print_columns(["instructions", "executed", "samples", "share", "top stalls"], rows)
    top = sorted(ins, key=lambda i: -i.samples)[:args.top]
    print("top instructions:")
    print_columns(["#", "samples", "executed", "SASS", "stalls"],
                  [[i.index, i.samples, i.executed, i.sass[:60], _reasons(i.stalls, 2)]
                   for i in top])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
