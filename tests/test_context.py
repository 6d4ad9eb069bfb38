"""TrainingContext / current_recipe state, recipe validation, delayed-scaling bookkeeping."""

import dataclasses
import threading

import pytest
import torch

import linghe
from linghe import context as context_mod
from linghe.fp8.delayed import DelayedScalingState


def test_default_is_none():
    assert linghe.current_recipe() is None


def test_nesting_and_restore():
    outer = linghe.TrainingContext(fp8="blockwise")
    with outer as c:
        assert c is outer and outer.active
        r = linghe.current_recipe()
        assert isinstance(r, linghe.Fp8Recipe) and r.name == "blockwise"
        with linghe.TrainingContext(fp8=None):
            assert linghe.current_recipe() is None
            with linghe.TrainingContext(fp8="tensorwise"):
                assert linghe.current_recipe().name == "tensorwise"
            assert linghe.current_recipe() is None
        assert linghe.current_recipe() is r
    assert linghe.current_recipe() is None and not outer.active


def test_restored_on_exception():
    ctx = linghe.TrainingContext(fp8="blockwise")
    with pytest.raises(KeyError):
        with ctx:
            with linghe.TrainingContext(fp8=None):
                raise KeyError("boom")
    assert linghe.current_recipe() is None and not ctx.active
    with ctx:  # usable again after an exception
        assert linghe.current_recipe().name == "blockwise"


def test_reentering_active_instance_raises():
    ctx = linghe.TrainingContext(fp8="blockwise")
    with ctx:
        with pytest.raises(RuntimeError, match="already active"):
            with ctx:
                pass
        assert linghe.current_recipe() is ctx.recipe  # the failed entry changed nothing
    with ctx, linghe.TrainingContext(fp8="blockwise"):  # a new instance nests fine
        pass


def test_threads_do_not_share_state():
    seen = {}

    def worker():
        seen["thread"] = linghe.current_recipe()

    with linghe.TrainingContext(fp8="blockwise"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["thread"] is None


def test_backward_runs_on_the_calling_thread_inside(device):
    # Inside a context the backward runs on the thread that calls it (no hand-off to the
    # autograd engine's device thread); the setting is restored on exit, also after an
    # exception and through nesting; caller_thread_backward=False leaves it alone.
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            seen.append(threading.get_ident())
            return g

    x = torch.randn(3, device=device, requires_grad=True)
    enabled = torch._C._is_multithreading_enabled
    assert enabled()
    with linghe.TrainingContext() as ctx:
        assert not enabled() and ctx.caller_thread_backward
        Probe.apply(x).sum().backward()
        with linghe.TrainingContext(fp8=None, caller_thread_backward=False):
            assert not enabled()  # an inner context that does not ask keeps the outer's
        assert not enabled()
    assert enabled() and seen == [threading.get_ident()]
    with pytest.raises(KeyError), linghe.TrainingContext():
        raise KeyError("boom")
    assert enabled()
    with linghe.TrainingContext(caller_thread_backward=False):
        assert enabled()
        Probe.apply(x).sum().backward()
    if device == "cuda":  # CPU backwards always run on the caller; CUDA ones on a worker
        assert seen[-1] != threading.get_ident()
    assert "caller_thread_backward=True" in repr(linghe.TrainingContext())


def test_backward_on_caller_thread(device):
    """linghe.backward_on_caller_thread: a training forward turns autograd's multithreading
    off for the thread (same gradients), a forward without gradients turns it back on,
    and a removed hook does nothing."""
    enabled = torch._C._is_multithreading_enabled
    m = torch.nn.Linear(4, 3).to(device)
    plain = torch.nn.Linear(4, 3).to(device)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 4, device=device)
    handle = linghe.backward_on_caller_thread(m)
    try:
        assert enabled()
        with torch.no_grad():
            m(x)
        assert enabled()
        m(x).square().sum().backward()
        assert not enabled()
        plain(x).square().sum().backward()
        assert torch.equal(m.weight.grad, plain.weight.grad)
        with torch.no_grad():
            m(x)
        assert enabled()
        handle.remove()
        m(x)
        assert enabled()
    finally:
        torch._C._set_multithreading_enabled(True)


def test_no_module_global_state_but_the_compile_mirror():
    # The state is a ContextVar; the one module global that changes on entry is the
    # mirror that code under torch.compile reads, and exit restores it.
    before = dict(vars(context_mod))
    with linghe.TrainingContext(fp8="blockwise") as ctx:
        changed = {k for k, v in vars(context_mod).items() if before.get(k) is not v}
        assert changed == {"_compiled_recipe"} and context_mod._compiled_recipe is ctx.recipe
    assert dict(vars(context_mod)) == before


def test_recipe_formats():
    b = linghe.TrainingContext(fp8="blockwise").recipe
    assert (b.act_scaling, b.weight_scaling, b.pow2_scale) == ("1x128", "128x128", True)
    assert b.fwd_dtype == b.grad_dtype == torch.float8_e4m3fn and b.state is None
    t = linghe.TrainingContext(fp8="tensorwise", pow2_scale=False).recipe
    assert (t.act_scaling, t.weight_scaling, t.pow2_scale) == ("tensor", "tensor", False)
    assert t.fwd_dtype == torch.float8_e4m3fn and t.grad_dtype == torch.float8_e5m2
    d = linghe.TrainingContext(fp8="delayed", history_len=4, amax_compute="most_recent",
                               margin=1).recipe
    assert isinstance(d.state, DelayedScalingState) and d.state.history_len == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.name = "tensorwise"


@pytest.mark.parametrize("kwargs, match", [
    (dict(fp8="fp4"), "fp8 recipe must be None or one of"),
    (dict(fp8="Blockwise"), "fp8 recipe must be None or one of"),
    (dict(fp8=8), "fp8 must be None or one of"),
    (dict(fp8="delayed", history_len=0), "history_len must be an int >= 1"),
    (dict(fp8="delayed", history_len=2.5), "history_len must be an int >= 1"),
    (dict(fp8="delayed", amax_compute="mean"), "amax_compute must be one of"),
    (dict(fp8="delayed", margin=-1), "margin must be a number >= 0"),
    (dict(fp8="blockwise", pow2_scale="yes"), "pow2_scale must be a bool"),
    (dict(fp8="blockwise", fp8_wgrad=1), "fp8_wgrad must be a bool"),
    (dict(fp8="blockwise", expert_fp8_wgrad=None), "expert_fp8_wgrad must be a bool"),
    (dict(fp8="blockwise", amax_group=object()), "amax_group is used only by"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linghe.TrainingContext(**kwargs)


def test_fp8_on_old_gpu_raises_at_entry(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # (the capability is read once per device and cached: cuda_capability)
    monkeypatch.setattr(context_mod, "cuda_capability", lambda dev: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    ctx = linghe.TrainingContext(fp8="blockwise")  # construction is fine
    with pytest.raises(RuntimeError, match="compute capability >= 8.9.*A100 has 8.0"):
        with ctx:
            pass
    assert linghe.current_recipe() is None and not ctx.active
    with linghe.TrainingContext(fp8=None):  # high precision is always allowed
        pass
    monkeypatch.setattr(context_mod, "cuda_capability", lambda dev: (9, 0))
    with linghe.TrainingContext(fp8="blockwise"):
        pass


def test_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(context_mod, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with linghe.TrainingContext(fp8="tensorwise"):
            pass


def test_delayed_scales_follow_amax_history(device):
    ctx = linghe.TrainingContext(fp8="delayed", history_len=3, pow2_scale=False)
    st = ctx.recipe.state
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25]
    for step, a in enumerate(amaxes):
        x = torch.full((4, 32), -a, device=device)
        with ctx:
            t = ctx.recipe.quantize_input(x, key="x")
        h = st.history(torch.float8_e4m3fn)
        want_q = 448.0 / max(amaxes[max(0, step - 2): step + 1])
        torch.testing.assert_close(h.scale[0], torch.tensor(want_q, device=device))
        # The quantization used the scale from *before* this step's update (delayed), or
        # the current amax on the very first step.
        used = 448.0 / (a if step == 0 else max(amaxes[max(0, step - 3): step]))
        torch.testing.assert_close(t.rowwise_scale, torch.tensor([1 / used], device=device))
    assert st.steps == len(amaxes)


def test_delayed_most_recent_margin_and_grad_dtype(device):
    ctx = linghe.TrainingContext(fp8="delayed", amax_compute="most_recent", margin=2)
    with ctx:
        ctx.recipe.quantize_input(torch.full((2, 16), 4.0, device=device), key="a")
        g = ctx.recipe.quantize_input(torch.full((2, 16), 1e3, device=device), key="a",
                                      grad=True)
    assert g.rowwise_data.dtype == torch.float8_e5m2
    st = ctx.recipe.state
    torch.testing.assert_close(st.history(torch.float8_e4m3fn).scale[0],
                               torch.tensor(448.0 / 4 / 4, device=device))
    torch.testing.assert_close(st.history(torch.float8_e5m2).scale[0],
                               torch.tensor(57344.0 / 1e3 / 4, device=device))
    with ctx:  # stale scale: a 100x larger tensor saturates instead of overflowing to NaN
        t = ctx.recipe.quantize_input(torch.full((2, 16), 400.0, device=device), key="a")
    assert not t.rowwise_data.float().isnan().any()
    assert t.rowwise_data.float().abs().max() == 448


def test_delayed_slots_grow(device):
    ctx = linghe.TrainingContext(fp8="delayed")
    with ctx:
        for i in range(40):
            ctx.recipe.quantize_input(torch.full((1, 16), float(i + 1), device=device),
                                      key=("layer", i))
    h = ctx.recipe.state.history(torch.float8_e4m3fn)
    assert h.scale.numel() >= 40
    torch.testing.assert_close(h.scale[:40], 448.0 / torch.arange(1, 41, device=device).float())


def _gloo_worker(rank, world, port, out, device):
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # The ranks run the kernels where the test runs them: on the GPU (both ranks share it;
    # gloo all-reduces CUDA tensors through host copies) or on CPU tensors through the
    # interpreter (TRITON_INTERPRET is inherited from the parent's environment).
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = linghe.TrainingContext(fp8="delayed", amax_group=dist.group.WORLD)
        torch.manual_seed(rank)
        for _ in range(2):
            with ctx:
                # Each rank sees different magnitudes: the scales must still agree.
                ctx.recipe.quantize_input(torch.randn(8, 32, device=device) * (rank + 1) * 3,
                                          key="x")
                ctx.recipe.quantize_input(torch.randn(8, 32, device=device) * (2 - rank),
                                          key="w")
        out[rank] = ctx.recipe.state.history(torch.float8_e4m3fn).scale[:2].cpu()
    finally:
        dist.destroy_process_group()


def test_delayed_scales_equal_across_gloo_ranks(device):
    import socket

    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_gloo_worker, args=(2, port, out, device), nprocs=2, join=True)
    assert torch.equal(out[0], out[1])
    assert not torch.equal(out[0], torch.ones(2))
