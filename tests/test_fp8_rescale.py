"""The FP8 grouped GEMMs' two promotion forms (``RESCALE``: one accumulator kept in units
of the current K step's scale, vs. the default second accumulator), pinned tiles through
the launchers' ``config`` argument, the wgrad's vectorized boundary-group masks
(``VEC_MASK``), and the tile sweep's CPU smoke run (benchmark/fp8_gemm_sweep.py).

Interpreter (CPU): ``tl.dot`` accumulates exactly, so both forms match the dequantized
reference to fp32 rounding. On Hopper the rescaled form keeps the whole K loop in the
MMA's reduced-precision accumulator (the default promotes every 128): hence the looser
GPU tolerance of the fp32 wgrad.
"""

import pytest
import torch
from test_grouped_mm import _deq, make_rows

import linghe
from linghe import reference as ref
from linghe.bwd import grouped_mm as bwd_gm
from linghe.fwd import grouped_mm as fwd_gm
from linghe.testing import assert_close, rel_err

ON_GPU = torch.cuda.is_available()

ROWS_CASES = [
    # (counts, align, K, N): zero-token expert + K tail step; K < 128 (no full step) and
    # align 1; three K steps, segments over 128 rows.
    ([5, 0, 150], 16, 200, 128),
    ([0, 0, 70], 1, 96, 256),
    ([130, 300], 8, 384, 128),
]


def _rows_config(bn: int, rescale: bool) -> dict:
    if ON_GPU:
        return dict(BM=64, BN=bn, num_warps=4, num_stages=3, RESCALE=rescale)
    return dict(BM=32, BN=bn, num_warps=4, num_stages=1, RESCALE=rescale)


def _wgrad_config(rescale: bool, vec_mask: bool = False) -> dict:
    if ON_GPU:
        return dict(BN=128, BK=128, num_warps=8, num_stages=3, RESCALE=rescale,
                    VEC_MASK=vec_mask)
    return dict(BN=64, BK=64, num_warps=4, num_stages=1, RESCALE=rescale, VEC_MASK=vec_mask)


def _operands(case, device, scale=3.0):
    counts, align, K, N = case
    E = len(counts)
    x, layout, real = make_rows(counts, align, K, device, torch.bfloat16, scale=scale)
    w = torch.randn(E, N, K, device=device, dtype=torch.bfloat16) / K**0.5
    g = torch.randn(x.shape[0], N, device=device, dtype=torch.bfloat16)
    g[~real] = 0
    return x, w, g, layout, real


@pytest.mark.parametrize("bn", [64, 256], ids=lambda b: f"BN{b}")
@pytest.mark.parametrize("rescale", [False, True], ids=["promote", "rescale"])
@pytest.mark.parametrize("case", ROWS_CASES, ids=lambda c: f"E{len(c[0])}-a{c[1]}-K{c[2]}")
def test_rows_kernel_forms(device, case, rescale, bn):
    """Forward and dgrad (the rows kernel) in both forms, with one weight scale per step
    (``BN <= 128``) and a ``[BN]`` vector of them (``BN = 256``): dequantized reference,
    zeros on padding and tail rows."""
    x, w, g, layout, real = _operands(case, device)
    a = linghe.quantize_1x128(x)
    wq = linghe.quantize_grouped_weight(w, columnwise=True)
    gq = linghe.quantize_1x128(g)
    off = layout.offsets
    cfg = _rows_config(bn, rescale)

    out = fwd_gm.grouped_mm_fp8_fwd(a, wq, off, out_dtype=torch.float32, config=cfg)
    r = ref.grouped_mm_fp8_dequantized(a.rowwise_data, a.rowwise_scale, wq.rowwise_data,
                                       wq.rowwise_scale, off)
    assert_close(out, r, tol=1e-3 if ON_GPU else 1e-5, name="fwd vs dequantized")
    assert torch.all(out[~real] == 0)

    dx = bwd_gm.grouped_mm_fp8_dgrad(gq, wq, off, out_dtype=torch.float32, config=cfg)
    r_dx = ref.grouped_mm(_deq(gq), _deq(wq).transpose(1, 2), off)
    assert_close(dx, r_dx, tol=1e-3 if ON_GPU else 1e-5, name="dgrad vs dequantized")
    assert torch.all(dx[~real] == 0)


WGRAD_CASES = [
    # (counts, align, K, N, segment groups)
    ([5, 0, 150], 16, 200, 128, False),   # plain groups straddling experts (head/tail)
    ([130, 300], 8, 128, 128, False),     # full interior groups plus head/tail groups
    ([5, 0, 140, 0], 16, 130, 128, True),  # segment groups, partial last groups, ALIGN16
    ([9, 31, 1, 0, 17], 1, 64, 256, True),  # segment groups, align 1 (no ALIGN16)
    ([0, 0], 8, 64, 128, True),            # no rows at all
]


# VEC_MASK changes only segment groups with 16-aligned segments.
_WGRAD_PARAMS = [(c, vm) for c in WGRAD_CASES for vm in (False, True)
                 if not vm or (c[4] and c[1] % 16 == 0)]


@pytest.mark.parametrize("rescale", [False, True], ids=["promote", "rescale"])
@pytest.mark.parametrize("case,vec_mask", _WGRAD_PARAMS, ids=lambda v: (
    f"E{len(v[0])}-a{v[1]}-{'seg' if v[4] else 'plain'}" if isinstance(v, tuple)
    else ("vecmask" if v else "regmask")))
def test_wgrad_forms(device, case, vec_mask, rescale):
    """The FP8 wgrad in both forms, plain and segment groups, the segments' partial last
    groups masked in registers or in vectorized loads (``VEC_MASK``): dequantized
    reference, zeros for experts without rows."""
    counts, align, K, N, seg = case
    E = len(counts)
    x, _, g, layout, real = _operands(case[:4], device)
    if seg:
        qg = linghe.functional.grouped_mm.quantize_grouped_1x128
        a, gq = qg(x, layout, rowwise=False), qg(g, layout, rowwise=False)
    else:
        a = linghe.quantize_1x128(x, columnwise=True)
        gq = linghe.quantize_1x128(g, columnwise=True)
    off = layout.offsets
    dw = bwd_gm.grouped_mm_fp8_wgrad(gq, a, off, out_dtype=torch.float32, segments=seg,
                                     align=align, config=_wgrad_config(rescale, vec_mask))
    gc, xc = _deq(gq, columnwise=True), _deq(a, columnwise=True)
    r_dw = torch.stack([gc[off[e]:off[e + 1]].t() @ xc[off[e]:off[e + 1]] for e in range(E)])
    tol = (5e-3 if rescale else 1e-3) if ON_GPU else 1e-5
    assert_close(dw, r_dw, tol=tol, name="wgrad vs dequantized")
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(dw[e] == 0)


def _edge_rows(device):
    """Rows whose 1x128 blocks span a wide range of scales: an all-zero block (scale 1)
    between blocks of ~1e3 and ~1e-20, a block of subnormal-scale values, an Inf (its
    block dequantizes to NaN) and a NaN."""
    counts, align, K, N = [40, 0, 23], 16, 512, 128
    x, layout, real = make_rows(counts, align, K, device, torch.float32)
    rows = real.nonzero().flatten()
    x[rows[0], 0:128] *= 1e3
    x[rows[0], 128:256] = 0
    x[rows[0], 256:384] *= 1e-20
    x[rows[1], 128:256] = 0
    x[rows[1], 384:512] *= 1e-36  # scale ~1e-39: the product of scales underflows
    x[rows[2], 300] = float("inf")
    x[rows[3], 17] = float("nan")
    x[rows[-1], :] *= 1e-30
    w = torch.randn(len(counts), N, K, device=device) / K**0.5
    return x, w, layout, real, rows


@pytest.mark.parametrize("rescale", [False, True], ids=["promote", "rescale"])
def test_rescale_scale_edge_cases(device, rescale):
    """Zero blocks (scale 1), scales spanning ~1e23 within a row, a product of scales
    below the fp32 normal range, NaN and Inf: both forms give the dequantized reference
    (NaN/Inf propagated as it has them), per row to fp32 rounding."""
    x, w, layout, real, rows = _edge_rows(device)
    a = linghe.quantize_1x128(x)
    wq = linghe.quantize_grouped_weight(w)
    off = layout.offsets
    out = fwd_gm.grouped_mm_fp8_fwd(a, wq, off, out_dtype=torch.float32,
                                    config=_rows_config(128, rescale))
    r = ref.grouped_mm_fp8_dequantized(a.rowwise_data, a.rowwise_scale, wq.rowwise_data,
                                       wq.rowwise_scale, off)
    bad = ~torch.isfinite(r)
    assert bool(bad[rows[2]].all()) and bool(bad[rows[3]].all())  # the reference's NaN rows
    check = torch.ones_like(bad)
    if not ON_GPU:
        # The interpreter's dot reads the e4m3 NaN byte (0x7F) as a number, so a NaN
        # element propagates on the GPU only; the Inf row goes through its scale (Inf).
        check[rows[3]] = False
    assert torch.equal((~torch.isfinite(out))[check], bad[check]), \
        "NaN/Inf rows differ from the reference"
    tol = 1e-3 if ON_GPU else 1e-5
    for i in rows.tolist():
        if not bool(bad[i].any()):  # each row on its own scale (rows span 1e-30 .. 1e3)
            assert rel_err(out[i], r[i]) <= tol, (i, rel_err(out[i], r[i]))
    assert torch.all(out[~real] == 0)


def test_rescale_pow2_matches_promote(device):
    """With power-of-two scales every rescaling is exact: on the interpreter (exact dot
    accumulation) the two forms agree to fp32 rounding of the sums' order."""
    x, w, g, layout, real = _operands(([70, 0, 90], 16, 384, 128), device)
    a = linghe.quantize_1x128(x, pow2_scale=True)
    wq = linghe.quantize_grouped_weight(w, pow2_scale=True)
    off = layout.offsets
    outs = [fwd_gm.grouped_mm_fp8_fwd(a, wq, off, out_dtype=torch.float32,
                                      config=_rows_config(64, rs)) for rs in (False, True)]
    assert_close(outs[1], outs[0], tol=1e-3 if ON_GPU else 1e-6, name="rescale vs promote")


def test_config_checks(device):
    """A pinned config: BN must divide 128 or be a multiple of it; the promotion form is an
    FP8 key (a bf16 launch refuses it)."""
    x, w, g, layout, real = _operands(([5, 7], 16, 128, 128), device)
    a = linghe.quantize_1x128(x)
    wq = linghe.quantize_grouped_weight(w)
    with pytest.raises(ValueError, match="BN must divide 128"):
        fwd_gm.grouped_mm_fp8_fwd(a, wq, layout.offsets, config=_rows_config(192, True))
    out = torch.empty(x.shape[0], 128, device=device, dtype=x.dtype)
    with pytest.raises(ValueError, match="unknown keys.*RESCALE"):
        fwd_gm.launch_grouped_rows(x, w, out, layout.offsets, stride_be=128 * 128,
                                   stride_bi=1, stride_bj=128, config=_rows_config(64, True))


def test_default_form_switch(device, monkeypatch):
    """``FP8_RESCALE`` picks the form of launches without a pinned form (the launchers'
    default path), and the MoE-style autograd path works with it."""
    monkeypatch.setattr(fwd_gm, "FP8_RESCALE", True)
    monkeypatch.setattr(bwd_gm, "WGRAD_VEC_MASK", True)
    x, w, g, layout, real = _operands(([9, 0, 40], 16, 128, 128), device)
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    out = linghe.grouped_mm(x, w, layout, fp8=True)
    out.backward(g)
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    r = ref.grouped_mm(xr, wr, layout.offsets)
    dx, dw = torch.autograd.grad(r, (xr, wr), g.double())
    assert_close(out, r, tol=0.08)
    assert_close(x.grad, dx, tol=0.08, name="d_rows")
    assert_close(w.grad, dw, tol=0.08, name="d_weight")


_COMPILE_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from linghe.fwd import grouped_mm as F
from linghe.bwd import grouped_mm as B

PTRS = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", as_ptr="*fp32",
            bs_ptr="*fp32", offsets_ptr="*i32", g_ptr="*fp8e4nv", x_ptr="*fp8e4nv",
            w_ptr="*bf16", gs_ptr="*fp32", xs_ptr="*fp32")
NOT16 = ("stride_bi", "bs_si")  # == 1 in the launches

def comp(kernel, consts, warps, stages):
    sig = {p.name: "constexpr" if p.is_constexpr else PTRS.get(p.name, "i32")
           for p in kernel.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n] != "constexpr" and n not in NOT16}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})

for bm, bn in [(128, 128), (128, 256)]:  # one weight scale per step / a [BN] vector
    k = comp(F._grouped_rows_kernel, dict(BM=bm, BN=bn, BK=128, GROUP_M=8, FP8=True,
             IEEE=False, B_KMAJOR=True, EP2=256, RESCALE=True), 8, 3)
    assert "wgmma" in k.asm["ptx"], bn
    assert "div.rn.f32" in k.asm["ptx"], "the ratio is a correctly rounded division"
for vm in (False, True):
    k = comp(B._wgrad_fp8_kernel, dict(BN=128, BK=128, BR=128, SEG=True, EP2=256,
             ALIGN16=True, RESCALE=True, VEC_MASK=vm), 8, 3)
    ptx = k.asm["ptx"]
    assert "wgmma" in ptx, vm
    if vm:  # the partial group's token masks stay 16-byte vectors (async copies)
        assert "ld.global.b8" not in ptx and "ld.global.u8" not in ptx
        assert "cp.async" in ptx
print("COMPILED")
'''


def test_rescale_kernels_compile_for_sm90(compile_sm90):
    """The rescaled rows kernel (both weight-scale paths) and wgrad (both boundary-mask
    forms) compile for sm_90 without a GPU, use wgmma, and VEC_MASK's token masks give
    vector async copies, not byte loads."""
    compile_sm90(_COMPILE_SCRIPT)


def test_fp8_gemm_sweep_cpu_smoke(tmp_path, capsys):
    """``python -m benchmark.fp8_gemm_sweep --device cpu``: one tiny shape through the
    interpreter, every op and form, checked against the dequantized reference; JSON rows
    and the summary table printed last."""
    if ON_GPU:
        pytest.skip("the smoke run is the CPU path; on a GPU run the sweep itself")
    import json

    from benchmark import fp8_gemm_sweep

    out = tmp_path / "sweep.json"
    assert fp8_gemm_sweep.main(["--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    ops = {(r["layout"], r["gemm"], r["op"]) for r in rows}
    assert {op for _, _, op in ops} == {"fwd", "dgrad", "wgrad"}
    fp8 = [r for r in rows if r["provider"] == "fp8"]
    assert {r["form"] for r in fp8} == {"promote", "rescale", "tma", "tmar", "default"}
    assert all(r["ok"] for r in fp8), [r for r in fp8 if not r["ok"]]
    assert all(r["us"] > 0 for r in rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("wgrad") or "wgrad" in lines[-1]
