"""Probe: the warp-specialized rows GEMMs of this tree against those of an earlier one:
``python -m benchmark.probe_ws_rows [--old-rev REV | --old DIR] [--rounds N] [--json
PATH]``.

The MoE experts' forward and dgrad GEMMs at the e2e's shapes (the cases of
:mod:`benchmark.probe_ws_tma_store`: gate_up and down, 8192 tokens top-8 over 256 and
32 experts), FP8 and bf16, through the public grouped GEMMs, once with this tree's
:mod:`linghe.fwd.grouped_mm_ws` launchers and once with the old module's (git
``--old-rev``, default ``HEAD``, or ``DIR/grouped_mm_ws.py`` / ``DIR/linghe/fwd/...``
for a copy of the tree without git), in the same process, alternating for ``--rounds``
rounds (the median of each side's rounds is reported). Checks in the same run: the new
output bit for bit against the old, and against the float32 product of the bf16
operands (relative error over the routed rows). Times: profiler kernel µs, L2 flushed
(:func:`benchmark.harness.device_time_us`). sm_90 only; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from linghe.fwd import grouped_mm as gm
from linghe.fwd import grouped_mm_ws as ws

from .harness import device_time_us, load_module_at
from .probe_ws_tma_store import CASES, make_case, print_ab

_LAUNCHERS = ("launch_fp8_rows_ws", "launch_hp_rows_ws")


def _load_old(old_dir: str | None, rev: str):
    src = None
    if old_dir:
        for d in (old_dir, os.path.join(old_dir, "linghe", "fwd")):
            if os.path.exists(os.path.join(d, "grouped_mm_ws.py")):
                src = d
        if src is None:
            raise FileNotFoundError(f"no grouped_mm_ws.py under {old_dir}")
    return load_module_at(rev, "linghe/fwd/grouped_mm_ws.py", "linghe.fwd._grouped_mm_ws_old",
                          src_dir=src)


def _with(launchers: dict, run):
    """``run()`` with ``linghe.fwd.grouped_mm`` launching through ``launchers``."""
    saved = {n: getattr(gm, n) for n in _LAUNCHERS}
    for n, f in launchers.items():
        setattr(gm, n, f)
    try:
        return run()
    finally:
        for n, f in saved.items():
            setattr(gm, n, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_ws_rows")
    p.add_argument("--old-rev", default="HEAD", help="git revision of the old module")
    p.add_argument("--old", default=None, metavar="DIR",
                   help="folder holding the old grouped_mm_ws.py (copies without git)")
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not ws.ws_capable(torch.empty(1, device="cuda")):
        print("probe_ws_rows: needs an sm_90 GPU with Gluon")
        return 1
    old_mod = _load_old(args.old, args.old_rev)
    sides = {"new": {n: getattr(ws, n) for n in _LAUNCHERS},
             "old": {n: getattr(old_mod, n) for n in _LAUNCHERS}}
    rows = []
    for case in CASES:
        runs, refs, real = make_case(*case)
        for (kind, direction), run in runs.items():
            outs = {k: _with(f, run) for k, f in sides.items()}
            times = {k: [] for k in sides}
            for _ in range(args.rounds):
                for k, f in sides.items():
                    times[k].append(device_time_us(lambda f=f, run=run: _with(f, run)))
            ref = refs(direction)
            y = outs["new"]
            row = dict(E=case[0], gemm=case[1], kind=kind, dir=direction, R=real.numel(),
                       N=case[2], K=case[3], new_us=statistics.median(times["new"]),
                       old_us=statistics.median(times["old"]), new_rounds=times["new"],
                       old_rounds=times["old"],
                       same_bits=bool(torch.equal(y, outs["old"])),
                       rel_err=((y.float() - ref)[real].norm() / ref[real].norm()).item())
            row["speedup"] = row["old_us"] / row["new_us"]
            rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), old=args.old or args.old_rev,
                           rows=rows), fh, indent=1)
    return print_ab(f"WS rows GEMMs, this tree vs {args.old or args.old_rev} "
                    f"({torch.cuda.get_device_name()}; kernel µs, L2 flushed, median of "
                    f"{args.rounds} alternating rounds)", rows, ("new", "new"), ("old", "old"))


if __name__ == "__main__":
    raise SystemExit(main())
