"""Group RMSNorm with sigmoid gate (``group_rms_norm_gate``), transpose fused."""

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.testing import assert_close

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}


def _check(device, *, B, S, H, dh, G, layout, shared, dtype, wdtype=torch.float32,
           x=None, gate=None):
    dim = H * dh
    if x is None:
        x = torch.randn(B, S, H, dh, device=device).to(dtype)
    if gate is None:
        gshape = (S, B, dim) if layout == "sbh" else (B, S, dim)
        gate = (torch.randn(gshape, device=device) * 2).to(dtype)
    w = (torch.randn(dim // G if shared else dim, device=device) + 1).to(wdtype)

    xa, ga, wa = (t.detach().clone().requires_grad_() for t in (x, gate, w))
    y = linghe.group_rms_norm_gate(xa, ga, wa, num_groups=G, gate_layout=layout)
    xr, gr, wr = (t.detach().float().requires_grad_() for t in (x, gate, w))
    yr = ref.group_rms_norm_gate(xr, gr, wr, num_groups=G, gate_layout=layout)
    assert y.shape == gate.shape and y.dtype == dtype and y.is_contiguous()
    assert_close(y, yr, tol=TOL[dtype], name="y")

    dy = torch.randn_like(yr)
    (y.float() * dy).sum().backward()
    (yr * dy).sum().backward()
    assert xa.grad.shape == x.shape and ga.grad.shape == gate.shape
    assert wa.grad.dtype == wdtype
    assert_close(xa.grad, xr.grad, tol=TOL[dtype], name="dx")
    assert_close(ga.grad, gr.grad, tol=TOL[dtype], name="dgate")
    assert_close(wa.grad, wr.grad, tol=max(TOL[dtype], TOL[wdtype]) * 2, name="dweight")


@pytest.mark.parametrize("layout", ["sbh", "bsh"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("B,S,H,dh,G", [(2, 5, 3, 4, 3), (1, 3, 4, 6, 4), (3, 1, 2, 5, 2),
                                         (2, 4, 1, 12, 1)])
def test_group_rms_norm_gate(device, layout, shared, B, S, H, dh, G):
    _check(device, B=B, S=S, H=H, dh=dh, G=G, layout=layout, shared=shared,
           dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["sbh", "bsh"])
def test_group_rms_norm_gate_half(device, dtype, layout):
    _check(device, B=2, S=5, H=3, dh=8, G=4, layout=layout, shared=layout == "bsh",
           dtype=dtype, wdtype=dtype)


def test_group_rms_norm_gate_3d_x_and_strided_gate(device):
    B, S, dim, G = 2, 3, 12, 3
    x = torch.randn(B, S, dim, device=device)
    big = torch.randn(S, B, dim + 5, device=device)
    gate = big[..., 2:2 + dim]
    assert not gate.is_contiguous()
    _check(device, B=B, S=S, H=1, dh=dim, G=G, layout="sbh", shared=False,
           dtype=torch.float32, x=x.view(B, S, 1, dim), gate=gate)
    y = linghe.group_rms_norm_gate(x, gate, torch.ones(dim, device=device), num_groups=G)
    yr = ref.group_rms_norm_gate(x, gate, torch.ones(dim, device=device), num_groups=G)
    assert_close(y, yr)


def test_group_rms_norm_gate_empty(device):
    for layout in ("sbh", "bsh"):
        x = torch.randn(2, 0, 3, 4, device=device, requires_grad=True)
        gate = torch.randn((0, 2, 12) if layout == "sbh" else (2, 0, 12), device=device,
                           requires_grad=True)
        w = torch.randn(12, device=device, requires_grad=True)
        y = linghe.group_rms_norm_gate(x, gate, w, num_groups=3, gate_layout=layout)
        assert y.shape == gate.shape
        y.sum().backward()
        assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


def test_group_rms_norm_gate_nonfinite_propagates(device):
    x = torch.randn(1, 2, 2, 4, device=device)
    x[0, 1, 0, 0] = float("nan")  # group 0 of token s=1 (num_groups=2, 4 channels each)
    gate = torch.randn(2, 1, 8, device=device)
    y = linghe.group_rms_norm_gate(x, gate, torch.ones(8, device=device), num_groups=2)
    assert y[1, 0, :4].isnan().all() and not y[1, 0, 4:].isnan().any()
    assert not y[0].isnan().any()


def test_group_rms_norm_gate_bad_inputs(device):
    x = torch.randn(2, 5, 3, 4, device=device)
    gate = torch.randn(5, 2, 12, device=device)
    w = torch.ones(12, device=device)
    with pytest.raises(ValueError, match="gate must have shape"):
        linghe.group_rms_norm_gate(x, gate, w, gate_layout="bsh")
    with pytest.raises(ValueError, match="multiple of num_groups"):
        linghe.group_rms_norm_gate(x, gate, w, num_groups=5)
    with pytest.raises(ValueError, match="weight must have shape"):
        linghe.group_rms_norm_gate(x, gate, torch.ones(4, device=device), num_groups=4)
    with pytest.raises(TypeError, match="gate must have dtype"):
        linghe.group_rms_norm_gate(x, gate.double(), w)
    with pytest.raises(TypeError, match="x must have dtype"):
        linghe.group_rms_norm_gate(x.int(), gate, w)
    with pytest.raises(ValueError, match="gate_layout"):
        linghe.group_rms_norm_gate(x, gate, w, gate_layout="hbs")
    with pytest.raises(ValueError, match="num_groups"):
        linghe.group_rms_norm_gate(x, gate, w, num_groups=0)
    with pytest.raises(ValueError, match="x must be 3 or 4-D"):
        linghe.group_rms_norm_gate(x[0, 0], gate, w)
    with pytest.raises(ValueError, match="last dimension"):
        linghe.group_rms_norm_gate(x, gate.transpose(0, 2).contiguous().transpose(0, 2), w)
    if device == "cpu":
        with pytest.raises(ValueError, match="weight must be on"):
            linghe.group_rms_norm_gate(x, gate, torch.ones(12, device="meta"))
    else:
        with pytest.raises(ValueError, match="gate must be on"):
            linghe.group_rms_norm_gate(x, gate.cpu(), w)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["sbh", "bsh"])
def test_group_rms_norm_gate_standard_shape(device, layout):
    _check(device, B=2, S=4096, H=16, dh=128, G=4, layout=layout, shared=False,
           dtype=torch.bfloat16)


def test_group_rms_norm_gate_many_token_blocks(device):
    # Several token blocks per persistent backward program, and a partial last block.
    _check(device, B=3, S=50, H=2, dh=256, G=1, layout="sbh", shared=False,
           dtype=torch.float32)
    _check(device, B=1, S=37, H=2, dh=6, G=2, layout="bsh", shared=True,
           dtype=torch.float32)


@pytest.mark.parametrize("P,N", [(150, 70), (1, 5), (64, 32)])
def test_sum_partials(device, P, N):
    # The weight-gradient reduction both gate and rope backward use.
    from linghe.utils import sum_partials

    p = torch.randn(P, N, device=device)
    assert_close(sum_partials(p, torch.float32), p.double().sum(0))
    out = sum_partials(p, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_close(out, p.double().sum(0), tol=1e-2)
