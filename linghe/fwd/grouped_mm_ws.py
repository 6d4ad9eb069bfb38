"""Warp-specialized grouped GEMMs for sm_90 (Gluon): the FP8 blockwise rows GEMM
(forward and dgrad) and wgrad over segment groups, and the bf16/fp16 rows GEMM and wgrad
(over one or several operand pairs: :func:`launch_hp_wgrad_ws`).

The same product as :func:`linghe.fwd.grouped_mm.launch_grouped_rows` with FP8
operands (``out[r] = a[r] @ B_e`` over expert segments, 1x128 row scales, 128x128
weight scales, each 128-deep K step promoted in fp32: ``acc += dot(a_q, b_q) * sa *
sb``), scheduled the way Hopper FP8 GEMMs are fast with promotion:

- one persistent program per SM walks the output tiles (grouped order, ``GROUP_M`` row
  tiles sweep the column tiles together so their weight tiles stay in L2);
- a loader warp issues the TMA copies of each K step's ``[BM, 128]`` rows box and
  ``[BN, 128]`` weight box into a ring of ``STAGES`` shared-memory buffers (mbarriers
  ``ready``/``empty``), running ahead across K steps and tiles;
- two consumer warpgroups each take ``BM / 2`` rows of the box (64-row tiles: half the
  columns each): issue the step's ``wgmma``, wait for it, release the buffer and
  promote. One's promotion (fp32 FMAs on the CUDA cores) can overlap the other's MMA;
  each holds only its half of the accumulator and one ``64 x 128`` product tile (128
  rows share each weight box: half the weight traffic of 64-row tiles, without Triton's
  one-program-per-SM limit for a promoted 128-row tile). Forcing the two to take turns
  at the MMAs (an mbarrier pair, handed over at the issue or at the completion) was
  nowhere faster (the wgrad 16-24% slower); promoting one step while the next step's
  MMA runs cannot overlap (ptxas serializes the wgmma: C7514, an accumulator read inside
  the pipeline stage). So each step stays MMA, wait, promote.
- each consumer's output part leaves through its shared-memory buffers and a TMA copy
  that is waited for only before the buffers are written again, so the store overlaps
  the next tile's K loop (``TMA_STORE``; a part ending inside the next expert's rows is
  stored masked from registers). H200, the e2e's shapes: 2-7% faster than the register
  stores, the same bits (``benchmark/results/h200_probe_ws_tma_store_*``). At 128x256
  tiles a consumer's two 128-column parts share one buffer (``STORE_BUFS``: the second
  waits for the first to leave it), which makes room for a fourth ring stage: FP8 2-8%
  faster than three stages (``h200_probe_ws_rows_four_stages_*``).
- the loader warp also computes the tile schedule and hands each tile's ``(expert,
  column tile, rows, K steps)`` to the consumers through shared-memory slots
  (:func:`_tile_slots`), so the consumers' tile boundaries hold no cross-warp
  reductions or dependent loads (source-level Nsight Compute: they were ~13% of the
  consumers' stall samples; FP8 2-6% faster, ``h200_probe_ws_rows_schedule_handover_*``).

Same tile schedule as the Triton kernel (expert tiles, then tail tiles that store zeros),
computed the same way inside each program from ``offsets`` (no launch of its own), same
promotion arithmetic. The wgrad (:func:`launch_fp8_wgrad_ws`)
is built the same way over ``dW_e`` tiles, one 128-token group per step, and the
bf16/fp16 rows GEMM (:func:`launch_hp_rows_ws`, forward and dgrad) is the rows kernel
without the promotion: each consumer's ``64 x BN`` wgmma chains into one accumulator,
one K step in flight while the previous one's stage is released. Gluon kernels
do not run in the CPU interpreter: the Triton kernels are the fallback there and on
other GPUs (:func:`ws_capable`), and the GPU tests compare the FP8 kernels with them
bit for bit (the 16-bit kernel, whose fp32 sums run in another order, against the fp32
product).
"""

from __future__ import annotations

import os

import torch

try:  # Gluon: triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    # the TMA copies are ``async_load``/``async_store`` from triton 3.7 on (3.6:
    # async_copy_global_to_shared / async_copy_shared_to_global)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # a partition's barrier: ``gl.barrier`` from triton 3.7 on (3.6: ``thread_barrier``)
    _partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
except (ImportError, AttributeError):  # pragma: no cover - triton without (this) Gluon
    gluon = None

from ..utils import INTERPRET, cdiv, cuda_capability, device_guard, launch, next_power_of_2, num_sms

#: Take the warp-specialized kernels for the FP8 rows GEMMs and the segment-group wgrad
#: where they can run (:func:`ws_capable`); ``LINGHE_FP8_WS=0`` keeps the Triton kernels
#: everywhere. (Read through ``linghe.fwd.grouped_mm.FP8_WS``, which re-exports it.)
FP8_WS: bool = os.environ.get("LINGHE_FP8_WS", "1") == "1"
#: The same for the bf16/fp16 grouped GEMMs of the Triton backend (forward, dgrad and
#: wgrad): ``LINGHE_HP_WS=0`` keeps the Triton kernels and ``torch._grouped_mm`` there.
HP_WS: bool = os.environ.get("LINGHE_HP_WS", "1") == "1"

#: Base settings: 128 rows (64 per consumer warpgroup) x 128 columns, 4 stages (32 KiB
#: each), the second consumer warpgroup at 232 registers, the loader warp at 40 (the
#: first, Gluon's default partition, gets what ``MAXNREG`` x 12 warps leaves: 208 at
#: 160); ``TMA_STORE``: the output tiles leave through shared memory and TMA copies that
#: overlap the next tile (where the output allows: :func:`_store_descriptor`), through a
#: buffer a consumer warpgroup for each of its 128-column parts, or one for both where
#: those do not fit beside the ring (:func:`launch_fp8_rows_ws`). :func:`ws_config` picks
#: the tiles by shape.
WS_CONFIG = dict(BM=128, BN=128, STAGES=4, GROUP_M=8, CONSUMER_REGS=232, MAXNREG=160,
                 TMA_STORE=True)
#: The tiles it takes: 128-row tiles split by rows between the two consumer warpgroups,
#: 64-row tiles split by columns.
WS_TILES = ((128, 128), (128, 256), (64, 128), (64, 256))
#: (BM, BN, STAGES) that fit shared memory (the ring, and the TMA-store epilogue's
#: buffers or the register stores' layout conversion); 128x256 also takes a fourth stage,
#: beside one store buffer a consumer (:func:`ws_config`).
WS_TILES_STAGES = ((128, 128, 4), (128, 256, 3), (64, 128, 5), (64, 256, 4))


def ws_config(R: int, E: int, I: int, J: int, device: torch.device | None = None) -> dict:
    """Tiles by shape (``R`` rows, ``E`` experts, contraction ``I``, output columns ``J``):
    128x256 (each consumer warpgroup 64x256 as two 128-column MMAs; 4 stages beside one
    store buffer a consumer, 3 beside two), except
    with few rows per expert, a long contraction and a wide output (256 experts' gate_up
    forward) on an H100-class GPU, where 128x128 (:func:`_large_memory`). H100, 8192
    tokens top-8, µs (vs ``torch._grouped_mm`` bf16;
    Triton rows kernel): E = 32 gate_up fwd 504 (1.58x; Triton 721), dgrad 504 (1.58x;
    736), down fwd 287 (1.50x; 383), dgrad 271 (1.54x; 368); E = 256 gate_up fwd 798 at
    128x128 (1.52x; 858; 893 at 128x256), dgrad 812 (1.48x; 873), down fwd 396 (1.66x;
    480), dgrad 409 (1.53x; 446); ``benchmark/results/h100_probe_fp8_ws_tiles_*``."""
    if R < 512 * E and I >= 2048 and J >= 2048 and not _large_memory(device):
        return dict(WS_CONFIG)
    return dict(WS_CONFIG, BN=256, STAGES=4)


def _large_memory(device) -> bool:
    """An H200-class GPU (>= 100 GiB: HBM3e, 4.8 TB/s), where 128x256 tiles win at 256
    experts' gate_up too (691 against 762 µs; on the H100, 80 GiB, 890 against 804)."""
    if device is None or device.type != "cuda":
        return False
    large = _LARGE_MEMORY.get(device)
    if large is None:
        large = _LARGE_MEMORY[device] = (
            torch.cuda.get_device_properties(device).total_memory >= 100 << 30)
    return large


_LARGE_MEMORY: dict = {}


def ws_capable(t: torch.Tensor) -> bool:
    """Whether the warp-specialized kernel can run on ``t``'s device: Gluon available,
    a CUDA sm_90 GPU (wgmma; not the interpreter)."""
    return (gluon is not None and not INTERPRET and t.device.type == "cuda"
            and cuda_capability(t.device)[0] == 9)


if gluon is not None:

    @gluon.jit
    def _ring(a_desc, b_desc, STAGES: gl.constexpr):
        """The operand ring: ``STAGES`` boxes of each operand in shared memory and their
        barriers, ``ready`` (the loader's TMA copies landed) and ``empty`` (both
        consumer warpgroups are done with the stage: two arrivals)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                           b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        return a_bufs, b_bufs, ready, empty

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _schedule(offsets_ptr, R, E, BM: gl.constexpr, EP2: gl.constexpr, NW: gl.constexpr):
        """The expert tile schedule, made once by each partition (``NW`` warps) of each
        program from ``offsets`` (``E + 1`` int32, L2-resident; no launch of its own; the
        loader walks the tiles with it, the consumers take only ``n_m``):
        ``(cum, n_m)``, ``cum [EP2]`` the inclusive sum of the experts' ``cdiv(segment,
        BM)`` row tiles (``EP2 / 32 / NW`` registers a thread), and the row tiles: the
        experts' then the tail's past ``offsets[E]`` (zeros stored). The Triton kernel's
        :func:`~linghe.fwd.grouped_mm.tile_schedule`, same order."""
        gl.static_assert(EP2 >= 32 * NW, "EP2: at least one expert slot a thread")
        idx = gl.arange(0, EP2, layout=gl.BlockedLayout([1], [32], [NW], [0]))
        m = idx < E
        lo = gl.load(offsets_ptr + idx, mask=m, other=0)
        hi = gl.load(offsets_ptr + idx + 1, mask=m, other=0)
        # (past E: the total, which no row tile t < total reaches)
        cum = gl.associative_scan(gl.where(m, (hi - lo + (BM - 1)) // BM, 0), 0, _add)
        n_m = gl.max(cum, 0) + gl.cdiv(R - gl.load(offsets_ptr + E), BM)
        return cum, n_m

    @gluon.jit
    def _tile(tile, n_m, num_n, cum, offsets_ptr, R, I, E, BM: gl.constexpr,
              BK: gl.constexpr, GROUP_M: gl.constexpr):
        """Output tile ``tile`` (grouped order) -> ``(expert, column tile, first row, row
        end, K steps)``; a tail tile (expert ``E``) has no K steps and ends at ``R``. The
        row tile ``t``'s expert: the experts whose tiles all come before it, counted
        (``cum <= t``); its first tile: the largest such running sum (``cum`` does not
        decrease); both in one reduction."""
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        size_m = gl.minimum(n_m - first_m, GROUP_M)
        t = first_m + (tile % width) % size_m
        pid_n = (tile % width) // size_m
        before = cum <= t
        e, first = gl.reduce((before.to(gl.int32), gl.where(before, cum, 0)), 0, _count_max)
        e = gl.minimum(e, E)  # (slots past E hold the total: counted only for a tail tile)
        valid = e < E
        start = gl.load(offsets_ptr + e) + (t - first) * BM
        end = gl.where(valid, gl.load(offsets_ptr + gl.minimum(e + 1, E)), R)
        k_tiles = gl.where(valid, gl.cdiv(I, BK), 0)
        return gl.minimum(e, E - 1), pid_n, start, end, k_tiles

    @gluon.jit
    def _count_max(n0, c0, n1, c1):
        """Combine of :func:`_tile`'s reduction: count the flags, keep the largest sum."""
        return n0 + n1, gl.maximum(c0, c1)

    @gluon.jit
    def _tile_slots(NSLOT: gl.constexpr):
        """The schedule's hand-over: ``NSLOT`` slots of one tile's ``(expert, column
        tile, first row, row end, K steps)`` (int32, padded to 8) that the loader warp
        fills (:func:`_publish_tile`) and both consumer warpgroups read
        (:func:`_take_tile`), with barriers ``tile_ready`` (the loader wrote the slot)
        and ``tile_free`` (both consumers read it: two arrivals)."""
        info = gl.allocate_shared_memory(gl.int32, [NSLOT, 8],
                                         gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tile_ready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1],
                                               mbarrier.MBarrierLayout())
        tile_free = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NSLOT):
            mbarrier.init(tile_ready.index(s), count=1)
            mbarrier.init(tile_free.index(s), count=2)
        return info, tile_ready, tile_free

    @gluon.jit
    def _publish_tile(info, tile_ready, tile_free, j, ec, pid_n, start, end, k_tiles,
                      NSLOT: gl.constexpr):
        """Loader side of the hand-over: the ``j``-th tile of this program into its slot,
        once both consumers have read the slot's previous tile."""
        slot = j % NSLOT
        mbarrier.wait(tile_free.index(slot), ((j // NSLOT) & 1) ^ 1)
        f = gl.arange(0, 8, layout=gl.BlockedLayout([8], [32], [1], [0]))
        v = gl.where(f == 0, ec, gl.where(f == 1, pid_n, gl.where(f == 2, start, gl.where(
            f == 3, end, k_tiles))))
        info.index(slot).store(v)
        # (every lane's write is done before the one arrive that releases them)
        _partition_barrier()
        mbarrier.arrive(tile_ready.index(slot), count=1)

    @gluon.jit
    def _take_tile(info, tile_ready, tile_free, j, NSLOT: gl.constexpr):
        """Consumer side (a 4-warp partition): the ``j``-th tile's ``(expert, column
        tile, first row, row end, K steps)``, read from its slot (each thread holds the
        whole slot: the fields are in-thread sums), and the slot released."""
        slot = j % NSLOT
        mbarrier.wait(tile_ready.index(slot), (j // NSLOT) & 1)
        whole: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
        f = gl.arange(0, 8, layout=whole)
        v = info.index(slot).load(whole)
        # (every thread has read the slot before the one arrive that frees it)
        _partition_barrier()
        mbarrier.arrive(tile_free.index(slot), count=1)
        return (gl.sum(gl.where(f == 0, v, 0), 0), gl.sum(gl.where(f == 1, v, 0), 0),
                gl.sum(gl.where(f == 2, v, 0), 0), gl.sum(gl.where(f == 3, v, 0), 0),
                gl.sum(gl.where(f == 4, v, 0), 0))

    @gluon.jit
    def _ws_load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, info, tile_ready, tile_free,
                 offsets_ptr, R, I, J, E, b_row_e, b_col_e, BM: gl.constexpr,
                 BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                 STAGES: gl.constexpr, EP2: gl.constexpr, NSLOT: gl.constexpr,
                 B_NMAJOR: gl.constexpr):
        """Loader warp: the schedule (each tile handed to the consumers before its
        loads: :func:`_publish_tile`; one warp's reductions are shuffles, no barrier)
        and the TMA copies of every K step of this program's tiles (``B_NMAJOR``: ``b``
        as ``[E*I, J]``, ``[BK, BN]`` boxes, output dim contiguous)."""
        cum, n_m = _schedule(offsets_ptr, R, E, BM, EP2, 1)
        num_n = gl.cdiv(J, BN)
        it = 0
        j = 0
        for tile in range(gl.program_id(0), n_m * num_n, gl.num_programs(0)):
            ec, pid_n, start, end, k_tiles = _tile(tile, n_m, num_n, cum, offsets_ptr, R, I,
                                                   E, BM, BK, GROUP_M)
            _publish_tile(info, tile_ready, tile_free, j, ec, pid_n, start, end, k_tiles,
                          NSLOT)
            j += 1
            b_row = ec * b_row_e + pid_n * BN
            b_col = ec * b_col_e
            for kk in range(k_tiles):
                st = it % STAGES
                mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(st)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [start, kk * BK], bar, a_bufs.index(st))
                if B_NMAJOR:
                    _tma_load(b_desc, [ec * b_row_e + kk * BK, pid_n * BN], bar,
                              b_bufs.index(st))
                else:
                    _tma_load(b_desc, [b_row, b_col + kk * BK], bar, b_bufs.index(st))
                it += 1

    @gluon.jit
    def _ws_consume(a_bufs, b_bufs, ready, empty, info, tile_ready, tile_free, c_ptr, c_desc,
                    c_bufs, as_ptr, bs_ptr, offsets_ptr, R, I, J, E, stride_cm, stride_asr,
                    stride_ask, bs_se, bs_si, bs_sj, WG: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                    SPLIT_N: gl.constexpr, EP2: gl.constexpr, NSLOT: gl.constexpr,
                    TMA_STORE: gl.constexpr, STORE_BUFS: gl.constexpr):
        """Consumer warpgroup ``WG`` of each tile's ``[WM, WN]`` part: rows ``WG * BM/2``
        on (``SPLIT_N`` off: ``WM = BM/2``, ``WN = BN``) or columns ``WG * BN/2`` on
        (``SPLIT_N``: ``WM = BM``, ``WN = BN/2``). Per K step: MMA, wait, release, promote,
        in sub-MMAs of at most 128 columns (each with its weight scale and accumulator,
        so no more than one ``WM x 128`` product tile is live); then the store
        (:func:`_epilogue`)."""
        WM: gl.constexpr = BM if SPLIT_N else BM // 2
        WN: gl.constexpr = BN // 2 if SPLIT_N else BN
        SUB: gl.constexpr = 128 if WN > 128 else WN
        TWO: gl.constexpr = WN // SUB == 2
        R_OFF: gl.constexpr = 0 if SPLIT_N else WG * WM
        C_OFF: gl.constexpr = WG * WN if SPLIT_N else 0
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, SUB, 32])
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // SUB, SUB // 8], [4, 1],
                                               [1, 0])
        # (the loader's row tile count, by the same function: the same count, tile for
        # tile, even for offsets that decrease)
        _, n_m = _schedule(offsets_ptr, R, E, BM, EP2, 4)
        num_n = gl.cdiv(J, BN)
        it = 0
        # (this program's tiles: those from program_id on, num_programs apart)
        for j in range(gl.cdiv(n_m * num_n - gl.program_id(0), gl.num_programs(0))):
            ec, pid_n, start, end, k_tiles = _take_tile(info, tile_ready, tile_free, j, NSLOT)
            row0 = start + R_OFF
            col0 = pid_n * BN + C_OFF
            rows = row0 + gl.arange(0, WM, layout=gl.SliceLayout(1, mma))
            rmask = (rows < end) & (rows < R)
            sa_ptrs = as_ptr + rows.to(gl.int64) * stride_asr
            sb_ptr = bs_ptr + ec.to(gl.int64) * bs_se + (col0 // 128) * bs_sj
            acc0 = gl.zeros((WM, SUB), gl.float32, mma)
            acc1 = gl.zeros((WM, SUB), gl.float32, mma)
            for kk in range(k_tiles):
                st = it % STAGES
                sa = gl.load(sa_ptrs + kk * stride_ask, mask=rmask, other=1.0)
                # (a column-split tile's second half may start past J: no scale block)
                sb0 = gl.load(sb_ptr + kk * bs_si, mask=col0 < J, other=1.0)
                mbarrier.wait(ready.index(st), (it // STAGES) & 1)
                a_view = a_bufs.index(st)
                if not SPLIT_N:
                    a_view = a_view.slice(R_OFF, WM)
                b_view = b_bufs.index(st)
                # use_acc=False: the accumulator operand only gives the result's layout
                prod = warpgroup_mma(a_view, b_view.slice(C_OFF, SUB).permute((1, 0)),
                                     gl.zeros((WM, SUB), gl.float32, mma), use_acc=False,
                                     is_async=True)
                prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                if TWO:
                    acc0 = acc0 + prod * gl.expand_dims(sa * sb0, 1)
                    # (the second sub-tile may lie past J: its scale block may not exist)
                    sb1 = gl.load(sb_ptr + bs_sj + kk * bs_si, mask=col0 + SUB < J, other=1.0)
                    prod = warpgroup_mma(a_view, b_view.slice(C_OFF + SUB, SUB).permute((1, 0)),
                                         gl.zeros((WM, SUB), gl.float32, mma), use_acc=False,
                                         is_async=True)
                    prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                    mbarrier.arrive(empty.index(st), count=1)
                    acc1 = acc1 + prod * gl.expand_dims(sa * sb1, 1)
                else:
                    mbarrier.arrive(empty.index(st), count=1)
                    acc0 = acc0 + prod * gl.expand_dims(sa * sb0, 1)
                it += 1
            _epilogue(c_ptr, c_desc, c_bufs, acc0, acc1, row0, col0, end, R, J, stride_cm,
                      WG, WM, SUB, TWO, TMA_STORE, STORE_BUFS if TWO else 1, mma, out_l)
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _epilogue(c_ptr, c_desc, c_bufs, acc0, acc1, row0, col0, end, R, J, stride_cm,
                  WG: gl.constexpr, WM: gl.constexpr, W: gl.constexpr, TWO: gl.constexpr,
                  TMA_STORE: gl.constexpr, NB: gl.constexpr, mma: gl.constexpr,
                  out_l: gl.constexpr):
        """A consumer's store of its ``[WM, W]`` part (and, ``TWO``, of ``acc1`` beside
        it). ``TMA_STORE``: a part whose rows all belong to the tile's segment (or end
        at ``R``, where TMA clips) goes through this warpgroup's shared-memory buffers
        and a TMA copy, waited for only before the buffers are written again (the next
        tile's epilogue), so the store overlaps the next tile's K loop; a part that ends
        inside the next expert's rows is stored masked, from the MMA's layout (no
        layout conversion, whose scratch would not fit beside the ring). Else the
        masked store through a coalescing layout (:func:`_store_rows`)."""
        if TMA_STORE:
            if (row0 + WM <= end) | (end >= R):  # (TMA clips the rows past R)
                _tma_store_parts(c_desc, c_bufs, acc0, acc1, row0, col0, W, WG, TWO, NB)
            else:
                _store_rows(c_ptr, acc0, acc1, row0, col0, end, R, J, stride_cm, WM, W, TWO,
                            mma)
        else:
            _store_rows(c_ptr, acc0, acc1, row0, col0, end, R, J, stride_cm, WM, W, TWO,
                        out_l)

    @gluon.jit
    def _tma_store_parts(desc, c_bufs, acc0, acc1, row0, col0, W: gl.constexpr,
                         WG: gl.constexpr, TWO: gl.constexpr, NB: gl.constexpr):
        """A consumer warpgroup's TMA-store epilogue: ``acc0`` (and, ``TWO``, ``acc1``
        ``W`` columns on) through its ``NB`` buffers of ``c_bufs`` into ``desc`` at
        ``[row0, col0]``, asynchronously: the buffers' previous stores are waited for
        first, these are left in flight (TMA clips past the tensor's bounds). With one
        buffer for two parts, the second waits until the first has left it."""
        # this warpgroup's buffers' previous stores have left: the wait holds the threads
        # that issued them, and the barrier Triton puts before the shared-memory writes
        # below holds the rest (test_fp8_ws_kernel_compiles_for_sm90 checks it is there)
        tma.store_wait(0)
        c_buf = c_bufs.index(WG * NB)
        c_buf.store(acc0.to(desc.dtype))
        if TWO and NB == 2:
            c_buf1 = c_bufs.index(WG * NB + 1)
            c_buf1.store(acc1.to(desc.dtype))
        fence_async_shared()
        _tma_store(desc, [row0, col0], c_buf)
        if TWO:
            if NB == 2:
                _tma_store(desc, [row0, col0 + W], c_buf1)
            else:
                tma.store_wait(0)
                c_buf.store(acc1.to(desc.dtype))
                fence_async_shared()
                _tma_store(desc, [row0, col0 + W], c_buf)

    @gluon.jit
    def _store_rows(c_ptr, acc0, acc1, row0, col0, end, R, J, stride_cm, WM: gl.constexpr,
                    W: gl.constexpr, TWO: gl.constexpr, out_l: gl.constexpr):
        """A consumer's masked epilogue: ``acc0`` (and, ``TWO``, ``acc1`` beside it) of
        ``[WM, W]`` into ``c`` rows ``row0..`` (those before the segment's ``end`` and
        ``R``) and columns ``col0..`` (before ``J``), in ``c``'s dtype."""
        orows = row0 + gl.arange(0, WM, layout=gl.SliceLayout(1, out_l))
        ocols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, out_l))
        optrs = (c_ptr + gl.expand_dims(orows.to(gl.int64) * stride_cm, 1)
                 + gl.expand_dims(ocols, 0))
        rm = gl.expand_dims((orows < end) & (orows < R), 1)
        gl.store(optrs, gl.convert_layout(acc0.to(c_ptr.dtype.element_ty), out_l),
                 mask=rm & gl.expand_dims(ocols < J, 0))
        if TWO:
            gl.store(optrs + W, gl.convert_layout(acc1.to(c_ptr.dtype.element_ty), out_l),
                     mask=rm & gl.expand_dims(ocols + W < J, 0))

    @gluon.jit
    def _store_buffers(c_desc, other, WN: gl.constexpr, TMA_STORE: gl.constexpr,
                       PER_WG: gl.constexpr):
        """The TMA-store epilogue's shared-memory buffers: per consumer warpgroup one
        ``c_desc`` box for each box-wide part of its ``WN`` columns (FP8: 128-column
        parts; bf16: the whole part), at most ``PER_WG`` (``other``, unused, when
        ``TMA_STORE`` is off)."""
        if TMA_STORE:
            PARTS: gl.constexpr = ((WN + c_desc.block_type.shape[1] - 1)
                                   // c_desc.block_type.shape[1])
            NBUF: gl.constexpr = 2 * (PARTS if PARTS < PER_WG else PER_WG)
            bufs = gl.allocate_shared_memory(c_desc.dtype, [NBUF] + c_desc.block_type.shape,
                                             c_desc.layout)
        else:
            bufs = other
        return bufs

    @gluon.jit
    def _fp8_rows_ws_kernel(a_desc, b_desc, c_ptr, c_desc, as_ptr, bs_ptr, offsets_ptr, R, I,
                            J, E, b_row_e, b_col_e, stride_cm, stride_asr, stride_ask, bs_se,
                            bs_si, bs_sj, BM: gl.constexpr, BN: gl.constexpr,
                            BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                            SPLIT_N: gl.constexpr, EP2: gl.constexpr,
                            TMA_STORE: gl.constexpr, STORE_BUFS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Persistent warp-specialized FP8 rows GEMM (see the module docstring).
        ``num_warps`` = 4: the first consumer warpgroup (the default partition).
        ``TMA_STORE``: ``c_desc`` over ``c`` ``[R, J]`` with a consumer's ``[WM, 128]``
        (or ``[WM, WN]`` below 128 columns) boxes (:func:`_epilogue`); else unused."""
        a_bufs, b_bufs, ready, empty = _ring(a_desc, b_desc, STAGES)
        NSLOT: gl.constexpr = 2
        info, tile_ready, tile_free = _tile_slots(NSLOT)
        c_bufs = _store_buffers(c_desc, a_bufs, BN // 2 if SPLIT_N else BN, TMA_STORE,
                                STORE_BUFS)
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        # (worker arguments are spelled out: tuples built by concatenation lose constexprs)
        gl.warp_specialize([
            (_ws_consume, (a_bufs, b_bufs, ready, empty, info, tile_ready, tile_free, c_ptr,
                           c_desc, c_bufs, as_ptr, bs_ptr, offsets_ptr, R, I, J, E, stride_cm,
                           stride_asr, stride_ask, bs_se, bs_si, bs_sj, WG0, BM, BN, BK,
                           STAGES, SPLIT_N, EP2, NSLOT, TMA_STORE, STORE_BUFS)),
            (_ws_consume, (a_bufs, b_bufs, ready, empty, info, tile_ready, tile_free, c_ptr,
                           c_desc, c_bufs, as_ptr, bs_ptr, offsets_ptr, R, I, J, E, stride_cm,
                           stride_asr, stride_ask, bs_se, bs_si, bs_sj, WG1, BM, BN, BK,
                           STAGES, SPLIT_N, EP2, NSLOT, TMA_STORE, STORE_BUFS)),
            (_ws_load, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, info, tile_ready,
                        tile_free, offsets_ptr, R, I, J, E, b_row_e, b_col_e, BM, BN, BK,
                        GROUP_M, STAGES, EP2, NSLOT, False)),
        ], [4, 1], [CONSUMER_REGS, 40])

    # ------------------------------------------------------- bf16 / fp16 rows GEMM

    @gluon.jit
    def _ws_consume_hp(a_bufs, b_bufs, ready, empty, info, tile_ready, tile_free, c_ptr,
                       c_desc, c_bufs, offsets_ptr, R, I, J, E, stride_cm, WG: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       STAGES: gl.constexpr, SPLIT_N: gl.constexpr, EP2: gl.constexpr,
                       NSLOT: gl.constexpr, B_NMAJOR: gl.constexpr,
                       TMA_STORE: gl.constexpr):
        """Consumer warpgroup ``WG`` of the 16-bit rows GEMM: one ``[WM, WN]`` wgmma a K
        step into one accumulator, the next step issued before the previous one is
        waited for (one in flight), its stage released once it is done."""
        WM: gl.constexpr = BM if SPLIT_N else BM // 2
        WN: gl.constexpr = BN // 2 if SPLIT_N else BN
        R_OFF: gl.constexpr = 0 if SPLIT_N else WG * WM
        C_OFF: gl.constexpr = WG * WN if SPLIT_N else 0
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, WN, 16])
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // WN, WN // 8], [4, 1],
                                               [1, 0])
        # (the loader's row tile count, by the same function: the same count, tile for
        # tile, even for offsets that decrease)
        _, n_m = _schedule(offsets_ptr, R, E, BM, EP2, 4)
        num_n = gl.cdiv(J, BN)
        it = 0
        # (this program's tiles: those from program_id on, num_programs apart)
        for j in range(gl.cdiv(n_m * num_n - gl.program_id(0), gl.num_programs(0))):
            ec, pid_n, start, end, k_tiles = _take_tile(info, tile_ready, tile_free, j, NSLOT)
            row0 = start + R_OFF
            col0 = pid_n * BN + C_OFF
            acc = gl.zeros((WM, WN), gl.float32, mma)
            for kk in range(k_tiles):
                st = it % STAGES
                mbarrier.wait(ready.index(st), (it // STAGES) & 1)
                a_view = a_bufs.index(st)
                if not SPLIT_N:
                    a_view = a_view.slice(R_OFF, WM)
                if B_NMAJOR:  # [BK, BN] boxes: the columns of this warpgroup
                    b_view = b_bufs.index(st).slice(C_OFF, WN, dim=1)
                else:  # [BN, BK] boxes: its rows, transposed
                    b_view = b_bufs.index(st).slice(C_OFF, WN).permute((1, 0))
                acc = warpgroup_mma(a_view, b_view, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if kk > 0:  # the previous step's MMA is done: release its stage
                    mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if k_tiles > 0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            _epilogue(c_ptr, c_desc, c_bufs, acc, acc, row0, col0, end, R, J, stride_cm, WG,
                      WM, WN, False, TMA_STORE, 1, mma, out_l)
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _hp_rows_ws_kernel(a_desc, b_desc, c_ptr, c_desc, offsets_ptr, R, I, J, E, b_row_e,
                           b_col_e, stride_cm, BM: gl.constexpr, BN: gl.constexpr,
                           BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                           SPLIT_N: gl.constexpr, EP2: gl.constexpr, B_NMAJOR: gl.constexpr,
                           TMA_STORE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           num_warps: gl.constexpr):
        """Persistent warp-specialized bf16/fp16 rows GEMM (fp32 accumulation): the FP8
        kernel's ring, loader, schedule and epilogue without the promotion (``c_desc``
        boxes: a consumer's whole ``[WM, WN]`` part)."""
        a_bufs, b_bufs, ready, empty = _ring(a_desc, b_desc, STAGES)
        NSLOT: gl.constexpr = 2
        info, tile_ready, tile_free = _tile_slots(NSLOT)
        c_bufs = _store_buffers(c_desc, a_bufs, BN // 2 if SPLIT_N else BN, TMA_STORE, 1)
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        gl.warp_specialize([
            (_ws_consume_hp, (a_bufs, b_bufs, ready, empty, info, tile_ready, tile_free,
                              c_ptr, c_desc, c_bufs, offsets_ptr, R, I, J, E, stride_cm, WG0,
                              BM, BN, BK, STAGES, SPLIT_N, EP2, NSLOT, B_NMAJOR, TMA_STORE)),
            (_ws_consume_hp, (a_bufs, b_bufs, ready, empty, info, tile_ready, tile_free,
                              c_ptr, c_desc, c_bufs, offsets_ptr, R, I, J, E, stride_cm, WG1,
                              BM, BN, BK, STAGES, SPLIT_N, EP2, NSLOT, B_NMAJOR, TMA_STORE)),
            (_ws_load, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, info, tile_ready,
                        tile_free, offsets_ptr, R, I, J, E, b_row_e, b_col_e, BM, BN, BK,
                        GROUP_M, STAGES, EP2, NSLOT, B_NMAJOR)),
        ], [4, 1], [CONSUMER_REGS, 40])

    # ------------------------------------------------------------ bf16 / fp16 wgrad

    @gluon.jit
    def _segment(offsets_ptr, e, R):
        """Expert ``e``'s rows ``start .. end`` of one operand pair (clipped to ``R``;
        int32, the TMA coordinates' type, whatever the offsets' dtype)."""
        end = gl.minimum(gl.load(offsets_ptr + e + 1), R).to(gl.int32)
        return gl.maximum(gl.minimum(gl.load(offsets_ptr + e), end), 0).to(gl.int32), end

    @gluon.jit
    def _hw_load_part(g_desc, x_desc, g_bufs, x_bufs, ready, empty, offsets_ptr, R, e, n0,
                      k0, it, BT: gl.constexpr, STAGES: gl.constexpr):
        """The loader's TMA copies of one part's segment of expert ``e``: per ``BT``-token
        step the ``[BT, BNW]`` box of ``g`` and the ``[BT, BKW]`` box of ``x``."""
        start, end = _segment(offsets_ptr, e, R)
        for i in range(gl.cdiv(end - start, BT)):
            st = it % STAGES
            mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(st)
            mbarrier.expect(bar, g_desc.block_type.nbytes + x_desc.block_type.nbytes)
            _tma_load(g_desc, [start + i * BT, n0], bar, g_bufs.index(st))
            _tma_load(x_desc, [start + i * BT, k0], bar, x_bufs.index(st))
            it += 1
        return it

    @gluon.jit
    def _hw_load(g0, x0, o0, R0, g1, x1, o1, R1, g2, x2, o2, R2, g3, x3, o3, R3, g_bufs,
                 x_bufs, ready, empty, N, K, E, BNW: gl.constexpr, BKW: gl.constexpr,
                 BT: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr):
        """Loader warp of the 16-bit wgrad: each tile's parts' segments in turn."""
        nN = gl.cdiv(N, BNW)
        nK = gl.cdiv(K, BKW)
        it = 0
        for tile in range(gl.program_id(0), E * nN * nK, gl.num_programs(0)):
            e, pid_n, pid_k = _wg_coords(tile, nN, nK)
            n0 = pid_n * BNW
            k0 = pid_k * BKW
            it = _hw_load_part(g0, x0, g_bufs, x_bufs, ready, empty, o0, R0, e, n0, k0, it,
                               BT, STAGES)
            if PARTS > 1:
                it = _hw_load_part(g1, x1, g_bufs, x_bufs, ready, empty, o1, R1, e, n0, k0,
                                   it, BT, STAGES)
            if PARTS > 2:
                it = _hw_load_part(g2, x2, g_bufs, x_bufs, ready, empty, o2, R2, e, n0, k0,
                                   it, BT, STAGES)
            if PARTS > 3:
                it = _hw_load_part(g3, x3, g_bufs, x_bufs, ready, empty, o3, R3, e, n0, k0,
                                   it, BT, STAGES)

    @gluon.jit
    def _hw_consume_part(acc, it, it0, g_bufs, x_bufs, ready, empty, offsets_ptr, R, e,
                         WG: gl.constexpr, WM: gl.constexpr, BT: gl.constexpr,
                         STAGES: gl.constexpr):
        """One part's steps of a consumer warpgroup: per step one ``[WM, BKW]`` wgmma
        (``g``'s box read transposed, ``x``'s as it is), one step in flight (the previous
        one's stage released once it is done: any step of this tile since ``it0``). The
        segment's partial last step first zeroes this warpgroup's ``g`` tokens past the
        segment in shared memory (they belong to the next expert, or another part's rows
        past ``R`` that TMA zero-filled)."""
        tok_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        start, end = _segment(offsets_ptr, e, R)
        for i in range(gl.cdiv(end - start, BT)):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            g_view = g_bufs.index(st).slice(WG * WM, WM, dim=1)  # [BT, WM]
            valid = end - (start + i * BT)
            if valid < BT:
                toks = gl.arange(0, BT, layout=gl.SliceLayout(1, tok_l))
                a = g_view.load(tok_l)
                a = gl.where(gl.expand_dims(toks < valid, 1), a, gl.zeros_like(a))
                g_view.store(a)
                fence_async_shared()
            acc = warpgroup_mma(g_view.permute((1, 0)), x_bufs.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if it > it0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            it += 1
        return acc, it

    @gluon.jit
    def _hw_consume(g_bufs, x_bufs, c_bufs, c_bars, ready, empty, w_ptr, w_desc, sq_ptr, o0,
                    R0, o1,
                    R1, o2, R2, o3, R3, N, K, E, stride_we, stride_wn, WG: gl.constexpr,
                    BNW: gl.constexpr, BKW: gl.constexpr, BT: gl.constexpr,
                    STAGES: gl.constexpr, PARTS: gl.constexpr, ACCUMULATE: gl.constexpr,
                    SQ: gl.constexpr, TMA_STORE: gl.constexpr):
        """Consumer warpgroup ``WG``: rows ``WG * BNW/2 ..`` of each ``dW_e`` tile, summed
        over the parts in one fp32 accumulator; then the epilogue (see
        :func:`_hp_wgrad_ws_kernel`)."""
        WM: gl.constexpr = BNW // 2
        F32_OUT: gl.constexpr = w_ptr.dtype.element_ty == gl.float32
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BKW, 16])
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BKW, BKW // 8], [4, 1],
                                               [1, 0])
        nN = gl.cdiv(N, BNW)
        nK = gl.cdiv(K, BKW)
        it = 0
        phase = 0
        for tile in range(gl.program_id(0), E * nN * nK, gl.num_programs(0)):
            e, pid_n, pid_k = _wg_coords(tile, nN, nK)
            n0 = pid_n * BNW + WG * WM
            k0 = pid_k * BKW
            if TMA_STORE:
                c_buf = c_bufs.index(WG)
                if ACCUMULATE:  # the existing tile, on its way during the K loop (once
                    # the buffer's previous store has been read out)
                    tma.store_wait(0)
                    mbarrier.expect(c_bars.index(WG), w_desc.block_type.nbytes)
                    _tma_load(w_desc, [e * N + n0, k0], c_bars.index(WG), c_buf)
            it0 = it
            acc = gl.zeros((WM, BKW), gl.float32, mma)
            acc, it = _hw_consume_part(acc, it, it0, g_bufs, x_bufs, ready, empty, o0, R0, e,
                                       WG, WM, BT, STAGES)
            if PARTS > 1:
                acc, it = _hw_consume_part(acc, it, it0, g_bufs, x_bufs, ready, empty, o1, R1,
                                           e, WG, WM, BT, STAGES)
            if PARTS > 2:
                acc, it = _hw_consume_part(acc, it, it0, g_bufs, x_bufs, ready, empty, o2, R2,
                                           e, WG, WM, BT, STAGES)
            if PARTS > 3:
                acc, it = _hw_consume_part(acc, it, it0, g_bufs, x_bufs, ready, empty, o3, R3,
                                           e, WG, WM, BT, STAGES)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if it > it0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            if TMA_STORE:  # asynchronous: overlaps the next tile's steps
                if ACCUMULATE:
                    mbarrier.wait(c_bars.index(WG), phase)
                    phase ^= 1
                    acc += c_buf.load(mma).to(gl.float32)
                else:  # (waited here, a K loop after it was issued: no stall)
                    tma.store_wait(0)
                c_buf.store(acc.to(w_ptr.dtype.element_ty))
                fence_async_shared()
                _tma_store(w_desc, [e * N + n0, k0], c_buf)  # (TMA clips columns past K)
                if SQ:  # (zeros outside N x K: TMA zero-filled the operands)
                    gl.store(sq_ptr + 2 * tile + WG, gl.sum(gl.sum(acc * acc, 1), 0))
            else:
                # 16-bit: loads and stores row-contiguous (coalesced, few addresses),
                # moved to and from the MMA's layout through shared memory; fp32: in the
                # MMA's layout (a thread's column pairs fill whole 32-byte sectors; the
                # fp32 tile would not fit shared memory beside the ring)
                io_l: gl.constexpr = mma if F32_OUT else out_l
                rows = n0 + gl.arange(0, WM, layout=gl.SliceLayout(1, io_l))
                cols = k0 + gl.arange(0, BKW, layout=gl.SliceLayout(0, io_l))
                ptrs = (w_ptr + e.to(gl.int64) * stride_we
                        + gl.expand_dims(rows.to(gl.int64) * stride_wn, 1)
                        + gl.expand_dims(cols, 0))
                mask = gl.expand_dims(rows < N, 1) & gl.expand_dims(cols < K, 0)
                if ACCUMULATE:
                    acc += gl.convert_layout(gl.load(ptrs, mask=mask, other=0.0),
                                             mma).to(gl.float32)
                if SQ:
                    gl.store(sq_ptr + 2 * tile + WG, gl.sum(gl.sum(acc * acc, 1), 0))
                gl.store(ptrs, gl.convert_layout(acc.to(w_ptr.dtype.element_ty), io_l),
                         mask=mask)
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _hp_wgrad_ws_kernel(g0, x0, o0, R0, g1, x1, o1, R1, g2, x2, o2, R2, g3, x3, o3, R3,
                            w_ptr, w_desc, sq_ptr, N, K, E, stride_we, stride_wn,
                            BNW: gl.constexpr, BKW: gl.constexpr, BT: gl.constexpr,
                            STAGES: gl.constexpr, PARTS: gl.constexpr,
                            ACCUMULATE: gl.constexpr, SQ: gl.constexpr,
                            TMA_STORE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            num_warps: gl.constexpr):
        """Persistent warp-specialized bf16/fp16 wgrad over expert segments, summed over
        ``PARTS`` (1-4) operand pairs (see :func:`launch_hp_wgrad_ws`): ``dW[e] (+)= sum_p
        g_p,e^T x_p,e`` in ``[BNW, BKW]`` tiles, fp32 accumulation, one rounding.
        Epilogue: ``TMA_STORE`` (a 16-bit ``dW``, ``N`` a multiple of ``BNW``): through
        shared memory and a TMA copy (``w_desc``: ``dW`` as ``[E*N, K]``, ``[BNW/2, BKW]``
        boxes), overlapping the next tile, ``ACCUMULATE`` adding the existing tile, which
        a TMA copy brings into the store buffer during the K loop; else masked stores
        from registers, ``ACCUMULATE`` adding the existing values loaded first. ``SQ``:
        each consumer also stores the sum of the squares of its half tile's final fp32
        values at ``sq_ptr[2 * tile + WG]``."""
        g_bufs, x_bufs, ready, empty = _ring(g0, x0, STAGES)
        if TMA_STORE:  # per consumer warpgroup: its tile, and a barrier for its loads
            c_bufs = gl.allocate_shared_memory(w_desc.dtype, [2] + w_desc.block_type.shape,
                                               w_desc.layout)
        else:
            c_bufs = g_bufs  # unused
        c_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(c_bars.index(i), count=1)
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        gl.warp_specialize([
            (_hw_consume, (g_bufs, x_bufs, c_bufs, c_bars, ready, empty, w_ptr, w_desc, sq_ptr, o0,
                           R0, o1, R1, o2, R2, o3, R3, N, K, E, stride_we, stride_wn, WG0,
                           BNW, BKW, BT, STAGES, PARTS, ACCUMULATE, SQ, TMA_STORE)),
            (_hw_consume, (g_bufs, x_bufs, c_bufs, c_bars, ready, empty, w_ptr, w_desc, sq_ptr, o0,
                           R0, o1, R1, o2, R2, o3, R3, N, K, E, stride_we, stride_wn, WG1,
                           BNW, BKW, BT, STAGES, PARTS, ACCUMULATE, SQ, TMA_STORE)),
            (_hw_load, (g0, x0, o0, R0, g1, x1, o1, R1, g2, x2, o2, R2, g3, x3, o3, R3, g_bufs,
                        x_bufs, ready, empty, N, K, E, BNW, BKW, BT, STAGES, PARTS)),
        ], [4, 1], [CONSUMER_REGS, 40])

    # ---------------------------------------------------------------- FP8 wgrad

    @gluon.jit
    def _wg_tile(tile, nN, nK, offsets_ptr, R):
        """wgrad tile ``tile`` -> ``(expert, n tile, k tile, first token, token end, token
        groups)``; an expert's tiles are adjacent (its tokens stay in L2 while they are
        read)."""
        e, pid_n, pid_k = _wg_coords(tile, nN, nK)
        start, end = _segment(offsets_ptr, e, R)
        return e, pid_n, pid_k, start, end, gl.cdiv(end - start, 128)

    @gluon.jit
    def _wg_coords(tile, nN, nK):
        """wgrad tile ``tile`` -> ``(expert, n tile, k tile)``: an expert's ``nN x nK``
        tiles adjacent (its tokens stay in L2 while they are read), k fastest."""
        per_e = nN * nK
        return tile // per_e, (tile % per_e) // nK, tile % nK

    @gluon.jit
    def _wg_first_group(offsets_ptr, e, E, EP2: gl.constexpr, NW: gl.constexpr):
        """Expert ``e``'s first scale group: the 128-token groups of the experts before it,
        ``sum cdiv(segment, 128)``, summed from ``offsets`` (L1) by each warp of a
        partition of ``NW`` warps on its own (a ``[1, EP2]`` row replicated over the
        warps: no cross-warp reduction), for each tile rather than kept in registers
        across tiles (the consumers, or with ``SCALES_TMA`` the loader)."""
        gl.static_assert(EP2 >= 32, "EP2: at least one expert slot a lane")
        row: gl.constexpr = gl.BlockedLayout([1, EP2 // 32], [1, 32], [NW, 1], [1, 0])
        idx = gl.expand_dims(gl.arange(0, EP2, layout=gl.SliceLayout(0, row)), 0)
        m = idx < gl.minimum(e, E)
        lo = gl.load(offsets_ptr + idx, mask=m, other=0)
        hi = gl.load(offsets_ptr + idx + 1, mask=m, other=0)
        return gl.sum(gl.sum((hi - lo + 127) // 128, 1), 0)

    @gluon.jit
    def _wg_load(g_desc, x_desc, gs_desc, xs_desc, g_bufs, x_bufs, gs_bufs, xs_bufs, ready,
                 empty, offsets_ptr, N, K, R, E, BNW: gl.constexpr, BKW: gl.constexpr,
                 STAGES: gl.constexpr, SCALES_TMA: gl.constexpr, EP2: gl.constexpr):
        """Loader warp of the wgrad: per token group, the ``[BNW, 128]`` box of ``g``'s
        columnwise copy and the ``[BKW, 128]`` box of ``x``'s (``SCALES_TMA``: and the
        group's rows of their scales, ``[1, BNW]`` / ``[1, BKW]``)."""
        nN = gl.cdiv(N, BNW)
        nK = gl.cdiv(K, BKW)
        SCALE_BYTES: gl.constexpr = (gs_desc.block_type.nbytes + xs_desc.block_type.nbytes
                                     if SCALES_TMA else 0)
        NBYTES: gl.constexpr = (g_desc.block_type.nbytes + x_desc.block_type.nbytes
                                + SCALE_BYTES)
        it = 0
        for tile in range(gl.program_id(0), E * nN * nK, gl.num_programs(0)):
            e, pid_n, pid_k, start, end, n_groups = _wg_tile(tile, nN, nK, offsets_ptr, R)
            if SCALES_TMA:
                gbase = _wg_first_group(offsets_ptr, e, E, EP2, 1)
            for i in range(n_groups):
                st = it % STAGES
                mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(st)
                mbarrier.expect(bar, NBYTES)
                _tma_load(g_desc, [pid_n * BNW, start + i * 128], bar, g_bufs.index(st))
                _tma_load(x_desc, [pid_k * BKW, start + i * 128], bar, x_bufs.index(st))
                if SCALES_TMA:
                    _tma_load(gs_desc, [gbase + i, pid_n * BNW], bar, gs_bufs.index(st))
                    _tma_load(xs_desc, [gbase + i, pid_k * BKW], bar, xs_bufs.index(st))
                it += 1

    @gluon.jit
    def _wg_consume(g_bufs, x_bufs, gs_bufs, xs_bufs, ready, empty, w_ptr, w_desc, c_bufs,
                    gs_ptr, xs_ptr, offsets_ptr, N, K, R, E, stride_gs, stride_xs, stride_we,
                    stride_wn, WG: gl.constexpr, BNW: gl.constexpr, BKW: gl.constexpr,
                    STAGES: gl.constexpr, TMA_STORE: gl.constexpr, SX_DIRECT: gl.constexpr,
                    SCALES_TMA: gl.constexpr, EP2: gl.constexpr):
        """Consumer warpgroup ``WG`` of the wgrad: rows ``n`` ``WG * BNW/2 ..`` of each
        ``dW_e`` tile. Per token group: MMA, wait, release, promote with the group's
        scales of both operands (``acc += prod * sg[n] * sx[k]``), in sub-MMAs of at most
        128 columns (``BKW`` = 256: two, each with its own accumulator and column scales,
        so one ``BNW/2 x 128`` product tile is live). The segment's partial last group
        first zeroes this warpgroup's ``g`` tokens past the segment in shared memory
        (they belong to the next expert)."""
        WM: gl.constexpr = BNW // 2
        SUB: gl.constexpr = 128 if BKW > 128 else BKW
        TWO: gl.constexpr = BKW // SUB == 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, SUB, 32])
        tok_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        out_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // SUB, SUB // 4], [4, 1],
                                               [1, 0])
        nN = gl.cdiv(N, BNW)
        nK = gl.cdiv(K, BKW)
        it = 0
        for tile in range(gl.program_id(0), E * nN * nK, gl.num_programs(0)):
            e, pid_n, pid_k, start, end, n_groups = _wg_tile(tile, nN, nK, offsets_ptr, R)
            if not SCALES_TMA:  # this warpgroup loads the scale rows itself
                gbase = _wg_first_group(offsets_ptr, e, E, EP2, 4)
                rows = pid_n * BNW + WG * WM + gl.arange(0, WM, layout=gl.SliceLayout(1, mma))
                cols1 = pid_k * BKW + gl.arange(0, SUB, layout=vec_l)
                cols = pid_k * BKW + gl.arange(0, SUB, layout=gl.SliceLayout(0, mma))
                nmask = rows < N
            acc0 = gl.zeros((WM, SUB), gl.float32, mma)
            acc1 = gl.zeros((WM, SUB), gl.float32, mma)
            for i in range(n_groups):
                st = it % STAGES
                if SCALES_TMA:  # the group's scale rows came with its boxes: read from
                    # shared memory after the MMA (not live across it: ptxas spilled
                    # ~250 bytes in the K loop when they were)
                    mbarrier.wait(ready.index(st), (it // STAGES) & 1)
                else:
                    xs_row = xs_ptr + (gbase + i) * stride_xs
                    sg = gl.expand_dims(gl.load(gs_ptr + (gbase + i) * stride_gs + rows,
                                                mask=nmask, other=1.0), 1)
                    sx0 = gl.expand_dims(_col_scales(xs_row, cols, cols1, K, mma, SX_DIRECT), 0)
                    mbarrier.wait(ready.index(st), (it // STAGES) & 1)
                valid = end - (start + i * 128)
                a_view = g_bufs.index(st).slice(WG * WM, WM)
                if valid < 128:  # zero this warpgroup's tokens past the segment in place
                    # (the token index made here, not kept across the loop: registers)
                    toks = gl.arange(0, 128, layout=gl.SliceLayout(0, tok_l))
                    a = a_view.load(tok_l).to(gl.int8, bitcast=True)
                    a = gl.where(gl.expand_dims(toks < valid, 0), a, gl.zeros_like(a))
                    a_view.store(a.to(gl.float8e4nv, bitcast=True))
                    fence_async_shared()
                x_view = x_bufs.index(st)
                # use_acc=False: the accumulator operand only gives the result's layout
                prod = warpgroup_mma(a_view, x_view.slice(0, SUB).permute((1, 0)),
                                     gl.zeros((WM, SUB), gl.float32, mma), use_acc=False,
                                     is_async=True)
                prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                if SCALES_TMA:
                    sg = gs_bufs.index(st).slice(WG * WM, WM, dim=1).permute((1, 0)).load(mma)
                    sx0 = xs_bufs.index(st).slice(0, SUB, dim=1).load(mma)
                if TWO:
                    acc0 = acc0 + prod * sg * sx0
                    if not SCALES_TMA:
                        sx1 = gl.expand_dims(_col_scales(xs_row, cols + SUB, cols1 + SUB, K,
                                                         mma, SX_DIRECT), 0)
                    prod = warpgroup_mma(a_view, x_view.slice(SUB, SUB).permute((1, 0)),
                                         gl.zeros((WM, SUB), gl.float32, mma), use_acc=False,
                                         is_async=True)
                    prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                    if SCALES_TMA:  # (read before the stage is released)
                        sx1 = xs_bufs.index(st).slice(SUB, SUB, dim=1).load(mma)
                    mbarrier.arrive(empty.index(st), count=1)
                    acc1 = acc1 + prod * sg * sx1
                else:
                    mbarrier.arrive(empty.index(st), count=1)
                    acc0 = acc0 + prod * sg * sx0
                it += 1
            if TMA_STORE:  # asynchronous: overlaps the next tile's K loop
                row0 = e * N + pid_n * BNW + WG * WM  # in dW viewed as [E * N, K]
                _tma_store_parts(w_desc, c_bufs, acc0, acc1, row0, pid_k * BKW, SUB, WG, TWO,
                                 2 if TWO else 1)
            else:
                orows = pid_n * BNW + WG * WM + gl.arange(0, WM, layout=gl.SliceLayout(1, out_l))
                ocols = pid_k * BKW + gl.arange(0, SUB, layout=gl.SliceLayout(0, out_l))
                optrs = (w_ptr + e.to(gl.int64) * stride_we
                         + gl.expand_dims(orows.to(gl.int64) * stride_wn, 1)
                         + gl.expand_dims(ocols, 0))
                rm = gl.expand_dims(orows < N, 1)
                gl.store(optrs, gl.convert_layout(acc0.to(w_ptr.dtype.element_ty), out_l),
                         mask=rm & gl.expand_dims(ocols < K, 0))
                if TWO:
                    gl.store(optrs + SUB,
                             gl.convert_layout(acc1.to(w_ptr.dtype.element_ty), out_l),
                             mask=rm & gl.expand_dims(ocols + SUB < K, 0))
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _col_scales(xs_row, cols, cols1, K, mma: gl.constexpr, SX_DIRECT: gl.constexpr):
        """One token group's column scales ``sx[cols]`` in the MMA's column layout:
        loaded there directly (``SX_DIRECT``: as many addresses a thread as it holds
        columns), or one per thread and then moved (no spills, a shuffle)."""
        if SX_DIRECT:
            sx = gl.load(xs_row + cols, mask=cols < K, other=1.0)
        else:
            sx = gl.convert_layout(gl.load(xs_row + cols1, mask=cols1 < K, other=1.0),
                                   gl.SliceLayout(0, mma))
        return sx

    @gluon.jit
    def _fp8_wgrad_ws_kernel(g_desc, x_desc, gs_desc, xs_desc, w_ptr, w_desc, gs_ptr, xs_ptr,
                             offsets_ptr, N, K, R, E, stride_gs, stride_xs, stride_we,
                             stride_wn, BNW: gl.constexpr, BKW: gl.constexpr,
                             STAGES: gl.constexpr, TMA_STORE: gl.constexpr,
                             SX_DIRECT: gl.constexpr, SCALES_TMA: gl.constexpr,
                             EP2: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Persistent warp-specialized FP8 wgrad over segment groups (see
        :func:`launch_fp8_wgrad_ws`). ``TMA_STORE``: each consumer stores its ``dW`` tile
        through shared memory and a TMA copy (``w_desc`` over ``dW`` as ``[E*N, K]`` with
        ``[BNW/2, min(BKW, 128)]`` boxes; needs ``N`` a multiple of ``BNW``), which overlaps
        the next tile; else masked stores from registers (``w_desc`` unused).
        ``SCALES_TMA``: the loader also copies each group's scale rows (``gs_desc`` /
        ``xs_desc`` over the transposed scales, ``[1, BNW]`` / ``[1, BKW]`` boxes) into
        the ring, and the consumers read them from shared memory in the MMA's layout;
        else the consumers load them (``gs_ptr`` / ``xs_ptr``; the descriptors unused)."""
        g_bufs, x_bufs, ready, empty = _ring(g_desc, x_desc, STAGES)
        if SCALES_TMA:
            gs_bufs = gl.allocate_shared_memory(gs_desc.dtype,
                                                [STAGES] + gs_desc.block_type.shape,
                                                gs_desc.layout)
            xs_bufs = gl.allocate_shared_memory(xs_desc.dtype,
                                                [STAGES] + xs_desc.block_type.shape,
                                                xs_desc.layout)
        else:
            gs_bufs = g_bufs  # unused
            xs_bufs = g_bufs
        if TMA_STORE:  # per consumer warpgroup, one [BNW/2, 128] tile a 128-column sub-MMA
            NBUF: gl.constexpr = 4 if BKW > 128 else 2
            c_bufs = gl.allocate_shared_memory(w_desc.dtype, [NBUF] + w_desc.block_type.shape,
                                               w_desc.layout)
        else:
            c_bufs = g_bufs  # unused
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        gl.warp_specialize([
            (_wg_consume, (g_bufs, x_bufs, gs_bufs, xs_bufs, ready, empty, w_ptr, w_desc,
                           c_bufs, gs_ptr, xs_ptr, offsets_ptr, N, K, R, E, stride_gs,
                           stride_xs, stride_we, stride_wn, WG0, BNW, BKW, STAGES, TMA_STORE,
                           SX_DIRECT, SCALES_TMA, EP2)),
            (_wg_consume, (g_bufs, x_bufs, gs_bufs, xs_bufs, ready, empty, w_ptr, w_desc,
                           c_bufs, gs_ptr, xs_ptr, offsets_ptr, N, K, R, E, stride_gs,
                           stride_xs, stride_we, stride_wn, WG1, BNW, BKW, STAGES, TMA_STORE,
                           SX_DIRECT, SCALES_TMA, EP2)),
            (_wg_load, (g_desc, x_desc, gs_desc, xs_desc, g_bufs, x_bufs, gs_bufs, xs_bufs,
                        ready, empty, offsets_ptr, N, K, R, E, BNW, BKW, STAGES, SCALES_TMA,
                        EP2)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


_LAYOUTS: dict = {}  # (box shape, dtype) -> its NVMMA shared layout


def _layout(box: tuple, dtype=None):
    """The NVMMA shared layout of a TMA box (``dtype``: a Gluon dtype, fp8 e4m3 by
    default), made once per box and dtype."""
    dtype = gl.float8e4nv if dtype is None else dtype
    layout = _LAYOUTS.get((box, dtype))
    if layout is None:
        layout = _LAYOUTS[box, dtype] = gl.NVMMASharedLayout.get_default_for(list(box), dtype)
    return layout


def _scale_layout():
    """The shared layout of a ``[1, n]`` fp32 box of scales (no swizzle: a plain row)."""
    layout = _LAYOUTS.get("scales")
    if layout is None:
        layout = _LAYOUTS["scales"] = gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                           element_bitwidth=32, rank=2)
    return layout


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _gluon_descriptor(desc) -> GluonDescriptor:
    """A Gluon tensor descriptor (NVMMA shared layout) for a ``triton.tools`` one over
    FP8, bf16 or fp16 data (a Gluon one as it is)."""
    if isinstance(desc, GluonDescriptor):
        return desc
    return ws_descriptor(desc.base, desc.shape, desc.strides, desc.block_shape)


def ws_descriptor(t: torch.Tensor, shape, strides, box, reuse: bool = False):
    """A Gluon TMA descriptor of ``t`` (FP8, bf16 or fp16) with its NVMMA layout: what
    :func:`linghe.fwd.grouped_mm._tma_operands` builds for the warp-specialized kernels
    (``make=``), with no ``triton.tools`` descriptor in between. ``reuse`` (a weight's
    operand): when ``t`` is a plain tensor (the FP8 weight copies, which live for a step
    or, rewritten in place, for the run), keep it on ``t`` and hand it out again for the
    same dtype, shape, strides and box, so it is built once, not in every launch. Not for
    ``nn.Parameter`` s, whose storage ``module.to()`` / ``p.data = ...`` replace (a kept
    descriptor would hold the old one). The kept descriptor is over another tensor on
    ``t``'s storage (not a view, which would refer back to ``t``: a cycle the garbage
    collector cannot see through), so ``t`` is freed as before."""
    key = (t.dtype, tuple(shape), tuple(strides), tuple(box))
    keep = reuse and type(t) is torch.Tensor
    kept = getattr(t, "_linghe_ws_desc", None) if keep else None
    if kept is not None:
        desc = kept.get(key)
        if desc is not None and desc.base.data_ptr() == t.data_ptr():
            return desc
    base = t
    if keep:
        base = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    name = _GL_DTYPES.get(t.dtype)
    desc = GluonDescriptor(base, list(shape), list(strides), list(box),
                           _layout(tuple(box), getattr(gl, name) if name else None))
    if keep:
        if kept is None or len(kept) >= 4:
            kept = {}
        kept[key] = desc
        try:
            t._linghe_ws_desc = kept
        except (AttributeError, RuntimeError):  # pragma: no cover
            pass
    return desc


def launch_fp8_rows_ws(ops, out: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                       offsets: torch.Tensor, bs_strides, config: dict | None = None):
    """Launch :func:`_fp8_rows_ws_kernel`. ``ops``: ``(a_desc, b_desc, b_row_e, b_col_e)``
    from :func:`linghe.fwd.grouped_mm._tma_operands` with ``[BM, 128]`` / ``[BN, 128]``
    boxes (the descriptors' boxes must match ``config``); ``a_scale [R, GK]`` the row
    scales in any strides (read where they are: a consumer's rows' scales of one K step
    are one small gather, cached across the tile's steps, so no transposed copy is made
    for it); ``b_scale`` and ``bs_strides`` as for the Triton kernel."""
    from .grouped_mm import row_tile_bound

    cfg = dict(WS_CONFIG, **(config or {}))
    a_desc, b_desc, b_row_e, b_col_e = ops
    R, I = a_desc.shape
    J = out.shape[1]
    E = offsets.numel() - 1
    # (the row tiles' count is known on the GPU only: the programs walk up to it)
    bound = row_tile_bound(R, E, cfg["BM"])
    grid = (max(1, min(num_sms(out.device), bound * cdiv(J, cfg["BN"]))),)
    a_desc = _gluon_descriptor(a_desc)
    wm, wn = _consumer_part(cfg)
    ring = cfg["STAGES"] * (cfg["BM"] + cfg["BN"]) * 128
    # a consumer's store buffers: one per 128-column part where they fit beside the
    # ring, else one for both (128x256 at 4 stages)
    store_bufs = cdiv(wn, 128)
    if ring + 2 * wm * wn * out.element_size() > _SMEM_BYTES:
        store_bufs = 1
    c_desc = _store_descriptor(out, R, J, (wm, min(wn, 128)), cfg, ring,
                               store_bufs * 2 * wm * min(wn, 128))
    with device_guard(out):
        launch(
            _fp8_rows_ws_kernel, grid, a_desc, _gluon_descriptor(b_desc), out,
            c_desc or a_desc, a_scale, b_scale, offsets, R, I, J, E, b_row_e, b_col_e,
            out.stride(0), a_scale.stride(0), a_scale.stride(1), *bs_strides, BM=cfg["BM"],
            BN=cfg["BN"], BK=128, GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"],
            SPLIT_N=cfg["BM"] == 64, EP2=max(128, next_power_of_2(E)),
            TMA_STORE=c_desc is not None, STORE_BUFS=store_bufs,
            CONSUMER_REGS=cfg["CONSUMER_REGS"], num_warps=4, maxnreg=cfg["MAXNREG"])
    return out


def _consumer_part(cfg: dict) -> tuple[int, int]:
    """``(WM, WN)``: a consumer warpgroup's part of a ``BM x BN`` tile in the rows
    kernels: half the rows of a 128-row tile, half the columns of a 64-row one
    (``SPLIT_N``)."""
    if cfg["BM"] == 64:
        return cfg["BM"], cfg["BN"] // 2
    return cfg["BM"] // 2, cfg["BN"]


#: Shared memory an sm_90 block may use (227 KiB), less what barriers and the schedule
#: take beside the ring and the store buffers.
_SMEM_BYTES = (227 << 10) - 1024


def _store_descriptor(out: torch.Tensor, R: int, J: int, box: tuple[int, int], cfg: dict,
                      ring_bytes: int, buffer_elems: int):
    """The TMA-store epilogue's descriptor of ``out``'s ``[R, J]`` rows with ``box`` (a
    consumer's part of a tile), or None where ``cfg["TMA_STORE"]`` is off, TMA cannot
    write ``out`` (not 16-bit, columns not contiguous, rows or base not 16-byte aligned)
    or the store buffers (``buffer_elems`` outputs, both consumers') do not fit shared
    memory beside the operand ring of ``ring_bytes`` (a deeper ring pinned by a config):
    then the kernels store from registers."""
    if not (cfg.get("TMA_STORE") and out.dtype in _GL_DTYPES and out.stride(1) == 1
            and out.stride(0) * out.element_size() % 16 == 0 and out.data_ptr() % 16 == 0
            and ring_bytes + buffer_elems * out.element_size() <= _SMEM_BYTES):
        return None
    return ws_descriptor(out, [R, J], out.stride(), box)


#: The 16-bit rows GEMM's settings: 128x256 tiles (each consumer warpgroup one 64x256
#: wgmma a 64-deep K step), 3 stages (48 KiB each). H200, 8192 tokens top-8, forward,
#: µs against ``torch._grouped_mm``: E = 256 gate_up 1070 (1136), down 556 (609); E = 32
#: gate_up 750 (771), down 402 (422) (``h200_probe_bf16_ws_rows_fwd_2026-11-27_s14``).
HP_WS_CONFIG = dict(BM=128, BN=256, BK=64, STAGES=3, GROUP_M=8, CONSUMER_REGS=232,
                    MAXNREG=160, TMA_STORE=True)
#: Its tiles (128 rows split by rows between the consumers, 64 by columns).
HP_WS_TILES = ((128, 256), (128, 128), (64, 256))


def launch_hp_rows_ws(ops, out: torch.Tensor, offsets: torch.Tensor, b_nmajor: bool,
                      config: dict | None = None) -> torch.Tensor:
    """Launch :func:`_hp_rows_ws_kernel` (bf16/fp16 operands, fp32 accumulation).
    ``ops``: ``(a_desc, b_desc, b_row_e, b_col_e)`` from
    :func:`linghe.fwd.grouped_mm._tma_operands` at ``config``'s ``BM``, ``BN``, ``BK``
    (``b_nmajor``: ``b``'s output dim contiguous, ``[BK, BN]`` boxes); writes every row
    of ``out`` (zeros past ``offsets[E]``)."""
    from .grouped_mm import row_tile_bound

    cfg = dict(HP_WS_CONFIG, **(config or {}))
    if (cfg["BM"], cfg["BN"]) not in HP_WS_TILES or cfg["STAGES"] < 2 or cfg["BK"] != 64:
        # (a consumer holds two stages before it releases one: one stage would deadlock)
        raise ValueError(f"16-bit warp-specialized rows GEMM: (BM, BN) in {HP_WS_TILES}, "
                         f"BK = 64 and STAGES >= 2, got {config}")
    a_desc, b_desc, b_row_e, b_col_e = ops
    R, I = a_desc.shape
    J = out.shape[1]
    E = offsets.numel() - 1
    bound = row_tile_bound(R, E, cfg["BM"])
    grid = (max(1, min(num_sms(out.device), bound * cdiv(J, cfg["BN"]))),)
    a_desc = _gluon_descriptor(a_desc)
    c_desc = _store_descriptor(out, R, J, _consumer_part(cfg), cfg,
                               cfg["STAGES"] * (cfg["BM"] + cfg["BN"]) * cfg["BK"] * 2,
                               cfg["BM"] * cfg["BN"])
    with device_guard(out):
        launch(_hp_rows_ws_kernel, grid, a_desc, _gluon_descriptor(b_desc), out,
               c_desc or a_desc, offsets, R, I, J, E, b_row_e, b_col_e, out.stride(0),
               BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
               STAGES=cfg["STAGES"], SPLIT_N=cfg["BM"] == 64, EP2=max(128, next_power_of_2(E)),
               B_NMAJOR=b_nmajor, TMA_STORE=c_desc is not None,
               CONSUMER_REGS=cfg["CONSUMER_REGS"], num_warps=4, maxnreg=cfg["MAXNREG"])
    return out


#: The 16-bit wgrad's settings: ``dW_e`` in ``[BNW, BKW]`` tiles (each consumer
#: warpgroup ``BNW / 2`` rows, one ``[BNW / 2, BKW]`` wgmma per ``BT``-token step; ``BKW``
#: 128 where ``K <= 128``), at most ``STAGES`` steps in flight (fewer where shared memory
#: holds fewer: :func:`_hp_wgrad_stages`), the TMA-store epilogue where it applies
#: (:func:`launch_hp_wgrad_ws`). H200, 8192 tokens top-8, µs, 32-token steps (64-token
#: steps, 3 stages; 32-token steps with register stores) against ``torch._grouped_mm``
#: and the Triton TMA kernel: E = 256 gate_up 1040 (1095; 1115) vs 1366 / 1720, down 536
#: (564; 570) vs 703 / 894; E = 32 gate_up 720 (723; 746) vs 767 / 839, down 360 (363;
#: 376) vs 395 / 415. Four micro-batches' parts summed, with the squares: E = 256 gate_up
#: 3235 vs the Triton parts kernel 4163 (one ``torch._grouped_mm`` over all their rows
#: in one buffer, the bar: 3502), down 1624 vs 2109 (1741). Accumulating: E = 256
#: gate_up 1394 vs the Triton kernel 2095
#: (``benchmark/results/h200_probe_bf16_ws_wgrad_final_2026-11-27_s15``).
HP_WGRAD_WS_CONFIG = dict(BNW=128, BKW=256, BT=32, STAGES=6, TMA_STORE=True,
                          CONSUMER_REGS=232, MAXNREG=160)
#: Its tiles.
HP_WGRAD_WS_TILES = ((128, 256), (128, 128))
#: Most operand pairs one launch of :func:`_hp_wgrad_ws_kernel` sums (more are chunked).
HP_WGRAD_WS_MAX_PARTS = 4


def hp_wgrad_ws_config(K: int, config: dict | None = None) -> dict:
    """The 16-bit wgrad's settings for contraction width ``K``: the defaults, ``BKW`` 128
    where ``K <= 128``, then ``config``'s keys; validated."""
    config = dict(config or {})
    cfg = dict(HP_WGRAD_WS_CONFIG, BKW=128 if K <= 128 else HP_WGRAD_WS_CONFIG["BKW"])
    cfg.update(config)
    regs_ok = all(isinstance(cfg.get(k), int) and 24 <= cfg[k] <= 256 and cfg[k] % 8 == 0
                  for k in ("CONSUMER_REGS", "MAXNREG"))
    if (set(cfg) != set(HP_WGRAD_WS_CONFIG) or (cfg["BNW"], cfg["BKW"]) not in HP_WGRAD_WS_TILES
            or cfg["BT"] not in (32, 64) or not isinstance(cfg["STAGES"], int)
            or cfg["STAGES"] < 2 or not regs_ok or not isinstance(cfg["TMA_STORE"], bool)):
        # (a consumer holds two stages before it releases one: one stage would deadlock)
        raise ValueError(f"16-bit wgrad (warp-specialized): keys "
                         f"{sorted(HP_WGRAD_WS_CONFIG)} with (BNW, BKW) in "
                         f"{HP_WGRAD_WS_TILES}, BT 32 or 64, STAGES >= 2, register counts "
                         f"multiples of 8 in [24, 256] and TMA_STORE a bool, got {config}")
    return cfg


def _hp_wgrad_stages(cfg: dict, elem_bytes: int, out_bytes: int) -> int:
    """The ring's depth: ``cfg["STAGES"]``, or as many as fit :data:`_WGRAD_SMEM` beside
    the epilogue's two ``[BNW / 2, BKW]`` 16-bit tiles (the TMA store's buffers or the
    register store's layout conversion; none for an fp32 ``dW``). At least 2."""
    bnw, bkw = cfg["BNW"], cfg["BKW"]
    store = bnw * bkw * out_bytes if out_bytes < 4 else 0
    stage = cfg["BT"] * (bnw + bkw) * elem_bytes
    return max(2, min(cfg["STAGES"], (_WGRAD_SMEM - store) // stage))


def hp_wgrad_ws_sq_size(dw: torch.Tensor, config: dict | None = None) -> int:
    """The length of :func:`launch_hp_wgrad_ws`'s ``sq_out``: one float32 per consumer
    warpgroup's half of each output tile of ``dw [E, N, K]``."""
    E, N, K = dw.shape
    cfg = hp_wgrad_ws_config(K, config)
    return 2 * E * cdiv(N, cfg["BNW"]) * cdiv(K, cfg["BKW"])


def launch_hp_wgrad_ws(parts, dw: torch.Tensor, *, accumulate: bool = False,
                       sq_out: torch.Tensor | None = None,
                       config: dict | None = None) -> torch.Tensor:
    """``dW[e] (+)= sum_p g_p,e^T x_p,e`` with the warp-specialized kernel, over operand
    pairs ``parts = [(g_p [R_p, N], x_p [R_p, K], offsets_p [E + 1]), ...]`` (bf16/fp16
    of one dtype, rows grouped by expert; part ``p``'s expert ``e`` has rows
    ``offsets_p[e] .. min(offsets_p[e+1], R_p)``; each TMA-describable, as
    :func:`linghe.bwd.grouped_mm.wgrad_tma_unsupported` checks, and ``R_p > 0``), into
    ``dw [E, N, K]`` (contiguous, bf16/fp16/fp32): one fp32 accumulator per tile and one
    rounding per launch of up to :data:`HP_WGRAD_WS_MAX_PARTS` parts (more are chunked:
    later chunks add). ``accumulate``: add to ``dw``'s contents. ``sq_out``: float32
    ``[hp_wgrad_ws_sq_size(dw)]`` that receives the sums of the squares of ``dw``'s final
    fp32 values per half tile. An expert without rows gets zeros (or keeps its values).
    ``config``: keys of :data:`HP_WGRAD_WS_CONFIG`. Checks ``dw``, ``sq_out``, the parts'
    count and rows and the config (``ValueError``); the operands' TMA layout and the
    offsets are the caller's (:func:`linghe.bwd.grouped_mm.launch_wgrad_parts` checks
    them). Returns ``dw``."""
    if dw.dim() != 3 or not dw.is_contiguous() or dw.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"launch_hp_wgrad_ws: dw must be a contiguous bf16/fp16/fp32 "
                         f"[E, N, K] tensor, got {dw.dtype} {tuple(dw.shape)}")
    E, N, K = dw.shape
    cfg = hp_wgrad_ws_config(K, config)
    if sq_out is not None and (sq_out.dtype != torch.float32 or not sq_out.is_contiguous()
                               or sq_out.numel() != hp_wgrad_ws_sq_size(dw, config)):
        raise ValueError(f"launch_hp_wgrad_ws: sq_out must be a contiguous float32 tensor "
                         f"of {hp_wgrad_ws_sq_size(dw, config)} elements")
    if not parts or any(g.shape[0] == 0 for g, _, _ in parts):
        raise ValueError("launch_hp_wgrad_ws: needs parts, each with rows (TMA cannot "
                         "describe an empty tensor)")
    if dw.numel() == 0:
        return dw
    bt, bnw, bkw = cfg["BT"], cfg["BNW"], cfg["BKW"]
    stages = _hp_wgrad_stages(cfg, parts[0][0].element_size(), dw.element_size())
    dt = gl.bfloat16 if parts[0][0].dtype == torch.bfloat16 else gl.float16
    descs = []
    for g, x, offsets in parts:
        R = g.shape[0]
        descs.append([
            GluonDescriptor(g, [R, N], [g.stride(0), 1], [bt, bnw], _layout((bt, bnw), dt)),
            GluonDescriptor(x, [R, K], [x.stride(0), 1], [bt, bkw], _layout((bt, bkw), dt)),
            offsets, R])
    # TMA store (and load, accumulating): a 16-bit dW whose tiles stay inside one
    # expert's rows, 16-byte aligned rows and base
    tma_store = (cfg["TMA_STORE"] and dw.dtype != torch.float32 and N % bnw == 0
                 and (K * dw.element_size()) % 16 == 0 and dw.data_ptr() % 16 == 0)
    if tma_store:
        box = [bnw // 2, bkw]
        w_dt = gl.bfloat16 if dw.dtype == torch.bfloat16 else gl.float16
        w_desc = GluonDescriptor(dw.view(E * N, K), [E * N, K], [K, 1], box,
                                 _layout(tuple(box), w_dt))
    else:
        w_desc = descs[0][0]  # unused
    tiles = E * cdiv(N, bnw) * cdiv(K, bkw)
    grid = (max(1, min(num_sms(dw.device), tiles)),)
    last = (len(descs) - 1) // HP_WGRAD_WS_MAX_PARTS * HP_WGRAD_WS_MAX_PARTS
    for c in range(0, len(descs), HP_WGRAD_WS_MAX_PARTS):
        chunk = descs[c:c + HP_WGRAD_WS_MAX_PARTS]
        sq = sq_out is not None and c == last  # (the last chunk stores the final values)
        args = [a for p in chunk for a in p]
        args += chunk[0] * (HP_WGRAD_WS_MAX_PARTS - len(chunk))  # unused parts (never read)
        with device_guard(dw):
            launch(_hp_wgrad_ws_kernel, grid, *args, dw, w_desc, sq_out if sq else dw, N, K,
                   E, dw.stride(0), dw.stride(1), BNW=bnw, BKW=bkw, BT=bt,
                   STAGES=stages, PARTS=len(chunk), ACCUMULATE=bool(accumulate or c > 0),
                   SQ=sq, TMA_STORE=tma_store, CONSUMER_REGS=cfg["CONSUMER_REGS"],
                   num_warps=4, maxnreg=cfg["MAXNREG"])
    return dw


#: The wgrad's settings: ``dW_e`` in ``[BNW, BKW]`` tiles (``BNW / 2`` rows per consumer
#: warpgroup; ``BKW`` = 256 as two 128-column sub-MMAs, 128 where ``K <= 128``),
#: ``STAGES`` 128-token groups in flight at most (:func:`_wgrad_stages` fits the ring to
#: shared memory: 5 at 128x128 with bf16 ``dW``, 3 at 128x256), and the per-tile settings
#: of :data:`WGRAD_WS_TILE_SETTINGS` unless the config names them. H100, 8192 tokens
#: top-8, µs, the default (128x256, scale rows by TMA, read after the MMA) first, then
#: in brackets the same with the scale rows read before the MMA (the thirteenth
#: session's form); with the scale rows loaded from global memory; 128x128;
#: ``torch._grouped_mm`` bf16 (``benchmark/results/h100_probe_fp8_ws_2026-11-27_s14``):
#: E = 256 gate_up 1113 (1639; 1512; 1608; 1445), down 590 (778; 791; 816; 748); E = 32
#: gate_up 695 (824; 827; 936; 790), down 369 (433; 432; 472; 400).
WGRAD_WS_CONFIG = dict(BNW=128, BKW=256, STAGES=5, TMA_STORE=True, SX_DIRECT=False,
                       SCALES_TMA=True, CONSUMER_REGS=240, LOADER_REGS=24, MAXNREG=168)
#: Per tile width. At 128x256 the loader copies each group's scale rows into the ring
#: with its boxes (``SCALES_TMA``) and the consumers read them in the MMA's layout from
#: shared memory once the MMA is done (no global loads, no layout conversion through
#: shared memory and its barrier on the promotion's path; at 256 experts 26% less time
#: than loading them);
#: where TMA cannot read the scales, they are loaded one per thread and moved to the
#: MMA's layout (loaded there directly, 32 a thread, ptxas spills ~2 KB: 2565 µs at
#: E = 256 gate_up on the H100, against 1914 moved); the consumers get 240 registers,
#: the loader 24 (ptxas spills 8 bytes with CUDA 13's; H100, 232 / 40: 1152 against
#: 1113 µs). At 128x128 the direct load wins (H200: 1486 / 1646 µs) at 232 / 40
#: registers, and there the TMA-store epilogue beats register stores (1486 / 1849 µs);
#: the scale TMA was not measured at 128x128 (off there).
WGRAD_WS_TILE_SETTINGS = {
    256: dict(SX_DIRECT=False, SCALES_TMA=True, CONSUMER_REGS=240, LOADER_REGS=24),
    128: dict(SX_DIRECT=True, SCALES_TMA=False, CONSUMER_REGS=232, LOADER_REGS=40),
}
#: The wgrad's tiles: ``BKW`` = 256 runs two 128-column sub-MMAs per consumer warpgroup.
WGRAD_WS_TILES = ((128, 128), (128, 256))
#: Shared memory the ring and the store tiles may take (sm_90: 227 KiB a block, less the
#: barriers and the compiler's scratch).
_WGRAD_SMEM = 216 << 10


def _wgrad_stages(stages: int, bnw: int, bkw: int, out_bytes: int, tma_store: bool,
                  scales_tma: bool = False) -> int:
    """The ring's depth: ``stages``, or as many as fit :data:`_WGRAD_SMEM` beside the
    epilogue's ``[bnw / 2, 128]`` tiles of ``out_bytes`` elements (TMA store: one tile
    per 128-column sub-MMA per consumer warpgroup; register store: one per consumer
    warpgroup, the layout conversion's scratch); a stage holds the two operand boxes
    and, with ``scales_tma``, their groups' fp32 scale rows."""
    tiles = 2 * (max(1, bkw // 128) if tma_store else 1)
    store = tiles * (bnw // 2) * min(bkw, 128) * out_bytes
    stage = (bnw + bkw) * (128 + 4 * scales_tma)  # (the scale rows: fp32)
    return max(1, min(stages, (_WGRAD_SMEM - store) // stage))


def wgrad_ws_config(K: int, config: dict | None = None) -> dict:
    """The wgrad's full settings for contraction width ``K`` (``x``'s features): the
    defaults, ``BKW`` 128 where ``K <= 128`` (the second sub-MMA would multiply zeros),
    that tile's :data:`WGRAD_WS_TILE_SETTINGS`, then ``config``'s keys; validated."""
    config = dict(config or {})
    bkw = config.get("BKW", 128 if K <= 128 else WGRAD_WS_CONFIG["BKW"])
    cfg = dict(WGRAD_WS_CONFIG, BKW=bkw, **WGRAD_WS_TILE_SETTINGS.get(bkw, {}))
    cfg.update(config)
    regs_ok = all(isinstance(cfg[k], int) and 24 <= cfg[k] <= 256 and cfg[k] % 8 == 0
                  for k in ("CONSUMER_REGS", "LOADER_REGS"))
    if (set(cfg) != set(WGRAD_WS_CONFIG) or (cfg["BNW"], cfg["BKW"]) not in WGRAD_WS_TILES
            or not regs_ok or not (isinstance(cfg["STAGES"], int) and cfg["STAGES"] >= 1)):
        raise ValueError(f"FP8 wgrad (warp-specialized): keys {sorted(WGRAD_WS_CONFIG)} "
                         f"with (BNW, BKW) in {WGRAD_WS_TILES}, STAGES >= 1 and register "
                         f"counts multiples of 8 in [24, 256], got {config}")
    return cfg


def wgrad_ws_operands_ok(gq: torch.Tensor, xq: torch.Tensor) -> bool:
    """Whether TMA can read the columnwise copies ``gq [N, R]`` / ``xq [K, R]``: tokens
    contiguous, 16-byte aligned bases and row strides."""
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (gq, xq))


def launch_fp8_wgrad_ws(gq: torch.Tensor, xq: torch.Tensor, gs_t: torch.Tensor,
                        xs_t: torch.Tensor, dw: torch.Tensor, offsets: torch.Tensor,
                        config: dict | None = None) -> torch.Tensor:
    """FP8 ``dW[e] = g_e^T x_e`` over segment groups (the MoE layout: each expert's tokens
    in 128-token groups from its segment start, scale group ``g_off[e] + i`` with
    ``g_off[e] = sum cdiv(segment, 128)`` over the experts before, summed in the kernel)
    with the warp-specialized kernel: ``gq [N, R]`` / ``xq [K, R]`` the columnwise copies
    (see :func:`wgrad_ws_operands_ok`), ``gs_t [G, N]`` / ``xs_t [G, K]`` their scales
    transposed (``G`` at least the segments' groups, ``sum cdiv(segment, 128)``: as the
    quantizer makes them), ``dw [E, N, K]`` written (every element; an expert without
    tokens gets zeros). Same promotion per token group as the Triton wgrad (``acc += dot
    * sg[n] * sx[k]``); the partial last group of a segment is masked to it. ``config``:
    keys of :data:`WGRAD_WS_CONFIG` (:func:`wgrad_ws_config`)."""
    N, R = gq.shape
    K = xq.shape[0]
    cfg = wgrad_ws_config(K, config)
    E = offsets.numel() - 1
    bnw, bkw = cfg["BNW"], cfg["BKW"]
    sub = min(bkw, 128)
    g_desc = GluonDescriptor(gq, [N, R], [gq.stride(0), 1], [bnw, 128],
                             _layout((bnw, 128)))
    x_desc = GluonDescriptor(xq, [K, R], [xq.stride(0), 1], [bkw, 128],
                             _layout((bkw, 128)))
    # TMA store: tiles within one expert's rows, 16-byte rows; else masked stores
    tma_store = (cfg["TMA_STORE"] and N % bnw == 0 and dw.is_contiguous()
                 and (K * dw.element_size()) % 16 == 0 and dw.data_ptr() % 16 == 0)
    # the scale rows by TMA: fp32 rows of the transposed scales, unit column stride,
    # 16-byte aligned base and row stride
    scales_tma = cfg["SCALES_TMA"] and all(
        t.dtype == torch.float32 and t.stride(1) == 1 and (t.stride(0) * 4) % 16 == 0
        and t.data_ptr() % 16 == 0 for t in (gs_t, xs_t))
    # (fp32 dW at 128x256: the store tiles would leave the ring under 3 stages, which
    # matters more; the depth that fits is compared, not a config's own small STAGES)
    if tma_store and _wgrad_stages(1 << 10, bnw, bkw, dw.element_size(), True,
                                   scales_tma) < 3:
        tma_store = False
    stages = _wgrad_stages(cfg["STAGES"], bnw, bkw, dw.element_size(), tma_store, scales_tma)
    if scales_tma:
        gs_desc = GluonDescriptor(gs_t, [gs_t.shape[0], N], [gs_t.stride(0), 1], [1, bnw],
                                  _scale_layout())
        xs_desc = GluonDescriptor(xs_t, [xs_t.shape[0], K], [xs_t.stride(0), 1], [1, bkw],
                                  _scale_layout())
    else:
        gs_desc = xs_desc = g_desc  # unused
    if tma_store:
        dt = {torch.float32: gl.float32, torch.float16: gl.float16}.get(dw.dtype, gl.bfloat16)
        box = (bnw // 2, sub)
        w_desc = GluonDescriptor(dw.view(E * N, K), [E * N, K], [K, 1], list(box),
                                 _layout(box, dt))
    else:
        w_desc = g_desc  # unused
    tiles = E * cdiv(N, bnw) * cdiv(K, bkw)
    grid = (max(1, min(num_sms(dw.device), tiles)),)
    with device_guard(dw):
        launch(_fp8_wgrad_ws_kernel, grid, g_desc, x_desc, gs_desc, xs_desc, dw, w_desc,
               gs_t, xs_t, offsets, N, K, R, E, gs_t.stride(0), xs_t.stride(0), dw.stride(0),
               dw.stride(1), BNW=bnw, BKW=bkw, STAGES=stages, TMA_STORE=tma_store,
               SX_DIRECT=cfg["SX_DIRECT"], SCALES_TMA=scales_tma,
               EP2=max(128, next_power_of_2(E)), CONSUMER_REGS=cfg["CONSUMER_REGS"],
               LOADER_REGS=cfg["LOADER_REGS"], num_warps=4, maxnreg=cfg["MAXNREG"])
    return dw
