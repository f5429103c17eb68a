"""Serving metrics from client-side request records, defined as SGLang's bench_serving does.

Per request (times in seconds on the client's `time.perf_counter()` clock):

    sent ──── first chunk ── chunk ── chunk ── ... ── last chunk = done
         TTFT              ITL      ITL
    E2E  = done - sent
    TPOT = (E2E - TTFT) / (output_len - 1)          (requests with output_len > 1)
    ITL  = gap between consecutive chunks / the tokens the later chunk brought, once per token
           (a chunk carrying k tokens after a gap g counts k intervals of g / k)

Run metrics: `duration` = first send to last finish; throughputs are per second of duration
(request, input = prompt tokens, output = generated tokens, total = input + output); each
latency gets mean, median, p90, p99 (and std, max) in milliseconds under keys such as
`ttft_ms_p99`, `itl_ms_median`, `e2e_ms_mean`. Percentiles interpolate linearly (numpy's
default). Failed requests count in `failed` and in no other figure.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

LATENCIES = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "median", "p90", "p99", "std", "max")


@dataclasses.dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    sent: float = 0.0  # when the request left the client
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # each chunk with new tokens
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)  # new tokens in that chunk
    done: float = 0.0
    output_len: int = 0  # tokens generated (the server's count)
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (if reported)
    output_ids: list[int] | None = None  # the generated ids (if the backend reports them)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_len > 0

    @property
    def ttft(self) -> float:
        return (self.chunk_times[0] if self.chunk_times else self.done) - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    def itls(self) -> list[float]:
        out: list[float] = []
        for i in range(1, len(self.chunk_times)):
            k = self.chunk_tokens[i]
            if k > 0:
                out += [(self.chunk_times[i] - self.chunk_times[i - 1]) / k] * k
        return out


def summarize(values_s: list[float], name: str) -> dict[str, float | None]:
    """{name_ms_mean, name_ms_median, name_ms_p90, name_ms_p99, name_ms_std, name_ms_max}."""
    if not values_s:
        return {f"{name}_ms_{s}": None for s in STATS}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    vals = [a.mean(), np.median(a), np.percentile(a, 90), np.percentile(a, 99), a.std(), a.max()]
    return {f"{name}_ms_{s}": float(v) for s, v in zip(STATS, vals, strict=True)}


def compute_metrics(records: list[RequestRecord], streamed: bool = True) -> dict[str, Any]:
    """Every run metric of `records` (see the module docstring). Without streaming a request has
    no chunks: TTFT, TPOT and ITL are then None (E2E and throughputs stay exact)."""
    ok = [r for r in records if r.ok]
    m: dict[str, float | int | None] = {"completed": len(ok), "failed": len(records) - len(ok)}
    if not ok:
        return m
    start = min(r.sent for r in ok)
    duration = max(r.done for r in ok) - start
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    m.update(
        duration_s=duration,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) / duration,
        input_throughput=n_in / duration,
        output_throughput=n_out / duration,
        total_throughput=(n_in + n_out) / duration,
        concurrency=sum(r.e2e for r in ok) / duration,  # mean requests in flight
    )
    if streamed:
        m.update(summarize([r.ttft for r in ok], "ttft"))
        m.update(summarize([t for r in ok if (t := r.tpot) is not None], "tpot"))
        m.update(summarize([x for r in ok for x in r.itls()], "itl"))
    else:
        for name in ("ttft", "tpot", "itl"):
            m.update(summarize([], name))
    m.update(summarize([r.e2e for r in ok], "e2e"))
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if len(cached) == len(ok):
        m["cached_prompt_tokens"] = sum(cached)
    return m


def format_table(runs: list[dict], title: str = "") -> str:
    """One column per run (its "label"), one row per headline metric."""
    rows = [
        ("completed", "completed", "{:.0f}"), ("duration (s)", "duration_s", "{:.2f}"),
        ("request throughput (req/s)", "request_throughput", "{:.2f}"),
        ("input throughput (tok/s)", "input_throughput", "{:.1f}"),
        ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("total throughput (tok/s)", "total_throughput", "{:.1f}"),
        ("mean concurrency", "concurrency", "{:.1f}"),
    ]  # fmt: skip
    for lat, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        for s in ("mean", "median", "p90", "p99"):
            rows.append((f"{label} {s} (ms)", f"{lat}_ms_{s}", "{:.2f}"))
    labels = [str(r.get("label", i)) for i, r in enumerate(runs)]
    width = max(14, *(len(x) + 2 for x in labels))
    lines = [title] if title else []
    lines.append(f"{'':30s}" + "".join(f"{x:>{width}s}" for x in labels))
    for name, key, fmt in rows:
        cells = []
        for r in runs:
            v = r.get(key)
            cells.append(f"{'-' if v is None else fmt.format(v):>{width}s}")
        lines.append(f"{name:30s}" + "".join(cells))
    return "\n".join(lines)
