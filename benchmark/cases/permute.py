"""MoE permute / unpermute with padded indices (top-8 of 256, align 16)."""

import torch

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, case, compiled


def _ids(T, E, k, device):
    return torch.rand(T, E, device=device).topk(k, dim=1).indices.to(torch.int32)


def _ref_permute(x, ids, probs, E):
    return ref.permute(x, ids, probs, E, 16)


def _linghe_permute(x, ids, probs, E):
    rows, prow, lay = linghe.permute(x, ids, probs, num_experts=E, align=16)
    return rows, prow, lay.row_index, lay.offsets, lay.tokens_per_expert


@case("permute")
def permute_case(cfg: Config):
    T, E, k, H = (64, 16, 4, 96) if cfg.cpu else (8192, 256, 8, 2048)
    x = torch.randn(T, H, device=cfg.device, dtype=torch.bfloat16)
    ids = _ids(T, E, k, cfg.device)
    probs = torch.rand(T, k, device=cfg.device)
    R = linghe.max_grouped_rows(T, k, E, 16)
    rows, _, lay = linghe.permute(x, ids, num_experts=E, align=16)
    idx = lay.row_index
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
    ]
