"""Host-side cProfile of the e2e step: ``python -m benchmark.probe_e2e_host OUTDIR [MODES]``
(``MODES``: comma-separated, default ``fp8,bf16``).

Builds the Ling-mini e2e model (4 micro-batches, deferred wgrad, the FP8 head,
norm-from-backward, balanced routing), runs 3 warm-up steps per mode (fp8, then bf16),
then profiles 5 steps with ``cProfile`` and writes ``OUTDIR/host_{mode}.txt`` (by own
time, then by cumulative time) with the host loop's ms per step (under the profiler,
which roughly doubles Python's cost) beside the ms per step to the GPU's end. Where
the host loop approaches the GPU time, a slower host makes the step host-bound. GPU only.
"""
import cProfile
import io
import pstats
import sys
import time

import torch

from benchmark.probe_e2e_gaps import probe_stepper

out = sys.argv[1] if len(sys.argv) > 1 else "."
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp8", "bf16"]
for mode in modes:
    _cfg, model, opt, _batches, step = probe_stepper(mode)
    # host time alone: the GPU is kept busy, the host never waits except where it must
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for i in range(3, 8):
        step(i)
    pr.disable()
    t_host = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_all = time.perf_counter() - t0
    s = io.StringIO()
    ps = pstats.Stats(pr, stream=s).sort_stats("tottime")
    ps.print_stats(45)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(60)
    with open(f"{out}/host_{mode}.txt", "w") as f:
        f.write(f"{mode}: 5 steps, host loop {t_host * 1e3 / 5:.1f} ms/step (under cProfile), "
                f"to the GPU's end {t_all * 1e3 / 5:.1f} ms/step\n")
        f.write(s.getvalue())
        f.write(s2.getvalue())
    print(mode, f"host {t_host * 1e3 / 5:.1f} ms/step under cProfile, all {t_all * 1e3 / 5:.1f}")
    del model, opt, step
    torch.cuda.empty_cache()
