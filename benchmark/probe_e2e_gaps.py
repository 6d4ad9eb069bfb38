"""Where the e2e step's GPU waits for the host, attributed to host code:
``python -m benchmark.probe_e2e_gaps [--mode fp8,bf16] [--json PATH]``.

``benchmark.e2e`` reports the GPU's idle time per step and its longest gaps by the
kernels around them. This probe says what the *host* was doing then: it profiles
``--steps`` steps of the same configuration as ``probe_e2e_host`` (4 micro-batches,
deferred wgrad, the FP8 head, norm-from-backward, balanced routing) with CPU activity
and Python stacks, and for each of the ``--top`` longest gaps between kernels prints

- the gap (µs) and the kernels around it;
- ``lag``: how long after its launch the kernel after the gap started (a few µs: it was
  launched late, the host was behind; long: the GPU waited on something else);
- ``host``: the time between the two kernels' launches on the host;
- the innermost linghe / benchmark / torch frames (``--stack``; else the torch ops) on
  the host at a few points between those launches, i.e. the host code that ran while
  the GPU waited;

then the host calls into CUDA that took >= 100 µs (synchronizations, pinned allocations)
and the points where the GPU's queue ran dry (a kernel that started within 30 µs of its
launch after one that had waited >= 1 ms).

``--phases``: instead of the profile, the host time of each phase of a step (each
micro-batch's forward+backward, the update) measured without any profiler, each behind a
GPU spin so that the host never waits, beside the GPU time of the same phase (events
around its queued work): where a phase's host time exceeds its GPU time, the GPU waits
for the host there.

GPU only (the profile needs CUDA kernels)."""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import os
import tempfile

import torch

from benchmark import e2e, e2e_model
from benchmark.e2e_model import ByteBatches, build_model, force_balanced_routing, make_optimizer

_GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
_KEEP = ("linghe/", "benchmark/", "torch/autograd", "torch/optim", "torch/nn/modules")


#: The repository root, cut from the frames' file names.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _frames(stacks, starts, t: float, depth: int = 5) -> list[str]:
    """The innermost ``depth`` kept frames (Python functions, torch ops) active at host
    time ``t``: every event that started by ``t`` and had not ended (a scan of the
    started ones, outermost first: a few queries per report)."""
    i = bisect.bisect_right(starts, t)
    active = [s for s in stacks[:i] if t <= s[1]]
    active.sort(key=lambda s: (s[0], -s[1]))
    names = [s[2] for s in active
             if s[3] != "python_function" or any(k in s[2] for k in _KEEP)]
    return [n.split(_ROOT)[-1].split("site-packages/")[-1] for n in names[-depth:]]


def gap_report(trace: dict, top: int = 15, min_us: float = 30.0, points: int = 3) -> dict:
    """The longest GPU gaps of a chrome trace (``torch.profiler`` with CPU+CUDA and
    ``with_stack``) with their host attribution (module docstring)."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in ev if e.get("cat") in _GPU_CATS), key=lambda e: e["ts"])
    runtime = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch = {e["args"]["correlation"]: e["ts"] for e in runtime
              if "correlation" in e.get("args", {})}
    stacks = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e["cat"]) for e in ev
                    if e.get("cat") in ("python_function", "cpu_op", "user_annotation"))
    starts = [s[0] for s in stacks]
    gaps, idle = [], 0.0
    if not gpu:
        return {"idle_us": 0.0, "gaps": []}
    end, prev = gpu[0]["ts"] + gpu[0]["dur"], gpu[0]
    for e in gpu[1:]:
        if e["ts"] > end:
            idle += e["ts"] - end
            if e["ts"] - end >= min_us:
                gaps.append((e["ts"] - end, prev, e))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    gaps.sort(key=lambda g: -g[0])
    out = []
    for us, a, b in gaps[:top]:
        la = launch.get(a.get("args", {}).get("correlation"))
        lb = launch.get(b.get("args", {}).get("correlation"))
        row = {"us": round(us, 1), "after": a["name"][:90], "before": b["name"][:90],
               "lag_us": None if lb is None else round(b["ts"] - lb, 1),
               "host_us": None if la is None or lb is None else round(lb - la, 1)}
        if la is not None and lb is not None and lb > la:
            row["host_frames"] = [_frames(stacks, starts, la + (lb - la) * (k + 1) / (points + 1))
                                  for k in range(points)]
            row["launch_frames"] = _frames(stacks, starts, lb - 0.5, depth=8)
        out.append(row)
    # host calls that block (synchronizations, pinned allocations...): long runtime calls
    blocking = sorted(((e["dur"], e["name"], _frames(stacks, starts, e["ts"], depth=4))
                       for e in runtime if e["dur"] >= 100), key=lambda b: -b[0])
    # where the GPU's queue ran dry: a kernel started within 30 us of its launch after one
    # that waited >= 1 ms in the queue
    drains, prev_lag = [], 0.0
    for e in gpu:
        lt = launch.get(e.get("args", {}).get("correlation"))
        if lt is None:
            continue
        lag = e["ts"] - lt
        if lag < 30 and prev_lag >= 1000:
            drains.append({"kernel": e["name"][:80], "ts_ms": round(e["ts"] / 1e3, 2),
                           "frames": _frames(stacks, starts, lt - 0.5, depth=6)})
        prev_lag = lag
    return {"idle_us": idle, "gaps": out,
            "blocking": [{"us": round(d, 1), "call": n, "frames": f}
                         for d, n, f in blocking[:top]],
            "drains": drains[:top]}


def phase_times(model, opt, batches, mode: str, step: int, micro_batches: int,
                spin_us: float = 600_000.0) -> list[dict]:
    """Host and GPU ms of each phase of step ``step`` (module docstring, ``--phases``)."""
    import time

    from benchmark.harness import _spin

    micro = [batches(step * micro_batches + j) for j in range(micro_batches)]
    tpes = None
    out = []

    def timed(name, fn):
        torch.cuda.synchronize()
        _spin(spin_us)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        r = fn()
        host = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        out.append({"phase": name, "host_ms": host, "gpu_ms": start.elapsed_time(end),
                    "waited": host >= 0.9 * spin_us / 1e3})
        return r

    for j, (tok, lab) in enumerate(micro):
        _, t = timed(f"micro-batch {j} fwd+bwd", functools.partial(
            e2e_model.forward_backward, model, opt, tok, lab, mode, accumulate=j > 0,
            loss_scale=1.0 / micro_batches))
        tpes = t if tpes is None else [a + b for a, b in zip(tpes, t)]
    timed("update", lambda: e2e_model.update(model, opt, tpes, mode))
    return out


def probe_stepper(mode: str, warmup: int = 3):
    """The probes' e2e setup (``probe_e2e_host`` shares it): the Ling-mini model with 4
    micro-batches, deferred wgrad, the FP8 head, norm-from-backward and balanced routing,
    warmed up ``warmup`` steps. Returns ``(cfg, model, opt, batches, step)``."""
    eargs = e2e.parse_args(["--micro-batches", "4", "--deferred-wgrad", "--norm-from-backward",
                            "--lm-head-fp8", "--mode", mode])
    cfg = e2e.config_from_args(eargs, "cuda")
    e2e_model.LM_HEAD_FP8 = True
    e2e_model.NORM_FROM_BACKWARD = True
    data = e2e.stdlib_corpus(e2e.corpus_bytes_needed(cfg, 20 * cfg.micro_batches))
    model = build_model(cfg, device="cuda", seed=0)
    opt = make_optimizer(model, 1e-3, mode=mode)
    batches = ByteBatches(data, cfg.batch, cfg.seq, "cuda")
    force_balanced_routing(model)
    step = e2e.make_stepper(model, opt, batches, mode, graph=False, warmup=warmup,
                            micro_batches=cfg.micro_batches)
    torch.cuda.synchronize()
    return cfg, model, opt, batches, step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="fp8")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument("--stack", action="store_true",
                    help="record Python stacks (names the host code, but slows the host "
                         "several times, FP8's most)")
    ap.add_argument("--phases", action="store_true",
                    help="host vs GPU ms of each phase of a step, no profiler")
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    report = {}
    for mode in args.mode.split(","):
        cfg, model, opt, batches, step = probe_stepper(mode)
        if args.phases:
            rows = [phase_times(model, opt, batches, mode, 3 + i, cfg.micro_batches)
                    for i in range(args.steps)]
            report[mode] = rows
            print(f"\n{mode}: host ms / GPU ms per phase (no profiler; each behind a spin)")
            for k in range(len(rows[0])):
                cells = "  ".join(f"{r[k]['host_ms']:7.1f} / {r[k]['gpu_ms']:7.1f}"
                                  + ("!" if r[k]["waited"] else "") for r in rows)
                print(f"  {rows[0][k]['phase']:24s} {cells}")
            tot = [(sum(p["host_ms"] for p in r), sum(p["gpu_ms"] for p in r)) for r in rows]
            print("  step                     " + "  ".join(f"{h:7.1f} / {g:7.1f}"
                                                         for h, g in tot))
            del model, opt, step
            torch.cuda.empty_cache()
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     with_stack=args.stack) as prof:
            for i in range(3, 3 + args.steps):
                step(i)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        rep = gap_report(trace, top=args.top)
        rep["idle_ms_per_step"] = rep.pop("idle_us") / 1e3 / args.steps
        report[mode] = rep
        print(f"\n{mode}: GPU idle {rep['idle_ms_per_step']:.2f} ms a step (profiled, "
              "with Python stacks: the host runs slower than unprofiled)")
        for g in rep["gaps"]:
            print(f"  {g['us']:7.1f} us  lag {g['lag_us']} host {g['host_us']}  "
                  f"{g['after'][:50]} -> {g['before'][:50]}")
            for fr in g.get("host_frames", []):
                print("      during: " + " > ".join(fr))
            if g.get("launch_frames"):
                print("      launch: " + " > ".join(g["launch_frames"]))
        for b in rep["blocking"]:
            print(f"  blocking {b['us']:8.1f} us  {b['call']}  in " + " > ".join(b["frames"]))
        for d in rep["drains"]:
            print(f"  queue ran dry at {d['ts_ms']} ms before {d['kernel'][:50]}  launched in "
                  + " > ".join(d["frames"]))
        del model, opt, step, prof, trace
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
