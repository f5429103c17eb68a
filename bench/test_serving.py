"""Offline throughput, ringserve engine vs HF transformers generate, in one run (pytest-benchmark).

    .venv/bin/python -m pytest bench/test_serving.py --benchmark-enable -p no:cacheprovider -s

With --benchmark-disable (the default test run) it is a smoke test on 8 short requests. The
full workload (256 requests, inputs 16-512, outputs 16-256) is `python -m bench.serving`.
"""

from __future__ import annotations

import pytest

from bench.conftest import RESULTS
from bench.serving import make_workload, run_engine, run_hf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from model.checkpoints.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


@pytest.fixture(scope="module")
def workload(request):
    full = request.config.getoption("benchmark_enable", False)
    return make_workload(64 if full else 8, 0, 2000, (16, 256 if full else 48), (16, 128 if full else 24))


@pytest.mark.parametrize("side", ["ringserve", "transformers"])
def test_offline_throughput_tiny(request, tiny_path, workload, side):
    """Times only the generation (engine start-up and HF model load excluded)."""
    path = tiny_path
    if side == "ringserve":
        server = dict(
            max_running_requests=64, context_length=512, max_total_tokens=64 * 512, max_prefill_tokens=1024
        )
        dt, info, outs = run_engine(path, workload, **server)
        assert info["integrity_errors"] == []
    else:
        dt, outs = run_hf(path, workload, 16)
    assert [len(o) for o in outs] == workload.max_new
    if request.config.getoption("benchmark_enable", False):
        RESULTS[("offline throughput", f"tiny {len(outs)} reqs", side)] = dt
        print(
            f"{side}: {workload.output_tokens} tokens in {dt:.2f}s = {workload.output_tokens / dt:.0f} tok/s"
        )
