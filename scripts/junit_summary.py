"""Per-file pass/fail table from pytest JUnit XML files (used by scripts/gpu_check.sh).

Usage: python3 scripts/junit_summary.py JUNIT.xml [JUNIT.xml ...]

Prints, per test file: passed, failed (failures and errors), skipped and the summed test
time (with xdist, time spent in all workers together); then the failed tests, the slowest
tests and, where the test run recorded it (tests/conftest.py on a GPU), the tests with the
largest peak GPU memory. Standard library only: it runs with whatever python runs pytest.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def _file_of(case: ET.Element) -> str:
    f = case.get("file")  # junit_family=xunit1
    if f:
        return f
    # xunit2: classname "tests.test_norm" or "tests.test_norm.TestClass"
    parts = (case.get("classname") or "?").split(".")
    mods = [p for p in parts if not p[:1].isupper()]
    return "/".join(mods) + ".py"


def _status(case: ET.Element) -> str:
    for tag in ("failure", "error"):
        if case.find(tag) is not None:
            return "failed"
    if case.find("skipped") is not None:
        return "skipped"
    return "passed"


def summarize(paths: list[str], top: int = 5) -> str:
    per_file: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    failed, times, peaks = [], [], []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            print(f"{path}: not readable ({e})", file=sys.stderr)
            continue
        for case in root.iter("testcase"):
            if not case.get("name"):  # left by xdist workers that were interrupted
                continue
            f = _file_of(case)
            st = _status(case)
            t = float(case.get("time") or 0.0)
            row = per_file[f]
            row[st] += 1
            row["time"] += t
            name = f"{f}::{case.get('name')}"
            if st == "failed":
                node = case.find("failure")
                node = node if node is not None else case.find("error")
                msg = (node.get("message") or "").splitlines()
                failed.append(f"{name} - {msg[0][:100] if msg else ''}")
            times.append((t, name))
            for prop in case.iter("property"):
                if prop.get("name") == "gpu_peak_mib":
                    peaks.append((float(prop.get("value")), name))
    lines = [f"{'passed':>7} {'failed':>7} {'skipped':>7} {'time s':>8}  file"]
    total: dict[str, float] = defaultdict(float)
    for f in sorted(per_file):
        row = per_file[f]
        for k, v in row.items():
            total[k] += v
        mark = "  <-- FAILED" if row["failed"] else ""
        lines.append(f"{int(row['passed']):7d} {int(row['failed']):7d} "
                     f"{int(row['skipped']):7d} {row['time']:8.1f}  {f}{mark}")
    lines.append(f"{int(total['passed']):7d} {int(total['failed']):7d} "
                 f"{int(total['skipped']):7d} {total['time']:8.1f}  all files")
    if times:
        lines.append(f"slowest {top} tests:")
        lines += [f"  {t:7.1f} s  {n}" for t, n in sorted(times, reverse=True)[:top]]
    if peaks:
        lines.append(f"largest peak GPU memory, {top} tests:")
        lines += [f"  {m:7.0f} MiB  {n}" for m, n in sorted(peaks, reverse=True)[:top]]
    if failed:
        lines.append(f"failed ({len(failed)}):")
        lines += [f"  {x}" for x in failed[:40]]
        if len(failed) > 40:
            lines.append(f"  ... and {len(failed) - 40} more")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(summarize(sys.argv[1:]))
