"""AdamW in one multi-tensor launch per dtype group, with gradient clipping fused in.

``linghe.optim.AdamW`` is a drop-in for ``torch.optim.AdamW`` (decoupled weight decay;
the same hyperparameters, state names and ``state_dict`` layout) whose ``step()`` is:

1. with ``max_grad_norm``: the total gradient norm and the clip coefficient
   ``min(max_grad_norm / (norm + 1e-6), 1)`` in one launch
   (:func:`linghe.optim.grad_norm`'s kernel; the norm is kept in :attr:`AdamW.grad_norm`);
2. per param group: one tiny launch advances the step counts and computes their bias
   corrections (in float64), then one persistent launch per (param, grad, moment) dtype
   combination over a cached table of chunk addresses reads each parameter, gradient and
   both moments once and writes the parameter and the moments once, the gradient
   multiplied by the clip coefficient in registers.

So clipping costs one read of the gradients instead of ``clip_grad_norm_``'s read plus a
read and write, and the update is one launch instead of PyTorch's fused AdamW's one launch
per ~21M elements (each a few waves with a tail). A 16-bit weight bound to an FP8 layer's
weight cache is updated by its own launch that also writes its 128x128 FP8 copies
(:mod:`linghe.optim.fp8_weights`; ``fp8_weight_copies=False`` turns it off): the next
forward finds them instead of reading the weight again (rewritten in place every step,
as the weight itself is). No host sync; the whole ``step()`` can
be captured in a CUDA graph (step counts and the clip coefficient live on the device;
see :meth:`AdamW.prepare_step`; pass ``lr`` as a device tensor to change it between replays; other
hyperparameters are baked into a captured step).

Differences from ``torch.optim.AdamW``, each documented where it applies:

* the gradients are not modified by clipping (the coefficient is applied inside the
  update); read :attr:`AdamW.grad_norm` for the norm;
* ``amsgrad=True`` and ``differentiable=True`` raise ``NotImplementedError``; ``foreach``,
  ``fused`` and ``capturable`` are accepted and ignored (there is one implementation,
  always capturable);
* parameters must be float32, bfloat16 or float16, contiguous, and on one device per
  param group; the math runs in float32 (as PyTorch's fused kernel for these dtypes).

The state of a parameter is ``step`` (a 0-dim float32 tensor on the parameter's device,
as in PyTorch's fused and capturable forms), ``exp_avg`` and ``exp_avg_sq`` (the
parameter's dtype). ``step`` entries are views of one per-group buffer (in-place edits
of them are seen; after replacing state tensors by hand, go through ``load_state_dict``).
State dicts load both ways between this class and ``torch.optim.AdamW``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..bwd import deferred, grad_norms
from ..fp8.cache import bound_caches
from ..fp8.tensor import Fp8Tensor
from ..utils import (
    capture_pauses_bookkeeping,
    check_kernel_device,
    in_whole_step_capture,
    mark_graph_written,
)
from . import multi_tensor as K
from .clip import (
    _norm_and_coef,
    _norm_and_coef_extra,
    check_max_norm,
    check_norm_type,
    prepare,
)
from .fp8_weights import adamw_quant_128_, copy_buffers_fit

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_PLANS_PER_GROUP = 8


def _capture_pauses(params: list) -> bool:
    """Whether a CUDA graph capture that does not hold whole steps is under way on the
    current stream (the parameters' device is a GPU): :func:`linghe.whole_step_capture`."""
    return bool(params) and capture_pauses_bookkeeping(params[0])


def _fp8_bound(params, idx: list[int], fuse: bool) -> tuple:
    """``(index, cache, fmt, pow2, shape2d)`` for the parameters of ``idx`` whose step
    makes the FP8 copy of the one cache bound to them (:meth:`WeightCache.bind_128x128`;
    with ``fuse``: 16-bit, contiguous, with a contiguous gradient of the same shape).
    Copies that an earlier step put in the caches of the others are cleared: this step
    changes their weights without making new ones."""
    out = []
    for i in idx:
        p = params[i]
        bound = bound_caches(p)
        if not bound:
            continue
        g = p.grad
        if (fuse and len(bound) == 1 and p.dtype in _FP8_FUSED_DTYPES
                and p.is_contiguous() and g.shape == p.shape and g.is_contiguous()
                and bound[0][3][0] * bound[0][3][1] == p.numel()):
            out.append((i, *bound[0]))
            continue
        for cache, *_ in bound:
            _drop_copy(cache, p)
    return tuple(out)


def _drop_copy(cache, p: torch.Tensor) -> None:
    """Clear ``cache``'s copy if this optimizer made it (a step that does not rewrite it
    changes the weight). Inside :func:`linghe.whole_step_capture` (the captures and the
    ``prepare_step`` between them) that copy may be what the captured forwards read, and
    clearing it would leave them on freed buffers: refuse."""
    if not cache.from_optimizer:
        return
    if in_whole_step_capture():
        raise RuntimeError(
            "linghe.optim.AdamW: inside linghe.whole_step_capture, a captured step cannot "
            "rewrite the FP8 copy of a weight (shape " + str(tuple(p.shape)) + ") in place "
            "(its gradient's layout or the copy's format changed since the eager steps), "
            "and the captured forwards read that copy; run an eager step with the same "
            "gradients before capturing")
    cache.clear()


#: Parameter dtypes whose step may write their FP8 copy (a 16-bit weight's transposed
#: e4m3 tile is stored from registers, as in ``quantize_128x128``; float32 weights keep
#: the separate quantization).
_FP8_FUSED_DTYPES = (torch.bfloat16, torch.float16)


class _GroupBuffers:
    """One param group's device-side step state: ``steps [n]`` float32 (the parameters'
    ``state["step"]`` are views of it), the betas as a float64 device tensor, this step's
    bias corrections ``bias [n, 2]``, and the cached launch plans, keyed on which
    parameters have a gradient, the dtypes and the alignment (the addresses are bound per
    call; plans a captured graph reads are never evicted)."""

    def __init__(self, params: list[torch.Tensor], state, betas) -> None:
        self.key = tuple(map(id, params))
        device = params[0].device
        for i, p in enumerate(params):
            if p.device != device:
                raise ValueError(f"linghe.optim.AdamW needs the parameters of a param group "
                                 f"on one device: params[{i}] is on {p.device}, params[0] "
                                 f"on {device}")
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=device)
        have = [i for i, p in enumerate(params) if "step" in state.get(p, {})]
        if have:  # loaded or earlier state: gather its counts (device ops, no sync)
            vals = [torch.as_tensor(state[params[i]]["step"], dtype=torch.float32)
                    .to(device).reshape(()) for i in have]
            self.steps[torch.tensor(have, device=device)] = torch.stack(vals)
            for i in have:
                state[params[i]]["step"] = self.steps[i]
        self.bias = torch.empty(len(params), 2, dtype=torch.float32, device=device)
        self.plans: OrderedDict = OrderedDict()
        self.set_betas(betas)

    def set_betas(self, betas) -> None:
        self.betas = (float(betas[0]), float(betas[1]))
        self.betas_t = torch.tensor(self.betas, dtype=torch.float64, device=self.steps.device)


class AdamW(torch.optim.Optimizer):
    """Drop-in for ``torch.optim.AdamW`` (see the module docstring for the differences).

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``.
        lr: learning rate (a float, or a 1-element tensor; on the parameters' device it is
            read by the kernel, so a captured step sees changes).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to the denominator, ``>= 0``. The update takes the GPU's fast square
            root and division (within 2 ulp of IEEE; the fast square root flushes subnormal
            second moments to zero), so with ``eps = 0`` an element whose second moment is
            zero or subnormal gets an infinite or NaN step: keep ``eps > 0``.
        weight_decay: decoupled weight decay, ``>= 0``.
        amsgrad: must be False.
        maximize: maximize the objective.
        foreach, fused, capturable: accepted and ignored (saved as ``None``/``False`` in
            the param groups, so that a state dict loads into ``torch.optim.AdamW`` as one
            of its own default form).
        differentiable: must be False.
        max_grad_norm: clip the gradients of all param groups to this total norm inside the
            step (``None``: no clipping).
        norm_type: the norm's order for ``max_grad_norm`` (``p > 0``, ``inf``, ``-inf``).
        fp8_weight_copies: make the FP8 copies of weights bound to an FP8 layer's
            :class:`~linghe.fp8.WeightCache` inside the step (16-bit weights, 128x128
            blocks; :mod:`linghe.optim.fp8_weights`), so that the next forward does not
            read them again to quantize; False leaves the quantization to the layers.
        norm_from_backward: with ``max_grad_norm`` and ``norm_type=2``, take the squared
            norms of the MoE experts' weight gradients from the wgrad kernel that wrote
            them (:mod:`linghe.bwd.grad_norms`) instead of reading those gradients again
            (one read of ~90% of a MoE model's gradients). Opt-in because a write to
            ``.grad`` that does not bump its version counter between the backward and
            the step goes unseen: ``torch.distributed`` collectives on ``.grad`` or
            writes through ``.data``. DDP (its buckets), FSDP (DTensor gradients) and
            PyTorch's in-place ops are seen. A gradient without a valid record is read
            as usual. Covers the parameters given here (not ``add_param_group``'s),
            while this optimizer lives.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 max_grad_norm: float | None = None, norm_type: float = 2.0,
                 fp8_weight_copies: bool = True, norm_from_backward: bool = False) -> None:
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if amsgrad:
            raise NotImplementedError("linghe.optim.AdamW does not implement amsgrad=True; "
                                      "use torch.optim.AdamW for it")
        if differentiable:
            raise NotImplementedError("linghe.optim.AdamW is not differentiable; use "
                                      "torch.optim.AdamW(differentiable=True)")
        self.max_grad_norm = None if max_grad_norm is None else check_max_norm(max_grad_norm)
        self.norm_type = check_norm_type(norm_type)
        self.fp8_weight_copies = bool(fp8_weight_copies)
        self.norm_from_backward = bool(norm_from_backward)
        #: The total gradient norm of the last ``step()`` (0-dim float32 tensor on the
        #: device) when ``max_grad_norm`` is set, else None.
        self.grad_norm: torch.Tensor | None = None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=maximize, foreach=None, capturable=False,
                        differentiable=False, fused=None)
        self._groups: dict[int, _GroupBuffers] = {}
        super().__init__(params, defaults)
        if self.norm_from_backward and self.max_grad_norm is not None and self.norm_type == 2:
            grad_norms.watch((p for g in self.param_groups for p in g["params"]), owner=self)

    def __setstate__(self, state: dict) -> None:
        state.setdefault("fp8_weight_copies", True)
        state.setdefault("norm_from_backward", False)
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("differentiable", False)
        self._groups = {}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._groups = {}  # rebuilt from the loaded state on the next step

    def extra_repr(self) -> str:
        return (f"max_grad_norm={self.max_grad_norm}, norm_type={self.norm_type}, "
                f"fp8_weight_copies={self.fp8_weight_copies}, "
                f"norm_from_backward={self.norm_from_backward}")

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient (see the module docstring).
        Returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coef = self._clip_coef()
        for gi, group in enumerate(self.param_groups):
            planned = self._group_plan(
                gi, group, fuse_fp8=self.fp8_weight_copies and not _capture_pauses(group["params"]))
            if planned is None:
                continue
            bufs, (plan, inc, _mv), addrs, _keep, fused = planned
            K.adamw_advance(bufs.steps, inc, bufs.betas_t, bufs.bias)
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device != bufs.steps.device:
                lr = float(lr)  # a CPU tensor: a host read, no device sync
            beta1, beta2 = bufs.betas
            hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], maximize=group["maximize"],
                         coef=coef)
            if plan is not None:
                K.adamw_(plan, addrs, bufs.bias, **hyper)
            for i, cache, fmt, pow2, shape2d in fused:
                self._step_fp8(group["params"][i], i, bufs, cache, fmt, pow2, shape2d, hyper)
        return loss

    def _step_fp8(self, p, i, bufs, cache, fmt, pow2, shape2d, hyper) -> None:
        """AdamW on ``p`` (row ``i`` of the group's bias corrections) that also makes its
        FP8 copy for ``cache`` (:mod:`linghe.optim.fp8_weights`)."""
        st = self.state[p]
        # The copy this update made last step is rewritten in place (a forward captured
        # in a CUDA graph reads those buffers; see linghe.whole_step_capture), else a new
        # one is made (the last freed first).
        value = cache.value if cache.from_optimizer else None
        if (value is not None and value.shape == p.shape and value.dtype == p.dtype
                and copy_buffers_fit(value, shape2d, p.device)):
            out = (value.rowwise_data, value.rowwise_scale, value.columnwise_data,
                   value.columnwise_scale)
        else:
            _drop_copy(cache, p)
            value = out = None
        q, s, qt, st_ = adamw_quant_128_(p, p.grad, st["exp_avg"], st["exp_avg_sq"],
                                         bufs.bias, i, pow2_scale=pow2, shape2d=shape2d,
                                         out=out, **hyper)
        if value is None:
            value = Fp8Tensor(p.shape, p.dtype, rowwise_data=q, rowwise_scale=s,
                              columnwise_data=qt, columnwise_scale=st_, scaling="128x128")
        else:
            # rewritten by a kernel: bump the version counters, so that what is derived
            # from the old copy and keyed by them (re-laid-out scales, a padded copy) is
            # made again; a captured rewrite (whose replays bump nothing) marks the
            # buffers so that nothing is derived from them and kept
            capturing = p.is_cuda and torch.cuda.is_current_stream_capturing()
            for t in out:
                torch.autograd.graph.increment_version(t)
                if capturing:
                    mark_graph_written(t)
        cache.put_from_optimizer(p, value, fmt)

    @torch.no_grad()
    def prepare_step(self) -> None:
        """Build what :meth:`step` needs for the current gradients (missing state, the
        chunk tables, the norm's table and buffers) without changing any parameter or
        step count. Call it before capturing ``step()`` in a CUDA graph when the gradients
        were allocated anew since the last eager step (e.g. set to None before a captured
        backward), or when eager steps made FP8 weight copies: new addresses (and a new
        table) are uploaded from pinned host memory, which a capture must not do. A step
        captured alone makes no FP8 copies (its table covers those weights too), so the
        copies eager steps put in caches are dropped (the captured forward quantizes);
        inside :func:`linghe.whole_step_capture` the captured step rewrites them in place,
        as eager steps do, and they stay (the captured forwards read them)."""
        # What a captured step runs: the recorded gradient norms and the FP8 copies only
        # inside linghe.whole_step_capture (elsewhere the capture pauses them).
        whole = in_whole_step_capture()
        params = [p for g in self.param_groups for p in g["params"]]
        if whole and any(deferred.pending_micro_batches(p) for p in params):
            raise RuntimeError(
                "linghe.optim.AdamW.prepare_step: deferred weight gradients are pending "
                "(wgrad_micro_batches); inside linghe.whole_step_capture the captured "
                "backward must hold every micro-batch of the step")
        self._clip_coef(consume=False, use_records=whole)  # (the records stay for the step)
        for gi, group in enumerate(self.param_groups):
            self._group_plan(gi, group, fuse_fp8=self.fp8_weight_copies and whole)

    # ------------------------------------------------------------------------ internals

    def _clip_coef(self, consume: bool = True,
                   use_records: bool | None = None) -> torch.Tensor | None:
        """The clip coefficient ``[1]`` (and :attr:`grad_norm`), or None without
        ``max_grad_norm``. ``consume``: forget the gradient norms the backward recorded
        (False: leave them for the step; :meth:`prepare_step`). ``use_records``: whether
        those norms may stand in for reading gradients (default: unless a capture that
        pauses the bookkeeping is under way)."""
        if self.max_grad_norm is None:
            return None
        params = [p for g in self.param_groups for p in g["params"]]
        if use_records is None:
            use_records = not _capture_pauses(params)
        if self.norm_from_backward and self.norm_type == 2.0 and use_records:
            # squared norms recorded by the wgrad kernels; the other gradients are read
            recorded, rest = [], []
            for p in params:
                sq = grad_norms.take(p, consume)
                if sq is None:
                    rest.append(p)
                else:
                    recorded.append(sq)
            if recorded:
                prep = prepare(rest, None, name="params", grads=True, write=False)
                if not any(prep[0]):  # (no DTensor gradients, whose norm is all-reduced)
                    extra = torch.cat([sq.reshape(-1) for sq in recorded]).sum().reshape(1)
                    self.grad_norm, coef = _norm_and_coef_extra(*prep, 2.0, torch.float32,
                                                                self.max_grad_norm, extra)
                    return coef
        prep = prepare(params, None, name="params", grads=True, write=False)
        self.grad_norm, coef = _norm_and_coef(*prep, self.norm_type, torch.float32,
                                              self.max_grad_norm)
        return coef

    def _buffers(self, gi: int, group: dict) -> _GroupBuffers:
        bufs = self._groups.get(gi)
        if bufs is None or bufs.key != tuple(map(id, group["params"])):
            bufs = self._groups[gi] = _GroupBuffers(group["params"], self.state,
                                                    group["betas"])
        elif bufs.betas != (float(group["betas"][0]), float(group["betas"][1])):
            bufs.set_betas(group["betas"])
        return bufs

    def _group_plan(self, gi: int, group: dict, fuse_fp8: bool):
        """``(buffers, (plan or None, step increment, the moments' addresses), addresses,
        temporary gradient copies or None, fused)`` for the parameters of ``group`` that
        have a gradient, or None when none has. ``fused``: ``(index, cache, fmt, pow2,
        shape2d)`` of the parameters whose step also makes their FP8 copy (``fuse_fp8``,
        :func:`_fp8_bound`); the table covers the others."""
        if group["amsgrad"]:
            raise NotImplementedError("linghe.optim.AdamW does not implement amsgrad=True "
                                      "(this param group asks for it)")
        params = group["params"]
        idx = [i for i, p in enumerate(params) if p.grad is not None]
        if not idx:
            return None
        bufs = self._buffers(gi, group)
        fused = _fp8_bound(params, idx, fuse_fp8)
        skip = {f[0] for f in fused}
        flat = [i for i in idx if i not in skip]
        ps = [params[i] for i in flat]
        gs = [p.grad for p in ps]
        keep = None
        if not all(map(_IS_CONTIGUOUS, gs)):  # read only: copies for this step
            gs = keep = [g if g.is_contiguous() else g.contiguous() for g in gs]
        pg_ptrs = tuple(map(_DATA_PTR, ps)) + tuple(map(_DATA_PTR, gs))
        # The table depends on which parameters step, their dtypes and the alignment, not
        # on the addresses: gradients allocated anew every step reuse it.
        key = (tuple(idx), tuple(flat), tuple(p.dtype for p in ps),
               tuple(g.dtype for g in gs), not any(x % 16 for x in pg_ptrs))
        entry = bufs.plans.get(key)
        if entry is None:
            entry = bufs.plans[key] = self._plan(bufs, params, idx, flat, key[-1])
            K.evict_oldest(bufs.plans, _PLANS_PER_GROUP,
                           lambda k, e: e[0] is not None and K.plan_in_graph(k, e[0]))
        else:
            bufs.plans.move_to_end(key)
        addrs = entry[0].addr_sets.get(pg_ptrs + entry[2]) if entry[0] is not None else None
        return bufs, entry, addrs, keep, fused

    def _plan(self, bufs: _GroupBuffers, params, idx: list[int], flat: list[int],
              aligned: bool):
        """Validate, create missing state (every parameter of ``idx``), build the segment
        tables of those in ``flat``. Returns ``(plan (None without any), step increment
        (None: every parameter), the moments' addresses)``."""
        device = bufs.steps.device
        ms, vs = [], []
        ps = [params[i] for i in idx]
        gs = [p.grad for p in ps]
        in_table = set(flat)
        for j, (i, p, g) in enumerate(zip(idx, ps, gs)):
            name = f"params[{i}]"
            if p.dtype not in PARAM_DTYPES:
                raise TypeError(f"linghe.optim.AdamW: {name} has dtype {p.dtype}; supported: "
                                "float32, bfloat16, float16")
            if g.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            if g.dtype not in PARAM_DTYPES:
                raise TypeError(f"linghe.optim.AdamW: {name}.grad has dtype {g.dtype}; "
                                "supported: float32, bfloat16, float16")
            if g.shape != p.shape:
                raise ValueError(f"{name}.grad has shape {tuple(g.shape)}, the parameter "
                                 f"{tuple(p.shape)}")
            if j == 0:
                check_kernel_device(name, p)
            if g.device != device:
                raise ValueError(f"{name}.grad is on {g.device}, the parameter on {device}")
            if not p.is_contiguous():
                raise ValueError(f"linghe.optim.AdamW needs contiguous parameters; {name} "
                                 "is not")
            st = self.state[p]
            if "exp_avg" not in st:
                st["step"] = bufs.steps[i]
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            for k in ("exp_avg", "exp_avg_sq"):
                t = st[k]
                if t.shape != p.shape or t.device != device or not t.is_contiguous() \
                        or t.dtype not in PARAM_DTYPES:
                    raise ValueError(f"state[{name}][{k!r}] must be a contiguous float tensor "
                                     f"of the parameter's shape on {device}")
            if st["exp_avg"].dtype != st["exp_avg_sq"].dtype:
                st["exp_avg_sq"] = st["exp_avg_sq"].to(st["exp_avg"].dtype)
            if i in in_table:
                ms.append(st["exp_avg"])
                vs.append(st["exp_avg_sq"])
        mv_ptrs = tuple(map(_DATA_PTR, ms)) + tuple(map(_DATA_PTR, vs))
        plan = None
        if flat:
            fps = [params[i] for i in flat]
            plan = K.build_adamw_plan(fps, [p.grad for p in fps], ms, flat, device,
                                      aligned and not any(x % 16 for x in mv_ptrs))
        inc = None
        if len(idx) < len(params):  # only the parameters with a gradient count this step
            inc = torch.zeros(len(params), dtype=torch.float32)
            inc[idx] = 1.0
            inc = inc.to(device)
        return plan, inc, mv_ptrs
