"""Router backward kernels: router GEMM grads (fp32-exact), top-k routing, z-loss.

- ``router_logits``: ``dx = dlogits @ W`` (dx in x's dtype) and ``dW = dlogits^T @ x``
  (fp32) from bf16 parts (no TF32): ``dlogits`` is split into its bf16 parts once
  (:func:`linghe.fwd.router.split_parts`, shared by both GEMMs), ``W``'s parts come from
  the forward. On Hopper both GEMMs load their operands by TMA (:func:`dw_tma`:
  :func:`_dw_kernel`, :func:`dx_tma`: :func:`_dx_kernel`) where TMA can address them
  (16-bit, 16-byte aligned rows; dW: a bf16 ``x``; dx: one bf16 pass, i.e. a bf16/fp16
  ``x``). The documented fallback for everything else (rows TMA cannot address, GPUs
  without TMA, dW of a float16/float32 ``x``, dx of a float32 ``x``, :data:`DX_ORDER`
  above 0, :data:`BWD_TMA` off) is :func:`linghe.fwd.router.matmul_parts` (pointer loads).
- ``topk_route``: one program per block of rows recomputes the scores from the logits and
  back-propagates ``dprobs`` through the scale, the normalization and softmax/sigmoid
  (selection has no gradient).
- ``router_z_loss``: ``dlogits = g * 2 * lse / T * softmax(logits)``.

**dW (``[E, H]`` fp32 from ``K = T`` tokens).** Every product ``part_p(dl)[t, e] *
x[t, h]`` of two bf16 values is exact in fp32, so ``dW = sum_p part_p(dl)^T @ x`` with
fp32 accumulation is fp32-exact (relative error ~2e-6 against float64 on Hopper, whose
MMA accumulation is not IEEE round-to-nearest). Few output tiles (``[256, 2048]``: 32 of
``128 x 128``) and a long contraction: the token range is split over programs (``SPLIT``)
and a second kernel sums the fp32 partials in rank order (deterministic). One
accumulator per part: each K step loads the ``x`` box once and issues ``P`` independent
dots (``P * BM * BN`` fp32 accumulators).

**dx (``[T, H]``, ``K = E``).** One bf16 pass (:data:`DX_ORDER` 0), persistent programs
(one per SM, the tile and K loops flattened into one pipeline) and TMA stores.

**Measured** (H100, T=8192 H=2048 E=256, fp32 weight, kernel µs;
``benchmark/results/h100_probe_router_bwd_2026-11-26_s5.txt``): main's pointer kernels
87.8 in all; dW 37.7 + 3.0 (sum kernel) and dx 22.0 are this module's. Measured and
removed:

- dW with one accumulator, the ``P`` dots of a K step chained (Triton 3.6 drains the MMA
  pipe between them: 40.2-60.6 + 4.4), one flat loop over (part, K step) (46.2-47.0 +
  4.4), or float32 dlogits split in registers (no split kernel, dx then reads float32:
  48.3-62.1, every row's total slower);
- the K-split partials summed by each tile's last program (tile counters: dW 41.8 against
  37.7 + 3.0) or by the dx kernel after its tiles (dx 30.9 against 21.8 + 4.4);
- the dx kernel reading float32 dlogits and writing dW's parts instead of the split
  kernel (dx 40.7 against 9.1 + 27.4);
- dx with one tile per program (26.9 with TMA stores) or pointer stores (27.4; 25.5
  persistent at 128 x 128), and two 4-warp programs per SM (24.1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..fwd.router import (
    CONFIG,
    _rows_per_prog,
    _sum_splits_kernel,
    matmul_parts,
    split_parts,
)
from ..utils import (
    INTERPRET,
    cdiv,
    device_guard,
    dot_f32acc,
    empty,
    empty_like,
    grouped_tile_order,
    launch,
    next_power_of_2,
    num_sms,
    tma_capable,
)

#: Part-product order of ``dx`` when x is bf16/fp16: 0 (default) is a single bf16 GEMM
#: ``bf16(dl) @ bf16(W)`` (relative error ~2e-3, the size of the bf16 output's own rounding;
#: 1/3 of the flops of order 1: this GEMM is most of the backward's time); 1 sums
#: ``dl_hi*W_hi + dl_mid*W_hi + dl_hi*W_mid`` (error ~2^-16). A float32 ``x`` always gets
#: order 2 (fp32-exact).
DX_ORDER = 0

#: The TMA kernels (:func:`dw_tma`, :func:`dx_tma`) where they apply (bf16 ``x``; dx of
#: order 0); False: :func:`linghe.fwd.router.matmul_parts` for both GEMMs.
BWD_TMA = True
#: Overrides of :func:`_dw_config`'s keys (``BM, BN, BK, num_warps, num_stages, SPLIT,
#: GROUP_M``) for :func:`dw_tma`; ``None``: the heuristic.
DW_CONFIG: dict | None = None
#: Overrides of :func:`_dx_config`'s keys (``BM, BN, BK, num_warps, num_stages,
#: GROUP_M``) for :func:`dx_tma`; ``None``: the heuristic.
DX_CONFIG: dict | None = None


def _tma_ok(t: torch.Tensor) -> bool:
    """A 16-bit matrix (or stack of matrices) TMA can address: unit last stride, 16-byte
    aligned base and row stride."""
    return (t.element_size() == 2 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(-2) * 2) % 16 == 0)


def _overridden(cfg: dict, config: dict | None, fn: str) -> dict:
    """``cfg`` updated by ``config`` (keys of ``cfg`` only)."""
    cfg = dict(cfg)
    if config:
        bad = set(config) - set(cfg)
        if bad:
            raise ValueError(f"{fn}: unknown config keys {sorted(bad)}")
        cfg.update(config)
    return cfg


# ------------------------------------------------------------------------------ dW
@triton.jit
def _dw_kernel(a_desc, b_desc, out_ptr, ws_ptr, M, N, T, k_per_split, P: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               SPLIT: tl.constexpr):
    """``out [M, N] fp32 = sum_p A_p^T @ B``: ``A_p`` (``[T, M]`` bf16) are the ``P`` parts
    of ``dlogits``, stacked along the rows as one ``[P * T, M]`` matrix (``a_desc``,
    ``[BK, BM]`` boxes: part ``p``'s box at row ``p * T + k``), ``B = x [T, N]``
    (``b_desc``, ``[BK, BN]`` boxes). Both come by TMA, fed to the MMA as they are (an
    M-major ``A^T`` and an N-major ``B``: Hopper's bf16 wgmma reads both from shared
    memory). A box that starts before ``T`` but reaches past it reads the next part's
    first rows (finite: ``mid``/``lo`` parts are zero where ``dlogits`` is not finite) and
    ``B``'s zero fill there, so those rows add exact zeros; past the last part TMA fills
    zeros. No masks in the K loop. One accumulator per part: each K step loads the ``B``
    box once and issues ``P`` independent dots (no dot waits for another).

    Program ``pid`` computes tile ``pid % tiles`` (grouped order) over the token chunk
    ``rank = pid // tiles`` (``k_per_split`` wide, ``SPLIT`` chunks). With ``SPLIT > 1``
    the fp32 partial goes to ``ws[rank]`` (summed by ``_sum_splits_kernel``)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    tiles = num_m * num_n
    rank = pid // tiles
    tile = pid % tiles
    pid_m, pid_n = grouped_tile_order(tile, num_m, num_n, GROUP_M)
    off_m = pid_m * BM
    off_n = pid_n * BN
    k_lo = rank * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, T)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        b = b_desc.load([k, off_n])
        if P > 2:
            a2 = a_desc.load([T + T + k, off_m])
            acc2 = dot_f32acc(tl.trans(a2), b, acc2)
        if P > 1:
            a1 = a_desc.load([T + k, off_m])
            acc1 = dot_f32acc(tl.trans(a1), b, acc1)
        a0 = a_desc.load([k, off_m])
        acc = dot_f32acc(tl.trans(a0), b, acc)
    if P > 2:
        acc = acc2 + acc1 + acc
    elif P > 1:
        acc = acc1 + acc
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + offs, acc, mask=mask)
    else:
        tl.store(ws_ptr + rank * (M.to(tl.int64) * N) + offs, acc, mask=mask)


_DW_CFG: dict = {}


def _dw_config(M: int, N: int, T: int, P: int, dev) -> dict:
    """Launch config of :func:`_dw_kernel` for ``dW [M, N]`` over ``T`` tokens with ``P``
    parts of dlogits (cached per shape): ``128 x 128`` tiles (``P * 64`` accumulator
    registers a thread at 8 warps), ``BK = 64``, stages within ~200 KB of shared memory;
    the token range split so that the programs make about one wave (the router's ``[256,
    2048]``: 32 tiles x 4 chunks), in chunks of at least 1024 tokens."""
    key = (M, N, T, P, dev)
    cfg = _DW_CFG.get(key)
    if cfg is not None:
        return cfg
    if INTERPRET:
        cfg = dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1, SPLIT=1, GROUP_M=8)
    else:
        BM = 128 if M > 64 else 64
        BN = 128 if N > 64 else 64
        BK = 64
        tiles = cdiv(M, BM) * cdiv(N, BN)
        split = max(1, min(num_sms(dev) // tiles, cdiv(T, 1024)))
        stage = (P * BM + BN) * BK * 2
        ns = max(2, min(4, (200 * 1024) // stage))
        cfg = dict(BM=BM, BN=BN, BK=BK, num_warps=8, num_stages=ns, SPLIT=split, GROUP_M=8)
    _DW_CFG[key] = cfg
    return cfg


def dw_tma(dl: torch.Tensor, x2: torch.Tensor, *, config: dict | None = None
           ) -> torch.Tensor | None:
    """``dW [E, H] fp32 = sum_p dl[p]^T @ x2`` through :func:`_dw_kernel` (and
    ``_sum_splits_kernel`` for a K split), or ``None`` where TMA cannot address the
    operands (unit last strides, 16-byte aligned rows). ``dl``: the bf16 parts of dlogits
    ``[P, T, E]``, stacked (``stride(0) == T * stride(1)``); ``x2 [T, H]`` bf16.
    ``config``: overrides of :func:`_dw_config`'s keys."""
    P, T, E = dl.shape
    H = x2.shape[1]
    if not (dl.dtype == torch.bfloat16 and _tma_ok(dl)
            and (P == 1 or dl.stride(0) == T * dl.stride(1))
            and x2.dtype == torch.bfloat16 and tma_capable(x2) and _tma_ok(x2)):
        return None
    dev = x2.device
    cfg = _overridden(_dw_config(E, H, T, P, dev), config, "dw_tma")
    out = empty(E, H, dtype=torch.float32, device=dev)
    if E == 0 or H == 0:
        return out
    if T == 0:
        return out.zero_()
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    k_per = cdiv(cdiv(T, cfg["SPLIT"]), BK) * BK
    split = cdiv(T, k_per)
    tiles = cdiv(E, BM) * cdiv(H, BN)
    ws = out if split == 1 else empty(split, E, H, dtype=torch.float32, device=dev)
    a2 = dl.as_strided((P * T, E), (dl.stride(1), 1))  # the parts stacked along the rows
    a_desc = TensorDescriptor(a2, [P * T, E], [dl.stride(1), 1], [BK, BM])
    b_desc = TensorDescriptor(x2, [T, H], [x2.stride(0), 1], [BK, BN])
    with device_guard(x2):
        launch(_dw_kernel, (tiles * split,), a_desc, b_desc, out, ws, E, H, T, k_per,
               P=P, BM=BM, BN=BN, BK=BK, GROUP_M=cfg["GROUP_M"], SPLIT=split,
               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if split > 1:
            # out = ws[0] + .. + ws[split - 1], in that order
            BLOCK = 1024
            launch(_sum_splits_kernel, (cdiv(out.numel(), BLOCK),), ws, out, out.numel(),
                   split, BLOCK=BLOCK, num_warps=4)
    return out


# ------------------------------------------------------------------------------ dx
@triton.jit
def _dx_kernel(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GROUP_M: tl.constexpr):
    """``C [M, N] = A @ B`` (fp32 accumulation, stored in ``C``'s 16-bit dtype): ``A``
    (``a_desc``, ``[BM, BK]`` boxes) and ``B`` (``b_desc``, ``[BK, BN]`` boxes, N-major)
    by TMA, zero-filled past their ends; each tile stored by TMA (``c_desc``, ``[BM,
    BN]`` boxes, clipped at the tensor's end). Persistent: program ``pid`` computes tiles
    ``pid, pid + G, ..`` (``G`` programs), the tile and K loops flattened into one
    pipelined loop (the next tile's first loads in flight during this tile's last MMAs
    and its store)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    tiles = num_m * num_n
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = grouped_tile_order(t, num_m, num_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([off_m, k])
            b = b_desc.load([k, off_n])
            acc = dot_f32acc(a, b, acc)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


_DX_CFG: dict = {}


def _dx_config(M: int, N: int, K: int, dev) -> dict:
    """Launch config of :func:`_dx_kernel` for ``dx [M, N] = dl [M, K] @ W [K, N]``
    (cached per shape): ``128 x 256`` tiles (the router's ``[8192, 2048]`` over ``K = E =
    256``: 512 tiles over one program per SM), 8 warps, ``BK = 64``, 3 stages (shared
    memory for the TMA-store tile too)."""
    key = (M, N, K, dev)
    cfg = _DX_CFG.get(key)
    if cfg is not None:
        return cfg
    if INTERPRET:
        cfg = dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1, GROUP_M=8)
    else:
        BM = 128 if M > 64 else 64
        BN = 256 if N > 128 else (128 if N > 64 else 64)
        cfg = dict(BM=BM, BN=BN, BK=64, num_warps=8, num_stages=3, GROUP_M=8)
    _DX_CFG[key] = cfg
    return cfg


def dx_tma(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
           config: dict | None = None) -> torch.Tensor | None:
    """``a [M, K] @ b [K, N]`` -> ``[M, N]`` ``out_dtype`` (bf16/fp16; fp32 accumulation
    of bf16 products) through :func:`_dx_kernel`, or ``None`` where TMA cannot address
    the operands (``a``, ``b`` bf16 with unit last strides and 16-byte aligned rows; ``N``
    a multiple of 8). ``config``: overrides of :func:`_dx_config`'s keys."""
    M, K = a.shape
    N = b.shape[1]
    if not (a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and tma_capable(a)
            and _tma_ok(a) and _tma_ok(b) and out_dtype in (torch.bfloat16, torch.float16)
            and N % 8 == 0):
        return None
    dev = a.device
    out = empty(M, N, dtype=out_dtype, device=dev)
    if M == 0 or N == 0 or K == 0:
        return out.zero_() if K == 0 else out
    cfg = _overridden(_dx_config(M, N, K, dev), config, "dx_tma")
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    tiles = cdiv(M, BM) * cdiv(N, BN)
    grid = min(tiles, 8 if INTERPRET else num_sms(dev))
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [BM, BK])
    b_desc = TensorDescriptor(b, [K, N], [b.stride(0), 1], [BK, BN])
    c_desc = TensorDescriptor(out, [M, N], [N, 1], [BM, BN])
    with device_guard(a):
        launch(_dx_kernel, (grid,), a_desc, b_desc, c_desc, M, N, K, BM=BM, BN=BN, BK=BK,
               GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
               num_stages=cfg["num_stages"])
    return out


def router_logits_bwd(dlogits: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                      need_dx: bool = True, need_dw: bool = True,
                      w_parts: torch.Tensor | None = None):
    """``dlogits [T, E]`` fp32, ``x2 [T, K]``, ``weight [E, K]`` -> ``(dx [T, K] x.dtype,
    dw [E, K] fp32)`` (``None`` where not needed). ``w_parts``: the forward's
    :func:`linghe.fwd.router.weight_parts` of ``weight`` (split here when absent).

    Launches, in order: the split of ``dlogits`` into bf16 parts, the dW GEMM (and, with
    a K split, the partials' sum), the dx GEMM."""
    dx_order = 2 if x2.dtype == torch.float32 else DX_ORDER
    # fp32 weight: fp32-exact dw (ORDER 2); a bf16/fp16 weight gets its gradient in its own
    # dtype, so bf16-level accuracy (ORDER 1: 2 passes instead of 3) is enough there.
    dw_order = 2 if weight.dtype == torch.float32 else 1
    if not (need_dx or need_dw):
        return None, None
    P = min(dw_order + 1, 3)  # dlogits' parts for dW
    wp = None
    if need_dx:
        wp = split_parts(weight, dx_order + 1) if w_parts is None else w_parts
    # one split of dlogits for both GEMMs
    dlp = split_parts(dlogits, max(P if need_dw else 0, dx_order + 1 if need_dx else 0))
    dx = dw = None
    if need_dw:
        if BWD_TMA:
            dw = dw_tma(dlp[:P], x2, config=DW_CONFIG)
        if dw is None:
            dw = matmul_parts(dlp.transpose(1, 2), split_parts(x2, dw_order + 1),
                              torch.float32, dw_order, config=CONFIG["dw"])
    if need_dx:
        if BWD_TMA and dx_order == 0:
            dx = dx_tma(dlp[0], wp[0], x2.dtype, config=DX_CONFIG)
        if dx is None:
            dx = matmul_parts(dlp, wp, x2.dtype, dx_order, config=CONFIG["dx"])
    return dx, dw


@triton.jit
def _topk_bwd_kernel(logits_ptr, ids_ptr, dp_ptr, dl_ptr, T, E, stride_l, scale,
                     BT: tl.constexpr, K_TOP: tl.constexpr, BK: tl.constexpr,
                     BE: tl.constexpr, SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr):
    # a [BT, E] tile of rows per program; the rows' ids/dprobs are loaded once as [BT, k]
    # vectors (no dependent scalar loads)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BT + tl.arange(0, BT)
    rmask = rows < T
    eb = tl.arange(0, BE)
    emask = eb < E
    m2 = rmask[:, None] & emask[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_l + eb[None, :], mask=m2,
                other=float("-inf")).to(tl.float32)
    if SIGMOID:
        s = tl.where(m2, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        mx = tl.where(rmask, tl.max(x, axis=1), 0.0)
        ex = tl.where(m2, tl.exp(x - mx[:, None]), 0.0)
        s = ex / tl.sum(ex, axis=1)[:, None]
    kk = tl.arange(0, BK)
    mk = rmask[:, None] & (kk < K_TOP)[None, :]
    ids2 = tl.load(ids_ptr + rows[:, None] * K_TOP + kk[None, :], mask=mk, other=-1)
    g2 = tl.load(dp_ptr + rows[:, None] * K_TOP + kk[None, :], mask=mk, other=0.0)
    gv = tl.zeros([BT, BE], dtype=tl.float32)
    selc = tl.zeros([BT, BE], dtype=tl.int32)
    for j in range(K_TOP):
        e_j = tl.sum(tl.where(kk[None, :] == j, ids2, 0), axis=1)
        g_j = tl.sum(tl.where(kk[None, :] == j, g2, 0.0), axis=1)
        hit = (eb[None, :] == e_j[:, None]) & m2
        gv = tl.where(hit, g_j[:, None], gv)
        selc = selc + hit.to(tl.int32)
    selm = selc > 0
    p = tl.where(selm, s, 0.0)
    if NORMALIZE:
        S = tl.sum(p, axis=1)[:, None]
        if K_TOP == 1:
            # p / S == 1 identically: exactly zero gradient (gv - gv keeps NaN/Inf); the
            # general formula leaves GPU rounding noise (approximate fp32 division)
            ds = tl.where(selm, scale * (gv - gv) / S, 0.0)
        else:
            d = tl.sum(gv * p, axis=1)[:, None] / S
            ds = tl.where(selm, scale * (gv - d) / S, 0.0)
    else:
        ds = tl.where(selm, scale * gv, 0.0)
    if SIGMOID:
        dl = ds * s * (1.0 - s)
    else:
        dl = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    tl.store(dl_ptr + rows[:, None] * stride_l + eb[None, :], dl.to(dl_ptr.dtype.element_ty),
             mask=m2)


def topk_route_bwd(dprobs: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                   sigmoid: bool, normalize: bool, scale: float) -> torch.Tensor:
    """``dlogits [T, E]`` (logits' dtype, contiguous) from ``dprobs [T, k]`` fp32."""
    T, E = logits.shape
    k = ids.shape[1]
    dl = empty(T, E, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return dl
    BE = next_power_of_2(E)
    BT = max(1, (512 if INTERPRET else 2048) // BE)
    nw = 4 if BT * BE <= 4096 else 8
    with device_guard(logits):
        launch(_topk_bwd_kernel, (cdiv(T, BT),),
            logits, ids, dprobs, dl, T, E, E, float(scale), BT=BT, K_TOP=k,
            BK=next_power_of_2(k), BE=BE, SIGMOID=sigmoid, NORMALIZE=normalize, num_warps=nw)
    return dl


@triton.jit
def _zloss_bwd_kernel(logits_ptr, lse_ptr, g_ptr, dl_ptr, T, E, stride_l, inv_t,
                      ROWS: tl.constexpr, BE: tl.constexpr):
    pid = tl.program_id(0)
    eb = tl.arange(0, BE)
    g = tl.load(g_ptr).to(tl.float32)
    for i in range(ROWS):
        t = pid.to(tl.int64) * ROWS + i
        rv = (eb * 0 + t) < T
        lse = tl.load(lse_ptr + tl.minimum(t, T - 1))
        c = g * 2.0 * lse * inv_t
        for e0 in range(0, E, BE):
            m = (e0 + eb < E) & rv
            x = tl.load(logits_ptr + t * stride_l + e0 + eb, mask=m, other=0.0).to(tl.float32)
            d = c * tl.exp(x - lse)
            tl.store(dl_ptr + t * E + e0 + eb, d.to(dl_ptr.dtype.element_ty), mask=m)


def router_z_loss_bwd(g: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    T, E = logits.shape
    dl = empty_like(logits) if logits.is_contiguous() else empty(T, E, dtype=logits.dtype,
                                                                   device=logits.device)
    if T == 0:
        return dl
    ROWS = _rows_per_prog(T, logits.device)
    BE = min(next_power_of_2(max(E, 1)), 4096)
    with device_guard(logits):
        launch(_zloss_bwd_kernel, (cdiv(T, ROWS),),
            logits, lse, g if g.dtype == torch.float32 else g.float(), dl, T, E, logits.stride(0),
            1.0 / T, ROWS=ROWS, BE=BE, num_warps=1 if BE <= 512 else 4)
    return dl
