"""Expert-parallel token dispatcher: one packed exchange per direction.

Data flow of :meth:`ExpertParallelDispatcher.dispatch` on ``W`` ranks, ``E`` experts
(``El = E / W`` local to each rank, rank ``r`` owning experts ``r*El .. (r+1)*El - 1``):

1. the routing's index map (``build_index`` over global experts, two small kernels):
   each routed copy's position in destination-major, expert-major, token order;
2. default mode only: per-destination row counts are exchanged (``W`` int64 per rank) and
   read on the host (the one host sync: ``all_to_all_single`` needs the split sizes);
3. one kernel (:func:`~linghe.dist.kernels.scatter_tokens`) reads each token once and
   writes its ``k`` copies straight into the send buffer, in destination/expert order, as
   records of ``row | routing weight | local expert id [| 1x128 scales]`` (FP8 payload:
   quantized in the same kernel). Copies for this rank go directly into the tail of the
   receive buffer: they never enter the collective;
4. one ``all_to_all_single`` of the records (asynchronous with ``async_op=True``);
5. on arrival, the local expert ids (in the records) give the local layout
   (``build_index`` again) and one kernel unpacks the records into rows grouped by local
   expert, padded by index to ``align`` rows (FP8: dequantized).

:meth:`~ExpertParallelDispatcher.combine` runs the mirror image: one kernel gathers the
expert outputs into arrival order (this rank's own rows straight into the return buffer),
one ``all_to_all_single`` of plain rows, and one kernel sums each token's ``k`` returned
rows (weighted by ``probs`` when given, in fp32). Backward passes are the same kernels and
one exchange each, in the other direction (the dispatch's backward carries ``dx`` rows and
the routing-weight gradients together).

Host syncs: the default mode reads the split sizes once per ``dispatch`` (the ``.tolist()``
of a ``2W``-element tensor). ``capacity_factor`` gives the static-shape mode with **no host
sync**: each rank sends at most ``C = max(1, min(T*k, ceil(capacity_factor * T * k / W)))``
rows to each rank (itself included; every rank must dispatch the same ``T``, as with a
fixed micro-batch); copies beyond ``C`` are dropped (the later experts of a destination's
block lose them first), counted in ``handle.num_dropped``, and contribute nothing to
``combine``. Everything is then device work of fixed shapes (CUDA-graph capturable).

Consistency and failures: the first dispatch (and any later one whose ``T`` (capacity
mode), ``k``, hidden size or dtype changed) all-gathers a small configuration fingerprint
and raises ``ValueError`` naming the field and the ranks when the ranks disagree
(``num_experts``, world size, ``top_k``, hidden size, dtype, ``fp8_payload``, mode and
capacity). Bounded waits: that check's wait, and every wait for an exchange of CPU
tensors (gloo), is bounded by ``timeout`` (default 300 s) and raises ``RuntimeError``
naming the exchange; a dead gloo peer ends the wait at once (connection reset). Exchanges
of CUDA tensors are waited on by the compute stream, not the host (a timed host wait on
NCCL polls in 10 ms sleeps: too slow for every call), so there the process group's
timeout bounds them, the default mode's split-size read included
(``init_process_group(timeout=...)``: NCCL's watchdog aborts the communicator and the
process raises).
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from ..fp8 import Fp8Tensor, quantize_1x128
from ..functional.moe import quantize_tokens
from ..functional.permute import permute, unpermute
from ..fwd.permute import index_buffer, layout_from_index
from ..layout import ExpertLayout
from ..reference import dequantize_1x128
from ..utils import (
    apply_function,
    check_kernel_device,
    check_same_device,
    check_tensor,
    empty,
)
from .collectives import group_size_rank
from .kernels import (
    TRAILER_ID,
    RecordSpec,
    VBuf,
    fwd_spec,
    gather_tokens,
    pack_rows,
    scatter_tokens,
    unpack_rows,
)

#: Default bound (seconds) on the host's waits for the dispatcher's collectives (the
#: configuration check; exchanges of CPU tensors).
DEFAULT_TIMEOUT_S = 300.0

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


class _Plan:
    """One dispatch's exchange, shared by both directions and both passes.

    ``in_splits``/``out_splits`` (host ints; this rank's own entry 0) size the
    collectives; ``n_send``/``n_recv`` are the exchanged records and ``n_self`` the rows
    kept on this rank (the receive buffer's tail, and the return buffer's); ``slot [T, k]``
    int32 is each routed copy's record in the virtual send order (``-1``: dropped)."""

    __slots__ = ("group", "rank", "world", "timeout", "host_wait", "x_dtype", "fp8",
                 "fp8_rows", "pow2", "T", "k", "H", "num_experts", "capacity", "in_splits",
                 "out_splits", "n_send", "n_recv", "n_self", "ids", "pos", "offsets", "slot",
                 "spec", "gspec", "layout")


class _Transfer:
    """The work object of an exchange started inside an autograd forward."""

    __slots__ = ("work",)

    def __init__(self):
        self.work = None


class DispatchHandle:
    """What :meth:`ExpertParallelDispatcher.combine` (and grouped GEMMs) need.

    Attributes:
        layout: the local experts' :class:`~linghe.layout.ExpertLayout` over ``rows``
            (real/padded counts per local expert and segment offsets, on device).
        num_tokens: ``T`` of the dispatched ``x``.
        capacity: rows per (source, destination) pair in capacity mode, else ``None``.
        num_dropped: int64 device scalar, routed copies of this rank's tokens that were
            dropped (ids outside ``[0, E)``, or beyond the capacity); computed on access.
    """

    __slots__ = ("layout", "num_tokens", "capacity", "_plan", "_owner", "_ids")

    def __init__(self, layout: ExpertLayout, num_tokens: int, capacity: int | None, plan,
                 owner, ids):
        self.layout, self.num_tokens, self.capacity = layout, num_tokens, capacity
        self._plan, self._owner, self._ids = plan, owner, ids

    @property
    def num_dropped(self) -> torch.Tensor:
        p = self._plan
        if p is None:
            return (self._ids.numel() - self.layout.tokens_per_expert.sum()).to(torch.int64)
        if p.capacity is None:
            kept = p.offsets[p.num_experts]
        else:
            kept = p.offsets[::p.num_experts // p.world].diff().clamp(max=p.capacity).sum()
        return (p.T * p.k - kept).to(torch.int64)


class PendingExchange:
    """An exchange in flight (``async_op=True``): :meth:`wait` waits for it and returns
    what the synchronous call returns (``(rows, probs_rows, handle)`` for a dispatch,
    ``out`` for a combine). Work queued between the call and ``wait`` (a shared expert,
    the next micro-batch's attention) overlaps the transfer; the buffers being filled are
    internal, so nothing the caller holds changes meanwhile. ``wait`` may be called more
    than once (it returns the same result)."""

    __slots__ = ("_transfer", "_plan", "_what", "_finish", "_result")

    def __init__(self, transfer, plan, what, finish, result=None):
        self._transfer, self._plan, self._what = transfer, plan, what
        self._finish, self._result = finish, result

    def wait(self):
        if self._finish is not None:
            if self._transfer is not None and self._transfer.work is not None:
                _wait(self._transfer.work, self._plan, self._what)
            self._result = self._finish()
            self._finish = self._transfer = None
        return self._result

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return without waiting for the transfer."""
        t = self._transfer
        return self._finish is None or t is None or t.work is None or t.work.is_completed()


def _wait(work, plan: _Plan, what: str, host: bool | None = None) -> None:
    """Wait for ``work``: the host waits (bounded by the plan's timeout) for CPU tensors
    and where ``host``; otherwise the current CUDA stream waits on the collective's."""
    try:
        if plan.host_wait if host is None else host:
            work.wait(plan.timeout)
        else:
            work.wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"linghe.dist: the {what} exchange did not complete on rank {plan.rank} of the "
            f"expert-parallel group (host waits bounded by {plan.timeout.total_seconds():g} "
            f"s): a rank died or hung, or the ranks called different collectives. Cause: "
            f"{e}") from e


def _a2a(out, inp, out_splits, in_splits, group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group,
                                  async_op=True)


# ---------------------------------------------------------------------- autograd pieces
class _DispatchSend(torch.autograd.Function):
    """Pack the token rows into records (one kernel) and start the exchange. Returns the
    receive buffer (filled when the transfer completes; non-differentiable) and ``link``,
    a stride-0 float32 ``[n_recv + n_self, grad words]`` placeholder whose gradient is
    the buffer of gradient records that :class:`_DispatchRecv`'s backward packs."""

    @staticmethod
    def forward(ctx, x, probs, plan, transfer):
        p = plan
        send = p.spec.empty(p.n_send, x.device)
        recv = p.spec.empty(p.n_recv + p.n_self, x.device)
        scatter_tokens(x, VBuf(p.spec, send, recv, p.n_send, p.n_recv), slot=p.slot,
                       routing=(p.ids, p.pos, p.offsets, p.num_experts // p.world, p.rank),
                       probs=probs, quant=p.fp8, pow2_scale=p.pow2,
                       capacity=p.capacity or 0)
        transfer.work = _a2a(recv[:p.n_recv], send, p.out_splits, p.in_splits, p.group)
        ctx.plan = p
        ctx.mark_non_differentiable(recv)
        # no zero-filled gradient for the non-differentiable receive buffer
        ctx.set_materialize_grads(False)
        link = recv.new_empty(1, 1).expand(recv.shape[0], p.gspec.words)
        return recv, link

    @staticmethod
    def backward(ctx, _, g):
        p = ctx.plan
        if g is None:  # neither rows nor probs_rows reached the loss (on this rank)
            g = p.gspec.empty(p.n_recv + p.n_self, p.slot.device).zero_()
        gz = p.gspec.empty(p.n_send, g.device)
        _wait(_a2a(gz, g[:p.n_recv].contiguous(), p.in_splits, p.out_splits, p.group), p,
              "dispatch backward")
        dx, dp = gather_tokens(VBuf(p.gspec, gz, g, p.n_send, p.n_recv), p.slot, p.x_dtype,
                               probs_grad=True)
        return dx, dp, None, None


class _DispatchRecv(torch.autograd.Function):
    """Unpack arrived records into rows grouped by local expert (one kernel): high
    precision (FP8 payload: dequantized), or with ``fp8_rows`` an ``Fp8Tensor`` of the
    arrived e4m3 rows and scales (the gradient comes back as a plain tensor)."""

    @staticmethod
    def forward(ctx, recv, link, plan):
        ctx.plan = plan
        rows, scales, prow = unpack_rows(VBuf(plan.spec, recv), plan.layout, plan.x_dtype,
                                         probs=True, dequant=plan.fp8 and not plan.fp8_rows,
                                         fp8_out=plan.fp8_rows)
        if plan.fp8_rows:
            rows = Fp8Tensor(tuple(rows.shape), plan.x_dtype, rowwise_data=rows,
                             rowwise_scale=scales, scaling="1x128")
        return rows, prow

    @staticmethod
    def backward(ctx, d_rows, d_prow):
        p = ctx.plan
        if isinstance(d_rows, Fp8Tensor):
            d_rows = d_rows.dequantize()
        g = p.gspec.empty(p.n_recv + p.n_self, d_rows.device)
        pack_rows(d_rows.contiguous(), p.layout, VBuf(p.gspec, g),
                  probs_rows=d_prow.float().contiguous())
        return None, g, None


class _CombineSend(torch.autograd.Function):
    """Gather expert outputs into arrival order (own rows straight into the return
    buffer's tail) and start the return exchange; returns that buffer."""

    @staticmethod
    def forward(ctx, y, plan, transfer):
        p = plan
        spec = RecordSpec(p.H, y.dtype, 0)
        back = spec.empty(p.n_recv, y.device)
        ret = spec.empty(p.n_send + p.n_self, y.device)
        pack_rows(y, p.layout, VBuf(spec, back, ret, p.n_recv, p.n_send))
        transfer.work = _a2a(ret[:p.n_send], back, p.in_splits, p.out_splits, p.group)
        ctx.plan, ctx.spec = p, spec
        return ret

    @staticmethod
    def backward(ctx, d_ret):
        p, spec = ctx.plan, ctx.spec
        d_ret = d_ret.contiguous()
        g = spec.empty(p.n_recv, d_ret.device)
        _wait(_a2a(g, d_ret[:p.n_send], p.out_splits, p.in_splits, p.group), p,
              "combine backward")
        dy, _, _ = unpack_rows(VBuf(spec, g, d_ret, p.n_recv, p.n_send), p.layout,
                               spec.dtype)
        return dy, None, None


class _CombineRecv(torch.autograd.Function):
    """``out[t] = sum_j probs[t, j] * returned row of (t, j)`` (one kernel)."""

    @staticmethod
    def forward(ctx, ret, probs, plan):
        spec = RecordSpec(plan.H, ret.dtype, 0)
        out, _ = gather_tokens(VBuf(spec, ret), plan.slot, ret.dtype, weights=probs)
        ctx.plan, ctx.spec = plan, spec
        want_dp = probs is not None and probs.requires_grad
        ctx.save_for_backward(ret if want_dp else None, probs)
        return out

    @staticmethod
    def backward(ctx, dout):
        p, spec = ctx.plan, ctx.spec
        ret, probs = ctx.saved_tensors
        d_ret = spec.empty(p.n_send + p.n_self, dout.device)
        dp = scatter_tokens(dout.contiguous(), VBuf(spec, d_ret), slot=p.slot,
                            weights=probs, dot_rows=ret)
        return d_ret, dp, None


# ---------------------------------------------------------------------- the dispatcher
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
            depend on the world size), or keeps them FP8 (``dispatch(fp8_rows=True)``).
            The gradient flows back unquantized (straight-through) in ``x``'s dtype.
        timeout: bound in seconds on the host's waits for the dispatcher's collectives
            (the configuration check; every exchange of CPU tensors); default 300. CUDA
            exchanges are bounded by the process group's timeout (module docstring).
    """

    def __init__(self, num_experts: int, *, group=None, align: int = 16,
                 capacity_factor: float | None = None, fp8_payload: bool = False,
                 timeout: float = DEFAULT_TIMEOUT_S):
        self.world_size, self.rank = group_size_rank(group)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % self.world_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-"
                             f"parallel group size ({self.world_size})")
        if not isinstance(align, int) or align < 1:
            raise ValueError(f"align must be an int >= 1, got {align!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        self.group = group
        self.align = align
        self.capacity_factor = capacity_factor
        self.fp8_payload = bool(fp8_payload)
        self.timeout = datetime.timedelta(seconds=float(timeout))
        self._verified = None  # the call signature last checked across ranks

    def __repr__(self):
        return (f"ExpertParallelDispatcher(num_experts={self.num_experts}, world_size="
                f"{self.world_size}, align={self.align}, capacity_factor="
                f"{self.capacity_factor}, fp8_payload={self.fp8_payload})")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor, *,
                 async_op: bool = False, fp8_rows: bool = False, pow2_scale: bool = False):
        """Send each token's ``k`` routed copies to the ranks owning their experts.

        Args:
            x: ``[T, H]`` bf16/fp16/fp32 tokens (last dim contiguous); on one rank
                (without ``fp8_payload``) also an :class:`~linghe.Fp8Tensor` with its
                1x128 rowwise copy, whose FP8 rows ``permute`` moves with their scales
                (``rows`` is then an ``Fp8Tensor`` too).
            expert_ids: ``[T, k]`` int32/int64 global expert ids (outside ``[0, E)``, e.g.
                ``-1``: not routed, dropped).
            probs: ``[T, k]`` router probabilities (fp32 or x's dtype).
            async_op: return a :class:`PendingExchange` at once; its ``wait()`` returns the
                triple below. A collective: every rank of the group calls ``dispatch`` (and
                later ``combine``, and their backward) in the same order.
            fp8_rows: with ``fp8_payload``, return ``rows`` as an :class:`~linghe.Fp8Tensor`
                (1x128 rowwise e4m3 data and scales as they arrived; padding rows data 0,
                scale 1) instead of dequantizing them: the input of FP8 expert GEMMs
                (``grouped_swiglu(fp8=True)``), half the bytes written on arrival.
            pow2_scale: with ``fp8_payload``, round the 1x128 scales up to powers of two.

        Returns:
            ``(rows, probs_rows, handle)``: ``rows [R, H]`` grouped by local expert with
            segments padded to ``align`` (padding and tail rows are zeros; in a segment,
            rows arrive by source rank, own rank last, each in token order),
            ``probs_rows [R]`` fp32 (0 on padding), and a :class:`DispatchHandle`.
            ``R = n + El*(align-1)`` with ``n`` the rows received (default mode) or
            ``W*C`` (capacity mode).

        Backward: ``dx[t] = sum_j d_rows[row of (t, j)]`` in ``x``'s dtype and
        ``dprobs[t, j] = d_probs_rows[row of (t, j)]`` (0 for dropped copies), through one
        exchange of packed gradient records.
        """
        if isinstance(x, Fp8Tensor):
            if self.world_size > 1 or self.fp8_payload:
                raise ValueError("x as an Fp8Tensor (FP8 tokens moved by permute) is "
                                 "supported on one rank without fp8_payload; with expert "
                                 "parallelism pass the high-precision tokens "
                                 "(fp8_payload=True sends them as FP8)")
        else:
            check_tensor("x", x, dtypes=tuple(_DTYPE_CODES), ndim=2)
        check_tensor("expert_ids", expert_ids, dtypes=(torch.int32, torch.int64), ndim=2,
                     shape=(x.shape[0], None))
        check_tensor("probs", probs, dtypes=tuple(_DTYPE_CODES), ndim=2,
                     shape=tuple(expert_ids.shape))
        check_same_device(x=x, expert_ids=expert_ids, probs=probs)
        if fp8_rows and not self.fp8_payload:
            raise ValueError("fp8_rows=True needs a dispatcher with fp8_payload=True")
        probs = probs.float()
        if self.world_size == 1:
            result = self._dispatch_local(x, expert_ids, probs, fp8_rows, pow2_scale)
            return PendingExchange(None, None, "dispatch", None, result) if async_op \
                else result
        if x.stride(-1) != 1 and x.shape[1] > 1:
            x = x.contiguous()
        plan = self._make_plan(x, expert_ids.contiguous())
        plan.fp8_rows, plan.pow2 = bool(fp8_rows), bool(pow2_scale)
        transfer = _Transfer()
        recv, link = apply_function(_DispatchSend, x, probs.contiguous(), plan, transfer)
        T = x.shape[0]

        def finish():
            p = plan
            ids = recv[:, p.spec.trailer_offset + TRAILER_ID].to(torch.int32)
            El = self.num_local_experts
            n = ids.shape[0]
            num_rows = n + El * (self.align - 1)
            p.layout = layout_from_index(index_buffer(ids.view(n, 1), El, self.align,
                                                      num_rows),
                                         (n, 1), El, self.align, num_rows)
            rows, prow = apply_function(_DispatchRecv, recv, link, p)
            return rows, prow, DispatchHandle(p.layout, T, p.capacity, p, self, None)

        pending = PendingExchange(transfer, plan, "dispatch", finish)
        return pending if async_op else pending.wait()

    def _dispatch_local(self, x, expert_ids, probs, fp8_rows, pow2):
        if fp8_rows:  # FP8 tokens: permute moves rows and scales together
            x = quantize_tokens(x, pow2_scale=pow2)
        rows, probs_rows, layout = permute(x, expert_ids, probs, num_experts=self.num_experts,
                                           align=self.align)
        if self.fp8_payload and not fp8_rows:
            rows = quantize_1x128_ste(rows, pow2)
        return rows, probs_rows, DispatchHandle(layout, x.shape[0], None, None, self,
                                                expert_ids)

    def _make_plan(self, x, expert_ids) -> _Plan:
        """Index map, split sizes (default mode: the host sync) and buffers' sizes."""
        W, El, r = self.world_size, self.num_local_experts, self.rank
        T, k = expert_ids.shape
        H = x.shape[1]
        self._verify(T, k, H, x.dtype, x.device)
        p = _Plan()
        p.group, p.rank, p.world, p.timeout = self.group, r, W, self.timeout
        p.host_wait = x.device.type == "cpu"
        p.x_dtype, p.fp8, p.T, p.k, p.H = x.dtype, self.fp8_payload, T, k, H
        p.num_experts = self.num_experts
        # Each copy's position in global expert order (destination-major: rank r's
        # experts are contiguous), and the segment offsets [E + 1].
        lay = layout_from_index(index_buffer(expert_ids, self.num_experts, 1, T * k),
                                (T, k), self.num_experts, 1, T * k)
        p.ids, p.pos, p.offsets = expert_ids, lay.row_index, lay.offsets
        if self.capacity_factor is None:
            p.capacity = None
            counts = p.offsets[::El].diff().to(torch.int64)
            recv_counts = torch.empty_like(counts)
            # (CPU: a bounded host wait; CUDA: the stream waits, .tolist() then blocks)
            _wait(_a2a(recv_counts, counts, None, None, self.group), p, "split-size")
            # The one host sync of the default mode: split sizes for the payload exchange.
            sizes = torch.cat([counts, recv_counts]).tolist()
            send, recv = sizes[:W], sizes[W:]
            p.n_self = send[r]
        else:
            C = max(1, min(T * k, math.ceil(self.capacity_factor * T * k / W)))
            p.capacity = C
            send, recv = [C] * W, [C] * W
            p.n_self = C
        send[r] = recv[r] = 0  # own rows bypass the collective
        p.in_splits, p.out_splits = send, recv
        p.n_send, p.n_recv = sum(send), sum(recv)
        p.spec = fwd_spec(H, x.dtype, self.fp8_payload)
        p.gspec = RecordSpec(H, x.dtype, 1)
        p.slot = empty(T, k, dtype=torch.int32, device=x.device)
        p.layout = None  # the receiver's, built on arrival
        return p

    def _verify(self, T, k, H, dtype, device) -> None:
        """All-gather a configuration fingerprint once per call signature; raise a
        ``ValueError`` naming the field and the ranks where the ranks disagree."""
        cap = self.capacity_factor
        sig = (T if cap is not None else -1, k, H, dtype)
        if sig == self._verified:
            return
        fields = {
            "num_experts": self.num_experts, "world_size": self.world_size, "top_k": k,
            "hidden size": H, "dtype": _DTYPE_CODES[dtype],
            "fp8_payload": int(self.fp8_payload),
            "capacity_factor (None = default mode)": -1.0 if cap is None else float(cap),
            "tokens per rank (capacity mode: must be equal)": sig[0],
        }
        mine = torch.tensor(list(fields.values()), dtype=torch.float64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        plan = _Plan()
        plan.rank, plan.timeout = self.rank, self.timeout
        _wait(dist.all_gather(parts, mine, group=self.group, async_op=True), plan,
              "configuration check", host=True)
        table = torch.stack(parts).tolist()
        for i, name in enumerate(fields):
            col = [row[i] for row in table]
            if len(set(col)) > 1:
                def show(v, name=name):
                    if name == "dtype":
                        return str(_CODE_DTYPES[int(v)]).replace("torch.", "")
                    if name.startswith("capacity_factor") and v == -1.0:
                        return "None"
                    return f"{v:g}"
                by = {}
                for rk, v in enumerate(col):
                    by.setdefault(show(v), []).append(rk)
                desc = "; ".join(f"{v} on ranks {rks}" for v, rks in by.items())
                raise ValueError(f"ExpertParallelDispatcher: {name} differs across the ranks "
                                 f"of the expert-parallel group ({desc}); every rank must "
                                 "dispatch with the same configuration")
        self._verified = sig

    # ------------------------------------------------------------------ combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle,
                probs: torch.Tensor | None = None, *, residual: torch.Tensor | None = None,
                async_op: bool = False):
        """Return expert outputs to their tokens: ``out[t] = sum_j probs[t, j] * y[row of
        (t, j)]`` (plain sum when ``probs`` is None), accumulated in fp32.

        Args:
            y: ``[R, H]`` expert outputs in the ``rows`` order of :meth:`dispatch`
                (bf16/fp16/fp32; need not match ``x``'s dtype).
            handle: the :class:`DispatchHandle` from that dispatch.
            probs: optional ``[T, k]`` weights (the same tensor given to dispatch, or any).
            residual: optional ``[T, H]`` tensor added to ``out`` (e.g. the shared experts'
                output). On one rank it joins the fp32 sum (:func:`linghe.unpermute`'s
                ``residual``: one pass, one rounding); across ranks it is added to the
                received ``out`` (in ``out``'s dtype).
            async_op: return a :class:`PendingExchange`; its ``wait()`` returns ``out``.

        Returns ``[T, H]`` in ``y``'s dtype. Backward: ``dy[row of (t, j)] = probs[t, j] *
        dout[t]`` (0 on padding rows), ``dprobs[t, j] = <dout[t], y[row of (t, j)]>``,
        ``dresidual = dout``.
        """
        check_tensor("y", y, dtypes=tuple(_DTYPE_CODES), ndim=2)
        check_kernel_device("y", y)  # (an Fp8Tensor is refused: combine sums in fp32)
        if not isinstance(handle, DispatchHandle) or handle._owner is not self:
            raise ValueError("handle must be the DispatchHandle returned by this "
                             "dispatcher's dispatch")
        if y.shape[0] != handle.layout.num_rows:
            raise ValueError(f"y must have {handle.layout.num_rows} rows (the dispatched "
                             f"rows), got {y.shape[0]}")
        p = handle._plan
        if probs is not None:
            check_tensor("probs", probs, dtypes=tuple(_DTYPE_CODES),
                         shape=(handle.num_tokens, None))
            probs = probs.float().contiguous()
        if p is None:
            out = unpermute(y, handle.layout, probs, residual=residual)
            return PendingExchange(None, None, "combine", None, out) if async_op else out
        if y.shape[1] != p.H:
            raise ValueError(f"y must have hidden size {p.H} (the dispatched rows'), got "
                             f"{y.shape[1]}")
        if probs is not None and probs.shape[1] != p.k:
            raise ValueError(f"probs must have shape ({p.T}, {p.k}), got "
                             f"{tuple(probs.shape)}")
        transfer = _Transfer()
        ret = apply_function(_CombineSend, y.contiguous(), p, transfer)

        def finish():
            out = apply_function(_CombineRecv, ret, probs, p)
            return out if residual is None else out + residual.to(out.dtype)

        pending = PendingExchange(transfer, p, "combine", finish)
        return pending if async_op else pending.wait()


def quantize_1x128_ste(x: torch.Tensor, pow2_scale: bool = False) -> torch.Tensor:
    """``x`` rounded through rowwise 1x128 FP8 (quantize + dequantize, in ``x``'s dtype);
    the gradient passes straight through. What ``fp8_payload`` does to rows on one rank."""
    return _QuantizeSTE.apply(x, bool(pow2_scale))


class _QuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pow2):
        q = quantize_1x128(x.contiguous(), rowwise=True, pow2_scale=pow2)
        return _dequant_rows(q.rowwise_data, q.rowwise_scale, x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _dequant_rows(data: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """1x128 rowwise dequantization to ``dtype`` (a broadcast multiply when ``H % 128 ==
    0``: no repeated-scale temporary)."""
    n, H = data.shape
    if H % 128 == 0:
        return (data.view(n, H // 128, 128).float() * scale.float()[:, :, None]).view(n, H) \
            .to(dtype)
    return dequantize_1x128(data, scale).to(dtype)
