"""Tile and promotion-form sweep of the FP8 blockwise grouped GEMMs against bf16.

    python -m benchmark.fp8_gemm_sweep --out sweep.json          # GPU (H100/H200), < 4 min
    python -m benchmark.fp8_gemm_sweep --device cpu --out s.json  # interpreter smoke run
    python -m benchmark.fp8_gemm_sweep --ptxas                    # offline: sm_90 registers

For the forward (fprop) and dgrad (``linghe/fwd/grouped_mm.py``'s rows kernel) and the
wgrad (``linghe/bwd/grouped_mm.py``'s ``_wgrad_fp8_kernel``) of the two MoE GEMMs,
gate_up ``[R, 2048] x [E, 2048, 2048]`` and down ``[R, 1024] x [E, 2048, 1024]``, at two
layouts built as ``benchmark/cases/grouped_mm.py`` builds them (8192 tokens, top-8):

- ``a``: E = 32 local experts, segments padded to 128 (69600 rows);
- ``b``: E = 256 experts, align 16 (69376 rows; the end-to-end model's layout).

Each candidate (promotion form x tiles x warps x stages, :data:`ROWS_CANDIDATES` and
:data:`WGRAD_CANDIDATES`: the configs that sm_90 ptxas compiles without spilling, see
``--ptxas`` and benchmark/NOTES.md) runs through the launchers with a pinned ``config``
(no autotuner), is checked against the dequantized fp32 reference (relative error, bf16
outputs: <= 1e-2 like the tests) and timed with ``triton.testing.do_bench`` (median),
beside ``torch._grouped_mm`` bf16 on the same segments (through linghe's ``backend=
"torch"``, as the benchmark) and the launchers' current default (no ``config``: the
autotuner over ``_FP8_CONFIGS`` / ``_WGRAD_FP8_CONFIGS``). The wgrad takes its operands
as the MoE layer does (columnwise groups per segment, ``quantize_grouped_1x128``).
Forms: ``promote`` (``acc += dot * scale``, two accumulator tiles) and ``rescale`` (one
tile, ``acc = dot(a, b, acc * s_prev / s)``), both loading through pointers, and ``tma``
(the rows kernel's promoting form with TMA loads, the FP8 default), ``tmar`` (TMA loads,
rescaled form: one accumulator tile, so 128-row tiles fit two programs per SM and each
expert's weights are re-read half as often); ``+vm``: the wgrad's
vectorized boundary-group masks (``VEC_MASK``). ``LINGHE_SWEEP_FORMS=tma,promote`` sweeps
only those forms (also with ``--ptxas``). A precision probe runs the 128x128 tiles of
both forms with fp32 outputs (the MMA's reduced-precision accumulation, which ``rescale``
carries over the whole K loop, is below bf16 rounding otherwise). The summary table is
printed last; every row goes to ``--out`` as JSON (with the compiled kernels' ``n_regs``
/ ``n_spills``).

``--budget-s`` (default 220) stops starting new candidates once that many seconds have
passed (skipped rows say so), so a run stays under ~4 minutes with cold Triton caches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

if not torch.cuda.is_available() and "--ptxas" not in sys.argv:
    # No GPU: run the same Triton kernels through the interpreter (must precede import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

import linghe  # noqa: E402
import linghe.functional.grouped_mm  # noqa: E402
from linghe import reference as ref  # noqa: E402
from linghe.bwd import grouped_mm as bwd_gm  # noqa: E402
from linghe.fwd import grouped_mm as fwd_gm  # noqa: E402
from linghe.testing import rel_err  # noqa: E402
from linghe.utils import INTERPRET, set_poison_outputs  # noqa: E402

from .harness import bench_us, compiled_binaries, fmt, random_routing  # noqa: E402

# --------------------------------------------------------------------------------------
# Candidates (GPU). Names: form, tiles, warps, stages.
# --------------------------------------------------------------------------------------


def _rows(form, bm, bn, warps, stages, group_m=None):
    c = dict(form=form, BM=bm, BN=bn, num_warps=warps, num_stages=stages)
    if group_m is not None:
        c["GROUP_M"] = group_m
    return c


def _wg(form, bn, bk, warps, stages, vm=False):
    return dict(form=form, BN=bn, BK=bk, num_warps=warps, num_stages=stages, VEC_MASK=vm)


#: Rows kernel (fwd and dgrad): the autotune list (promote; the current default picks
#: among these) and rescale tiles that fit without spilling (sm_90 ptxas, offline).
ROWS_CANDIDATES = [
    _rows("promote", 64, 128, 4, 4), _rows("promote", 64, 128, 4, 3),
    _rows("promote", 128, 128, 8, 3), _rows("promote", 128, 128, 8, 4),
    _rows("promote", 128, 64, 4, 4),
    _rows("rescale", 64, 128, 4, 3), _rows("rescale", 128, 128, 8, 3),
    _rows("rescale", 64, 256, 8, 3), _rows("rescale", 128, 256, 8, 3),
    _rows("rescale", 256, 128, 8, 3),
    _rows("tma", 64, 128, 4, 4), _rows("tma", 64, 128, 4, 3), _rows("tma", 128, 128, 8, 3),
    _rows("tma", 128, 128, 8, 4), _rows("tma", 128, 64, 4, 4), _rows("tma", 64, 64, 4, 4),
    _rows("tma", 64, 128, 4, 2), _rows("tma", 64, 256, 8, 3), _rows("tma", 128, 256, 8, 3),
    _rows("tma", 64, 128, 4, 3, 4), _rows("tma", 64, 128, 4, 3, 16),
    _rows("tmar", 64, 128, 4, 3), _rows("tmar", 128, 128, 8, 3), _rows("tmar", 128, 128, 8, 4),
    _rows("tmar", 128, 256, 8, 3), _rows("tmar", 256, 128, 8, 3), _rows("tmar", 64, 256, 8, 3),
]
#: wgrad ([BN, BK] tiles of dW): promote at 128x128 (the autotuner's non-spilling
#: members), with vectorized boundary masks, and rescale tiles (all +vm: without it the
#: rescaled wgrad spills at 128x128).
WGRAD_CANDIDATES = [
    _wg("promote", 128, 128, 8, 3), _wg("promote", 128, 128, 8, 4),
    _wg("promote", 128, 128, 8, 3, True), _wg("promote", 128, 64, 8, 4, True),
    _wg("rescale", 128, 128, 8, 3, True), _wg("rescale", 128, 64, 8, 4, True),
    _wg("rescale", 64, 256, 8, 3, True), _wg("rescale", 256, 64, 8, 3, True),
    _wg("rescale", 128, 256, 8, 3, True),
]
#: ``LINGHE_SWEEP_FORMS=tma,promote`` in the environment: sweep only these forms (the
#: compile workers inherit it).
_FORMS = os.environ.get("LINGHE_SWEEP_FORMS")
if _FORMS:
    ROWS_CANDIDATES = [c for c in ROWS_CANDIDATES if c["form"] in _FORMS.split(",")]
    WGRAD_CANDIDATES = [c for c in WGRAD_CANDIDATES if c["form"] in _FORMS.split(",")]
#: Interpreter smoke run: small tiles, every form, the BN > 128 path of the rows kernel.
CPU_ROWS = [_rows("promote", 32, 64, 4, 1), _rows("rescale", 32, 64, 4, 1),
            _rows("rescale", 32, 256, 4, 1), _rows("tma", 32, 64, 4, 1),
            _rows("tmar", 32, 64, 4, 1)]
CPU_WGRAD = [_wg("promote", 64, 64, 4, 1), _wg("rescale", 64, 64, 4, 1, True),
             _wg("rescale", 64, 128, 4, 1)]

LAYOUTS = {"a": dict(T=8192, topk=8, E=32, align=128),
           "b": dict(T=8192, topk=8, E=256, align=16)}
GEMMS = {"gate_up": (2048, 2048), "down": (2048, 1024)}  # (N, K)
CPU_LAYOUT = {"tiny": dict(T=40, topk=2, E=3, align=16)}
CPU_GEMMS = {"tiny": (256, 256)}
OPS = ("fwd", "dgrad", "wgrad")
#: The precision probe: fp32 outputs of the 128x128 tiles in both forms.
PROBES = [("fwd", _rows("promote", 128, 128, 8, 3)), ("fwd", _rows("rescale", 128, 128, 8, 3)),
          ("fwd", _rows("tma", 64, 128, 4, 3)), ("fwd", _rows("tmar", 128, 128, 8, 3)),
          ("wgrad", _wg("promote", 128, 128, 8, 3, True)),
          ("wgrad", _wg("rescale", 128, 128, 8, 3, True))]
TOL = 1e-2  # bf16 outputs vs the dequantized fp32 reference (as tests/test_grouped_mm.py)


def cfg_name(c: dict | None) -> str:
    if c is None:
        return "default"
    tiles = f"{c['BM']}x{c['BN']}" if "BM" in c else f"{c['BN']}x{c['BK']}"
    vm = "+vm" if c.get("VEC_MASK") else ""
    g = f"/g{c['GROUP_M']}" if "GROUP_M" in c else ""
    return f"{c['form']}{vm} {tiles}/{c['num_warps']}w/{c['num_stages']}s{g}"


def launch_config(c: dict) -> dict:
    """A candidate as the launchers' ``config`` argument (form ``tma``: the rows kernel
    with its operands loaded by TMA; ``promote``/``rescale`` load through pointers)."""
    out = {k: v for k, v in c.items() if k != "form"}
    out["RESCALE"] = c["form"] in ("rescale", "tmar")
    out["TMA"] = c["form"] in ("tma", "tmar")
    return out


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


class Clock:
    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over(self) -> bool:
        return self.elapsed() > self.budget_s


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


_RES: dict = {}  # (kernel, layout, config) -> (n_regs, n_spills) of its binary


def _run_first(fn, kernel, key, device):
    """First call of a candidate (compiles on a miss; outputs poisoned so that an
    unwritten element fails the check): ``(out, seconds, n_regs, n_spills)``."""
    before = {id(b) for b in compiled_binaries(kernel)}
    set_poison_outputs(True)
    t = time.perf_counter()
    try:
        out = fn()
        _sync(device)
    finally:
        set_poison_outputs(False)
    secs = time.perf_counter() - t
    new = [b for b in compiled_binaries(kernel) if id(b) not in before]
    if len(new) == 1:
        _RES[key] = (getattr(new[0], "n_regs", None), getattr(new[0], "n_spills", None))
    regs, spills = _RES.get(key, (None, None))
    return out, secs, regs, spills


# --------------------------------------------------------------------------------------
# Inputs and references
# --------------------------------------------------------------------------------------


def build_inputs(lay: dict, N: int, K: int, device: str, tokens: int | None = None):
    """Layout and operands as benchmark/cases/grouped_mm.py builds them (random balanced
    routing, zero padding rows), quantized as the MoE layer's GEMMs take them."""
    layout, real, _, _ = random_routing(tokens or lay["T"], lay["topk"], lay["E"],
                                        lay["align"], device)
    E, R = layout.num_experts, layout.num_rows
    dt = torch.bfloat16
    x = torch.randn(R, K, device=device, dtype=dt)
    x[~real] = 0
    w = (torch.randn(E, N, K, device=device) / K**0.5).to(dt)
    g = torch.randn(R, N, device=device, dtype=dt)
    g[~real] = 0
    qg = linghe.functional.grouped_mm.quantize_grouped_1x128
    return dict(layout=layout, x=x, w=w, g=g, xq=linghe.quantize_1x128(x),
                gq=linghe.quantize_1x128(g), wq=linghe.quantize_grouped_weight(w),
                xs=qg(x, layout, rowwise=False), gs=qg(g, layout, rowwise=False))


def reference(op: str, d: dict) -> torch.Tensor:
    """The dequantized fp32 result of ``op`` (what each FP8 candidate is checked against)."""
    off = d["layout"].offsets
    f32 = torch.float32
    if op == "fwd":
        xq, wq = d["xq"], d["wq"]
        return ref.grouped_mm_fp8_dequantized(xq.rowwise_data, xq.rowwise_scale,
                                              wq.rowwise_data, wq.rowwise_scale, off)
    if op == "dgrad":
        return ref.grouped_mm(d["gq"].dequantize(dtype=f32),
                              d["wq"].dequantize(dtype=f32).transpose(1, 2), off)
    gc = d["gs"].dequantize(columnwise=True, dtype=f32)
    xc = d["xs"].dequantize(columnwise=True, dtype=f32)
    o = off.tolist()
    E, N, K = d["w"].shape
    out = torch.empty(E, N, K, device=gc.device, dtype=f32)
    for e in range(E):
        torch.matmul(gc[o[e]:o[e + 1]].t(), xc[o[e]:o[e + 1]], out=out[e])
    return out


def fp8_call(op: str, d: dict, cfg: dict | None, out_dtype=torch.bfloat16):
    lay = d["layout"]
    off = lay.offsets
    c = None if cfg is None else launch_config(cfg)
    if op == "fwd":
        return lambda: fwd_gm.grouped_mm_fp8_fwd(d["xq"], d["wq"], off, out_dtype=out_dtype,
                                                 config=c)
    if op == "dgrad":
        return lambda: bwd_gm.grouped_mm_fp8_dgrad(d["gq"], d["wq"], off,
                                                   out_dtype=out_dtype, config=c)
    return lambda: bwd_gm.grouped_mm_fp8_wgrad(d["gs"], d["xs"], off, out_dtype=out_dtype,
                                               segments=True, align=lay.align, config=c)


def bf16_call(op: str, d: dict):
    """``torch._grouped_mm`` bf16 through linghe's ``backend="torch"`` (the benchmark's
    ``torch_bf16`` row), or None where it is not available."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    if d["x"].is_cuda and not fwd_gm.torch_grouped_mm_ok(d["x"], d["w"]):
        return None
    off = d["layout"].offsets
    if op == "fwd":
        return lambda: fwd_gm.grouped_mm_fwd(d["x"], d["w"], off, backend="torch")
    if op == "dgrad":
        return lambda: bwd_gm.grouped_mm_dgrad(d["g"], d["w"], off, backend="torch")
    return lambda: bwd_gm.grouped_mm_wgrad(d["g"], d["x"], off, backend="torch")


def _kernel(op: str, cfg: dict | None = None):
    """The kernel a candidate launches (its new binary gives ``n_regs``/``n_spills``)."""
    if op == "wgrad":
        return bwd_gm._wgrad_fp8_kernel
    tma = fwd_gm.FP8_TMA if cfg is None else cfg["form"] in ("tma", "tmar")
    return fwd_gm._grouped_rows_tma_kernel if tma else fwd_gm._grouped_rows_kernel


def _tuned_config(op: str) -> str:
    """The autotuner's pick after a default launch (``""`` on the heuristic path)."""
    tuner = bwd_gm._wgrad_tuned if op == "wgrad" else fwd_gm._rows_tuned
    best = getattr(tuner, "best_config", None)
    if best is None:
        return ""
    kw = dict(best.kwargs)
    tiles = (f"{kw.get('BM')}x{kw.get('BN')}" if "BM" in kw
             else f"{kw.get('BN')}x{kw.get('BK')}")
    return f"autotuned promote {tiles}/{best.num_warps}w/{best.num_stages}s"


# --------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------


def sweep_op(op, lname, gname, d, cands, device, clock, rows):
    base = dict(layout=lname, gemm=gname, op=op, E=d["layout"].num_experts,
                R=d["layout"].num_rows, N=d["w"].shape[1], K=d["w"].shape[2])
    bf = bf16_call(op, d)
    bf_us = None
    if bf is not None:
        try:
            if device == "cuda":
                bf()
            bf_us = bench_us(bf, device == "cuda", warmup=10, rep=60)
            rows.append(dict(base, provider="bf16", form="torch._grouped_mm", config="bf16",
                             us=bf_us, ok=True))
        except Exception as exc:  # e.g. no CPU kernel for torch._grouped_mm
            print(f"  bf16 {op}: {type(exc).__name__}: {exc}"[:200], flush=True)
    expect = reference(op, d)
    for cfg in [None, *cands]:
        name = cfg_name(cfg)
        row = dict(base, provider="fp8", form=cfg["form"] if cfg else "default", config=name,
                   tiles=None if cfg is None else {k: v for k, v in cfg.items() if k != "form"})
        if clock.over():
            rows.append(dict(row, skipped=f"time budget ({clock.budget_s:.0f} s) used up"))
            continue
        fn = fp8_call(op, d, cfg)
        key = (op == "wgrad", lname, name)
        try:
            out, secs, regs, spills = _run_first(fn, _kernel(op, cfg), key, device)
            err = rel_err(out, expect)
            del out
            # (the interpreter's timing is one wall-clock call: the first call's)
            us = bench_us(fn, True, warmup=10, rep=60) if device == "cuda" else secs * 1e6
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(dict(row, ok=False, error=msg))
            print(f"  {lname} {gname} {op} {name}: {msg}"[:200], flush=True)
            continue
        if cfg is None:
            row["config"] = _tuned_config(op) or "default (heuristic)"
        row.update(us=us, first_call_s=secs, rel_err=err, ok=bool(err <= TOL), n_regs=regs,
                   n_spills=spills, speedup_vs_bf16=(bf_us / us) if bf_us else None)
        rows.append(row)
        print(f"  {lname} {gname:7s} {op:5s} {row['config']:34s} {us:9.1f} us  err "
              f"{err:.3e}  regs {fmt(regs, 'd')} spills {fmt(spills, 'd')}  "
              f"first call {secs:.1f} s", flush=True)
    del expect


def precision_probe(d, lname, gname, device, clock) -> list[dict]:
    """fp32 outputs of the 128x128 tiles of both forms (fwd and wgrad): the accumulation
    error itself, which bf16 rounding (~1e-3) would hide."""
    if device != "cuda":
        return []
    out = []
    for op, cfg in PROBES:
        if clock.over():
            break
        expect = reference(op, d)
        res = fp8_call(op, d, cfg, out_dtype=torch.float32)()
        out.append(dict(layout=lname, gemm=gname, op=op, config=cfg_name(cfg),
                        rel_err_fp32_out=rel_err(res, expect)))
        del res, expect
    return out


def summary(rows: list[dict], probes: list[dict]) -> list[str]:
    lines = []
    if probes:
        lines.append("precision (fp32 outputs vs the dequantized reference):")
        for p in probes:
            lines.append(f"  {p['layout']} {p['gemm']:7s} {p['op']:5s} {p['config']:30s} "
                         f"rel err {p['rel_err_fp32_out']:.3e}")
    head = ["op", "layout", "gemm", "bf16 µs", "default µs", "default", "best µs", "best",
            "regs", "spills", "best/bf16", "default/bf16", "best err"]
    table = []
    keys = []
    for r in rows:
        k = (r["layout"], r["gemm"], r["op"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        rs = [r for r in rows if (r["layout"], r["gemm"], r["op"]) == k]
        bf = next((r["us"] for r in rs if r["provider"] == "bf16"), None)
        fp8 = [r for r in rs if r["provider"] == "fp8" and r.get("ok") and r.get("us")]
        default = next((r for r in fp8 if r["form"] == "default"), None)
        best = min(fp8, key=lambda r: r["us"], default=None)
        sp = lambda r, bf=bf: None if (r is None or not bf) else bf / r["us"]
        table.append([k[2], k[0], k[1], fmt(bf, ".1f"),
                      fmt(default and default["us"], ".1f"),
                      default["config"] if default else "-",
                      fmt(best and best["us"], ".1f"), best["config"] if best else "-",
                      fmt(best and best.get("n_regs"), "d"),
                      fmt(best and best.get("n_spills"), "d"),
                      fmt(sp(best), ".2f") + "x", fmt(sp(default), ".2f") + "x",
                      fmt(best and best.get("rel_err"), ".2e")])
    # wgrad rows last, so the most-watched numbers end the output.
    table.sort(key=lambda t: (OPS.index(t[0]), t[1], t[2]))
    widths = [max(len(str(c)) for c in col) for col in zip(head, *table)]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    lines.append(line(head))
    lines.append("-+-".join("-" * w for w in widths))
    lines += [line(t) for t in table]
    return lines


def run(args) -> int:
    device = args.device
    if device == "cpu" and not INTERPRET:
        print("--device cpu runs the kernels through the Triton interpreter: set "
              "TRITON_INTERPRET=1 before starting", file=sys.stderr)
        return 2
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for the interpreter smoke run)",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references
    cpu = device == "cpu"
    layouts = CPU_LAYOUT if cpu else {k: LAYOUTS[k] for k in args.layouts.split(",")}
    gemms = CPU_GEMMS if cpu else {k: GEMMS[k] for k in args.gemms.split(",")}
    ops = [o for o in args.ops.split(",") if o in OPS]
    rows_c, wgrad_c = (CPU_ROWS, CPU_WGRAD) if cpu else (ROWS_CANDIDATES, WGRAD_CANDIDATES)
    clock = Clock(args.budget_s)
    rows: list[dict] = []
    probes: list[dict] = []
    warm_s = 0.0
    if not cpu:
        warm_s = warm_up(_warm_tasks(layouts, gemms, ops, args.precision), args.jobs,
                         timeout_s=0.6 * args.budget_s)
    torch.manual_seed(0)
    for lname, lay in layouts.items():
        for gname, (N, K) in gemms.items():
            d = build_inputs(lay, N, K, device)
            print(f"layout {lname} (E={lay['E']}, align {lay['align']}, R="
                  f"{d['layout'].num_rows}), {gname} N={N} K={K}", flush=True)
            for op in ops:
                sweep_op(op, lname, gname, d, wgrad_c if op == "wgrad" else rows_c, device,
                         clock, rows)
            if args.precision and lname == "a" and gname == "gate_up":
                probes = precision_probe(d, lname, gname, device, clock)
            del d
            if device == "cuda":
                torch.cuda.empty_cache()
    facts = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.node(),
                 torch=torch.__version__, triton=triton.__version__,
                 elapsed_s=clock.elapsed(), budget_s=args.budget_s, warm_up_s=warm_s)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(facts, rows=rows, precision=probes), fh, indent=1)
    print(f"{facts['device']}, torch {facts['torch']}, triton {facts['triton']}: "
          f"{facts['elapsed_s']:.0f} s")
    print("\n".join(summary(rows, probes)))
    return 0


# --------------------------------------------------------------------------------------
# Offline: compile every candidate for sm_90 without a GPU, report registers and spills
# --------------------------------------------------------------------------------------

#: Pointer dtypes and the integer arguments that the real launches specialise as
#: multiples of 16 (the MoE shapes), per kernel.
_PTRS = {
    "_grouped_rows_kernel": dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16",
                                 as_ptr="*fp32", bs_ptr="*fp32", offsets_ptr="*i32"),
    "_wgrad_fp8_kernel": dict(g_ptr="*fp8e4nv", x_ptr="*fp8e4nv", w_ptr="*bf16",
                              gs_ptr="*fp32", xs_ptr="*fp32", offsets_ptr="*i32"),
    # descriptors: their block shapes are filled in per candidate
    "_grouped_rows_tma_kernel": dict(a_desc="tensordesc<fp8e4nv[{BM}, 128]>",
                                     b_desc="tensordesc<fp8e4nv[{BN}, 128]>",
                                     c_ptr="*bf16", as_ptr="*fp32", bs_ptr="*fp32",
                                     offsets_ptr="*i32"),
}
_DIV16 = {
    "_grouped_rows_tma_kernel": ("R", "I", "J", "E", "R_BUCKET", "b_row_e", "stride_cm",
                                 "stride_ask", "bs_se", "bs_sj"),
    "_grouped_rows_kernel": ("R", "I", "J", "E", "R_BUCKET", "stride_am", "stride_be",
                             "stride_bj", "stride_cm", "stride_ask", "bs_se", "bs_sj"),
    "_wgrad_fp8_kernel": ("N", "K", "R", "E", "stride_g", "stride_x", "stride_gs",
                          "stride_xs", "stride_we", "stride_wn"),
}


def _ptxas_usage(ptx: str) -> tuple[int | None, int | None]:
    """``(registers, spill store bytes)`` from ``ptxas -v`` (triton's bundled ptxas)."""
    import glob
    import re
    import subprocess
    import tempfile

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(ptx)
    try:
        for exe in sorted(glob.glob(os.path.join(bindir, "ptxas*")), reverse=True):
            r = subprocess.run([exe, "-arch=sm_90a", "-v", fh.name, "-o", os.devnull],
                               capture_output=True, text=True)
            regs = re.search(r"Used (\d+) registers", r.stderr)
            spill = re.search(r"(\d+) bytes spill stores", r.stderr)
            if r.returncode == 0 and regs:
                return int(regs[1]), int(spill[1]) if spill else 0
    finally:
        os.unlink(fh.name)
    return None, None


def ptxas_table(args) -> int:
    """Compile each candidate (and the other form of its tiles) for sm_90 and print
    registers / spill bytes / shared memory: which configs fit without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_one(kernel, consts, warps, stages):
        name = kernel.fn.__name__
        sig = {}
        for p in kernel.params:
            if p.is_constexpr:
                sig[p.name] = "constexpr"
            else:
                sig[p.name] = _PTRS[name].get(p.name, "i32").format(**consts)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
                 if sig[n].startswith("*") or n in _DIV16[name]}
        src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})

    lines = []
    seen = set()
    for cands, kernel in ((ROWS_CANDIDATES, fwd_gm._grouped_rows_kernel),
                          (WGRAD_CANDIDATES, bwd_gm._wgrad_fp8_kernel)):
        for c in cands:
            tma = c["form"] in ("tma", "tmar")
            for form in (c["form"],) if tma else ("promote", "rescale"):
                cc = dict(c, form=form)
                if (kernel, cfg_name(cc)) in seen:
                    continue
                seen.add((kernel, cfg_name(cc)))
                for lname in ("a", "b"):
                    E = LAYOUTS[lname]["E"]
                    ep2 = max(16, triton.next_power_of_2(E))
                    if kernel is bwd_gm._wgrad_fp8_kernel:
                        consts = dict(BN=c["BN"], BK=c["BK"], BR=128, SEG=True, EP2=ep2,
                                      ALIGN16=True, RESCALE=form == "rescale",
                                      VEC_MASK=c["VEC_MASK"])
                    elif tma:
                        consts = dict(BM=c["BM"], BN=c["BN"], BK=128,
                                      GROUP_M=c.get("GROUP_M", 8), EP2=ep2,
                                      RESCALE=form == "tmar")
                    else:
                        consts = dict(BM=c["BM"], BN=c["BN"], BK=128, GROUP_M=8, FP8=True,
                                      IEEE=False, B_KMAJOR=True, EP2=ep2,
                                      RESCALE=form == "rescale")
                    t = time.perf_counter()
                    k = compile_one(fwd_gm._grouped_rows_tma_kernel if tma
                                    else kernel, consts, c["num_warps"], c["num_stages"])
                    regs, spill = _ptxas_usage(k.asm["ptx"])
                    line = (f"{'wgrad' if 'BK' in c else 'rows '} {lname} "
                            f"{cfg_name(cc):32s} regs {fmt(regs, 'd', '?'):>3} spill "
                            f"{fmt(spill, 'd', '?'):>4} B  smem {k.metadata.shared // 1024:3d}"
                            f" KiB  wgmma {'wgmma' in k.asm['ptx']}  "
                            f"({time.perf_counter() - t:.1f} s)")
                    print(line, flush=True)
                    lines.append(line)
    return 0


# --------------------------------------------------------------------------------------
# Parallel compile warm-up (GPU): worker processes fill Triton's on-disk cache
# --------------------------------------------------------------------------------------

#: Tokens of the warm-up workers' layouts: the row counts keep the real ones'
#: divisibility by 16, so the workers compile exactly the binaries the sweep launches.
WARM_TOKENS = 512


def _autotune_extras(op: str) -> list[dict]:
    """The autotuner's configs (the ``default`` row tunes over them) that are not
    candidates already: compiled by the warm-up too. None for the rows kernel when its
    default launch takes the TMA kernel (fixed tiles, no autotuning)."""
    if op != "wgrad" and fwd_gm.FP8_TMA:
        return []
    if op == "wgrad":
        have, tuned = WGRAD_CANDIDATES, [_wg("promote", c.kwargs["BN"], c.kwargs["BK"],
                                             c.num_warps, c.num_stages)
                                         for c in bwd_gm._WGRAD_FP8_CONFIGS]
    else:
        have, tuned = ROWS_CANDIDATES, [_rows("promote", c.kwargs["BM"], c.kwargs["BN"],
                                              c.num_warps, c.num_stages)
                                        for c in fwd_gm._FP8_CONFIGS]
    return [c for c in tuned if c not in have]


def _warm_tasks(layouts, gemms, ops, precision) -> list[str]:
    """One task per distinct compile specialisation: the rows kernel's launches differ
    only in the forward of the down GEMM (a weight-scale stride of 8, not a multiple of
    16), the wgrad's not at all across the two GEMMs (checked with tests/compile_keys.py);
    the layouts differ in ``EP2``. A wrong guess here only costs compile time later."""
    tasks, seen = [], set()
    for lname in layouts:
        for gname in gemms:
            for op in ops:
                spec = ("wgrad" if op == "wgrad" else
                        "rows-down-fwd" if (gname, op) == ("down", "fwd") else "rows")
                if (lname, spec) not in seen:
                    seen.add((lname, spec))
                    tasks.append(f"{lname}:{gname}:{op}")
        if precision and lname == "a" and "gate_up" in gemms:
            tasks.append("a:gate_up:probe")
    return tasks


def warm_worker(task: str) -> int:
    """Compile (and run once, unchecked) every candidate of one task
    (``layout:gemm:op``, or ``layout:gemm:op:i/n``: every n-th candidate from the i-th)."""
    lname, gname, op, *part = task.split(":")
    i, n = map(int, part[0].split("/")) if part else (0, 1)
    N, K = GEMMS[gname]
    d = build_inputs(LAYOUTS[lname], N, K, "cuda", tokens=WARM_TOKENS)
    if op == "probe":
        jobs = [(o, c, torch.float32) for o, c in PROBES]
    else:
        cands = WGRAD_CANDIDATES if op == "wgrad" else ROWS_CANDIDATES
        jobs = [(op, c, torch.bfloat16) for c in cands + _autotune_extras(op)]
    for o, c, dt in jobs[i::n]:
        try:
            fp8_call(o, d, c, out_dtype=dt)()
        except Exception as exc:  # the sweep itself reports it
            print(f"warm-up {task} {cfg_name(c)}: {type(exc).__name__}: {exc}"[:300])
    torch.cuda.synchronize()
    return 0


def warm_up(tasks: list[str], jobs: int, timeout_s: float) -> float:
    """Run the warm-up tasks in ``jobs`` worker processes; returns the wall seconds."""
    import subprocess

    t0 = time.perf_counter()
    if jobs <= 0 or not tasks:
        return 0.0
    # fewer tasks than processes: split each task's candidates among the spare ones
    n = max(1, jobs // len(tasks))
    tasks = [t if n == 1 or t.endswith(":probe") else f"{t}:{i}/{n}"
             for t in tasks for i in range(1 if t.endswith(":probe") else n)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    pending, running = list(tasks), []
    while pending or running:
        while pending and len(running) < jobs:
            task = pending.pop(0)
            running.append((task, subprocess.Popen(
                [sys.executable, "-m", "benchmark.fp8_gemm_sweep", "--warm-worker", task],
                cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True)))
        time.sleep(0.5)
        for task, proc in list(running):
            over = time.perf_counter() - t0 > timeout_s
            if proc.poll() is None and not over:
                continue
            if proc.poll() is None:
                proc.kill()  # ours; the sweep compiles what is missing itself
            out = proc.communicate()[0] or ""
            if proc.returncode:
                print(f"warm-up {task}: exit {proc.returncode}\n{out[-1500:]}", flush=True)
            elif out.strip():
                print(out.strip()[-1500:], flush=True)
            running.remove((task, proc))
    secs = time.perf_counter() - t0
    print(f"compile warm-up: {len(tasks)} tasks in {jobs} processes, {secs:.0f} s", flush=True)
    return secs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.fp8_gemm_sweep",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write every row here as JSON")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"])
    p.add_argument("--layouts", default="a,b", help="comma-separated: a (E=32, align 128), "
                   "b (E=256, align 16)")
    p.add_argument("--gemms", default="gate_up,down")
    p.add_argument("--ops", default="fwd,dgrad,wgrad")
    p.add_argument("--budget-s", type=float, default=220.0,
                   help="start no new candidate after this many seconds")
    p.add_argument("--no-precision", dest="precision", action="store_false",
                   help="skip the fp32-output precision probe")
    p.add_argument("--ptxas", action="store_true",
                   help="offline: compile the candidates for sm_90 (no GPU needed) and "
                        "print registers and spills")
    p.add_argument("--jobs", type=int, default=7,
                   help="GPU: worker processes compiling the candidates first (0: none)")
    p.add_argument("--warm-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm_worker:
        return warm_worker(args.warm_worker)
    if args.ptxas:
        if INTERPRET:
            print("--ptxas compiles for sm_90: run it without TRITON_INTERPRET",
                  file=sys.stderr)
            return 2
        return ptxas_table(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
