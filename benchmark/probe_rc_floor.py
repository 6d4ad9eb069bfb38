"""Probe: the floor of the "both 1x128 copies" access pattern, moved without any math:
``python -m benchmark.probe_rc_floor [--json PATH] [--rounds N]``.

``quantize_1x128`` with both copies (issue 11: 22-23 µs at ``[8192, 2048]``, target 18.4)
reads a 16-bit ``x [M, K]`` once and writes two 8-bit arrays: ``q [M, K]`` and the
transposed ``q_t [K, M]``. Three kernel designs measured so far (the "split" kernel that
reads x twice, single-read register tiles, and a TMA-ring Gluon kernel: session 25's
``h200_probe_quantize_rc_tma_not_kept_*``) all land at 82-86% of a size-matched copy.
This probe asks whether the pattern itself costs that, with one persistent Gluon kernel
that moves the same bytes through TMA only (a ring of ``[128, 128]`` input tiles, TMA
stores of the output tiles; the bytes are the input's high and low bytes, no
quantization):

- ``copy``: each input tile stored back as it is (the kernel's own copy: its overhead
  against ``torch``'s copy of the same bytes);
- ``two rows``: two byte arrays ``[M, K]`` (the pattern's bytes, both row-major);
- ``row + transposed``: ``[M, K]`` and ``[K, M]``, the latter as 32-bit words of 4
  tokens through a layout conversion (the pattern of ``quantize_1x128``).

Each beside ``harness.size_matched_copy_us`` of the same bytes (profiler kernel µs, L2
flushed), at ``[8192, 2048]`` and ``[32768, 2048]``. sm_90 with Gluon only. The table is
printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from linghe.fwd.grouped_mm_ws import (
    GluonDescriptor,
    _partition_barrier,
    _tma_load,
    _tma_store,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    ws_capable,
)
from linghe.utils import num_sms

from .harness import device_time_us, print_columns, size_matched_copy_us

MODES = ("copy", "two rows", "row + transposed")

if gluon is not None:

    @gluon.jit
    def _pattern_kernel(x_desc, y_desc, a_desc, b_desc, M, K, MODE: gl.constexpr,
                        STAGES: gl.constexpr, NW: gl.constexpr):
        """This program's ``[128, 128]`` tiles of ``x`` (every ``num_programs``-th, a row
        block's columns in turn) through a ring of ``STAGES``; ``MODE`` 0: the tile to
        ``y``; 1: its high bytes to ``a [M, K]`` and low bytes to ``b [M, K]``; 2: high
        bytes to ``a``, low bytes transposed to ``b [K, M / 4]`` (int32 words)."""
        layout: gl.constexpr = gl.BlockedLayout([4, 8], [2, 16], [NW, 1], [1, 0])
        words_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape,
                                         x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2] + a_desc.block_type.shape,
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [2] + b_desc.block_type.shape,
                                           b_desc.layout)
        nk = gl.cdiv(K, 128)
        n_tiles = gl.cdiv(M, 128) * nk
        n_mine = gl.cdiv(n_tiles - gl.program_id(0), gl.num_programs(0))
        # loads run AHEAD tiles ahead; a copy's stage leaves through its own TMA store,
        # so its loads run one tile less ahead (the store of two tiles ago has left)
        AHEAD: gl.constexpr = STAGES - 2 if MODE == 0 else STAGES - 1
        for i in range(n_mine + AHEAD):
            if i < n_mine:
                t = gl.program_id(0) + i * gl.num_programs(0)
                st = i % STAGES
                if MODE == 0:
                    tma.store_wait(1)
                mbarrier.expect(ready.index(st), x_desc.block_type.nbytes)
                _tma_load(x_desc, [(t // nk) * 128, (t % nk) * 128], ready.index(st),
                          bufs.index(st))
            c = i - AHEAD
            if c >= 0:
                t = gl.program_id(0) + c * gl.num_programs(0)
                m0 = (t // nk) * 128
                k0 = (t % nk) * 128
                st = c % STAGES
                mbarrier.wait(ready.index(st), (c // STAGES) & 1)
                if MODE == 0:
                    _tma_store(y_desc, [m0, k0], bufs.index(st))
                else:
                    bits = bufs.index(st).load(layout).to(gl.int16, bitcast=True)
                    _partition_barrier()
                    hi = (bits >> 8).to(gl.uint8)
                    lo = bits.to(gl.uint8)
                    ob = c % 2
                    tma.store_wait(2)
                    a_bufs.index(ob).store(hi)
                    if MODE == 1:
                        b_bufs.index(ob).store(lo)
                    else:
                        v = gl.reshape(lo.to(gl.int32), [32, 4, 128])
                        sh = gl.arange(0, 4, layout=gl.SliceLayout(
                            0, gl.SliceLayout(2, v.type.layout))) * 8
                        w = gl.sum(v << gl.expand_dims(gl.expand_dims(sh, 0), 2), axis=1)
                        b_bufs.index(ob).store(gl.convert_layout(gl.permute(w, [1, 0]),
                                                                 words_l))
                    fence_async_shared()
                    _tma_store(a_desc, [m0, k0], a_bufs.index(ob))
                    if MODE == 1:
                        _tma_store(b_desc, [m0, k0], b_bufs.index(ob))
                    else:
                        _tma_store(b_desc, [k0, m0 // 4], b_bufs.index(ob))
        tma.store_wait(0)


_GL = {torch.bfloat16: "bfloat16", torch.uint8: "uint8", torch.int32: "int32"}


def _desc(t: torch.Tensor, box):
    """A TMA descriptor of ``t`` in ``box`` boxes with the NVMMA layout for its dtype."""
    dt = getattr(gl, _GL[t.dtype])
    return GluonDescriptor(t, list(t.shape), list(t.stride()), list(box),
                           gl.NVMMASharedLayout.get_default_for(list(box), dt))


def run_pattern(x: torch.Tensor, mode: int, outs, stages: int = 4, warps: int = 4) -> None:
    """One launch of :func:`_pattern_kernel` on ``x [M, K]`` bf16 into ``outs`` (see
    :func:`make_outputs`)."""
    M, K = x.shape
    y, a, b = outs
    x_desc, y_desc, a_desc = _desc(x, (128, 128)), _desc(y, (128, 128)), _desc(a, (128, 128))
    b_desc = _desc(b, (128, 128) if mode != 2 else (128, 32))
    grid = (min(num_sms(x.device), (M // 128) * (K // 128)),)
    _pattern_kernel[grid](x_desc, y_desc, a_desc, b_desc, M, K, MODE=mode, STAGES=stages,
                          NW=warps, num_warps=warps)


def make_outputs(x: torch.Tensor, mode: int):
    """``(y, a, b)``: ``y`` like ``x`` (mode 0), ``a [M, K]`` uint8 and ``b`` (``[M, K]``
    uint8, or ``[K, M / 4]`` int32 words in mode 2)."""
    M, K = x.shape
    a = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    if mode == 2:
        b = torch.empty(K, M // 4, dtype=torch.int32, device=x.device)
    else:
        b = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    return torch.empty_like(x), a, b


def check(x: torch.Tensor, mode: int, outs) -> bool:
    """The bytes landed where the pattern says."""
    y, a, b = outs
    bits = x.view(torch.int16)
    if mode == 0:
        return torch.equal(y, x)
    hi = (bits >> 8).to(torch.uint8)
    lo = bits.to(torch.uint8)
    ok = torch.equal(a, hi)
    if mode == 1:
        return ok and torch.equal(b, lo)
    return ok and torch.equal(b.view(torch.uint8).view(x.shape[1], x.shape[0]), lo.t())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.probe_rc_floor")
    p.add_argument("--json", default=None)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not (torch.cuda.is_available() and ws_capable(torch.empty(1, device="cuda"))):
        raise SystemExit("probe_rc_floor needs an sm_90 GPU with Gluon")
    rows = []
    for M, K in ((8192, 2048), (32768, 2048)):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        nbytes = 4 * M * K  # read 2 MK, write 2 MK in every mode
        for mode, name in enumerate(MODES):
            outs = make_outputs(x, mode)
            run_pattern(x, mode, outs)
            ok = check(x, mode, outs)
            us, copy = [], []
            for _ in range(args.rounds):
                us.append(device_time_us(
                    lambda x=x, mode=mode, outs=outs: run_pattern(x, mode, outs)))
                copy.append(size_matched_copy_us(nbytes, "cuda"))
            t, c = statistics.median(us), statistics.median(copy)
            rows.append(dict(shape=f"[{M}, {K}]", pattern=name, us=t, copy_us=c,
                             pct_copy=100 * c / t, gbs=nbytes / t / 1e3, bytes_ok=ok))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"the both-copies pattern moved by TMA alone, {torch.cuda.get_device_name()} "
          "(profiler kernel µs, L2 flushed)")
    print_columns(["shape", "pattern", "µs", "copy µs", "% of copy", "GB/s", "bytes ok"],
                  [[r["shape"], r["pattern"], f"{r['us']:.1f}", f"{r['copy_us']:.1f}",
                    f"{r['pct_copy']:.0f}", f"{r['gbs']:.0f}", r["bytes_ok"]] for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
