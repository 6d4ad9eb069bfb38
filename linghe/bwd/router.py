"""Router backward kernels: router GEMM grads (fp32-exact), top-k routing, z-loss.

- ``router_logits``: ``dx = dlogits @ W`` (dx in x's dtype) and ``dW = dlogits^T @ x``
  (fp32) from bf16 parts (no TF32): ``dlogits`` is split into its bf16 parts once
  (:func:`linghe.fwd.router.split_parts`, shared by both GEMMs; or by the dx kernel,
  :data:`DX_SPLITS`; or in registers by the dW kernel, form ``"split"``), ``W``'s parts
  come from the forward. With a bf16 ``x`` whose rows TMA can address (Hopper, 16-byte aligned rows)
  both GEMMs load their operands by TMA (:func:`dw_tma`: :func:`_dw_kernel`,
  :func:`dx_tma`: :func:`_dx_kernel`); otherwise, and for a float32 ``x``, both go
  through :func:`linghe.fwd.router.matmul_parts` (pointer loads).
- ``topk_route``: one program per block of rows recomputes the scores from the logits and
  back-propagates ``dprobs`` through the scale, the normalization and softmax/sigmoid
  (selection has no gradient).
- ``router_z_loss``: ``dlogits = g * 2 * lse / T * softmax(logits)``.

**dW (``[E, H]`` fp32 from ``K = T`` tokens).** Every product ``part_p(dl)[t, e] *
x[t, h]`` of two bf16 values is exact in fp32, so ``dW = sum_p part_p(dl)^T @ x`` with
fp32 accumulation is fp32-exact (relative error ~2e-6 against float64 on Hopper, whose
MMA accumulation is not IEEE round-to-nearest). Few output tiles (``[256, 2048]``: 32 of
``128 x 128``) and a long contraction: the token range is split over programs (``SPLIT``)
and the fp32 partials are summed in rank order (deterministic, ``REDUCE``): by the
tile's last program to finish (``"last"``: no extra launch, but one SM per tile reads all
its partials), by a second kernel (``"kernel"``), or by the dx kernel that runs after
the dW kernel (``"dx"``: each dx program sums a slice after its tiles). Four forms of
the K loop (``FORM``), which trade operand bytes (L2 -> shared memory, per 3 x
128x128x64 MMA) against MMA stalls:

- ``"acc"``: one accumulator per part, each K step loads the ``x`` box once and issues
  ``P`` independent dots (``P * BM * BN`` fp32 accumulators: ``128 x 128`` or ``64 x
  256`` at most; 64 / 56 KB);
- ``"chain"``: one accumulator, the ``P`` dots of a K step chained (``x`` box loaded
  once; ``128 x 256``: 40 KB), but Triton 3.6 waits for each chained dot's MMAs
  (``wgmma.wait_group 0``) before issuing the next;
- ``"flat"``: one accumulator and one flat pipelined loop over (part, K step), the small
  parts first over the whole K chunk, then the hi part (no waits; the ``x`` box loaded
  once per part: ``128 x 256``: 72 KB);
- ``"split"``: ``"chain"`` on float32 dlogits boxes, split into their bf16 parts in
  registers and fed to the MMA from registers (``128 x 256``: 32 KB of dlogits + 32 KB of
  x per K step of 64; no split kernel and no parts in memory: the dx kernel then reads
  float32 dlogits too), at the cost of the split's ALU work in the K loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..fwd.router import (
    CONFIG,
    _rows_per_prog,
    _split3,
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
#: order 0); False: :func:`linghe.fwd.router.matmul_parts` for both GEMMs (main's path).
BWD_TMA = True
#: Overrides of :func:`_dw_config`'s keys (``BM, BN, BK, num_warps, num_stages, SPLIT,
#: FORM, REDUCE, GROUP_M``; ``FORM``: ``"acc"``, ``"chain"``, ``"flat"`` or ``"split"``;
#: ``REDUCE``: ``"last"``, ``"kernel"`` or ``"dx"``; see the module docstring) for
#: :func:`dw_tma`; ``None``: the heuristic.
DW_CONFIG: dict | None = None
#: Overrides of :func:`_dx_config`'s keys (``BM, BN, BK, num_warps, num_stages, PERSIST,
#: EPI_TMA, GROUP_M``) for :func:`dx_tma`; ``None``: the heuristic.
DX_CONFIG: dict | None = None
#: The defaults of the heuristics :func:`_dw_config` / :func:`_dx_config` (what
#: ``DW_CONFIG`` / ``DX_CONFIG`` leave out). ``DW_FORM``: ``"acc"`` takes ``128 x 128``
#: tiles; the one-accumulator forms ``"chain"``, ``"flat"`` and ``"split"`` take ``128 x
#: 256``; the token range is split so that the programs make about one wave.
#: ``DW_REDUCE``: who sums the K-split partials (``"last"``, ``"kernel"``, ``"dx"``).
#: ``DX_PERSIST``: dx programs per SM (0: one tile per program); ``DX_EPI_TMA``: TMA
#: stores of the dx tiles. ``benchmark/probe_router.py`` times the alternatives (H100,
#: standard shape, kernel µs: main's pointer kernels 87.8; "acc" with the K-split summed
#: by a kernel 37.7 + 3.0 against 41.8 by the last program; the persistent dx with TMA
#: stores 22.0 against 27.4; every "chain"/"flat"/"split" form and the dx-side split
#: lost: ``benchmark/results/h100_probe_router_bwd_2026-11-26_s5.*``).
DW_FORM = "acc"
DW_REDUCE = "kernel"
DX_PERSIST = 1
DX_EPI_TMA = True
#: With a float32 ``dlogits`` and the TMA dx: the dx kernel reads ``dlogits`` itself
#: (rounded to bf16 in registers) and writes its bf16 parts for dW (each program of a
#: row tile a share of its K boxes), so no separate split kernel runs (it read 4 and
#: wrote 6 bytes per element); False: :func:`linghe.fwd.router.split_parts` first.
DX_SPLITS = False


def _tma_ok(t: torch.Tensor) -> bool:
    """A 16-bit matrix (or stack of matrices) TMA can address: unit last stride, 16-byte
    aligned base and row stride."""
    return (t.element_size() == 2 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(-2) * 2) % 16 == 0)


# ------------------------------------------------------------------------------ dW
@triton.jit
def _dw_kernel(a_desc, b_desc, out_ptr, ws_ptr, flag_ptr, M, N, T, k_per_split,
               P: tl.constexpr, FORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
               FIXUP: tl.constexpr, CH: tl.constexpr):
    """``out [M, N] fp32 = sum_p A_p^T @ B``: ``A_p`` (``[T, M]`` bf16) are the ``P`` parts
    of ``dlogits``, stacked along the rows as one ``[P * T, M]`` matrix (``a_desc``,
    ``[BK, BM]`` boxes: part ``p``'s box at row ``p * T + k``), ``B = x [T, N]``
    (``b_desc``, ``[BK, BN]`` boxes). Both come by TMA, fed to the MMA as they are (an
    M-major ``A^T`` and an N-major ``B``: Hopper's bf16 wgmma reads both from shared
    memory). A box that starts before ``T`` but reaches past it reads the next part's
    first rows (finite: ``mid``/``lo`` parts are zero where ``dlogits`` is not finite) and
    ``B``'s zero fill there, so those rows add exact zeros; past the last part TMA fills
    zeros. No masks in the K loop.

    ``FORM`` (module docstring): 0, one accumulator per part (each K step loads the ``B``
    box once and issues ``P`` independent dots); 1, one accumulator, the ``P`` dots of a K
    step chained (the ``B`` box loaded once; Triton 3.6 drains the MMA pipe between
    chained dots); 2, one accumulator, one flat loop over (part, K step), parts ``P-1 ..
    0`` (small first) each over the whole chunk (no drains; the ``B`` box loaded once per
    part); 3, form 1 with ``a_desc`` over float32 dlogits ``[T, M]`` itself, each box
    split into its parts in registers (:func:`linghe.fwd.router._split3`).

    Program ``pid`` computes tile ``pid % tiles`` (grouped order) over the token chunk
    ``rank = pid // tiles`` (``k_per_split`` wide, ``SPLIT`` chunks). With ``SPLIT > 1``
    the fp32 partial goes to ``ws[rank]``; with ``FIXUP`` each program then counts itself
    in ``flag[tile]`` (acq_rel, after a barrier) and the tile's last program sums the
    partials in rank order (the same adds in the same order whichever program is last:
    deterministic), ``CH`` rows at a time, stores the tile and resets the flag to 0 for
    the next launch. Without ``FIXUP`` a later kernel sums them (``_sum_splits_kernel``
    or :func:`_dx_kernel`). Nobody waits for another program."""
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
    if FORM == 3:
        for k in range(k_lo, k_hi, BK):
            b = b_desc.load([k, off_n])
            hi, mid, lo = _split3(a_desc.load([k, off_m]))
            if P > 2:
                acc = dot_f32acc(tl.trans(lo), b, acc)
            if P > 1:
                acc = dot_f32acc(tl.trans(mid), b, acc)
            acc = dot_f32acc(tl.trans(hi), b, acc)
    elif FORM == 2:
        nk = tl.cdiv(k_hi - k_lo, BK)
        for i in range(0, P * nk):
            q = i // nk  # part P-1-q, K step i - q * nk
            k = k_lo + (i - q * nk) * BK
            a = a_desc.load([(P - 1 - q) * T + k, off_m])
            b = b_desc.load([k, off_n])
            acc = dot_f32acc(tl.trans(a), b, acc)
    elif FORM == 1:
        for k in range(k_lo, k_hi, BK):
            b = b_desc.load([k, off_n])
            if P > 2:
                a2 = a_desc.load([T + T + k, off_m])
                acc = dot_f32acc(tl.trans(a2), b, acc)
            if P > 1:
                a1 = a_desc.load([T + k, off_m])
                acc = dot_f32acc(tl.trans(a1), b, acc)
            a0 = a_desc.load([k, off_m])
            acc = dot_f32acc(tl.trans(a0), b, acc)
    else:
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
        mn = M.to(tl.int64) * N
        tl.store(ws_ptr + rank * mn + offs, acc, mask=mask)
        if FIXUP:
            tl.debug_barrier()  # every thread's partial is written before the release
            if tl.atomic_add(flag_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
                # the tile's last chunk: sum the partials in rank order, CH rows at a time
                for i in range(0, BM, CH):
                    r2 = off_m + i + tl.arange(0, CH)
                    m2 = (r2 < M)[:, None] & (rn < N)[None, :]
                    o2 = r2.to(tl.int64)[:, None] * N + rn[None, :]
                    s = tl.load(ws_ptr + o2, mask=m2, other=0.0, cache_modifier=".cg")
                    for r in tl.static_range(1, SPLIT):
                        s += tl.load(ws_ptr + r * mn + o2, mask=m2, other=0.0,
                                     cache_modifier=".cg")
                    tl.store(out_ptr + o2, s, mask=m2)
                tl.store(flag_ptr + tile, 0)  # ready for the next launch (stream order)


_DW_CFG: dict = {}
_FLAGS: dict = {}
_FORMS = {"acc": 0, "chain": 1, "flat": 2, "split": 3}


def _flags(dev, n: int) -> torch.Tensor:
    """A per-device int32 zero vector of at least ``n`` tile counters, which
    :func:`_dw_kernel` increments and its last program per tile resets to zero (launches
    on one device are assumed stream-ordered, as all of a training step's are)."""
    f = _FLAGS.get(dev)
    if f is None or f.numel() < n:
        f = _FLAGS[dev] = torch.zeros(max(n, 1024), dtype=torch.int32, device=dev)
    return f


def _dw_config(M: int, N: int, T: int, P: int, dev) -> dict:
    """Launch config of :func:`_dw_kernel` for ``dW [M, N]`` over ``T`` tokens with ``P``
    parts of dlogits (cached per shape and :data:`DW_FORM` / :data:`DW_REDUCE`). Form
    ``"acc"`` (the default: main's tiles and accumulators on TMA loads): ``128 x 128``
    tiles, ``P * 64`` accumulator registers a thread at 8 warps, ``BK = 64``. The
    one-accumulator forms: ``128 x 256`` tiles (``BK = 32`` for ``"split"``, whose split
    needs registers). The token range is split so that the programs make about one wave
    (the router's ``[256, 2048]``: 32 tiles x 4 chunks, or 16 x 8), in chunks of at
    least 1024 tokens; stages within ~200 KB of shared memory (``"split"``: 3)."""
    form, reduce = DW_FORM, DW_REDUCE
    key = (M, N, T, P, dev, form, reduce)
    cfg = _DW_CFG.get(key)
    if cfg is not None:
        return cfg
    if INTERPRET:
        cfg = dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1, SPLIT=1, FORM=form,
                   REDUCE=reduce, GROUP_M=8)
    else:
        sms = num_sms(dev)
        BM = 128 if M > 64 else 64
        BN = 128 if N > 64 else 64
        if form != "acc" and N > 128:
            BN = 256
        BK = 32 if form == "split" else 64
        tiles = cdiv(M, BM) * cdiv(N, BN)
        split = max(1, min(sms // tiles, cdiv(T, 1024)))
        a_rows = {"acc": P * BM, "chain": P * BM, "flat": BM, "split": 2 * BM}[form]
        stage = (a_rows + BN) * BK * 2
        ns = 3 if form == "split" else max(2, min(4, (200 * 1024) // stage))
        cfg = dict(BM=BM, BN=BN, BK=BK, num_warps=8, num_stages=ns, SPLIT=split, FORM=form,
                   REDUCE=reduce, GROUP_M=8)
    _DW_CFG[key] = cfg
    return cfg


def dw_form(E: int, H: int, T: int, P: int, dev) -> str:
    """The K-loop form :func:`dw_tma` takes for this shape (:data:`DW_CONFIG` over the
    heuristic)."""
    cfg = DW_CONFIG or {}
    return cfg.get("FORM") or _dw_config(E, H, T, P, dev)["FORM"]


def dw_tma(dl: torch.Tensor, x2: torch.Tensor, parts: int | None = None, *,
           config: dict | None = None, deferred: list | None = None
           ) -> torch.Tensor | None:
    """``dW [E, H] fp32 = dl^T @ x2`` through :func:`_dw_kernel`, or ``None`` where TMA
    cannot address the operands (unit last strides, 16-byte aligned rows; ``x2 [T, H]``
    bf16). ``dl``: the bf16 parts of dlogits ``[P, T, E]`` (stacked: ``stride(0) == T *
    stride(1)``; every form but ``"split"``), or float32 dlogits ``[T, E]`` itself (form
    ``"split"`` only: its first ``parts`` bf16 parts made in registers). ``config``:
    overrides of :func:`_dw_config`'s keys. ``REDUCE="dx"`` with a K split and a
    ``deferred`` list: the partials are not summed here; ``(ws, split)`` is appended to
    ``deferred`` and the caller sums them into the returned tensor (:func:`dx_tma`'s
    ``reduce``, or :func:`_sum_splits`) before using it; without ``deferred``, or for
    ``"kernel"``, ``_sum_splits_kernel`` sums them."""
    f32 = dl.dim() == 2
    if f32:
        T, E = dl.shape
        P = parts
        dl_ok = (dl.dtype == torch.float32 and dl.stride(-1) == 1 and dl.data_ptr() % 16 == 0
                 and (dl.stride(0) * 4) % 16 == 0)
    else:
        P, T, E = dl.shape
        dl_ok = (dl.dtype == torch.bfloat16 and _tma_ok(dl)
                 and (P == 1 or dl.stride(0) == T * dl.stride(1)))
    H = x2.shape[1]
    if not (dl_ok and x2.dtype == torch.bfloat16 and tma_capable(x2) and _tma_ok(x2)):
        return None
    dev = x2.device
    cfg = dict(_dw_config(E, H, T, P, dev))
    if config:
        cfg.update(config)
    if f32 != (cfg["FORM"] == "split"):
        raise ValueError(f"dw_tma: form {cfg['FORM']!r} takes "
                         f"{'float32 dlogits' if not f32 else 'bf16 parts'}")
    if cfg["REDUCE"] not in ("last", "kernel", "dx"):
        raise ValueError(f"dw_tma: REDUCE must be 'last', 'kernel' or 'dx', got "
                         f"{cfg['REDUCE']!r}")
    out = empty(E, H, dtype=torch.float32, device=dev)
    if E == 0 or H == 0:
        return out
    if T == 0:
        return out.zero_()
    BM, BN, BK, nw = cfg["BM"], cfg["BN"], cfg["BK"], cfg["num_warps"]
    form = _FORMS[cfg["FORM"]] if (P > 1 or f32) else 0
    k_per = cdiv(cdiv(T, cfg["SPLIT"]), BK) * BK
    split = cdiv(T, k_per)
    tiles = cdiv(E, BM) * cdiv(H, BN)
    fixup = cfg["REDUCE"] == "last"
    ws = flags = out
    if split > 1:
        ws = empty(split, E, H, dtype=torch.float32, device=dev)
        if fixup:
            flags = _flags(dev, tiles)
    if f32:
        a_desc = TensorDescriptor(dl, [T, E], [dl.stride(0), 1], [BK, BM])
    else:
        a2 = dl.as_strided((P * T, E), (dl.stride(1), 1))  # the parts stacked along the rows
        a_desc = TensorDescriptor(a2, [P * T, E], [dl.stride(1), 1], [BK, BM])
    b_desc = TensorDescriptor(x2, [T, H], [x2.stride(0), 1], [BK, BN])
    with device_guard(x2):
        launch(_dw_kernel, (tiles * split,), a_desc, b_desc, out, ws, flags, E, H, T, k_per,
               P=P, FORM=form, BM=BM, BN=BN, BK=BK, GROUP_M=cfg["GROUP_M"], SPLIT=split,
               FIXUP=fixup, CH=max(1, min(BM, 512 * nw // BN)), num_warps=nw,
               num_stages=cfg["num_stages"])
    if split > 1 and not fixup:
        if cfg["REDUCE"] == "dx" and deferred is not None:
            deferred.append((ws, split))
        else:
            _sum_splits(ws, out, split)
    return out


def _sum_splits(ws: torch.Tensor, out: torch.Tensor, split: int) -> None:
    """``out = ws[0] + .. + ws[split - 1]`` in that order (``_sum_splits_kernel``)."""
    BLOCK = 1024
    with device_guard(out):
        launch(_sum_splits_kernel, (cdiv(out.numel(), BLOCK),), ws, out, out.numel(), split,
               BLOCK=BLOCK, num_warps=4)


# ------------------------------------------------------------------------------ dx
@triton.jit
def _dx_kernel(a_desc, b_desc, c_desc, c_ptr, parts_ptr, ws_ptr, red_ptr, M, N, K, n_red,
               red_chunk, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP_M: tl.constexpr, EPI_TMA: tl.constexpr, FLATTEN: tl.constexpr,
               P_OUT: tl.constexpr, S_RED: tl.constexpr, RBLOCK: tl.constexpr):
    """``C [M, N] = A @ B`` (fp32 accumulation, stored in ``C``'s 16-bit dtype): ``A``
    (``a_desc``, ``[BM, BK]`` boxes) and ``B`` (``b_desc``, ``[BK, BN]`` boxes, N-major)
    by TMA, zero-filled past their ends. Program ``pid`` computes tiles ``pid, pid + G,
    ..`` (``G`` programs; one tile each when ``G`` is the tile count); ``FLATTEN``: the
    tile and K loops flattened into one pipelined loop (the next tile's first loads in
    flight during this tile's last MMAs and its store). ``EPI_TMA``: the tile is stored
    by TMA (``c_desc``, ``[BM, BN]`` boxes, clipped at the tensor's end), else by
    pointer stores to ``c_ptr`` (row stride ``N``).

    A float32 ``A`` (``dlogits`` itself) is rounded to bf16 in registers (the same value
    as its ``hi`` part); with ``P_OUT > 0`` the programs of column tile ``n`` also write
    the first ``P_OUT`` bf16 parts (:func:`linghe.fwd.router._split3`) of ``A``'s K boxes
    ``n, n + num_n, ..`` of their row tile to ``parts [P_OUT, M, K]`` (contiguous), so
    that every element of ``A`` is split exactly once and no separate split kernel runs.

    ``S_RED > 0``: after its tiles, program ``pid`` also sums elements ``[pid * red_chunk,
    (pid + 1) * red_chunk)`` of ``S_RED`` float32 partials ``ws [S_RED, n_red]`` in rank
    order into ``red [n_red]`` (the dW kernel's K split, launched before this kernel:
    no separate sum kernel), ``RBLOCK`` elements at a time with all ``S_RED`` loads in
    flight."""
    A_F32: tl.constexpr = a_desc.dtype == tl.float32
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    tiles = num_m * num_n
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile_order(t, num_m, num_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([off_m, k])
            if A_F32:
                a = a.to(tl.bfloat16)
            b = b_desc.load([k, off_n])
            acc = dot_f32acc(a, b, acc)
        out = acc.to(c_desc.dtype)
        if EPI_TMA:
            c_desc.store([off_m, off_n], out)
        else:
            rm = off_m + tl.arange(0, BM)
            rn = off_n + tl.arange(0, BN)
            tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], out,
                     mask=(rm < M)[:, None] & (rn < N)[None, :])
        if P_OUT > 0:
            rm = off_m + tl.arange(0, BM)
            rk = tl.arange(0, BK)
            mk = M.to(tl.int64) * K
            for j in range(pid_n, tl.cdiv(K, BK), num_n):
                h, mid, lo = _split3(a_desc.load([off_m, j * BK]))
                ck = j * BK + rk
                msk = (rm < M)[:, None] & (ck < K)[None, :]
                ptr = parts_ptr + rm.to(tl.int64)[:, None] * K + ck[None, :]
                tl.store(ptr, h, mask=msk)
                if P_OUT > 1:
                    tl.store(ptr + mk, mid, mask=msk)
                if P_OUT > 2:
                    tl.store(ptr + mk + mk, lo, mask=msk)
    if S_RED > 0:
        r_lo = tl.program_id(0).to(tl.int64) * red_chunk
        r_hi = tl.minimum(r_lo + red_chunk, n_red)
        for r0 in range(r_lo, r_hi, RBLOCK):
            offs = r0 + tl.arange(0, RBLOCK)
            rmask = offs < r_hi
            p = ws_ptr + offs
            tot = tl.load(p, mask=rmask, other=0.0)
            for _ in tl.static_range(1, S_RED):
                p += n_red
                tot += tl.load(p, mask=rmask, other=0.0)
            tl.store(red_ptr + offs, tot, mask=rmask)


_DX_CFG: dict = {}


def _dx_config(M: int, N: int, K: int, a_size: int, dev) -> dict:
    """Launch config of :func:`_dx_kernel` for ``dx [M, N] = dl [M, K] @ W [K, N]``
    (``a_size``: bytes per element of ``dl``; cached per shape and :data:`DX_PERSIST` /
    :data:`DX_EPI_TMA`): ``128 x 256`` tiles (the router's ``[8192, 2048]`` over ``K = E =
    256``: 512 tiles), 8 warps, ``BK = 64`` and 3 stages for bf16 ``dl``, ``BK = 32`` and
    4 stages for float32 (shared memory for the TMA-store tile too)."""
    persist, epi = DX_PERSIST, DX_EPI_TMA
    key = (M, N, K, a_size, dev, persist, epi)
    cfg = _DX_CFG.get(key)
    if cfg is not None:
        return cfg
    if INTERPRET:
        cfg = dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1, PERSIST=persist,
                   EPI_TMA=epi, GROUP_M=8)
    else:
        BM = 128 if M > 64 else 64
        BN = 256 if N > 128 else (128 if N > 64 else 64)
        f32 = a_size == 4
        cfg = dict(BM=BM, BN=BN, BK=32 if f32 else 64, num_warps=8, num_stages=4 if f32 else 3,
                   PERSIST=persist, EPI_TMA=epi, GROUP_M=8)
    _DX_CFG[key] = cfg
    return cfg


def dx_tma(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
           parts: torch.Tensor | None = None, reduce: tuple | None = None,
           config: dict | None = None) -> torch.Tensor | None:
    """``a [M, K] @ b [K, N]`` -> ``[M, N]`` ``out_dtype`` (bf16/fp16; fp32 accumulation
    of bf16 products) through :func:`_dx_kernel`, or ``None`` where TMA cannot address
    the operands (unit last strides, 16-byte aligned rows; ``N`` a multiple of 8). ``b``
    bf16; ``a`` bf16, or float32 (rounded to bf16 in the kernel: ``a``'s hi part), in
    which case ``parts`` (``[P, M, K]`` bf16, contiguous, ``P <= 3``), if given, receives
    ``a``'s first ``P`` bf16 parts (:func:`linghe.fwd.router.split_parts`'s values).
    ``reduce``: ``(ws, out, split)``, float32 partials ``ws [split, *out.shape]`` that the
    kernel's programs also sum into ``out`` (contiguous; :func:`dw_tma`'s ``deferred``);
    not done when this returns ``None``. ``config``: overrides of :func:`_dx_config`'s
    keys (``PERSIST``: programs per SM, 0 for one tile per program)."""
    M, K = a.shape
    N = b.shape[1]
    a_ok = (a.dtype == torch.bfloat16 and _tma_ok(a)) or (
        a.dtype == torch.float32 and a.stride(-1) == 1 and a.data_ptr() % 16 == 0
        and (a.stride(0) * 4) % 16 == 0)
    if not (a_ok and b.dtype == torch.bfloat16 and tma_capable(a) and _tma_ok(b)
            and out_dtype in (torch.bfloat16, torch.float16) and N % 8 == 0):
        return None
    if parts is not None:
        assert a.dtype == torch.float32 and parts.is_contiguous() and parts.shape[1:] == a.shape
    dev = a.device
    out = empty(M, N, dtype=out_dtype, device=dev)
    if M == 0 or N == 0 or K == 0:
        if parts is not None and parts.numel():
            parts.copy_(split_parts(a, parts.shape[0]))
        if reduce is not None:
            _sum_splits(*reduce)
        return out.zero_() if K == 0 else out
    cfg = dict(_dx_config(M, N, K, a.element_size(), dev))
    if config:
        cfg.update(config)
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    tiles = cdiv(M, BM) * cdiv(N, BN)
    persist = int(cfg["PERSIST"])
    grid = tiles if persist <= 0 else min(tiles, persist * (8 if INTERPRET else num_sms(dev)))
    ws = red = out
    n_red = red_chunk = s_red = 0
    RBLOCK = 1024
    if reduce is not None:
        ws, red, s_red = reduce
        n_red = red.numel()
        red_chunk = cdiv(cdiv(n_red, grid), RBLOCK) * RBLOCK
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [BM, BK])
    b_desc = TensorDescriptor(b, [K, N], [b.stride(0), 1], [BK, BN])
    c_desc = TensorDescriptor(out, [M, N], [N, 1], [BM, BN])
    with device_guard(a):
        launch(_dx_kernel, (grid,), a_desc, b_desc, c_desc, out,
               parts if parts is not None else out, ws, red, M, N, K, n_red, red_chunk,
               BM=BM, BN=BN, BK=BK, GROUP_M=cfg["GROUP_M"], EPI_TMA=bool(cfg["EPI_TMA"]),
               FLATTEN=persist > 0, P_OUT=0 if parts is None else parts.shape[0],
               S_RED=s_red, RBLOCK=RBLOCK, num_warps=cfg["num_warps"],
               num_stages=cfg["num_stages"])
    return out


def router_logits_bwd(dlogits: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                      need_dx: bool = True, need_dw: bool = True,
                      w_parts: torch.Tensor | None = None):
    """``dlogits [T, E]`` fp32, ``x2 [T, K]``, ``weight [E, K]`` -> ``(dx [T, K] x.dtype,
    dw [E, K] fp32)`` (``None`` where not needed). ``w_parts``: the forward's
    :func:`linghe.fwd.router.weight_parts` of ``weight`` (split here when absent).

    Launches, in order: the split of ``dlogits`` into bf16 parts (not when the dW form is
    ``"split"`` and dx reads float32 dlogits, nor with :data:`DX_SPLITS`, whose dx kernel
    writes the parts and runs first), the dW GEMM (and, with a K split and ``REDUCE`` of
    ``"kernel"``, the partials' sum; ``"dx"``: the dx kernel sums them), the dx GEMM."""
    dx_order = 2 if x2.dtype == torch.float32 else DX_ORDER
    # fp32 weight: fp32-exact dw (ORDER 2); a bf16/fp16 weight gets its gradient in its own
    # dtype, so bf16-level accuracy (ORDER 1: 2 passes instead of 3) is enough there.
    dw_order = 2 if weight.dtype == torch.float32 else 1
    if not (need_dx or need_dw):
        return None, None
    T, E = dlogits.shape
    H = x2.shape[1]
    P = min(dw_order + 1, 3)  # dlogits' parts for dW
    f32 = dlogits.dtype == torch.float32
    tma_dx = need_dx and BWD_TMA and dx_order == 0
    form = dw_form(E, H, T, P, dlogits.device) if need_dw and BWD_TMA else None
    dw_f32 = form == "split" and f32  # dW splits float32 dlogits in registers
    # dx reads float32 dlogits (no parts of its own), writing dW's parts with DX_SPLITS
    dx_f32 = tma_dx and f32 and (dw_f32 or DX_SPLITS)
    wp = None
    if need_dx:
        wp = split_parts(weight, dx_order + 1) if w_parts is None else w_parts
    dlp = dx = dw = None
    deferred: list = []
    if dx_f32 and need_dw and not dw_f32:
        # DX_SPLITS: dx first, writing the parts dW reads
        parts = empty(P, T, E, dtype=torch.bfloat16, device=dlogits.device)
        dx = dx_tma(dlogits, wp[0], x2.dtype, parts=parts, config=DX_CONFIG)
        if dx is not None:
            dlp = parts
    if need_dw:
        if dw_f32:
            dw = dw_tma(dlogits, x2, P, config=DW_CONFIG, deferred=deferred)
        if dw is None:
            if dlp is None:
                dlp = split_parts(dlogits, max(P, dx_order + 1 if need_dx else 0))
            if BWD_TMA and form != "split":
                dw = dw_tma(dlp[:P], x2, config=DW_CONFIG, deferred=deferred)
            if dw is None:
                dw = matmul_parts(dlp.transpose(1, 2), split_parts(x2, dw_order + 1),
                                  torch.float32, dw_order, config=CONFIG["dw"])
    if need_dx and dx is None:
        red = (deferred[0][0], dw, deferred[0][1]) if deferred else None
        if tma_dx:
            if dx_f32:
                dx = dx_tma(dlogits, wp[0], x2.dtype, reduce=red, config=DX_CONFIG)
            if dx is None:
                if dlp is None:
                    dlp = split_parts(dlogits, dx_order + 1)
                dx = dx_tma(dlp[0], wp[0], x2.dtype, reduce=red, config=DX_CONFIG)
        if dx is not None:
            deferred = []  # summed by the dx kernel
        else:
            if dlp is None:
                dlp = split_parts(dlogits, dx_order + 1)
            dx = matmul_parts(dlp, wp, x2.dtype, dx_order, config=CONFIG["dx"])
    for ws, split in deferred:  # no dx kernel to sum them
        _sum_splits(ws, dw, split)
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
