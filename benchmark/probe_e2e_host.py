"""Host-side cProfile of the e2e step: ``python -m benchmark.probe_e2e_host OUTDIR``.

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

from benchmark import e2e, e2e_model
from benchmark.e2e_model import ByteBatches, build_model, force_balanced_routing, make_optimizer

out = sys.argv[1] if len(sys.argv) > 1 else "."
args = e2e.parse_args(["--micro-batches", "4", "--deferred-wgrad", "--norm-from-backward",
                       "--lm-head-fp8", "--mode", "fp8"])
cfg = e2e.config_from_args(args, "cuda")
e2e_model.LM_HEAD_FP8 = True
e2e_model.NORM_FROM_BACKWARD = True
data = e2e.stdlib_corpus(e2e.corpus_bytes_needed(cfg, 20 * cfg.micro_batches))
for mode in ("fp8", "bf16"):
    model = build_model(cfg, device="cuda", seed=0)
    opt = make_optimizer(model, 1e-3, mode=mode)
    batches = ByteBatches(data, cfg.batch, cfg.seq, "cuda")
    force_balanced_routing(model)
    step = e2e.make_stepper(model, opt, batches, mode, graph=False, warmup=3,
                            micro_batches=cfg.micro_batches)
    torch.cuda.synchronize()
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
