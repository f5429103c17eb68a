"""bench.weights on the tiny model: every timed call succeeds and nothing recompiles (the
figures themselves come from `python -m ringserve.bench.weights --model smollm2`)."""

from __future__ import annotations


def test_weight_sync_harness_runs_on_the_tiny_model(capsys):
    from ringserve.bench.weights import main

    # the test suite's small shapes: its compiled programs are in the XLA cache already
    out = main(["--model", "tiny", "--repeat", "1", "--context-length", "256", "--max-prefill-tokens", "256",
                "--max-total-tokens", "8192", "--bucket-mb", "1"])  # fmt: skip
    assert set(out) == {"from_disk", "from_tensor_all", "from_tensor_other_process", "from_tensor_http",
                        "from_tensor_one_layer", "release_memory", "resume_memory"}  # fmt: skip
    assert all(s > 0 for s in out.values())
    assert "nothing recompiled: True" in capsys.readouterr().out
