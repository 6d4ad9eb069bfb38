"""``benchmark.host`` (host µs per call of the public ops): the script runs and writes its
rows; the MoE rows are set up as the GPU run needs them."""

import json

import pytest


def test_host_benchmark_runs(tmp_path):
    host = pytest.importorskip("benchmark.host")
    out = tmp_path / "host.json"
    assert host.main(["--case", "empty torch op", "triton launch", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} >= {"empty torch op (x.add_(0))",
                                       "triton launch linghe.utils.launch"}
    assert all(r["host_us"] > 0 for r in rows)


def test_host_benchmark_moe_rows(device):
    """The MoE rows: bf16 and FP8 forward+backward on the calling thread, few calls each
    on a GPU (each launches tens of kernels: the launch queue holds about a thousand)."""
    host = pytest.importorskip("benchmark.host")
    cases = host._moe_cases(device, small=True)
    assert [c.name.split(" (")[0] for c in cases] == ["nn.MoE bf16 fwd+bwd",
                                                        "nn.MoE fp8 fwd+bwd"]
    assert all(c.backward and c.caller_thread and c.calls * 60 < 1000 for c in cases)


def test_case_selection():
    """``python -m benchmark --case``: an exact name runs alone, other arguments match as
    substrings, each on its own."""
    from benchmark.__main__ import select_cases

    names = ["grouped_mm", "grouped_mm_deferred", "rms_norm", "rms_norm_quant"]
    assert select_cases(names, ["grouped_mm"]) == ["grouped_mm"]
    assert select_cases(names, ["grouped"]) == ["grouped_mm", "grouped_mm_deferred"]
    assert select_cases(names, ["grouped_mm", "quant"]) == ["grouped_mm", "rms_norm_quant"]
    assert select_cases(names, ["nothing"]) == []
