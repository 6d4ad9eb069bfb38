"""Gradient norm and clipping: drop-ins for ``torch.nn.utils.get_total_norm``,
``clip_grads_with_norm_`` and ``clip_grad_norm_``, plus :func:`grad_norm`.

Distributed design (``group=``)
-------------------------------
The norm of gradients sharded over ranks is ``(sum_over_ranks sum |g_local|^p)^(1/p)``
(``max`` for ``p = inf``, ``min`` for ``-inf``), so each rank computes its local partial
``sum |g|^p`` and the partials are all-reduced (SUM, or MAX/MIN) before the final root.
Gradients may be sharded over different process groups (expert parameters over the
expert-data-parallel group, dense ones over the data-parallel group); they form *buckets*:

* ``group=None``: plain tensors are not sharded (no collective).
* ``group=pg`` (a ``ProcessGroup``): every plain tensor is a shard over ``pg``.
* ``group=[g_0, g_1, ...]`` (a list): then ``parameters`` (or ``tensors``) must be a list of
  the same length of parameter iterables; iterable ``i`` is sharded over ``g_i``, where
  ``g_i`` is ``None`` (replicated / not sharded), a ``ProcessGroup``, or a tuple of groups
  (sharded over all of them, e.g. ``(tp_group, dp_group)``). Example, MoE with dense
  parameters sharded over DP and experts over EP x EDP::

      clip_grad_norm_([dense_params, expert_params], 1.0,
                      group=[dp_group, (ep_group, edp_group)])

* ``DTensor`` gradients (FSDP2) always use their own mesh: the local shard
  (``_local_tensor``) is read and the partial is all-reduced over the mesh dimensions whose
  placement is ``Shard`` (replicated dimensions are not reduced, so nothing is counted
  twice); ``Partial`` placements are rejected. ``group`` applies to plain tensors only.

Each bucket's partial is reduced on the device and all-reduced once per group of the
bucket; the buckets are combined on the device, so there is no host sync. Every rank must
pass the same bucket structure (the same ``group`` list; ``None`` grads are fine: an empty
bucket still joins its collectives, so ranks never hang on each other).

The returned norm is a float32 tensor (float64 with ``dtype=torch.float64``) on the
gradients' device, also for bf16/fp16 gradients (PyTorch returns the gradients' dtype); it
is the norm of the full (unsharded) gradients on every rank (a plain tensor, not a DTensor).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import attrgetter

import torch

from ..bwd.deferred import flush_deferred_wgrad
from ..utils import check_kernel_device, empty
from . import multi_tensor as K

_NONFINITE_MSG = (
    "The total norm of order {p} for gradients from `parameters` is non-finite, so it "
    "cannot be clipped. To disable this error and scale the gradients by the non-finite "
    "norm anyway, set `error_if_nonfinite=False`"
)


# ======================================================================================
# argument handling
# ======================================================================================


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - old torch / no distributed
        try:
            from torch.distributed._tensor import DTensor
        except Exception:
            return None
    return DTensor


def _is_pg(g) -> bool:
    if not torch.distributed.is_available():
        return False
    return isinstance(g, torch.distributed.ProcessGroup)


def _norm_group(g, name: str) -> tuple:
    """``None`` / a ProcessGroup / a tuple of ProcessGroups -> tuple of groups."""
    if g is None:
        return ()
    if _is_pg(g):
        return (g,)
    if isinstance(g, tuple) and all(_is_pg(x) for x in g):
        return g
    raise TypeError(f"{name} must be None, a torch.distributed.ProcessGroup or a tuple of "
                    f"them, got {type(g).__name__}")


def check_norm_type(norm_type) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"norm_type must be a number, got {type(norm_type).__name__}") from None
    if math.isnan(p) or (not math.isinf(p) and p <= 0):
        raise ValueError(f"norm_type must be > 0, inf or -inf, got {norm_type}")
    return p


def check_max_norm(max_norm) -> float:
    if isinstance(max_norm, torch.Tensor):
        if max_norm.numel() != 1:
            raise ValueError(f"max_norm must be a number, got a tensor of shape "
                             f"{tuple(max_norm.shape)}")
        max_norm = max_norm.item()
    try:
        m = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}") from None
    if not math.isfinite(m) or m < 0:
        raise ValueError(f"max_norm must be finite and >= 0, got {max_norm}")
    return m


def _check_foreach(foreach) -> None:
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be None or a bool, got {type(foreach).__name__}")


def _as_list(x, name: str) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if not isinstance(x, Iterable):
        raise TypeError(f"{name} must be a tensor or an iterable of tensors, got "
                        f"{type(x).__name__}")
    return list(x)


def _local(t: torch.Tensor, user_groups: tuple, DTensor) -> tuple[torch.Tensor, tuple]:
    """(local tensor, groups it is sharded over)."""
    if DTensor is not None and isinstance(t, DTensor):
        mesh = t.device_mesh
        groups = []
        for d, pl in enumerate(t.placements):
            if pl.is_shard():
                groups.append(mesh.get_group(d))
            elif pl.is_partial():
                raise ValueError("DTensor gradients with a Partial placement are not supported "
                                 "(reduce them first, e.g. with .redistribute())")
        return t._local_tensor, tuple(groups)
    return t, user_groups


def collect(items, group, *, name: str, grads: bool, write: bool):
    """Validate and bucket the inputs.

    Returns ``(buckets, device)`` with ``buckets`` a list of ``(groups, [local tensors])``
    in a rank-independent order, and ``device`` the tensors' device (None when there are no
    tensors). ``grads``: items are parameters whose ``.grad`` is read (None skipped);
    ``write``: the tensors will be scaled in place (must be contiguous).
    """
    if isinstance(group, list):
        sublists = _as_list(items, name)
        if len(sublists) != len(group):
            raise ValueError(f"group is a list of {len(group)} groups, so {name} must be a "
                             f"list of {len(group)} iterables of tensors, got {len(sublists)} "
                             "items")
        parts = [(_norm_group(g, f"group[{i}]"), _as_list(s, f"{name}[{i}]"), f"{name}[{i}]")
                 for i, (g, s) in enumerate(zip(group, sublists))]
    else:
        parts = [(_norm_group(group, "group"), _as_list(items, name), name)]
    DTensor = _dtensor_cls()
    buckets: dict = {}
    for g, _, _ in parts:  # every declared bucket exists on every rank, even if empty
        buckets.setdefault(g, [])
    device = None
    first_name = None
    for g, lst, pname in parts:
        for i, t in enumerate(lst):
            tname = f"{pname}[{i}]"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{tname} must be a torch.Tensor, got {type(t).__name__}")
            if grads:
                t = t.grad
                tname += ".grad"
                if t is None:
                    continue
            loc, gg = _local(t, g, DTensor)
            if loc.dtype not in K.NORM_DTYPES:
                raise TypeError(f"{tname} must have dtype float32, bfloat16, float16 or "
                                f"float64, got {loc.dtype}")
            if device is None:
                device, first_name = loc.device, tname
                check_kernel_device(tname, loc)
            elif loc.device != device:
                raise ValueError(f"{tname} is on {loc.device} but {first_name} is on {device}; "
                                 "all tensors must be on one device")
            if not loc.is_contiguous():
                if write:
                    raise ValueError(f"{tname} must be contiguous to be scaled in place")
                loc = loc.contiguous()
            buckets.setdefault(gg, []).append(loc)
    return list(buckets.items()), device


def _default_device(groups) -> torch.device:
    """Device for an empty rank's collectives: CUDA for NCCL groups, else CPU."""
    for g in groups:
        if torch.distributed.get_backend(g) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_GRAD = attrgetter("grad")
_FAST = K.TensorListCache(32)


def prepare(items, group, *, name: str, grads: bool, write: bool):
    """Validated inputs as ``(bucket groups, device, plan, keep)``; ``plan`` is None when
    there is nothing to compute (no tensors, no collectives); ``keep`` holds contiguous
    copies the plan points to (the caller keeps it until the kernels are launched).

    Steady-state fast path: a flat list of plain contiguous tensors (or parameters whose
    ``.grad`` are such) validated before skips validation and table building: a hit costs
    a few C-level ``map`` calls over the list (type, [grad], id, data_ptr; see
    :class:`linghe.optim.multi_tensor.TensorListCache`). The cache holds no tensor
    references.
    """
    lst = None
    if not isinstance(group, list):
        if isinstance(items, torch.Tensor):
            lst = [items]
        elif isinstance(items, list):
            lst = items
        else:
            lst = _as_list(items, name)
        if _PLAIN_TYPES.issuperset(map(type, lst)):
            ts = list(map(_GRAD, lst)) if grads else lst
            groups = _norm_group(group, "group")
            key, hit = _FAST.get((groups, grads, write), ts)
            if hit is not None:
                return hit
            live = [g for g in ts if g is not None] if grads else ts
            if _PLAIN_TYPES.issuperset(map(type, live)) and all(
                    map(torch.Tensor.is_contiguous, live)):
                res = _prepare_slow(lst, group, name=name, grads=grads, write=write)
                _FAST.put(key, ts, res[:3] + ((),))  # contiguous: no copies to keep
                return res
    return _prepare_slow(items if lst is None else lst, group, name=name, grads=grads,
                         write=write)


def _prepare_slow(items, group, *, name: str, grads: bool, write: bool):
    buckets, device = collect(items, group, name=name, grads=grads, write=write)
    groups = [g for g, _ in buckets]
    all_groups = [g for gs in groups for g in gs]
    if device is None:
        if not all_groups:
            return groups, None, None, ()
        device = _default_device(all_groups)
    keep = [ts for _, ts in buckets]
    return groups, device, K.get_plan("float", keep, device), keep


# ======================================================================================
# core
# ======================================================================================


def _norm_and_coef(groups, device, plan, keep, p: float, acc_dtype: torch.dtype,
                   max_norm: float | None):
    """Returns ``(norm 0-dim, coef [1] or None)`` from :func:`prepare`'s output; no host
    sync."""
    if plan is None:
        return torch.tensor(0.0, dtype=acc_dtype), None
    all_groups = [g for gs in groups for g in gs]
    norm = empty((), dtype=acc_dtype, device=device)
    coef = plan.buffer("coef", 1, torch.float32) if max_norm is not None else None
    mn = 0.0 if max_norm is None else max_norm
    if not all_groups and len(groups) == 1 and len(plan.launches) == 1:
        # one launch: partials, final reduce, norm and coefficient (no reduce launch)
        K.norm_single_launch(plan, p, acc_dtype, norm_out=norm, coef_out=coef, max_norm=mn)
        return norm, coef
    partials = K.norm_partials(plan, p, acc_dtype)
    if not all_groups and len(groups) == 1:
        acc = plan.buffer("acc", 1, acc_dtype)
        off, n = plan.buckets[0]
        K.reduce_partials(partials, off, n, p, acc_out=acc, norm_out=norm, coef_out=coef,
                          max_norm=mn)
        return norm, coef
    accs = plan.buffer("accs", len(groups), acc_dtype)
    for b, (off, n) in enumerate(plan.buckets):
        K.reduce_partials(partials, off, n, p, acc_out=accs[b:b + 1])
    mode = K.norm_mode(p)
    op = (torch.distributed.ReduceOp.MAX if mode == K.MODE_INF else
          torch.distributed.ReduceOp.MIN if mode == K.MODE_NEG_INF else
          torch.distributed.ReduceOp.SUM) if all_groups else None
    for b, gs in enumerate(groups):
        for g in gs:
            torch.distributed.all_reduce(accs[b:b + 1], op=op, group=g)
    K.finish_norm(accs, p, norm_out=norm, coef_out=coef, max_norm=mn)
    return norm, coef


def _norm_and_coef_extra(groups, device, plan, keep, p, acc_dtype, max_norm, extra_sq):
    """:func:`_norm_and_coef` of the gradients :func:`prepare` took plus ``extra_sq``, a
    ``[1]`` float32 sum of squares of other gradients (e.g. recorded by the wgrad kernels,
    :mod:`linghe.bwd.grad_norms`); ``p = 2`` only, not distributed. The partials of
    ``plan`` (if any) are reduced to one accumulator, then the accumulators ``[rest,
    extra_sq]`` finished together."""
    if p != 2.0 or any(gs for gs in groups):
        raise ValueError("extra_sq needs norm_type 2 and no process groups")
    device = extra_sq.device
    accs = torch.zeros(2, dtype=acc_dtype, device=device)
    accs[1:].copy_(extra_sq)
    if plan is not None and plan.launches:
        partials = K.norm_partials(plan, p, acc_dtype)
        off, n = plan.buckets[0]
        K.reduce_partials(partials, off, n, p, acc_out=accs[0:1])
    norm = empty((), dtype=acc_dtype, device=device)
    coef = empty(1, dtype=torch.float32, device=device) if max_norm is not None else None
    K.finish_norm(accs, p, norm_out=norm, coef_out=coef,
                  max_norm=0.0 if max_norm is None else max_norm)
    return norm, coef


def _raise_if_nonfinite(norm: torch.Tensor, p: float) -> None:
    if not bool(torch.isfinite(norm).item()):
        raise RuntimeError(_NONFINITE_MSG.format(p=p))


def grad_norm(tensors, norm_type: float = 2.0, *, dtype: torch.dtype = torch.float32,
              group=None) -> torch.Tensor:
    """Total ``norm_type``-norm of ``tensors`` viewed as one vector.

    Args:
        tensors: a tensor or an iterable of tensors (float32/bfloat16/float16/float64, mixed
            dtypes and sizes allowed, each read in its own dtype; all on one device; DTensors
            are read through their local shard). With ``group`` a list: a list of iterables.
        norm_type: ``p > 0``, ``inf`` or ``-inf``.
        dtype: accumulation and result dtype, ``torch.float32`` (default) or
            ``torch.float64``.
        group: see the module docstring (distributed buckets).

    Returns a 0-dim tensor of ``dtype`` on the tensors' device (``tensor(0.)`` on the CPU for
    an empty list, as PyTorch). NaN/Inf propagate. Launches: one per (bucket, dtype) group of
    the list plus one reduce (none for a one-dtype list without ``group``), whatever
    the number of tensors; no host sync.
    """
    p = check_norm_type(norm_type)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    prep = prepare(tensors, group, name="tensors", grads=False, write=False)
    return _norm_and_coef(*prep, p, dtype, None)[0]


def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None, *, group=None) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.get_total_norm``: the norm of ``tensors`` (e.g. the
    gradients) viewed as one vector; float32 result (see :func:`grad_norm`). ``foreach`` is
    accepted and ignored (the kernel is always multi-tensor). ``error_if_nonfinite=True``
    syncs the host to check the result."""
    _check_foreach(foreach)
    p = check_norm_type(norm_type)
    prep = prepare(tensors, group, name="tensors", grads=False, write=False)
    norm = _norm_and_coef(*prep, p, torch.float32, None)[0]
    if error_if_nonfinite:
        _raise_if_nonfinite(norm, p)
    return norm


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor,
                          foreach: bool | None = None, *, group=None) -> None:
    """Drop-in for ``torch.nn.utils.clip_grads_with_norm_``: scale every ``p.grad`` in place
    by ``clamp(max_norm / (total_norm + 1e-6), max=1)`` (computed on the device from
    ``total_norm``; float32 multiply, stored in each gradient's dtype). ``group`` only
    shapes ``parameters`` (a list of iterables when ``group`` is a list)."""
    _check_foreach(foreach)
    mn = check_max_norm(max_norm)
    if not isinstance(total_norm, torch.Tensor):
        raise TypeError(f"total_norm must be a torch.Tensor, got {type(total_norm).__name__}")
    _, device, plan, _keep = prepare(parameters, group, name="parameters", grads=True,
                                     write=True)
    if plan is None or not plan.launches:
        return
    coef = torch.clamp(mn / (total_norm.detach().to(device, torch.float32) + 1e-6), max=1.0)
    K.scale_(plan, coef.reshape(1))


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    group=None) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_``.

    Computes the total ``norm_type``-norm of the gradients of ``parameters`` (``None`` grads
    skipped) and scales them in place by ``clamp(max_norm / (total + 1e-6), max=1)``. The
    coefficient is computed on the device by the reduce kernel and read by the multi-tensor
    scaling kernel: no host sync unless ``error_if_nonfinite=True``. Launches: one
    partial-norm launch and one scaling launch per dtype in the list, one reduce (none for a
    one-dtype list without ``group``). Deferred expert weight gradients still pending
    (:mod:`linghe.bwd.deferred`) are computed into ``.grad`` first.

    Args:
        parameters: a tensor or an iterable of tensors (parameters), or a list of such
            iterables when ``group`` is a list (see the module docstring).
        max_norm: finite, >= 0.
        norm_type: ``p > 0``, ``inf`` or ``-inf``.
        error_if_nonfinite: raise ``RuntimeError`` (before scaling) if the norm is NaN/Inf.
        foreach: accepted for compatibility, ignored.
        group: distributed buckets (module docstring); DTensor grads use their own mesh.

    Returns the total norm (0-dim float32 tensor on the gradients' device; ``tensor(0.)``
    when there are no gradients, as PyTorch).
    """
    _check_foreach(foreach)
    mn = check_max_norm(max_norm)
    p = check_norm_type(norm_type)
    flush_deferred_wgrad()  # pending deferred expert gradients first (linghe.bwd.deferred)
    groups, device, plan, keep = prepare(parameters, group, name="parameters", grads=True,
                                         write=True)
    norm, coef = _norm_and_coef(groups, device, plan, keep, p, torch.float32, mn)
    if error_if_nonfinite:
        _raise_if_nonfinite(norm, p)
    if plan is not None and plan.launches:
        K.scale_(plan, coef)
    return norm
