"""linghe.dist.ExpertParallelDispatcher over gloo (2, 3 and 4 CPU ranks, forked here).

Every rank builds the same global problem from one seed and takes its slice of tokens
(uneven slices; some ranks get none); dispatch -> identity experts -> combine must equal
``sum_k probs * x`` for its tokens, and the gradients to ``x`` and ``probs`` must equal the
single-process autograd reference. Also: capacity drops, the FP8 payload, asynchronous
handles, no host sync in capacity mode, a configuration that differs across ranks, and a
rank that dies or hangs (an error, never a hang).
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

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
    elif mode == "skip_last":  # the upper half of the experts (the last rank's) get nothing
        ids = torch.rand(T, E // 2, generator=g).argsort(1)[:, :k]
    else:
        ids = torch.rand(T, E, generator=g).argsort(1)[:, :k]
    if mode == "dropped":
        ids[::3, -1] = -1
        ids[1::5, 0] = E  # out of range: dropped too
    return x, ids.to(torch.int32), probs


def _reference(x, ids, probs, gout, E, fp8=False):
    """out = sum_k probs * x over routed copies (ids in [0, E); autograd reference)."""
    from linghe import reference as ref
    x = x.clone().requires_grad_(True)
    p = probs.clone().requires_grad_(True)
    xv = x
    if fp8:
        q, s = ref.quantize_1x128(x.detach())
        xv = x + (ref.dequantize_1x128(q, s) - x).detach()
    w = p * _routed(ids, E)
    out = (w[:, :, None] * xv[:, None, :]).sum(1)
    (out * gout).sum().backward()
    return out.detach(), x.grad, p.grad


def _routed(ids, E):
    return (ids >= 0) & (ids < E)


def _split(T, world, rank, empty_rank):
    sizes = [T // world + (r < T % world) for r in range(world)]
    if empty_rank is not None:
        sizes[(empty_rank + 1) % world] += sizes[empty_rank]
        sizes[empty_rank] = 0
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _run(d, xl, idl, pl, weight_in_expert, async_op, fp8_rows=False):
    from linghe.dist import PendingExchange
    if async_op:
        pending = d.dispatch(xl, idl, pl, async_op=True, fp8_rows=fp8_rows)
        assert isinstance(pending, PendingExchange)
        busy = (xl.detach() * 2).sum()  # work queued while the tokens travel
        rows, prow, h = pending.wait()
        again = pending.wait()
        assert again[0] is rows and again[2] is h and pending.is_completed()
        assert torch.isfinite(busy)
    else:
        rows, prow, h = d.dispatch(xl, idl, pl, fp8_rows=fp8_rows)
    if weight_in_expert:
        y, cp = rows * prow[:, None], None
    else:
        y, cp = rows, pl
    if async_op:
        pending = d.combine(y, h, cp, async_op=True)
        out = pending.wait()
        assert pending.wait() is out
    else:
        out = d.combine(y, h, cp)
    return rows, prow, h, out


def _check_case(rank, world, group, *, seed, T, E, k, mode="random", empty_rank=None,
                capacity_factor=None, fp8=False, weight_in_expert=False, align=4,
                async_op=False, fp8_rows=False):
    from linghe.dist import ExpertParallelDispatcher

    x, ids, probs = _problem(seed, T, E, k, mode)
    gout = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1))
    sl = _split(T, world, rank, empty_rank)
    xl = x[sl].clone().requires_grad_(True)
    pl = probs[sl].clone().requires_grad_(True)
    d = ExpertParallelDispatcher(E, group=group, align=align, capacity_factor=capacity_factor,
                                 fp8_payload=fp8)
    rows, prow, h, out = _run(d, xl, ids[sl], pl, weight_in_expert, async_op, fp8_rows)
    El = d.num_local_experts
    if fp8_rows:  # the arrived e4m3 rows and 1x128 scales, as an Fp8Tensor
        from linghe import Fp8Tensor
        assert isinstance(rows, Fp8Tensor) and rows.dtype == xl.dtype
        q, sc = rows.rowwise_data, rows.rowwise_scale
        assert q.dtype == torch.float8_e4m3fn and sc.shape == (rows.shape[0], 1)
    assert rows.shape[0] == h.layout.num_rows and prow.shape == (rows.shape[0],)
    assert h.layout.num_experts == El
    assert bool((h.layout.offsets % align == 0).all())
    # padding and tail rows are zeros (poisoned outputs would show NaN)
    real = torch.zeros(rows.shape[0], dtype=torch.bool)
    for e in range(El):
        o = int(h.layout.offsets[e])
        real[o:o + int(h.layout.tokens_per_expert[e])] = True
    assert bool((rows[~real] == 0).all()) and bool((prow[~real] == 0).all())
    if fp8_rows:
        assert bool((rows.rowwise_scale[~real] == 1).all())
    assert torch.isfinite(rows).all() and torch.isfinite(prow).all()
    (out * gout[sl]).sum().backward()
    what = f"{mode} T={T} E={E} k={k} world={world} cap={capacity_factor} fp8={fp8}"
    if capacity_factor is not None:
        return out.detach(), h
    ro, rdx, rdp = _reference(x, ids, probs, gout, E, fp8=fp8)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ro[sl], **tol, msg=lambda m: f"out {what}: {m}")
    torch.testing.assert_close(xl.grad, rdx[sl], **tol, msg=lambda m: f"dx {what}: {m}")
    torch.testing.assert_close(pl.grad, rdp[sl], **tol, msg=lambda m: f"dp {what}: {m}")
    assert int(h.num_dropped) == int((~_routed(ids[sl], E)).sum()), what
    # rows received here = copies routed to this rank's experts, from every rank
    lo, hi = rank * El, (rank + 1) * El
    assert int(h.layout.tokens_per_expert.sum()) == int(((ids >= lo) & (ids < hi)).sum())
    return out.detach(), h


class _HostSyncOps(TorchDispatchMode):
    """Records aten ops that make a CUDA stream wait for the host: value reads and ops
    whose output shape depends on the data (on CPU nothing waits; the ops show it)."""

    SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique",
                "_unique", "_unique2", "unique_consecutive", "bincount", "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.SYNC_OPS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _no_host_sync(fn):
    """``fn()`` under the dispatch-mode detector, with ``Tensor.item/tolist`` patched too
    (``tolist`` reads memory without an aten op); returns the recorded syncs."""
    calls = []
    orig_item, orig_tolist = torch.Tensor.item, torch.Tensor.tolist
    torch.Tensor.item = lambda self: calls.append("item") or orig_item(self)
    torch.Tensor.tolist = lambda self: calls.append("tolist") or orig_tolist(self)
    try:
        with _HostSyncOps() as mode:
            fn()
    finally:
        torch.Tensor.item, torch.Tensor.tolist = orig_item, orig_tolist
    return calls + mode.seen


def _check_capacity(rank, world, group):
    """Capacity mode: static shapes; a large factor keeps everything, a small one drops
    copies (counted) and the output is the reference over the kept copies; forward and
    backward make no host sync (after the first call's configuration check)."""
    from linghe.dist import ExpertParallelDispatcher

    T, E, k = 12, 2 * world, 2
    # generous capacity: nothing dropped, equals the reference
    out, h = _check_case(rank, world, group, seed=5, T=T, E=E, k=k, capacity_factor=1e9)
    assert int(h.num_dropped) == 0
    sl = _split(T, world, rank, None)
    x, ids, probs = _problem(5, T, E, k, "random")
    torch.testing.assert_close(out, _reference(x, ids, probs, torch.zeros(T, H), E)[0][sl])
    # everything to expert 0 with a tight capacity: copies beyond C are dropped
    d = ExpertParallelDispatcher(E, group=group, align=4, capacity_factor=0.5)
    ids = torch.zeros(T, k, dtype=torch.int32)
    xl = x[sl].clone().requires_grad_(True)
    pl = probs[sl].clone().requires_grad_(True)
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
    gout = torch.randn_like(out)
    # a residual (the shared experts' output) is added to the received rows
    res = torch.randn_like(out).requires_grad_(True)
    out_r = d.combine(rows, h, pl, residual=res)
    torch.testing.assert_close(out_r, out + res)
    assert torch.equal(torch.autograd.grad(out_r, res, gout, retain_graph=True)[0], gout)
    (out * gout).sum().backward()
    torch.testing.assert_close(xl.grad, (pl * w.view(Tl, k)).sum(1, keepdim=True) * gout)
    torch.testing.assert_close(pl.grad, w.view(Tl, k) * (gout * xl).sum(1, keepdim=True))

    def step():  # a steady-state call: forward, backward, the dropped count
        xs = xl.detach().requires_grad_(True)
        r, pr, hh = d.dispatch(xs, ids[sl], pl.detach())
        o = d.combine(r * pr[:, None], hh)
        o.sum().backward()
        return hh.num_dropped

    syncs = _no_host_sync(step)
    assert not syncs, f"host syncs in capacity mode: {syncs}"


# (case kwargs, world sizes that run it): every case runs on 2 ranks; 3 and 4 ranks run
# the ones whose bookkeeping depends on the number of ranks (uneven and empty slices, a
# rank that receives nothing, capacity blocks), which keeps the interpreter time down.
_CASES = [
    (dict(seed=1, T=11, k=2), (2, 3, 4)),                                    # uneven slices
    (dict(seed=2, T=9, k=3, weight_in_expert=True, async_op=True), (2, 4)),
    (dict(seed=3, T=7, k=2, empty_rank=0), (2, 3)),                          # zero-token rank
    (dict(seed=4, T=8, k=2, mode="skip_last"), (2, 3, 4)),                   # receives nothing
    (dict(seed=6, T=10, k=2, mode="one_expert"), (2,)),                      # all to one
    (dict(seed=7, T=10, k=2, mode="dropped"), (2, 4)),                       # ids -1 / >= E
    (dict(seed=8, T=0, k=2, async_op=True), (2,)),                           # no tokens
    (dict(seed=9, T=6, k=2, fp8=True), (2, 3)),
    (dict(seed=9, T=6, k=2, fp8=True, weight_in_expert=True, async_op=True), (2,)),
    (dict(seed=12, T=7, k=2, fp8=True, fp8_rows=True, weight_in_expert=True), (2, 4)),
]


def _dispatcher_worker(rank, world):
    g = dist.group.WORLD
    for kw, worlds in _CASES:
        if world in worlds:
            _check_case(rank, world, g, E=2 * world, **kw)
    _check_capacity(rank, world, g)
    if world < 4:
        _check_case(rank, world, g, seed=10, T=3 * world, E=2 * world, k=2, fp8=True,
                    capacity_factor=1e9, async_op=True)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatcher_gloo(world):
    run_ranks(_dispatcher_worker, world, timeout_s=150)


def _mismatch_worker(rank, world):
    """Each sub-case makes one rank differ; every rank raises a ValueError naming the
    field and the ranks (the check is an all-gather, so all ranks see it)."""
    from linghe.dist import ExpertParallelDispatcher
    g = dist.group.WORLD
    T, k = 4, 2
    cases = [  # (field in the message, dispatcher kwargs, x dtype, hidden, top_k, T)
        ("hidden size", {}, torch.float32, 16 if rank == 1 else H, k, T),
        ("top_k", {}, torch.float32, H, 3 if rank == 2 else k, T),
        ("dtype", {}, torch.bfloat16 if rank == 0 else torch.float32, H, k, T),
        ("fp8_payload", {"fp8_payload": rank == 1}, torch.float32, H, k, T),
        ("capacity_factor", {"capacity_factor": 2.0} if rank == 0 else {}, torch.float32, H,
         k, T),
        ("tokens per rank", {"capacity_factor": 2.0}, torch.float32, H, k, T + rank),
        ("num_experts", {"num_experts": 2 * world if rank else 4 * world}, torch.float32, H,
         k, T),
    ]
    for field, kw, dtype, hid, kk, t in cases:
        kw = dict(kw)
        E = kw.pop("num_experts", 2 * world)
        d = ExpertParallelDispatcher(E, group=g, **kw)
        x = torch.randn(t, hid, dtype=dtype)
        ids = torch.randint(0, E, (t, kk), dtype=torch.int32)
        with pytest.raises(ValueError, match=field) as err:
            d.dispatch(x, ids, torch.rand(t, kk))
        assert "on ranks [" in str(err.value), str(err.value)
    # the ranks agree again: a dispatch works (the group is still usable)
    _check_case(rank, world, g, seed=1, T=5, E=2 * world, k=2)


def test_configuration_mismatch_is_an_error():
    run_ranks(_mismatch_worker, 3, timeout_s=120)


def _dead_rank_worker(rank, world):
    """Rank 1 dies after one good dispatch; rank 0's next dispatch raises at once."""
    from linghe.dist import ExpertParallelDispatcher
    d = ExpertParallelDispatcher(4, group=dist.group.WORLD, timeout=60)
    x, ids, p = torch.randn(3, H), torch.randint(0, 4, (3, 2), dtype=torch.int32), torch.rand(3, 2)
    d.dispatch(x, ids, p)
    if rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        d.dispatch(x, ids, p)
    except RuntimeError as e:
        assert "did not complete" in str(e) and "split-size" in str(e), str(e)
    else:
        raise AssertionError("dispatch with a dead peer returned")
    assert time.monotonic() - t0 < 30
    os._exit(0)  # the group is broken: skip the interpreter's teardown


def _hung_rank_worker(rank, world):
    """Capacity mode (no host sync): rank 1 stops calling; rank 0's wait for the exchange
    is bounded by the dispatcher's timeout (1 s here) and raises."""
    from linghe.dist import ExpertParallelDispatcher
    d = ExpertParallelDispatcher(4, group=dist.group.WORLD, capacity_factor=2.0, timeout=1)
    x, ids, p = torch.randn(3, H), torch.randint(0, 4, (3, 2), dtype=torch.int32), torch.rand(3, 2)
    d.dispatch(x, ids, p)
    if rank == 1:
        time.sleep(2.5)
        os._exit(0)
    t0 = time.monotonic()
    try:
        d.dispatch(x, ids, p)
    except RuntimeError as e:
        msg = str(e)
        assert "did not complete" in msg and "bounded by 1 s" in msg, msg
    else:
        raise AssertionError("dispatch with a hung peer returned")
    assert time.monotonic() - t0 < 2.5
    os._exit(0)


@pytest.mark.parametrize("worker", [_dead_rank_worker, _hung_rank_worker],
                         ids=["dead", "hung"])
def test_failed_rank_is_an_error(worker):
    run_ranks(worker, 2, timeout_s=60, finalize=False)


def test_dispatcher_single_process():
    """world_size 1 (group=None): a plain local permute/unpermute (async: done at once)."""
    for mode in ("random", "one_expert", "dropped", "skip_last"):
        _check_case(0, 1, None, seed=11, T=9, E=6, k=2, mode=mode)
    _check_case(0, 1, None, seed=12, T=9, E=6, k=2, weight_in_expert=True, align=1,
                async_op=True)
    _check_case(0, 1, None, seed=13, T=0, E=6, k=2)
    _check_case(0, 1, None, seed=14, T=5, E=4, k=2, fp8=True)
    _check_case(0, 1, None, seed=15, T=5, E=4, k=2, fp8=True, fp8_rows=True,
                weight_in_expert=True)


def test_dispatcher_bad_input():
    from linghe.dist import ExpertParallelDispatcher
    with pytest.raises(ValueError, match="num_experts"):
        ExpertParallelDispatcher(0)
    with pytest.raises(ValueError, match="align"):
        ExpertParallelDispatcher(4, align=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        ExpertParallelDispatcher(4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="timeout"):
        ExpertParallelDispatcher(4, timeout=0)
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
    with pytest.raises(ValueError, match="handle"):
        ExpertParallelDispatcher(4).combine(rows, h)
    with pytest.raises(ValueError, match="probs"):
        d.combine(rows, h, p[:2])
    with pytest.raises(ValueError, match="fp8_rows"):
        d.dispatch(x, ids, p, fp8_rows=True)
    d8 = ExpertParallelDispatcher(4, fp8_payload=True)
    rows8, _, h8 = d8.dispatch(x, ids, p, fp8_rows=True)
    with pytest.raises(TypeError, match="Fp8Tensor"):
        d8.combine(rows8, h8)


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


# ------------------------------------------------------------------ offline GPU compile
_COMPILE_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from linghe.dist import kernels as K

def comp(fn, sig, consts, warps, div=("stride", "wstride", "H", "stride_x")):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or n in div}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return k.asm["ptx"]

def warps(*blocks):  # the launchers' rule
    n = 1
    for b in blocks:
        n *= b
    return 4 if n <= 4096 else 8

H, k = 2048, 8  # the benchmark's shape, with the launchers' tiles for it
V = dict(Pd="*bf16", Pw="*fp32", Qd="*bf16", Qw="*fp32", n_split="i32", q_base="i32",
         stride="i32", wstride="i32", TW="i32")
V8 = dict(V, Pd="*fp8e4nv", Qd="*fp8e4nv")
ssig = dict(x_ptr="*bf16", p_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i32", row_ptr="*i32",
            offs_ptr="*i32", slot_ptr="*i32", dot_ptr="*bf16", dp_ptr="*fp32")
srest = dict(T="i32", H="i32", G="i32", stride_x="i32", El="i32", rank="i32", C="i32",
             n_tok_progs="i32", K_TOP="constexpr", BT="constexpr", BH="constexpr",
             BK="constexpr", BR="constexpr", SLOTS="constexpr", CAP="constexpr",
             HAS_P="constexpr", HAS_W="constexpr", QUANT="constexpr", POW2="constexpr",
             DOT="constexpr")
for quant, cap in ((False, False), (False, True), (True, False), (True, True)):
    BT, BK, BH = K._token_tiles(H, k, quant)
    ptx = comp(K._scatter_tokens_kernel, {**ssig, **(V8 if quant else V), **srest},
               dict(K_TOP=k, BT=BT, BH=BH, BK=BK, BR=64, SLOTS=True, CAP=cap, HAS_P=True,
                    HAS_W=False, QUANT=quant, POW2=cap, DOT=False), warps(BT, BK, BH))
    assert "st.global.v4" in ptx, ("dispatch pack: 16-byte row stores", quant, cap)
BT, BK, BH = K._token_tiles(H, k)
BT = max(1, BT // 2)
ptx = comp(K._scatter_tokens_kernel, {**ssig, **V, **srest},
           dict(K_TOP=k, BT=BT, BH=BH, BK=BK, BR=64, SLOTS=False, CAP=False, HAS_P=False,
                HAS_W=True, QUANT=False, POW2=False, DOT=True), warps(BT, BK, BH))
assert "st.global.v4" in ptx and "ld.global.v4" in ptx, "combine backward"
usig = dict(ridx_ptr="*i32", out_ptr="*bf16", os_ptr="*fp32", prow_ptr="*fp32",
            offs_ptr="*i32", tpe_ptr="*i32", N="i32", H="i32", G="i32", El="i32", R="i32",
            n_slot_progs="i32", n_tail_progs="i32", BT="constexpr", BH="constexpr",
            BR="constexpr", BHZ="constexpr", BG="constexpr", HAS_P="constexpr",
            DEQUANT="constexpr", FP8OUT="constexpr")
for deq, f8 in ((False, False), (True, False), (False, True)):
    BT, BH = K._row_tiles(H, 1 if f8 else 2)
    nw = warps(BT, BH)
    if deq or f8:
        BT, nw = 32, 4  # the launcher's tile for 128-column groups
    sig = {**(V8 if deq or f8 else V), **usig}
    if f8:
        sig["out_ptr"] = "*fp8e4nv"
    ptx = comp(K._unpack_rows_kernel, sig, dict(BT=BT, BH=BH, BR=16, BHZ=1024, BG=16,
                                                 HAS_P=True, DEQUANT=deq, FP8OUT=f8), nw)
    assert "st.global.v4" in ptx and "ld.global.v4" in ptx, ("unpack", deq, f8)
psig = dict(src_ptr="*bf16", sprow_ptr="*fp32", ridx_ptr="*i32", **V, N="i32", H="i32",
            BT="constexpr", BH="constexpr", HAS_P="constexpr")
for hp in (False, True):
    ptx = comp(K._pack_rows_kernel, psig, dict(BT=BT, BH=BH, HAS_P=hp), warps(BT, BH))
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, ("pack", hp)
gsig = dict(**V, slot_ptr="*i32", w_ptr="*fp32", out_ptr="*bf16", dp_ptr="*fp32", T="i32",
            H="i32", K_TOP="constexpr", BT="constexpr", BH="constexpr", BK="constexpr",
            HAS_W="constexpr", PGRAD="constexpr")
BT, BK, BH = K._token_tiles(H, k)
for hw, pg in ((True, False), (False, True)):
    ptx = comp(K._gather_tokens_kernel, gsig, dict(K_TOP=k, BT=BT, BH=BH, BK=BK, HAS_W=hw,
                                                   PGRAD=pg), 4)
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, ("gather", hw, pg)
print("COMPILED")
'''


def test_kernels_compile_for_sm90(compile_sm90):
    """Compile the exchange kernels for an H100/H200 (sm_90) without a GPU, in a subprocess
    without TRITON_INTERPRET, with the launchers' tiles for H=2048, top-8: catches
    GPU-only compile errors (e.g. a name bound to two types in a runtime branch, which the
    interpreter accepts) and checks that row copies use 16-byte accesses."""
    compile_sm90(_COMPILE_SCRIPT)
