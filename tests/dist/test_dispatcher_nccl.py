"""linghe.dist over NCCL on 2 GPUs (spawned here): the dispatcher (bf16 and FP8 payload,
default and capacity mode, synchronous and asynchronous, FP8 rows), a sharded nn.MoE
equal to the single-process one, and the capacity mode captured in a CUDA graph and
replayed. Skipped without 2 CUDA devices."""

import pytest
import torch
import torch.distributed as dist

from tests.dist._spawn import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                       or not dist.is_available() or not dist.is_nccl_available(),
                       reason="needs 2 CUDA GPUs and NCCL"),
]

# NVLink multicast (NVLS) is off on the lent machines.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def _problem(world, T, H, E, k, dev):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(world * T, H, generator=g).to(dev, torch.bfloat16)
    probs = torch.rand(world * T, k, generator=g).to(dev)
    ids = torch.rand(world * T, E, generator=g).argsort(1)[:, :k].to(dev, torch.int32)
    gout = torch.randn(world * T, H, generator=g).to(dev, torch.bfloat16)
    return x, probs, ids, gout


def _dispatch_worker(rank, world):
    from linghe import reference as ref
    from linghe.dist import ExpertParallelDispatcher
    from linghe.testing import assert_close

    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, E, k = 512, 512, 16, 4
    x, probs, ids, gout = _problem(world, T, H, E, k, dev)
    sl = slice(rank * T, (rank + 1) * T)
    for fp8, fp8_rows in ((False, False), (True, False), (True, True)):
        for cap in (None, 4.0):
            for async_op in (False, True):
                d = ExpertParallelDispatcher(E, group=dist.group.WORLD, align=16,
                                             capacity_factor=cap, fp8_payload=fp8)
                xl = x[sl].clone().requires_grad_(True)
                pl = probs[sl].clone().requires_grad_(True)
                if async_op:
                    rows, prow, h = d.dispatch(xl, ids[sl], pl, async_op=True,
                                               fp8_rows=fp8_rows).wait()
                    out = d.combine(rows * prow[:, None].to(rows.dtype), h,
                                    async_op=True).wait()
                else:
                    rows, prow, h = d.dispatch(xl, ids[sl], pl, fp8_rows=fp8_rows)
                    out = d.combine(rows * prow[:, None].to(rows.dtype), h)
                (out.float() * gout[sl].float()).sum().backward()
                # single-process reference (fp32 math)
                xr = x[sl].float()
                if fp8:
                    q, s = ref.quantize_1x128(x[sl])
                    xr = ref.dequantize_1x128(q, s)
                want = (probs[sl][:, :, None] * xr[:, None, :]).sum(1)
                what = f"fp8={fp8} rows={fp8_rows} cap={cap} async={async_op}"
                assert int(h.num_dropped) == 0, what
                assert_close(out, want, 1e-2, f"out {what}")
                dx = probs[sl].sum(1, keepdim=True) * gout[sl].float()
                assert_close(xl.grad, dx, 1e-2, f"dx {what}")
                dp = (gout[sl].float()[:, None, :] * xr[:, None, :]).sum(-1).expand(-1, k)
                assert_close(pl.grad, dp, 1e-2, f"dprobs {what}")


def _graph_worker(rank, world):
    """Capacity mode in a CUDA graph: dispatch + combine captured once (after the first
    call's configuration check), replayed on new inputs copied into the static ones."""
    from linghe.dist import ExpertParallelDispatcher
    from linghe.testing import assert_close

    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, E, k = 256, 256, 8, 2
    d = ExpertParallelDispatcher(E, group=dist.group.WORLD, align=16, capacity_factor=4.0)
    x, probs, ids, _ = _problem(world, T, H, E, k, dev)
    sl = slice(rank * T, (rank + 1) * T)
    sx, sp, si = x[sl].clone(), probs[sl].clone(), ids[sl].clone()

    def step():
        rows, prow, h = d.dispatch(sx, si, sp)
        return d.combine(rows * prow[:, None].to(rows.dtype), h)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # warm-up: configuration check, compiles, NCCL setup
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = step()
    for seed in (5, 6):
        g = torch.Generator().manual_seed(seed + rank)
        sx.copy_(torch.randn(T, H, generator=g).to(dev, torch.bfloat16))
        sp.copy_(torch.rand(T, k, generator=g).to(dev))
        graph.replay()
        torch.cuda.synchronize()
        want = (sp[:, :, None] * sx.float()[:, None, :]).sum(1)
        assert_close(out, want, 1e-2, f"graph replay seed={seed}")


def _moe_worker(rank, world):
    from tests.dist.test_moe_dist import _config, check_moe_equivalence
    for fp8 in (False, True):
        c = _config(world, device="cuda", dtype=torch.bfloat16, T_per_rank=(256, 100),
                    fp8_payload=fp8, E=8, H=256, I=128, k=2, align=16)
        check_moe_equivalence(rank, world, c, tol=2e-2)
    c = _config(world, device="cuda", dtype=torch.bfloat16, T_per_rank=(256, 100),
                fp8_payload=True, E=8, H=256, I=128, k=2, align=16, recipe="blockwise")
    check_moe_equivalence(rank, world, c, tol=3e-2)


def test_dispatcher_nccl():
    run_ranks(_dispatch_worker, 2, timeout_s=300, backend="nccl", env=NCCL_ENV)


def test_capacity_mode_cuda_graph_nccl():
    run_ranks(_graph_worker, 2, timeout_s=300, backend="nccl", env=NCCL_ENV)


def test_moe_nccl():
    run_ranks(_moe_worker, 2, timeout_s=300, backend="nccl", env=NCCL_ENV)
