"""linghe.optim across ranks: gloo CPU processes (spawned here, loopback only, bounded time).

Every scenario runs in one spawned job per world size (process start-up dominates):
sharded gradients over the world group, several buckets on distinct groups (list ``group``),
DTensor (FSDP2-style) gradients on 1-D and 2-D meshes, count_zeros and AmaxHistory MAX.
On a GPU machine the ranks still use CPU tensors through gloo (the kernels then need the
interpreter, so the test is skipped there unless TRITON_INTERPRET=1).
"""

import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.dist._spawn import run_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs torch.distributed (gloo) and CPU tensors through the Triton interpreter")

TIMEOUT_S = 240


def _full(seed, sizes, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def _shard(t, rank, world):
    return t.tensor_split(world)[rank].contiguous()


def _params_from(grads):
    ps = []
    for gr in grads:
        p = torch.nn.Parameter(torch.zeros_like(gr))
        p.grad = gr.clone()
        ps.append(p)
    return ps


def _close(a, b, tol, what):
    a, b = float(a), float(b)
    if math.isinf(b) or math.isnan(b):
        assert (math.isnan(a) and math.isnan(b)) or a == b, (what, a, b)
        return
    assert abs(a - b) <= tol * max(abs(b), 1e-30), f"{what}: {a} vs {b}"


def _check_sharded(rank, world):
    from linghe import optim
    from linghe import reference as ref

    sizes = [1, 7, 1000, 70_003, 3]
    for p in (1.0, 2.0, 3.0, float("inf")):
        full = _full(1, sizes)
        local = [_shard(t, rank, world) for t in full]
        exp = ref.total_norm(full, p)
        # grad_norm / get_total_norm
        _close(optim.grad_norm(local, p, group=dist.group.WORLD), exp, 1e-5, f"grad_norm p={p}")
        _close(optim.get_total_norm(local, p, group=dist.group.WORLD), exp, 1e-5, "get_total")
        # clip: clipped shards equal the shards of the clipped full gradients
        ps = _params_from(local)
        norm = optim.clip_grad_norm_(ps, 0.5, p, group=dist.group.WORLD)
        _close(norm, exp, 1e-5, f"clip norm p={p}")
        coef = ref.clip_coef(exp.float(), 0.5)
        for q, t in zip(ps, full):
            want = _shard(t * coef, rank, world)
            torch.testing.assert_close(q.grad, want, rtol=1e-6, atol=1e-7)


def _check_buckets(rank, world):
    """Three buckets: A sharded over the world, B sharded within pairs of ranks (replicated
    across pairs, HSDP-like) on distinct groups, C replicated (None)."""
    from linghe import optim
    from linghe import reference as ref

    pairs = [dist.new_group([r, r + 1]) if r + 1 < world else dist.new_group([r])
             for r in range(0, world, 2)]
    pair = pairs[rank // 2]
    pair_rank, pair_size = dist.get_rank(pair), dist.get_world_size(pair)
    A = _full(2, [5000, 33])
    B = _full(3, [70_000, 129], torch.bfloat16)
    C = _full(4, [17])
    for p in (2.0, float("inf")):
        a = _params_from([_shard(t, rank, world) for t in A])
        b = _params_from([_shard(t, pair_rank, pair_size) for t in B])
        c = _params_from(C)
        if rank == 0:
            b[1].grad = None  # None grads are skipped; the bucket still joins its collective
        exp_parts = A + [B[0]] + C
        norm = optim.clip_grad_norm_([a, b, c], 1e9, p, group=[dist.group.WORLD, pair, None])
        # B is all-reduced within the pair only: the pair holding rank 0 misses one shard
        b1_parts = [_shard(B[1], r, pair_size) for r in range(pair_size)
                    if not (pairs[0] is pair and r == 0)]
        exp = ref.total_norm(exp_parts + b1_parts, p)
        _close(norm, exp, 1e-5, f"buckets p={p}")
        # with every grad present, the clip matches the reference on the full gradients
        a = _params_from([_shard(t, rank, world) for t in A])
        b = _params_from([_shard(t, pair_rank, pair_size) for t in B])
        c = _params_from(C)
        norm = optim.clip_grad_norm_([a, b, c], 0.1, p, group=[dist.group.WORLD, pair, None])
        exp = ref.total_norm(A + B + C, p)
        _close(norm, exp, 1e-5, f"buckets full p={p}")
        coef = ref.clip_coef(exp.float(), 0.1)
        torch.testing.assert_close(c[0].grad, C[0] * coef, rtol=1e-6, atol=1e-7)
        want = _shard((B[0].float() * coef).bfloat16(), pair_rank, pair_size)
        torch.testing.assert_close(b[0].grad.float(), want.float(), rtol=1e-2, atol=1e-3)


def _check_dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from linghe import optim
    from linghe import reference as ref

    meshes = [(init_device_mesh("cpu", (world,)), [Shard(0)])]
    if world % 2 == 0 and world >= 4:
        meshes.append((init_device_mesh("cpu", (world // 2, 2)), [Replicate(), Shard(0)]))
    full = _full(5, [1000, 7, 70_001])
    for mesh, placements in meshes:
        for p in (2.0, float("inf")):
            ps = []
            for t in full:
                q = torch.nn.Parameter(distribute_tensor(torch.zeros_like(t), mesh, placements))
                q.grad = distribute_tensor(t.clone(), mesh, placements)
                ps.append(q)
            norm = optim.clip_grad_norm_(ps, 0.5, p)
            exp = ref.total_norm(full, p)
            _close(norm, exp, 1e-5, f"dtensor p={p} mesh={mesh.shape}")
            coef = ref.clip_coef(exp.float(), 0.5)
            for q, t in zip(ps, full):
                torch.testing.assert_close(q.grad.full_tensor(), t * coef, rtol=1e-6, atol=1e-7)


def _check_count_zeros_and_amax(rank, world):
    from linghe import optim

    t = torch.ones(1000 + rank)
    t[: 10 * (rank + 1)] = 0
    e4 = torch.tensor([0.0, -0.0, 1.0]).to(torch.float8_e4m3fn)
    z = optim.count_zeros([t, e4], group=dist.group.WORLD)
    assert z.item() == sum(10 * (r + 1) + 2 for r in range(world)), z
    h = optim.AmaxHistory(3, 4, margin=1, device="cpu")
    h.record(0, torch.tensor(float(rank + 1)))
    h.record(1, torch.tensor(2.0 if rank == world - 1 else 0.5))
    h.update(group=dist.group.WORLD)
    assert h.scale.tolist() == [448.0 / world / 2, 448.0 / 2.0 / 2, 1.0], h.scale
    assert h.amax_history[1].tolist() == [float(world), 2.0, 0.0]
    assert torch.all(h.amax_history[0] == 0)


def _all_checks(rank, world):
    _check_sharded(rank, world)
    _check_buckets(rank, world)
    _check_count_zeros_and_amax(rank, world)
    _check_dtensor(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_optim_distributed(world):
    run_ranks(_all_checks, world, timeout_s=TIMEOUT_S)
