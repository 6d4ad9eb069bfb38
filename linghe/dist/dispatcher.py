"""Expert-parallel token dispatcher: all-to-all with padded indices.

Data flow of :meth:`ExpertParallelDispatcher.dispatch` on ``W`` ranks, ``E`` experts
(``E / W`` local to each rank, rank ``r`` owning experts ``r*E/W .. (r+1)*E/W - 1``):

1. local ``permute`` by global expert (no padding): copies bound for rank ``r`` are one
   contiguous block, in expert order;
2. exchange per-(rank, expert) counts with ``all_to_all_single`` on a small int tensor;
3. exchange the payload rows (and their router probabilities) with ``all_to_all_single``;
4. regroup the received rows, which arrive rank-major, into expert-major segments padded
   to ``align`` rows by padding *indices* (a second ``permute`` over local experts).

:meth:`~ExpertParallelDispatcher.combine` runs the same path backwards and sums each
token's ``k`` expert outputs (weighted by ``probs`` when given, in fp32). Every step is
differentiable: the backward of an exchange is the adjoint exchange.

Host syncs: the default mode syncs once per ``dispatch`` to learn the split sizes (one
``.tolist()`` of a ``2*W``-element tensor). ``capacity_factor`` gives a static-shape
mode with no host sync: each rank sends at most ``C = min(T*k, ceil(capacity_factor * T * k
/ W))`` rows to each peer (every rank of the group must dispatch the same ``T``, as with a
fixed micro-batch, since the exchange has equal splits of ``C`` rows); copies beyond
``C`` are dropped (the later experts of that peer's block lose them first), counted in
``handle.num_dropped``, and contribute nothing to ``combine``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..fp8 import Fp8Tensor, quantize_1x128
from ..functional.permute import permute, unpermute
from ..layout import ExpertLayout
from ..reference import dequantize_1x128
from ..utils import check_same_device, check_tensor
from .collectives import _all_to_all, all_to_all, group_size_rank


@dataclass
class DispatchHandle:
    """What :meth:`ExpertParallelDispatcher.combine` (and grouped GEMMs) need.

    Attributes:
        layout: the local experts' :class:`~linghe.layout.ExpertLayout` over ``rows``
            (real/padded counts per local expert and segment offsets, on device).
        send_layout: the source-side permute by global expert (``None`` on one rank).
        input_splits / output_splits: rows sent to / received from each rank (default
            mode; ``None`` in capacity mode, where every split is ``capacity``).
        capacity: rows per (source, destination) pair in capacity mode, else ``None``.
        num_dropped: int64 device scalar, routed copies dropped by the capacity limit.
        num_tokens: ``T`` of the dispatched ``x``.
        slot_of_send_row: capacity mode only: ``[T*k]`` int64, the exchange slot each
            source-side row comes back in (``W*C`` = dropped: reads a zero row).
    """

    layout: ExpertLayout
    send_layout: ExpertLayout | None
    input_splits: list[int] | None
    output_splits: list[int] | None
    capacity: int | None
    num_dropped: torch.Tensor
    num_tokens: int
    slot_of_send_row: torch.Tensor | None = None


class _Fp8AllToAll(torch.autograd.Function):
    """Send rows as 1x128 FP8 (e4m3 data + fp32 scales, about half the bytes of bf16) and
    dequantize them on arrival: the receiver gets a plain tensor in ``x``'s dtype holding
    the 1x128-quantized values. Backward exchanges the plain gradient (straight-through)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        q = quantize_1x128(x.contiguous(), rowwise=True)
        data = _all_to_all(q.rowwise_data.view(torch.uint8), out_splits, in_splits, group)
        scale = _all_to_all(q.rowwise_scale, out_splits, in_splits, group)
        return _dequant_rows(data.view(q.rowwise_data.dtype), scale, x.dtype)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all(g, in_splits, out_splits, ctx.group), None, None, None


class ExpertParallelDispatcher:
    """Moves routed tokens to the ranks that own their experts, and back.

    Args:
        num_experts: total experts ``E`` (divisible by the group size).
        group: the expert-parallel process group; ``None`` = one rank (plain local
            permute/unpermute, no collectives).
        align: each local expert's segment is padded to a multiple of ``align`` rows.
        capacity_factor: static-shape mode without host syncs (see module docstring).
        fp8_payload: send 1x128-quantized rows plus scales (about half the bytes); the
            receiver dequantizes them, so ``rows`` is a plain tensor in ``x``'s dtype that
            holds ``x`` rounded through 1x128 FP8 (also on one rank, so results do not
            depend on the world size). The gradient flows back unquantized
            (straight-through) in ``x``'s dtype.
    """

    def __init__(self, num_experts: int, *, group=None, align: int = 16,
                 capacity_factor: float | None = None, fp8_payload: bool = False):
        self.world_size, self.rank = group_size_rank(group)
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % self.world_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-"
                             f"parallel group size ({self.world_size})")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        self.group = group
        self.align = align
        self.capacity_factor = capacity_factor
        self.fp8_payload = fp8_payload

    def __repr__(self):
        return (f"ExpertParallelDispatcher(num_experts={self.num_experts}, world_size="
                f"{self.world_size}, align={self.align}, capacity_factor="
                f"{self.capacity_factor}, fp8_payload={self.fp8_payload})")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor):
        """Send each token's ``k`` routed copies to the ranks owning their experts.

        Args:
            x: ``[T, H]`` bf16/fp16/fp32 tokens; on one rank (without ``fp8_payload``)
                also an :class:`~linghe.Fp8Tensor` with its 1x128 rowwise copy, whose FP8
                rows ``permute`` moves with their scales (``rows`` is then an
                ``Fp8Tensor`` too).
            expert_ids: ``[T, k]`` int global expert ids.
            probs: ``[T, k]`` router probabilities (fp32 or x's dtype).

        Returns:
            ``(rows, probs_rows, handle)``: ``rows [R, H]`` grouped by local expert with
            segments padded to ``align`` (padding rows are zeros), ``probs_rows [R]`` fp32
            (0 on padding), and a :class:`DispatchHandle`.
        """
        check_tensor("x", x, dtypes=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
        check_tensor("expert_ids", expert_ids, dtypes=(torch.int32, torch.int64), ndim=2,
                     shape=(x.shape[0], None))
        check_tensor("probs", probs, dtypes=(torch.float32, torch.float16, torch.bfloat16),
                     ndim=2, shape=tuple(expert_ids.shape))
        check_same_device(x=x, expert_ids=expert_ids, probs=probs)
        if isinstance(x, Fp8Tensor) and (self.world_size > 1 or self.fp8_payload):
            raise ValueError("x as an Fp8Tensor (FP8 tokens moved by permute) is supported "
                             "on one rank without fp8_payload; with expert parallelism pass "
                             "the high-precision tokens (fp8_payload=True sends them as FP8)")
        probs = probs.float()
        if self.world_size == 1:
            return self._dispatch_local(x, expert_ids, probs)
        if self.capacity_factor is not None:
            return self._dispatch_capacity(x, expert_ids, probs)
        return self._dispatch_exchange(x, expert_ids, probs)

    def _dispatch_local(self, x, expert_ids, probs):
        rows, probs_rows, layout = permute(x, expert_ids, probs, num_experts=self.num_experts,
                                           align=self.align)
        if self.fp8_payload:
            rows = quantize_1x128_ste(rows)
        dropped = _num_dropped(expert_ids, layout)
        return rows, probs_rows, DispatchHandle(layout, None, None, None, None, dropped,
                                                x.shape[0])

    def _send_side(self, x, expert_ids, probs):
        T, k = expert_ids.shape
        send_rows, send_probs, send_layout = permute(
            x, expert_ids, probs, num_experts=self.num_experts, align=1, num_rows=T * k)
        return send_rows, send_probs, send_layout

    def _exchange(self, rows, out_splits, in_splits):
        if self.fp8_payload:
            return _Fp8AllToAll.apply(rows, out_splits, in_splits, self.group)
        return all_to_all(rows, out_splits, in_splits, self.group)

    def _regroup(self, recv_rows, recv_probs, local_ids, num_rows=None):
        return permute(recv_rows, local_ids[:, None], recv_probs[:, None],
                       num_experts=self.num_local_experts, align=self.align, num_rows=num_rows)

    def _dispatch_exchange(self, x, expert_ids, probs):
        W, El = self.world_size, self.num_local_experts
        send_rows, send_probs, send_layout = self._send_side(x, expert_ids, probs)
        counts = send_layout.tokens_per_expert.to(torch.int64)
        recv_counts = _all_to_all(counts, None, None, self.group).view(W, El)
        # The one host sync of the default mode: split sizes for the payload exchange.
        sizes = torch.cat([counts.view(W, El).sum(1), recv_counts.sum(1)]).tolist()
        in_splits, out_splits = sizes[:W], sizes[W:]
        n_send, n_recv = sum(in_splits), sum(out_splits)
        recv_rows = self._exchange(send_rows[:n_send], out_splits, in_splits)
        recv_probs = all_to_all(send_probs[:n_send], out_splits, in_splits, self.group)
        local_ids = torch.repeat_interleave(
            torch.arange(El, device=x.device).repeat(W), recv_counts.flatten(),
            output_size=n_recv)
        rows, probs_rows, layout = self._regroup(recv_rows, recv_probs, local_ids)
        dropped = _num_dropped(expert_ids, send_layout)
        handle = DispatchHandle(layout, send_layout, in_splits, out_splits, None, dropped,
                                x.shape[0])
        return rows, probs_rows, handle

    def _dispatch_capacity(self, x, expert_ids, probs):
        W, El = self.world_size, self.num_local_experts
        T, k = expert_ids.shape
        # Never more slots than copies (T*k): the same C on every rank needs the same T.
        C = max(1, min(T * k, math.ceil(self.capacity_factor * T * k / W)))
        send_rows, send_probs, send_layout = self._send_side(x, expert_ids, probs)
        dev = x.device
        offs = send_layout.offsets.to(torch.int64)
        counts = send_layout.tokens_per_expert.to(torch.int64)
        rank_start = offs[torch.arange(W, device=dev) * El]                      # [W]
        rank_count = offs[(torch.arange(W, device=dev) + 1) * El] - rank_start   # [W]
        # Copies of expert e that fit in its rank's C slots (experts in order).
        before = offs[:-1] - rank_start.repeat_interleave(El)
        sent = (C - before).clamp(min=0).minimum(counts)                         # [E]
        num_dropped = (counts.sum() - sent.sum()) + _num_dropped(expert_ids, send_layout)
        # Slot (r, j) holds send row rank_start[r] + j when j < min(count_r, C); send rows
        # are padded with one zero row that empty slots point to.
        j = torch.arange(C, device=dev)
        valid = j[None, :] < rank_count.clamp(max=C)[:, None]
        slot_src = torch.where(valid, rank_start[:, None] + j[None, :], T * k).flatten()
        padded_rows = torch.cat([send_rows, send_rows.new_zeros(1, send_rows.shape[1])])
        padded_probs = torch.cat([send_probs[: T * k], send_probs.new_zeros(1)])
        send_buf = padded_rows.index_select(0, slot_src)
        send_buf_probs = padded_probs.index_select(0, slot_src)
        recv_counts = _all_to_all(sent, None, None, self.group).view(W, El)
        recv_rows = self._exchange(send_buf, None, None)
        recv_probs = all_to_all(send_buf_probs, None, None, self.group)
        # Local expert of each received slot; slots past a source's total are dropped (-1).
        ends = recv_counts.cumsum(1)                                              # [W, El]
        local = torch.searchsorted(ends, j.expand(W, C).contiguous(), right=True)
        local_ids = torch.where(local < El, local, -1).flatten()
        num_rows = W * C + El * (self.align - 1)
        rows, probs_rows, layout = self._regroup(recv_rows, recv_probs, local_ids, num_rows)
        # Where each send row's result comes back: its slot, or the zero row past the end.
        i = torch.arange(T * k, device=dev)
        r_of = torch.searchsorted(offs[El::El].contiguous(), i, right=True).clamp(max=W - 1)
        pos = i - rank_start[r_of]
        back_slot = torch.where((pos < C) & (i < offs[-1]), r_of * C + pos, W * C)
        handle = DispatchHandle(layout, send_layout, None, None, C, num_dropped, T,
                                slot_of_send_row=back_slot)
        return rows, probs_rows, handle

    # ------------------------------------------------------------------ combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle,
                probs: torch.Tensor | None = None) -> torch.Tensor:
        """Return expert outputs to their tokens: ``out[t] = sum_j probs[t, j] * y[row of
        (t, j)]`` (plain sum when ``probs`` is None), accumulated in fp32.

        Args:
            y: ``[R, H]`` expert outputs in the ``rows`` order of :meth:`dispatch`.
            handle: the :class:`DispatchHandle` from that dispatch.
            probs: optional ``[T, k]`` weights (the same tensor given to dispatch, or any).

        Returns ``[T, H]`` in ``y``'s dtype.
        """
        check_tensor("y", y, dtypes=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
        if y.shape[0] != handle.layout.num_rows:
            raise ValueError(f"y must have {handle.layout.num_rows} rows (the dispatched "
                             f"rows), got {y.shape[0]}")
        if handle.send_layout is None:
            return unpermute(y, handle.layout, probs)
        back = unpermute(y, handle.layout)              # [received rows, H], arrival order
        if handle.capacity is None:
            returned = all_to_all(back, handle.input_splits, handle.output_splits, self.group)
            missing = handle.send_layout.num_rows - returned.shape[0]
            if missing:
                returned = torch.cat([returned, returned.new_zeros(missing, y.shape[1])])
        else:
            returned = all_to_all(back, None, None, self.group)
            returned = torch.cat([returned, returned.new_zeros(1, y.shape[1])])
            returned = returned.index_select(0, handle.slot_of_send_row)
        return unpermute(returned, handle.send_layout, probs)


def quantize_1x128_ste(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded through rowwise 1x128 FP8 (quantize + dequantize, in ``x``'s dtype);
    the gradient passes straight through. What ``fp8_payload`` does to rows on one rank."""
    return _QuantizeSTE.apply(x)


class _QuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        q = quantize_1x128(x.contiguous(), rowwise=True)
        return _dequant_rows(q.rowwise_data, q.rowwise_scale, x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


def _dequant_rows(data: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """1x128 rowwise dequantization to ``dtype`` (a broadcast multiply when ``H % 128 ==
    0``: no repeated-scale temporary)."""
    n, H = data.shape
    if H % 128 == 0:
        return (data.view(n, H // 128, 128).float() * scale.float()[:, :, None]).view(n, H) \
            .to(dtype)
    return dequantize_1x128(data, scale).to(dtype)


def _num_dropped(expert_ids: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Copies that ``permute`` did not place (ids outside ``[0, E)``), as an int64 scalar."""
    return (expert_ids.numel() - layout.tokens_per_expert.sum()).to(torch.int64)
