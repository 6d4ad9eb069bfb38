"""Cross entropy (also vocab-parallel) and fused linear cross entropy: autograd Functions,
public functions and input validation."""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import library
from ..bwd import deferred
from ..bwd.loss import ce_backward, scale_by_grad_
from ..context import current_recipe
from ..fp8 import gemm as fp8_gemm
from ..fp8.cache import WeightCache
from ..fp8.quantize import FP8_DTYPE, empty_1x128, quantize_1x128_launch
from ..fwd.loss import ce_forward, ce_grad_fp8, ce_partials, ce_reduce, ce_row_weight
from ..utils import (
    FLOAT_DTYPES,
    apply_function,
    capture_pauses_bookkeeping,
    cdiv,
    check_kernel_device,
    check_same_device,
    check_tensor,
    debug_enabled,
    empty,
    may_keep_derived,
    next_power_of_2,
)

_REDUCTIONS = ("mean", "sum", "none")
_LABEL_DTYPES = (torch.int64, torch.int32)


def _check_options(ignore_index, reduction, label_smoothing, z_loss):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not float(z_loss) >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")


def _check_labels_in_range(labels, ignore_index, V):
    """Debug mode only (host sync): every label is ignore_index or in [0, V)."""
    if not debug_enabled() or labels.numel() == 0:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"labels[{i}] = {int(labels[i])} is out of range: labels must be "
                         f"ignore_index ({ignore_index}) or in [0, {V})")


def _check_ce_inputs(logits, labels):
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2, last_dim_contiguous=True)
    check_tensor("labels", labels, dtypes=_LABEL_DTYPES, ndim=1)
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(f"labels must have shape ({logits.shape[0]},) to match logits "
                         f"{tuple(logits.shape)}, got {tuple(labels.shape)}")
    check_same_device(logits=logits, labels=labels)
    check_kernel_device("logits", logits)
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one class (V >= 1), got V = 0")


def _vocab_slice(process_group, V_local, device):
    """``(vocab_start, vocab_total)`` of this rank: an all_gather of the slice sizes (one
    small collective and a host sync per call), slices ordered by rank."""
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    mine = torch.tensor([V_local], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=process_group)
    sizes = torch.cat(sizes).tolist()
    return sum(sizes[:rank]), sum(sizes)


def _dist_stats(logits, labels, process_group, *, ignore_index, label_smoothing, z_loss,
                vocab_start, vocab_total):
    """Vocab-parallel forward: local partials -> all-reduce MAX of the row max, SUM of the
    rescaled sum-exp, target logit and row sum -> per-row ``(loss, lse)`` (all ranks equal)."""
    import torch.distributed as dist

    part = ce_partials(logits, labels, ignore_index=ignore_index, vocab_start=vocab_start,
                       vocab_total=vocab_total)
    m_loc = part[0]
    m = m_loc.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=process_group)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    stats = torch.stack([part[1] * torch.exp(m_loc - m_safe), part[2], part[3]])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group)
    s, x_t, sx = stats[0], stats[1], stats[2]
    lse = m_safe + torch.log(s)
    eps = float(label_smoothing)
    loss = lse - (1.0 - eps) * x_t - (eps / vocab_total) * sx + float(z_loss) * lse * lse
    valid = (labels != ignore_index) & (labels >= 0) & (labels < vocab_total)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    lse = torch.where(valid, lse, torch.zeros_like(lse))  # ignored rows were not read
    return loss.contiguous(), lse.contiguous()


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index, reduction, label_smoothing, z_loss,
                inplace_backward, process_group):
        N, V = logits.shape
        if process_group is None:
            vocab_start, vocab_total = 0, V
        else:
            vocab_start, vocab_total = _vocab_slice(process_group, V, logits.device)
        _check_labels_in_range(labels, ignore_index, vocab_total)
        opts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss)
        if process_group is None:
            loss_rows, lse, out, inv_n = ce_forward(logits, labels, **opts, reduction=reduction)
        else:
            loss_rows, lse = _dist_stats(logits, labels, process_group, **opts,
                                         vocab_start=vocab_start, vocab_total=vocab_total)
            out = inv_n = None
            if reduction != "none":
                out, inv_n = ce_reduce(loss_rows, labels, ignore_index=ignore_index,
                                       vocab_total=vocab_total, mean=reduction == "mean")
        if reduction == "none":
            out = loss_rows
        ctx.save_for_backward(logits, labels, lse, inv_n)
        ctx.opts = opts
        ctx.vocab = (vocab_start, vocab_total)
        ctx.inplace = inplace_backward
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse, inv_n = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ce_backward(logits, labels, lse, grad, inv_n, **ctx.opts,
                             vocab_start=ctx.vocab[0], vocab_total=ctx.vocab[1],
                             inplace=ctx.inplace)
        return dx, None, None, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                  inplace_backward: bool = False, process_group=None) -> torch.Tensor:
    """Cross entropy of ``logits [N, V]`` against ``labels [N]``, fp32 math.

    Args:
        logits: ``[N, V]`` float32/float16/bfloat16, rows contiguous (``stride(1) == 1``;
            any row stride). Any ``V >= 1``.
        labels: ``[N]`` int64/int32 class ids. ``ignore_index`` rows contribute 0. A label
            outside ``[0, V_total)`` raises ``ValueError`` in debug mode
            (:func:`linghe.set_debug`, a host sync); otherwise such a row is treated as
            ignored (never read out of bounds).
        reduction: ``"mean"`` (sum over rows / number of non-ignored rows), ``"sum"`` or
            ``"none"`` (``[N]`` fp32, 0 for ignored rows). If every row is ignored the loss
            is 0 and the gradient 0 (never NaN).
        label_smoothing: ``eps`` as in ``torch.nn.functional.cross_entropy``: the target is
            ``(1 - eps) * onehot + eps / V_total``.
        z_loss: adds ``z_loss * lse**2`` per (non-ignored) row, ``lse = logsumexp(row)``
            (PaLM's auxiliary loss).
        inplace_backward: the backward writes the gradient into the ``logits`` buffer
            (no second ``[N, V]`` buffer) and returns it as the gradient. The logits are
            then overwritten: do not read them after ``backward`` and do not use this when
            another op's backward needs them (e.g. a softcap whose backward saves its
            output), nor call backward twice.
        process_group: vocab-parallel logits. Each rank of the group holds a contiguous
            slice ``[N, V_local]`` of the vocabulary, ordered by rank (rank r's slice starts
            at the sum of the slice sizes of ranks < r; sizes may differ and are exchanged
            by one small ``all_gather`` plus a host sync per call). ``labels`` are global
            ids, equal on every rank. Forward: all-reduce MAX of the row max, then SUM of
            the rescaled sum-exp, target logit and row sum; every rank returns the full
            loss, and its backward gives the gradient of its own slice (no communication).

    Returns the loss: fp32 scalar (``"mean"``/``"sum"``) or ``[N]`` fp32 (``"none"``).
    Saved for backward: ``logits``, ``labels``, per-row ``lse`` (fp32 ``[N]``) and the row
    weight (fp32 ``[1]``); the backward recomputes the softmax from ``lse``.
    """
    _check_ce_inputs(logits, labels)
    _check_options(ignore_index, reduction, label_smoothing, z_loss)
    if torch.compiler.is_compiling() and process_group is None:
        return library.cross_entropy(logits, labels.contiguous(), int(ignore_index), reduction,
                                     float(label_smoothing), float(z_loss))
    return apply_function(_CrossEntropy, logits, labels.contiguous(), int(ignore_index), reduction,
                          float(label_smoothing), float(z_loss), bool(inplace_backward),
                          process_group)


# ---------------------------------------------------------------------------------------
# Fused linear cross entropy
# ---------------------------------------------------------------------------------------

_CHUNK_BYTES = 1 << 29  # target size of one logits chunk (512 MiB; at most twice that)


def default_chunk_size(N: int, V: int, itemsize: int) -> int:
    """Rows per chunk: a power of two of at least 256 rows holding about 512 MiB of
    logits (at most 1 GiB), or all ``N`` rows when fewer. Row counts off cuBLAS's tile
    multiples cost GEMM time: at the e2e LM head (``[8192, 2048] x [157184, 2048]`` bf16,
    H100) one forward+backward took 28.8 ms with 832-row chunks (~256 MiB), 26.3 with
    1024, 24.9 with 2048 (614 MiB peak) and 24.3 unchunked
    (``benchmark/probe_lce_chunk.py``, ``h100_probe_lce_chunk_2026-11-26_s7.json``)."""
    if N == 0:
        return 1
    per_row = max(1, V * itemsize)
    rows = max(256, next_power_of_2(max(1, _CHUNK_BYTES // per_row)))
    while rows > 256 and rows * per_row > 2 * _CHUNK_BYTES:
        rows //= 2
    return min(N, rows)


def _chunk_logits(h, weight, bias, fp8):
    """``h · W^T (+ b)`` of one chunk: cuBLAS in the input dtype, or with ``fp8 = (wq,
    pow2_scale, fp8_wgrad)`` the blockwise FP8 GEMM of ``h`` quantized 1x128 and W's
    rowwise copy."""
    if fp8 is not None:
        wq, pow2 = fp8[:2]
        hq, hs, _, _ = quantize_1x128_launch(h, True, False, pow2, True)
        return fp8_gemm._gemm(hq, hs, "1x128", wq.rowwise_data, wq.rowwise_scale,
                              wq.scaling, h.dtype, bias)
    if bias is None:
        return torch.mm(h, weight.t())
    return torch.addmm(bias, h, weight.t())


def _chunk_dh(d, weight, fp8, out, operands=None):
    """``out = d · W`` (the chunk's hidden gradient): cuBLAS, or the FP8 GEMM of ``d``'s
    1x128 copy and W's columnwise copy: ``operands = (a, a_scale, b, b_scale)`` as
    :func:`_dgrad_fp8_operands` made them, or (when ``None``) ``d`` quantized here."""
    if fp8 is None:
        torch.mm(d, weight, out=out)
        return
    wq, pow2 = fp8[:2]
    if operands is None:
        q, sq = quantize_1x128_launch(d, True, False, pow2, True)[:2]
        operands = (q, sq, wq.columnwise_data, wq.columnwise_scale)
    a, sa, b, sb = operands
    out.copy_(fp8_gemm._gemm(a, sa, "1x128", b, sb, wq.scaling, out.dtype, None))


#: an LM head weight copy's columnwise data -> (K, its zero-padded copy, padded scales)
_PADDED_COLUMNWISE = WeakIdKeyDictionary()


def _padded_columnwise(wq, k: int):
    """W's columnwise copy ``[H, V]`` with zero columns up to ``k`` (and scale 1 for the
    added groups), made once per copy and kept while the copy's version counters stay
    (the optimizer's in-place rewrite of the copy bumps them); made anew inside a CUDA
    graph capture, which must contain it (a replay after a captured update would read a
    stale one), and not kept for a copy a captured update rewrites (its replays bump no
    version)."""
    data, scale = wq.columnwise_data, wq.columnwise_scale
    keep = may_keep_derived(data)
    key = (k, data._version, scale._version)
    hit = _PADDED_COLUMNWISE.get(data) if keep else None
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    rows, V = data.shape
    padded = torch.zeros(rows, k, dtype=torch.uint8, device=data.device)
    padded[:, :V].copy_(data.view(torch.uint8))
    padded_scale = torch.ones(scale.shape[0], k // 128, dtype=torch.float32,
                              device=scale.device)
    padded_scale[:, :scale.shape[1]].copy_(scale)
    if keep:
        _PADDED_COLUMNWISE[data] = (key, padded.view(data.dtype), padded_scale)
    return padded.view(data.dtype), padded_scale


def _dgrad_fp8_operands(fp8, rows: int, V: int, out_dtype, device):
    """For one chunk of the fused FP8 path: ``(dq, operands)``, the buffers the loss kernel
    writes the gradient's 1x128 copy into (``(q [rows, V], scale)``, scales group-major)
    and the dgrad's operands for :func:`_chunk_dh`. Where cuBLAS declines K = V but takes
    it padded (:func:`linghe.fp8.gemm.padded_k`: ``V/128`` not a multiple of 4, e.g. the
    vocabularies 151936 and 128256), the buffers are ``[rows, Vp]`` with zero pad columns
    (scale 1) and the weight's columnwise copy is padded the same way: cuBLAS instead of
    the Triton GEMM, 1.7-2x faster at those shapes (``benchmark/probe_fp8_lm_head.py``)."""
    wq = fp8[0]
    wcol = wq.columnwise_data
    k = fp8_gemm.padded_k(rows, wcol.shape[0], V, "1x128", wq.scaling, FP8_DTYPE,
                          wcol.dtype, out_dtype, device)
    q, sq, _, _ = empty_1x128(rows, k, device, rowwise=True, columnwise=False,
                              group_major=True)
    if k == V:
        return (q, sq), (q, sq, wcol, wq.columnwise_scale)
    groups = cdiv(V, 128)
    q.view(torch.uint8)[:, V:].zero_()
    sq[:, groups:].fill_(1.0)
    return (q[:, :V], sq[:, :groups]), (q, sq, *_padded_columnwise(wq, k))


#: Bytes of the FP8 weight-gradient operand (the logits' gradient, ``[V, tokens]``
#: e4m3) held at once: the weight gradient is one GEMM over up to this many tokens'
#: worth (all of a micro-batch at the e2e shape: 8192 x 157184 = 1.2 GiB), further
#: spans are added into it.
FP8_WGRAD_BUFFER_BYTES = 2 << 30


def fp8_wgrad_on(fp8, group, bias) -> bool:
    """Whether the LM head's weight gradient runs FP8 (:func:`linear_cross_entropy`): the
    FP8 head with the recipe's ``fp8_wgrad``, and neither vocab-parallel (its gradient
    pass is the 16-bit one) nor with a bias (whose gradient sums the 16-bit one)."""
    return fp8 is not None and fp8[2] and group is None and bias is None


def _fp8_wgrad_spans(N: int, V: int, chunk: int) -> list[tuple[int, int]]:
    """Token spans ``[a, b)`` (whole chunks) of one weight-gradient GEMM each."""
    span = max(chunk, FP8_WGRAD_BUFFER_BYTES // max(V, 1) // chunk * chunk)
    return [(a, min(N, a + span)) for a in range(0, N, span)]


def _chunk_grads_fp8(logits, labels, lse, row_weight, opts, weight, fp8, dh_out, columnwise):
    """One chunk's gradient pass with the FP8 weight gradient: the loss gradient written
    only as FP8 (:func:`~linghe.fwd.loss.ce_grad_fp8`: the rowwise copy when ``dh_out`` is
    wanted, the columnwise one into the span's buffer), then ``dh_out = d · W`` in FP8."""
    rowwise = ops = None
    if dh_out is not None:
        rowwise, ops = _dgrad_fp8_operands(fp8, logits.shape[0], logits.shape[1],
                                           dh_out.dtype, logits.device)
    ce_grad_fp8(logits, labels, lse, row_weight, **opts, pow2_scale=fp8[1], rowwise=rowwise,
                columnwise=columnwise)
    if dh_out is not None:
        _chunk_dh(None, weight, fp8, dh_out, ops)


def _wgrad_span_fp8(qt, st, h, pow2: bool, dw):
    """``dlogits^T · h`` of one token span from the gradient's columnwise copy ``qt
    [V, T]`` and ``h [T, H]`` quantized 1x128 along the tokens, added into ``dw`` (or
    returned, the first span)."""
    hq, hs = quantize_1x128_launch(h, False, True, pow2, True)[2:]
    part = fp8_gemm._gemm(qt, st, "1x128", hq, hs, "1x128", h.dtype, None)
    return part if dw is None else dw.add_(part)


def _lce_grads_fp8_wgrad(hidden, weight, labels, lse_or_none, row_weight, opts, chunk,
                         need_h, fp8, loss_rows=None, head=None):
    """``(dh, dw)`` of the FP8 head with the FP8 weight gradient, chunk by chunk: the
    logits (FP8 GEMM), their statistics (:func:`ce_forward`, when ``lse_or_none`` is
    ``None``: the fused forward; its loss rows into ``loss_rows``) or the saved ``lse``
    (the backward of ``reduction="none"``), then :func:`_chunk_grads_fp8`; per span of
    chunks one weight-gradient GEMM. ``chunk`` is a multiple of 128 (whole token groups
    per chunk). ``head`` (a :class:`_HeadSlot`): the columnwise copies go into its
    stash's slot instead (one span) and ``dw`` is ``None``."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    dh = empty(N, H, dtype=hidden.dtype, device=dev) if need_h else None
    dw = None
    for a, b in [(0, N)] if head is not None else _fp8_wgrad_spans(N, V, chunk):
        if head is None:
            qt, st = empty_1x128(b - a, V, dev, rowwise=False, columnwise=True,
                                 group_major=True)[2:]
            t0 = -a
        else:
            qt, st, t0 = head.stash.qt, head.stash.st, head.stash.first_token(head.slot)
        for s in range(a, b, chunk):
            e = min(b, s + chunk)
            logits = _chunk_logits(hidden[s:e], weight, None, fp8)
            if lse_or_none is None:
                lse = ce_forward(logits, labels[s:e], loss_out=loss_rows[s:e], **opts)[1]
            else:
                lse = lse_or_none[s:e]
            w = row_weight if row_weight.numel() == 1 else row_weight[s:e]
            _chunk_grads_fp8(logits, labels[s:e], lse, w, opts, weight, fp8,
                             dh[s:e] if dh is not None else None, (qt, st, t0 + s))
            del logits
        if head is None:
            dw = _wgrad_span_fp8(qt, st, hidden[a:b], fp8[1], dw)
    if head is not None:
        head.stash.put_hidden(head.slot, hidden)
    elif dw is None:  # no rows
        dw = torch.zeros_like(weight)
    return dh, dw


class HeadWgradStash(deferred.Stash):
    """The FP8 LM head's pending weight-gradient micro-batches (``wgrad_micro_batches``
    of :func:`linear_cross_entropy`), ``n`` slots of ``tokens`` (a multiple of 128) each:
    the logits' gradient's columnwise copy ``qt [V, n * tokens]`` (e4m3, 1x128 scales
    ``st`` along the tokens, group-major) and ``hidden``'s ``hq [H, n * tokens]`` (scales
    ``hs``), a micro-batch's at token columns ``slot * tokens ..``, its ``hs`` times its
    ``grad_output`` once its backward ran (then the slot is in ``parts``). With every
    slot pending the gradient is one FP8 GEMM over ``n * tokens`` tokens (no
    per-micro-batch ``dW``, no adds into ``.grad``, one rounding). Made by the first
    micro-batch's forward: ``n * tokens * (V + H)`` bytes plus the scales.

    A slot is reserved by a forward (``live``: slot -> ticket) until its backward defers
    it (``parts``) or computes its own gradient, or until the forward's autograd graph
    dies without a backward (a recomputation under activation checkpointing, a forward
    whose loss was dropped, a forward that raised): then it is free again."""

    __slots__ = ("tokens", "pow2", "qt", "st", "hq", "hs", "free", "live", "tickets")

    def __init__(self, weight: torch.Tensor, micro_batches: int, tokens: int, pow2: bool):
        super().__init__(weight)
        V, H = weight.shape
        cap = micro_batches * tokens
        self.tokens, self.pow2 = tokens, pow2
        self.qt, self.st = empty_1x128(cap, V, weight.device, rowwise=False, columnwise=True,
                                       group_major=True)[2:]
        self.hq, self.hs = empty_1x128(cap, H, weight.device, rowwise=False, columnwise=True,
                                       group_major=True)[2:]
        self.free = list(range(micro_batches - 1, -1, -1))  # (popped from the end: 0 first)
        self.live: dict[int, int] = {}
        self.tickets = 0

    @property
    def slots(self) -> int:
        return self.qt.shape[1] // self.tokens

    def reserve(self, tokens: int) -> tuple[int, int] | None:
        """``(slot, ticket)`` for a micro-batch of ``tokens`` rows, or ``None`` (no free
        slot, or another size)."""
        if tokens != self.tokens or not self.free:
            return None
        slot = self.free.pop()
        self.tickets += 1
        self.live[slot] = self.tickets
        return slot, self.tickets

    def resolve(self, slot: int, ticket: int, deferred_now: bool) -> None:
        """The slot's backward ran: its product is pending (``deferred_now``) or was
        handed over, and the slot is free again."""
        if self.live.get(slot) == ticket:
            del self.live[slot]
            (self.parts if deferred_now else self.free).append(slot)

    def release(self, slot: int, ticket: int) -> None:
        """The slot's forward graph died without a backward: free it."""
        if self.live.get(slot) == ticket:
            del self.live[slot]
            self.free.append(slot)

    def first_token(self, slot: int) -> int:
        return slot * self.tokens

    def put_hidden(self, slot: int, hidden: torch.Tensor) -> None:
        """``hidden [tokens, H]`` quantized 1x128 along the tokens into the slot."""
        hq, hs = quantize_1x128_launch(hidden, False, True, self.pow2, True)[2:]
        a, g = slot * self.tokens, slot * (self.tokens // 128)
        self.hq[:, a:a + self.tokens].copy_(hq)
        self.hs[:, g:g + self.tokens // 128].copy_(hs)

    def scale(self, slot: int, g: torch.Tensor) -> None:
        """The slot's contribution times ``g`` (its ``grad_output``, a device scalar)."""
        a = slot * (self.tokens // 128)
        self.hs[:, a:a + self.tokens // 128].mul_(g)

    def gradient(self, slots: list[int], dtype: torch.dtype) -> torch.Tensor:
        """``sum over slots of dlogits^T · hidden`` (``[V, H]`` in ``dtype``): every slot
        as one GEMM; some of them (a flush before the last micro-batch, or a backward that
        cannot defer): a GEMM per slot on copies of its columns, summed in fp32."""
        if sorted(slots) == list(range(self.slots)):
            return fp8_gemm._gemm(self.qt, self.st, "1x128", self.hq, self.hs, "1x128",
                                  dtype, None)
        total = None
        for slot in slots:
            a, b = slot * self.tokens, (slot + 1) * self.tokens
            part = fp8_gemm._gemm(self.qt[:, a:b].contiguous(), self.st[:, a // 128:b // 128],
                                  "1x128", self.hq[:, a:b].contiguous(),
                                  self.hs[:, a // 128:b // 128], "1x128", torch.float32, None)
            total = part if total is None else total.add_(part)
        return total.to(dtype)

    def flush(self, w: torch.Tensor) -> None:
        dw = self.gradient(self.parts, w.dtype)
        if w.grad is None:
            w.grad = dw
        else:
            w.grad.add_(dw)


class _HeadSlot:
    """A forward's reservation in a :class:`HeadWgradStash` (kept on the autograd
    ``ctx``; when it dies without its backward having run, the slot is freed)."""

    __slots__ = ("weight", "stash", "slot", "ticket", "__weakref__")

    def __init__(self, weight, stash, slot, ticket):
        self.weight, self.stash, self.slot, self.ticket = weight, stash, slot, ticket
        weakref.finalize(self, stash.release, slot, ticket)


def _reserve_head_slot(weight: torch.Tensor, micro_batches: int, tokens: int,
                       pow2: bool) -> _HeadSlot | None:
    """In the forward: the reservation of a micro-batch of ``tokens`` rows whose FP8
    weight gradient is deferred, or ``None`` (it computes its own): not deferrable (see
    :func:`~linghe.bwd.deferred.deferrable`), ``tokens`` not a positive multiple of 128,
    or the weight's stash in use with no free slot (more forwards than ``micro_batches``
    before their backwards) or for micro-batches of another size."""
    if (tokens <= 0 or tokens % 128 or deferred.deferrable(weight, micro_batches) is None
            or capture_pauses_bookkeeping(weight)):
        return None
    stash = deferred.stash_of(weight)
    if stash is not None and (stash.tokens != tokens or stash.pow2 != pow2
                              or stash.slots != micro_batches):
        if stash.parts or stash.live:
            return None
        stash = None
    if stash is None:
        stash = HeadWgradStash(weight, micro_batches, tokens, pow2)
        deferred.set_stash(weight, stash)
    got = stash.reserve(tokens)
    return None if got is None else _HeadSlot(weight, stash, *got)


def _head_wgrad(head: _HeadSlot, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """In the backward: the weight gradient to hand over for a deferred micro-batch
    (``head`` from :func:`_reserve_head_slot`, ``g`` its ``grad_output``): ``None`` while
    micro-batches are still to come, else all pending ones' (this backward fills the
    stash) or, when this backward cannot defer, its own (its slot freed; a stash with
    nothing pending or reserved is dropped)."""
    weight, stash, slot, ticket = head.weight, head.stash, head.slot, head.ticket
    if torch.is_grad_enabled():  # create_graph: differentiable in grad_output
        dw = (stash.gradient([slot], dtype) * g).to(dtype)
        stash.resolve(slot, ticket, False)
        return dw
    stash.scale(slot, g)
    if deferred.can_defer(weight) and deferred.stash_of(weight) is stash:
        stash.resolve(slot, ticket, True)
        if len(stash.parts) < stash.slots:
            return None
        deferred.set_stash(weight, None)
        return stash.gradient(stash.parts, dtype)
    dw = stash.gradient([slot], dtype)
    stash.resolve(slot, ticket, False)
    if not stash.parts and not stash.live and deferred.stash_of(weight) is stash:
        deferred.set_stash(weight, None)
    return dw


def row_weight_in_forward(dtype: torch.dtype) -> bool:
    """Whether the fused linear cross entropy applies the reduction's row weight
    (``1/n_valid``) to the logits' gradient in the forward (then the backward only applies
    ``grad_output``): not for float16, whose range would flush ``p / n_valid`` to zero at
    thousands of tokens before the GEMMs (bf16 and float32 have float32's exponent range)."""
    return dtype != torch.float16


def lce_forward(hidden, weight, bias, labels, ignore_index, reduction, label_smoothing, z_loss,
                chunk_size, need_grads, vocab, group, fp8=None, head=None):
    """The chunked forward of :func:`linear_cross_entropy` (also run by its custom op,
    ``linghe.library``). ``vocab``: ``dict(vocab_start=, vocab_total=)`` of this rank.
    ``fp8``: ``None`` (GEMMs in the input dtype) or ``(wq, pow2_scale)``, the weight's
    128x128 :class:`~linghe.Fp8Tensor` with both copies: the logits and hidden-gradient
    GEMMs run blockwise FP8 (the weight gradient stays in the input dtype).

    Returns ``(out, inv_n, dh, dw, db, lse)``: with a "mean"/"sum" reduction and a gradient
    needed ("fused"), the gradients ``dh``, ``dw``, ``db`` of the reduced loss (``None``
    where not needed; the row weight ``inv_n`` already applied where
    :func:`row_weight_in_forward`, so only ``grad_output`` is left for the backward,
    else weight 1 per row) and ``lse = None``; otherwise no gradients and the per-row
    ``lse [N]`` for the backward's recomputation. ``inv_n`` is ``None`` for
    ``reduction="none"``. ``head`` (a :class:`_HeadSlot`): the FP8 weight gradient is
    deferred into its :class:`HeadWgradStash` slot (``dw`` is ``None``)."""
    N, H = hidden.shape
    V = weight.shape[0]
    opts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss)
    _check_labels_in_range(labels, ignore_index, vocab["vocab_total"])
    loss_rows = empty(N, dtype=torch.float32, device=hidden.device)
    need_h, need_w, need_b = need_grads
    fused = reduction != "none" and any(need_grads)
    # the FP8 weight gradient (fp8_wgrad_on): its own chunk loop, below
    fp8_w = fused and need_w and fp8_wgrad_on(fp8, group, bias)
    dh = dw = db = row_w = None
    if fused:
        # The gradients are computed now, each row's weighted by the reduction's row
        # weight (known from the labels), so the backward only applies grad_output.
        if row_weight_in_forward(hidden.dtype):
            row_w = ce_row_weight(labels, ignore_index=ignore_index,
                                  vocab_total=vocab["vocab_total"], mean=reduction == "mean")
        if need_h and not fp8_w:
            dh = empty(N, H, dtype=hidden.dtype, device=hidden.device)
        if need_w and not fp8_w:  # the first chunk writes it (no zero fill) unless none
            dw = (empty if N else torch.zeros)(V, H, dtype=weight.dtype, device=weight.device)
        if need_b:
            db = torch.zeros(V, dtype=torch.float32, device=weight.device)
    one = torch.ones(1, dtype=torch.float32, device=hidden.device)
    lses = []
    if fp8_w:
        # its operand is grouped along the tokens: chunks of whole 128-token groups
        dh, dw = _lce_grads_fp8_wgrad(hidden, weight, labels, None,
                                      row_w if row_w is not None else one, opts,
                                      cdiv(chunk_size, 128) * 128, need_h, fp8, loss_rows,
                                      head)
    else:
        for s in range(0, N, chunk_size):
            e = min(N, s + chunk_size)
            h = hidden[s:e]
            logits = _chunk_logits(h, weight, bias, fp8)
            dq = dgrad_ops = None
            if group is None:
                if fused and dh is not None and fp8 is not None:  # the loss kernel quantizes
                    dq, dgrad_ops = _dgrad_fp8_operands(fp8, e - s, logits.shape[1],
                                                        hidden.dtype, logits.device)
                _, lse, _, _ = ce_forward(logits, labels[s:e], loss_out=loss_rows[s:e],
                                          fuse_bwd=fused, row_weight=row_w, **opts,
                                          grad_fp8=None if dq is None else (*dq, fp8[1]))
            else:
                loss_c, lse = _dist_stats(logits, labels[s:e], group, **opts, **vocab)
                loss_rows[s:e] = loss_c
                if fused:
                    ce_backward(logits, labels[s:e], lse, one[0], row_w, **opts, **vocab,
                                inplace=True)
            lses.append(lse)
            if fused:  # logits now hold d loss / d logits (this rank's columns)
                if dh is not None:
                    _chunk_dh(logits, weight, fp8, dh[s:e], dgrad_ops)
                if dw is not None:
                    if s == 0:
                        torch.mm(logits.t(), h, out=dw)
                    else:
                        dw.addmm_(logits.t(), h)
                if db is not None:
                    db += logits.sum(0, dtype=torch.float32)
            del logits
    if group is not None and dh is not None:
        import torch.distributed as dist

        dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=group)  # sum over vocab slices
    if reduction == "none":
        out, inv_n = loss_rows, None
    else:
        out, inv_n = ce_reduce(loss_rows, labels, ignore_index=ignore_index,
                               vocab_total=vocab["vocab_total"], mean=reduction == "mean")
    lse = None
    if not fused:
        lse = torch.cat(lses) if lses else empty(0, dtype=torch.float32, device=hidden.device)
    return out, inv_n, dh, dw, db, lse


def lce_backward_none(grad, hidden, weight, bias, labels, lse, ignore_index, label_smoothing,
                      z_loss, chunk_size, need, vocab, group, fp8=None):
    """Backward of :func:`linear_cross_entropy` with a per-row ``grad [N]``
    (``reduction="none"``, or no gradient was known to be needed in the forward): the
    logits are recomputed chunk by chunk (with the forward's ``fp8``, so they are the same
    logits). Returns ``(dhidden, dweight, dbias)`` (``None`` where ``need`` says no)."""
    nh, nw, nb = need
    opts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss)
    if nw and fp8_wgrad_on(fp8, group, bias):  # (no bias, so no dbias)
        return (*_lce_grads_fp8_wgrad(hidden, weight, labels, lse, grad, opts,
                                      cdiv(chunk_size, 128) * 128, nh, fp8), None)
    N, H = hidden.shape
    cs = chunk_size
    gh = empty(N, H, dtype=hidden.dtype, device=hidden.device) if nh else None
    gw = torch.zeros_like(weight) if nw else None
    gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
        if nb else None
    for s in range(0, N, cs):
        e = min(N, s + cs)
        h = hidden[s:e]
        logits = _chunk_logits(h, weight, bias, fp8)
        d = ce_backward(logits, labels[s:e], lse[s:e], grad[s:e], None, **opts, **vocab,
                        inplace=True)
        if gh is not None:
            _chunk_dh(d, weight, fp8, gh[s:e])
        if gw is not None:
            gw.addmm_(d.t(), h)
        if gb is not None:
            gb += d.sum(0, dtype=torch.float32)
        del logits, d
    if group is not None and gh is not None:
        import torch.distributed as dist

        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group)
    if gb is not None:
        gb = gb.to(bias.dtype)
    return gh, gw, gb


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, label_smoothing,
                z_loss, chunk_size, need_grads, process_group, fp8, micro_batches):
        group = process_group
        V = weight.shape[0]
        if group is None:
            vocab_start, vocab_total = 0, V
        else:
            vocab_start, vocab_total = _vocab_slice(group, V, hidden.device)
        vocab = dict(vocab_start=vocab_start, vocab_total=vocab_total)
        head = None
        if (micro_batches > 1 and reduction != "none" and need_grads[1]
                and fp8_wgrad_on(fp8, group, bias)):
            head = _reserve_head_slot(weight, micro_batches, hidden.shape[0], fp8[1])
        out, inv_n, dh, dw, db, lse = lce_forward(
            hidden, weight, bias, labels, ignore_index, reduction, label_smoothing, z_loss,
            chunk_size, need_grads, vocab, group, fp8, head)
        ctx.head = head
        ctx.fused = lse is None
        ctx.grads_taken = False
        ctx.row_weight_applied = row_weight_in_forward(hidden.dtype)
        ctx.opts = (ignore_index, label_smoothing, z_loss)
        ctx.vocab = vocab
        ctx.group = group
        ctx.chunk_size = chunk_size
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if ctx.fused:
            ctx.save_for_backward(dh, dw, db, inv_n)
        else:
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
            ctx.fp8 = fp8
        return out

    @staticmethod
    def backward(ctx, grad):
        nh, nw, nb = ctx.needs_input_grad[:3]
        none = (None,) * 10
        if ctx.fused:
            # The forward's gradients (row weight applied) times grad_output, in place:
            # handed to autograd once, so a second backward through this node (retain_graph)
            # would see them scaled and accumulated into: refused.
            if ctx.grads_taken:
                raise RuntimeError(
                    "linear_cross_entropy computes its gradients in the forward and hands "
                    "them over once: a second backward through the same call is not "
                    "supported (call it again, or use reduction='none' and reduce outside)")
            ctx.grads_taken = True
            dh, dw, db, inv_n = ctx.saved_tensors
            g = grad if ctx.row_weight_applied else grad.float() * inv_n[0]
            head, ctx.head = ctx.head, None
            if head is not None:  # the FP8 weight gradient, deferred (dw is None)
                gw = _head_wgrad(head, g, head.weight.dtype) if nw else None
                gh = None
                if nh and dh is not None:
                    gh = ((dh * g).to(dh.dtype) if torch.is_grad_enabled()
                          else scale_by_grad_(dh, g))
                return (gh, gw, None, *none)
            if torch.is_grad_enabled():  # create_graph: differentiable in grad_output
                gh = (dh * g).to(dh.dtype) if (nh and dh is not None) else None
                gw = (dw * g).to(dw.dtype) if (nw and dw is not None) else None
            else:
                gh = scale_by_grad_(dh, g) if (nh and dh is not None) else None
                gw = scale_by_grad_(dw, g) if (nw and dw is not None) else None
            gb = (db * g.float()).to(ctx.bias_dtype) if (nb and db is not None) else None
            return (gh, gw, gb, *none)
        # reduction "none" (per-row grad_output): recompute the logits chunk by chunk
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        gh, gw, gb = lce_backward_none(grad, hidden, weight, bias, labels, lse, *ctx.opts,
                                       ctx.chunk_size, (nh, nw, nb), ctx.vocab, ctx.group,
                                       ctx.fp8)
        ctx.fp8 = None
        return (gh, gw, gb, *none)


#: LM head weight -> its FP8 copy between optimizer steps (``lm_head_fp8``).
_WEIGHT_CACHES = WeakIdKeyDictionary()


def _lm_head_fp8(weight: torch.Tensor, recipe) -> tuple:
    """``(wq, pow2_scale, fp8_wgrad)``: the LM head weight's 128x128 FP8 copies (both),
    cached per weight until it changes (:class:`~linghe.fp8.cache.WeightCache`; bound to
    the weight, so :class:`linghe.optim.AdamW` writes them in its update pass), and the
    recipe's choices."""
    cache = _WEIGHT_CACHES.get(weight)
    if cache is None:
        cache = _WEIGHT_CACHES[weight] = WeightCache()
    return (cache.get_for_recipe(weight, recipe, (weight, "w")), recipe.pow2_scale,
            recipe.fp8_wgrad)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, chunk_size: int | None = None,
                         process_group=None, wgrad_micro_batches: int = 1) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, labels)`` without the full logits.

    Args:
        hidden: ``[N, H]`` float32/float16/bfloat16 (the last hidden states, flattened).
        weight: ``[V, H]`` (the output embedding / LM head), same dtype and device.
        labels: ``[N]`` int64/int32; same rules as :func:`cross_entropy`.
        bias: optional ``[V]``, same dtype.
        chunk_size: rows per chunk (default: about 512 MiB of logits per chunk, see
            :func:`default_chunk_size`).
        ignore_index, reduction, label_smoothing, z_loss: as in :func:`cross_entropy`.
        wgrad_micro_batches: ``n > 1`` defers the FP8 weight gradient (below) over ``n``
            micro-batches, as :class:`linghe.nn.MoE`'s setting does for the experts.

    Per chunk of rows: ``logits = h @ W.T (+ b)`` by cuBLAS in the input dtype, then one
    kernel computes the chunk's losses and overwrites the logits with their gradient
    (fused forward+backward), then ``dh_chunk = dlogits @ W``, ``dW += dlogits.T @ h``,
    ``db += dlogits.sum(0)``. So the forward (when any input requires grad and the
    reduction is "mean"/"sum") stores ``dh [N, H]``, ``dW [V, H]`` (input dtype; with
    bf16/fp16 inputs the chunk sums are rounded to that dtype once per chunk) and ``db``
    (fp32), already weighted by ``1/n_valid`` for "mean" (float16: in the backward), and
    the backward only scales them by ``grad_output``, in place and not at all when it is 1
    (decided on the device): they are handed over once, so a second backward through the
    same call raises. With ``reduction="none"`` the per-row ``grad_output`` is only known in
    backward, so the forward saves ``hidden``, ``weight``, ``bias``, ``labels`` and the
    per-row ``lse`` and the backward recomputes the logits chunk by chunk. Peak extra
    memory: one ``[chunk, V]`` logits chunk (plus the stored gradients).

    ``process_group`` (vocab-parallel LM head): each rank holds a contiguous slice
    ``weight [V_local, H]`` (and ``bias [V_local]``) ordered by rank, as in
    :func:`cross_entropy`; ``hidden`` and ``labels`` (global ids) are the same on every
    rank. Per chunk the row statistics are all-reduced (MAX, then SUM), the loss equals the
    unsharded one on every rank, the weight/bias gradients are this rank's slices, and the
    hidden gradient is all-reduced (SUM over the slices, in the hidden dtype) so every rank
    gets the full ``dhidden``.

    FP8 (opt-in): under ``linghe.TrainingContext(fp8="blockwise", lm_head_fp8=True)`` the
    logits GEMM and the hidden-gradient GEMM run blockwise FP8: each chunk of ``hidden``
    quantized 1x128, the weight 128x128 (both copies, cached per weight until it changes:
    once per optimizer step, or written by :class:`linghe.optim.AdamW`), and the logits'
    gradient 1x128 by the loss kernel that writes it. With the recipe's ``fp8_wgrad``
    (the default) the weight-gradient GEMM runs FP8 too: per chunk the loss statistics
    come first, then one pass (:func:`linghe.fwd.loss.ce_grad_fp8`) writes the logits'
    gradient only as FP8, both 1x128 copies (the columnwise one, grouped along the
    tokens, into one buffer for the chunks of up to ``FP8_WGRAD_BUFFER_BYTES``), and
    ``dW`` is one GEMM over those tokens and ``hidden`` quantized 1x128 along them
    (chunks are then rounded up to whole 128-row groups). Not for a vocab-parallel head
    or with a bias: those keep the 16-bit weight gradient. The loss arithmetic stays in
    fp32. Without ``lm_head_fp8`` the recipe does not change this op.

    Deferred FP8 weight gradient (``wgrad_micro_batches = n > 1``, FP8 weight gradient,
    a "mean"/"sum" reduction, ``N`` a multiple of 128): the first micro-batch's forward
    allocates room for ``n`` micro-batches' columnwise copies (:class:`HeadWgradStash`:
    ``n * N * (V + H)`` bytes, 5.2 GB for 4 x 8192 tokens of a 157184 x 2048 head) and
    each forward writes its own there instead of computing ``dW``; the backwards return
    no weight gradient until the ``n``-th, which hands over all ``n`` micro-batches' as
    one FP8 GEMM over ``n * N`` tokens (each micro-batch's ``grad_output`` folded into
    its scales): no per-micro-batch ``dW``, no adds into ``.grad``, one rounding instead
    of one per micro-batch. The rules are the experts' (:mod:`linghe.bwd.deferred`):
    pending micro-batches are computed by :func:`linghe.flush_deferred_wgrad` (run by
    itself before every ``torch.optim`` optimizer's ``step()`` and in
    :func:`linghe.optim.clip_grad_norm_`); a backward that cannot hand a gradient over
    later (``torch.autograd.grad``, ``create_graph``, compiled autograd, CUDA graph
    capture) computes its own micro-batch's; a micro-batch of another size than the
    first's, or more than ``n`` forwards before the backwards, computes its own. A
    forward whose graph dies without a backward (a recomputation under activation
    checkpointing, a dropped loss) frees its slot. Elsewhere (no FP8 weight gradient,
    ``reduction="none"``) the setting changes nothing.

    Returns the loss: fp32 scalar or ``[N]`` fp32 (``"none"``).
    """
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=(hidden.dtype,), ndim=2)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must have shape (V, {hidden.shape[1]}) to match hidden "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V >= 1), got V = 0")
    check_tensor("labels", labels, dtypes=_LABEL_DTYPES, shape=(hidden.shape[0],))
    if bias is not None:
        check_tensor("bias", bias, dtypes=(hidden.dtype,), shape=(weight.shape[0],))
    check_same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    check_kernel_device("hidden", hidden)
    _check_options(ignore_index, reduction, label_smoothing, z_loss)
    if (isinstance(wgrad_micro_batches, bool) or not isinstance(wgrad_micro_batches, int)
            or wgrad_micro_batches < 1):
        raise ValueError(f"wgrad_micro_batches must be an int >= 1, got "
                         f"{wgrad_micro_batches!r}")
    N, V = hidden.shape[0], weight.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(N, V, hidden.element_size())
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad)
    recipe = current_recipe()
    fp8 = recipe is not None and recipe.fp8_lm_head
    if torch.compiler.is_compiling() and process_group is None:
        return library.linear_cross_entropy(
            hidden.contiguous(), weight.contiguous(), bias, labels.contiguous(),
            int(ignore_index), reduction, float(label_smoothing), float(z_loss),
            int(chunk_size), need, fp8, fp8 and recipe.pow2_scale, fp8 and recipe.fp8_wgrad)
    return apply_function(_LinearCrossEntropy, hidden.contiguous(), weight.contiguous(), bias,
                          labels.contiguous(), int(ignore_index), reduction,
                          float(label_smoothing), float(z_loss), int(chunk_size),
                          need, process_group, _lm_head_fp8(weight, recipe) if fp8 else None,
                          wgrad_micro_batches)
