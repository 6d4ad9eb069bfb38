"""Process launcher for the tests of linghe.dist (loopback, free port, bounded time).

gloo ranks are forked from the test process: they inherit its imported torch, triton and
linghe, so a rank starts in well under a second (spawned ranks re-import torch: 6 to 12 s
each on CI's two cores, which was most of the time of these tests). Each forked rank runs
with one intra-op thread (several ranks share two cores; and a forked child must not
enter an OpenMP pool its parent started). NCCL ranks are spawned (CUDA cannot be used
in a forked child).
"""

import datetime
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, fn, errq, env, pg_timeout_s, finalize):
    try:
        os.environ.update(env)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        fn(rank, world)
        if finalize:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def run_ranks(fn, world: int, timeout_s: float = 120, backend: str = "gloo", env=None,
              pg_timeout_s: float = 120, finalize: bool = True):
    """Run ``fn(rank, world)`` on ``world`` processes (forked for gloo, spawned for NCCL);
    raise with every rank's traceback on failure and fail (terminating the ranks) past
    ``timeout_s``. ``pg_timeout_s`` is the process group's timeout; ``finalize=False``
    skips the closing barrier (for tests in which a rank exits on purpose)."""
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    errq = ctx.Queue()
    port = free_port()
    env = dict(env or {})
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, errq, env,
                                               pg_timeout_s, finalize))
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
