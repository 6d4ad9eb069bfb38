"""Warp-specialized FP8 blockwise grouped rows GEMM for sm_90 (Gluon).

The same product as :func:`linghe.fwd.grouped_mm.launch_grouped_rows` with FP8
operands (``out[r] = a[r] @ B_e`` over expert segments, 1x128 row scales, 128x128
weight scales, each 128-deep K step promoted in fp32: ``acc += dot(a_q, b_q) * sa *
sb``), scheduled the way Hopper FP8 GEMMs are fast with promotion:

- one persistent program per SM walks the output tiles (grouped order, ``GROUP_M`` row
  tiles sweep the column tiles together so their weight tiles stay in L2);
- a loader warp issues the TMA copies of each K step's ``[BM, 128]`` rows box and
  ``[BN, 128]`` weight box into a ring of ``STAGES`` shared-memory buffers (mbarriers
  ``ready``/``empty``), running ahead across K steps and tiles;
- two consumer warpgroups each take ``BM / 2`` rows of the box: issue the step's
  ``wgmma``, wait for it, release the buffer and promote. The two run out of phase, so
  one's promotion (fp32 FMAs on the CUDA cores) overlaps the other's MMA, and each holds
  only a ``BM/2 x BN`` accumulator and product tile (128 rows share each weight box:
  half the weight traffic of 64-row tiles, without Triton's one-program-per-SM limit for
  a promoted 128-row tile).

Same tile schedule as the Triton kernel (``tile_map``: expert tiles, then tail tiles
that store zeros), same promotion arithmetic. Gluon kernels do not run in the CPU
interpreter: the Triton rows kernel is the fallback there and on other GPUs
(:func:`ws_capable`), and the GPU tests compare this kernel with it.
"""

from __future__ import annotations

import os

import torch

try:  # Gluon: triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    # the TMA load is ``async_load`` from triton 3.7 on (3.6: async_copy_global_to_shared)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # pragma: no cover - older triton
    gluon = None

from ..utils import INTERPRET, cdiv, cuda_capability, device_guard, num_sms

#: Take the warp-specialized kernel for FP8 rows GEMMs where it can run
#: (:func:`ws_capable`); ``LINGHE_FP8_WS=0`` keeps the Triton kernel everywhere.
FP8_WS: bool = os.environ.get("LINGHE_FP8_WS", "0") == "1"

#: Default tiles: 128 rows (64 per consumer warpgroup) x 128 columns, 4 stages
#: (32 KiB each), consumer warpgroups at 232 registers, the loader warp at 40.
WS_CONFIG = dict(BM=128, BN=128, STAGES=4, GROUP_M=8, CONSUMER_REGS=232)


def ws_capable(t: torch.Tensor) -> bool:
    """Whether the warp-specialized kernel can run on ``t``'s device: Gluon available,
    a CUDA sm_90 GPU (wgmma; not the interpreter)."""
    return (gluon is not None and not INTERPRET and t.device.type == "cuda"
            and cuda_capability(t.device)[0] == 9)


if gluon is not None:

    @gluon.jit
    def _num_tiles(offsets_ptr, tile_off_ptr, R, J, E, BM: gl.constexpr, BN: gl.constexpr):
        """(row tiles: the experts' tiles then the tail's, column tiles)."""
        n_m = gl.load(tile_off_ptr + E) + gl.cdiv(R - gl.load(offsets_ptr + E), BM)
        return n_m, gl.cdiv(J, BN)

    @gluon.jit
    def _tile(tile, n_m, num_n, offsets_ptr, tile_off_ptr, tile_expert_ptr, R, I, E,
              BM: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr):
        """Output tile ``tile`` (grouped order) -> ``(expert, column tile, first row, row
        end, K steps)``; a tail tile (expert ``E``) has no K steps and ends at ``R``."""
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        size_m = gl.minimum(n_m - first_m, GROUP_M)
        t = first_m + (tile % width) % size_m
        pid_n = (tile % width) // size_m
        e = gl.load(tile_expert_ptr + t)
        valid = e < E
        start = gl.load(offsets_ptr + e) + (t - gl.load(tile_off_ptr + e)) * BM
        end = gl.where(valid, gl.load(offsets_ptr + gl.minimum(e + 1, E)), R)
        k_tiles = gl.where(valid, gl.cdiv(I, BK), 0)
        return gl.minimum(e, E - 1), pid_n, start, end, k_tiles

    @gluon.jit
    def _ws_load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, tile_off_ptr,
                 tile_expert_ptr, R, I, J, E, b_row_e, b_col_e,
                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                 STAGES: gl.constexpr):
        """Loader warp: the TMA copies of every K step of this program's tiles."""
        n_m, num_n = _num_tiles(offsets_ptr, tile_off_ptr, R, J, E, BM, BN)
        it = 0
        for tile in range(gl.program_id(0), n_m * num_n, gl.num_programs(0)):
            ec, pid_n, start, end, k_tiles = _tile(tile, n_m, num_n, offsets_ptr,
                                                   tile_off_ptr, tile_expert_ptr, R, I, E,
                                                   BM, BK, GROUP_M)
            b_row = ec * b_row_e + pid_n * BN
            b_col = ec * b_col_e
            for kk in range(k_tiles):
                st = it % STAGES
                mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(st)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [start, kk * BK], bar, a_bufs.index(st))
                _tma_load(b_desc, [b_row, b_col + kk * BK], bar, b_bufs.index(st))
                it += 1

    @gluon.jit
    def _ws_consume(a_bufs, b_bufs, ready, empty, c_ptr, as_ptr, bs_ptr, offsets_ptr,
                    tile_off_ptr, tile_expert_ptr, R, I, J, E, stride_cm, stride_ask, bs_se,
                    bs_si, bs_sj, WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                    BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """Consumer warpgroup ``WG``: rows ``WG * BM/2 ..`` of each tile; MMA, release,
        promote per K step, then the masked bf16 store of its rows."""
        HALF: gl.constexpr = BM // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN, 32])
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        zero = gl.zeros((HALF, BN), gl.float32, mma)
        n_m, num_n = _num_tiles(offsets_ptr, tile_off_ptr, R, J, E, BM, BN)
        it = 0
        for tile in range(gl.program_id(0), n_m * num_n, gl.num_programs(0)):
            ec, pid_n, start, end, k_tiles = _tile(tile, n_m, num_n, offsets_ptr,
                                                   tile_off_ptr, tile_expert_ptr, R, I, E,
                                                   BM, BK, GROUP_M)
            row0 = start + WG * HALF
            rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
            rmask = (rows < end) & (rows < R)
            sa_ptrs = as_ptr + rows
            sb_ptr = bs_ptr + ec.to(gl.int64) * bs_se + ((pid_n * BN) // 128) * bs_sj
            acc = gl.zeros((HALF, BN), gl.float32, mma)
            for kk in range(k_tiles):
                st = it % STAGES
                s = (gl.load(sa_ptrs + kk * stride_ask, mask=rmask, other=1.0)
                     * gl.load(sb_ptr + kk * bs_si))
                mbarrier.wait(ready.index(st), (it // STAGES) & 1)
                prod = warpgroup_mma(a_bufs.index(st).slice(WG * HALF, HALF),
                                     b_bufs.index(st).permute((1, 0)), zero, use_acc=False,
                                     is_async=True)
                prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod, ))
                mbarrier.arrive(empty.index(st), count=1)
                acc = acc + prod * gl.expand_dims(s, 1)
                it += 1
            out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), out_l)
            orows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, out_l))
            ocols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_l))
            omask = (gl.expand_dims((orows < end) & (orows < R), 1)
                     & gl.expand_dims(ocols < J, 0))
            gl.store(c_ptr + gl.expand_dims(orows.to(gl.int64) * stride_cm, 1)
                     + gl.expand_dims(ocols, 0), out, mask=omask)

    @gluon.jit
    def _fp8_rows_ws_kernel(a_desc, b_desc, c_ptr, as_ptr, bs_ptr, offsets_ptr, tile_off_ptr,
                            tile_expert_ptr, R, I, J, E, b_row_e, b_col_e, stride_cm,
                            stride_ask, bs_se, bs_si, bs_sj,
                            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Persistent warp-specialized FP8 rows GEMM (see the module docstring).
        ``num_warps`` = 4: the first consumer warpgroup (the default partition)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                           b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        # (worker arguments are spelled out: tuples built by concatenation lose constexprs)
        gl.warp_specialize([
            (_ws_consume, (a_bufs, b_bufs, ready, empty, c_ptr, as_ptr, bs_ptr, offsets_ptr,
                           tile_off_ptr, tile_expert_ptr, R, I, J, E, stride_cm, stride_ask,
                           bs_se, bs_si, bs_sj, WG0, BM, BN, BK, GROUP_M, STAGES)),
            (_ws_consume, (a_bufs, b_bufs, ready, empty, c_ptr, as_ptr, bs_ptr, offsets_ptr,
                           tile_off_ptr, tile_expert_ptr, R, I, J, E, stride_cm, stride_ask,
                           bs_se, bs_si, bs_sj, WG1, BM, BN, BK, GROUP_M, STAGES)),
            (_ws_load, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                        tile_off_ptr, tile_expert_ptr, R, I, J, E, b_row_e, b_col_e, BM, BN,
                        BK, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 40])


def _gluon_descriptor(desc, dtype) -> GluonDescriptor:
    """A Gluon tensor descriptor (NVMMA shared layout) for a ``triton.tools`` one."""
    layout = gl.NVMMASharedLayout.get_default_for(list(desc.block_shape), dtype)
    return GluonDescriptor(desc.base, list(desc.shape), list(desc.strides),
                           list(desc.block_shape), layout)


def launch_fp8_rows_ws(ops, out: torch.Tensor, as_t: torch.Tensor, b_scale: torch.Tensor,
                       offsets: torch.Tensor, bs_strides, config: dict | None = None):
    """Launch :func:`_fp8_rows_ws_kernel`. ``ops``: ``(a_desc, b_desc, b_row_e, b_col_e)``
    from :func:`linghe.fwd.grouped_mm._tma_operands` with ``[BM, 128]`` / ``[BN, 128]``
    boxes (the descriptors' boxes must match ``config``); ``as_t [GK, R]`` the row
    scales transposed; ``b_scale`` and ``bs_strides`` as for the Triton kernel."""
    from .grouped_mm import tile_map

    cfg = dict(WS_CONFIG, **(config or {}))
    a_desc, b_desc, b_row_e, b_col_e = ops
    R, I = a_desc.shape
    J = out.shape[1]
    E = offsets.numel() - 1
    tile_off, tile_expert, bound = tile_map(offsets, R, cfg["BM"])
    grid = (max(1, min(num_sms(out.device), bound * cdiv(J, cfg["BN"]))),)
    with device_guard(out):
        _fp8_rows_ws_kernel[grid](
            _gluon_descriptor(a_desc, gl.float8e4nv), _gluon_descriptor(b_desc, gl.float8e4nv),
            out, as_t, b_scale, offsets, tile_off, tile_expert, R, I, J, E, b_row_e, b_col_e,
            out.stride(0), as_t.stride(0), *bs_strides, BM=cfg["BM"], BN=cfg["BN"], BK=128,
            GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
            num_warps=4, maxnreg=168)
    return out
