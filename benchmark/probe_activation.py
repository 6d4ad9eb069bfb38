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

(The kernels before the 16-row alignment fix were timed beside these once, on an H100:
``benchmark/results/h100_probe_activation_2026-11-25.*``, rows ``legacy``.)

Knobs (module constants of :mod:`linghe.fwd.activation`, read at each call):
``QUANT_BWD_MODE`` for the batch backward (row ``2k``: ``"two_kernel"``, dx in bf16,
then the grouped quantizer, the default; not compared bit for bit: rounding dx to bf16
first moves rare elements by one e4m3 step), ``QUANT_BWD_NUM_WARPS`` x
``QUANT_BWD_COLS`` for the fused backward (batch and non-batch forms),
``BATCH_QUANT_NUM_WARPS`` x ``BATCH_QUANT_COLS`` for the batch forward (``*_COLS``:
128-column blocks per program).
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

from benchmark.cases.activation import moe_grouped_inputs  # noqa: E402
from linghe.utils import INTERPRET  # noqa: E402

from .harness import fmt  # noqa: E402

# knob grids: (num_warps, column blocks per program); the batch backward runs fused with
# each, and once as two kernels (QUANT_BWD_MODE="two_kernel", the row "2k")
_BWD_KNOBS = [(16, 1), (8, 1), (8, 4), (16, 4)]
_FWD_KNOBS = [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]
_BWD_KNOBS_QUICK = [(16, 1), (8, 1), (8, 4)]
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
    p.add_argument("--quick", action="store_true", help="fewer knob values, no profiler "
                   "kernel times")
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
            "QUANT_BWD_NUM_WARPS", "QUANT_BWD_COLS", "QUANT_BWD_MODE",
            "BATCH_QUANT_NUM_WARPS", "BATCH_QUANT_COLS")}
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

    def _kernel_us(self, fn, name, reps: int = 5) -> float | None:
        """Device time per call of the kernels whose name contains ``name`` (a string or
        a tuple of them)."""
        names = (name,) if isinstance(name, str) else name
        if self.cpu or self.quick:
            return None
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    fn()
                torch.cuda.synchronize()
            tot = sum(e.self_device_time_total for e in prof.key_averages()
                      if any(n in e.key for n in names))
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
        print(f"  {name:<34} {str(knobs):<28} {fmt(row['us'], '.1f'):>9} µs "
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
            inp = moe_grouped_inputs(E, self.routed, self.n, self.device, seed=i)
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
            # fused rows are compared bit for bit with the first fused one; the two-kernel
            # row (last) with nothing
            bwd_knobs = [dict(QUANT_BWD_MODE="fused", QUANT_BWD_NUM_WARPS=w,
                              QUANT_BWD_COLS=cols) for w, cols in self.bwd_knobs]
            bwd_knobs.append(dict(QUANT_BWD_MODE="two_kernel"))
            for kv in bwd_knobs:
                with self._knobs(**kv):
                    def fn(x=x, dy=dy, p=p, c=c, al=al, off=inp["offsets"]):
                        return silu_mul_bwd_quant(dy, x, p, columnwise=True, pow2_scale=True,
                                                  need_dprobs=True, counts=c, align=al,
                                                  segments=off)
                    two = kv["QUANT_BWD_MODE"] == "two_kernel"
                    row, out = self._row(f"bwd {tag}", "bwd", E, _knob_names(kv), fn,
                                         check_bwd, nb, ("_silu_mul_bwd",
                                                         "_quantize_grouped"),
                                         None if two else base)
                rows.append(row)
                if base is None:
                    base = out
            del base
            # backward, non-batch form at the same R (first input set only)
            if i == 0:
                nbd = self._bytes("bwd_dense", inp)
                base = None
                for w, cols in self.bwd_knobs:
                    kv = dict(QUANT_BWD_NUM_WARPS=w, QUANT_BWD_COLS=cols)
                    with self._knobs(**kv):
                        def fn(x=x, dy=dy, p=p):
                            return silu_mul_bwd_quant(dy, x, p, columnwise=True,
                                                      pow2_scale=True, need_dprobs=True)
                        row, out = self._row(
                            "bwd dense", "bwd_dense", 0, _knob_names(kv), fn,
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
            del inp, dx_ref, dp_ref, y_ref
            if not self.cpu:
                torch.cuda.empty_cache()
        return rows

    # -- output
    def report(self, rows) -> dict:
        best = {}
        for r in rows:
            if r["ok"] and r["us"] is not None:
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
        head = ["case", "knobs", "µs", "kernel µs", "GB/s", "% copy", "same", "check"]
        lines = []
        for r in rows:
            k = r["knobs"]
            kn = "2k" if k.get("mode") == "two_kernel" else f"w{k['warps']} c{k['cols']}"
            same = {True: "=", False: "DIFF", None: ""}[r.get("same_as_default")]
            chk = "ok" if r["ok"] else ("error: " + r["error"][:50] if r["error"] else "FAIL")
            if r["ok"]:
                chk += f" (deq {max(r['rowwise_rel_err'], r['colwise_rel_err']):.1e})"
            lines.append([r["name"], kn, fmt(r["us"], ".1f"), fmt(r["kernel_us"], ".1f"),
                          fmt(r["gbps"], ".0f"), fmt(r["pct_copy"], ".0f"), same, chk])
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        print(f"{self.dev_name}; copy {self.copy_gbps:.0f} GB/s; torch {torch.__version__}, "
              f"triton {triton.__version__}; GB/s and % copy from kernel µs when "
              "measured")
        print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
        print("-+-".join("-" * w for w in widths))
        for line in lines:
            print(" | ".join(str(c).ljust(w) for c, w in zip(line, widths)))


def _knob_names(kv: dict) -> dict:
    """Short knob names for the rows: warps, cols, mode (two_kernel rows: mode only)."""
    if kv.get("QUANT_BWD_MODE") == "two_kernel":
        return {"mode": "two_kernel"}
    short = {"QUANT_BWD_NUM_WARPS": "warps", "QUANT_BWD_COLS": "cols",
             "QUANT_BWD_MODE": "mode"}
    return {short[k]: v for k, v in kv.items()}



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


if __name__ == "__main__":
    sys.exit(main())
