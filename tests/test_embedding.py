"""Token embedding (linghe.embedding, linghe.nn.Embedding): the gather forward, the sorted
deterministic backward (fresh and accumulating into .grad), torch.compile, the module."""

import pytest
import torch

import linghe
from linghe import reference as ref
from linghe.bwd import accumulate
from linghe.bwd import embedding as bwd_emb
from linghe.testing import as_stored

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# every tensor and module here is made on the test device (CUDA on a GPU machine)
pytestmark = pytest.mark.usefixtures("on_test_device")


@pytest.fixture(params=[4, 32], ids=["chunk4", "chunk32"])
def chunk(request, monkeypatch):
    """The backward's chunk of sorted positions: 4 (with a 2-chunk combine step and
    column blocks of 64 / 32) makes runs of one id cross chunk boundaries and span many
    chunks, and rows span several column blocks, at these small shapes; 32 is the
    default."""
    monkeypatch.setattr(bwd_emb, "CHUNK", request.param)
    if request.param == 4:
        monkeypatch.setattr(bwd_emb, "COMBINE_BJ", 2)
        monkeypatch.setattr(bwd_emb, "BLOCK_H", 64)
        monkeypatch.setattr(bwd_emb, "COMBINE_BH", 32)
    return request.param


def _rounded(sum64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 sum rounded once to ``dtype`` as the kernel stores it (through float32),
    back in ``dtype``."""
    return as_stored(sum64.float(), dtype).to(dtype)


def _tokens(shape, V, dtype=torch.int64, hot=None):
    """Random ids in ``[0, V)`` with many duplicates (``hot``: the first ids are drawn
    from ``[0, hot)`` only)."""
    t = torch.randint(0, V, shape)
    if hot is not None:
        flat = t.view(-1)
        flat[: flat.numel() // 2] = torch.randint(0, hot, (flat.numel() // 2,))
    return t.to(dtype)


def _weight(V, H, dtype):
    return torch.nn.Parameter(torch.randn(V, H).to(dtype))


def _same(a, b, name):
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max()}"


SHAPES = [(37,), (3, 5), (1,), (0,), (2, 0, 3), (6, 41)]


# GPU subset: float16 shares bfloat16's code path but for the element conversion; (6, 41)
# repeats the many-token path of (37,), (2, 0, 3) the empty one of (0,).
@pytest.mark.gpu_subset(dtype=[torch.float32, torch.bfloat16],
                        shape=[(37,), (3, 5), (1,), (0,)])
@pytest.mark.parametrize("tok_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_torch(dtype, shape, tok_dtype):
    V, H = 13, 33
    w = torch.randn(V, H).to(dtype)
    t = _tokens(shape, V, tok_dtype)
    out = linghe.embedding(t, w)
    _same(out, torch.nn.functional.embedding(t, w), "out")
    assert out.shape == (*shape, H)


def test_forward_strided_inputs():
    V, H = 20, 48
    base = torch.randn(H, V)
    w = base.t()  # column stride 1 is missing: copied first
    t = _tokens((9, 4), V).t()  # non-contiguous ids
    _same(linghe.embedding(t, w), torch.nn.functional.embedding(t, w), "out")
    w2 = torch.randn(V, 2 * H)[:, :H]  # row stride 2H
    _same(linghe.embedding(t, w2), torch.nn.functional.embedding(t, w2), "out")


def test_out_of_range_ids():
    V, H = 9, 24
    w = _weight(V, H, torch.float32)
    t = torch.tensor([3, -1, 9, 2**40, 3, 8, -(2**40)])
    out = linghe.embedding(t, w)
    bad = torch.tensor([False, True, True, True, False, False, True])
    _same(out[~bad], w.detach()[t[~bad]], "in range")
    assert torch.equal(out[bad], torch.zeros(int(bad.sum()), H))
    _same(out, ref.embedding(t, w.detach()), "reference")
    g = torch.randn(t.shape[0], H)
    out.backward(g)
    _same(w.grad, _rounded(ref.embedding_backward(t, g, V), torch.float32), "grad")
    linghe.set_debug(True)
    try:
        with pytest.raises(ValueError, match="tokens must be in"):
            linghe.embedding(t, w)
    finally:
        linghe.set_debug(False)


def test_bad_inputs():
    w = torch.randn(10, 8)
    t = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="tokens"):
        linghe.embedding(t.float(), w)
    with pytest.raises(TypeError, match="weight"):
        linghe.embedding(t, w.double())
    with pytest.raises(ValueError, match="weight"):
        linghe.embedding(t, w.view(-1))
    with pytest.raises(ValueError, match="padding_idx"):
        linghe.embedding(t, w, padding_idx=10)
    with pytest.raises(ValueError, match="padding_idx"):
        linghe.embedding(t, w, padding_idx=-11)
    with pytest.raises(TypeError, match="padding_idx"):
        linghe.embedding(t, w, padding_idx=1.0)


# (tokens shape, V, H, hot ids, padding_idx)
BWD_CASES = [
    ((37,), 13, 33, 3, None),     # many duplicates, H not a multiple of 16
    ((6, 41), 300, 20, 2, 1),     # 2-D tokens, rows never touched, one id ~120 times
    ((5, 7), 50, 130, None, -1),  # H over 2 column blocks, padding_idx from the end
    ((1,), 7, 16, None, None),    # a single token
    ((0,), 7, 16, None, 0),       # no tokens: a zero gradient
    ((64,), 4, 8, 1, 2),          # every token of one chunk the same id
]


@pytest.mark.gpu_subset(dtype=[torch.float32, torch.bfloat16])  # (float16: as above)
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"{c[0]}-V{c[1]}-H{c[2]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_reference(dtype, case, chunk):
    shape, V, H, hot, pad = case
    w = _weight(V, H, dtype)
    t = _tokens(shape, V, hot=hot)
    if pad is not None and t.numel():
        t.view(-1)[::5] = pad % V  # some padding tokens
    out = linghe.embedding(t, w, padding_idx=pad)
    _same(out, ref.embedding(t, w.detach(), pad), "out")
    g = torch.randn(out.shape).to(dtype)
    out.backward(g)
    expect = ref.embedding_backward(t, g, V, pad)
    _same(w.grad, _rounded(expect, dtype), "dw")
    touched = torch.zeros(V, dtype=torch.bool)
    touched[t.reshape(-1)] = True
    if pad is not None:
        touched[pad % V] = False
        assert torch.equal(w.grad[pad % V], torch.zeros(H, dtype=dtype))
    assert torch.equal(w.grad[~touched], torch.zeros(int((~touched).sum()), H, dtype=dtype))
    # against torch's own backward (float64, padding_idx as torch handles it)
    w64 = w.detach().double().requires_grad_()
    torch.nn.functional.embedding(t, w64, padding_idx=pad).backward(g.double())
    _same(w.grad, _rounded(w64.grad, dtype), "dw vs torch")


def test_backward_non_contiguous_grad():
    V, H = 17, 24
    w = _weight(V, H, torch.bfloat16)
    t = _tokens((5, 6), V, hot=2)
    out = linghe.embedding(t, w)
    g = torch.randn(6, 5, H).to(torch.bfloat16)
    out.backward(g.transpose(0, 1))  # rows not contiguous
    _same(w.grad, _rounded(ref.embedding_backward(t, g.transpose(0, 1), V), torch.bfloat16),
          "dw")
    w.grad = None
    linghe.embedding(t, w).sum().backward()  # an expanded (stride 0) gradient
    _same(w.grad, _rounded(ref.embedding_backward(t, torch.ones(5, 6, H), V), torch.bfloat16),
          "dw of sum")


@pytest.mark.parametrize("H", [1, 0])
def test_backward_rows_of_one_or_no_element(H):
    """H = 1: a gradient whose column stride is not 1 (torch calls it contiguous, so
    .contiguous() keeps it) is accepted, eager and compiled; H = 0: the gradient of a
    sum (an expanded empty tensor)."""
    V = 7
    w = _weight(V, H, torch.float32)
    t = torch.tensor([3, 1, 3, 6, 0, 3])
    # H = 1: strides (1, 6); H = 0: strides (0, 0)
    g = torch.randn(H, 6).t() if H else torch.zeros(()).expand(6, 0)
    linghe.embedding(t, w).backward(g)
    _same(w.grad, _rounded(ref.embedding_backward(t, g, V), torch.float32), "dw")
    compiled = torch.compile(lambda tok, wt: linghe.embedding(tok, wt), fullgraph=True,
                             backend="aot_eager")
    (dw,) = torch.autograd.grad(compiled(t, w), w, g)
    _same(dw, _rounded(ref.embedding_backward(t, g, V), torch.float32), "compiled dw")


def test_backward_deterministic_under_shuffle(chunk):
    """The same bits on every run, and when the tokens (with their gradient rows) come in
    another order: the float64 sums of bf16 rows are exact."""
    V, H, N = 40, 72, 101
    t = _tokens((N,), V, hot=3)
    g = (torch.randn(N, H) * torch.logspace(-6, 6, H)).to(torch.bfloat16)
    w = _weight(V, H, torch.bfloat16)

    def grad_of(tok, gr):
        (dw,) = torch.autograd.grad(linghe.embedding(tok, w), w, gr)
        return dw

    a = grad_of(t, g)
    _same(grad_of(t, g), a, "second run")
    for _ in range(3):
        perm = torch.randperm(N)
        _same(grad_of(t[perm], g[perm]), a, "shuffled")


@pytest.mark.parametrize("pad", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulates_in_place(dtype, pad, monkeypatch, fused_on, chunk, count_calls):
    """From the second micro-batch on the kernel adds into .grad (the same tensor storage
    throughout): each touched row is round(grad + float64 sum), others are untouched."""
    V, H = 60, 40
    w = _weight(V, H, dtype)
    toks = [_tokens((3, 11), 20, hot=2), _tokens((29,), V, hot=4), _tokens((0,), V),
            _tokens((1,), V)]
    gs = [torch.randn(*t.shape, H).to(dtype) for t in toks]
    calls = count_calls(bwd_emb, "embedding_bwd_accumulate_")
    ptrs = []
    expect = None
    for t, g in zip(toks, gs):
        linghe.embedding(t, w, padding_idx=pad).backward(g)
        ptrs.append(w.grad.data_ptr())
        s = ref.embedding_backward(t, g, V, pad)
        expect = _rounded(s if expect is None else expect.double() + s, dtype)
        _same(w.grad, expect, "accumulated dw")
    assert len(calls) == len(toks) - 1 and len(set(ptrs)) == 1

    # the plain path (a fresh gradient each time, AccumulateGrad adds it)
    accumulate.set_fused_grad_accumulation(False)
    w2 = _weight(V, H, dtype)
    plain = None
    for t, g in zip(toks, gs):
        linghe.embedding(t, w2, padding_idx=pad).backward(g)
        step = _rounded(ref.embedding_backward(t, g, V, pad), dtype)
        plain = step if plain is None else plain + step
    assert len(calls) == len(toks) - 1
    _same(w2.grad, plain, "plain dw")


def test_accumulate_leaves_other_rows(monkeypatch, fused_on, count_calls):
    """Rows of .grad that the batch does not touch (the padding row too) keep their
    values, whatever they are."""
    V, H = 30, 24
    w = _weight(V, H, torch.bfloat16)
    w.grad = torch.randn(V, H).to(torch.bfloat16)
    before = w.grad.clone()
    t = torch.tensor([[4, 4, 7], [2, 4, 5]])
    calls = count_calls(bwd_emb, "embedding_bwd_accumulate_")
    g = torch.randn(2, 3, H).to(torch.bfloat16)
    linghe.embedding(t, w, padding_idx=5).backward(g)
    assert len(calls) == 1
    expect = _rounded(before.double() + ref.embedding_backward(t, g, V, 5), torch.bfloat16)
    _same(w.grad, expect, "dw")
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[[2, 4, 7]] = False
    _same(w.grad[untouched], before[untouched], "untouched rows")


def test_autograd_grad_leaves_dot_grad(monkeypatch, fused_on, count_calls):
    """torch.autograd.grad returns this backward's gradient and leaves .grad alone; a
    tensor hook sees each backward's own gradient (no fused accumulation)."""
    V, H = 25, 16
    w = _weight(V, H, torch.bfloat16)
    t1, t2 = _tokens((19,), V, hot=2), _tokens((2, 7), V, hot=3)
    g1, g2 = torch.randn(19, H).to(torch.bfloat16), torch.randn(2, 7, H).to(torch.bfloat16)
    calls = count_calls(bwd_emb, "embedding_bwd_accumulate_")
    linghe.embedding(t1, w).backward(g1)
    before = w.grad.clone()
    (dw,) = torch.autograd.grad(linghe.embedding(t2, w), w, g2)
    assert not calls
    _same(w.grad, before, ".grad")
    _same(dw, _rounded(ref.embedding_backward(t2, g2, V), torch.bfloat16), "autograd.grad dw")

    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))
    linghe.embedding(t2, w).backward(g2)
    assert not calls
    _same(seen[0], dw, "hook grad")
    _same(w.grad, before + dw, "hooked dw")


def test_double_backward_in_grad_output(fused_on):
    """With create_graph the weight gradient stays differentiable in grad_output (as
    torch's): d<dW, c>/d grad is c[tokens], zero for padding and out-of-range tokens."""
    V, H = 9, 12
    w = _weight(V, H, torch.float32)
    w.grad = torch.randn(V, H)  # (no fused accumulation under create_graph)
    before = w.grad.clone()
    t = torch.tensor([[1, 4, 1, 2], [11, 4, -1, 8]])
    g = torch.randn(2, 4, H, requires_grad=True)
    c = torch.randn(V, H, requires_grad=True)
    out = linghe.embedding(t, w, padding_idx=2)
    (dw,) = torch.autograd.grad(out, w, g, create_graph=True)
    _same(dw.detach(), _rounded(ref.embedding_backward(t, g.detach(), V, 2), torch.float32),
          "dw")
    (dw * c).sum().backward(retain_graph=True)
    valid = (t >= 0) & (t < V) & (t != 2)
    expect = torch.where(valid.unsqueeze(-1), c.detach()[t.clamp(0, V - 1)], 0.0)
    _same(g.grad, expect, "d/d grad_output")
    _same(c.grad, dw.detach(), "d/dc")
    _same(w.grad, before, "w.grad untouched by autograd.grad")
    # a second order: the gather of the gradient of dW is differentiable too
    (gg,) = torch.autograd.grad((dw * c).sum(), g, create_graph=True)
    (gc,) = torch.autograd.grad((gg * g.detach()).sum(), c)
    _same(gc, _rounded(ref.embedding_backward(t, g.detach(), V, 2), torch.float32),
          "third order")


def test_weight_without_grad():
    w = torch.randn(12, 8)
    t = _tokens((5,), 12)
    x = torch.randn(5, 8, requires_grad=True)
    out = linghe.embedding(t, w) * x
    out.sum().backward()
    assert w.grad is None
    _same(x.grad, w[t], "dx")


def test_compile_fullgraph():
    V, H = 23, 40
    w = _weight(V, H, torch.bfloat16)
    t = _tokens((3, 9), V, hot=2)
    c = torch.randn(3, 9, H)

    def f(tok, weight):
        return (linghe.embedding(tok, weight, padding_idx=1).float() * c).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (dw_c,) = torch.autograd.grad(compiled(t, w), w)
    (dw_e,) = torch.autograd.grad(f(t, w), w)
    _same(dw_c, dw_e, "compiled dw")
    # (the cotangent of the bf16 output is c rounded to bf16 by the cast's backward)
    expect = ref.embedding_backward(t, c.to(torch.bfloat16), V, 1)
    _same(dw_e, _rounded(expect, torch.bfloat16), "dw")
    _same(compiled(t, w), f(t, w), "loss")


def test_module_matches_torch():
    V, H = 31, 12
    torch.manual_seed(1)
    mine = linghe.nn.Embedding(V, H, padding_idx=-2, dtype=torch.bfloat16)
    theirs = torch.nn.Embedding(V, H, padding_idx=-2, dtype=torch.bfloat16)
    assert mine.padding_idx == theirs.padding_idx == V - 2
    assert repr(mine).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
    assert torch.equal(mine.weight[V - 2], torch.zeros(H, dtype=torch.bfloat16))
    theirs.load_state_dict(mine.state_dict())
    mine.load_state_dict(theirs.state_dict())
    t = _tokens((4, 5), V, hot=3)
    t[0, 0] = V - 2
    _same(mine(t), theirs(t), "out")
    g = torch.randn(4, 5, H).to(torch.bfloat16)
    mine(t).backward(g)
    _same(mine.weight.grad, _rounded(ref.embedding_backward(t, g, V, V - 2), torch.bfloat16),
          "dw")
    assert repr(linghe.nn.Embedding(3, 4)) == "Embedding(3, 4)"

    pre = torch.randn(V, H)
    frozen = linghe.nn.Embedding.from_pretrained(pre)
    assert not frozen.weight.requires_grad and frozen.weight.data_ptr() == pre.data_ptr()
    _same(frozen(t), pre[t], "from_pretrained")
    assert linghe.nn.Embedding.from_pretrained(pre, freeze=False).weight.requires_grad


def test_module_arguments_as_torch():
    """torch.nn.Embedding's arguments, in its order: the defaults of max_norm,
    scale_grad_by_freq and sparse are accepted (and readable as attributes), other values
    rejected by name; from_pretrained takes them too."""
    V, H = 11, 6
    w = torch.randn(V, H)
    args = (V, H, 3, None, 2.0, False, False, w)  # positional, as torch's __init__
    mine, theirs = linghe.nn.Embedding(*args), torch.nn.Embedding(*args)
    for name in ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"):
        assert getattr(mine, name) == getattr(theirs, name), name
    assert mine.weight.data_ptr() == theirs.weight.data_ptr() == w.data_ptr()
    assert repr(mine).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
    m = linghe.nn.Embedding(V, H, sparse=False, scale_grad_by_freq=False, max_norm=None,
                            dtype=torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    for kw in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            linghe.nn.Embedding(V, H, **kw)
        with pytest.raises(ValueError, match=next(iter(kw))):
            linghe.nn.Embedding.from_pretrained(w, **kw)
    fp = linghe.nn.Embedding.from_pretrained(w, False, 2, None, 2.0, False, False)
    assert fp.weight.requires_grad and fp.padding_idx == 2
    t = _tokens((3, 4), V)
    _same(fp(t), w[t], "from_pretrained")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_wide_rows(dtype):
    """Rows over one forward column block (1 KB)."""
    V, H = 7, 600
    w = torch.randn(V, H).to(dtype)
    t = _tokens((2, 5), V)
    _same(linghe.embedding(t, w), torch.nn.functional.embedding(t, w), "out")


@pytest.mark.gpu
def test_cuda_graph_capture(fused_on):
    """The whole micro-batch (forward, backward accumulating into .grad) has no host sync:
    it is captured in a CUDA graph (with more than 3072 tokens, where PyTorch's embedding
    backward would synchronise) and each replay adds the same gradient."""
    V, H, N = 1000, 64, 5000
    t = _tokens((N,), V, hot=30)
    g = torch.randn(N, H).to(torch.bfloat16)
    w = _weight(V, H, torch.bfloat16)
    w.grad = torch.zeros(V, H, dtype=torch.bfloat16)
    s = ref.embedding_backward(t, g, V)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linghe.embedding(t, w).backward(g)  # warm-up: compiles the kernels
    torch.cuda.current_stream().wait_stream(side)
    expect = _rounded(s, torch.bfloat16)
    _same(w.grad, expect, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linghe.embedding(t, w).backward(g)
    ptr = w.grad.data_ptr()
    for _ in range(3):
        graph.replay()
        expect = _rounded(expect.double() + s, torch.bfloat16)
    torch.cuda.synchronize()
    assert w.grad.data_ptr() == ptr
    _same(w.grad, expect, "after 3 replays")
