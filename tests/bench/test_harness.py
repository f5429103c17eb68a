"""The serving harness end to end (`python -m ringserve.bench.serving`): a small workload through the
engine and the IPC client, both overlap settings, with the profiler and the JSON report."""

from __future__ import annotations

import json

from ringserve.bench.serving import bench

SMALL = [
    "--num-prompts", "6", "--input-len", "8", "40", "--output-len", "4", "12", "--warmup", "1",
    "--max-running-requests", "8", "--max-prefill-tokens", "128", "--context-length", "256",
    "--disable-tqdm",
]  # fmt: skip


def test_harness_reports_every_run_with_a_valid_trace(tmp_path, capsys):
    out = tmp_path / "run.json"
    runs = bench(["--model", "tiny", "--backend", "engine", "client", "--overlap", "both", "--profile",
                  "--output-json", str(out), *SMALL])  # fmt: skip
    assert [r["label"] for r in runs] == ["engine", "client", "engine-overlap-off", "client-overlap-off"]
    saved = json.loads(out.read_text())
    assert [r["label"] for r in saved] == [r["label"] for r in runs]
    for r in saved:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] > 0 and r["output_throughput"] > 0
        for key in ("ttft_ms_p99", "itl_ms_p99", "tpot_ms_median", "e2e_ms_mean", "request_throughput"):
            assert key in r
        # no shared prefixes in a random workload: every prompt token is computed once
        assert r["prefill_over_unique"] == 1.0
        trace = json.loads((tmp_path / r["trace_file"].split("/")[-1]).read_text())
        assert trace["traceEvents"] and all("ph" in e for e in trace["traceEvents"])
        assert 0.0 <= r["profile"]["device_idle_fraction"] <= 1.0
    text = capsys.readouterr().out
    assert "overlap on / off (tiny)" in text and "step profile" in text
