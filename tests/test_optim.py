"""linghe.optim: grad norm, clip_grad_norm_, count_zeros, AmaxHistory."""

import math

import pytest
import torch

import linghe
from linghe import optim
from linghe import reference as ref
from linghe.testing import assert_close

INF = float("inf")
ON_GPU = torch.cuda.is_available()


def _params(sizes, dtype, device, scale=1.0):
    ps = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, device=device, dtype=dtype))
        p.grad = (torch.randn(n, device=device) * scale).to(dtype)
        ps.append(p)
    return ps


def _clone_params(ps):
    out = []
    for p in ps:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


SIZE_LISTS = {
    "0": [],
    "1": [1000],
    "3": [0, 70_001, 3],
    "big": [100_000, 4096, 1],
}


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, INF])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", list(SIZE_LISTS), ids=list(SIZE_LISTS))
def test_clip_grad_norm_matches_torch(device, p, dtype, sizes):
    ps = _params(SIZE_LISTS[sizes], dtype, device)
    ps_t = _clone_params(ps)
    max_norm = 0.5  # below the norm: the gradients are scaled
    norm = optim.clip_grad_norm_(ps, max_norm, norm_type=p)
    # (PyTorch refuses the inf norm of an empty tensor; empty tensors do not change the norm)
    norm_t = torch.nn.utils.clip_grad_norm_([q for q in ps_t if q.numel()], max_norm,
                                            norm_type=p)
    assert norm.dim() == 0
    if not ps:
        assert norm.item() == 0.0 and norm_t.item() == 0.0
        return
    assert norm.dtype == torch.float32 and norm.device.type == torch.device(device).type
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(norm, norm_t.float(), tol=tol)
    for a, b in zip(ps, ps_t):
        assert_close(a.grad, b.grad, tol=tol, name="clipped grad")


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 0.5, INF, -INF])
def test_grad_norm_exact_fp32(device, p):
    # 65_537 elements (4 chunks and one element) for the sums' accuracy; max/min are exact
    # in any order, so the +-inf norms take 2 chunks and a tail (the interpreter runs their
    # NaN-propagating reduction slowly)
    n = 16_387 if math.isinf(p) else 65_537
    ts = [torch.randn(k, device=device) for k in (5, n, 0, 300)]
    out = optim.grad_norm(ts, p)
    exp = ref.total_norm(ts, p)
    assert_close(out, exp, tol=1e-5)
    out64 = optim.grad_norm(ts, p, dtype=torch.float64)
    assert out64.dtype == torch.float64
    assert_close(out64, exp, tol=1e-9 if p in (1.0, 2.0, INF, -INF) else 1e-6)


def test_grad_norm_mixed_dtypes(device):
    ts = [torch.randn(1000, device=device), torch.randn(3000, device=device).bfloat16(),
          torch.randn(17, device=device).half(), torch.randn(70_000, device=device).bfloat16(),
          torch.randn(5, device=device, dtype=torch.float64)]
    for p in (2.0, INF):
        assert_close(optim.grad_norm(ts, p), ref.total_norm(ts, p), tol=1e-5)


def test_clip_mixed_dtypes_scales_each_in_its_dtype(device):
    ps = _params([100, 200], torch.float32, device) + _params([300], torch.bfloat16, device) \
        + _params([50], torch.float16, device) + _params([40], torch.float64, device)
    ps_t = _clone_params(ps)
    norm = optim.clip_grad_norm_(ps, 1.0)
    norm_r = ref.clip_grad_norm_(ps_t, 1.0)
    assert_close(norm, norm_r, tol=1e-5)
    for a, b in zip(ps, ps_t):
        assert a.grad.dtype == b.grad.dtype
        assert_close(a.grad, b.grad, tol=1e-2 if b.grad.element_size() == 2 else 1e-6)


def test_thousand_tensors(device):
    sizes = [(i * 37) % 50 for i in range(1000)]
    ps = _params(sizes, torch.float32, device)
    ps_t = _clone_params(ps)
    norm = optim.clip_grad_norm_(ps, 1.0)
    norm_t = torch.nn.utils.clip_grad_norm_(ps_t, 1.0)
    assert_close(norm, norm_t, tol=1e-5)
    g = torch.cat([p.grad for p in ps])
    gt = torch.cat([p.grad for p in ps_t])
    assert_close(g, gt, tol=1e-6)


def test_no_clip_when_below_max_norm(device):
    ps = _params([10, 20], torch.float32, device, scale=1e-3)
    before = [p.grad.clone() for p in ps]
    norm = optim.clip_grad_norm_(ps, 100.0)
    assert norm.item() < 100
    for p, b in zip(ps, before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0)


def test_none_grads_skipped_and_single_tensor(device):
    ps = _params([10, 20, 30], torch.float32, device)
    ps[1].grad = None
    ps_t = _clone_params(ps)
    norm = optim.clip_grad_norm_(iter(ps), 0.1)
    norm_t = torch.nn.utils.clip_grad_norm_(ps_t, 0.1)
    assert_close(norm, norm_t, tol=1e-5)
    assert ps[1].grad is None
    # a single tensor
    p = _params([33], torch.float32, device)[0]
    pt = _clone_params([p])[0]
    assert_close(optim.clip_grad_norm_(p, 0.1), torch.nn.utils.clip_grad_norm_(pt, 0.1), 1e-5)
    assert_close(p.grad, pt.grad, tol=1e-6)


def test_split_api_matches_torch(device):
    ps = _params([100, 5000], torch.float32, device)
    ps_t = _clone_params(ps)
    grads = [p.grad for p in ps]
    total = optim.get_total_norm(grads, 3.0)
    total_t = torch.nn.utils.get_total_norm([p.grad for p in ps_t], 3.0)
    assert_close(total, total_t, tol=1e-5)
    optim.clip_grads_with_norm_(ps, 2.0, total)
    torch.nn.utils.clip_grads_with_norm_(ps_t, 2.0, total_t)
    for a, b in zip(ps, ps_t):
        assert_close(a.grad, b.grad, tol=1e-6)


def test_nan_inf_propagate(device):
    for bad in (float("nan"), INF):
        ts = [torch.randn(100, device=device), torch.randn(70_000, device=device)]
        ts[1][12345] = bad
        for p in (1.0, 2.0, 3.0, INF):
            out = optim.grad_norm(ts, p).item()
            exp = ref.total_norm(ts, p).item()
            assert (math.isnan(out) and math.isnan(exp)) or out == exp, (bad, p, out, exp)
        ps = _params([10], torch.float32, device)
        ps[0].grad[3] = bad
        with pytest.raises(RuntimeError, match="non-finite"):
            optim.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
        # not scaled before raising
        assert (ps[0].grad[3] != ps[0].grad[3]) or ps[0].grad[3] == bad
        norm = optim.clip_grad_norm_(ps, 1.0)
        assert not math.isfinite(norm.item())


def test_norm_segments_table():
    """The norm's segment table covers every element once, in order; each program's share
    is contiguous and within 16 elements of the others; segments start 16-element aligned
    inside their tensor (or at its start) and are at most _MAX_SEGMENT long."""
    import numpy as np

    from linghe.optim import multi_tensor as K

    rng = np.random.default_rng(0)
    cases = [(np.array([5, 65_537, 300, 1, 70_001, 4096]), 7),
             (rng.integers(1, 5000, size=300), 64), (np.array([3]), 1),
             (np.array([10, 20]), 16), (np.array([3 * K._MAX_SEGMENT + 5, 7]), 5)]
    for sizes, G in cases:
        slots = np.arange(len(sizes)) * 3 + 1  # slots need not be 0..n-1
        t = K._segments(slots, sizes, G)
        ptr, rows = t[:G + 1], t[G + 1:].reshape(-1, 3)
        assert ptr[0] == 0 and ptr[-1] == len(rows) and np.all(np.diff(ptr) >= 0)
        cum = np.concatenate([[0], np.cumsum(sizes)])
        tid = (rows[:, 0] - 1) // 3
        glob = cum[tid] + rows[:, 1]
        assert np.all(rows[:, 2] > 0) and np.all(rows[:, 2] <= K._MAX_SEGMENT)
        assert glob[0] == 0 and np.all(glob[1:] == glob[:-1] + rows[:-1, 2])  # in order
        assert glob[-1] + rows[-1, 2] == cum[-1]
        assert np.all(rows[:, 1] + rows[:, 2] <= sizes[tid])
        assert np.all(rows[:, 1] % 16 == 0)
        share = np.array([rows[ptr[p]:ptr[p + 1], 2].sum() for p in range(G)])
        assert share.sum() == cum[-1] and share.max() < -(-cum[-1] // G) + 16


@pytest.mark.parametrize("knobs", [dict(segments=False), dict(stages=1),
                                   dict(warps=4, elems=8), dict(elems=32, stages=2)])
def test_grad_norm_kernel_knobs(device, knobs):
    """Every knob of the norm kernel (linghe.optim.multi_tensor.NORM_CONFIG, the plan's
    PROGRAMS_PER_SM) gives the reference norm: every mode, four dtypes, many tensors whose
    sizes end mid-vector, shares that split tensors, NaN propagation, unaligned views."""
    from linghe.optim import multi_tensor as K

    saved, pps = dict(K.NORM_CONFIG), K.PROGRAMS_PER_SM
    K.NORM_CONFIG.update(knobs)
    K.PROGRAMS_PER_SM = 1 if knobs.get("stages") == 1 else pps
    optim.clear_plan_cache()
    try:
        # (16_411: a chunk of 16_384 and a tail; the interpreter's +-inf norms are slow)
        sizes = [16_411, 3, 2_000, 1, 17, 5_003, 4_096, 6]
        modes = {torch.float32: (1.0, 2.0, 3.0, INF, -INF), torch.bfloat16: (2.0, -INF),
                 torch.float16: (INF,), torch.float64: (2.0,)}
        for dtype, ps in modes.items():
            ts = [(torch.randn(n, device=device) * 3).to(dtype) for n in sizes]
            for p in ps:
                assert_close(optim.grad_norm(ts, p), ref.total_norm(ts, p),
                             tol=1e-5 if p != 3.0 else 1e-4)
        ts = [torch.randn(n, device=device) for n in sizes]
        ts[1][2] = float("nan")  # in a tensor's last partial vector
        ts[0][16_400] = float("inf")
        for p in (2.0, -INF):
            assert math.isnan(optim.grad_norm(ts, p).item())
        buf = torch.randn(20_003, device=device)
        views = [buf[1:16_501], buf[16_501:20_003]]  # not 16-byte aligned
        assert_close(optim.grad_norm(views), ref.total_norm(views), tol=1e-5)
    finally:
        K.NORM_CONFIG.clear()
        K.NORM_CONFIG.update(saved)
        K.PROGRAMS_PER_SM = pps
        optim.clear_plan_cache()


def test_zero_grads_and_empty_tensors(device):
    ps = _params([0, 0, 10], torch.float32, device)
    ps[2].grad.zero_()
    norm = optim.clip_grad_norm_(ps, 1.0)
    assert norm.item() == 0.0
    assert torch.all(ps[2].grad == 0)
    assert optim.grad_norm([torch.empty(0, device=device)]).item() == 0.0
    assert optim.grad_norm([]).item() == 0.0


def test_plan_cache_reused_and_correct_after_change(device):
    optim.clear_plan_cache()
    ts = [torch.randn(50, device=device), torch.randn(70, device=device)]
    a = optim.grad_norm(ts)
    ts[0].mul_(2)  # same pointers, new values: the cached table still reads them
    b = optim.grad_norm(ts)
    assert_close(b, ref.total_norm(ts), tol=1e-5)
    assert not torch.equal(a, b)
    ts2 = [torch.randn(51, device=device)]
    assert_close(optim.grad_norm(ts2), ref.total_norm(ts2), tol=1e-5)


def test_fast_path_cache_identity(device):
    """The fast path keys on tensor identities + data_ptrs: new objects at the same address
    (views of another size, a freed list's reused memory), set_, and None grads are
    recomputed, not served from a stale entry."""
    optim.clear_plan_cache()
    buf = torch.randn(1000, device=device)
    a = [buf[:600]]
    assert_close(optim.grad_norm(a), ref.total_norm(a), tol=1e-5)
    b = [buf[:300]]  # same data_ptr, other numel
    assert_close(optim.grad_norm(b), ref.total_norm(b), tol=1e-5)
    assert optim.count_zeros(a).item() == 0
    a[0].zero_()
    assert optim.count_zeros(a).item() == 600
    assert optim.count_zeros(b).item() == 300
    del a, b
    c = [torch.randn(37, 3, device=device).t()]  # non-contiguous: copied, not cached
    assert_close(optim.grad_norm(c), ref.total_norm(c), tol=1e-5)
    t = torch.randn(64, device=device)
    d = [t]
    assert_close(optim.grad_norm(d), ref.total_norm(d), tol=1e-5)
    t.set_(torch.randn(200, device=device))  # same object, new storage and size
    assert_close(optim.grad_norm(d), ref.total_norm(d), tol=1e-5)
    for _ in range(3):  # freed and re-created lists (ids/addresses may be reused)
        e = [torch.randn(n, device=device) for n in (5, 17, 9)]
        assert_close(optim.grad_norm(e), ref.total_norm(e), tol=1e-5)
    ps = _params([10, 20], torch.float32, device)
    g0 = ps[0].grad.clone()
    ps[1].grad = None
    optim.clip_grad_norm_(ps, 1e-3)
    assert_close(ps[0].grad, g0 * min(1.0, 1e-3 / (g0.norm().item() + 1e-6)), tol=1e-5)
    ps[1].grad = torch.randn(20, device=device)  # the None becomes a gradient
    exp = ref.total_norm([ps[0].grad, ps[1].grad])
    assert_close(optim.clip_grad_norm_(ps, 1e9), exp, tol=1e-5)


def test_unaligned_views(device):
    buf = torch.randn(70_000 + 3, device=device)
    ts = [buf[1:40_001], buf[40_001:70_003]]  # storage offsets: not 16-byte aligned
    ps = []
    for t in ts:
        p = torch.nn.Parameter(torch.empty_like(t))
        p.grad = t
        ps.append(p)
    exp = ref.total_norm(ts)
    norm = optim.clip_grad_norm_(ps, 1.0)
    assert_close(norm, exp, tol=1e-5)
    assert_close(torch.cat([p.grad for p in ps]), torch.cat(ts), tol=1e-6)


def test_bad_inputs(device):
    ps = _params([10], torch.float32, device)
    with pytest.raises(TypeError, match=r"parameters\[1\]"):
        optim.clip_grad_norm_([ps[0], 3.0], 1.0)
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        optim.grad_norm(["x"])
    for bad in (-1.0, float("nan"), INF):
        with pytest.raises(ValueError, match="max_norm"):
            optim.clip_grad_norm_(ps, bad)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="norm_type"):
            optim.clip_grad_norm_(ps, 1.0, norm_type=bad)
    with pytest.raises(TypeError, match="norm_type"):
        optim.grad_norm([ps[0].grad], norm_type="fro")
    with pytest.raises(TypeError, match="dtype"):
        optim.grad_norm([torch.ones(3, dtype=torch.int32, device=device)])
    with pytest.raises(TypeError, match="dtype"):
        optim.grad_norm([torch.ones(3, device=device)], dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        p = torch.nn.Parameter(torch.randn(4, 4, device=device))
        p.grad = torch.randn(4, 4, device=device).t()
        optim.clip_grad_norm_([p], 1.0)
    with pytest.raises(ValueError, match="group"):
        optim.clip_grad_norm_([ps], 1.0, group=[None, None])
    if ON_GPU:
        with pytest.raises(ValueError, match=r"tensors\[1\] is on cpu"):
            optim.grad_norm([torch.ones(3, device=device), torch.ones(3)])
    # non-contiguous read-only inputs are fine for the norm
    t = torch.randn(6, 5, device=device).t()
    assert_close(optim.grad_norm([t]), ref.total_norm([t]), tol=1e-5)


def test_list_of_groups_without_collectives(device):
    # group entries None: buckets but no collectives; equals the norm of everything
    a = _params([10, 20], torch.float32, device)
    b = _params([30], torch.bfloat16, device)
    ps_t = _clone_params(a + b)
    norm = optim.clip_grad_norm_([a, b], 0.1, group=[None, None])
    exp = ref.clip_grad_norm_(ps_t, 0.1)
    assert_close(norm, exp, tol=1e-5)
    for x, y in zip(a + b, ps_t):
        assert_close(x.grad, y.grad, tol=1e-2)


# ------------------------------------------------------------------------- count_zeros

ZERO_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64,
               torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int16,
               torch.int32, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", ZERO_DTYPES)
def test_count_zeros_every_dtype(device, dtype):
    n = 70_003
    x = torch.randn(n, device=device)
    x[torch.rand(n, device=device) < 0.3] = 0.0
    if dtype.is_floating_point:
        x[::7] = -0.0
        t = x.to(dtype)
        if t.element_size() == 1:
            t[5] = float("nan")  # NaN is not zero
    elif dtype == torch.bool:
        t = x != 0
    else:
        t = (x * 3).round().clamp(-100, 100).to(dtype)
    exp = ref.count_zeros([t])
    out = optim.count_zeros([t, t[:0]])
    assert out.dtype == torch.int64 and out.dim() == 0
    assert out.item() == exp.item()


def test_count_zeros_mixed_list(device):
    ts = [torch.zeros(10, device=device), torch.tensor([0.0, -0.0, 1.0], device=device).half(),
          torch.tensor([0, 1, 0], device=device, dtype=torch.int8),
          torch.tensor([-0.0, 2.0], device=device).to(torch.float8_e4m3fn),
          torch.randn(100, 3, device=device).t()]
    assert optim.count_zeros(ts).item() == 10 + 2 + 2 + 1
    assert optim.count_zeros([]).item() == 0
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        optim.count_zeros([torch.zeros(2, dtype=torch.complex64, device=device)])
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        optim.count_zeros([ts[0], None])


# ------------------------------------------------------------------------- AmaxHistory


def _check_amax_step(h: optim.AmaxHistory, margin, compute):
    hist0, scale0 = h.amax_history.clone(), h.scale.clone()
    h.update()
    eh, es = ref.amax_history_update(hist0, scale0, h.fp8_max, margin, compute)
    torch.testing.assert_close(h.amax_history, eh, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(h.scale, es, rtol=0, atol=0)


@pytest.mark.parametrize("compute", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_amax_history_formula_and_roll(device, compute, margin):
    n, L = 37, 5
    h = optim.AmaxHistory(n, L, amax_compute=compute, margin=margin, device=device)
    assert torch.all(h.scale == 1) and h.amax_history.shape == (L, n)
    for step in range(7):
        for i in range(n):
            if (i + step) % 5 == 0:
                continue  # not recorded this step: amax stays 0
            h.record(i, torch.rand((), device=device) * 10 + 0.1)
            h.record(i, torch.rand(1, device=device).bfloat16())  # max with existing
        _check_amax_step(h, margin, compute)
    assert torch.all(h.amax_history[0] == 0)
    # explicit formula on one column
    h2 = optim.AmaxHistory(3, 2, margin=margin, device=device)
    h2.record(0, torch.tensor(2.0, device=device))
    h2.update()
    assert h2.scale[0].item() == pytest.approx(448.0 / 2.0 / 2**margin, rel=1e-7)
    assert h2.scale[1].item() == 1.0 and h2.amax_history[1, 0].item() == 2.0


def test_amax_history_nonfinite_keeps_scale(device):
    h = optim.AmaxHistory(4, 3, device=device)
    for i, v in enumerate([1.0, 2.0, 4.0, 8.0]):
        h.record(i, torch.tensor(v, device=device))
    h.update()
    s1 = h.scale.clone()
    h.record(0, torch.tensor(float("nan"), device=device))
    h.record(1, torch.tensor(INF, device=device))
    h.record(2, torch.tensor(1e-45, device=device))  # scale would overflow
    _check_amax_step(h, 0, "max")
    assert h.scale[0] == s1[0] and h.scale[1] == s1[1] and h.scale[2] == s1[2]
    assert h.scale[3] == s1[3]  # amax from the history (8) still
    h3 = optim.AmaxHistory(2, 1, device=device)
    h3.record(0, torch.tensor(1e-45, device=device))  # 448 / 1e-45 overflows: keep 1
    h3.record(1, torch.tensor(0.5, device=device))
    h3.update()
    assert h3.scale.tolist() == [1.0, 896.0] and h3.amax_history.tolist() == [[0.0, 0.0]]


def test_amax_history_state_dict_and_errors(device):
    h = optim.AmaxHistory(5, 4, margin=1, device=device)
    for i in range(5):
        h.record(i, torch.rand((), device=device) + 0.5)
    h.update()
    h.record(2, torch.tensor(3.0, device=device))
    sd = h.state_dict()
    h2 = optim.AmaxHistory(5, 4, device=device)
    buf = h2.scale
    h2.load_state_dict(sd)
    assert h2.scale is buf and h2.margin == 1
    torch.testing.assert_close(h2.amax_history, h.amax_history, rtol=0, atol=0)
    torch.testing.assert_close(h2.scale, h.scale, rtol=0, atol=0)
    h.update()
    h2.update()
    torch.testing.assert_close(h2.scale, h.scale, rtol=0, atol=0)
    with pytest.raises(ValueError, match="index"):
        h.record(5, torch.tensor(1.0, device=device))
    with pytest.raises(TypeError, match="amax"):
        h.record(0, torch.ones(2, device=device))
    with pytest.raises(ValueError, match="amax_compute"):
        optim.AmaxHistory(2, amax_compute="mean", device=device)
    with pytest.raises(ValueError, match="history_len"):
        optim.AmaxHistory(2, 0, device=device)
    with pytest.raises(ValueError, match="shape"):
        optim.AmaxHistory(3, device=device).load_state_dict(sd)


def test_exported():
    assert linghe.optim.clip_grad_norm_ is optim.clip_grad_norm_


# ------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_clip_grad_norm_no_host_sync(device):
    ps = _params([1000, 70_000, 3], torch.float32, device) + _params([500], torch.bfloat16,
                                                                     device)
    grads = [p.grad for p in ps]
    h = optim.AmaxHistory(4, device=device)

    def step():
        optim.clip_grad_norm_(ps, 1.0)
        optim.grad_norm(grads, 3.0)
        optim.count_zeros(grads)
        h.record(1, grads[0].abs().max())
        h.update()

    step()  # warm: compile the kernels, build the plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_large_grad_norm_gpu(device):
    ts = [torch.randn(n, device=device) for n in (3_000_001, 12_345_678, 1, 0, 65_536 * 7)]
    for p in (1.0, 2.0, INF):
        assert_close(optim.grad_norm(ts, p), ref.total_norm(ts, p), tol=1e-5)
    z = [t.clone() for t in ts]
    z[1][::3] = 0
    assert optim.count_zeros(z).item() == ref.count_zeros(z).item()


_COMPILE_SCRIPT = r'''
import re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from linghe.optim import multi_tensor as K


def comp(fn, sig, consts, vec=r"ld\.global\.[\w:.]*v4"):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": K.NUM_WARPS})
    assert re.search(vec, k.asm["ptx"]), fn.__name__
    return k


B = K._block(4, "float")
nsig = dict(table_ptr="*i64", addrs_ptr="*i64", n_chunks="i32", partial_ptr="*fp32",
            p="fp32", counter_ptr="*i32", norm_out_ptr="*fp32", coef_out_ptr="*fp32",
            max_norm="fp32", DTYPE="constexpr", ES="constexpr", ACC="constexpr",
            MODE="constexpr", IDENT="constexpr", BLOCK="constexpr", ALIGNED="constexpr",
            LAST="constexpr", COEF="constexpr", RBLOCK="constexpr", SEGMENTS="constexpr",
            SPAN="constexpr", STAGES="constexpr")
for last, seg, mode in ((False, False, 2), (True, False, 2), (True, True, 2), (False, True, 5)):
    opts = {**K._norm_launch_opts(4, True), "SEGMENTS": seg}
    del opts["num_warps"]
    k = comp(K._norm_partials_kernel, nsig,
             dict(DTYPE=tl.float32, ES=4, ACC=tl.float32, MODE=mode, IDENT=0.0, ALIGNED=True,
                  LAST=last, COEF=last, RBLOCK=K.REDUCE_BLOCK, **opts), "ld.global|cp.async")
    ptx = k.asm["ptx"]
    if last:
        assert "atom" in ptx and "acq_rel" in ptx and "ld.global.cg" in ptx, "LAST"
    if seg:  # the segment loop is pipelined: 16-byte asynchronous copies
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx), "seg"
comp(K._scale_kernel,
     dict(table_ptr="*i64", addrs_ptr="*i64", n_chunks="i32", coef_ptr="*fp32",
          DTYPE="constexpr", ES="constexpr", CT="constexpr", BLOCK="constexpr",
          ALIGNED="constexpr"),
     dict(DTYPE=tl.bfloat16, ES=2, CT=tl.float32, BLOCK=B, ALIGNED=True))
comp(K._count_zeros_kernel,
     dict(table_ptr="*i64", addrs_ptr="*i64", n_chunks="i32", partial_ptr="*i64",
          ITYPE="constexpr", ES="constexpr", BLOCK="constexpr", ALIGNED="constexpr"),
     dict(ITYPE=tl.int32, ES=4, BLOCK=B, ALIGNED=True))
for dt in (tl.bfloat16, tl.float32):
    es = dt.primitive_bitwidth // 8
    k = comp(K._adamw_kernel,
             dict(seg_ptr="*i64", addrs_ptr="*i64", nt="i32", bias_ptr="*fp32",
                  coef_ptr="*fp32", lr_ptr="*fp32", lr="fp32", beta1="fp32", beta2="fp32",
                  eps="fp32", weight_decay="fp32", P="constexpr", G="constexpr",
                  M="constexpr", ESP="constexpr", ESG="constexpr", ESM="constexpr",
                  BLOCK="constexpr", STAGES="constexpr", ALIGNED="constexpr",
                  CLIP="constexpr", LR_TENSOR="constexpr", MAXIMIZE="constexpr"),
             dict(P=dt, G=dt, M=dt, ESP=es, ESG=es, ESM=es,
                  BLOCK=K.adamw_block((es,) * 3), STAGES=K.ADAMW_CONFIG["stages"],
                  ALIGNED=True, CLIP=True, LR_TENSOR=True, MAXIMIZE=False),
             vec="cp.async")
    # the segment loop is pipelined (16-byte asynchronous copies)
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10",
                     k.asm["ptx"]), "adamw pipelined loads"
    assert re.search(r"st\.global\.[\w:.]*v4", k.asm["ptx"]), "adamw stores"
from linghe.optim import fp8_weights as W  # noqa: E402
sig = {p.name: "constexpr" if p.is_constexpr else "i32" for p in W._adamw_quant_128_kernel.params}
sig.update({n: "*bf16" for n in ("p_ptr", "g_ptr", "m_ptr", "v_ptr")},
           q_ptr="*fp8e4nv", qt_ptr="*fp8e4nv",
           **{n: "*fp32" for n in ("s_ptr", "st_ptr", "bias_ptr", "coef_ptr", "lr_ptr")},
           **{n: "fp32" for n in ("lr", "beta1", "beta2", "eps", "weight_decay")})
k = triton.compile(ASTSource(fn=W._adamw_quant_128_kernel, signature=sig, constexprs=dict(
    CLIP=True, LR_TENSOR=False, MAXIMIZE=False, POW2=True, ROWS=W.ROWS, STAGES=W.STAGES),
    attrs={
    (i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
    if sig[n].startswith("*") or n in ("N", "K")}),  # (the MoE shapes: multiples of 16)
    target=GPUTarget("cuda", 90, 32), options={"num_warps": W.NUM_WARPS})
ptx = k.asm["ptx"]  # the moments and both FP8 copies in 16-byte stores, no byte stores
assert re.search(r"st\.global\.[\w:.]*v4", ptx) and "st.global.b8" not in ptx, "fp8_weights"
print("COMPILED")
'''


def test_kernels_compile_for_sm90(compile_sm90):
    """Compile the multi-tensor kernels and the FP8-copy AdamW kernel for an H100/H200
    (sm_90) without a GPU (subprocess without TRITON_INTERPRET): catches GPU-only compile
    errors the interpreter accepts, and checks the accesses vectorize to 16 bytes."""
    compile_sm90(_COMPILE_SCRIPT)
