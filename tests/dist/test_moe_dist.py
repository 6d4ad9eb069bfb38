"""linghe.nn.MoE sharded by expert over gloo ranks (2 and 4, spawned here) equals the same
layer unsharded on one process: outputs, input grads, router grads (summed over ranks, as a
data-parallel all-reduce would), expert weight grads (the local slice of the full grads)."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist._spawn import run_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs torch.distributed (gloo) and CPU tensors through the Triton interpreter")


def check_moe_equivalence(rank, world, *, device="cpu", dtype=torch.float32, T_per_rank=(5,),
                          tol=1e-5, fp8_payload=False, capacity_factor=None, shared=1,
                          E=None, H=16, I=8, k=2, align=4, fp8=None):
    import linghe
    from linghe.testing import assert_close

    E = E or 2 * world
    group = dist.group.WORLD
    torch.manual_seed(123)
    kw = dict(num_shared_experts=shared, align=align, fp8_payload=fp8_payload,
              capacity_factor=capacity_factor, device=device, dtype=dtype)
    full = linghe.nn.MoE(H, E, k, I, **kw)
    full.expert_bias.copy_(torch.randn(E, device=device) * 0.1)
    sharded = linghe.nn.MoE(H, E, k, I, ep_group=group, **kw)
    sharded.load_full_state_dict(full.state_dict())
    sizes = [T_per_rank[r % len(T_per_rank)] for r in range(world)]
    T = sum(sizes)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    gout = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])

    # unsharded reference on this process: all tokens (each rank's slice run separately when
    # the capacity is per-rank, i.e. identical per rank anyway with a generous factor)
    # fp8="blockwise": unsharded, tokens are quantized before an FP8 permute; sharded,
    # bf16 rows arrive and are quantized per expert segment: the same rowwise values.
    with linghe.TrainingContext(fp8=fp8):
        xf = x.clone().requires_grad_(True)
        of, auxf = full(xf)
        (of.float() * gout.float()).sum().backward()

        xs = x[sl].clone().requires_grad_(True)
        os_, auxs = sharded(xs)
        (os_.float() * gout[sl].float()).sum().backward()

    what = (f"world={world} rank={rank} fp8_payload={fp8_payload} cap={capacity_factor} "
            f"fp8={fp8}")
    assert_close(os_, of[sl], tol, f"out {what}")
    assert_close(xs.grad, xf.grad[sl], tol, f"dx {what}")
    assert torch.equal(auxs.tokens_per_expert, auxf.tokens_per_expert), what
    lo_e, hi_e = sharded.expert_range
    fullp = dict(full.named_parameters())
    for name, p in sharded.named_parameters():
        gr = p.grad
        if name.startswith("experts_"):
            want = fullp[name].grad[lo_e:hi_e]
        else:  # replicated: sum the per-rank gradients
            gr = gr.clone()
            dist.all_reduce(gr, group=group)
            want = fullp[name].grad
        assert_close(gr, want, tol, f"d{name} {what}")
    # the gathered state dict equals the full one
    sd = sharded.gather_full_state_dict()
    for kname, v in full.state_dict().items():
        assert torch.equal(sd[kname], v), kname


def _moe_worker(rank, world):
    check_moe_equivalence(rank, world, T_per_rank=(5, 0, 3))          # a zero-token rank
    check_moe_equivalence(rank, world, T_per_rank=(4,), fp8_payload=True, shared=0)
    check_moe_equivalence(rank, world, T_per_rank=(4,), capacity_factor=float(world))
    if world == 2:  # the FP8 expert path with expert parallelism (one world size: cost)
        check_moe_equivalence(rank, world, T_per_rank=(6, 3), dtype=torch.bfloat16, H=128,
                              I=64, shared=0, fp8="blockwise", tol=0.05)


@pytest.mark.parametrize("world", [2, 4])
def test_moe_sharded_equals_unsharded(world):
    run_ranks(_moe_worker, world, timeout_s=150)
