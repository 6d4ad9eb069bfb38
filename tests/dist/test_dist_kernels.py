"""The exchange kernels of linghe.dist on one device, without collectives (CPU through the
interpreter, or one GPU: the only GPU coverage of these kernels outside the 2-GPU test).

Rank ``rank`` of a pretend group of ``W`` ranks packs its tokens (slots per the routing,
own rows into a second buffer), the records are checked field by field against a Python
model, unpacked into expert-grouped rows, packed back, and gathered into weighted sums.
"""

import pytest
import torch

from linghe import reference as ref
from linghe.dist import kernels as K
from linghe.fwd.permute import index_buffer, layout_from_index
from linghe.testing import assert_fp8_close

CASES = [  # (W, rank, T, H, k, capacity_factor, fp8)
    (3, 1, 13, 40, 2, None, False),
    (3, 2, 13, 40, 2, 0.5, False),      # tight capacity: drops, empty slots
    (2, 0, 9, 256, 3, 1.0, True),       # FP8 payload, two 1x128 groups
    (4, 3, 0, 24, 2, None, False),      # no tokens
]


def _model_slots(ids, W, El, rank, C):
    """Python model of the send order: destinations in rank order, own block last; per
    destination, experts in order, tokens in order; capacity C per destination."""
    T, k = ids.shape
    per_dest = {r: [] for r in range(W)}
    for e in range(W * El):
        for t in range(T):
            for j in range(k):
                if int(ids[t, j]) == e:
                    per_dest[e // El].append((t, j))
    slot = torch.full((T, k), -1, dtype=torch.int32)
    order = [r for r in range(W) if r != rank] + [rank]
    base = 0
    for r in order:
        copies = per_dest[r] if C is None else per_dest[r][:C]
        for p, (t, j) in enumerate(copies):
            slot[t, j] = base + p
        base += len(per_dest[r]) if C is None else C
    n_send = sum(len(per_dest[r]) for r in order[:-1]) if C is None else (W - 1) * C
    return slot, n_send, per_dest


@pytest.mark.parametrize("case", CASES)
def test_scatter_records_and_gather(case, device):
    W, rank, T, H, k, cf, fp8 = case
    El = 2
    E = W * El
    g = torch.Generator().manual_seed(T * 7 + H)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :k].to(torch.int32)
    if T > 3:
        ids[1, 0] = -1  # not routed
        ids[2, -1] = E  # out of range: dropped
    probs = torch.rand(T, k, generator=g).to(device)
    C = None if cf is None else max(1, min(T * k, -(-int(cf * T * k) // W)))
    want_slot, n_send, per_dest = _model_slots(ids, W, El, rank, C)
    n_self = len(per_dest[rank]) if C is None else C
    ids = ids.to(device)
    lay = layout_from_index(index_buffer(ids, E, 1, T * k), (T, k), E, 1, T * k)
    spec = K.fwd_spec(H, x.dtype, fp8)
    send, tail = spec.empty(n_send, device), spec.empty(n_self, device)
    slot = torch.empty(T, k, dtype=torch.int32, device=device)
    K.scatter_tokens(x, K.VBuf(spec, send, tail, n_send, 0), slot=slot,
                     routing=(ids, lay.row_index, lay.offsets, El, rank), probs=probs,
                     quant=fp8, capacity=C or 0)
    assert torch.equal(slot.cpu(), want_slot)
    recs = torch.cat([send, tail]).cpu()
    TW = spec.trailer_offset
    data = recs.view(spec.dtype)[:, :H]
    if fp8:
        q, s = ref.quantize_1x128(x.float().cpu())
    for t in range(T):
        for j in range(k):
            v = int(want_slot[t, j])
            if v < 0:
                continue
            assert recs[v, TW] == probs[t, j].cpu(), (t, j)
            assert recs[v, TW + 1] == int(ids[t, j]) % El, (t, j)
            if fp8:  # the reference's scales (to an ulp or two: the GPU's fp32 division
                # is not correctly rounded); data within one e4m3 step
                torch.testing.assert_close(recs[v, TW + 2:TW + 4], s[t], rtol=3e-7, atol=0,
                                           msg=f"scales of ({t}, {j})")
                assert_fp8_close(data[v], q[t], f"payload of ({t}, {j})")
            else:
                assert torch.equal(data[v], x[t].cpu()), (t, j)
    if C is not None:  # empty capacity slots are marked with id -1
        for r in range(W):
            base = (W - 1) * C if r == rank else (r - (r > rank)) * C
            filled = min(len(per_dest[r]), C)
            assert bool((recs[base + filled:base + C, TW + 1] == -1).all()), r
    # the records back to tokens: out[t] = sum_j w[t, j] * payload(slot[t, j]), dprob
    if not fp8:
        w = torch.rand(T, k, generator=g).to(device)
        out, dp = K.gather_tokens(K.VBuf(spec, send, tail, n_send, 0), slot, torch.float32,
                                  weights=w, probs_grad=True)
        kept = (want_slot >= 0).to(device)
        want = (w[:, :, None] * kept[:, :, None] * x.float()[:, None, :]).sum(1)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dp, probs * kept)


@pytest.mark.parametrize("fp8", [False, True])
def test_unpack_pack_round_trip(fp8, device):
    """Arrived records (ids with -1 = empty slots) -> rows grouped by local expert, padded
    by index (zeros; FP8 rows: scale 1) -> packed back into the arrival order."""
    N, H, El, align = 23, 200 if fp8 else 40, 3, 4
    g = torch.Generator().manual_seed(5)
    spec = K.fwd_spec(H, torch.bfloat16, fp8)
    recs = spec.empty(N, device)
    lid = torch.randint(-1, El, (N,), generator=g).to(device)
    TW = spec.trailer_offset
    pay = torch.randn(N, H, generator=g).to(device)
    if fp8:
        q, s = ref.quantize_1x128(pay.cpu())
        recs.view(spec.dtype)[:, :H] = q.to(device)
        recs[:, TW + 2:TW + 4] = s.to(device)
        pay = ref.dequantize_1x128(q, s).to(device)
    else:
        recs.view(spec.dtype)[:, :H] = pay.to(torch.bfloat16)
        pay = pay.to(torch.bfloat16).float()
    recs[:, TW] = torch.rand(N, generator=g).to(device)
    recs[:, TW + 1] = lid.float()
    # two parts: records 0..9 in one buffer, the rest in another (as own rows are)
    P, Q = recs[:10].clone(), recs[10:].clone()
    num_rows = N + El * (align - 1)
    lay = layout_from_index(index_buffer(lid.to(torch.int32).view(N, 1), El, align, num_rows),
                            (N, 1), El, align, num_rows)
    src = K.VBuf(spec, P, Q, 10, 0)
    rows, scales, prow = K.unpack_rows(src, lay, torch.bfloat16, probs=True, dequant=fp8)
    assert scales is None
    ri = lay.row_index.view(-1).cpu()
    real = torch.zeros(num_rows, dtype=torch.bool)
    real[ri[ri >= 0].long()] = True
    assert bool((rows.cpu()[~real] == 0).all()) and bool((prow.cpu()[~real] == 0).all())
    for i in range(N):
        r = int(ri[i])
        assert (r >= 0) == (int(lid[i]) >= 0)
        if r >= 0:
            torch.testing.assert_close(rows[r].float(), pay[i], rtol=1e-2, atol=1e-2)
            assert prow[r] == recs[i, TW]
    if fp8:  # kept FP8: the arrived bytes and scales, padding scale 1
        rq, rs, _ = K.unpack_rows(src, lay, torch.bfloat16, fp8_out=True)
        assert rq.dtype == torch.float8_e4m3fn
        assert bool((rs.cpu()[~real] == 1).all())
        for i in range(N):
            r = int(ri[i])
            if r >= 0:
                assert torch.equal(rq[r].view(torch.uint8), recs.view(spec.dtype)[i, :H]
                                   .view(torch.uint8))
                assert rs[r, 0] == recs[i, TW + 2] and rs[r, 1] == recs[i, TW + 3]
        return
    # back into arrival order (plain rows, two parts), with the probs into a trailer
    gspec = K.RecordSpec(H, torch.bfloat16, 1)
    back = gspec.empty(N, device)
    K.pack_rows(rows, lay, K.VBuf(gspec, back[:7], back[7:], 7, 0), probs_rows=prow)
    ok = ri >= 0
    got = back.view(torch.bfloat16)[:, :H].float().cpu()
    torch.testing.assert_close(got[ok], pay.cpu()[ok])
    assert torch.equal(back[:, gspec.trailer_offset].cpu()[ok], recs[:, TW].cpu()[ok])
