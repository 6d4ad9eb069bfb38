"""Probe: the LM head's three GEMMs per ``linear_cross_entropy`` chunk in bf16 against the
blockwise FP8 GEMMs (``python -m benchmark.probe_fp8_lm_head [--json PATH] [--cpu]``).

One chunk of the e2e LM head: ``h [C, H]`` bf16 (C = 2048 rows, H = 2048), ``W [V, H]``
(V = 157184), ``dlogits [C, V]``. Rows (profiler kernel µs, L2 flushed):

- fprop ``logits = h · W^T``: bf16 ``torch.mm`` / FP8 (``h`` quantized 1x128, W's
  128x128 rowwise copy, as the weight cache holds it);
- dgrad ``dh = dlogits · W``: bf16 / FP8 (dlogits quantized 1x128 along V, W's
  columnwise copy);
- wgrad ``dW += dlogits^T · h``: bf16 ``addmm_`` / FP8 (both quantized along the chunk's
  tokens) into a float32 output plus the add into the bf16 gradient; and over all ``N``
  rows at once (``K = rows``: the micro-batch's weight gradient as one GEMM);
- the quantizations on their own; the loss kernels of one chunk (statistics only; the
  fused pass writing the 16-bit gradient and its rowwise FP8 copy; the FP8-only gradient
  pass writing both copies);
- ``linear_cross_entropy`` forward+backward over ``N`` rows (default chunk) in bf16 and
  under ``TrainingContext(fp8="blockwise", lm_head_fp8=True)`` (the weight's FP8 copy
  cached, as within an optimizer step; with the recipe's FP8 weight gradient, and with
  ``fp8_wgrad=False``), with the relative difference of (loss, |dh|, |dW|).

The relative error of each FP8 GEMM against the bf16 one is in the last column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __name__ == "__main__" and ("--cpu" in sys.argv or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402

from linghe.fp8 import gemm  # noqa: E402
from linghe.fp8.quantize import quantize_1x128_launch, quantize_128x128_launch  # noqa: E402
from linghe.testing import rel_err  # noqa: E402

from .harness import device_time_us, fmt, print_columns, wall_us  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8192, help="N of the linear_cross_entropy rows")
    ap.add_argument("--vocab", type=int, default=157184)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    dev = "cuda" if gpu else "cpu"
    C, H, V = (args.chunk, args.hidden, args.vocab) if gpu else (130, 256, 384)
    timer = device_time_us if gpu else wall_us
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(C, H, generator=g) * 0.5).to(dev, torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    d = (torch.randn(C, V, generator=g) * 1e-5).to(dev, torch.bfloat16)
    dw = torch.zeros(V, H, dtype=torch.bfloat16, device=dev)
    wq, ws, wqt, wst = quantize_128x128_launch(w, True, True)

    def q_rows(x):
        return quantize_1x128_launch(x, True, False, True, True)[:2]

    def q_cols(x):
        return quantize_1x128_launch(x, False, True, True, True)[2:]

    hq, hs = q_rows(h)
    dq, ds = q_rows(d)
    dqt, dst = q_cols(d)
    hqt, hst = q_cols(h)
    wst_rows = wst.repeat_interleave(128, 0)[:H].contiguous()
    vp = -(-V // 512) * 512
    dq_pad = torch.zeros(C, vp, dtype=dq.dtype, device=dev)
    dq_pad[:, :V] = dq
    ds_pad = torch.ones(vp // 128, C, dtype=torch.float32, device=dev).t()
    ds_pad[:, :ds.shape[1]] = ds
    wqt_pad = torch.zeros(H, vp, dtype=wqt.dtype, device=dev)
    wqt_pad[:, :V] = wqt
    wst_pad = torch.ones(wst.shape[0], vp // 128, dtype=torch.float32, device=dev)
    wst_pad[:, :wst.shape[1]] = wst
    bf = torch.bfloat16
    f32 = torch.float32
    Nk = args.rows if gpu else 256
    dn = (torch.randn(Nk, V, generator=g) * 1e-5).to(dev, torch.bfloat16)
    hn = (torch.randn(Nk, H, generator=g) * 0.5).to(dev, torch.bfloat16)
    dnqt, dnst = quantize_1x128_launch(dn, False, True, True, True)[2:]
    hnqt, hnst = quantize_1x128_launch(hn, False, True, True, True)[2:]
    paths = {
        "fprop bf16": (lambda: torch.mm(h, w.t()), None),
        "fprop fp8": (lambda: gemm._gemm(hq, hs, "1x128", wq, ws, "128x128", bf, None),
                      "fprop bf16"),
        "fprop fp8 + quant h": (lambda: gemm._gemm(*q_rows(h), "1x128", wq, ws, "128x128",
                                                   bf, None), "fprop bf16"),
        "dgrad bf16": (lambda: torch.mm(d, w), None),
        "dgrad fp8": (lambda: gemm._gemm(dq, ds, "1x128", wqt, wst, "128x128", bf, None),
                      "dgrad bf16"),
        "dgrad fp8 + quant dlogits": (lambda: gemm._gemm(*q_rows(d), "1x128", wqt, wst,
                                                         "128x128", bf, None), "dgrad bf16"),
        # cuBLAS takes 128x128 B scales only with K/128 a multiple of 4; two ways around
        # it at other vocabularies: 1x128 B scales (the block scale repeated per row) or K
        # zero-padded to a multiple of 512.
        "dgrad fp8 cuBLAS, 1x128 B scales": (
            lambda: gemm._gemm(dq, ds, "1x128", wqt, wst_rows, "1x128", bf, None, "torch"),
            "dgrad bf16"),
        "dgrad fp8 cuBLAS, K padded": (
            lambda: gemm._gemm(dq_pad, ds_pad, "1x128", wqt_pad, wst_pad, "128x128", bf,
                               None, "torch"), "dgrad bf16"),
        "wgrad bf16 (addmm_)": (lambda: dw.addmm_(d.t(), h), None),
        "wgrad bf16 (mm)": (lambda: torch.mm(d.t(), h), None),
        "wgrad fp8 -> bf16": (lambda: gemm._gemm(dqt, dst, "1x128", hqt, hst, "1x128", bf,
                                                 None), "wgrad bf16 (mm)"),
        "wgrad fp8 -> f32": (lambda: gemm._gemm(dqt, dst, "1x128", hqt, hst, "1x128", f32,
                                                None), "wgrad bf16 (mm)"),
        # the whole micro-batch's wgrad as one GEMM (K = rows): one output write
        "wgrad bf16 (mm), K = rows": (lambda: torch.mm(dn.t(), hn), None),
        "wgrad fp8 -> bf16, K = rows": (lambda: gemm._gemm(dnqt, dnst, "1x128", hnqt, hnst,
                                                           "1x128", bf, None),
                                        "wgrad bf16 (mm), K = rows"),
        "quant dlogits rows": (lambda: q_rows(d), None),
        "quant dlogits cols": (lambda: q_cols(d), None),
        "quant dlogits rows+cols": (lambda: quantize_1x128_launch(d, True, True, True, True),
                                    None),
        "quant W 128x128 both": (lambda: quantize_128x128_launch(w, True, True), None),
    }
    # the loss kernels of one chunk: the statistics pass alone, the fused pass that writes
    # the 16-bit gradient and its rowwise FP8 copy (FP8 head, 16-bit wgrad), and the
    # FP8-only gradient pass (both copies; FP8 wgrad), each on a fresh copy of the logits
    from linghe.fp8.quantize import empty_1x128
    from linghe.fwd.loss import ce_forward, ce_grad_fp8

    lg = (torch.randn(C, V, generator=g) * 2).to(dev, torch.bfloat16)
    lg_lab = torch.randint(0, V, (C,), generator=g).to(dev)
    ce_opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0)
    lg_lse = ce_forward(lg, lg_lab, **ce_opts)[1]
    one = torch.ones(1, dtype=torch.float32, device=dev)
    gq, gs = empty_1x128(C, V, dev, rowwise=True, columnwise=False, group_major=True)[:2]
    gqt, gst = empty_1x128(C, V, dev, rowwise=False, columnwise=True, group_major=True)[2:]
    lg_work = lg.clone()

    def fused_pass():
        lg_work.copy_(lg)  # (the fused pass overwrites its logits: the copy is timed too)
        return ce_forward(lg_work, lg_lab, **ce_opts, fuse_bwd=True, row_weight=one,
                          grad_fp8=(gq, gs, True))[0]

    def grad_fp8_pass(config=None):
        ce_grad_fp8(lg, lg_lab, lg_lse, one, **ce_opts, pow2_scale=True, rowwise=(gq, gs),
                    columnwise=(gqt, gst, 0), config=config)
        return gs  # (no conversion kernel in the timing)

    paths["loss stats pass"] = (lambda: ce_forward(lg, lg_lab, **ce_opts)[0], None)
    paths["copy logits chunk (bf16)"] = (lambda: lg_work.copy_(lg), None)
    paths["loss fused pass + rowwise fp8 (+ copy)"] = (fused_pass, None)
    paths["loss fp8 gradient pass, both copies"] = (grad_fp8_pass, None)
    # launch variants of the gradient pass (warps, register cap): bits equal to the default's
    variants = [dict(warps=w, maxnreg=r) for w, r in ((4, None), (4, 168), (4, 160),
                                                      (8, 128))]
    # (ROUND off: the fp32 gradient quantized, not its 16-bit rounding: other bits)
    variants += [dict(warps=4, maxnreg=r, round=False) for r in (None, 168)]

    def grad_bits(config=None):
        grad_fp8_pass(config)
        return [t.view(torch.uint8).clone() if t.dtype != torch.float32 else t.clone()
                for t in (gq, gs, gqt, gst)]

    want = grad_bits()
    for cfg in variants:
        same = all(torch.equal(a, b) for a, b in zip(grad_bits(cfg), want))
        if cfg.get("round") is False:  # (rounding apart: the same values within a step)
            same = "n/a"
        print(f"gradient pass {cfg}: bits equal to the default: {same}")
    del want
    for cfg in variants:
        paths["loss fp8 gradient pass, " + ", ".join(f"{k} {v}" for k, v in cfg.items())] = (
            lambda cfg=cfg: grad_fp8_pass(cfg), "loss fp8 gradient pass, both copies")
    import linghe

    N = args.rows if gpu else 200
    hl = (torch.randn(N, H, generator=g) * 0.5).to(dev, torch.bfloat16).requires_grad_(True)
    wl = w.clone().requires_grad_(True)
    lab = torch.randint(0, V, (N,), generator=g).to(dev)
    fp8_ctx = linghe.TrainingContext(fp8="blockwise", lm_head_fp8=True)
    fp8_ctx_hp_wgrad = linghe.TrainingContext(fp8="blockwise", lm_head_fp8=True,
                                              fp8_wgrad=False)

    def lce(fp8):
        hl.grad = wl.grad = None
        if fp8:
            with (fp8_ctx if fp8 == "fp8" else fp8_ctx_hp_wgrad):
                loss = linghe.linear_cross_entropy(hl, wl, lab)
        else:
            loss = linghe.linear_cross_entropy(hl, wl, lab)
        loss.backward()
        return torch.stack([loss.detach(), hl.grad.float().norm(), wl.grad.float().norm()])

    paths["linear_cross_entropy bf16"] = (lambda: lce(False), None)
    paths["linear_cross_entropy lm_head_fp8, bf16 wgrad"] = (lambda: lce("bf16 wgrad"),
                                                             "linear_cross_entropy bf16")
    paths["linear_cross_entropy lm_head_fp8"] = (lambda: lce("fp8"),
                                                 "linear_cross_entropy bf16")
    rows = []
    outs = {}
    for name, (fn, ref) in paths.items():
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - a backend this build lacks: say so
            print(name, "failed:", str(e).splitlines()[0][:200], flush=True)
            rows.append(dict(path=name, us=None, rel_err=None, error=str(e)[:500]))
            continue
        if isinstance(out, torch.Tensor) and not name.startswith("wgrad bf16 (addmm"):
            outs[name] = out.float()
        err = rel_err(outs[name], outs[ref]) if ref else None
        us = timer(fn)
        rows.append(dict(path=name, us=us, rel_err=err))
        print(name, us, err, flush=True)
    print("probed cuBLAS backends:", gemm.probed_backends())
    env = {"device": torch.cuda.get_device_name() if gpu else "cpu",
           "torch": torch.__version__, "triton": triton.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"C": C, "H": H, "V": V, "rows": rows, "env": env}, f, indent=1)
    flop = 2 * C * H * V
    print(f"\nLM head GEMMs per chunk, h [{C}, {H}], W [{V}, {H}] "
          f"({'kernel' if gpu else 'interpreter wall'} us; {env['device']})")
    def tflops(r):
        if not r["us"] or r["path"].startswith(("quant", "loss", "copy")):
            return None
        if r["path"].startswith("linear"):
            return 3 * flop * N / C / r["us"] / 1e6
        return (flop * Nk / C if r["path"].endswith("K = rows") else flop) / r["us"] / 1e6

    print_columns(["path", "us", "TFLOP/s", "rel err vs bf16"],
                  [[r["path"], fmt(r["us"], ".0f"), fmt(tflops(r), ".0f"),
                    fmt(r["rel_err"], ".1e")] for r in rows])


if __name__ == "__main__":
    main()
