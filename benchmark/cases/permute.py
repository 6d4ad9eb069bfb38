"""MoE permute / unpermute with padded indices (top-8 of 256, align 16)."""

import torch

import linghe
from linghe import reference as ref
from linghe.fwd.permute import TokenRows, scatter_rows_fp8_copy

from ..harness import Bench, Config, case, compiled


def _ids(T, E, k, device):
    return torch.rand(T, E, device=device).topk(k, dim=1).indices.to(torch.int32)


def _ref_permute(x, ids, probs, E):
    return ref.permute(x, ids, probs, E, 16)


def _linghe_permute(x, ids, probs, E):
    rows, prow, lay = linghe.permute(x, ids, probs, num_experts=E, align=16)
    return rows, prow, lay.row_index, lay.offsets, lay.tokens_per_expert


def _ref_rows_fp8_copy(dout, ids, E):
    """unpermute's d_rows (without probs: the scatter of ``dout``) and their rowwise FP8
    copy, quantized from the rows."""
    rows = ref.permute(dout, ids, None, E, 16)[0]
    return (rows, *ref.quantize_1x128(rows, pow2_scale=True))


def _ref_rows_dequantized(q, s, ids, E):
    """The expert rows of FP8 tokens, dequantized: what the deferred wgrad reads."""
    return ref.permute(ref.dequantize_1x128(q, s, torch.bfloat16), ids, None, E, 16)[0]


def _ref_unpermute_add(rows, idx, probs, shared):
    """The combine and the shared experts' output added after it, as torch code writes it."""
    return ref.unpermute(rows, idx, probs) + shared


@case("permute")
def permute_case(cfg: Config):
    T, E, k, H = (64, 16, 4, 96) if cfg.cpu else (8192, 256, 8, 2048)
    x = torch.randn(T, H, device=cfg.device, dtype=torch.bfloat16)
    ids = _ids(T, E, k, cfg.device)
    probs = torch.rand(T, k, device=cfg.device)
    R = linghe.max_grouped_rows(T, k, E, 16)
    rows, _, lay = linghe.permute(x, ids, num_experts=E, align=16)
    idx = lay.row_index
    G = -(-H // 128)
    shared = torch.randn(T, H, device=cfg.device, dtype=torch.bfloat16)
    tok = linghe.quantize_1x128(x, pow2_scale=True)
    tq, ts = tok.rowwise_data, tok.rowwise_scale
    return [
        Bench(name=f"permute [{T},{H}] bf16 top-{k} of {E}, align 16",
              bytes=T * H * 2 + R * H * 2 + T * k * 8 + R * 4, tol=0.0,
              run={"eager": lambda: _ref_permute(x, ids, probs, E),
                   "compile": lambda: compiled(_ref_permute)(x, ids, probs, E),
                   "linghe": lambda: _linghe_permute(x, ids, probs, E)}),
        Bench(name=f"unpermute [{R},{H}] bf16 -> [{T},{H}] (sum of {k} rows)",
              bytes=T * k * H * 2 + T * H * 2 + T * k * 8, tol=1e-2,
              expected=lambda: ref.unpermute(rows.double(), idx, probs.double()),
              run={"eager": lambda: ref.unpermute(rows, idx, probs),
                   "compile": lambda: compiled(ref.unpermute)(rows, idx, probs),
                   "linghe": lambda: linghe.unpermute(rows, lay, probs)}),
        # nn.MoE's combine: the shared experts' output added in the same pass
        Bench(name=f"unpermute + shared experts' output [{R},{H}] + [{T},{H}] bf16",
              bytes=T * k * H * 2 + 2 * T * H * 2 + T * k * 8, tol=1e-2,
              expected=lambda: ref.unpermute(rows.double(), idx, probs.double(),
                                             residual=shared.double()),
              run={"eager": lambda: _ref_unpermute_add(rows, idx, probs, shared),
                   "compile": lambda: compiled(_ref_unpermute_add)(rows, idx, probs, shared),
                   "linghe": lambda: linghe.unpermute(rows, lay, probs, residual=shared)}),
        # the FP8 MoE layer's backward: unpermute's d_rows with their rowwise FP8 copy
        # (the down GEMM's dgrad operand), each token row quantized once
        Bench(name=f"unpermute bwd [{T},{H}] -> [{R},{H}] bf16 + rowwise FP8 copy",
              bytes=T * H * 2 + R * H * 3 + R * G * 4 + T * k * 4, tol=1e-2,
              run={"eager": lambda: _ref_rows_fp8_copy(x, ids, E),
                   "compile": lambda: compiled(_ref_rows_fp8_copy)(x, ids, E),
                   "linghe": lambda: scatter_rows_fp8_copy(x, lay, pow2_scale=True)}),
        # the deferred expert wgrad's rows, made from the FP8 tokens kept for it
        Bench(name=f"expert rows of FP8 tokens [{T},{H}] -> [{R},{H}] bf16 (dequantized)",
              bytes=T * H + T * G * 4 + R * H * 2 + T * k * 4, tol=1e-2,
              run={"eager": lambda: _ref_rows_dequantized(tq, ts, ids, E),
                   "compile": lambda: compiled(_ref_rows_dequantized)(tq, ts, ids, E),
                   "linghe": lambda: TokenRows(tq, ts, lay).dequantized(torch.bfloat16)}),
    ]
