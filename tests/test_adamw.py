"""linghe.optim.AdamW: the update against linghe/reference.py and torch.optim.AdamW, fused
clipping, skipped parameters, param groups, state_dict both ways, input checks, and (GPU)
CUDA-graph capture without host syncs."""

import copy

import numpy as np
import pytest
import torch

import linghe
from linghe import optim
from linghe import reference as ref
from linghe.testing import assert_close

# sizes: empty, one element, odd, several 16384-element chunks with a tail
SIZES = [0, 1, 33, 70_001]
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _params(sizes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(device, dtype)) for n in sizes]


def _clone(ps):
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


def _set_grads(groups_of_params, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    for ps in groups_of_params:
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype)
    # the same gradients in every list
    for ps in groups_of_params[1:]:
        for p, q in zip(ps, groups_of_params[0]):
            p.grad = q.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_reference(device, dtype, maximize):
    ps = _params(SIZES, dtype, device)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    opt = optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, maximize=maximize)
    for step in range(1, 4):
        _set_grads([ps], seed=step)
        # the reference starts from this step's state (so errors do not compound)
        exp = [p.detach().clone() for p in ps]
        if step == 1:
            ms = [torch.zeros_like(p) for p in ps]
            vs = [torch.zeros_like(p) for p in ps]
        else:
            ms = [opt.state[p]["exp_avg"].clone() for p in ps]
            vs = [opt.state[p]["exp_avg_sq"].clone() for p in ps]
        ref.adamw_step(exp, [p.grad for p in ps], ms, vs, [step] * len(ps), lr=lr, beta1=b1,
                       beta2=b2, eps=eps, weight_decay=wd, maximize=maximize)
        opt.step()
        for p, e, m, v in zip(ps, exp, ms, vs):
            st = opt.state[p]
            assert st["step"].item() == step and st["step"].dtype == torch.float32
            assert st["exp_avg"].dtype == dtype
            assert_close(p.detach(), e, tol=TOL[dtype], name="param")
            assert_close(st["exp_avg"], m, tol=TOL[dtype], name="exp_avg")
            assert_close(st["exp_avg_sq"], v, tol=TOL[dtype], name="exp_avg_sq")


def test_rows_without_gradients(device):
    """Rows without gradients (zero moments: an embedding's unseen tokens) beside rows
    with them, three steps: the former keep their values exactly (no weight decay), the
    rest match the reference."""
    ps = _params([300], torch.float32, device)
    opt = optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(1, 4):
        _set_grads([ps], seed=step)
        ps[0].grad[:200] = 0.0
        exp = [p.detach().clone() for p in ps]
        st = opt.state.get(ps[0], {})
        ms = [st["exp_avg"].clone() if st else torch.zeros_like(ps[0])]
        vs = [st["exp_avg_sq"].clone() if st else torch.zeros_like(ps[0])]
        ref.adamw_step(exp, [ps[0].grad], ms, vs, [step], lr=1e-2, beta1=0.9, beta2=0.95,
                       eps=1e-8, weight_decay=0.0, maximize=False)
        opt.step()
        assert torch.equal(ps[0].detach()[:200], exp[0][:200])  # untouched: no gradient
        assert_close(ps[0].detach(), exp[0], tol=TOL[torch.float32], name="param")


@pytest.mark.parametrize("piece", [48, 65536])
def test_pieces_match_reference(device, monkeypatch, piece):
    # Program p takes pieces p, p + G, ... (piece=48: several per tensor, tails shorter;
    # the default: smaller pieces for a group this small); every element updated once.
    from linghe.optim import multi_tensor as K

    monkeypatch.setitem(K.ADAMW_CONFIG, "piece", piece)
    ps = _params([1000, 77, 1, 4101, 96], torch.float32, device)
    exp = [p.detach().clone() for p in ps]
    _set_grads([ps], seed=3)
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    ref.adamw_step(exp, [p.grad for p in ps], ms, vs, [1] * len(ps), lr=1e-2, beta1=0.9,
                   beta2=0.95, eps=1e-8, weight_decay=0.1, maximize=False)
    opt = optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt.step()
    for p, e, v in zip(ps, exp, vs):
        assert_close(p.detach(), e, tol=TOL[torch.float32], name="param")
        assert_close(opt.state[p]["exp_avg_sq"], v, tol=TOL[torch.float32], name="v")
    # the table: round-robin pieces of at most `piece` elements
    seg = K._interleaved_segments(np.arange(5), np.array([1000, 77, 1, 4101, 96]), 4,
                                  piece, np.zeros(5, dtype=np.int64))
    ptr, rows = seg[:5], seg[5:].reshape(-1, 4)
    assert ptr[0] == 0 and ptr[-1] == len(rows) and rows[:, 2].max() == min(piece, 4101)
    assert rows[:, 2].sum() == 1000 + 77 + 1 + 4101 + 96


def test_unaligned_views_and_mixed_dtypes(device):
    # Parameters that are views at odd offsets take the unaligned (scalar-load) launch;
    # a bf16 parameter is a second dtype group of the same step; both match torch.
    buf = torch.randn(4000, device=device)
    ps = [torch.nn.Parameter(buf[1:1001]), torch.nn.Parameter(buf[1003:1500])]
    ps_t = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    bf = torch.nn.Parameter(torch.randn(777, device=device).bfloat16())
    bf_t = torch.nn.Parameter(bf.detach().clone())
    for p, q in zip(ps + [bf], ps_t + [bf_t]):
        g = torch.randn(p.shape, device=device)
        p.grad, q.grad = g.to(p.dtype), g.to(q.dtype)
    assert ps[0].data_ptr() % 16 and ps[1].data_ptr() % 16
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optim.AdamW(ps + [bf], **hyper).step()
    torch.optim.AdamW(ps_t + [bf_t], foreach=False, **hyper).step()
    for p, q in zip(ps, ps_t):
        assert_close(p.detach(), q.detach(), tol=TOL[torch.float32], name="param")
    assert_close(bf.detach().float(), bf_t.detach().float(), tol=TOL[torch.bfloat16],
                 name="bf16 param")


def test_segment_tables_cover_every_element_once():
    # Table-only (no allocation): a tensor over 2^30 elements is cut into segments of at
    # most 2^30; pieces and shares cover every element once, starts 16-aligned.
    from linghe.optim import multi_tensor as K

    sizes = np.array([3 * 2**30 + 5, 17, 1, 70_000], dtype=np.int64)
    slots = np.arange(len(sizes))
    extra = np.array([7, 8, 9, 10], dtype=np.int64)
    for seg, width in ((K._segments(slots, sizes, 5), 3),
                       (K._interleaved_segments(slots, sizes, 5, 2**30, extra), 4),
                       (K._interleaved_segments(slots, sizes, 5, 2**20, extra), 4)):
        ptr, rows = seg[:6], seg[6:].reshape(-1, width)
        assert ptr[0] == 0 and ptr[-1] == len(rows) and (np.diff(ptr) >= 0).all()
        assert rows[:, 2].max() <= 2**30 and (rows[:, 1] % 16 == 0).all()
        if width == 4:
            assert (rows[:, 3] == extra[rows[:, 0]]).all()
        for t, n in enumerate(sizes):
            mine = rows[rows[:, 0] == t]
            mine = mine[np.argsort(mine[:, 1])]
            assert mine[0, 1] == 0 and mine[:, 2].sum() == n
            assert (mine[1:, 1] == mine[:-1, 1] + mine[:-1, 2]).all()


def test_matches_torch_param_groups_and_lr_tensor(device):
    a, b = _params([300, 17], torch.float32, device), _params([1000], torch.float32, device, 1)
    a_t, b_t = _clone(a), _clone(b)
    lr_t = torch.tensor(3e-3, device=device)
    groups = [dict(params=a, lr=1e-2, weight_decay=0.0), dict(params=b)]
    groups_t = [dict(params=a_t, lr=1e-2, weight_decay=0.0), dict(params=b_t)]
    opt = optim.AdamW(groups, lr=lr_t, betas=(0.8, 0.99), weight_decay=0.05)
    opt_t = torch.optim.AdamW(groups_t, lr=3e-3, betas=(0.8, 0.99), weight_decay=0.05,
                              foreach=False)
    for step in range(5):
        _set_grads([a + b, a_t + b_t], seed=10 + step)
        if step == 3:  # a new learning rate through the tensor (no new plan, no host read)
            lr_t.fill_(1e-3)
            opt_t.param_groups[1]["lr"] = 1e-3
        opt.step()
        opt_t.step()
    for p, q in zip(a + b, a_t + b_t):
        assert_close(p.detach(), q.detach(), tol=1e-5)
        assert_close(opt.state[p]["exp_avg_sq"], opt_t.state[q]["exp_avg_sq"], tol=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_max_grad_norm_matches_clip_then_step(device, norm_type):
    # (20_001: two chunks and a tail; the interpreter's inf-norm reduction is slow)
    ps = _params([5000, 3, 20_001], torch.float32, device)
    ps_t = _clone(ps)
    opt = optim.AdamW(ps, lr=1e-3, max_grad_norm=0.5, norm_type=norm_type)
    opt_t = torch.optim.AdamW(ps_t, lr=1e-3, foreach=False)
    for step in range(3):
        _set_grads([ps, ps_t], seed=20 + step, scale=3.0)
        grads_before = [p.grad.clone() for p in ps]
        norm_t = torch.nn.utils.clip_grad_norm_(ps_t, 0.5, norm_type=norm_type)
        opt.step()
        opt_t.step()
        assert_close(opt.grad_norm, norm_t, tol=1e-5, name="grad_norm")
        for p, g in zip(ps, grads_before):  # clipping happens inside the update
            assert torch.equal(p.grad, g)
    for p, q in zip(ps, ps_t):
        assert_close(p.detach(), q.detach(), tol=1e-5)
        assert_close(opt.state[p]["exp_avg"], opt_t.state[q]["exp_avg"], tol=1e-5)
    assert "max_grad_norm=0.5" in repr(opt) or opt.max_grad_norm == 0.5


def test_params_without_grad_are_skipped(device):
    ps = _params([40, 50, 60], torch.float32, device)
    ps_t = _clone(ps)
    opt = optim.AdamW(ps, lr=1e-2)
    opt_t = torch.optim.AdamW(ps_t, lr=1e-2, foreach=False)
    for step, skip in enumerate([None, 1, 1, None, 0]):
        _set_grads([ps, ps_t], seed=30 + step)
        if skip is not None:
            ps[skip].grad = ps_t[skip].grad = None
        before = [p.detach().clone() for p in ps]
        opt.step()
        opt_t.step()
        if skip is not None:
            assert torch.equal(ps[skip].detach(), before[skip])
        for p, q in zip(ps, ps_t):
            assert_close(p.detach(), q.detach(), tol=1e-5)
            if q in opt_t.state:
                assert opt.state[p]["step"].item() == opt_t.state[q]["step"].item()
    assert [opt.state[p]["step"].item() for p in ps] == [4.0, 3.0, 5.0]
    # nothing to do: no gradients at all
    for p in ps:
        p.grad = None
    opt.step()
    assert [opt.state[p]["step"].item() for p in ps] == [4.0, 3.0, 5.0]


def test_betas_changed_between_steps(device):
    ps = _params([100], torch.float32, device)
    ps_t = _clone(ps)
    opt = optim.AdamW(ps, lr=1e-2)
    opt_t = torch.optim.AdamW(ps_t, lr=1e-2, foreach=False)
    for step in range(4):
        if step == 2:
            opt.param_groups[0]["betas"] = opt_t.param_groups[0]["betas"] = (0.5, 0.9)
        _set_grads([ps, ps_t], seed=40 + step)
        opt.step()
        opt_t.step()
    assert_close(ps[0].detach(), ps_t[0].detach(), tol=1e-5)


def test_state_dict_both_ways_with_torch(device):
    ps = _params([64, 7], torch.float32, device)
    ps_t = _clone(ps)
    opt = optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    for step in range(2):
        _set_grads([ps], seed=50 + step)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # ours -> torch: torch continues where we stopped
    with torch.no_grad():
        for p, q in zip(ps, ps_t):
            q.copy_(p)
    opt_t = torch.optim.AdamW(ps_t, lr=1e-2, weight_decay=0.1, foreach=False)
    opt_t.load_state_dict(sd)
    # torch -> ours: a fresh linghe optimizer over copies, loaded from torch's state
    ps2 = _clone(ps)
    opt2 = optim.AdamW(ps2, lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(copy.deepcopy(opt_t.state_dict()))
    for step in range(2):
        _set_grads([ps, ps_t, ps2], seed=60 + step)
        opt.step()
        opt_t.step()
        opt2.step()
    for p, q, r in zip(ps, ps_t, ps2):
        assert_close(p.detach(), q.detach(), tol=1e-5)
        assert_close(r.detach(), q.detach(), tol=1e-5)
        assert opt2.state[r]["step"].item() == 4.0
        assert opt2.state[r]["step"].device == r.device


def test_step_bumps_fp8_weight_cache_generation(device):
    from linghe.fp8 import cache

    ps = _params([10], torch.float32, device)
    opt = optim.AdamW(ps)
    _set_grads([ps], seed=1)
    gen = cache._GENERATION[0]
    opt.step()
    assert cache._GENERATION[0] == gen + 1


def test_bad_inputs(device):
    ps = _params([10], torch.float32, device)
    with pytest.raises(ValueError, match="learning rate"):
        optim.AdamW(ps, lr=-1.0)
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        optim.AdamW(ps, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="weight_decay"):
        optim.AdamW(ps, weight_decay=-0.1)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        optim.AdamW(ps, amsgrad=True)
    with pytest.raises(ValueError, match="max_norm"):
        optim.AdamW(ps, max_grad_norm=float("nan"))
    p64 = torch.nn.Parameter(torch.randn(4, dtype=torch.float64, device=device))
    p64.grad = torch.randn_like(p64)
    with pytest.raises(TypeError, match="float64"):
        optim.AdamW([p64]).step()
    pt = torch.nn.Parameter(torch.randn(4, 6, device=device).t())
    pt.grad = torch.randn_like(pt)
    with pytest.raises(ValueError, match="contiguous parameters"):
        optim.AdamW([pt]).step()
    # a non-contiguous gradient is read through a copy
    p = torch.nn.Parameter(torch.randn(6, 4, device=device))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = torch.randn(4, 6, device=device).t()
    q.grad = p.grad.contiguous()
    optim.AdamW([p]).step()
    torch.optim.AdamW([q], foreach=False).step()
    assert_close(p.detach(), q.detach(), tol=1e-5)


def test_new_gradient_tensors_reuse_the_tables(device):
    """Gradients allocated anew every step (zero_grad(set_to_none=True) + backward) move
    around; the chunk tables depend only on sizes, dtypes and alignment, so only the small
    address arrays are uploaded (a table of a 7B model has ~440K rows)."""
    from unittest import mock

    from linghe.optim import multi_tensor as K

    optim.clear_plan_cache()
    ps = _params([5000, 3, 70_001], torch.float32, device)
    ps_t = _clone(ps)
    opt = optim.AdamW(ps, lr=1e-2, max_grad_norm=1.0)
    opt_t = torch.optim.AdamW(ps_t, lr=1e-2, foreach=False)
    built = []
    with mock.patch.object(K, "_build_plan", side_effect=K._build_plan) as norm_b, \
            mock.patch.object(K, "build_adamw_plan", side_effect=K.build_adamw_plan) as adam_b:
        for step in range(4):
            _set_grads([ps, ps_t], seed=90 + step)  # new gradient tensors, new addresses
            opt.step()
            torch.nn.utils.clip_grad_norm_(ps_t, 1.0)
            opt_t.step()
            built.append((norm_b.call_count, adam_b.call_count))
    assert built[-1] == (1, 1), built
    for p, q in zip(ps, ps_t):
        assert_close(p.detach(), q.detach(), tol=1e-5)


def test_plans_read_by_a_captured_graph_are_never_evicted():
    """A captured CUDA graph reads a plan's table and address array by address, so the
    caches' LRU eviction skips them (marked as the capture marks them)."""
    from collections import OrderedDict

    from linghe.optim import multi_tensor as K

    d = OrderedDict((k, k) for k in range(5))
    K.evict_oldest(d, 3, lambda k, _v: k in (0, 2))
    assert list(d) == [0, 2, 4]
    K.evict_oldest(d, 1, lambda k, _v: True)  # nothing evictable: kept over the size
    assert list(d) == [0, 2, 4]
    sets = K.AddressSets(torch.device("cpu"), size=2)
    first = sets.get((1, 2))
    sets.kept.add((1, 2))  # what a get() under capture records
    for i in range(5):
        sets.get((10 + i,))
    assert sets.get((1, 2)) is first and len(sets.d) == 2
    K.clear_plan_cache()
    plan = K.get_plan("float", [[torch.randn(3)]], torch.device("cpu")).plan
    plan.addr_sets.kept.add(next(iter(plan.addr_sets.d)))
    K.clear_plan_cache()
    assert K.get_plan("float", [[torch.randn(3)]], torch.device("cpu")).plan is plan
    plan.addr_sets.kept.clear()
    K.clear_plan_cache()


def test_prepare_step_changes_nothing(device):
    ps = _params([100, 3], torch.float32, device)
    ps_t = _clone(ps)
    opt = optim.AdamW(ps, lr=1e-2, max_grad_norm=1.0)
    opt_t = torch.optim.AdamW(ps_t, lr=1e-2, foreach=False)
    _set_grads([ps, ps_t], seed=80)
    before = [p.detach().clone() for p in ps]
    opt.prepare_step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert all(opt.state[p]["step"].item() == 0 and not opt.state[p]["exp_avg"].any()
               for p in ps)
    opt.step()
    torch.nn.utils.clip_grad_norm_(ps_t, 1.0)
    opt_t.step()
    for p, q in zip(ps, ps_t):
        assert_close(p.detach(), q.detach(), tol=1e-5)


def test_exported():
    assert linghe.optim.AdamW is optim.AdamW
    assert issubclass(optim.AdamW, torch.optim.Optimizer)


# ------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_cuda_graph_capture_no_host_sync(device):
    ps = _params([70_001, 3, 4096], torch.bfloat16, device)
    ps_t = _clone(ps)
    lr = torch.tensor(1e-3, device=device)
    opt = optim.AdamW(ps, lr=lr, max_grad_norm=1.0)
    opt_t = optim.AdamW(ps_t, lr=1e-3, max_grad_norm=1.0)
    _set_grads([ps, ps_t], seed=70)
    opt.step()  # warm-up: compile, state, plans
    opt_t.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
        opt_t.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # new gradient tensors (as a backward after zero_grad(set_to_none=True) makes them):
    # prepare_step builds their tables outside the capture
    for p, q in zip(ps, ps_t):
        p.grad = p.grad.clone()
        q.grad = p.grad.clone()
    opt.prepare_step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):  # replays advance the step counts and bias corrections
        graph.replay()
        opt_t.step()
    torch.cuda.synchronize()
    for p, q in zip(ps, ps_t):
        assert opt.state[p]["step"].item() == opt_t.state[q]["step"].item() == 5.0
        assert_close(p.detach(), q.detach(), tol=1e-2)


# ------------------------------------------------------------ FP8 copies made in the step


def _bound_weights(device, dtype=torch.bfloat16, pow2=True):
    """A grouped expert weight [E, N, K] and a 2-D Linear weight, each bound to a
    WeightCache the way the FP8 layers bind them (odd K, partial 128 blocks)."""
    from linghe.fp8 import WeightCache
    from linghe.functional.grouped_mm import cached_grouped_weight

    g = torch.Generator().manual_seed(3)
    w3 = torch.nn.Parameter((torch.randn(3, 128, 136, generator=g) / 8).to(device, dtype))
    w2 = torch.nn.Parameter((torch.randn(200, 72, generator=g) / 8).to(device, dtype))
    c3, c2 = WeightCache(), WeightCache()
    cached_grouped_weight(c3, w3, pow2)  # a miss: binds the weight
    c2.get(w2, lambda w: linghe.quantize_128x128(w, columnwise=True, pow2_scale=pow2),
           ("plain", pow2))
    c2.bind_128x128(w2, ("plain", pow2), pow2, tuple(w2.shape))
    return (w3, c3, ("grouped_128x128", pow2)), (w2, c2, ("plain", pow2))


@pytest.mark.parametrize("pow2", [False, True])
def test_step_makes_fp8_weight_copies(device, pow2):
    """A weight bound to an FP8 WeightCache: AdamW's step writes its 128x128 FP8 copies
    in the same pass, bit for bit what quantize_128x128 makes of the updated weight; the
    update itself is bit-identical to the unbound step (parameters, moments, step count,
    clipping included); the next forward's lookup hits."""
    from linghe.fwd.grouped_mm import quantize_grouped_weight

    bound = _bound_weights(device, pow2=pow2)
    ps = [b[0] for b in bound] + _params([33], torch.bfloat16, device)
    ps_t = _clone(ps)
    opt = optim.AdamW(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    opt_t = optim.AdamW(ps_t, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    for step in range(2):
        _set_grads([ps, ps_t], seed=10 + step)
        opt.step()
        opt_t.step()
        for p, q in zip(ps, ps_t):
            assert torch.equal(p, q)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][k], opt_t.state[q][k]), k
        for w, c, fmt in bound:
            assert c.from_optimizer and c.value is not None
            want = (quantize_grouped_weight(w.detach(), pow2_scale=pow2) if w.dim() == 3
                    else linghe.quantize_128x128(w.detach(), columnwise=True,
                                                 pow2_scale=pow2))
            got = c.value
            assert got.shape == w.shape and got.dtype == w.dtype
            for name in ("rowwise_data", "rowwise_scale", "columnwise_data",
                         "columnwise_scale"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.shape == b.shape, name
                assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                   b.view(torch.uint8) if b.dtype != torch.float32 else b), name
            hits = c.hits
            assert c.get(w, lambda _: pytest.fail("must hit"), fmt) is got
            assert c.hits == hits + 1


def test_fp8_copies_only_where_the_step_can_make_them(device):
    """Not fused (the separate quantization stays): float32 weights, a weight bound to
    two caches, and prepare_step's plans (a captured step never fuses), which clear a
    copy an earlier step made; invalidate_weight_caches() makes such a copy miss."""
    from linghe.fp8 import WeightCache

    (w3, c3, _fmt), _ = _bound_weights(device)
    w32 = torch.nn.Parameter(torch.randn(128, 128, device=device))
    c32 = WeightCache()
    c32.bind_128x128(w32, ("plain", False), False, (128, 128))
    (wb, cb, fmtb), _ = _bound_weights(device)
    cb2 = WeightCache()
    cb2.bind_128x128(wb, ("other", False), False, tuple((wb.shape[0] * wb.shape[1],
                                                         wb.shape[2])))
    opt = optim.AdamW([w3, w32, wb])
    _set_grads([[w3, w32, wb]], seed=4)
    opt.prepare_step()
    assert not any(c.from_optimizer for c in (c3, c32, cb, cb2))
    opt.step()
    assert c3.from_optimizer
    assert not c32.from_optimizer and not cb.from_optimizer and not cb2.from_optimizer
    # a step that does not make the copy (prepare_step plans a captured step's) clears it
    opt.prepare_step()
    assert not c3.from_optimizer and c3.value is None
    opt.step()
    assert c3.from_optimizer
    # invalidate_weight_caches() reaches copies the optimizer made
    linghe.fp8.invalidate_weight_caches()
    misses = c3.misses
    c3.get(w3, lambda w: linghe.functional.grouped_mm.quantize_grouped_weight(
        w, pow2_scale=True), _fmt)
    assert c3.misses == misses + 1 and not c3.from_optimizer


def test_step_rewrites_its_fp8_copy_in_place(device):
    """Every step writes a weight's FP8 copy into the buffers of the copy it made the step
    before (the same Fp8Tensor: a forward captured in a CUDA graph reads those); a copy of
    another shape or format is replaced. Inside linghe.whole_step_capture, prepare_step
    plans the fused update the captured step will run and keeps the copy; outside, it
    plans a step without copies and clears it."""
    (w3, c3, _fmt), _ = _bound_weights(device)
    opt = optim.AdamW([w3])
    _set_grads([[w3]], seed=6)
    opt.step()
    first = c3.value
    ptrs = [t.data_ptr() for t in (first.rowwise_data, first.rowwise_scale,
                                   first.columnwise_data, first.columnwise_scale)]
    _set_grads([[w3]], seed=7)
    parts = (first.rowwise_data, first.rowwise_scale, first.columnwise_data,
             first.columnwise_scale)
    versions = [t._version for t in parts]
    opt.step()
    assert c3.value is first and c3.from_optimizer
    assert ptrs == [t.data_ptr() for t in parts]
    # the rewrite bumps the version counters (what is derived from the copy is redone)
    assert all(t._version > v for t, v in zip(parts, versions))
    with linghe.whole_step_capture():
        opt.prepare_step()
    assert c3.value is first and c3.from_optimizer
    opt.prepare_step()
    assert c3.value is None and not c3.from_optimizer
    # a copy that does not fit (another scaling) is replaced, not written into
    opt.step()
    c3.value.scaling = "1x128"
    stale = c3.value
    opt.step()
    assert c3.value is not stale and c3.value.scaling == "128x128"


def test_whole_step_capture_refuses_what_would_break_the_graphs(device):
    """Inside linghe.whole_step_capture, AdamW refuses to drop an FP8 copy it made (the
    captured forwards may read it): here a gradient whose layout keeps the step from
    rewriting it; and prepare_step refuses while deferred micro-batches are pending (the
    captured backward must hold every micro-batch)."""
    from linghe.bwd import deferred

    (w3, c3, _fmt), _ = _bound_weights(device)
    opt = optim.AdamW([w3])
    _set_grads([[w3]], seed=9)
    opt.step()
    assert c3.from_optimizer
    w3.grad = w3.grad.transpose(1, 2).contiguous().transpose(1, 2)  # not contiguous
    with linghe.whole_step_capture(), pytest.raises(RuntimeError, match="in place"):
        opt.prepare_step()
    assert c3.from_optimizer
    _set_grads([[w3]], seed=10)
    deferred._STASHES[w3] = stash = deferred.Stash(w3)
    stash.parts.append(None)
    try:
        with linghe.whole_step_capture(), pytest.raises(RuntimeError, match="pending"):
            opt.prepare_step()
    finally:
        deferred.discard_deferred_wgrad()
    assert deferred.pending_micro_batches(w3) == 0


@pytest.mark.gpu
def test_fp8_copy_from_the_step_hits_under_whole_step_capture(device):
    """Inside linghe.whole_step_capture a captured forward reads the FP8 copy the eager
    step made (no quantization in the graph) and a captured step rewrites it in place:
    after a replay it is quantize_128x128 of the updated weight."""
    from linghe.fwd.grouped_mm import quantize_grouped_weight

    (w3, c3, fmt), _ = _bound_weights(device)
    opt = optim.AdamW([w3])
    _set_grads([[w3]], seed=8)
    opt.step()
    made = c3.value
    calls = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g_fwd, g_step = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with linghe.whole_step_capture():
        with torch.cuda.stream(side), torch.cuda.graph(g_fwd):
            got = c3.get(w3, lambda w: calls.append(1), fmt)
            summed = got.rowwise_data.view(torch.uint8).sum()
        opt.prepare_step()
        with torch.cuda.stream(side), torch.cuda.graph(g_step):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    assert not calls and got is made
    g_step.replay()
    g_fwd.replay()
    torch.cuda.synchronize()
    want = quantize_grouped_weight(w3.detach(), pow2_scale=True)
    assert c3.value is made
    assert torch.equal(made.rowwise_data.view(torch.uint8), want.rowwise_data.view(torch.uint8))
    assert torch.equal(made.columnwise_scale, want.columnwise_scale)
    assert int(summed) == int(want.rowwise_data.view(torch.uint8).sum())


@pytest.mark.gpu
def test_fp8_copy_from_the_step_misses_under_capture(device):
    """A CUDA graph captured after an eager step that made an FP8 copy must contain its
    own quantization: the cache misses while the capture runs."""
    from linghe.fwd.grouped_mm import quantize_grouped_weight

    (w3, c3, fmt), _ = _bound_weights(device)
    opt = optim.AdamW([w3])
    _set_grads([[w3]], seed=5)
    opt.step()
    assert c3.from_optimizer
    calls = []

    def quantize(w):
        calls.append(1)
        return quantize_grouped_weight(w, pow2_scale=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        c3.get(w3, quantize, fmt)
    torch.cuda.current_stream().wait_stream(side)
    assert calls and not c3.from_optimizer
