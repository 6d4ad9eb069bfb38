"""linghe.dist over NCCL on 2 GPUs (spawned here): the dispatcher (bf16 and FP8 payload)
and a sharded nn.MoE equal the single-process results. Skipped without 2 CUDA devices."""

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


def _dispatch_worker(rank, world):
    from linghe import reference as ref
    from linghe.dist import ExpertParallelDispatcher
    from linghe.testing import assert_close

    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, E, k = 512, 512, 16, 4
    for fp8 in (False, True):
        for cap in (None, 4.0):
            g = torch.Generator().manual_seed(3)
            x = torch.randn(world * T, H, generator=g).to(dev, torch.bfloat16)
            probs = torch.rand(world * T, k, generator=g).to(dev)
            ids = torch.rand(world * T, E, generator=g).argsort(1)[:, :k].to(dev, torch.int32)
            gout = torch.randn(world * T, H, generator=g).to(dev, torch.bfloat16)
            sl = slice(rank * T, (rank + 1) * T)
            d = ExpertParallelDispatcher(E, group=dist.group.WORLD, align=16,
                                         capacity_factor=cap, fp8_payload=fp8)
            xl = x[sl].clone().requires_grad_(True)
            pl = probs[sl].clone().requires_grad_(True)
            rows, prow, h = d.dispatch(xl, ids[sl], pl)
            out = d.combine(rows * prow[:, None].to(rows.dtype), h)
            (out.float() * gout[sl].float()).sum().backward()
            # single-process reference (fp32 math)
            xr = x[sl].float()
            if fp8:
                q, s = ref.quantize_1x128(x[sl])
                xr = ref.dequantize_1x128(q, s)
            want = (probs[sl][:, :, None] * xr[:, None, :]).sum(1)
            what = f"fp8={fp8} cap={cap}"
            assert int(h.num_dropped) == 0, what
            assert_close(out, want, 1e-2, f"out {what}")
            dx = probs[sl].sum(1, keepdim=True) * gout[sl].float()
            assert_close(xl.grad, dx, 1e-2, f"dx {what}")
            dp = (gout[sl].float()[:, None, :] * xr[:, None, :]).sum(-1).expand(-1, k)
            assert_close(pl.grad, dp, 1e-2, f"dprobs {what}")


def _moe_worker(rank, world):
    from tests.dist.test_moe_dist import _config, check_moe_equivalence
    for fp8 in (False, True):
        c = _config(world, device="cuda", dtype=torch.bfloat16, T_per_rank=(256, 100),
                    fp8_payload=fp8, E=8, H=256, I=128, k=2, align=16)
        check_moe_equivalence(rank, world, c, tol=2e-2)


def test_dispatcher_nccl():
    run_ranks(_dispatch_worker, 2, timeout_s=300, backend="nccl", env=NCCL_ENV)


def test_moe_nccl():
    run_ranks(_moe_worker, 2, timeout_s=300, backend="nccl", env=NCCL_ENV)
