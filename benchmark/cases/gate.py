"""Group RMSNorm with sigmoid gate, transpose fused: forward and backward.

Standard shape (chosen): x [2, 4096, 16, 128] bf16 (dim 2048), gate "sbh" [4096, 2, 2048]
bf16, weight [2048] bf16, num_groups 4 (512 channels per group); output [4096, 2, 2048].
"""

import torch

import linghe
from linghe import reference as ref

from ..harness import Bench, Config, backward_of, case, compiled


@case("group_rms_norm_gate")
def group_rms_norm_gate_case(cfg: Config):
    B, S, H, dh, G = (1, 8, 2, 16, 4) if cfg.cpu else (2, 4096, 16, 128, 4)
    dev, dt = cfg.device, torch.bfloat16
    dim = H * dh
    x = torch.randn(B, S, H, dh, device=dev, dtype=dt, requires_grad=True)
    gate = torch.randn(S, B, dim, device=dev, dtype=dt, requires_grad=True)
    w = (torch.rand(dim, device=dev) + 0.5).to(dt).requires_grad_()
    kw = dict(num_groups=G, gate_layout="sbh")

    def eager():
        return ref.group_rms_norm_gate(x, gate, w, **kw)

    def comp():
        return compiled(ref.group_rms_norm_gate)(x, gate, w, **kw)

    def ours():
        return linghe.group_rms_norm_gate(x, gate, w, **kw)

    T = B * S
    fwd_bytes = 3 * T * dim * 2 + dim * 2          # read x, gate; write y
    bwd_bytes = 5 * T * dim * 2 + 2 * dim * 2      # read x, gate, dy; write dx, dgate
    name = f"group_rms_norm_gate [B{B},S{S},{dim}] G{G} sbh bf16"
    dy = torch.randn(S, B, dim, device=dev, dtype=dt)
    ins = [x, gate, w]
    return [
        Bench(name=name + " fwd", bytes=fwd_bytes, tol=1e-2,
              run={"eager": eager, "compile": comp, "linghe": ours}),
        Bench(name=name + " bwd", bytes=bwd_bytes, tol=1e-2,
              run={"eager": backward_of(eager, ins, dy),
                   "compile": backward_of(comp, ins, dy),
                   "linghe": backward_of(ours, ins, dy)}),
    ]
