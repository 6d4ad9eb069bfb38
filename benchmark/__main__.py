"""``python -m benchmark [--case NAME ...] [--quick] [--json PATH] [--list]``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

if not torch.cuda.is_available():
    # No GPU: run the same Triton kernels through the interpreter (must precede import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from . import cases as _register_cases  # noqa: E402,F401  (imports every case file)
from .harness import (  # noqa: E402
    PROVIDERS,
    Config,
    cases,
    copy_bandwidth_gbps,
    fmt,
    run_bench,
)


def print_table(rows, file=sys.stdout):
    head = ["case", "provider", "µs", "kernel µs", "host µs", "GB/s", "% copy", "TFLOP/s",
            "vs eager", "vs compile", "rel err"]
    lines = []
    for r in rows:
        if r["error"]:
            lines.append([r["case"], r["provider"], "error: " + r["error"][:60], "", "", "",
                          "", "", "", "", ""])
            continue
        err = fmt(r["rel_err"], ".1e") + ("" if r["ok"] in (None, True) else " FAIL")
        lines.append([r["case"], r["provider"], fmt(r["us"], ".1f"),
                      fmt(r.get("device_us"), ".1f"),
                      fmt(r.get("host_us"), ".1f") + (" (waited)" if r.get("host_waited") else ""),
                      fmt(r["gbps"], ".0f"),
                      fmt(r["pct_copy"], ".0f"), fmt(r.get("tflops"), ".1f"),
                      fmt(r["vs_eager"], ".2f") + "x",
                      fmt(r["vs_compile"], ".2f") + "x", err])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)] if lines else []
    fmt_line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    print(fmt_line(head), file=file)
    print("-+-".join("-" * w for w in widths), file=file)
    for line in lines:
        print(fmt_line(line), file=file)


def select_cases(names: list[str], wanted: list[str]) -> list[str]:
    """The cases ``wanted`` picks from ``names``: each argument the case it names exactly
    (``grouped_mm``, not ``grouped_mm_deferred`` too), else every case whose name
    contains it."""
    return [n for n in names if any(n == c or (c not in names and c in n) for c in wanted)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark", description=__doc__)
    p.add_argument("--case", nargs="*", default=None,
                   help="case names (a name given exactly runs alone; else substrings of "
                        "names) to run; default: all")
    p.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    p.add_argument("--json", default=None, help="write the rows and device facts here")
    p.add_argument("--providers", default=None,
                   help="comma-separated providers (default: eager,compile,linghe; on CPU "
                        "eager,linghe, since inductor's CPU code is not what is compared)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)

    all_cases = cases()
    if args.list:
        print("\n".join(sorted(all_cases)))
        return 0
    names = sorted(all_cases)
    if args.case:
        names = select_cases(names, args.case)
        if not names:
            print(f"no case matches {args.case}; --list shows them", file=sys.stderr)
            return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = Config(device=device, quick=args.quick or device == "cpu")
    dev_name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    if device == "cpu":
        print("No GPU: tiny shapes through the Triton interpreter. These are interpreter "
              "timings, not kernel performance.", file=sys.stderr)
    copy_gbps = copy_bandwidth_gbps(cfg)
    print(f"device: {dev_name}; copy bandwidth {copy_gbps:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", file=sys.stderr)
    default = PROVIDERS if device == "cuda" else ("eager", "linghe")
    providers = [x for x in (args.providers or ",".join(default)).split(",") if x]
    rows = []
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}", file=sys.stderr, flush=True)
        try:
            benches = all_cases[name](cfg)
        except Exception as e:
            rows.append({"case": name, "provider": "-", "error": f"{type(e).__name__}: {e}",
                         "us": None})
            continue
        for b in benches:
            extra = [k for k in b.run if k not in providers and k not in PROVIDERS]
            rows += run_bench(b, cfg, copy_gbps, providers + extra)
            if device == "cuda":
                torch.cuda.empty_cache()
    print_table(rows)
    # notes that carry measurements (e.g. peak memory), once per case
    seen = set()
    for r in rows:
        note = r.get("note") or ""
        if r.get("case") not in seen and ("MiB" in note or "GB" in note):
            seen.add(r.get("case"))
            print(f"note: {r['case']}: {note}")
    failed = [r for r in rows if r.get("ok") is False]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": dev_name, "copy_gbps": copy_gbps,
                       "torch": torch.__version__, "triton": triton.__version__,
                       "interpreter": device == "cpu", "rows": rows}, f, indent=1)
    if failed:
        print(f"{len(failed)} result(s) failed the correctness check", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
