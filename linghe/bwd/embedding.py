"""Token embedding backward: ``dW[v] = sum of grad[t] over the tokens t with id v``,
deterministic and without a host sync, fresh or added into an existing ``.grad``.

1. ``_embedding_key_kernel``: each token's sort key, its id as int32, or ``V`` for a
   token that gets no gradient (id outside ``[0, V)`` or ``padding_idx``): those sort
   last.
2. ``torch.sort(keys, stable=True)`` on the device (fixed size, no sync): the tokens of
   one id become a run of consecutive sorted positions, in token order.
3. ``_embedding_chunk_kernel``: the sorted positions are cut into chunks of ``CHUNK``; a
   program takes one chunk and ``BH`` columns and walks the chunk's rows in sorted
   order (an unrolled loop that gathers each row, through the sort's permutation, 4
   rows before it is used, and reads the keys 8 rows ahead), keeping the running sum
   of the current run of equal ids. A run that starts and ends inside the chunk is
   written to ``dW`` (added to the existing row when accumulating); the part of a run
   that crosses the chunk's start or end is written to a float64 scratch row instead:
   ``part[c, 0]`` for the run the chunk starts inside of, ``part[c, 1]`` for the run it
   ends inside of that started in it.
4. ``_embedding_combine_kernel``: the chunk in which a crossing run starts adds its
   ``part[c, 1]`` and the ``part[c + j, 0]`` of the chunks the run continues into (all
   chunks whose first key is the run's id), then writes the row. Every row of ``dW`` is
   written by exactly one program, in a fixed order of additions: the same bits on
   every run. A frequent id (a byte-level space) costs its chunks, not one program's
   serial walk over all its tokens.

Sums are taken in **float64** and rounded once to ``dW``'s dtype (through float32, as
torch's float64 -> bfloat16 conversion does); when accumulating, the existing ``.grad``
row is added in the same float64 sum. A float64 sum of ``n`` bf16 values is exact
(so independent of the order of an id's tokens: the same bits when the batch is
shuffled) while, in one column, the id's nonzero values, with the ``.grad`` value, lie
within a factor of about ``2^(45 - log2 n)`` of each other (``2^32`` for 8192 tokens;
fp16: ``2^(42 - log2 n)``, float32: ``2^(29 - log2 n)``); beyond that it is still
deterministic for a given token order. Rows that no token touches are never read or
written (accumulating) or stay the zeros of the fresh buffer.

Bytes: the gradient rows once, plus per touched row one write (fresh; plus the
``V x H`` zero fill) or one read and one write (accumulating), plus the crossing runs'
float64 scratch rows (at most ``2 x cdiv(N, CHUNK)`` rows of ``BH``-column pieces).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv, device_guard, empty, launch

#: Sorted positions per program of ``_embedding_chunk_kernel``, and columns per program.
CHUNK = 32
BLOCK_H = 512
NUM_WARPS = 2
#: ``_embedding_combine_kernel``: chunks looked at per step when a run spans several
#: chunks, and columns per program.
COMBINE_BJ = 8
COMBINE_BH = 256
#: Keys per program of ``_embedding_key_kernel``.
KEY_BLOCK = 1024


@triton.jit
def _embedding_key_kernel(tok_ptr, key_ptr, N, V, pad, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    t = tl.load(tok_ptr + offs, mask=m, other=0).to(tl.int64)
    drop = (t < 0) | (t >= V) | (t == pad)
    tl.store(key_ptr + offs, tl.where(drop, V, t).to(tl.int32), mask=m)


@triton.jit
def _cols_if(cmask, cond):
    """``cmask & cond`` for a scalar ``cond`` (the triton 3.9 interpreter turns ``&`` of a
    vector and a scalar mask into int32, which a load or store refuses)."""
    return tl.where(cond, cmask, False)


@triton.jit
def _round_store(ptr, acc, mask):
    # float64 -> float32 -> dtype: the rounding torch's float64 -> bf16/fp16 casts make
    tl.store(ptr, acc.to(tl.float32).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _meta(key_ptr, order_ptr, p, N, V):
    """Sorted position ``p``'s key (``V`` past the end) and source token."""
    valid = p < N
    return (tl.load(key_ptr + p, mask=valid, other=V),
            tl.load(order_ptr + p, mask=valid, other=0))


@triton.jit
def _data(g_ptr, dw_ptr, key, nxt, src, V, H, stride_g, cols, cmask, ACCUM: tl.constexpr):
    """A sorted position's gradient row (key ``key``, source token ``src``) and, when
    accumulating and its run ends there (``nxt`` differs), the existing ``dW`` row."""
    ok = key < V
    g = tl.load(g_ptr + src * stride_g + cols, mask=_cols_if(cmask, ok), other=0.0)
    if ACCUM:
        old = tl.load(dw_ptr + key.to(tl.int64) * H + cols,
                      mask=_cols_if(cmask, ok & (key != nxt)), other=0.0)
    else:
        old = g  # (unused)
    return g, old


@triton.jit
def _embedding_chunk_kernel(key_ptr, order_ptr, g_ptr, dw_ptr, part_ptr, N, V, H, stride_g,
                            C: tl.constexpr, BH: tl.constexpr, ACCUM: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cmask = cols < H
    p0 = c * C
    # Unrolled over the chunk's rows. The compiler may not move a load above the dW
    # stores of the rows before (it cannot tell that they do not alias), so the loads
    # are issued ahead by hand: keys and source tokens 8 rows ahead, gradient (and old
    # dW) rows 4 rows ahead of their use. Window at step r: keys/sources of rows
    # r .. r+7 in (ka, sa) .. (kh, sh), data of rows r .. r+3 in d0 .. d3.
    ka, sa = _meta(key_ptr, order_ptr, p0, N, V)
    kb, sb = _meta(key_ptr, order_ptr, p0 + 1, N, V)
    kc, sc = _meta(key_ptr, order_ptr, p0 + 2, N, V)
    kd, sd = _meta(key_ptr, order_ptr, p0 + 3, N, V)
    ke, se = _meta(key_ptr, order_ptr, p0 + 4, N, V)
    kf, sf = _meta(key_ptr, order_ptr, p0 + 5, N, V)
    kg, sg = _meta(key_ptr, order_ptr, p0 + 6, N, V)
    kh, sh = _meta(key_ptr, order_ptr, p0 + 7, N, V)
    g0, o0 = _data(g_ptr, dw_ptr, ka, kb, sa, V, H, stride_g, cols, cmask, ACCUM)
    g1, o1 = _data(g_ptr, dw_ptr, kb, kc, sb, V, H, stride_g, cols, cmask, ACCUM)
    g2, o2 = _data(g_ptr, dw_ptr, kc, kd, sc, V, H, stride_g, cols, cmask, ACCUM)
    g3, o3 = _data(g_ptr, dw_ptr, kd, ke, sd, V, H, stride_g, cols, cmask, ACCUM)
    prev = tl.load(key_ptr + p0 - 1, mask=p0 > 0, other=-1)
    has_head = (ka == prev) & (ka < V)  # the chunk starts inside a run (with a gradient)
    head = has_head
    acc = tl.zeros([BH], dtype=tl.float64)
    head_acc = acc
    for r in tl.static_range(C):
        if r + 8 <= C:  # the key of row C is the last one needed (row C-1's next)
            ki, si = _meta(key_ptr, order_ptr, p0 + r + 8, N, V)
        else:
            ki, si = kh, sh  # (unused)
        if r + 4 < C:
            g4, o4 = _data(g_ptr, dw_ptr, ke, kf, se, V, H, stride_g, cols, cmask, ACCUM)
        else:
            g4, o4 = g3, o3  # (unused)
        key, nxt = ka, kb
        valid = p0 + r < N
        start = valid & (key != prev)  # a run of equal keys starts here (keys are >= 0)
        end = valid & (key != nxt)     # ... and ends here
        ok = valid & (key < V)         # a token that has a gradient
        acc = tl.where(start, g0.to(tl.float64), acc + g0.to(tl.float64))
        head = head & ~start
        head_acc = tl.where(head, acc, head_acc)
        # a whole run ends here: write (or add into) its dW row
        done = ok & end & ~head
        row = dw_ptr + key.to(tl.int64) * H + cols
        if ACCUM:
            _round_store(row, acc + o0.to(tl.float64), _cols_if(cmask, done))
        else:
            _round_store(row, acc, _cols_if(cmask, done))
        tail = ok & ~head & ~end  # (after the last row: the run continues past the chunk)
        prev = key
        ka, kb, kc, kd, ke, kf, kg, kh = kb, kc, kd, ke, kf, kg, kh, ki
        sa, sb, sc, sd, se, sf, sg, sh = sb, sc, sd, se, sf, sg, sh, si
        g0, g1, g2, g3 = g1, g2, g3, g4
        o0, o1, o2, o3 = o1, o2, o3, o4
    # the partial sums of the runs crossing the chunk's start (part[c, 0]) and end
    part0 = part_ptr + (c * 2) * H + cols
    tl.store(part0, head_acc, mask=_cols_if(cmask, has_head))
    tl.store(part0 + H, acc, mask=_cols_if(cmask, tail))


@triton.jit
def _embedding_combine_kernel(key_ptr, dw_ptr, part_ptr, N, V, H, C: tl.constexpr,
                              BJ: tl.constexpr, BH: tl.constexpr, ACCUM: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cmask = cols < H
    nxt_pos = c * C + C
    if nxt_pos < N:
        key = tl.load(key_ptr + nxt_pos - 1)
        nxt = tl.load(key_ptr + nxt_pos)
        before = tl.load(key_ptr + c * C - 1, mask=c > 0, other=-1)
        # the chunk's last run continues into the next chunk and started in this one
        if (key == nxt) & (key != before) & (key < V):
            acc = tl.load(part_ptr + (c * 2 + 1) * H + cols, mask=cmask, other=0.0)
            j = c + 1
            go = key == nxt
            while go:
                js = j + tl.arange(0, BJ)
                jm = js * C < N
                firsts = tl.load(key_ptr + js * C, mask=jm, other=-1)
                match = jm & (firsts == key)
                p = tl.load(part_ptr + (js * 2)[:, None] * H + cols[None, :],
                            mask=match[:, None] & cmask[None, :], other=0.0)
                acc += tl.sum(p, axis=0)
                go = tl.sum(match.to(tl.int32), axis=0) == BJ
                j += BJ
            row = dw_ptr + key.to(tl.int64) * H + cols
            if ACCUM:
                acc += tl.load(row, mask=cmask, other=0.0).to(tl.float64)
            _round_store(row, acc, cmask)


def sort_keys(tokens: torch.Tensor, num_embeddings: int,
              padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted keys [N] int32, order [N] int64)``: each token's id, or ``V`` for one
    without a gradient, sorted stably on the device (``keys[order] == sorted``)."""
    N = tokens.shape[0]
    keys = empty(N, dtype=torch.int32, device=tokens.device)
    with device_guard(tokens):
        launch(_embedding_key_kernel, (cdiv(N, KEY_BLOCK),), tokens, keys, N, num_embeddings,
               -1 if padding_idx is None else padding_idx, BLOCK=KEY_BLOCK, num_warps=4)
    return torch.sort(keys, stable=True)


def _launch(dw: torch.Tensor, tokens: torch.Tensor, grad: torch.Tensor,
            padding_idx: int | None, accumulate: bool) -> None:
    N = tokens.shape[0]
    V, H = dw.shape
    # everything that allocates (and may fail) runs before the first write into dw
    sorted_keys, order = sort_keys(tokens, V, padding_idx)
    C, BH = CHUNK, BLOCK_H
    assert C >= 4, "CHUNK must be at least 4 (the kernel loads 4 rows ahead)"
    n_chunks = cdiv(N, C)
    # scratch rows, read only where written
    part = empty(n_chunks * 2 * H, dtype=torch.float64, device=dw.device)
    with device_guard(dw):
        launch(_embedding_chunk_kernel, (n_chunks, cdiv(H, BH)), sorted_keys, order, grad, dw,
               part, N, V, H, grad.stride(0), C=C, BH=BH, ACCUM=accumulate,
               num_warps=NUM_WARPS)
        if n_chunks > 1:
            launch(_embedding_combine_kernel, (n_chunks, cdiv(H, COMBINE_BH)), sorted_keys, dw,
                   part, N, V, H, C=C, BJ=COMBINE_BJ, BH=COMBINE_BH, ACCUM=accumulate,
                   num_warps=4)


def _check_launch(dw, tokens, grad):
    V, H = dw.shape
    # (the column stride of rows of 0 or 1 element is never used: torch calls such a
    # tensor contiguous whatever it is, so .contiguous() does not make it 1)
    if (grad.dim() != 2 or grad.shape != (tokens.shape[0], H)
            or (H > 1 and grad.stride(1) != 1)):
        raise ValueError(f"grad must be [N={tokens.shape[0]}, H={H}] with contiguous rows, "
                         f"got shape {tuple(grad.shape)} strides {grad.stride()}")
    if V >= 2**31 - 1:
        raise ValueError(f"num_embeddings must be < 2^31 - 1, got {V}")


def embedding_bwd(tokens: torch.Tensor, grad: torch.Tensor, num_embeddings: int,
                  padding_idx: int | None, dtype: torch.dtype) -> torch.Tensor:
    """A fresh ``dW [V, H]`` in ``dtype``: zeros, then the touched rows written.

    ``tokens [N]`` int32/int64 contiguous, ``grad [N, H]`` float (rows contiguous);
    tokens with an id outside ``[0, V)`` or equal to ``padding_idx`` contribute nothing."""
    dw = torch.zeros(num_embeddings, grad.shape[1], dtype=dtype, device=grad.device)
    _check_launch(dw, tokens, grad)
    if tokens.shape[0] and grad.shape[1]:
        _launch(dw, tokens, grad, padding_idx, accumulate=False)
    return dw


def embedding_bwd_accumulate_(dw: torch.Tensor, tokens: torch.Tensor, grad: torch.Tensor,
                              padding_idx: int | None) -> torch.Tensor:
    """Add this backward's gradient into ``dw [V, H]`` (contiguous, float) in place: each
    touched row gets ``round(dw[v] + sum)`` with the sum and the add in float64, one
    rounding; untouched rows are not read or written. Returns ``dw``."""
    if not dw.is_contiguous() or dw.dim() != 2:
        raise ValueError(f"dw must be a contiguous [V, H] tensor, got shape "
                         f"{tuple(dw.shape)} strides {dw.stride()}")
    _check_launch(dw, tokens, grad)
    if tokens.shape[0] and grad.shape[1]:
        _launch(dw, tokens, grad, padding_idx, accumulate=True)
    return dw
