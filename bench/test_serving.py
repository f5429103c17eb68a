"""Offline throughput, ringserve engine vs HF transformers generate, in one run (pytest-benchmark).

    .venv/bin/python -m pytest bench/test_serving.py --benchmark-enable -p no:cacheprovider -s

Both sides get the same requests (bench/workload.py, EOS ignored) all at once: ringserve through
the Engine, streamed (bench/backends.py), transformers in static batches of 16 (bench/hf_backend.py).
Only generation is timed (engine start-up and HF model load excluded). With --benchmark-disable
(the default test run) it is a smoke test on 8 short requests whose greedy tokens must equal
transformers'. The full harness is `python -m ringserve.bench.serving` (README: Benchmarks).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from ringserve.bench.backends import drive, engine_sender
from ringserve.bench.hf_backend import load_model, run_hf
from ringserve.bench.workload import random_requests

OUTS: dict[str, list[list[int]]] = {}
FULL = dict(max_running_requests=64, context_length=512, max_total_tokens=64 * 512, max_prefill_tokens=1024)
SMALL = dict(max_running_requests=16, context_length=256, max_prefill_tokens=256, max_total_tokens=16 * 512)  # as tests/engine


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from ringserve.model.checkpoints.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


@pytest.fixture(scope="module")
def workload(request):
    full = request.config.getoption("benchmark_enable", False)
    return random_requests(64 if full else 8, 2000, 0, (16, 256 if full else 48), (16, 128 if full else 24))


@pytest.mark.parametrize("side", ["ringserve", "transformers"])
def test_offline_throughput_tiny(benchmark, record, tiny_path, workload, side):
    arrivals = [0.0] * len(workload)
    if side == "ringserve":
        from ringserve import Engine

        server = FULL if len(workload) > 8 else SMALL
        with Engine(tiny_path, **server) as engine:
            engine.wait_compiled()
            engine.generate(input_ids=[r.prompt[:8] for r in workload[:2]], sampling_params={"max_new_tokens": 2})
            send = engine_sender(engine)
            records = benchmark.pedantic(lambda: asyncio.run(drive(send, workload, arrivals, progress=False)), rounds=1)
            assert engine.get_server_info()["integrity_errors"] == []
        outs = [r.output_ids for r in records]
    else:
        model = load_model(tiny_path)
        records, outs = benchmark.pedantic(lambda: run_hf(model, workload, arrivals, 16, progress=False), rounds=1)
    assert [r.output_len for r in records] == [r.output_len for r in workload]
    assert all(math.isfinite(r.ttft) and r.e2e >= r.ttft for r in records)
    OUTS[side] = outs
    if len(OUTS) == 2:  # greedy, same checkpoint: the same tokens
        assert OUTS["ringserve"] == OUTS["transformers"]
    record(("offline throughput", f"tiny {len(workload)} reqs", side), sum(r.output_len for r in workload))
