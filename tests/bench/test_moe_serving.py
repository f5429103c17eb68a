"""bench/moe_serving.py end to end in a tiny configuration, so the bench cannot rot: three
checkpoints made to the sizes asked for (the dense ones matching the MoE's total and active
parameters to within the rounding of their intermediate size), every run of every server timed,
ringserve's tokens equal to transformers' (greedy, the same prompts), the JSON and the table."""

from __future__ import annotations

import json

import pytest

from ringserve.bench.moe_serving import main

HIDDEN, LAYERS, EXPERTS, TOPK, INTER = 64, 2, 4, 2, 32
TINY = ["--hidden", str(HIDDEN), "--layers", str(LAYERS), "--heads", "4", "--kv-heads", "2", "--vocab", "512",
        "--experts", str(EXPERTS), "--topk", str(TOPK), "--moe-inter", str(INTER), "--batches", "1", "3",
        "--repeat", "2", "--prompt-len", "8", "--output-len", "4", "--prefill-prompts", "2", "--prefill-len", "16"]  # fmt: skip


@pytest.mark.sweep  # three engines compile: 68-95 s on 2 cores: out of CI's 45 minutes
def test_tiny_moe_bench_runs_every_server_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "moe.json"
    report = main([*TINY, "--models-dir", str(tmp_path / "models"), "--output-json", str(out)])
    assert json.loads(out.read_text())["runs"] == report["runs"]
    runs = {(r["model"], r["server"]): r for r in report["runs"]}
    assert list(runs) == [("moe", "ringserve"), ("moe", "transformers"), ("dense-total", "ringserve"),
                          ("dense-total", "transformers"), ("dense-active", "ringserve")]  # fmt: skip
    for r in runs.values():
        for col in ("gen_1", "gen_3", "prefill"):
            assert len(r[col]) == 2 and all(v > 0 for v in r[col]), (r["model"], r["server"], col)
    moe, total, active = (runs[(m, "ringserve")] for m in ("moe", "dense-total", "dense-active"))
    # the idle experts: (E - k) of each layer's gate, up and down
    assert moe["total_params"] - moe["active_params"] == LAYERS * (EXPERTS - TOPK) * 3 * HIDDEN * INTER
    assert (
        total["active_params"] == total["total_params"] and active["active_params"] == active["total_params"]
    )
    # intermediate sizes rounded to 16: within half a step (3 * H * 8 per layer) of the MoE's counts
    assert abs(total["total_params"] - moe["total_params"]) <= LAYERS * 3 * HIDDEN * 8
    assert abs(active["total_params"] - moe["active_params"]) <= LAYERS * 3 * HIDDEN * 8
    # greedy on the same prompts: ringserve's tokens are transformers' (the largest batch's 3 requests)
    assert runs[("moe", "transformers")]["same"] == 3 and runs[("dense-total", "transformers")]["same"] == 3
    text = capsys.readouterr().out
    assert "moe ringserve / dense-active ringserve" in text and "moe ringserve / moe transformers" in text
