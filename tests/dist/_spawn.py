"""Spawn helper for the gloo tests of linghe.dist (loopback, free port, bounded time)."""

import datetime
import os
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, fn, errq, env):
    try:
        os.environ.update(env)
        if backend == "nccl":
            import torch
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        fn(rank, world)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def run_ranks(fn, world: int, timeout_s: float = 120, backend: str = "gloo", env=None):
    """Run ``fn(rank, world)`` on ``world`` spawned processes; raise with every rank's
    traceback on failure and fail (terminating the ranks) past ``timeout_s``."""
    ctx = mp.get_context("spawn")
    errq = ctx.Queue()
    port = free_port()
    env = dict(env or {})
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, errq, env))
             for r in range(world)]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + timeout_s
    try:
        for pr in procs:
            pr.join(max(1.0, deadline - time.monotonic()))
    finally:
        hung = [pr for pr in procs if pr.is_alive()]
        for pr in hung:
            pr.terminate()
        for pr in hung:
            pr.join(10)
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in errors)
    assert not hung, f"ranks {[procs.index(p) for p in hung]} did not finish in {timeout_s}s"
    assert all(pr.exitcode == 0 for pr in procs), [pr.exitcode for pr in procs]
