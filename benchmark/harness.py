"""The benchmark harness: cases register :class:`Bench` items; the harness checks
correctness, times each provider and prints/saves the table.

A case file in ``benchmark/cases/`` adds an op; it never adds a harness. A case is a
function ``(cfg: Config) -> list[Bench]`` registered with ``@case("name")``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from linghe.fp8 import Fp8Tensor
from linghe.testing import rel_err

PROVIDERS = ("eager", "compile", "linghe")


@dataclass
class Config:
    device: str
    quick: bool

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"


@dataclass
class Bench:
    """One timed comparison.

    ``run`` maps a provider name to a zero-argument callable doing the op once; extra
    providers (e.g. ``"torch"``) may appear beside eager/compile/linghe. ``expected``
    computes the high-precision result the outputs are checked against (default: the
    eager output); ``bytes`` is the fewest bytes the op must move.
    """

    name: str
    bytes: int
    run: dict[str, Callable[[], Any]]
    tol: float
    expected: Callable[[], Any] | None = None
    flops: int = 0
    note: str = ""


_CASES: dict[str, Callable[[Config], list[Bench]]] = {}


def case(name: str):
    """Register a case function under ``name``."""

    def deco(fn):
        if name in _CASES:
            raise ValueError(f"benchmark case {name!r} registered twice")
        _CASES[name] = fn
        return fn

    return deco


def cases() -> dict[str, Callable[[Config], list[Bench]]]:
    return dict(_CASES)


# ------------------------------------------------------------------------------ helpers
_compiled: dict[int, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``, cached per function object."""
    if id(fn) not in _compiled:
        _compiled[id(fn)] = torch.compile(fn)
    return _compiled[id(fn)]


def backward_of(fwd: Callable[[], Any], inputs: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor] | torch.Tensor) -> Callable[[], Any]:
    """A callable that runs only the backward of ``fwd()`` and returns the gradients of
    ``inputs``. The forward graph is built once, on the first call, so a provider that is
    not run (e.g. ``compile`` on CPU) costs nothing."""
    gs = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    graph = []

    def run():
        if not graph:
            out = fwd()
            graph.extend(o for o in (out if isinstance(out, (tuple, list)) else (out,))
                         if isinstance(o, torch.Tensor) and o.requires_grad)
        return torch.autograd.grad(graph, list(inputs), gs[: len(graph)], retain_graph=True)

    return run


def flat_tensors(x) -> list[torch.Tensor]:
    """Tensors of a nested output; an Fp8Tensor counts as its (data, scale) components, so
    a reference returning ``(q, scale, q_t, scale_t)`` compares with it directly."""
    if isinstance(x, Fp8Tensor):
        return [getattr(x, n) for n in ("rowwise_data", "rowwise_scale", "columnwise_data",
                                         "columnwise_scale") if getattr(x, n) is not None]
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in flat_tensors(item)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in flat_tensors(v)]
    return []


def max_rel_err(out, expected) -> float:
    outs, exps = flat_tensors(out), flat_tensors(expected)
    if len(outs) != len(exps):
        return float("inf")
    return max((rel_err(o, e) for o, e in zip(outs, exps)), default=0.0)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_us(fn: Callable[[], Any], cfg: Config) -> float:
    """Median time of ``fn`` in µs: ``triton.testing.do_bench`` (L2 flushed between runs)
    on the GPU; on CPU a median of wall-clock runs (interpreter timings)."""
    if cfg.device == "cuda":
        import triton

        ms = triton.testing.do_bench(fn, warmup=25 if cfg.quick else 100,
                                     rep=50 if cfg.quick else 200, return_mode="median")
        return ms * 1e3
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def bench_us(fn: Callable[[], Any], on_gpu: bool, *, warmup: int = 5, rep: int = 25) -> float:
    """A probe's timing of ``fn`` in µs: the ``triton.testing.do_bench`` median (L2 flushed
    between runs) on the GPU, one wall-clock call on the interpreter."""
    if not on_gpu:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def compiled_binaries(*kernels) -> list:
    """The compiled binaries (``n_regs``, ``n_spills``) of ``@triton.jit`` kernels on every
    device; ``[]`` where this triton keeps them elsewhere."""
    out = []
    for kernel in kernels:
        try:
            for cache in kernel.device_caches.values():
                out.extend(v for v in cache[0].values() if hasattr(v, "n_regs"))
        except Exception:
            pass
    return out


def graph_time_us(fn: Callable[[], Any], rep: int = 200) -> float | None:
    """Median time of ``fn`` in µs replayed from a CUDA graph (``do_bench_cudagraph``: the
    host hidden); ``None`` where ``fn`` cannot be captured."""
    import triton

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
    except Exception:
        return None


def profile_flushed(fn: Callable[[], Any], reps: int = 10,
                    flush: torch.Tensor | None = None):
    """``torch.profiler`` (CUDA activity) over ``reps`` calls of ``fn``, each after an L2
    flush (``flush.zero_()``, by default a fresh 256 MiB buffer: a fill kernel that
    callers leave out of their sums), after one warm-up call. Returns the profiler; the
    probes read its events (launch order) or ``key_averages()`` (per kernel name)."""
    from torch.profiler import ProfilerActivity, profile

    if flush is None:
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    return prof


def device_time_us(fn: Callable[[], Any], reps: int = 10) -> float | None:
    """Kernel time of one ``fn`` call in µs: the durations of the CUDA kernels it launches,
    summed by ``torch.profiler`` over ``reps`` calls (each after an L2 flush), minus the
    flushes' own kernels. Unlike :func:`time_us` it leaves out the host's launch and
    autograd overhead, which ``do_bench`` includes whenever the host is slower than the
    GPU. ``None`` if profiling fails."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def kernel_us(f) -> float:
        prof = profile_flushed(f, reps, flush)
        return sum(e.self_device_time_total for e in prof.key_averages())

    try:
        return max(kernel_us(fn) - kernel_us(lambda: None), 0.0) / reps
    except Exception:
        return None


def host_canary_ms() -> float:
    """The time of a fixed pure-Python loop (about 1 ms on a fast core): taken beside a
    step, it tells a slow host CPU (a noisy neighbour, frequency, scheduling) from the
    step's own host work when a host-bound step is slow."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(20000):
        acc += i * i
    return (time.perf_counter() - t0) * 1e3


def wall_us(fn: Callable[[], Any], reps: int = 3) -> float:
    """Wall µs per call of ``fn`` (after one warm-up call): the probes' timer on the CPU
    interpreter, where there are no kernel times."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


_SPIN_CYCLES_PER_US: list[float] = []


def _spin(us: float) -> None:
    """Queue a GPU spin of about ``us`` µs (``torch.cuda._sleep``, calibrated once)."""
    if not _SPIN_CYCLES_PER_US:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _SPIN_CYCLES_PER_US.append(20_000_000 / (start.elapsed_time(end) * 1e3))
    torch.cuda._sleep(int(us * _SPIN_CYCLES_PER_US[0]))


def host_us(fn: Callable[[], Any], calls: int = 20, spin_us: float = 200_000.0,
            repeats: int = 5) -> tuple[float, bool]:
    """Host µs per call of ``fn`` (ANCHORS.md's method): ``calls`` back-to-back calls after
    warm-up, no sync inside the loop, behind a GPU spin of ``spin_us`` so that the host
    never waits for the GPU; the median over ``repeats`` such loops (a lent machine's host
    has one-off stalls of milliseconds, which one short loop averages in). Returns
    ``(µs, waited)``: ``waited`` is True when a loop outlasted its spin, i.e. some call
    waited for the GPU (a host sync, or a launch queue of about a thousand entries filled
    up), so the number is not host time alone. Keep ``calls`` x kernels per call well
    under a thousand."""
    fn()
    fn()
    per_call, waited = [], False
    for _ in range(repeats):
        torch.cuda.synchronize()
        _spin(spin_us)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        per_call.append((t1 - t0) / calls * 1e6)
        waited |= per_call[-1] * calls >= 0.9 * spin_us
    return statistics.median(per_call), waited


def fmt(v, spec: str, none: str = "-") -> str:
    """A table cell: ``format(v, spec)``, or ``none`` where ``v`` is ``None``."""
    return none if v is None else format(v, spec)


def print_columns(head: Sequence[str], lines: Sequence[Sequence[Any]]) -> None:
    """Print ``lines`` under ``head`` as a ``|``-separated table with padded columns (the
    probes' last output)."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(str(c).ljust(w) for c, w in zip(line, widths)))


def _float_or_nan(v: str) -> float:
    """nvidia-smi's number, or NaN for what it does not report (``[N/A]``)."""
    try:
        return float(v)
    except ValueError:
        return float("nan")


class GpuClockLog:
    """Samples the GPU's SM and memory clocks, power and temperature every ``period_ms``
    (``nvidia-smi -lms`` in a child process, each line stamped on arrival) while open;
    :meth:`summary` averages the samples between two ``time.time()`` stamps. Why: the same
    memory-bound kernel measured ~30% slower inside the e2e step than alone; clocks and
    power during each part tell whether the GPU was throttled there. Does nothing
    without ``nvidia-smi``."""

    FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")

    def __init__(self, period_ms: int = 100, fields: tuple[str, ...] = FIELDS):
        import shutil
        import subprocess
        import threading

        self.samples: list[tuple[float, list[float]]] = []
        self.fields = tuple(fields)
        self._proc = None
        if shutil.which("nvidia-smi") is None:
            return
        # nvidia-smi numbers GPUs its own way (not CUDA_VISIBLE_DEVICES'): name it by UUID
        uuid = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()),
                           "uuid", ""))
        gpu = (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}") if uuid else "0"
        self._proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,"
             "nounits", "-i", gpu, "-lms", str(period_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            vals = [_float_or_nan(v) for v in line.split(",")]
            if len(vals) == len(self.fields):
                self.samples.append((time.time(), vals))

    def summary(self, t0: float, t1: float) -> dict | None:
        """Mean SM / memory MHz and power (W), max temperature (C) over ``[t0, t1]``
        (and the HBM's, ``mem_temp_c_max``, where ``temperature.memory`` is a field)."""
        got = [v for t, v in list(self.samples) if t0 <= t <= t1]
        if not got:
            return None
        # a field nvidia-smi does not report ([N/A], NaN here) is left out of its column
        col = lambda i: [v[i] for v in got if v[i] == v[i]] or [float("nan")]
        out = {"sm_mhz": statistics.mean(col(0)), "sm_mhz_min": min(col(0)),
               "mem_mhz": statistics.mean(col(1)), "power_w": statistics.mean(col(2)),
               "power_w_max": max(col(2)), "temp_c_max": max(col(3)), "samples": len(got)}
        if "temperature.memory" in self.fields:
            out["mem_temp_c_max"] = max(col(self.fields.index("temperature.memory")))
        return out

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None


def random_routing(T: int, topk: int, E: int, align: int, device, R: int | None = None,
                   seed: int = 0, exact_rows: bool = False):
    """Balanced random routing of ``T`` tokens to ``topk`` of ``E`` experts (standard-normal
    logits, CPU generator ``seed``): ``(layout, real, offs, counts)`` with the
    :class:`~linghe.layout.ExpertLayout` over ``R`` rows (default: the worst-case bound
    ``max_grouped_rows``; ``exact_rows``: the padded segments alone, no tail), the ``[R]``
    mask of real (routed) rows on ``device``, the segment offsets as a list and the
    ``[E]`` int32 counts (CPU)."""
    from linghe.layout import make_expert_layout, max_grouped_rows

    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randn(T, E, generator=g).topk(topk, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    if exact_rows:
        R = int(((counts + align - 1) // align * align).sum())
    elif R is None:
        R = max_grouped_rows(T, topk, E, align)
    layout = make_expert_layout(counts.to(device), align, R)
    offs = layout.offsets.tolist()
    real = torch.zeros(R, dtype=torch.bool)
    for e, c in enumerate(counts.tolist()):
        real[offs[e]:offs[e] + c] = True
    return layout, real.to(device), offs, counts


def size_matched_copy_us(nbytes: int, device, timer: Callable | None = None) -> float | None:
    """µs of a device copy that reads and writes ``nbytes`` in all (a uint8 ``copy_`` of
    ``nbytes / 2``): the probes' "% of a size-matched copy" ceiling. ``timer(fn)`` gives
    the µs of one call (default :func:`device_time_us`)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return (timer or device_time_us)(lambda: dst.copy_(src))


def interpreter_matches(cpu: bool, module: str) -> bool:
    """Whether a probe's choice of the CPU interpreter (``--cpu``, or no GPU) matches
    ``TRITON_INTERPRET``, which must be set before triton is imported; says how to run
    the probe when it does not."""
    from linghe.utils import INTERPRET

    if cpu == INTERPRET:
        return True
    print(f"--cpu needs TRITON_INTERPRET=1 before triton is imported: run it as its own "
          f"process (python -m {module} --cpu)", file=sys.stderr)
    return False


def copy_bandwidth_gbps(cfg: Config) -> float:
    """Device-to-device copy bandwidth (bytes read + written) on a buffer far over L2."""
    n = (1 << 30) if cfg.device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=cfg.device).random_()
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), cfg)
    return 2 * n / us / 1e3


def run_bench(b: Bench, cfg: Config, copy_gbps: float, providers: Sequence[str]) -> list[dict]:
    """Check and time every provider of ``b``; return one row per provider."""
    rows = []
    expected = b.expected() if b.expected is not None else None
    for prov in providers:
        if prov not in b.run:
            continue
        row = {"case": b.name, "provider": prov, "us": None, "device_us": None,
               "host_us": None, "host_waited": None, "gbps": None,
               "pct_copy": None,
               "tflops": None, "rel_err": None, "ok": None, "note": b.note, "error": None}
        try:
            out = b.run[prov]()
            _sync(cfg.device)
            if expected is None and prov == "eager":
                expected = out
            if expected is not None:
                err = max_rel_err(out, expected)
                row["rel_err"], row["ok"] = err, err <= b.tol
            del out
            us = time_us(b.run[prov], cfg)
            row["us"] = us
            row["gbps"] = b.bytes / us / 1e3
            row["pct_copy"] = 100 * row["gbps"] / copy_gbps
            if b.flops:
                row["tflops"] = b.flops / us / 1e6
            if cfg.device == "cuda":
                row["device_us"] = device_time_us(b.run[prov])
                row["host_us"], row["host_waited"] = host_us(b.run[prov])
        except Exception as e:  # one failing provider must not stop the run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        rows.append(row)
    base = {r["provider"]: r["us"] for r in rows if r["us"]}
    for r in rows:
        for ref_prov in ("eager", "compile"):
            r[f"vs_{ref_prov}"] = (base[ref_prov] / r["us"]
                                   if r["us"] and base.get(ref_prov) else None)
    return rows


@dataclass
class Report:
    device: str
    copy_gbps: float
    rows: list[dict] = field(default_factory=list)


def load_module_at(rev: str, path: str, name: str, *, src_dir: str | None = None,
                   replace: Sequence[tuple[str, str]] = ()):
    """A past version of a linghe module, for probes that time a change against what it
    replaced: ``path`` (e.g. ``"linghe/fwd/rope.py"``) at git ``rev``, or read from
    ``src_dir`` (a folder holding the file under its base name; for copies of the tree
    without ``.git``), imported as ``name`` (e.g. ``"linghe.fwd._rope_old"``, so that its
    relative imports resolve in the package) after the ``replace`` string substitutions
    (e.g. pointing an old backward at the old forward)."""
    import importlib.util
    import os
    import subprocess
    import sys
    import tempfile

    if src_dir:
        with open(os.path.join(src_dir, os.path.basename(path))) as fh:
            src = fh.read()
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    for old, new in replace:
        if old not in src:
            raise ValueError(f"load_module_at: {old!r} is not in {path} at {rev}")
        src = src.replace(old, new)
    # Triton reads a kernel's source from its file: keep the file for the process' life.
    fd, file = tempfile.mkstemp(suffix=".py", prefix=name.replace(".", "_"))
    with os.fdopen(fd, "w") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
