"""Probe of the FP8 SwiGLU kernels at the FP8 MoE shape, for every launch knob:
``python -m benchmark.probe_activation --out PATH.json [--device cpu] [--quick]``.

What it times (``triton.testing.do_bench`` median; kernel µs from ``torch.profiler``),
on inputs built like the end-to-end FP8 step (``benchmark/e2e.py``): ``T * topk = 65536``
routed rows with random expert ids over ``E`` experts, segments padded to 16, the
buffer's static bound ``R = max_grouped_rows`` of rows, zero padding/tail rows,
``x = h [R, 2048]`` bf16, ``dy [R, 1024]`` bf16, ``probs [R]`` fp32, pow2 scales:

- ``bwd E256`` / ``bwd E32``: :func:`linghe.bwd.activation.silu_mul_bwd_quant`, batch form
  (``counts``, columnwise, dprobs), as ``_GroupedSwiGLUFp8.backward`` calls it;
- ``bwd dense``: the same kernel's non-batch form at the same ``R``;
- ``fwd E256`` / ``fwd E32``: :func:`linghe.fwd.activation.batch_silu_mul_quant_fwd`;
- ``... legacy``: the kernels as they were before the 16-row alignment fix and the
  one-scan ``expert_tile`` (copied below, launched as their launchers did), for a
  before/after on the same device.

Knobs (module constants of :mod:`linghe.fwd.activation`, read at each call):
``QUANT_BWD_NUM_WARPS`` x ``QUANT_BWD_COLS`` for the backward, ``BATCH_QUANT_NUM_WARPS``
x ``BATCH_QUANT_COLS`` for the batch forward (``*_COLS``: 128-column blocks per program).
Every row is checked against :mod:`linghe.reference` in the same run (dequantized
rowwise and per-segment columnwise copies within e4m3 precision of the fp32 reference,
dprobs, zeros on padding rows) and compared bit for bit with the default knobs' output.
GB/s counts the fewest bytes (real rows read once, every output written once); % copy is
against a measured device-to-device copy. The table is printed last; ``--out`` gets JSON.

``--device cpu`` runs tiny shapes (8 and 3 experts, 256 routed rows, ``n = 256``; with
``--quick`` 8 experts only) through the Triton interpreter: a smoke test of this script,
not a measurement. A GPU run takes about 1-2 minutes (34 kernel variants compile).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import torch


def _argv_device(argv) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--device="):
            return a.split("=", 1)[1]
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
    return None


if __name__ == "__main__" and (not torch.cuda.is_available()
                               or _argv_device(sys.argv[1:]) == "cpu"):
    # The interpreter is chosen when a kernel is decorated: before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from linghe.fp8.quantize import quant_cols, quant_rows  # noqa: E402
from linghe.fwd.activation import silu_f32  # noqa: E402
from linghe.utils import INTERPRET  # noqa: E402

# knob grids: (num_warps, column blocks per program)
_BWD_KNOBS = [(8, 1), (8, 2), (8, 4), (16, 1), (16, 2), (16, 4)]
_FWD_KNOBS = [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]
_BWD_KNOBS_QUICK = [(8, 1), (16, 1), (8, 4)]
_FWD_KNOBS_QUICK = [(4, 1), (8, 1), (4, 4)]
_CPU_KNOBS = [(4, 1), (4, 2)]  # the interpreter ignores warps; cols 2 runs the loop

# checks: dequantized copies vs the fp32 reference (e4m3 keeps ~2^-4 relative precision)
_DEQ_TOL = 0.05
_DP_TOL = 1e-3


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_activation",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when present, else cpu (the Triton interpreter)")
    p.add_argument("--quick", action="store_true", help="fewer knob values, no legacy rows "
                   "for 32 experts, no profiler kernel times")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if (device == "cpu") != INTERPRET:
        print(f"--device {device} needs TRITON_INTERPRET={int(device == 'cpu')} before "
              "triton is imported: run it as its own process (python -m "
              "benchmark.probe_activation ...)", file=sys.stderr)
        return 2
    probe = _Probe(device, args.quick)
    rows = probe.run()
    probe.print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(probe.report(rows), f, indent=1)
        print(f"wrote {args.out}", file=sys.stderr)
    bad = [r for r in rows if not r.get("ok")]
    if bad:
        print(f"{len(bad)} row(s) failed: " + ", ".join(r["name"] for r in bad),
              file=sys.stderr)
    return 1 if bad else 0


# ------------------------------------------------------------------------- inputs
def _inputs(E: int, routed: int, n: int, device: str, seed: int):
    """Rows grouped by expert as the FP8 MoE step holds them (see the module docstring)."""
    from linghe.layout import make_expert_layout, max_grouped_rows

    align, topk = 16, 8
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(E, (routed,), generator=g), minlength=E)
    R = max_grouped_rows(routed // topk, topk, E, align)
    padded = (counts + align - 1) // align * align
    real = torch.zeros(R, dtype=torch.bool)
    start = 0
    for c, p in zip(counts.tolist(), padded.tolist()):
        real[start:start + c] = True
        start += p
    gd = torch.Generator(device=device).manual_seed(seed)  # (large tensors: on the device)
    real = real.to(device)
    x = torch.randn(R, 2 * n, generator=gd, device=device).to(torch.bfloat16)
    dy = torch.randn(R, n, generator=gd, device=device).to(torch.bfloat16)
    probs = torch.rand(R, generator=gd, device=device)
    x[~real], dy[~real], probs[~real] = 0, 0, 0  # the layout contract: zero padding rows
    cnt = counts.to(device, torch.int32)
    layout = make_expert_layout(cnt, align, R)
    return dict(E=E, R=R, n=n, align=align, routed=routed, counts=cnt,
                counts_host=counts, offsets=layout.offsets, real=real, x=x, dy=dy,
                probs=probs)


# ------------------------------------------------------------------------- the probe
class _Probe:
    def __init__(self, device: str, quick: bool):
        import linghe.fwd.activation as A

        self.A, self.device, self.quick = A, device, quick
        self.cpu = device == "cpu"
        if self.cpu:
            self.routed, self.n, self.experts = 256, 256, (8,) if quick else (8, 3)
            self.bwd_knobs = self.fwd_knobs = _CPU_KNOBS
        else:
            self.routed, self.n, self.experts = 65536, 1024, (256, 32)
            self.bwd_knobs = _BWD_KNOBS_QUICK if quick else _BWD_KNOBS
            self.fwd_knobs = _FWD_KNOBS_QUICK if quick else _FWD_KNOBS
        self.defaults = {k: getattr(A, k) for k in (
            "QUANT_BWD_NUM_WARPS", "QUANT_BWD_COLS", "BATCH_QUANT_NUM_WARPS",
            "BATCH_QUANT_COLS")}
        self.copy_gbps = None

    # -- knobs
    @contextlib.contextmanager
    def _knobs(self, **kv):
        old = {k: getattr(self.A, k) for k in kv}
        for k, v in kv.items():
            setattr(self.A, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(self.A, k, v)

    # -- timing
    def _sync(self):
        if not self.cpu:
            torch.cuda.synchronize()

    def _time_us(self, fn) -> float:
        if not self.cpu:
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def _kernel_us(self, fn, name: str, reps: int = 5) -> float | None:
        """Device time per call of the kernels whose name contains ``name``."""
        if self.cpu or self.quick:
            return None
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    fn()
                torch.cuda.synchronize()
            tot = sum(e.self_device_time_total for e in prof.key_averages()
                      if name in e.key)
            return tot / reps if tot else None
        except Exception:  # the profiler is optional here
            return None

    def _copy_bandwidth(self) -> float:
        nbytes = (1 << 30) if not self.cpu else (1 << 22)
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_()
        dst = torch.empty_like(src)
        us = self._time_us(lambda: dst.copy_(src))
        return 2 * nbytes / us / 1e3

    # -- bytes
    @staticmethod
    def _cdiv(a, b):
        return -(-a // b)

    def _bytes(self, kind: str, inp) -> int:
        R, n, E, real = inp["R"], inp["n"], inp["E"], inp["routed"]
        cd = self._cdiv
        if kind == "bwd_dense":
            K = 2 * n
            return (R * K * 2 + R * n * 2 + R * 4 + 2 * R * K + 4 * R * cd(K, 128)
                    + 4 * K * cd(R, 128) + 4 * R)
        G = cd(R, 128) + E
        if kind == "bwd":
            K = 2 * n
            return (real * K * 2 + real * n * 2 + real * 4 + 2 * R * K + 4 * R * cd(K, 128)
                    + 4 * K * G + 4 * R)
        return real * 2 * n * 2 + real * 4 + 2 * R * n + 4 * R * cd(n, 128) + 4 * n * G \
            + 8 * (E + 1)

    # -- references (fp32 on the device; padding rows are zeros in the inputs)
    def _ref_bwd(self, inp):
        from linghe import reference as ref

        x = inp["x"].float().requires_grad_()
        p = inp["probs"].float().requires_grad_()
        dx, dp = torch.autograd.grad(ref.silu_mul(x, p), [x, p], inp["dy"].float())
        return dx, dp

    def _ref_fwd(self, inp):
        from linghe import reference as ref

        y = ref.silu_mul(inp["x"].float(), inp["probs"].float())
        segs = ref.expert_segments(inp["counts_host"], inp["align"])
        g_off = [0]
        for _, _, padded in segs:
            g_off.append(g_off[-1] + self._cdiv(padded, 128))
        return y, torch.tensor(g_off, dtype=torch.int32)

    def _check_quant(self, q, s, qt, st, want, inp, segmented: bool) -> dict:
        from linghe import reference as ref
        from linghe.testing import rel_err

        real = inp["real"]
        row = ref.dequantize_1x128(q, s)
        if segmented:
            col = ref.dequantize_segment_columnwise(qt, st, inp["offsets"])
        else:
            col = ref.dequantize_1x128(qt, st)
        out = {"rowwise_rel_err": rel_err(row, want), "colwise_rel_err": rel_err(col, want.t())}
        out["padding_zero"] = bool((q[~real].float() == 0).all()
                                   and (qt[:, ~real].float() == 0).all())
        out["ok"] = (out["rowwise_rel_err"] <= _DEQ_TOL and out["colwise_rel_err"] <= _DEQ_TOL
                     and out["padding_zero"])
        return out

    # -- one row
    def _row(self, name, op, E, knobs, fn, check, nbytes, kernel_name, same_as=None):
        row = {"name": name, "op": op, "E": E, "knobs": knobs, "us": None, "kernel_us": None,
               "gbps": None, "pct_copy": None, "ok": False, "error": None}
        try:
            t0 = time.perf_counter()
            out = fn()
            self._sync()
            first_us = (time.perf_counter() - t0) * 1e6  # on CPU: the timing (interpreter)
            row.update(check(out))
            if same_as is not None:
                row["same_as_default"] = all(
                    torch.equal(a, b) for a, b in zip(_flat(out), _flat(same_as)))
            row["us"] = first_us if self.cpu else self._time_us(fn)
            row["kernel_us"] = self._kernel_us(fn, kernel_name)
            t = row["kernel_us"] or row["us"]
            row["gbps"] = nbytes / t / 1e3
            row["pct_copy"] = 100 * row["gbps"] / self.copy_gbps
            row["bytes"] = nbytes
        except Exception as e:  # one failing row must not stop the probe
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            row["ok"] = False
            out = None
        print(f"  {name:<34} {str(knobs):<28} {_f(row['us'], '.1f'):>9} µs "
              f"{'ok' if row['ok'] else 'FAIL ' + str(row.get('error') or '')}",
              file=sys.stderr, flush=True)
        return row, out

    def run(self) -> list[dict]:
        from linghe.bwd.activation import silu_mul_bwd_quant
        from linghe.fwd.activation import batch_silu_mul_quant_fwd

        dev_name = torch.cuda.get_device_name() if not self.cpu else (
            platform.processor() or "cpu") + " (Triton interpreter)"
        self.copy_gbps = self._copy_bandwidth()
        print(f"device: {dev_name}; copy {self.copy_gbps:.0f} GB/s; torch {torch.__version__}"
              f", triton {triton.__version__}", file=sys.stderr, flush=True)
        self.dev_name = dev_name
        rows = []
        for i, E in enumerate(self.experts):
            inp = _inputs(E, self.routed, self.n, self.device, seed=i)
            tag = f"E{E}"
            x, dy, p, c, al = inp["x"], inp["dy"], inp["probs"], inp["counts"], inp["align"]
            dx_ref, dp_ref = self._ref_bwd(inp)
            y_ref, g_ref = self._ref_fwd(inp)
            real = inp["real"]

            def check_bwd(out, segmented=True, dx_ref=dx_ref, dp_ref=dp_ref, inp=inp,
                          real=real):
                from linghe.testing import rel_err

                dxq, dp = out
                r = self._check_quant(dxq.rowwise_data, dxq.rowwise_scale,
                                      dxq.columnwise_data, dxq.columnwise_scale, dx_ref, inp,
                                      segmented)
                r["dprobs_rel_err"] = rel_err(dp, dp_ref)
                r["ok"] = r["ok"] and r["dprobs_rel_err"] <= _DP_TOL and (
                    not segmented or bool((dp[~real] == 0).all()))
                return r

            def check_fwd(out, y_ref=y_ref, g_ref=g_ref, inp=inp):
                q, s, qt, st, g_off, _seg = out
                r = self._check_quant(q, s, qt, st, y_ref, inp, True)
                r["g_off_exact"] = bool(torch.equal(g_off.cpu(), g_ref))
                r["ok"] = r["ok"] and r["g_off_exact"]
                return r

            # backward, batch form
            nb = self._bytes("bwd", inp)
            base = None
            for w, cols in self.bwd_knobs:
                with self._knobs(QUANT_BWD_NUM_WARPS=w, QUANT_BWD_COLS=cols):
                    def fn(x=x, dy=dy, p=p, c=c, al=al, off=inp["offsets"]):
                        return silu_mul_bwd_quant(dy, x, p, columnwise=True, pow2_scale=True,
                                                  need_dprobs=True, counts=c, align=al,
                                                  segments=off)
                    row, out = self._row(f"bwd {tag}", "bwd", E, {"warps": w, "cols": cols},
                                         fn, check_bwd, nb, "_silu_mul_bwd_quant", base)
                rows.append(row)
                if base is None:
                    base = out
            del base
            if not (self.quick and i > 0):
                row, _ = self._row(f"bwd {tag} legacy", "bwd", E, {"legacy": True},
                                   lambda x=x, dy=dy, p=p, c=c, al=al, off=inp["offsets"]:
                                   _legacy_bwd(dy, x, p, c, al, off),
                                   check_bwd, nb, "_legacy_bwd_quant_kernel")
                rows.append(row)
            # backward, non-batch form at the same R (first input set only)
            if i == 0:
                nbd = self._bytes("bwd_dense", inp)
                base = None
                for w, cols in self.bwd_knobs:
                    with self._knobs(QUANT_BWD_NUM_WARPS=w, QUANT_BWD_COLS=cols):
                        def fn(x=x, dy=dy, p=p):
                            return silu_mul_bwd_quant(dy, x, p, columnwise=True,
                                                      pow2_scale=True, need_dprobs=True)
                        row, out = self._row(
                            "bwd dense", "bwd_dense", 0, {"warps": w, "cols": cols}, fn,
                            lambda o: check_bwd(o, segmented=False), nbd,
                            "_silu_mul_bwd_quant", base)
                    rows.append(row)
                    if base is None:
                        base = out
                del base
            # forward, batch form
            nf = self._bytes("fwd", inp)
            base = None
            for w, cols in self.fwd_knobs:
                with self._knobs(BATCH_QUANT_NUM_WARPS=w, BATCH_QUANT_COLS=cols):
                    def fn(x=x, p=p, c=c, al=al):
                        return batch_silu_mul_quant_fwd(x, p, c, al, columnwise=True,
                                                        pow2_scale=True)
                    row, out = self._row(f"fwd {tag}", "fwd", E, {"warps": w, "cols": cols},
                                         fn, check_fwd, nf, "_silu_mul_quant_fwd", base)
                rows.append(row)
                if base is None:
                    base = out
            del base
            if not (self.quick and i > 0):
                row, _ = self._row(f"fwd {tag} legacy", "fwd", E, {"legacy": True},
                                   lambda x=x, p=p, c=c, al=al: _legacy_fwd(x, p, c, al),
                                   check_fwd, nf, "_legacy_fwd_quant_kernel")
                rows.append(row)
            del inp, dx_ref, dp_ref, y_ref
            if not self.cpu:
                torch.cuda.empty_cache()
        return rows

    # -- output
    def report(self, rows) -> dict:
        best = {}
        for r in rows:
            if r["ok"] and r["us"] is not None and not r["knobs"].get("legacy"):
                t = r["kernel_us"] or r["us"]
                b = best.get(r["name"])
                if b is None or t < b["time_us"]:
                    best[r["name"]] = {"knobs": r["knobs"], "time_us": t}
        return {"device": self.dev_name, "torch": torch.__version__,
                "triton": triton.__version__, "interpreter": self.cpu,
                "copy_gbps": self.copy_gbps, "defaults": self.defaults,
                "shape": {"routed_rows": self.routed, "n": self.n, "experts": self.experts,
                          "align": 16},
                "best": best, "rows": rows}

    def print_table(self, rows) -> None:
        legacy = {r["name"][: -len(" legacy")]: (r["kernel_us"] or r["us"])
                  for r in rows if r["knobs"].get("legacy") and r["us"]}
        head = ["case", "knobs", "µs", "kernel µs", "GB/s", "% copy", "vs legacy", "same",
                "check"]
        lines = []
        for r in rows:
            kn = "legacy" if r["knobs"].get("legacy") else \
                f"w{r['knobs']['warps']} c{r['knobs']['cols']}"
            t = r["kernel_us"] or r["us"]
            base = legacy.get(r["name"])
            vs = f"{base / t:.2f}x" if base and t and not r["knobs"].get("legacy") else "-"
            same = {True: "=", False: "DIFF", None: ""}[r.get("same_as_default")]
            chk = "ok" if r["ok"] else ("error: " + r["error"][:50] if r["error"] else "FAIL")
            if r["ok"]:
                chk += f" (deq {max(r['rowwise_rel_err'], r['colwise_rel_err']):.1e})"
            lines.append([r["name"], kn, _f(r["us"], ".1f"), _f(r["kernel_us"], ".1f"),
                          _f(r["gbps"], ".0f"), _f(r["pct_copy"], ".0f"), vs, same, chk])
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        print(f"{self.dev_name}; copy {self.copy_gbps:.0f} GB/s; torch {torch.__version__}, "
              f"triton {triton.__version__}; GB/s and % copy from kernel µs when "
              "measured")
        print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
        print("-+-".join("-" * w for w in widths))
        for line in lines:
            print(" | ".join(str(c).ljust(w) for c, w in zip(line, widths)))


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def _flat(out):
    from linghe.fp8 import Fp8Tensor

    res = []
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, Fp8Tensor):
            res += [t for t in (o.rowwise_data, o.rowwise_scale, o.columnwise_data,
                                o.columnwise_scale) if t is not None]
        elif isinstance(o, torch.Tensor):
            res.append(o)
    return res


# ------------------------------------------------------------------------- legacy kernels
# The batch-form kernels as they were before the fix (git history: linghe/fwd/activation.py
# and linghe/bwd/activation.py), launched as their launchers did. triton 3.6 compiles
# their transposed fp8 stores as single bytes (tl.multiple_of is lost, seg_stop's
# alignment unknown); their expert_tile takes two scans and seven reductions.


@triton.jit
def _legacy_expert_tile(cnt_ptr, E, R, t, ALIGN, EP2: tl.constexpr):
    idx = tl.arange(0, EP2)
    emask = idx < E
    c = tl.load(cnt_ptr + idx, mask=emask, other=0).to(tl.int32)
    c = tl.maximum(c, 0)
    padded = (c + ALIGN - 1) // ALIGN * ALIGN
    ntile = (padded + 127) // 128
    seg_end = tl.cumsum(padded, 0)
    g_end = tl.cumsum(ntile, 0)
    used = tl.sum(padded, 0)
    g_used = tl.sum(ntile, 0)
    e = tl.sum(((g_end <= t) & emask).to(tl.int32), 0)
    sel = idx == e
    seg_start = tl.sum(tl.where(sel, seg_end - padded, 0), 0)
    g_start = tl.sum(tl.where(sel, g_end - ntile, 0), 0)
    cnt_e = tl.sum(tl.where(sel, c, 0), 0)
    pad_e = tl.sum(tl.where(sel, padded, 0), 0)
    is_tail = e >= E
    tile_start = tl.where(is_tail, used + (t - g_used) * 128,
                          seg_start + (t - g_start) * 128)
    real_end = tl.where(is_tail, 0, seg_start + cnt_e)
    seg_stop = tl.where(is_tail, R, seg_start + pad_e)
    return (tile_start, real_end, seg_stop, g_end - ntile, g_used, idx, seg_end - padded,
            used)

@triton.jit
def _legacy_bwd_quant_kernel(dy_ptr, x_ptr, p_ptr, cnt_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
                             dpp_ptr, M, N, E, stride_dy, stride_x, NPROG_N, ALIGN, NG,
                             POW2: tl.constexpr, EP2: tl.constexpr):
    # the batch form, SPLIT (N % 128 == 0), COLWISE, HAS_P, NEED_DP, ALIGN16
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    K = 2 * N
    GK = tl.cdiv(K, 128)
    tile_start, real_end, seg_stop, _g, _gu, _i, _so, _u = _legacy_expert_tile(
        cnt_ptr, E, M, pid_m, ALIGN, EP2)
    tile_start = tl.multiple_of(tile_start, 16)
    rows = tile_start.to(tl.int64) + tl.arange(0, 128)
    wmask = (rows < seg_stop) & (rows < M)
    rmask = (rows < real_end) & wmask
    p = tl.load(p_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    NB = N // 128
    gate = (tl.zeros([128], tl.int32) + pid_n) < NB
    j = (pid_n % NB) * 128 + tl.arange(0, 128)
    c = pid_n * 128 + tl.arange(0, 128)
    m = rmask[:, None] & (j < N)[None, :]
    xp = x_ptr + rows[:, None] * stride_x + j[None, :]
    g = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    u = tl.load(xp + N, mask=m & gate[None, :], other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + j[None, :], mask=m,
                 other=0.0).to(tl.float32)
    silu, sig = silu_f32(g)
    dyh = dy * silu * u
    dy = dy * p[:, None]
    dx = tl.where(gate[None, :], dy * u * (sig * (1.0 + g * (1.0 - sig))), dy * silu)
    qx, sx = quant_rows(dx, POW2)
    wm = wmask[:, None] & (j < N)[None, :]
    tl.store(q_ptr + rows[:, None] * K + c[None, :], qx, mask=wm)
    tl.store(s_ptr + rows * GK + pid_n, sx, mask=wmask)
    qxt, sxt = quant_cols(dx, POW2)
    tl.store(qt_ptr + c.to(tl.int64)[None, :] * M + rows[:, None], qxt, mask=wm)
    tl.store(st_ptr + c.to(tl.int64) * NG + pid_m, sxt)
    tl.store(dpp_ptr + rows * NPROG_N + pid_n, tl.sum(dyh, 1), mask=wmask & gate)

@triton.jit
def _legacy_fwd_quant_kernel(x_ptr, p_ptr, cnt_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
                             goff_ptr, M, N, E, stride_x, ALIGN, NG, POW2: tl.constexpr,
                             EP2: tl.constexpr):
    # the batch form, BM 128, COLWISE, HAS_P, ALIGN16
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    tile_start, real_end, seg_stop, g_off, g_used, eidx, seg_off, used = \
        _legacy_expert_tile(cnt_ptr, E, M, pid_m, ALIGN, EP2)
    first = (eidx * 0 + pid_m + pid_n) == 0
    tl.store(goff_ptr + eidx, tl.where(eidx < E, g_off, g_used),
             mask=(eidx <= E) & first)
    tl.store(goff_ptr + E + 1 + eidx, tl.where(eidx < E, seg_off, used),
             mask=(eidx <= E) & first)
    tile_start = tl.multiple_of(tile_start, 16)
    rows = tile_start.to(tl.int64) + tl.arange(0, 128)
    smask = (rows < seg_stop) & (rows < M)
    lmask = (rows < real_end) & smask
    cols = pid_n * 128 + tl.arange(0, 128)
    cmask = cols < N
    mask = lmask[:, None] & cmask[None, :]
    xp = x_ptr + rows[:, None] * stride_x + cols[None, :]
    g = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(xp + N, mask=mask, other=0.0).to(tl.float32)
    silu, _ = silu_f32(g)
    y = silu * u
    p = tl.load(p_ptr + rows, mask=lmask, other=0.0).to(tl.float32)
    y = y * p[:, None]
    q, s = quant_rows(y, POW2)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q,
             mask=smask[:, None] & cmask[None, :])
    nvalid = (tl.zeros([128], tl.int32) + pid_n * 128) < N
    tl.store(s_ptr + rows * tl.cdiv(N, 128) + pid_n, s, mask=smask & nvalid)
    qt, st = quant_cols(y, POW2)
    tl.store(qt_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], qt,
             mask=smask[:, None] & cmask[None, :])
    tl.store(st_ptr + cols.to(tl.int64) * NG + pid_m, st, mask=cmask)


def _legacy_bwd(dy, x, probs, counts, align, segments):
    """The old launcher of the batch quantized-dx backward (N % 128 == 0, align % 16 == 0,
    columnwise, pow2 scales, dprobs)."""
    from linghe.fp8.quantize import FP8_DTYPE
    from linghe.fp8.tensor import Fp8Tensor
    from linghe.fwd.activation import QUANT_BWD_NUM_WARPS, batch_col_groups
    from linghe.utils import cdiv, launch, next_power_of_2

    M, N = x.shape[0], x.shape[1] // 2
    assert N % 128 == 0 and align % 16 == 0
    K, E, dev = 2 * N, counts.numel(), x.device
    NG = batch_col_groups(M, E)
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=dev)
    s = torch.empty(M, cdiv(K, 128), dtype=torch.float32, device=dev)
    qt = torch.empty(K, M, dtype=FP8_DTYPE, device=dev)
    st = torch.empty(K, NG, dtype=torch.float32, device=dev)
    part = torch.empty(M, N // 128, dtype=torch.float32, device=dev)
    launch(_legacy_bwd_quant_kernel, (NG, cdiv(K, 128)), dy, x, probs, counts, q, s, qt, st,
           part, M, N, E, dy.stride(0), x.stride(0), N // 128, align, NG, POW2=True,
           EP2=next_power_of_2(E + 1), num_warps=QUANT_BWD_NUM_WARPS)
    dp = part.sum(1).to(probs.dtype)
    return Fp8Tensor((M, K), x.dtype, rowwise_data=q, rowwise_scale=s, columnwise_data=qt,
                     columnwise_scale=st, scaling="1x128", col_segments=segments), dp


def _legacy_fwd(x, probs, counts, align):
    """The old launcher of the batch forward (columnwise, pow2 scales, 4 warps)."""
    from linghe.fp8.quantize import FP8_DTYPE
    from linghe.fwd.activation import batch_col_groups
    from linghe.utils import cdiv, launch, next_power_of_2

    R, N = x.shape[0], x.shape[1] // 2
    assert align % 16 == 0
    E, dev = counts.numel(), x.device
    G = batch_col_groups(R, E)
    q = torch.empty(R, N, dtype=FP8_DTYPE, device=dev)
    s = torch.empty(R, cdiv(N, 128), dtype=torch.float32, device=dev)
    qt = torch.empty(N, R, dtype=FP8_DTYPE, device=dev)
    st = torch.empty(N, G, dtype=torch.float32, device=dev)
    offs = torch.empty(2, E + 1, dtype=torch.int32, device=dev)
    launch(_legacy_fwd_quant_kernel, (G, max(cdiv(N, 128), 1)), x, probs, counts, q, s, qt,
           st, offs[0], R, N, E, x.stride(0), align, G, POW2=True,
           EP2=next_power_of_2(E + 1), num_warps=4)
    return q, s, qt, st, offs[0], offs[1]


if __name__ == "__main__":
    sys.exit(main())
