"""``Fp8Tensor``: a quantized tensor that still behaves like its high-precision self."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .. import reference as ref


def _tracing(t: torch.Tensor) -> bool:
    """Whether ``t`` is being traced (torch.compile, fake or functional tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or is_fake(t) or \
        torch._is_functional_tensor(t)

_COMPONENTS = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale",
               "col_segments")
SCALINGS = ("1x128", "128x128", "tensor")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Tensor(torch.Tensor):
    """A tensor held as FP8 data plus float32 dequantization scales (``x ≈ q * scale``).

    Its logical ``shape``/``dtype``/``device`` are those of the high-precision tensor it
    stands for. Inside, with ``M`` the product of the leading dims and ``K`` the last dim:

    - ``rowwise_data [M, K]`` fp8 and ``rowwise_scale``: ``[M, ceil(K/128)]`` for
      ``scaling="1x128"`` (activations, gradients), ``[ceil(M/128), ceil(K/128)]`` for
      ``"128x128"`` (weights), a 1-element tensor for ``"tensor"``;
    - optionally ``columnwise_data [K, M]`` (the transpose, quantized on its own in groups
      along ``M``: not the transpose of the rowwise data) and ``columnwise_scale``
      (``[K, ceil(M/128)]`` for ``"1x128"``; the transposed block scales for ``"128x128"``);
    - ``col_segments``: ``None`` (the columnwise 1x128 groups are rows ``128 g .. 128 g +
      127``), or, for a 2-D ``"1x128"`` tensor whose rows are grouped by expert
      (:mod:`linghe.layout`, e.g. from ``batch_silu_mul_quant``), the segment offsets
      ``[E + 1]`` int32 (device) that its columnwise groups follow: expert ``e``'s groups
      start at row ``offsets[e]`` every 128 rows and never cross ``offsets[e + 1]``, the
      rows from ``offsets[E]`` on form the groups after them, and ``columnwise_scale`` is
      ``[K, ceil(M/128) + E]`` (column ``g_off[e] + i`` for expert ``e``'s ``i``-th group,
      ``g_off`` the exclusive cumsum of ``ceil(segment/128)``).

    Component shapes, dtypes and devices are checked at construction (``ValueError``),
    so a tensor whose scales do not match its data cannot be built; ``dequantize`` reads
    every copy the way it was quantized (``col_segments`` included, on the device: no
    host sync).

    Any PyTorch op that linghe does not handle itself sees the dequantized tensor (the
    rowwise copy when present), so an ``Fp8Tensor`` is always safe to use as an ordinary
    tensor; in-place ops on it raise, since they would silently change a temporary.
    Gradients flowing back into it are ordinary tensors.
    """

    rowwise_data: torch.Tensor | None
    rowwise_scale: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale: torch.Tensor | None
    col_segments: torch.Tensor | None
    scaling: str
    _linghe_fp8 = True  # marker for linghe.utils.check_kernel_device (no import cycle)

    @staticmethod
    def __new__(cls, shape, dtype, *, rowwise_data=None, rowwise_scale=None,
                columnwise_data=None, columnwise_scale=None, scaling="1x128",
                col_segments=None, requires_grad=False):
        any_data = rowwise_data if rowwise_data is not None else columnwise_data
        if any_data is None:
            raise ValueError("Fp8Tensor needs rowwise_data or columnwise_data")
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=any_data.device, requires_grad=requires_grad
        )

    def __init__(self, shape, dtype, *, rowwise_data=None, rowwise_scale=None,
                 columnwise_data=None, columnwise_scale=None, scaling="1x128",
                 col_segments=None, requires_grad=False):
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        if (rowwise_data is None) != (rowwise_scale is None):
            raise ValueError("rowwise_data and rowwise_scale come together")
        if (columnwise_data is None) != (columnwise_scale is None):
            raise ValueError("columnwise_data and columnwise_scale come together")
        _check_components(self.shape, scaling, rowwise_data, rowwise_scale, columnwise_data,
                          columnwise_scale, col_segments)
        self.rowwise_data = rowwise_data
        self.rowwise_scale = rowwise_scale
        self.columnwise_data = columnwise_data
        self.columnwise_scale = columnwise_scale
        self.col_segments = col_segments
        self.scaling = scaling

    # ---------------------------------------------------------------- conversion
    def dequantize(self, columnwise: bool = False, dtype: torch.dtype | None = None):
        """The high-precision tensor (logical shape, ``dtype`` or the logical dtype).

        ``columnwise=True`` reads the columnwise copy (transposed back), following
        ``col_segments`` when its groups follow expert segments.
        """
        dtype = dtype or self.dtype
        if self.requires_grad and torch.is_grad_enabled():
            # Straight-through: gradients reach whatever produced this tensor.
            return _DequantizeST.apply(self, columnwise, dtype)
        return self._dequantize_impl(columnwise, dtype)

    def _dequantize_impl(self, columnwise: bool, dtype: torch.dtype):
        if columnwise:
            if self.columnwise_data is None:
                raise ValueError("this Fp8Tensor has no columnwise copy")
            if self.col_segments is not None:
                out = ref.dequantize_segment_columnwise(
                    self.columnwise_data, self.columnwise_scale, self.col_segments).t()
            else:
                out = self._dequant(self.columnwise_data, self.columnwise_scale).t()
        else:
            if self.rowwise_data is None:
                raise ValueError("this Fp8Tensor has no rowwise copy")
            q = self.rowwise_data
            if (self.scaling == "1x128" and q.is_cuda and q.dim() == 2
                    and q.dtype == torch.float8_e4m3fn and q.stride(-1) == 1
                    and self.rowwise_scale.dtype == torch.float32
                    and self.rowwise_scale.stride(-1) == 1 and not _tracing(q)):
                # One kernel (the reference's math) instead of a chain of torch ops (which
                # stay the path while torch.compile traces: a kernel has no fake form).
                from .quantize import dequantize_1x128_rows

                return dequantize_1x128_rows(q, self.rowwise_scale, dtype).reshape(self.shape)
            out = self._dequant(q, self.rowwise_scale)
        return out.reshape(self.shape).to(dtype)

    def _dequant(self, q, scale):
        if self.scaling == "1x128":
            return ref.dequantize_1x128(q, scale)
        if self.scaling == "128x128":
            return ref.dequantize_128x128(q, scale)
        return q.float() * scale.float().reshape(())

    def _high_precision(self):
        return self.dequantize(columnwise=self.rowwise_data is None)

    def with_components(self, **changes) -> Fp8Tensor:
        """A new ``Fp8Tensor`` sharing this one's components, some replaced (checked as at
        construction). Replacing the columnwise copy drops ``col_segments`` unless it is
        given too: a new copy is assumed to have plain groups."""
        unknown = set(changes) - set(_COMPONENTS)
        if unknown:
            raise TypeError(f"with_components takes {_COMPONENTS}, got {sorted(unknown)}")
        kw = {n: getattr(self, n) for n in _COMPONENTS}
        if ("columnwise_data" in changes or "columnwise_scale" in changes) and \
                "col_segments" not in changes:
            kw["col_segments"] = None
        kw.update(changes)
        return Fp8Tensor(self.shape, self.dtype, scaling=self.scaling, **kw)

    def __repr__(self, *, tensor_contents=None):
        parts = [c for c in ("rowwise", "columnwise") if getattr(self, c + "_data") is not None]
        data = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data
        seg = ", col_segments" if self.col_segments is not None else ""
        return (f"Fp8Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"fp8={data.dtype}, scaling={self.scaling}, copies={'+'.join(parts)}{seg}, "
                f"device={self.device})")

    # ---------------------------------------------------------------- dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return args[0].with_components()
        if func._schema.is_mutable:
            mutated = [a.name for a in func._schema.arguments
                       if a.alias_info is not None and a.alias_info.is_write]
            bound = dict(zip([a.name for a in func._schema.arguments], args))
            bound.update(kwargs)
            if any(isinstance(bound.get(n), Fp8Tensor) for n in mutated):
                raise RuntimeError(f"{func} would modify an Fp8Tensor in place; Fp8Tensor is "
                                   "read-only: call .dequantize() for a writable copy")

        def unwrap(t):
            return t._high_precision() if isinstance(t, Fp8Tensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    # torch.compile support (traceable wrapper subclass protocol)
    def __tensor_flatten__(self):
        names = [n for n in _COMPONENTS if getattr(self, n) is not None]  # col_segments too
        return names, (self.scaling, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        scaling, dtype = ctx
        return Fp8Tensor(outer_size, dtype, scaling=scaling, **inner)


def _check_components(shape, scaling, q, s, qt, st, segments) -> None:
    """Shapes, dtypes and devices of the components against the logical ``shape``
    (``ValueError``/``TypeError`` naming the component): a mismatch here would otherwise
    surface as silently wrong values in ``dequantize`` or a GEMM."""
    if len(shape) < 1:
        raise ValueError("Fp8Tensor needs a shape with at least one dimension")
    K = shape[-1]
    M = 1
    for d in shape[:-1]:
        M *= d
    if scaling == "1x128":
        want_s, want_st = (M, _cdiv(K, 128)), (K, _cdiv(M, 128))
    elif scaling == "128x128":
        want_s, want_st = (_cdiv(M, 128), _cdiv(K, 128)), (_cdiv(K, 128), _cdiv(M, 128))
    else:
        want_s = want_st = None  # one scale
    dev = (q if q is not None else qt).device
    for name, data, scale, want_d, want in (("rowwise", q, s, (M, K), want_s),
                                            ("columnwise", qt, st, (K, M), want_st)):
        if data is None:
            continue
        if data.dtype not in _FP8_DTYPES:
            raise TypeError(f"{name}_data must be float8_e4m3fn or float8_e5m2, got "
                            f"{data.dtype}")
        if scale.dtype != torch.float32:
            raise TypeError(f"{name}_scale must be float32, got {scale.dtype}")
        if data.device != dev or scale.device != dev:
            raise ValueError(f"{name}_data and {name}_scale must be on {dev}, got "
                             f"{data.device} and {scale.device}")
        if tuple(data.shape) != want_d:
            raise ValueError(f"{name}_data must have shape {want_d} for an Fp8Tensor of "
                             f"shape {tuple(shape)}, got {tuple(data.shape)}")
        if name == "columnwise" and segments is not None:
            continue  # checked with col_segments below
        if want is None:
            if scale.numel() != 1:
                raise ValueError(f"{name}_scale must hold one scale for scaling='tensor', "
                                 f"got shape {tuple(scale.shape)}")
        elif tuple(scale.shape) != want:
            raise ValueError(f"{name}_scale must have shape {want} for {scaling} scaling of "
                             f"shape {tuple(shape)}, got {tuple(scale.shape)}")
    if segments is None:
        return
    if scaling != "1x128" or len(shape) != 2 or qt is None:
        raise ValueError("col_segments describes the columnwise copy of a 2-D '1x128' "
                         "Fp8Tensor: it needs scaling='1x128', 2 dims and columnwise_data")
    if not isinstance(segments, torch.Tensor) or segments.dim() != 1 or \
            segments.numel() < 2 or segments.dtype not in (torch.int32, torch.int64):
        raise ValueError("col_segments must be a 1-D int32/int64 tensor of segment offsets "
                         "[E + 1] (E >= 1)")
    if segments.device != dev:
        raise ValueError(f"col_segments must be on {dev}, got {segments.device}")
    want = (K, _cdiv(M, 128) + segments.numel() - 1)
    if tuple(st.shape) != want:
        raise ValueError(f"columnwise_scale must have shape {want} (ceil(M/128) + E groups) "
                         f"with col_segments of {segments.numel() - 1} experts, got "
                         f"{tuple(st.shape)}")


class _DequantizeST(torch.autograd.Function):
    """``Fp8Tensor.dequantize`` under autograd: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, t, columnwise, dtype):
        ctx.in_dtype = t.dtype
        return t._dequantize_impl(columnwise, dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.in_dtype), None, None
