"""Expert-parallel dispatch/combine and the nn.MoE layer over NCCL (``linghe.dist``).

One command on a machine with 2 GPUs (from the repository root)::

    python -m benchmark.dist_a2a                       # spawns its ranks
    torchrun --nproc-per-node 2 -m benchmark.dist_a2a  # or under torchrun

Per rank: T = 8192 tokens, hidden 2048, top-8 of 256 experts (random routing: on 2
ranks about half of the copies stay on their rank), bf16 tokens. Rows of the table
(median of ``--iters`` timed calls, CUDA events, a barrier before each; the slowest rank
decides):

- ``plain a2a bf16`` / ``plain a2a fp8``: one ``all_to_all_single`` of the bytes the
  payload needs (``T*k`` rows of ``H`` bf16; of ``H`` e4m3 bytes + ``H/128`` fp32 scales),
  equal splits: the bandwidth the dispatcher is compared with (``vs plain``);
  ``... remote only``: the same rows without the ones a rank keeps (what the dispatcher
  actually exchanges: its own rows bypass the collective);
- ``dispatch`` / ``combine`` in the default mode (one host sync for the split sizes) and
  the capacity mode (``cap1.25``: static shapes, no host sync), bf16 and FP8 payload
  (``fp8``: dequantized on arrival; ``fp8 rows``: kept FP8 for the FP8 expert GEMMs);
  ``dispatch+combine fwd+bwd`` with the backward exchanges;
- ``MoE fwd`` / ``MoE fwd+bwd``: ``linghe.nn.MoE`` (256 experts top-8 sigmoid in 8 groups
  / top-4, expert intermediate 1024, one shared expert) with EP over the ranks, with and
  without the shared expert overlapped with the dispatch (``overlap``); the same layer
  with all experts on one GPU (``1 GPU``), and the EP speedup in tokens/s.

``GB/s`` = payload bytes of one rank's ``T*k`` rows / time (the same bytes as the plain
row it is compared with); ``tok/s`` = tokens dispatched per second by all ranks together.
Targets (issue 12) are checked at the end. NCCL_NVLS_ENABLE=0 is set for the ranks.

``--device cpu`` runs everything over gloo through the Triton interpreter at tiny sizes
(a smoke test of this script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: (row, compared with, minimum ratio): the targets of issue 12.
TARGETS = (
    ("dispatch bf16", "plain a2a bf16", 0.85, "GB/s vs plain a2a"),
    ("combine bf16", "plain a2a bf16", 0.85, "GB/s vs plain a2a"),
    ("dispatch fp8 rows", "dispatch bf16", 1.7, "tokens/s vs bf16 dispatch"),
    ("dispatch fp8", "dispatch bf16", 1.7, "tokens/s vs bf16 dispatch"),
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_call_us(fn, cuda: bool) -> float:
    """µs of one ``fn()``: CUDA events around it on the GPU, wall clock on CPU."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3


class _Timer:
    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.dev, self.iters, self.warmup = device, iters, warmup

    def __call__(self, fn) -> float:
        """Median µs of ``fn()`` on this rank; the maximum over ranks is returned."""
        cuda = self.dev.type == "cuda"
        for _ in range(self.warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
        ts = []
        for _ in range(self.iters):
            dist.barrier()
            ts.append(_one_call_us(fn, cuda))
        t = torch.tensor([statistics.median(ts)], dtype=torch.float64, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())


def _routing(T, E, k, dev, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :k].to(dev, torch.int32)
    probs = torch.rand(T, k, generator=g).to(dev)
    return ids, probs


def _worker(rank, world, args, q=None):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cpu = args.device == "cpu"
    if cpu:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
        backend = "gloo"
    else:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        backend = "nccl"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    import linghe
    from linghe.dist import ExpertParallelDispatcher
    from linghe.dist.kernels import fwd_spec

    T, H, E, k = args.tokens, args.hidden, args.experts, args.topk
    grp = dist.group.WORLD
    timer = _Timer(dev, args.iters, args.warmup)
    dt = torch.float32 if cpu else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).to(dev, dt)
    ids, probs = _routing(T, E, k, dev, rank)
    es = x.element_size()
    G = -(-H // 128)
    rows_bytes = T * k * H * es
    fp8_bytes = T * k * (H + 4 * G)
    results = []

    def add(name, us, nbytes=0, tokens=0, **extra):
        r = dict(name=name, us=us, bytes=nbytes, GBps=nbytes / us / 1e3 if nbytes else None,
                 tok_per_s=tokens / us * 1e6 if tokens else None, **extra)
        results.append(r)
        if rank == 0 and args.verbose:
            print(f"  {name}: {us:.1f} µs", flush=True)

    # ------------------------------------------------------------ plain all_to_all_single
    def plain(nbytes, remote_only):
        n = nbytes // world
        inp = torch.empty(world * n, dtype=torch.uint8, device=dev)
        splits = [0 if (remote_only and r == rank) else n for r in range(world)]
        out = torch.empty(sum(splits), dtype=torch.uint8, device=dev)
        return lambda: dist.all_to_all_single(out, inp[:sum(splits)], splits, splits,
                                              group=grp)

    for label, nbytes in (("bf16", rows_bytes), ("fp8", fp8_bytes)):
        add(f"plain a2a {label}", timer(plain(nbytes, False)), nbytes, world * T)
        add(f"plain a2a {label} remote only", timer(plain(nbytes, True)), nbytes, world * T)

    # ------------------------------------------------------------ dispatch / combine
    cap = args.capacity_factor
    with torch.no_grad():
        for label, fp8, cf, f8rows in (
                ("bf16", False, None, False), (f"bf16 cap{cap:g}", False, cap, False),
                ("fp8", True, None, False), ("fp8 rows", True, None, True),
                (f"fp8 rows cap{cap:g}", True, cap, True)):
            d = ExpertParallelDispatcher(E, group=grp, align=16, capacity_factor=cf,
                                         fp8_payload=fp8)
            nbytes = fp8_bytes if fp8 else rows_bytes
            rec = fwd_spec(H, dt, fp8).nbytes
            add(f"dispatch {label}",
                timer(lambda d=d, f=f8rows: d.dispatch(x, ids, probs, fp8_rows=f)), nbytes,
                world * T, record_bytes=rec)
            if not fp8:
                rows, prow, h = d.dispatch(x, ids, probs)
                add(f"combine {label}", timer(lambda d=d, rows=rows, h=h: d.combine(rows, h)),
                    rows_bytes, world * T)
                del rows, prow, h
    for label, cf in (("bf16", None), (f"bf16 cap{cap:g}", cap)):
        d = ExpertParallelDispatcher(E, group=grp, align=16, capacity_factor=cf)
        xg = x.clone().requires_grad_(True)
        pg = probs.clone().requires_grad_(True)

        def fwd_bwd(d=d, xg=xg, pg=pg):
            rows, prow, h = d.dispatch(xg, ids, pg)
            out = d.combine(rows, h, pg)
            out.backward(x)

        add(f"dispatch+combine fwd+bwd {label}", timer(fwd_bwd), 4 * rows_bytes, world * T)
        del xg, pg

    # ------------------------------------------------------------ nn.MoE
    if not args.skip_moe:
        _moe_rows(rank, world, args, dev, dt, grp, timer, add, linghe)
    dist.barrier()
    if rank == 0:
        if q is not None:
            q.put(results)
        else:
            _report(results, world, args)
    dist.destroy_process_group()


def _moe_rows(rank, world, args, dev, dt, grp, timer, add, linghe):
    T, H, E, k, In = args.tokens, args.hidden, args.experts, args.topk, args.intermediate
    groups = 8 if E % 8 == 0 and E >= 32 else 1
    kw = dict(num_shared_experts=1, score="sigmoid", num_groups=groups,
              topk_groups=min(4, groups), align=16, device=dev, dtype=dt)
    torch.manual_seed(0)
    g = torch.Generator(device="cpu").manual_seed(200 + rank)
    x = torch.randn(T, H, generator=g).to(dev, dt)
    gout = torch.randn(T, H, generator=g).to(dev, dt)
    ep = linghe.nn.MoE(H, E, k, In, ep_group=grp, **kw)
    xg = x.clone().requires_grad_(True)

    def fwd(layer=ep):
        with torch.no_grad():
            layer(x)

    def fwd_bwd(layer=ep):
        out, aux = layer(xg)
        out.backward(gout)

    for overlap in (True, False):
        ep.overlap_shared_experts = overlap
        tag = "overlap" if overlap else "no overlap"
        add(f"MoE EP{world} fwd ({tag})", timer(fwd), 0, world * T)
        add(f"MoE EP{world} fwd+bwd ({tag})", timer(fwd_bwd), 0, world * T)
    ep.overlap_shared_experts = True
    # the same layer with every expert on one GPU (rank 0; the others wait)
    if rank == 0:
        one = linghe.nn.MoE(H, E, k, In, **kw)

        def one_fwd_bwd():
            out, aux = one(xg)
            out.backward(gout)

        local = _Timer(dev, timer.iters, timer.warmup)
        us = _local_time(local, one_fwd_bwd)
        del one
    else:
        us = 0.0
    t = torch.tensor([us], dtype=torch.float64, device=dev)
    dist.broadcast(t, 0)
    add("MoE 1 GPU fwd+bwd", float(t.item()), 0, T)


def _local_time(timer: _Timer, fn) -> float:
    """``timer`` without the collectives (one rank alone)."""
    cuda = timer.dev.type == "cuda"
    for _ in range(timer.warmup):
        fn()
    ts = []
    for _ in range(timer.iters):
        if cuda:
            torch.cuda.synchronize()
        ts.append(_one_call_us(fn, cuda))
    return statistics.median(ts)


def _report(results, world, args) -> dict:
    by = {r["name"]: r for r in results}
    for r in results:
        n = r["name"]
        base = None
        if n.startswith(("dispatch ", "combine ")) and "fwd+bwd" not in n:
            base = by.get("plain a2a fp8" if " fp8" in n else "plain a2a bf16")
        r["vs_plain"] = base["us"] / r["us"] if base else None
    one = by.get("MoE 1 GPU fwd+bwd")
    for r in results:
        if one and r["name"].startswith("MoE EP") and "fwd+bwd" in r["name"]:
            r["vs_1gpu_tok_per_s"] = r["tok_per_s"] / one["tok_per_s"]
    targets = []
    for name, ref, want, what in TARGETS:
        if name in by and ref in by:
            if what.startswith("tokens"):
                got = by[name]["tok_per_s"] / by[ref]["tok_per_s"]
            else:
                got = by[name]["vs_plain"]
            targets.append(dict(row=name, vs=ref, what=what, want=want, got=got,
                                met=got >= want))
    dev = "cpu (gloo, interpreter: times mean nothing)" if args.device == "cpu" else \
        torch.cuda.get_device_name(0)
    print(f"{dev} x{world}: T {args.tokens}/rank, H {args.hidden}, E {args.experts}, "
          f"top-{args.topk}")
    print(f"{'row':40} | {'µs':>9} | {'GB/s':>7} | {'Mtok/s':>7} | vs plain | vs 1 GPU")
    for r in results:
        gb = f"{r['GBps']:7.1f}" if r["GBps"] else " " * 7
        tk = f"{r['tok_per_s'] / 1e6:7.2f}" if r["tok_per_s"] else " " * 7
        vp = f"{r['vs_plain']:8.2f}" if r.get("vs_plain") else " " * 8
        v1 = f"{r['vs_1gpu_tok_per_s']:.2f}x" if r.get("vs_1gpu_tok_per_s") else ""
        print(f"{r['name']:40} | {r['us']:9.1f} | {gb} | {tk} | {vp} | {v1}")
    ov = [by.get(f"MoE EP{world} fwd+bwd ({t})") for t in ("overlap", "no overlap")]
    if all(ov):
        print(f"shared expert overlapped with the dispatch: MoE fwd+bwd "
              f"{ov[1]['us']:.1f} -> {ov[0]['us']:.1f} µs")
    for t in targets:
        print(f"target {t['row']} {t['what']} >= {t['want']}: {t['got']:.2f} "
              f"{'met' if t['met'] else 'NOT met'}")
    meta = dict(world=world, tokens=args.tokens, hidden=args.hidden, experts=args.experts,
                topk=args.topk, intermediate=args.intermediate,
                capacity_factor=args.capacity_factor, iters=args.iters,
                torch=torch.__version__, device=dev)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    out = dict(meta=meta, results=results, targets=targets)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.out}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmark.dist_a2a",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default: benchmark/results/"
                    "<gpu>x<world>_dist_a2a.json; none on --device cpu)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens", type=int, default=None, help="per rank (default 8192)")
    ap.add_argument("--hidden", type=int, default=None, help="default 2048")
    ap.add_argument("--experts", type=int, default=None, help="default 256")
    ap.add_argument("--topk", type=int, default=None, help="default 8")
    ap.add_argument("--intermediate", type=int, default=None, help="default 1024")
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--iters", type=int, default=None, help="default 20")
    ap.add_argument("--warmup", type=int, default=None, help="default 3")
    ap.add_argument("--skip-moe", action="store_true", help="only dispatch/combine rows")
    ap.add_argument("--verbose", action="store_true", help="print each row as it is timed")
    args = ap.parse_args(argv)
    # full shapes on the GPU, tiny ones through the interpreter
    small = args.device == "cpu"
    for name, full, tiny in (("tokens", 8192, 6), ("hidden", 2048, 128), ("experts", 256, 8),
                             ("topk", 8, 2), ("intermediate", 1024, 32), ("iters", 20, 1),
                             ("warmup", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if small else full)
    return args


def main(argv=None):
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank
        dist.init_process_group("gloo" if args.device == "cpu" else "nccl",
                                timeout=datetime.timedelta(seconds=300))
        rank, world = dist.get_rank(), dist.get_world_size()
        args.world = world
        if args.out is None and args.device == "cuda":
            args.out = _default_out(world)
        _worker(rank, world, args)
        return
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} CUDA GPUs, found {torch.cuda.device_count()}")
    if args.out is None and args.device == "cuda":
        args.out = _default_out(args.world)
    args.port = _free_port()
    # gloo ranks are forked (no CUDA in them); NCCL ranks are spawned
    ctx = mp.get_context("fork" if args.device == "cpu" else "spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, args, q))
             for r in range(args.world)]
    for p in procs:
        p.start()
    import queue
    deadline = time.monotonic() + 900
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
    return _report(results, args.world, args)


def _default_out(world: int) -> str:
    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
    name = name.split()[0] if name else "gpu"
    return os.path.join("benchmark", "results", f"{name}x{world}_dist_a2a.json")


if __name__ == "__main__":
    main()
