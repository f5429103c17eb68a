"""Latency samples for pytest-benchmark: TTFT, TPOT, ITL and E2E as benchmark statistics.

pytest-benchmark times a function; a serving latency is measured by the client inside a run.
`record_samples` hands measured values to pytest-benchmark through a virtual clock, so each
latency becomes an ordinary benchmark whose rounds are the samples (min, max, mean, median,
IQR, ops in the table, `--benchmark-json` and `--benchmark-compare`), with p50, p90 and p99 in
its `extra_info`:

    @pytest.mark.benchmark(timer=CLOCK, group="latency")
    def test_x(benchmark):
        record_samples(benchmark, CLOCK, [0.012, 0.011, ...])   # seconds

With --benchmark-disable (the default test run) nothing is recorded (extra_info is still set).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ringserve.bench.backends import drive, engine_sender
from ringserve.bench.metrics import RequestRecord
from ringserve.bench.workload import Request


class VirtualClock:
    """A timer that advances only when told: pytest-benchmark's duration of a round is the
    sample the round handed over."""

    __name__ = "measured_latency"  # how pytest-benchmark names the timer in its JSON

    def __init__(self) -> None:
        self.now = 0.0
        self.pending: list[float] = []

    def __call__(self) -> float:
        return self.now

    def next_sample(self) -> None:
        self.now += self.pending.pop()


def record_samples(benchmark: Any, clock: VirtualClock, samples_s: list[float], unit_tokens: int = 0) -> None:
    """One benchmark round per sample; percentiles (ms) into extra_info."""
    a = np.asarray(samples_s, dtype=np.float64) * 1e3
    benchmark.extra_info.update(
        samples=len(a),
        p50_ms=float(np.percentile(a, 50)),
        p90_ms=float(np.percentile(a, 90)),
        p99_ms=float(np.percentile(a, 99)),
    )
    if unit_tokens:
        benchmark.extra_info["tokens_per_sample"] = unit_tokens
    clock.pending = list(reversed(samples_s))
    # disabled (the default test run): pedantic runs the target once and records nothing
    benchmark.pedantic(clock.next_sample, rounds=len(samples_s), iterations=1, warmup_rounds=0)


def closed_loop(engine: Any, requests: list[Request], concurrency: int) -> list[RequestRecord]:
    """`concurrency` clients, each sending its next request when the previous one finished."""
    return asyncio.run(drive(engine_sender(engine), requests, [0.0] * len(requests), concurrency, progress=False))


def samples(records: list[RequestRecord], metric: str) -> list[float]:
    """Seconds: one per request (ttft, tpot, e2e) or one per generated token after the first (itl)."""
    if metric == "ttft":
        return [r.ttft for r in records]
    if metric == "tpot":
        return [t for r in records if (t := r.tpot) is not None]
    if metric == "itl":
        return [x for r in records for x in r.itls()]
    if metric == "e2e":
        return [r.e2e for r in records]
    raise ValueError(f"metric={metric!r}: one of ttft, tpot, itl, e2e")
