"""linghe.dist.ExpertParallelDispatcher over gloo (2 and 4 CPU ranks, spawned here).

Every rank builds the same global problem from one seed and takes its slice of tokens
(some ranks get none); dispatch -> identity experts -> combine must equal
``sum_k probs * x`` for its tokens, and the gradients to ``x`` and ``probs`` must equal the
single-process autograd reference.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist._spawn import run_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs torch.distributed (gloo) and CPU tensors through the Triton interpreter")

H = 8


def _problem(seed, T, E, k, mode):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    probs = torch.rand(T, k, generator=g)
    if mode == "one_expert":
        ids = torch.zeros(T, k, dtype=torch.int64)
        ids[:, 1:] = -1  # only the first copy is routed
    elif mode == "skip_last":  # experts E-1 and the last rank's experts get nothing
        ids = torch.rand(T, E // 2, generator=g).argsort(1)[:, :k]
    else:
        ids = torch.rand(T, E, generator=g).argsort(1)[:, :k]
    if mode == "dropped":
        ids[::3, -1] = -1
    return x, ids.to(torch.int32), probs


def _reference(x, ids, probs, gout, fp8=False):
    """out = sum_k probs * x over routed copies (autograd reference)."""
    from linghe import reference as ref
    x = x.clone().requires_grad_(True)
    p = probs.clone().requires_grad_(True)
    xv = x
    if fp8:
        q, s = ref.quantize_1x128(x.detach())
        xv = x + (ref.dequantize_1x128(q, s) - x).detach()
    w = p * (ids >= 0)
    out = (w[:, :, None] * xv[:, None, :]).sum(1)
    (out * gout).sum().backward()
    return out.detach(), x.grad, p.grad


def _split(T, world, rank, empty_rank):
    sizes = [T // world + (r < T % world) for r in range(world)]
    if empty_rank is not None:
        sizes[(empty_rank + 1) % world] += sizes[empty_rank]
        sizes[empty_rank] = 0
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _check_case(rank, world, group, *, seed, T, E, k, mode="random", empty_rank=None,
                capacity_factor=None, fp8=False, weight_in_expert=False, align=4):
    from linghe.dist import ExpertParallelDispatcher

    x, ids, probs = _problem(seed, T, E, k, mode)
    gout = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1))
    sl = _split(T, world, rank, empty_rank)
    xl = x[sl].clone().requires_grad_(True)
    pl = probs[sl].clone().requires_grad_(True)
    d = ExpertParallelDispatcher(E, group=group, align=align, capacity_factor=capacity_factor,
                                 fp8_payload=fp8)
    rows, prow, h = d.dispatch(xl, ids[sl], pl)
    El = d.num_local_experts
    assert rows.shape[0] == h.layout.num_rows and prow.shape == (rows.shape[0],)
    assert h.layout.num_experts == El
    assert bool((h.layout.offsets % align == 0).all())
    if weight_in_expert:
        out = d.combine(rows * prow[:, None], h)
    else:
        out = d.combine(rows, h, pl)
    (out * gout[sl]).sum().backward()
    what = f"{mode} T={T} E={E} k={k} world={world} cap={capacity_factor} fp8={fp8}"
    if capacity_factor is not None:
        # Capacity drops: compare against the reference over the copies that were kept.
        return out.detach(), h
    ro, rdx, rdp = _reference(x, ids, probs, gout, fp8=fp8)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ro[sl], **tol, msg=lambda m: f"out {what}: {m}")
    torch.testing.assert_close(xl.grad, rdx[sl], **tol, msg=lambda m: f"dx {what}: {m}")
    torch.testing.assert_close(pl.grad, rdp[sl], **tol, msg=lambda m: f"dp {what}: {m}")
    assert int(h.num_dropped) == int((ids[sl] < 0).sum()), what
    return out.detach(), h


def _check_capacity(rank, world, group):
    """Capacity mode: static shapes, no host sync; a large factor keeps everything, a small
    one drops copies (counted) and the output is the reference over the kept copies."""
    import linghe.dist.dispatcher as dm
    from linghe.dist import ExpertParallelDispatcher

    T, E, k = 12, 2 * world, 2
    # generous capacity: nothing dropped, equals the default mode
    _check_case(rank, world, group, seed=5, T=T, E=E, k=k, capacity_factor=float(world))
    out, h = _check_case(rank, world, group, seed=5, T=T, E=E, k=k, capacity_factor=1e9)
    assert int(h.num_dropped) == 0
    sl = _split(T, world, rank, None)
    x, ids, probs = _problem(5, T, E, k, "random")
    torch.testing.assert_close(out, _reference(x, ids, probs, torch.zeros(T, H))[0][sl])
    # everything to expert 0 with a tight capacity: copies beyond C are dropped
    d = ExpertParallelDispatcher(E, group=group, align=4, capacity_factor=0.5)
    ids = torch.zeros(T, k, dtype=torch.int32)
    xl, pl = x[sl], probs[sl]
    rows, prow, h = d.dispatch(xl, ids[sl], pl)
    Tl = xl.shape[0]
    C = h.capacity
    # static shapes: rows depend on T, k, W, align only
    assert rows.shape[0] == world * C + d.num_local_experts * 3
    kept = min(C, Tl * k)
    assert int(h.num_dropped) == Tl * k - kept
    out = d.combine(rows, h, pl)
    # the first `kept` copies in (token, j) order of expert 0 survive
    w = torch.zeros(Tl * k)
    w[:kept] = 1
    want = (pl * w.view(Tl, k)).sum(1, keepdim=True) * xl
    torch.testing.assert_close(out, want)
    # no host sync in the capacity path
    calls = []
    orig_item, orig_tolist = torch.Tensor.item, torch.Tensor.tolist
    torch.Tensor.item = lambda self: calls.append("item") or orig_item(self)
    torch.Tensor.tolist = lambda self: calls.append("tolist") or orig_tolist(self)
    try:
        rows, prow, h = d.dispatch(xl, ids[sl], pl)
        d.combine(rows, h, pl)
    finally:
        torch.Tensor.item, torch.Tensor.tolist = orig_item, orig_tolist
    assert not calls, calls
    assert dm is not None


def _dispatcher_worker(rank, world):
    g = dist.group.WORLD
    E = 2 * world
    _check_case(rank, world, g, seed=1, T=11, E=E, k=2)
    _check_case(rank, world, g, seed=2, T=9, E=E, k=3, weight_in_expert=True)
    _check_case(rank, world, g, seed=3, T=7, E=E, k=2, empty_rank=0)          # zero-token rank
    _check_case(rank, world, g, seed=4, T=8, E=E, k=2, mode="skip_last")       # zero experts
    _check_case(rank, world, g, seed=6, T=10, E=E, k=2, mode="one_expert")     # all to one
    _check_case(rank, world, g, seed=7, T=10, E=E, k=2, mode="dropped")        # ids -1
    _check_case(rank, world, g, seed=8, T=0, E=E, k=2)                         # no tokens
    _check_case(rank, world, g, seed=9, T=6, E=E, k=2, fp8=True)
    _check_case(rank, world, g, seed=9, T=6, E=E, k=2, fp8=True, weight_in_expert=True)
    _check_capacity(rank, world, g)
    _check_case(rank, world, g, seed=10, T=8, E=E, k=2, fp8=True, capacity_factor=1e9)


@pytest.mark.parametrize("world", [2, 4])
def test_dispatcher_gloo(world):
    run_ranks(_dispatcher_worker, world, timeout_s=150)


def test_dispatcher_single_process():
    """world_size 1 (group=None): a plain local permute/unpermute."""
    for mode in ("random", "one_expert", "dropped", "skip_last"):
        _check_case(0, 1, None, seed=11, T=9, E=6, k=2, mode=mode)
    _check_case(0, 1, None, seed=12, T=9, E=6, k=2, weight_in_expert=True, align=1)
    _check_case(0, 1, None, seed=13, T=0, E=6, k=2)
    _check_case(0, 1, None, seed=14, T=5, E=4, k=2, fp8=True)


def test_dispatcher_bad_input():
    from linghe.dist import ExpertParallelDispatcher
    with pytest.raises(ValueError, match="num_experts"):
        ExpertParallelDispatcher(0)
    with pytest.raises(ValueError, match="align"):
        ExpertParallelDispatcher(4, align=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        ExpertParallelDispatcher(4, capacity_factor=0.0)
    d = ExpertParallelDispatcher(4)
    x = torch.randn(3, H)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    p = torch.rand(3, 2)
    with pytest.raises(ValueError, match="expert_ids"):
        d.dispatch(x, ids[:2], p)
    with pytest.raises(TypeError, match="expert_ids"):
        d.dispatch(x, ids.float(), p)
    with pytest.raises(ValueError, match="probs"):
        d.dispatch(x, ids, p[:, :1])
    with pytest.raises(TypeError, match="x"):
        d.dispatch(x.to(torch.int32), ids, p)
    rows, prow, h = d.dispatch(x, ids, p)
    with pytest.raises(ValueError, match="y must have"):
        d.combine(rows[1:], h)


def test_fp8_payload_dequant_matches_reference():
    """The broadcast dequantization of the FP8 payload (H % 128 == 0) equals the reference."""
    from linghe import quantize_1x128
    from linghe import reference as ref
    from linghe.dist.dispatcher import _dequant_rows, quantize_1x128_ste
    for H in (256, 200):
        x = torch.randn(5, H, dtype=torch.bfloat16)
        q = quantize_1x128(x, rowwise=True)
        want = ref.dequantize_1x128(q.rowwise_data, q.rowwise_scale).to(torch.bfloat16)
        assert torch.equal(_dequant_rows(q.rowwise_data, q.rowwise_scale, torch.bfloat16), want)
        xs = x.clone().requires_grad_(True)
        y = quantize_1x128_ste(xs)
        assert torch.equal(y, want)
        y.sum().backward()
        assert torch.equal(xs.grad, torch.ones_like(x))
