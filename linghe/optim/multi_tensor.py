"""Multi-tensor kernels over a pointer/chunk table: partial norms, the final reduce, in-place
scaling, zero counting; and the host-side table ("plan") with its cache.

How a list of tensors becomes a fixed number of launches:

* Every tensor is cut into chunks of ``CHUNK`` elements. The chunk table is an int64
  tensor ``[n_chunks, 4]`` on the tensors' device; row ``c`` = ``(slot of the chunk's
  tensor, start element within it, length, flag)`` (``flag`` is the sign-clearing mask for
  :func:`count_zeros`, unused otherwise). The tensors' base addresses are a separate small
  int64 array (one per slot), so the table depends only on the tensors' sizes, dtypes and
  alignment, never on where they live: gradients that a backward allocates anew every step
  (``zero_grad(set_to_none=True)``) reuse the table and upload only their addresses.
* Chunks are grouped by (bucket, dtype, 16-byte alignment); a group is one launch of a
  persistent-ish kernel whose programs stride over the group's chunks (program ``p`` takes
  chunks ``p, p + G, ...``) and write one partial each. Buckets are the distributed groups
  of :func:`linghe.optim.clip_grad_norm_` (one bucket when not distributed).
* The norm reads the same tensors through a second, coarser table (built with the plan,
  :func:`_segments`): the ``G`` programs of a launch each take one contiguous share of the
  group's elements (equal within 16 elements): one or a few pieces of tensors, and stream
  each piece with a loop that Triton software-pipelines (asynchronous copies into shared
  memory, ``NORM_CONFIG["stages"] - 1`` tiles in flight per program). The chunk loop
  (``NORM_CONFIG["segments"] = False``) looked every 16K-element chunk up in the table
  with a dependent load the warps waited for, and kept only two blocks per thread in flight.
* A one-program kernel reduces a bucket's partials (and, when not distributed, finishes the
  norm and the clip coefficient in the same launch). When the whole list is one launch and
  not distributed (the common case), there is no reduce launch: the partial-norm program
  that finishes last (an atomic ticket) reduces the partials and finishes the norm and
  coefficient (:func:`norm_single_launch`).

Addresses are int64 and cast with ``tl.pointer_type`` in the kernel (this works on the
Triton interpreter too). When every pointer of the list is 16-byte aligned the launches are
specialised with ``ALIGNED``: ``tl.multiple_of`` on the cast pointer itself (a hint on the
integer before the cast, or on ``ptr + start``, is lost by the compiler: checked in the PTX
of sm_90, where only this form gives ``ld.global.v4``).

The plan (table and launches) is cached keyed on ``(numel, dtype)`` of every tensor and the
list's alignment; each plan keeps a few uploaded address arrays keyed on the tensors'
``data_ptr`` (:class:`AddressSets`). Tables and addresses are uploaded from pinned memory
with non-blocking copies: building or reusing a plan never syncs the host with the device.
(Keying the whole table on the addresses, as before, rebuilt a 440K-row table every step
of a 7B-parameter model whose gradients move between steps: ~20 ms of host time.)
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from ..utils import INTERPRET, cdiv, device_guard, empty, launch, next_power_of_2, num_sms

#: Elements per chunk (a multiple of 2x every BLOCK below). 16384 (round 2): the persistent
#: programs' finishing times differ by at most one chunk, so smaller chunks shorten the
#: tail of a launch (65536 fp32 = ~33 µs per chunk per program on an H200 at 528
#: programs); the kernels load each chunk's table row one chunk ahead, so the extra chunks
#: add no dependent latency. ``LINGHE_OPTIM_CHUNK=65536`` restores round 1 (grad_norm 300
#: fp32 tensors: 310 µs, count_zeros 296 µs on H200).
CHUNK = int(os.environ.get("LINGHE_OPTIM_CHUNK", "16384"))
if CHUNK <= 0 or CHUNK % 16384:
    raise ValueError(f"LINGHE_OPTIM_CHUNK must be a positive multiple of 16384, got {CHUNK}")
NUM_WARPS = 8
PROGRAMS_PER_SM = 4  # persistent-ish grid: all resident at <= 64 regs x 256 threads (fp32: 42)
REDUCE_BLOCK = 1024

# Norm modes (kernel constexpr)
MODE_L1, MODE_L2, MODE_P, MODE_INF, MODE_NEG_INF = 1, 2, 3, 4, 5

_TL_DTYPE = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
}
NORM_DTYPES = tuple(_TL_DTYPE)

# count_zeros reads every dtype as a signed integer of its element size
_INT_BY_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def norm_mode(p: float) -> int:
    if p == 1.0:
        return MODE_L1
    if p == 2.0:
        return MODE_L2
    if p == float("inf"):
        return MODE_INF
    if p == float("-inf"):
        return MODE_NEG_INF
    return MODE_P


# Elements per thread per load: 16 (fp32: four 16-byte loads). Each loop iteration issues two
# such loads (an unroll of 2) before using them, so a thread has 128 B of fp32 in flight
# while its accumulator stays at 16 registers.
ELEMS_PER_THREAD = 16


#: AdamW launch knobs (``benchmark.probe_adamw`` varies them): ``stages`` of the
#: pipelined segment loop (``stages - 1`` blocks of the four inputs in flight per program
#: while one is updated), ``warps``, ``vectors`` per thread per block (16-byte vectors of
#: the narrowest dtype: 8 bf16 or 4 fp32 elements each), ``programs_per_sm``, and
#: ``piece``: program ``p`` takes pieces ``p, p + G, ...`` of this many elements
#: (:func:`_interleaved_segments`).
#: ``benchmark.probe_adamw`` (the e2e's 6.4 B bf16 parameters, H200): round 2's strided
#: loop over 16K-element chunks (no loads in flight across blocks but the other
#: program's) 83% of the copy bandwidth; this kernel 94-96% at stages 3-4 and pieces of
#: 64K-256K (16K: 92%); one contiguous share per program (as the norm's segments) 90%,
#: and inside the e2e step half as fast as the interleaved pieces.
ADAMW_CONFIG = dict(stages=4, warps=NUM_WARPS, vectors=1, piece=65536,
                    programs_per_sm=int(os.environ.get("LINGHE_ADAMW_PROGRAMS_PER_SM", "2")))


def adamw_block(es: tuple[int, int, int]) -> int:
    """Elements per block of an AdamW launch over elements of ``es`` bytes (as many when
    the tensors are not 16-byte aligned: the loads are then scalar, not fewer)."""
    return ADAMW_CONFIG["warps"] * 32 * ADAMW_CONFIG["vectors"] * (16 // min(es))


#: The norm kernel's launch knobs (``benchmark.probe_cenorm`` varies them): ``segments``:
#: each program streams one contiguous share of the elements (:func:`_segments`,
#: :func:`_norm_segments`) through a loop pipelined ``stages`` deep (asynchronous copies
#: into shared memory); False: round 2's strided chunk loop (each chunk's table lookup a
#: dependent load the warp waits for, two blocks in flight per thread). ``warps`` and
#: ``elems`` (per thread per block; a block is ``warps * 32 * elems`` elements, ``CHUNK``
#: must be a multiple of twice it). The grid (``PROGRAMS_PER_SM``) and ``CHUNK`` are the
#: plan's, shared with the scaling kernel.
NORM_CONFIG = dict(segments=True, stages=3, warps=NUM_WARPS, elems=ELEMS_PER_THREAD)


def _norm_launch_opts(es: int, aligned: bool) -> dict:
    """``BLOCK``, ``SEGMENTS``, ``SPAN``, ``STAGES`` and ``num_warps`` of a norm launch over
    elements of ``es`` bytes (:data:`NORM_CONFIG`)."""
    cfg = NORM_CONFIG
    block = cfg["warps"] * 32 * cfg["elems"]
    if CHUNK % (2 * block):
        raise ValueError(f"CHUNK ({CHUNK}) must be a multiple of twice the norm block "
                         f"({block} elements)")
    vec = min(16 // es if aligned else 1, cfg["elems"])  # elements of a 16-byte access
    return dict(BLOCK=block, SEGMENTS=bool(cfg["segments"]), SPAN=cfg["warps"] * 32 * vec,
                STAGES=cfg["stages"], num_warps=cfg["warps"])


def _block(elem_size: int, kind: str) -> int:
    if kind == "bits" and elem_size < 4:
        return NUM_WARPS * 32 * ELEMS_PER_THREAD * 2  # narrow ints: 32 elements per thread
    return NUM_WARPS * 32 * ELEMS_PER_THREAD


# ======================================================================================
# kernels
# ======================================================================================


@triton.jit
def _elem(x, p, MODE: tl.constexpr):
    """Per-element contribution of ``x`` (already in the accumulation dtype)."""
    if MODE == 1:
        return tl.abs(x)
    elif MODE == 2:
        return x * x
    elif MODE == 3:
        # |x|^p for p > 0: exp2(p * log2|x|); |x| = 0 -> exp2(-inf) = 0. In fp32 also for
        # fp64 accumulation (fp32 exp2/log2 are the fast, portable ones)
        xf = tl.abs(x.to(tl.float32))
        return tl.exp2(p * tl.log2(xf)).to(x.dtype)
    else:
        return tl.abs(x)


@triton.jit
def _combine(acc, v, MODE: tl.constexpr):
    if MODE == 4:
        return tl.maximum(acc, v, propagate_nan=tl.PropagateNan.ALL)
    elif MODE == 5:
        return tl.minimum(acc, v, propagate_nan=tl.PropagateNan.ALL)
    else:
        return acc + v


def _ident(mode: int) -> float:
    """Identity of the combine (passed to the kernels as the constexpr ``IDENT``)."""
    return float("inf") if mode == MODE_NEG_INF else 0.0


@triton.jit
def _reduce_all(acc, MODE: tl.constexpr):
    """Reduce a vector to a scalar; NaN propagates for max/min too."""
    if MODE == 4:
        r = tl.max(acc, axis=0)
    elif MODE == 5:
        r = tl.min(acc, axis=0)
    else:
        r = tl.sum(acc, axis=0)
    if MODE >= 4:
        n_nan = tl.sum((acc != acc).to(tl.int32), axis=0)
        r = tl.where(n_nan > 0, float("nan"), r)
    return r


@triton.jit
def _table_row(table_ptr, addrs_ptr, c, n_chunks, ES: tl.constexpr):
    """``(byte address, length, flag)`` of chunk ``c`` (zeros past the table), from its row
    ``(slot, start, length, flag)`` and the slot's base address ``addrs[slot]`` (elements of
    ``ES`` bytes): loaded one chunk ahead by the kernels below, so a chunk's data loads never
    wait on its table row."""
    ok = c < n_chunks
    row = table_ptr + c.to(tl.int64) * 4
    slot = tl.load(row, mask=ok, other=0)
    start = tl.load(row + 1, mask=ok, other=0)
    n = tl.load(row + 2, mask=ok, other=0)
    flag = tl.load(row + 3, mask=ok, other=0)
    base = tl.load(addrs_ptr + slot, mask=ok, other=0)
    return base + start * ES, n, flag


@triton.jit
def _as_ptr(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The int64 byte address ``addr`` as a pointer to ``DTYPE`` (16-byte aligned hint when
    ``ALIGNED``: the hint must sit on the cast pointer itself to give 16-byte accesses)."""
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fold_rows(v, MODE: tl.constexpr):
    """``[R, SPAN] -> [SPAN]`` with the mode's combine (NaN propagates): a thread holds
    all ``R`` rows of its columns, so this is register arithmetic, no shuffles."""
    if MODE == 4:
        return tl.reduce(v, 0, _max_nan)
    elif MODE == 5:
        return tl.reduce(v, 0, _min_nan)
    else:
        return tl.sum(v, axis=0)


@triton.jit
def _norm_segments(seg_ptr, addrs_ptr, p, DTYPE: tl.constexpr, ES: tl.constexpr,
                   ACC: tl.constexpr, MODE: tl.constexpr, IDENT: tl.constexpr,
                   BLOCK: tl.constexpr, ALIGNED: tl.constexpr, SPAN: tl.constexpr,
                   STAGES: tl.constexpr):
    """This program's accumulator ``[SPAN]`` over its contiguous share of the elements
    (:func:`_segments`): ``seg[pid]:seg[pid + 1]`` index its segment rows ``(slot, start,
    length)`` stored after the ``G + 1`` offsets; a segment is a piece of one tensor, a
    program has one or a few.

    A segment is streamed in ``[BLOCK / SPAN, SPAN]`` tiles (``SPAN`` = threads x 16
    bytes) by a loop that Triton pipelines (``STAGES``: asynchronous 16-byte copies into
    shared memory, ``STAGES - 1`` tiles in flight per program while one is summed); each
    thread folds the rows of its columns into its ``SPAN``-wide accumulator (no shuffles).
    The loads are masked on whole 16-byte vectors (``offs < vectors``) so the last tile
    keeps vector accesses; the < 4 (fp32) elements past a tensor's last whole vector are
    read by a small separate load."""
    VEC: tl.constexpr = 16 // ES if ALIGNED else 1
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK // SPAN)[:, None] * SPAN + tl.arange(0, SPAN)[None, :]
    cl = tl.arange(0, SPAN)
    rl = tl.arange(0, VEC)
    acc = tl.full([SPAN], IDENT, ACC)
    s_lo = tl.load(seg_ptr + pid)
    s_hi = tl.load(seg_ptr + pid + 1)
    rows = seg_ptr + G + 1
    for s in range(s_lo, s_hi):
        row = rows + s * 3
        slot = tl.load(row)
        n = tl.load(row + 2).to(tl.int32)  # < 2^30 (the host splits longer segments)
        ptr = _as_ptr(tl.load(addrs_ptr + slot) + tl.load(row + 1) * ES, DTYPE, ALIGNED)
        nv = (n // VEC) * VEC  # elements in whole 16-byte vectors
        for off in tl.range(0, nv, BLOCK, num_stages=STAGES):
            o = off + offs
            x = tl.load(ptr + o, mask=o < nv, other=IDENT)
            acc = _combine(acc, _fold_rows(_elem(x.to(ACC), p, MODE), MODE), MODE)
        if n > nv:  # a tensor's last < VEC elements
            xr = tl.load(ptr + nv + rl, mask=rl < n - nv, other=IDENT).to(ACC)
            t = _reduce_all(_elem(xr, p, MODE), MODE)
            acc = _combine(acc, tl.where(cl == 0, t, IDENT), MODE)
    return acc


@triton.jit
def _norm_chunks(table_ptr, addrs_ptr, n_chunks, p, DTYPE: tl.constexpr, ES: tl.constexpr,
                 ACC: tl.constexpr, MODE: tl.constexpr, IDENT: tl.constexpr,
                 BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's accumulator ``[BLOCK]``, chunk by chunk (round 2): unmasked double
    blocks (two loads per step), then the masked tail of a tensor's last chunk."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], IDENT, ACC)
    addr_nxt, n_nxt, _f = _table_row(table_ptr, addrs_ptr, pid, n_chunks, ES)
    for c in range(pid, n_chunks, G):
        addr = addr_nxt  # byte address of the chunk's first element
        n = n_nxt
        addr_nxt, n_nxt, _f = _table_row(table_ptr, addrs_ptr, c + G, n_chunks, ES)
        ptr = _as_ptr(addr, DTYPE, ALIGNED)
        # full double blocks: unmasked (vectorizable) loads, two in flight per thread
        n_full = (n // (2 * BLOCK)) * (2 * BLOCK)
        for i in range(0, n // (2 * BLOCK)):
            x0 = tl.load(ptr + i * (2 * BLOCK) + lanes)
            x1 = tl.load(ptr + i * (2 * BLOCK) + BLOCK + lanes)
            acc = _combine(acc, _elem(x0.to(ACC), p, MODE), MODE)
            acc = _combine(acc, _elem(x1.to(ACC), p, MODE), MODE)
        for off in range(n_full, n, BLOCK):  # the tail of a tensor's last chunk: masked
            m = off + lanes < n
            x = tl.load(ptr + off + lanes, mask=m, other=0.0).to(ACC)
            v = tl.where(m, _elem(x, p, MODE), IDENT)
            acc = _combine(acc, v, MODE)
    return acc


@triton.jit
def _norm_partials_kernel(table_ptr, addrs_ptr, n_chunks, partial_ptr, p, counter_ptr,
                          norm_out_ptr, coef_out_ptr, max_norm,
                          DTYPE: tl.constexpr, ES: tl.constexpr, ACC: tl.constexpr,
                          MODE: tl.constexpr,
                          IDENT: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                          LAST: tl.constexpr = False, COEF: tl.constexpr = False,
                          RBLOCK: tl.constexpr = 1024, SEGMENTS: tl.constexpr = False,
                          SPAN: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """Program ``pid`` folds chunks ``pid, pid + G, ...`` of the table into one partial.

    ``SEGMENTS``: ``table_ptr`` is the launch's segment table instead (each program one
    contiguous share, streamed by a pipelined loop: :func:`_norm_segments`); otherwise the
    chunk table, chunk by chunk, two blocks loaded per step (:func:`_norm_chunks`, round 2).

    ``LAST`` (single launch, not distributed): the program that finishes last (an atomic
    ticket on ``counter[0]``, which it resets to 0) reduces all ``G`` partials in a fixed
    order (deterministic) and writes the norm (and with ``COEF`` the clip coefficient):
    no separate reduce launch."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if SEGMENTS:
        acc = _norm_segments(table_ptr, addrs_ptr, p, DTYPE, ES, ACC, MODE, IDENT, BLOCK,
                             ALIGNED, SPAN, STAGES)
    else:
        acc = _norm_chunks(table_ptr, addrs_ptr, n_chunks, p, DTYPE, ES, ACC, MODE, IDENT,
                           BLOCK, ALIGNED)
    tl.store(partial_ptr + pid, _reduce_all(acc, MODE))
    if LAST:
        tl.debug_barrier()  # this program's partial is stored before its ticket (release)
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        is_last = ticket == G - 1
        # only the last program reads (the others' loop is empty): .cg reads from L2, where
        # the other programs' partials are (their tickets were released after the stores)
        n_red = tl.where(is_last, G, 0)
        rl = tl.arange(0, RBLOCK)
        racc = tl.full([RBLOCK], IDENT, ACC)
        for off in range(0, n_red, RBLOCK):
            m = off + rl < n_red
            v = tl.load(partial_ptr + off + rl, mask=m, other=IDENT, cache_modifier=".cg")
            racc = _combine(racc, v.to(ACC), MODE)
        norm = _finish(_reduce_all(racc, MODE), p, MODE)
        tl.store(norm_out_ptr, norm, mask=is_last)
        tl.store(counter_ptr, 0, mask=is_last)  # ready for the next call
        if COEF:
            nf = norm.to(tl.float32)
            coef = tl.div_rn(tl.zeros([], tl.float32) + max_norm, nf + 1e-6)
            coef = tl.where(coef > 1.0, 1.0, coef)  # clamp(max=1) keeps NaN
            tl.store(coef_out_ptr, coef, mask=is_last)


@triton.jit
def _norm_reduce_kernel(partial_ptr, n_partials, acc_out_ptr, norm_out_ptr, coef_out_ptr,
                        p, max_norm, ACC: tl.constexpr, MODE: tl.constexpr, IDENT: tl.constexpr,
                        FINISH: tl.constexpr, COEF: tl.constexpr, BLOCK: tl.constexpr):
    """One program: reduce ``n_partials`` partials to ``acc_out[0]``; with ``FINISH`` also
    write the norm (``acc^(1/p)``) and with ``COEF`` the clip coefficient
    ``min(max_norm / (norm + 1e-6), 1)`` (float32)."""
    lanes = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], IDENT, ACC)
    for off in range(0, n_partials, BLOCK):
        m = off + lanes < n_partials
        v = tl.load(partial_ptr + off + lanes, mask=m, other=IDENT).to(ACC)
        acc = _combine(acc, v, MODE)
    total = _reduce_all(acc, MODE)
    tl.store(acc_out_ptr, total)
    if FINISH:
        norm = _finish(total, p, MODE)
        tl.store(norm_out_ptr, norm)
        if COEF:
            _store_coef(coef_out_ptr, norm, max_norm)


@triton.jit
def _finish(total, p, MODE: tl.constexpr):
    if MODE == 2:
        if total.dtype == tl.float64:
            return tl.sqrt(total)  # IEEE for fp64
        else:
            return tl.sqrt_rn(total)
    elif MODE == 3:
        return tl.exp2(tl.log2(total.to(tl.float32)) / p).to(total.dtype)
    else:
        return total


@triton.jit
def _store_coef(coef_out_ptr, norm, max_norm):
    nf = norm.to(tl.float32)
    coef = tl.div_rn(tl.zeros([], tl.float32) + max_norm, nf + 1e-6)
    # clamp(max=1) keeps NaN (as torch.clamp does)
    coef = tl.where(coef > 1.0, 1.0, coef)
    tl.store(coef_out_ptr, coef)


@triton.jit
def _norm_finish_kernel(acc_ptr, n_acc, norm_out_ptr, coef_out_ptr, p, max_norm,
                        ACC: tl.constexpr, MODE: tl.constexpr, IDENT: tl.constexpr,
                        COEF: tl.constexpr, BLOCK: tl.constexpr):
    """Combine the (all-reduced) per-bucket accumulators and finish norm and coefficient."""
    lanes = tl.arange(0, BLOCK)
    v = tl.load(acc_ptr + lanes, mask=lanes < n_acc, other=IDENT).to(ACC)
    norm = _finish(_reduce_all(v, MODE), p, MODE)
    tl.store(norm_out_ptr, norm)
    if COEF:
        _store_coef(coef_out_ptr, norm, max_norm)


@triton.jit
def _scale_kernel(table_ptr, addrs_ptr, n_chunks, coef_ptr, DTYPE: tl.constexpr,
                  ES: tl.constexpr, CT: tl.constexpr, BLOCK: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """In place: ``x *= coef[0]`` (multiply in ``CT``: fp32, fp64 for fp64 tensors; stored
    in the tensor's dtype)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    coef = tl.load(coef_ptr).to(CT)
    addr_nxt, n_nxt, _f = _table_row(table_ptr, addrs_ptr, pid, n_chunks, ES)
    for c in range(pid, n_chunks, G):
        addr = addr_nxt  # byte address of the chunk's first element
        n = n_nxt
        addr_nxt, n_nxt, _f = _table_row(table_ptr, addrs_ptr, c + G, n_chunks, ES)
        ptr = addr.to(tl.pointer_type(DTYPE))
        if ALIGNED:  # 16-byte aligned chunk start: 16-byte vector loads
            ptr = tl.multiple_of(ptr, 16)
        n_full = (n // (2 * BLOCK)) * (2 * BLOCK)
        for i in range(0, n // (2 * BLOCK)):
            p0 = ptr + i * (2 * BLOCK) + lanes
            x0 = tl.load(p0).to(CT)
            x1 = tl.load(p0 + BLOCK).to(CT)
            tl.store(p0, (x0 * coef).to(DTYPE))
            tl.store(p0 + BLOCK, (x1 * coef).to(DTYPE))
        for off in range(n_full, n, BLOCK):
            m = off + lanes < n
            x = tl.load(ptr + off + lanes, mask=m, other=0.0).to(CT)
            tl.store(ptr + off + lanes, (x * coef).to(DTYPE), mask=m)


@triton.jit
def _count_zeros_kernel(table_ptr, addrs_ptr, n_chunks, partial_ptr, ITYPE: tl.constexpr,
                        ES: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Count elements whose bits ``& flag`` are 0 (``flag`` clears the sign bit of floats,
    so -0.0 counts; it is all ones for integers)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    cnt = tl.zeros([BLOCK], tl.int32)
    addr_nxt, n_nxt, f_nxt = _table_row(table_ptr, addrs_ptr, pid, n_chunks, ES)
    for c in range(pid, n_chunks, G):
        addr = addr_nxt  # byte address of the chunk's first element
        n = n_nxt
        mask_bits = f_nxt.to(ITYPE)
        addr_nxt, n_nxt, f_nxt = _table_row(table_ptr, addrs_ptr, c + G, n_chunks, ES)
        ptr = addr.to(tl.pointer_type(ITYPE))
        if ALIGNED:  # 16-byte aligned chunk start: 16-byte vector loads
            ptr = tl.multiple_of(ptr, 16)
        n_full = (n // (2 * BLOCK)) * (2 * BLOCK)
        for i in range(0, n // (2 * BLOCK)):
            x0 = tl.load(ptr + i * (2 * BLOCK) + lanes)
            x1 = tl.load(ptr + i * (2 * BLOCK) + BLOCK + lanes)
            cnt += ((x0 & mask_bits) == 0).to(tl.int32) + ((x1 & mask_bits) == 0).to(tl.int32)
        for off in range(n_full, n, BLOCK):
            m = off + lanes < n
            x = tl.load(ptr + off + lanes, mask=m, other=1)
            cnt += (((x & mask_bits) == 0) & m).to(tl.int32)
    tl.store(partial_ptr + pid, tl.sum(cnt.to(tl.int64), axis=0))


@triton.jit
def adamw_scalars(coef_ptr, lr_ptr, lr, weight_decay, CLIP: tl.constexpr,
                  LR_TENSOR: tl.constexpr):
    """A step's ``(lr, clip coefficient, 1 - lr * weight_decay)`` in float32: ``lr``
    from ``lr_ptr`` (``LR_TENSOR``) or the argument, the coefficient from ``coef_ptr``
    (``CLIP``) or 1."""
    if LR_TENSOR:
        lr_f = tl.load(lr_ptr).to(tl.float32)
    else:
        lr_f = tl.zeros([], tl.float32) + lr
    if CLIP:
        coef = tl.load(coef_ptr).to(tl.float32)
    else:
        coef = tl.full([], 1.0, tl.float32)
    return lr_f, coef, 1.0 - lr_f * weight_decay


@triton.jit
def adamw_bias(bias_ptr, t, lr_f):
    """``(lr / bc1, sqrt(bc2))`` from tensor ``t``'s bias corrections ``bias[t]``."""
    bc1 = tl.load(bias_ptr + 2 * t)
    bc2 = tl.load(bias_ptr + 2 * t + 1)
    return tl.div_rn(lr_f, bc1), tl.sqrt_rn(bc2)


@triton.jit
def _adamw_block(pp, gp, mp, vp, mask, coef, decay, step_size, bc2_sqrt, beta1, beta2, eps,
                 MAXIMIZE: tl.constexpr):
    """One block of elements: the update in float32, stored in each tensor's dtype;
    returns the parameter's new values as stored."""
    p = tl.load(pp, mask=mask).to(tl.float32)
    g = tl.load(gp, mask=mask).to(tl.float32) * coef
    m = tl.load(mp, mask=mask).to(tl.float32)
    v = tl.load(vp, mask=mask).to(tl.float32)
    if MAXIMIZE:
        g = -g
    # Explicit FMAs: every kernel that inlines this block (the multi-tensor AdamW and
    # linghe.optim.fp8_weights) rounds the same way, whatever the compiler would contract.
    p = p * decay
    m = tl.fma(m, beta1, (1.0 - beta1) * g)
    v = tl.fma(v, beta2, (1.0 - beta2) * (g * g))
    # The fast square root and division (sqrt.approx, div.full: within 2 ulp of IEEE), not
    # sqrt_rn / div_rn: in the e2e step (SM clocks ~1.6-1.7 GHz under the power cap) this
    # kernel is instruction-bound, and the IEEE forms' slow paths for zero and subnormal
    # moments (rows without gradients: an embedding's unseen tokens) made such rows cost
    # twice their copy time.
    denom = tl.sqrt(v) * (1.0 / bc2_sqrt) + eps
    p = tl.fma(-step_size, m / denom, p)
    p = p.to(pp.dtype.element_ty)
    tl.store(pp, p, mask=mask)
    tl.store(mp, m.to(mp.dtype.element_ty), mask=mask)
    tl.store(vp, v.to(vp.dtype.element_ty), mask=mask)
    return p


@triton.jit
def _pow_steps(b, s):
    """``b ** s`` for float64 ``b`` and an integer count ``0 <= s < 2^25`` (float32 step
    counts are exact up to 2^24): binary exponentiation, plain float64 multiplies (about
    1e-14 relative error; no transcendental functions, whose GPU forms are approximate)."""
    r = b * 0.0 + 1.0
    for _ in tl.static_range(25):
        r = tl.where((s & 1) == 1, r * b, r)
        b = b * b
        s = s >> 1
    return r


@triton.jit
def _adamw_advance_kernel(steps_ptr, inc_ptr, betas_ptr, bias_ptr, n,
                          HAS_INC: tl.constexpr, BLOCK: tl.constexpr):
    """``steps += inc`` (1, or ``inc[i]`` with ``HAS_INC``: only the parameters with a
    gradient count a step) and the bias corrections of the new counts, ``bias[i] = (1 -
    beta1^steps[i], 1 - beta2^steps[i])`` as float32, computed in float64 from the float64
    ``betas[0:2]`` (``1 - 0.999^1`` keeps its digits; float32 betas would make it 1.3e-5
    off)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(steps_ptr + i, mask=m, other=0.0)
    if HAS_INC:
        s = s + tl.load(inc_ptr + i, mask=m, other=0.0)
    else:
        s = s + 1.0
    tl.store(steps_ptr + i, s, mask=m)
    k = s.to(tl.int32)
    tl.store(bias_ptr + 2 * i, (1.0 - _pow_steps(tl.load(betas_ptr), k)).to(tl.float32),
             mask=m)
    tl.store(bias_ptr + 2 * i + 1,
             (1.0 - _pow_steps(tl.load(betas_ptr + 1), k)).to(tl.float32), mask=m)


@triton.jit
def _adamw_seg(rows, addrs_ptr, nt, s, s_hi, ESP: tl.constexpr, ESG: tl.constexpr,
               ESM: tl.constexpr):
    """Segment ``s``'s byte addresses of the parameter, gradient and both moments, its
    length (int32, < 2^30) and bias row; zeros when ``s >= s_hi``."""
    ok = s < s_hi
    row = rows + s * 4  # (rows of the table: < 2^29)
    a = addrs_ptr + tl.load(row, mask=ok, other=0)
    start = tl.load(row + 1, mask=ok, other=0)
    return (tl.load(a, mask=ok, other=0) + start * ESP,
            tl.load(a + nt, mask=ok, other=0) + start * ESG,
            tl.load(a + 2 * nt, mask=ok, other=0) + start * ESM,
            tl.load(a + 3 * nt, mask=ok, other=0) + start * ESM,
            tl.load(row + 2, mask=ok, other=0).to(tl.int32),
            tl.load(row + 3, mask=ok, other=0))


@triton.jit
def _adamw_kernel(seg_ptr, addrs_ptr, nt, bias_ptr, coef_ptr, lr_ptr, lr, beta1, beta2, eps,
                  weight_decay, P: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                  ESP: tl.constexpr, ESG: tl.constexpr, ESM: tl.constexpr,
                  BLOCK: tl.constexpr, STAGES: tl.constexpr, ALIGNED: tl.constexpr,
                  CLIP: tl.constexpr, LR_TENSOR: tl.constexpr, MAXIMIZE: tl.constexpr):
    """AdamW (decoupled weight decay) over ``nt`` tensors (their addresses in ``addrs [4,
    nt]``: parameters, gradients, exp_avg, exp_avg_sq; elements of ``ESP``/``ESG``/``ESM``
    bytes): program ``pid`` of ``NP`` streams its segments, rows ``(slot, start, length,
    bias row)`` ``seg[pid]:seg[pid + 1]`` after the ``NP + 1`` offsets
    (:func:`_interleaved_segments`),
    each through a loop that Triton pipelines ``STAGES`` deep (asynchronous 16-byte copies
    of the four inputs into shared memory, so that ``STAGES - 1`` blocks per program are
    in flight while one is updated); the next segment's row is loaded one segment ahead.

    Per element, in float32: ``g *= coef`` (the clip coefficient, ``CLIP``), ``p *= 1 - lr
    * wd``, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, ``p -= lr / bc1 * m /
    (sqrt(v) / sqrt(bc2) + eps)``, with the bias corrections ``bias[t] = (bc1, bc2)`` of
    the segment's tensor ``t`` (from :func:`_adamw_advance_kernel`, for this step). The
    loop's loads are masked on whole 16-byte vectors of the narrowest dtype; the < 8
    elements after a tensor's last whole vector take one small masked block."""
    VEC: tl.constexpr = 16 // min(ESP, ESG, ESM) if ALIGNED else 1
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    tail = tl.arange(0, VEC)
    lr_f, coef, decay = adamw_scalars(coef_ptr, lr_ptr, lr, weight_decay, CLIP, LR_TENSOR)
    s_lo = tl.load(seg_ptr + pid)
    s_hi = tl.load(seg_ptr + pid + 1)
    rows = seg_ptr + tl.num_programs(0) + 1
    pa_n, ga_n, ma_n, va_n, n_n, t_n = _adamw_seg(rows, addrs_ptr, nt, s_lo, s_hi, ESP, ESG,
                                                  ESM)
    for s in range(s_lo, s_hi):
        pa, ga, ma, va, n, t = pa_n, ga_n, ma_n, va_n, n_n, t_n
        # the next segment's row and addresses, loaded while this one streams
        pa_n, ga_n, ma_n, va_n, n_n, t_n = _adamw_seg(rows, addrs_ptr, nt, s + 1, s_hi, ESP,
                                                      ESG, ESM)
        step_size, bc2_sqrt = adamw_bias(bias_ptr, t, lr_f)
        pp = _as_ptr(pa, P, ALIGNED)
        gp = _as_ptr(ga, G, ALIGNED)
        mp = _as_ptr(ma, M, ALIGNED)
        vp = _as_ptr(va, M, ALIGNED)
        nv = (n // VEC) * VEC  # elements in whole vectors
        for off in tl.range(0, nv, BLOCK, num_stages=STAGES):
            o = off + lanes
            _adamw_block(pp + o, gp + o, mp + o, vp + o, o < nv, coef, decay, step_size,
                         bc2_sqrt, beta1, beta2, eps, MAXIMIZE)
        if n > nv:
            o = nv + tail
            _adamw_block(pp + o, gp + o, mp + o, vp + o, o < n, coef, decay, step_size,
                         bc2_sqrt, beta1, beta2, eps, MAXIMIZE)


# ======================================================================================
# plans (chunk tables) and their cache
# ======================================================================================


@dataclass
class Launch:
    key: object  # tl dtype (norm/scale) or element size (count_zeros)
    chunk_off: int
    n_chunks: int
    partial_off: int
    grid: int
    aligned: bool
    block: int
    es: int = 4  # element size in bytes
    table: torch.Tensor | None = None  # the plan's table from this launch's first chunk
    segs: torch.Tensor | None = None  # its norm segment table (:func:`_segments`; "float")


def evict_oldest(d: OrderedDict, size: int, keep) -> None:
    """Drop the oldest entries of the LRU ``d`` beyond ``size``, skipping those for which
    ``keep(key, value)`` is true (entries a captured CUDA graph reads)."""
    while len(d) > size:
        old = next((k for k, v in d.items() if not keep(k, v)), None)
        if old is None:
            return
        del d[old]


def plan_in_graph(_key, plan) -> bool:
    """Whether a captured CUDA graph reads ``plan``'s table (one of its address arrays was
    used during a capture): such a plan must stay alive."""
    return bool(plan.addr_sets.kept)


class AddressSets:
    """A plan's uploaded base-address arrays (int64, on the device), one per distinct tuple
    of addresses, the most recent ``size`` kept. An upload is a pinned, non-blocking copy.
    An array used while a CUDA graph is being captured is kept for good (the graph reads it
    on every replay); a tuple first seen inside a capture cannot be uploaded there, so it
    raises: run the same call once eagerly before capturing."""

    def __init__(self, device: torch.device, size: int = 8):
        self.device, self.size = device, size
        self.d: OrderedDict = OrderedDict()
        self.kept: set = set()

    def get(self, ptrs: tuple) -> torch.Tensor:
        capturing = (self.device.type == "cuda"
                     and torch.cuda.is_current_stream_capturing())
        t = self.d.get(ptrs)
        if t is None:
            if capturing:
                raise RuntimeError(
                    "linghe.optim: these tensors' addresses were not seen before the CUDA "
                    "graph capture; run the same call once eagerly before capturing "
                    "(linghe.optim.AdamW: prepare_step())")
            _host, t = _upload(np.asarray(ptrs, dtype=np.int64), self.device)
            self.d[ptrs] = t
            evict_oldest(self.d, self.size, lambda k, _v: k in self.kept)
        else:
            self.d.move_to_end(ptrs)
        if capturing:
            self.kept.add(ptrs)
        return t


@dataclass
class Plan:
    device: torch.device
    table: torch.Tensor  # int64 [n_chunks, 4] on device
    host_table: torch.Tensor  # pinned source of the upload (kept alive with the plan)
    launches: list[Launch]
    buckets: list[tuple[int, int]]  # (partial_off, n_partials) per bucket
    n_partials: int
    scratch: dict = field(default_factory=dict)
    addr_sets: AddressSets | None = None
    seg_host: torch.Tensor | None = None  # pinned source of the segment tables' upload

    def buffer(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A scratch device buffer reused across calls with this plan (partials, per-bucket
        accumulators, the clip coefficient): saves allocations on every step. Calls are
        ordered on the current stream, so reuse is safe there."""
        key = (name, n, dtype)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = empty(n, dtype=dtype, device=self.device)
        return buf


class Bound:
    """A plan bound to one list's addresses: ``addrs`` (int64 per slot, on the device) and
    every attribute of the :class:`Plan` (launches, scratch buffers, buckets)."""

    __slots__ = ("plan", "addrs")

    def __init__(self, plan, addrs: torch.Tensor):
        self.plan, self.addrs = plan, addrs

    def __getattr__(self, name):
        return getattr(self.plan, name)


_PLAN_CACHE: OrderedDict = OrderedDict()
_PLAN_CACHE_SIZE = 32


_DEPENDENT_CACHES: list = []  # the front ends' caches of validated inputs -> plans


def clear_plan_cache() -> None:
    """Drop every cached chunk table and validated-input entry (this just frees the tables
    and scratch buffers) but the plans a captured CUDA graph reads."""
    for k in [k for k, v in _PLAN_CACHE.items() if not plan_in_graph(k, v)]:
        del _PLAN_CACHE[k]
    for c in _DEPENDENT_CACHES:
        c.clear()


_DATA_PTR = torch.Tensor.data_ptr


class TensorListCache:
    """LRU cache of validated tensor lists (the front ends' steady-state fast path), keyed on
    the *identities* of the tensors (``tuple(map(id, ts))``: one cheap C-level map) and
    verified by their ``data_ptr`` (one more map). No tensor references are held: each entry
    keeps weak references whose callbacks drop the entry when any of its tensors is freed,
    so an id can never be confused with a later object's. Cost of a hit for 2000 tensors:
    two maps and a tuple hash, instead of five per-tensor maps (type, is_contiguous,
    data_ptr, numel, dtype) for a key built from the tensors' properties.

    Assumption: a live tensor's numel, dtype or contiguity change only together with its
    ``data_ptr`` (``set_``, ``.data =``, reallocation). In-place metadata changes that keep
    the pointer (``resize_`` to fewer elements, ``transpose_``, ``as_strided_``) are not
    detected: call :func:`clear_plan_cache` after them. ``None`` entries (parameters without
    a gradient) are allowed in the list and part of the key."""

    def __init__(self, size: int = 32):
        self.d: OrderedDict = OrderedDict()
        self.size = size
        _DEPENDENT_CACHES.append(self)

    def clear(self) -> None:
        self.d.clear()

    def get(self, extra, ts: list):
        """``(key, value or None)``; ``key`` is for :meth:`put` on a miss."""
        key = (extra, tuple(map(id, ts)))
        e = self.d.get(key)
        if e is None:
            return key, None
        ptrs, value, has_none, _tok, _refs = e
        live = [t for t in ts if t is not None] if has_none else ts
        if tuple(map(_DATA_PTR, live)) != ptrs:
            return key, None
        self.d.move_to_end(key)
        return key, value

    def put(self, key, ts: list, value) -> None:
        live = [t for t in ts if t is not None]
        tok = object()
        d = self.d

        def drop(_ref, key=key, tok=tok, d=d):
            e = d.get(key)
            if e is not None and e[3] is tok:
                d.pop(key, None)

        refs = [weakref.ref(t, drop) for t in live]
        d[key] = (tuple(map(_DATA_PTR, live)), value, len(live) != len(ts), tok, refs)
        d.move_to_end(key)
        if len(d) > self.size:
            d.popitem(last=False)


def _max_programs(device: torch.device) -> int:
    return num_sms(device) * PROGRAMS_PER_SM


def _chunks(sizes: np.ndarray, chunk: int = CHUNK
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tensor index, start element, length)`` of every ``chunk``-element chunk of
    tensors of ``sizes`` elements, tensor after tensor (empty tensors have none)."""
    nch = (sizes + chunk - 1) // chunk
    total = int(nch.sum())
    tid = np.repeat(np.arange(len(sizes)), nch)
    first = np.cumsum(nch) - nch
    start = (np.arange(total, dtype=np.int64) - np.repeat(first, nch)) * chunk
    return tid, start, np.minimum(chunk, sizes[tid] - start)


def _interleaved_segments(slots: np.ndarray, sizes: np.ndarray, G: int, piece: int,
                          extra: np.ndarray) -> np.ndarray:
    """A segment table in :func:`_segments`' format with a fourth column (rows ``(slot,
    start, length, extra)``; ``piece`` <= :data:`_MAX_SEGMENT`) whose program ``p`` takes
    pieces ``p, p + G, p + 2G, ...`` of the tensors cut
    into ``piece``-element pieces: the ``G`` programs sweep the tensors side by side, each
    working within a window of ``G`` pieces, instead of ``G`` shares far apart (which on
    a step's ~100 GB of optimizer state ran at half the bandwidth: address translation
    and DRAM locality of ~1000 distant streams)."""
    tid, start, length = _chunks(sizes, piece)
    prog = np.arange(len(tid)) % G
    order = np.argsort(prog, kind="stable")
    ptr = np.searchsorted(prog[order], np.arange(G + 1), side="left").astype(np.int64)
    rows = np.stack([slots[tid], start, length, extra[tid]], axis=1)[order]
    return np.concatenate([ptr, rows.ravel()])


#: Longest segment of a segment table (norm, AdamW), elements (the kernels count in int32).
_MAX_SEGMENT = 1 << 30
#: Program shares start on multiples of this many elements within a tensor (>= 16 bytes,
#: so every segment of an aligned tensor starts 16-byte aligned).
_SEG_ALIGN = 16


def _segments(slots: np.ndarray, sizes: np.ndarray, G: int) -> np.ndarray:
    """The norm's segment table of one launch: tensors ``slots`` of ``sizes`` elements
    (all > 0), viewed as one concatenated vector, cut into ``G`` contiguous shares of
    (nearly) equal size, each share's start moved back to a multiple of
    :data:`_SEG_ALIGN` within its tensor; a share is one or more segments (pieces of one
    tensor, at most :data:`_MAX_SEGMENT` long). Returns int64 ``[G + 1 + 3 * n_seg]``:
    program ``p``'s segments are rows ``ptr[p]:ptr[p + 1]`` of the ``(slot, start
    element, length)`` rows after the ``G + 1`` offsets ``ptr``."""
    cum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    total = int(cum[-1])
    share = -(-total // G)
    bounds = np.minimum(np.arange(G + 1, dtype=np.int64) * share, total)
    t = np.clip(np.searchsorted(cum, bounds, side="right") - 1, 0, len(sizes) - 1)
    bounds = cum[t] + (bounds - cum[t]) // _SEG_ALIGN * _SEG_ALIGN
    bounds[0], bounds[-1] = 0, total
    bounds = np.maximum.accumulate(bounds)
    cuts = [bounds, cum]
    for i in np.nonzero(sizes > _MAX_SEGMENT)[0]:  # split very long tensors
        cuts.append(np.arange(cum[i], cum[i + 1], _MAX_SEGMENT, dtype=np.int64))
    cuts = np.unique(np.concatenate(cuts))
    lo, hi = cuts[:-1], cuts[1:]
    tid = np.searchsorted(cum, lo, side="right") - 1
    prog = np.searchsorted(bounds, lo, side="right") - 1
    ptr = np.searchsorted(prog, np.arange(G + 1), side="left").astype(np.int64)
    rows = np.stack([slots[tid], lo - cum[tid], hi - lo], axis=1)
    return np.concatenate([ptr, rows.ravel()])


def _upload(table_np: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(host, device)`` copies of an int64 table: uploaded from pinned memory with a
    non-blocking copy (no host sync); the pinned source must live as long as the plan."""
    host = torch.from_numpy(np.ascontiguousarray(table_np))
    if device.type != "cuda":
        return host, host
    host = host.pin_memory()
    return host, host.to(device, non_blocking=True)


def _build_plan(kind: str, buckets: list[list[torch.Tensor]], device: torch.device,
                aligned: bool) -> Plan:
    """Chunk table for ``buckets`` (lists of tensors; slots numbered across the buckets in
    order). ``kind`` = "float" (group by dtype, for norm/scale) or "bits" (group by element
    size, for count_zeros). ``aligned``: every tensor starts 16-byte aligned."""
    groups: OrderedDict = OrderedDict()  # (bucket, key) -> list[(slot, numel, flag)]
    segs: list[np.ndarray] = []
    slot = 0
    for b, ts in enumerate(buckets):
        for t in ts:
            n = t.numel()
            if n:
                es = t.element_size()
                if kind == "float":
                    key = t.dtype
                    flag = 0
                else:
                    key = es
                    flag = ((1 << (8 * es - 1)) - 1) if (t.dtype.is_floating_point
                                                         or t.dtype.is_complex) else -1
                groups.setdefault((b, key), []).append((slot, n, flag))
            slot += 1
        groups.setdefault((b, None), [])  # keeps empty buckets visible
    max_prog = _max_programs(device)
    rows = []
    launches: list[Launch] = []
    bucket_ranges = [[0, 0] for _ in buckets]
    chunk_off = 0
    partial_off = 0
    for b in range(len(buckets)):
        bucket_ranges[b][0] = partial_off
        for (bb, key), items in groups.items():
            if bb != b or key is None or not items:
                continue
            arr = np.asarray(items, dtype=np.int64)
            slots, sizes, flags = arr[:, 0], arr[:, 1], arr[:, 2]
            tid, start, length = _chunks(sizes)
            total = len(tid)
            if kind == "float":
                es = torch.empty((), dtype=key).element_size()
                tl_key = _TL_DTYPE[key]
            else:
                es = key
                tl_key = _INT_BY_SIZE[key]
            rows.append(np.stack([slots[tid], start, length, flags[tid]], axis=1))
            grid = min(total, max_prog)
            launches.append(Launch(tl_key, chunk_off, total, partial_off, grid, aligned,
                                   _block(es, kind), es))
            if kind == "float":
                segs.append(_segments(slots, sizes, grid))
            chunk_off += total
            partial_off += grid
        bucket_ranges[b][1] = partial_off - bucket_ranges[b][0]
    table_np = (np.concatenate(rows, axis=0) if rows else np.zeros((0, 4), dtype=np.int64))
    host, table = _upload(table_np, device)
    for ln in launches:
        ln.table = table[ln.chunk_off:]
    seg_host = None
    if segs:  # one upload for all launches' segment tables
        seg_host, seg_table = _upload(np.concatenate(segs), device)
        off = 0
        for ln, sg in zip(launches, segs):
            ln.segs = seg_table[off:]
            off += len(sg)
    return Plan(device, table, host, launches, [tuple(r) for r in bucket_ranges], partial_off,
                addr_sets=AddressSets(device), seg_host=seg_host)


@dataclass
class AdamWLaunch:
    key: tuple  # (param, grad, moment) tl dtypes
    es: tuple  # their element sizes
    grid: int
    aligned: bool
    segs: torch.Tensor  # this launch's segment table (:func:`_interleaved_segments`)


@dataclass
class AdamWPlan:
    seg_host: torch.Tensor  # pinned source of the upload (kept alive with the plan)
    launches: list[AdamWLaunch]
    nt: int  # tensors (slots)
    addr_sets: AddressSets


def build_adamw_plan(params: list[torch.Tensor], grads: list[torch.Tensor],
                     exp_avgs: list[torch.Tensor], index: list[int], device: torch.device,
                     aligned: bool) -> AdamWPlan:
    """The AdamW segment tables of contiguous, same-size ``params[i], grads[i],
    exp_avgs[i]`` (and the exp_avg_sqs, of the moments' dtype) in slots ``i``;
    ``index[i]``: the tensor's row in the bias corrections; one launch per dtype
    combination, whose programs take interleaved pieces of its elements. The
    addresses are bound per call (:meth:`AddressSets.get` of ``params + grads + exp_avgs +
    exp_avg_sqs`` pointers); ``aligned``: all of them 16-byte aligned."""
    groups: OrderedDict = OrderedDict()
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs)):
        if p.numel():
            key = (p.dtype, g.dtype, m.dtype)
            groups.setdefault(key, []).append((i, p.numel(), index[i]))
    max_prog = num_sms(device) * ADAMW_CONFIG["programs_per_sm"]
    piece = ADAMW_CONFIG["piece"]
    if piece % _SEG_ALIGN or not 0 < piece <= _MAX_SEGMENT:
        # (segment starts must stay 16-byte aligned for ALIGNED; lengths fit int32)
        raise ValueError(f"ADAMW_CONFIG['piece'] must be a positive multiple of "
                         f"{_SEG_ALIGN} up to {_MAX_SEGMENT}, got {piece}")
    segs, specs = [], []
    for (pd, gd, md), items in groups.items():
        arr = np.asarray(items, dtype=np.int64)
        # A group smaller than the resident grid's pieces takes smaller pieces (a
        # multiple of 16 elements), so that every program gets work.
        share = cdiv(cdiv(int(arr[:, 1].sum()), max_prog), _SEG_ALIGN) * _SEG_ALIGN
        unit = min(piece, share)
        grid = min(int(((arr[:, 1] + unit - 1) // unit).sum()), max_prog)
        segs.append(_interleaved_segments(arr[:, 0], arr[:, 1], grid, unit, arr[:, 2]))
        es = tuple(torch.empty((), dtype=d).element_size() for d in (pd, gd, md))
        specs.append(((_TL_DTYPE[pd], _TL_DTYPE[gd], _TL_DTYPE[md]), es, grid))
    host, table = _upload(np.concatenate(segs) if segs else np.zeros(0, dtype=np.int64),
                          device)
    launches, off = [], 0
    for (key, es, grid), sg in zip(specs, segs):
        launches.append(AdamWLaunch(key, es, grid, aligned, table[off:]))
        off += len(sg)
    return AdamWPlan(host, launches, len(params), AddressSets(device))


def get_plan(kind: str, buckets: list[list[torch.Tensor]], device: torch.device) -> Bound:
    """Cached :func:`_build_plan` (keyed on ``(numel, dtype)`` of every tensor and whether
    all are 16-byte aligned), bound to these tensors' addresses."""
    ptrs = tuple(t.data_ptr() for ts in buckets for t in ts)
    aligned = not any(p % 16 for p in ptrs)
    key = (kind, device, aligned, tuple(tuple((t.numel(), t.dtype) for t in ts)
                                        for ts in buckets))
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        _PLAN_CACHE.move_to_end(key)
    else:
        plan = _PLAN_CACHE[key] = _build_plan(kind, buckets, device, aligned)
        evict_oldest(_PLAN_CACHE, _PLAN_CACHE_SIZE, plan_in_graph)
    return Bound(plan, plan.addr_sets.get(ptrs))


# ======================================================================================
# launchers
# ======================================================================================


def norm_partials(plan: Bound, p: float, acc_dtype: torch.dtype) -> torch.Tensor:
    """Run the partial-norm launches of ``plan``; returns ``partials [plan.n_partials]``."""
    mode = norm_mode(p)
    partials = plan.buffer("partials", max(plan.n_partials, 1), acc_dtype)
    acc_tl = _TL_DTYPE[acc_dtype]
    with device_guard(plan.table):
        for ln in plan.launches:
            part = partials[ln.partial_off:]
            opts = _norm_launch_opts(ln.es, ln.aligned)
            launch(_norm_partials_kernel, (ln.grid,),
                ln.segs if opts["SEGMENTS"] else ln.table, plan.addrs, ln.n_chunks, part,
                float(p), part, part, part, 0.0, DTYPE=ln.key, ES=ln.es, ACC=acc_tl,
                MODE=mode, IDENT=_ident(mode), ALIGNED=ln.aligned, **opts)
    return partials


def norm_single_launch(plan: Bound, p: float, acc_dtype: torch.dtype, *, norm_out: torch.Tensor,
                       coef_out: torch.Tensor | None = None, max_norm: float = 0.0) -> None:
    """For a plan of exactly one launch (one dtype, not distributed): partials, the final
    reduce, the norm and the clip coefficient in that one launch (``LAST``)."""
    (ln,) = plan.launches
    mode = norm_mode(p)
    partials = plan.buffer("partials", max(plan.n_partials, 1), acc_dtype)
    counter = plan.scratch.get("counter")
    if counter is None:  # zeroed once; the last program of every launch resets it
        counter = plan.scratch["counter"] = torch.zeros(1, dtype=torch.int32,
                                                        device=plan.device)
    coef = coef_out if coef_out is not None else norm_out
    opts = _norm_launch_opts(ln.es, ln.aligned)
    with device_guard(plan.table):
        launch(_norm_partials_kernel, (ln.grid,),
            ln.segs if opts["SEGMENTS"] else ln.table, plan.addrs, ln.n_chunks, partials,
            float(p), counter, norm_out, coef, float(max_norm), DTYPE=ln.key, ES=ln.es,
            ACC=_TL_DTYPE[acc_dtype], MODE=mode, IDENT=_ident(mode), ALIGNED=ln.aligned, LAST=True,
            COEF=coef_out is not None, RBLOCK=REDUCE_BLOCK, **opts)


def reduce_partials(partials: torch.Tensor, off: int, n: int, p: float, *, acc_out: torch.Tensor,
                    norm_out: torch.Tensor | None = None, coef_out: torch.Tensor | None = None,
                    max_norm: float = 0.0) -> None:
    """Reduce ``partials[off:off+n]`` into ``acc_out[0]`` (and optionally finish)."""
    mode = norm_mode(p)
    finish = norm_out is not None
    with device_guard(partials):
        launch(_norm_reduce_kernel, (1,),
            partials[off:], n, acc_out, norm_out if finish else acc_out,
            coef_out if coef_out is not None else acc_out, float(p), float(max_norm),
            ACC=_TL_DTYPE[partials.dtype], MODE=mode, IDENT=_ident(mode), FINISH=finish,
            COEF=coef_out is not None, BLOCK=REDUCE_BLOCK, num_warps=4)


def finish_norm(accs: torch.Tensor, p: float, *, norm_out: torch.Tensor,
                coef_out: torch.Tensor | None = None, max_norm: float = 0.0) -> None:
    """Combine per-bucket accumulators ``accs [B]`` into the norm (and coefficient)."""
    mode = norm_mode(p)
    with device_guard(accs):
        launch(_norm_finish_kernel, (1,),
            accs, accs.numel(), norm_out, coef_out if coef_out is not None else norm_out,
            float(p), float(max_norm), ACC=_TL_DTYPE[accs.dtype], MODE=mode, IDENT=_ident(mode),
            COEF=coef_out is not None, BLOCK=max(16, next_power_of_2(accs.numel())),
            num_warps=1)


def scale_(plan: Bound, coef: torch.Tensor) -> None:
    """Multiply every tensor of ``plan`` in place by ``coef[0]`` (a device scalar)."""
    with device_guard(plan.table):
        for ln in plan.launches:
            ct = tl.float64 if ln.key == tl.float64 else tl.float32
            launch(_scale_kernel, (ln.grid,), ln.table, plan.addrs, ln.n_chunks, coef,
                   DTYPE=ln.key, ES=ln.es, CT=ct, BLOCK=ln.block, ALIGNED=ln.aligned,
                   num_warps=NUM_WARPS)


def adamw_advance(steps: torch.Tensor, inc: torch.Tensor | None, betas: torch.Tensor,
                  bias: torch.Tensor) -> None:
    """Advance the float32 ``steps [n]`` by 1 (or by ``inc [n]`` float32) and write the bias
    corrections ``bias [n, 2]`` float32 of the new counts (``betas [2]`` float64)."""
    n = steps.numel()
    if n:
        with device_guard(steps):
            launch(_adamw_advance_kernel, (cdiv(n, 1024),), steps,
                   inc if inc is not None else steps, betas, bias, n,
                   HAS_INC=inc is not None, BLOCK=1024, num_warps=4)


def adamw_(plan: AdamWPlan, addrs: torch.Tensor, bias: torch.Tensor, *, lr, beta1: float,
           beta2: float, eps: float, weight_decay: float, maximize: bool,
           coef: torch.Tensor | None) -> None:
    """Run the AdamW launches of ``plan`` on the tensors at ``addrs [4, nt]`` (from
    ``plan.addr_sets``); ``bias [n, 2]`` the bias corrections of each tensor row of the
    table (:func:`adamw_advance`); ``lr`` a float or a 1-element float tensor on the device;
    ``coef`` the clip coefficient ``[1]`` fp32 or None."""
    lr_tensor = isinstance(lr, torch.Tensor)
    cfg = ADAMW_CONFIG
    with device_guard(bias):
        for ln in plan.launches:
            P, G, M = ln.key
            ESP, ESG, ESM = ln.es
            launch(_adamw_kernel, (ln.grid,), ln.segs, addrs, plan.nt, bias,
                   coef if coef is not None else bias, lr if lr_tensor else bias,
                   0.0 if lr_tensor else float(lr), float(beta1), float(beta2), float(eps),
                   float(weight_decay), P=P, G=G, M=M, ESP=ESP, ESG=ESG, ESM=ESM,
                   BLOCK=adamw_block(ln.es), STAGES=cfg["stages"],
                   ALIGNED=ln.aligned, CLIP=coef is not None, LR_TENSOR=lr_tensor,
                   MAXIMIZE=bool(maximize), num_warps=cfg["warps"])


def count_zeros_partials(plan: Bound) -> torch.Tensor:
    partials = empty(max(plan.n_partials, 1), dtype=torch.int64, device=plan.device)
    if plan.n_partials == 0:
        partials.zero_()
    with device_guard(plan.table):
        for ln in plan.launches:
            launch(_count_zeros_kernel, (ln.grid,), ln.table, plan.addrs, ln.n_chunks,
                   partials[ln.partial_off:], ITYPE=ln.key, ES=ln.es,
                   BLOCK=ln.block, ALIGNED=ln.aligned,
                   num_warps=NUM_WARPS)
    return partials


__all__ = ["CHUNK", "INTERPRET", "cdiv", "clear_plan_cache", "get_plan", "TensorListCache",
           "evict_oldest", "plan_in_graph",
           "adamw_", "adamw_advance", "build_adamw_plan", "norm_partials", "norm_single_launch",
           "reduce_partials", "finish_norm", "scale_", "count_zeros_partials", "NORM_DTYPES"]
