"""Dispatch/combine bandwidth of linghe.dist.ExpertParallelDispatcher over NCCL.

Spawns its own ranks (no torchrun): ``python -m benchmark.dist_a2a OUT.json [--world 2]``
(run from the repository root). Per rank: T 8192 tokens, hidden 2048, top-8 of 256 experts
(random routing, so about half the copies cross to the peer on 2 ranks), bf16 tokens.

Rows of the table (median of ``--iters`` timed calls, CUDA events, barrier before each):

- ``plain a2a bf16`` / ``plain a2a fp8``: one ``all_to_all_single`` of the same bytes the
  dispatcher sends (``T*k`` rows of ``H`` bf16 / of ``H`` e4m3 bytes + ``H/128`` fp32
  scales, equal splits) — the bandwidth to compare against;
- ``dispatch bf16`` / ``dispatch fp8`` (default mode: one host sync for the split sizes),
  ``dispatch bf16 cap1.25`` (static-shape capacity mode), ``combine bf16``.

GB/s = bytes that leave one rank's payload buffer (``T*k`` rows, self-copies included, as
``all_to_all_single`` counts them) / time. NCCL_NVLS_ENABLE=0 is set for the ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    # the slowest rank decides
    t = torch.tensor([statistics.median(ts)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _worker(rank, world, port, args, q):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    from linghe.dist import ExpertParallelDispatcher

    T, H, E, k = args.tokens, args.hidden, args.experts, args.topk
    dev = torch.device("cuda", rank)
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :k].to(dev, torch.int32)
    probs = torch.rand(T, k, generator=g).to(dev)
    rows_bytes_bf16 = T * k * H * 2
    rows_bytes_fp8 = T * k * (H + 4 * ((H + 127) // 128))
    results = []

    def add(name, us, nbytes):
        results.append(dict(name=name, us=us, bytes=nbytes, GBps=nbytes / us / 1e3))

    grp = dist.group.WORLD
    plain_in = torch.empty(T * k, H, device=dev, dtype=torch.bfloat16)
    plain_out = torch.empty_like(plain_in)
    add("plain a2a bf16", _time(lambda: dist.all_to_all_single(plain_out, plain_in, group=grp),
                                args.iters), rows_bytes_bf16)
    p8_in = torch.empty(rows_bytes_fp8, device=dev, dtype=torch.uint8)
    p8_out = torch.empty_like(p8_in)
    add("plain a2a fp8", _time(lambda: dist.all_to_all_single(p8_out, p8_in, group=grp),
                               args.iters), rows_bytes_fp8)
    with torch.no_grad():
        for name, kw, nbytes in (("dispatch bf16", {}, rows_bytes_bf16),
                                 ("dispatch fp8", {"fp8_payload": True}, rows_bytes_fp8),
                                 ("dispatch bf16 cap1.25", {"capacity_factor": 1.25},
                                  rows_bytes_bf16)):
            d = ExpertParallelDispatcher(E, group=grp, align=16, **kw)
            add(name, _time(lambda d=d: d.dispatch(x, ids, probs), args.iters), nbytes)
        d = ExpertParallelDispatcher(E, group=grp, align=16)
        rows, prow, h = d.dispatch(x, ids, probs)
        add("combine bf16", _time(lambda: d.combine(rows, h), args.iters), rows_bytes_bf16)
    if rank == 0:
        q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} CUDA GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, q))
             for r in range(args.world)]
    for p in procs:
        p.start()
    import queue
    import time
    deadline = time.monotonic() + 600
    results = None
    while results is None:
        try:
            results = q.get(timeout=5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                raise SystemExit(f"a rank failed or timed out: exit codes "
                                 f"{[p.exitcode for p in procs]}") from None
    for p in procs:
        p.join(60)
    base = {r["name"]: r["GBps"] for r in results}
    print(f"world {args.world}, T {args.tokens}/rank, H {args.hidden}, E {args.experts}, "
          f"top-{args.topk}")
    print(f"{'op':24} | {'µs':>9} | {'MB':>7} | {'GB/s':>7} | vs plain a2a")
    for r in results:
        ref = base["plain a2a fp8" if "fp8" in r["name"] else "plain a2a bf16"]
        r["vs_plain"] = r["GBps"] / ref
        print(f"{r['name']:24} | {r['us']:9.1f} | {r['bytes'] / 1e6:7.1f} | {r['GBps']:7.1f} |"
              f" {r['vs_plain']:.2f}")
    meta = dict(world=args.world, tokens=args.tokens, hidden=args.hidden,
                experts=args.experts, topk=args.topk, torch=torch.__version__,
                device=torch.cuda.get_device_name(0))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
