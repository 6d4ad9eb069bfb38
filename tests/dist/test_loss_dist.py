"""Vocab-parallel cross entropy and linear cross entropy: 2 processes equal the
unsharded op, as CPU processes over gloo (loopback; the kernels through the Triton
interpreter, so on a GPU machine only when ``TRITON_INTERPRET=1``, as the other gloo
tests) and as 2 GPUs over NCCL (compiled kernels; needs 2 CUDA devices).

The test spawns its own processes with torch.multiprocessing (a free local port, bounded
time); each rank holds a contiguous slice of the vocabulary (the slices differ in size).
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.dist._spawn import free_port

WORLD = 2
TIMEOUT_S = 90


def _worker(rank, port, cases, results, backend):
    if backend == "gloo":
        os.environ["TRITON_INTERPRET"] = "1"
    import datetime

    import torch.distributed as dist

    import linghe

    dev = "cpu"
    if backend == "nccl":
        dev = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def back(*ts):  # results go through the manager as CPU tensors
        return tuple(t.detach().cpu() for t in ts)
    try:
        out = []
        for c in cases:
            x, lab, split, kw = c["x"].to(dev), c["labels"].to(dev), c["split"], c["kw"]
            start = sum(split[:rank])
            xl = x[:, start:start + split[rank]].clone().requires_grad_()
            loss = linghe.cross_entropy(xl, lab, process_group=dist.group.WORLD, **kw)
            loss.backward(c["grad"].to(dev))
            out.append(back(loss, xl.grad))
        lin = []
        for c in _linear_cases():
            h, w, b, lab = (c[k].to(dev) for k in ("h", "w", "b", "labels"))
            split, kw = c["split"], c["kw"]
            start = sum(split[:rank])
            hl = h.clone().requires_grad_()
            wl = w[start:start + split[rank]].clone().requires_grad_()
            bl = b[start:start + split[rank]].clone().requires_grad_()
            with linghe.TrainingContext(fp8="blockwise" if c["fp8"] else None,
                                        lm_head_fp8=c["fp8"]):
                loss = linghe.linear_cross_entropy(hl, wl, lab, bias=bl, chunk_size=7,
                                                   process_group=dist.group.WORLD, **kw)
            loss.backward(c["grad"].to(dev))
            lin.append(back(loss, hl.grad, wl.grad, bl.grad))
        results[rank] = (out, lin)
    finally:
        dist.destroy_process_group()


def _cases():
    g = torch.Generator().manual_seed(1234)
    cases = []
    for N, V, split, kw in [
        (33, 1000, (400, 600), dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3)),
        (17, 7, (3, 4), dict(reduction="none")),
        (9, 300, (150, 150), dict(reduction="sum", z_loss=0.1, inplace_backward=True)),
        (5, 64, (32, 32), dict(reduction="mean", label_smoothing=0.2)),
    ]:
        x = torch.randn(N, V, generator=g) * 3
        lab = torch.randint(0, V, (N,), generator=g)
        lab[::4] = -100
        if kw.get("label_smoothing") == 0.2:
            lab[:] = -100  # all ignored: loss 0, gradient 0
        red = kw.get("reduction")
        grad = torch.randn(N, generator=g) if red == "none" else torch.tensor(1.3)
        cases.append(dict(x=x, labels=lab, split=split, kw=kw, grad=grad))
    return cases


def _linear_cases():
    g = torch.Generator().manual_seed(99)
    cases = []
    # fp8: the FP8 LM head (lm_head_fp8); with the slices on 128-row boundaries each rank's
    # 128x128 weight blocks and 1x128 gradient groups are the unsharded ones
    for N, H, V, split, kw, fp8 in [
        (20, 8, 300, (120, 180), dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3),
         False),
        (13, 8, 50, (25, 25), dict(reduction="none", z_loss=1e-2), False),
        (20, 8, 300, (128, 172), dict(reduction="mean", z_loss=1e-3), True),
        (13, 8, 260, (128, 132), dict(reduction="none"), True),
    ]:
        h = torch.randn(N, H, generator=g)
        w = torch.randn(V, H, generator=g) / H**0.5 * 2
        b = torch.randn(V, generator=g)
        lab = torch.randint(0, V, (N,), generator=g)
        lab[::5] = -100
        # (FP8 with a reduction: grad_output 1, see reference.linear_cross_entropy_fp8)
        grad = (torch.randn(N, generator=g) if kw["reduction"] == "none" else
                torch.tensor(1.0 if fp8 else 0.8))
        cases.append(dict(h=h, w=w, b=b, labels=lab, split=split, kw=kw, grad=grad, fp8=fp8))
    return cases


@pytest.mark.parametrize("backend", [
    pytest.param("gloo", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="CPU ranks run the kernels through the Triton interpreter (TRITON_INTERPRET=1)")),
    pytest.param("nccl", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2
        or os.environ.get("TRITON_INTERPRET") == "1", reason="needs 2 CUDA devices")),
])
def test_vocab_parallel_cross_entropy_equals_unsharded(backend):
    from linghe import reference as ref
    from linghe.testing import assert_close

    cases = _cases()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, cases, results, backend))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            pytest.fail(f"vocab-parallel workers did not finish within {TIMEOUT_S}s")
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        res = dict(results)
    for i, c in enumerate(_linear_cases()):
        h64, w64, b64 = (c[k].double().requires_grad_() for k in ("h", "w", "b"))
        spec = ref.linear_cross_entropy_fp8 if c["fp8"] else ref.linear_cross_entropy
        r = spec(h64, w64, c["labels"], b64, **c["kw"])
        r.backward(c["grad"].double())
        # (FP8 on GPUs: Hopper's FP8 adds within a 128-deep block are less precise)
        tol = 5e-3 if c["fp8"] and backend == "nccl" else 1e-5
        dws, dbs = [], []
        for rank in range(WORLD):
            loss, dh, dw, db = res[rank][1][i]
            assert_close(loss, r, tol=1e-5 if tol < 1e-4 else 2e-4,
                         name=f"linear case {i} rank {rank} loss")
            assert_close(dh, h64.grad, tol=tol, name=f"linear case {i} rank {rank} dhidden")
            dws.append(dw)
            dbs.append(db)
        assert_close(torch.cat(dws), w64.grad, tol=tol, name=f"linear case {i} dweight")
        assert_close(torch.cat(dbs), b64.grad, tol=tol, name=f"linear case {i} dbias")
    for i, c in enumerate(cases):
        kw = {k: v for k, v in c["kw"].items() if k != "inplace_backward"}
        x64 = c["x"].double().requires_grad_()
        r = ref.cross_entropy(x64, c["labels"], **kw)
        r.backward(c["grad"].double())
        grads = []
        for rank in range(WORLD):
            loss, gx = res[rank][0][i]
            assert_close(loss, r, tol=1e-5, name=f"case {i} rank {rank} loss")
            grads.append(gx)
        assert_close(torch.cat(grads, dim=1), x64.grad, tol=1e-5, name=f"case {i} grad")
