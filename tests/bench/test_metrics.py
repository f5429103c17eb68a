"""bench/metrics.py on hand-made request records whose figures are worked out by hand."""

from __future__ import annotations

import pytest

from ringserve.bench.metrics import RequestRecord, compute_metrics, format_table, summarize


def records() -> list[RequestRecord]:
    a = RequestRecord(prompt_len=10, sent=0.0, chunk_times=[0.1, 0.2, 0.4], chunk_tokens=[1, 1, 2], done=0.4, output_len=4,
                      cached_tokens=0)  # fmt: skip
    b = RequestRecord(prompt_len=20, sent=0.5, chunk_times=[0.8, 1.0], chunk_tokens=[1, 1], done=1.0, output_len=2,
                      cached_tokens=16)  # fmt: skip
    failed = RequestRecord(prompt_len=99, sent=0.2, done=5.0, error="HTTP 500")
    return [a, b, failed]


def test_per_request_figures():
    a, b, failed = records()
    assert a.ttft == pytest.approx(0.1) and a.e2e == pytest.approx(0.4)
    assert a.tpot == pytest.approx(0.1)  # (0.4 - 0.1) / (4 - 1)
    assert a.itls() == pytest.approx([0.1, 0.1, 0.1])  # the last chunk brought 2 tokens after 0.2 s
    assert b.tpot == pytest.approx(0.2) and b.itls() == pytest.approx([0.2])
    assert not failed.ok
    one = RequestRecord(prompt_len=5, sent=1.0, chunk_times=[1.5], chunk_tokens=[1], done=1.5, output_len=1)
    assert one.tpot is None and one.itls() == [] and one.ttft == pytest.approx(0.5)


def test_run_metrics_known_answers():
    m = compute_metrics(records())
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["duration_s"] == pytest.approx(1.0)  # first send 0.0 -> last finish 1.0 (the failed one ignored)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["input_throughput"] == pytest.approx(30.0)
    assert m["output_throughput"] == pytest.approx(6.0)
    assert m["total_throughput"] == pytest.approx(36.0)
    assert m["concurrency"] == pytest.approx(0.9)  # (0.4 + 0.5) s in flight over 1 s
    # TTFT [100, 300] ms; numpy's linear percentiles: p90 = 100 + 0.9 * 200, p99 = 100 + 0.99 * 200
    assert (m["ttft_ms_mean"], m["ttft_ms_median"], m["ttft_ms_p90"], m["ttft_ms_p99"]) == pytest.approx((200, 200, 280, 298))
    assert m["ttft_ms_max"] == pytest.approx(300) and m["ttft_ms_std"] == pytest.approx(100)
    # ITL [100, 100, 100, 200] ms: p90 at rank 2.7 -> 100 + 0.7 * 100, p99 at rank 2.97
    assert (m["itl_ms_mean"], m["itl_ms_median"], m["itl_ms_p90"], m["itl_ms_p99"]) == pytest.approx((125, 100, 170, 197))
    assert (m["tpot_ms_mean"], m["tpot_ms_median"]) == pytest.approx((150, 150))
    assert (m["e2e_ms_mean"], m["e2e_ms_median"], m["e2e_ms_max"]) == pytest.approx((450, 450, 500))
    assert m["cached_prompt_tokens"] == 16


def test_without_streaming_latencies_but_e2e_are_none():
    m = compute_metrics(records(), streamed=False)
    assert m["ttft_ms_p99"] is None and m["itl_ms_median"] is None and m["tpot_ms_mean"] is None
    assert m["e2e_ms_mean"] == pytest.approx(450) and m["output_throughput"] == pytest.approx(6.0)


def test_nothing_completed():
    assert compute_metrics([RequestRecord(prompt_len=3, error="boom")]) == {"completed": 0, "failed": 1}
    assert summarize([], "ttft") == {f"ttft_ms_{s}": None for s in ("mean", "median", "p90", "p99", "std", "max")}


def test_table_lists_every_run_and_headline_metric():
    m = compute_metrics(records())
    text = format_table([{**m, "label": "engine"}, {"label": "empty"}], "title")
    lines = text.splitlines()
    assert lines[0] == "title" and lines[1].split() == ["engine", "empty"]
    row = {ln[:30].strip(): ln[30:].split() for ln in lines[2:]}
    assert row["output throughput (tok/s)"] == ["6.0", "-"]
    assert row["ITL p99 (ms)"] == ["197.00", "-"]
    assert row["TTFT p90 (ms)"] == ["280.00", "-"]


def test_chunked_prefill_window_against_steady_median():
    """bench/chunked_prefill.analyse: decoder ITLs that overlap the long prompt's prefill window
    (sent 1.0, first token 1.5) are the window; the ratios divide by the median outside it."""
    from ringserve.bench.chunked_prefill import analyse

    # a decoder streaming a token every 0.1 s, except one 0.4 s stall inside the window
    times = [0.1 * i for i in range(1, 11)] + [1.4, 1.5, 1.6, 1.7, 1.8]
    dec = RequestRecord(prompt_len=64, sent=0.0, chunk_times=times, chunk_tokens=[1] * len(times), output_len=len(times))
    long = RequestRecord(prompt_len=4096, sent=1.0, chunk_times=[1.5], chunk_tokens=[1], output_len=1)
    r = analyse([dec], long)
    # ITLs: nine of 0.1 up to t=1.0 (steady), 1.0->1.4 (0.4, window), 1.4->1.5 (0.1, window), then 3 steady
    assert r["steady_samples"] == 12 and r["window_samples"] == 2
    assert r["itl_median_ms"] == pytest.approx(100.0)
    assert r["window_max_ms"] == pytest.approx(400.0) and r["window_median_ms"] == pytest.approx(250.0)
    assert r["window_p99_over_median"] == pytest.approx(r["window_p99_ms"] / 100.0)
    assert r["long_ttft_ms"] == pytest.approx(500.0) and r["long_prefill_window_ms"] == pytest.approx(500.0)
