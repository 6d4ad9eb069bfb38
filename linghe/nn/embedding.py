"""``linghe.nn.Embedding``: a drop-in for ``torch.nn.Embedding``'s common arguments."""

from __future__ import annotations

import torch

from ..functional.embedding import embedding, normalize_padding_idx


class Embedding(torch.nn.Module):
    """A lookup table ``weight [num_embeddings, embedding_dim]``; ``forward(tokens)`` is
    :func:`linghe.embedding` (sync-free deterministic backward, fused gradient
    accumulation into ``weight.grad``).

    Like ``torch.nn.Embedding`` (the same arguments, in the same order): one parameter
    ``weight`` initialized from N(0, 1) with the ``padding_idx`` row zeroed, so state
    dicts load either way. ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are not
    supported: only their defaults are accepted (``ValueError`` otherwise). Ids outside
    ``[0, num_embeddings)`` give zero rows (see :func:`linghe.embedding`; debug mode
    raises).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: torch.Tensor | None = None,
                 _freeze: bool = False, device=None, dtype=None):
        super().__init__()
        _check_unsupported(max_norm, scale_grad_by_freq, sparse)
        # (torch.nn.Embedding's attributes, for code that reads them)
        self.max_norm, self.norm_type = None, norm_type
        self.scale_grad_by_freq, self.sparse = False, False
        if int(num_embeddings) < 0 or int(embedding_dim) < 0:
            raise ValueError(f"num_embeddings and embedding_dim must be >= 0, got "
                             f"{num_embeddings}, {embedding_dim}")
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.padding_idx = normalize_padding_idx(padding_idx, self.num_embeddings)
        if _weight is None:
            self.weight = torch.nn.Parameter(
                torch.empty(self.num_embeddings, self.embedding_dim, device=device,
                            dtype=dtype), requires_grad=not _freeze)
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (self.num_embeddings, self.embedding_dim):
                raise ValueError(f"_weight must have shape ({self.num_embeddings}, "
                                 f"{self.embedding_dim}), got {tuple(_weight.shape)}")
            self.weight = torch.nn.Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding(tokens, self.weight, padding_idx=self.padding_idx)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        return s

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True,
                        padding_idx: int | None = None, max_norm: float | None = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = False) -> Embedding:
        """An ``Embedding`` whose weight is ``embeddings [V, H]`` (the tensor itself, as
        torch's ``from_pretrained``, with its arguments); ``freeze``: no gradient."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D [V, H], got shape "
                             f"{tuple(embeddings.shape)}")
        V, H = embeddings.shape
        return cls(V, H, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                   scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, _weight=embeddings,
                   _freeze=freeze)


def _check_unsupported(max_norm, scale_grad_by_freq, sparse) -> None:
    """``ValueError`` naming the first of torch's options set to other than its default."""
    for name, value, unset in (("max_norm", max_norm, max_norm is None),
                               ("scale_grad_by_freq", scale_grad_by_freq, not scale_grad_by_freq),
                               ("sparse", sparse, not sparse)):
        if not unset:
            raise ValueError(f"linghe.nn.Embedding does not support {name} (got {value!r}): "
                             "use torch.nn.Embedding for it")
