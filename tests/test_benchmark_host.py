"""``benchmark.host`` (host µs per call of the public ops): the script runs and writes its
rows; the MoE rows are set up as the GPU run needs them. ``benchmark.probe_roofline``'s
CPU smoke run and its ``--only`` row selection; ``benchmark.probe_rc_floor``'s byte check."""

import json

import pytest
import torch


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


def test_probe_roofline_cpu_only(device, tmp_path):
    """``python -m benchmark.probe_roofline --cpu --only ...`` (tiny shapes, interpreter):
    the issue-11 rows run, in ``--only``'s selection, with ANCHORS.md's byte counts and
    targets; an unknown row name is an error."""
    if device != "cpu":
        pytest.skip("the GPU runs the probe itself (python -m benchmark.probe_roofline)")
    from benchmark import probe_roofline

    out = tmp_path / "roof.json"
    assert probe_roofline.main(["--cpu", "--only", "rope_fwd,rope_bwd,batch_fwd",
                                "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["key"] for r in rows] == ["rope_fwd", "rope_bwd", "batch_fwd"]
    B, S, H, Hkv, D, R = 2, 5, 4, 2, 16, 8  # the probe's CPU shape
    T, W = B * S, (H + 2 * Hkv) * D
    assert rows[0]["min_mb"] * 1e6 == pytest.approx(2 * T * W * 2 + 2 * S * R // 2 * 4)
    assert rows[1]["min_mb"] * 1e6 == pytest.approx(3 * T * W * 2 + 2 * S * R // 2 * 4)
    assert [r["target_us"] for r in rows] == [27.9, 41.6, 111.0]
    with pytest.raises(SystemExit):
        probe_roofline.main(["--cpu", "--only", "rope_fwd,nope"])


def test_probe_e2e_gaps_report():
    """``benchmark.probe_e2e_gaps``' trace analysis on a hand-made chrome trace: the GPU
    gaps between kernels (listed from ``min_us`` on, all counted), a gap's launch lag and
    host time (runtime and driver launches), the host frames then, a blocking runtime call,
    and the point where the launch queue ran dry."""
    from benchmark.probe_e2e_gaps import _ROOT, gap_report

    def x(cat, name, ts, dur, corr=None):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur,
                    args={} if corr is None else dict(correlation=corr))

    trace = {"traceEvents": [
        x("kernel", "k1", 0, 2000, 1), x("kernel", "k2", 2100, 10, 2),
        x("kernel", "k3", 2140, 10, 3),
        x("cuda_runtime", "cudaLaunchKernel", -5, 2, 1),
        x("cuda_driver", "cuLaunchKernelEx", 1000, 2, 2),   # queued 1100 us: GPU busy
        x("cuda_runtime", "cudaLaunchKernel", 2130, 2, 3),  # started 10 us after: dry
        x("cuda_runtime", "cudaStreamSynchronize", 100, 800),
        x("python_function", _ROOT + "linghe/functional/moe.py(10): forward", -10, 2300),
        x("python_function", "/usr/lib/python3/threading.py(1): run", -10, 2300),
        x("cpu_op", "aten::item", 90, 820),
        {"ph": "i", "name": "instant", "ts": 5},
    ]}
    rep = gap_report(trace, min_us=50)
    assert rep["idle_us"] == 100 + 30
    (gap,) = rep["gaps"]  # (the 30 us one before k3 is counted, not listed)
    assert (gap["us"], gap["after"], gap["before"]) == (100, "k1", "k2")
    assert (gap["lag_us"], gap["host_us"]) == (1100, 1005)
    # a quarter of the way between the launches the host was in moe.forward's aten::item
    # (threading.py is not a kept frame)
    assert gap["host_frames"][0] == ["linghe/functional/moe.py(10): forward", "aten::item"]
    assert rep["blocking"] == [{"us": 800, "call": "cudaStreamSynchronize",
                                "frames": ["linghe/functional/moe.py(10): forward",
                                           "aten::item"]}]
    assert [d["kernel"] for d in rep["drains"]] == ["k3"]


def test_probe_ws_rows_old_module_and_table(tmp_path, capsys):
    """``benchmark.probe_ws_rows`` (GPU-only timing): the old ``grouped_mm_ws.py`` loads
    from a folder (copies of the tree without git) as its own module, with the launchers
    the probe swaps in; a folder without it is an error; the A/B table's exit code flags
    a case whose bits differ."""
    pytest.importorskip("torch")
    probe = pytest.importorskip("benchmark.probe_ws_rows")
    import shutil

    from linghe.fwd import grouped_mm_ws

    (tmp_path / "linghe" / "fwd").mkdir(parents=True)
    shutil.copy(grouped_mm_ws.__file__, tmp_path / "linghe" / "fwd" / "grouped_mm_ws.py")
    old = probe._load_old(str(tmp_path), "HEAD")
    assert old is not grouped_mm_ws and old.__name__ == "linghe.fwd._grouped_mm_ws_old"
    assert all(callable(getattr(old, n)) for n in probe._LAUNCHERS)
    with pytest.raises(FileNotFoundError, match="grouped_mm_ws.py"):
        probe._load_old(str(tmp_path / "linghe"), "HEAD")
    row = dict(E=3, gemm="down", kind="fp8", dir="fwd", new_us=9.0, old_us=10.0,
               speedup=10 / 9, same_bits=True, rel_err=1e-3)
    assert probe.print_ab("t", [row], ("new", "new"), ("old", "old")) == 0
    assert "1.111x" in capsys.readouterr().out
    assert probe.print_ab("t", [dict(row, same_bits=False)], ("new", "new"),
                          ("old", "old")) == 2


def test_ncu_source_summary(tmp_path, capsys):
    """``benchmark.ncu_source`` on a committed Nsight Compute source page (the FP8 rows
    kernel, H200): every instruction's samples land in exactly one region; the idle
    padding warps' park (executed once a CTA a warp) is pure barrier samples; the
    table prints; a CSV without instruction rows is an error."""
    import glob
    import os

    ncu = pytest.importorskip("benchmark.ncu_source")
    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "benchmark", "results")
    files = sorted(glob.glob(os.path.join(results, "h200_ncu_source_fp8_rows_ws_*_s22.csv.gz")))
    assert files, "the committed ncu source pages"
    ins = ncu.read_source_csv(files[0])
    regs = ncu.regions(ins)
    assert sum(r[3] for r in regs) == sum(i.samples for i in ins) > 0
    assert [r[0] for r in regs] == [0] + [r[1] + 1 for r in regs[:-1]]
    park = [r for r in regs if r[2] in (132, 264) and r[3] > 0]
    assert park and all(set(r[4]) == {"barrier"} for r in park)
    assert ncu.main([files[0], "--top", "3"]) == 0
    assert "top instructions" in capsys.readouterr().out
    bad = tmp_path / "bad.csv"
    bad.write_text('"Kernel Name","k"\n"Address","Source","Warp Stall Sampling (All Samples)",'
                   '"Instructions Executed"\n')
    with pytest.raises(ValueError, match="no instruction rows"):
        ncu.read_source_csv(str(bad))


def test_ncu_metrics_summary(capsys, tmp_path):
    """``benchmark.ncu_metrics`` on the committed Nsight Compute raw pages (H200): the FP8
    rows kernel keeps the tensor pipe 60-75% busy, the bf16 one more; the quantize kernel
    uses no tensor pipe and is L2-bound; units convert (the FP8 E256 launch is 609.3 µs);
    the table, the verdicts and the JSON come out."""
    import glob
    import os

    ncu = pytest.importorskip("benchmark.ncu_metrics")
    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "benchmark", "results")
    files = sorted(glob.glob(os.path.join(results, "h200_ncu_raw_*_s23.csv.gz")))
    assert len(files) == 4, "the committed ncu raw pages"
    out = tmp_path / "ncu.json"
    assert ncu.main(files + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tensor pipe active %" in text and "DRAM read GB" in text
    assert text.count("busiest unit") == 4 and "L2-bound" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    by = {r["file"].split("_ncu_raw_")[1].split("_2026")[0]: r for r in rows}
    tensor = "tensor pipe active %"
    e256, e32 = by["fp8_rows_ws_e256_gate_up"], by["fp8_rows_ws_e32_gate_up"]
    bf16, quant = by["bf16_rows_ws_e256_gate_up"], by["quantize_split_8192x2048"]
    assert 60 < e256[tensor] < 75
    assert bf16[tensor] > max(e256[tensor], e32[tensor])
    assert abs(e256["duration us"] - 609.3) < 1 and abs(bf16["duration us"] - 1032.1) < 1
    assert quant[tensor] == 0 and ncu.busiest(quant)[0] == "L2"
    assert all(r["DRAM throughput %"] is not None for r in rows)


def test_probe_rc_floor_check():
    """``benchmark.probe_rc_floor``'s byte check (the kernel is sm_90-only): the pattern's
    outputs built on the host pass, a transposed copy that is off by one byte fails."""
    from benchmark.probe_rc_floor import check, make_outputs

    x = torch.randn(32, 48).to(torch.bfloat16)
    bits = x.view(torch.int16)
    hi, lo = (bits >> 8).to(torch.uint8), bits.to(torch.uint8)
    y, a, b = make_outputs(x, 2)
    a.copy_(hi)
    b.view(torch.uint8).view(48, 32).copy_(lo.t())
    assert check(x, 2, (y, a, b))
    b.view(torch.uint8)[0, 0] ^= 1
    assert not check(x, 2, (y, a, b))
    y, a, b = make_outputs(x, 1)
    a.copy_(hi)
    b.copy_(lo)
    assert check(x, 1, (y, a, b)) and not check(x, 1, (y, b, a))
    y.copy_(x)
    assert check(x, 0, (y, a, b))
