"""benchmark.dist_a2a runs end to end (gloo, two forked CPU ranks, tiny sizes): every row,
the targets and the JSON. Its GPU numbers come from `python -m benchmark.dist_a2a` on a
2-GPU machine; this keeps that command working between GPU sessions."""

import json
import os

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not dist.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs torch.distributed (gloo) and CPU tensors through the Triton interpreter")


def test_dist_a2a_benchmark_cpu_smoke(tmp_path, capsys):
    from benchmark import dist_a2a

    out = tmp_path / "dist.json"
    rep = dist_a2a.main(["--device", "cpu", "--warmup", "0", "--out", str(out)])
    names = [r["name"] for r in rep["results"]]
    for want in ("plain a2a bf16", "plain a2a fp8 remote only", "dispatch bf16",
                 "dispatch bf16 cap1.25", "combine bf16", "dispatch fp8", "dispatch fp8 rows",
                 "dispatch+combine fwd+bwd bf16", "MoE EP2 fwd+bwd (overlap)",
                 "MoE EP2 fwd+bwd (no overlap)", "MoE 1 GPU fwd+bwd"):
        assert want in names, (want, names)
    assert all(r["us"] > 0 for r in rep["results"])
    assert {t["row"] for t in rep["targets"]} == {t[0] for t in dist_a2a.TARGETS}
    ep = next(r for r in rep["results"] if r["name"] == "MoE EP2 fwd+bwd (overlap)")
    assert ep["vs_1gpu_tok_per_s"] > 0
    saved = json.loads(out.read_text())
    assert saved["meta"]["world"] == 2 and len(saved["results"]) == len(names)
    assert "target dispatch bf16" in capsys.readouterr().out
