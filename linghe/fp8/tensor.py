"""``Fp8Tensor``: a quantized tensor that still behaves like its high-precision self."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .. import reference as ref

_COMPONENTS = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")
SCALINGS = ("1x128", "128x128", "tensor")


class Fp8Tensor(torch.Tensor):
    """A tensor held as FP8 data plus float32 dequantization scales (``x ≈ q * scale``).

    Its logical ``shape``/``dtype``/``device`` are those of the high-precision tensor it
    stands for. Inside, with ``M`` the product of the leading dims and ``K`` the last dim:

    - ``rowwise_data [M, K]`` fp8 and ``rowwise_scale``: ``[M, ceil(K/128)]`` for
      ``scaling="1x128"`` (activations, gradients), ``[ceil(M/128), ceil(K/128)]`` for
      ``"128x128"`` (weights), a 1-element tensor for ``"tensor"``;
    - optionally ``columnwise_data [K, M]`` (the transpose, quantized on its own in groups
      along ``M``: not the transpose of the rowwise data) and ``columnwise_scale``
      (``[K, ceil(M/128)]`` for ``"1x128"``; the transposed block scales for ``"128x128"``).

    Any PyTorch op that linghe does not handle itself sees the dequantized tensor (the
    rowwise copy when present), so an ``Fp8Tensor`` is always safe to use as an ordinary
    tensor; in-place ops on it raise, since they would silently change a temporary.
    Gradients flowing back into it are ordinary tensors.
    """

    rowwise_data: torch.Tensor | None
    rowwise_scale: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale: torch.Tensor | None
    scaling: str

    @staticmethod
    def __new__(cls, shape, dtype, *, rowwise_data=None, rowwise_scale=None,
                columnwise_data=None, columnwise_scale=None, scaling="1x128",
                requires_grad=False):
        any_data = rowwise_data if rowwise_data is not None else columnwise_data
        if any_data is None:
            raise ValueError("Fp8Tensor needs rowwise_data or columnwise_data")
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=any_data.device, requires_grad=requires_grad
        )

    def __init__(self, shape, dtype, *, rowwise_data=None, rowwise_scale=None,
                 columnwise_data=None, columnwise_scale=None, scaling="1x128",
                 requires_grad=False):
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        if (rowwise_data is None) != (rowwise_scale is None):
            raise ValueError("rowwise_data and rowwise_scale come together")
        if (columnwise_data is None) != (columnwise_scale is None):
            raise ValueError("columnwise_data and columnwise_scale come together")
        self.rowwise_data = rowwise_data
        self.rowwise_scale = rowwise_scale
        self.columnwise_data = columnwise_data
        self.columnwise_scale = columnwise_scale
        self.scaling = scaling

    # ---------------------------------------------------------------- conversion
    def dequantize(self, columnwise: bool = False, dtype: torch.dtype | None = None):
        """The high-precision tensor (logical shape, ``dtype`` or the logical dtype).

        ``columnwise=True`` reads the columnwise copy (transposed back).
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
            out = self._dequant(self.columnwise_data, self.columnwise_scale).t()
        else:
            if self.rowwise_data is None:
                raise ValueError("this Fp8Tensor has no rowwise copy")
            out = self._dequant(self.rowwise_data, self.rowwise_scale)
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
        """A new ``Fp8Tensor`` sharing this one's components, some replaced."""
        kw = {n: getattr(self, n) for n in _COMPONENTS}
        kw.update(changes)
        return Fp8Tensor(self.shape, self.dtype, scaling=self.scaling, **kw)

    def __repr__(self, *, tensor_contents=None):
        parts = [c for c in ("rowwise", "columnwise") if getattr(self, c + "_data") is not None]
        data = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data
        return (f"Fp8Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"fp8={data.dtype}, scaling={self.scaling}, copies={'+'.join(parts)}, "
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
        names = [n for n in _COMPONENTS if getattr(self, n) is not None]
        return names, (self.scaling, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        scaling, dtype = ctx
        return Fp8Tensor(outer_size, dtype, scaling=scaling, **inner)


class _DequantizeST(torch.autograd.Function):
    """``Fp8Tensor.dequantize`` under autograd: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, t, columnwise, dtype):
        ctx.in_dtype = t.dtype
        return t._dequantize_impl(columnwise, dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.in_dtype), None, None
