"""bench/profile.py and the step tracer (actors/transport/trace.py): the summary's figures on
hand-made step records, a valid Chrome trace, and a real engine's records in the right order."""

from __future__ import annotations

import json
import time

import pytest

from ringserve.actors.transport.trace import FIELDS, RUNNER_FIELDS, StepTrace
from ringserve.bench.profile import chrome_trace, format_summary, merge, summarize, write_chrome_trace

# three steps, times in seconds, as one scheduler thread and one runner thread would stamp them.
# device: step 1 [4, 14]; step 2 [14, 20] (dispatched at 12, while step 1 ran); step 3 [24, 30]
# (dispatched at 24: the device idled 20 -> 24; its watcher saw the end at 30.2, after the
# runner's own fetch at 30.0, which bounds it)
STEPS = [
    # step, dec, rows, ext, drows, loop, sched, send, sent, bytes, wait, got, done, b_in,
    #   r_start, applied, dispatched, fetch, ready, fetched
    (1, 0, 2, 300, 0, 0.0, 1.0, 2.0, 2.5, 1000, 11.0, 15.0, 16.0, 100, 3.0, 3.5, 4.0, 12.1, 14.0, 14.5),
    (2, 1, 2, 0, 2, 9.0, 9.5, 10.5, 11.0, 40, 17.0, 21.0, 22.0, 100, 11.5, 11.8, 12.0, 14.6, 20.0, 20.5),
    (3, 1, 2, 0, 2, 22.0, 22.2, 22.5, 22.8, 40, 22.9, 30.5, 31.5, 100, 23.0, 23.5, 24.0, 24.1, 30.2, 30.0),
]


def columns(steps=STEPS, base: float = 100.0) -> dict:
    """Stamps move to `base` + t (a perf_counter stamp is never 0: 0.0 means never taken)."""
    cols = {f: [s[i] + (base if f.startswith(("t_", "r_")) else 0) for s in steps] for i, f in enumerate(FIELDS)}
    cols["dropped"] = 0
    return cols


def test_summary_known_answers():
    s = summarize(columns())
    assert (s["steps"], s["decode_steps"], s["prefill_steps"]) == (3, 2, 1)
    assert s["device_busy_s"] == pytest.approx(10 + 6 + 6)
    assert s["device_span_s"] == pytest.approx(30 - 4)
    assert s["device_idle_fraction"] == pytest.approx(4 / 26)
    assert s["device_ms_per_decode_step"] == pytest.approx(6000)
    # scheduler host: schedule + send + process = 2.5, 2.5 and 0.3 + 0.3 + 1.0 s
    assert s["scheduler_host_ms_per_step"] == pytest.approx(6.6 / 3 * 1e3)
    assert s["host_over_forward"] == pytest.approx(6.6 / 22)
    # runner host: apply + build/dispatch + device-to-host (from max(fetch, ready) to fetched):
    # 0.5 + 0.5 + 0.5, 0.3 + 0.2 + 0.5, 0.5 + 0.5 + 0
    assert s["runner_host_ms_per_step"] == pytest.approx(3.5 / 3 * 1e3)
    assert s["runner_host_over_forward"] == pytest.approx(3.5 / 22)
    assert (s["bytes_per_step"], s["bytes_per_decode_step"], s["bytes_per_prefill_step"]) == pytest.approx((360, 40, 1000))
    assert s["stepmsg_ring_ms_per_step"] == pytest.approx((0.5 + 0.5 + 0.2) / 3 * 1e3)
    assert s["prefill_tokens_computed"] == 300
    assert s["window_s"] == pytest.approx(31.5 - 1.0)
    assert "device idle fraction     0.154" in format_summary(s)


def test_summary_is_by_step_order_and_merges_drains():
    a, b = columns(STEPS[2:]), columns(STEPS[:2])
    a["dropped"] = 2
    merged = merge([a, b])
    assert merged["dropped"] == 2 and merged["step_id"] == [3, 1, 2]
    s = summarize(merged)
    assert s["device_idle_fraction"] == pytest.approx(4 / 26) and s["dropped_records"] == 2
    assert summarize(columns([])) == {"steps": 0}


def check_chrome_trace(trace: dict) -> dict[str, int]:
    """Trace Event Format as Perfetto loads it; returns the count of each slice name."""
    trace = json.loads(json.dumps(trace))
    assert set(trace) == {"traceEvents", "displayTimeUnit"}
    names: dict[str, int] = {}
    tracks: dict[tuple, list] = {}
    opened: dict[tuple, float] = {}
    for e in trace["traceEvents"]:
        assert e["ph"] in ("M", "X", "b", "e", "C"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index") and "args" in e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] > 0
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
            names[e["name"]] = names.get(e["name"], 0) + 1
        elif e["ph"] == "b":
            opened[(e["cat"], e["id"], e["name"])] = e["ts"]
        elif e["ph"] == "e":
            assert opened.pop((e["cat"], e["id"], e["name"])) <= e["ts"]
    assert not opened, "async slices left open"
    for spans in tracks.values():  # slices on one track follow each other, never overlap
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end - 0.01
    return names


def test_chrome_trace_of_known_steps(tmp_path):
    path = write_chrome_trace(columns(), tmp_path / "t.trace.json")
    names = check_chrome_trace(json.loads(path.read_text()))
    assert names["prefill step"] == 1 and names["decode step"] == 2
    assert names["schedule"] == names["send"] == names["process"] == names["apply"] == 3
    assert names["wait device"] == 3 and names["device-to-host"] == 2  # step 3: on the host when fetched
    dev = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X" and e["pid"] == 4]
    # microseconds from the first stamp (the first loop, t = 0)
    assert [(e["ts"], e["dur"]) for e in dev] == [(4e6, 10e6), (14e6, 6e6), (24e6, 6e6)]


def test_step_trace_keeps_the_last_records_and_counts_drops():
    class B:
        def __init__(self, step_id):
            self.step_id, self.is_decode, self.rows = step_id, True, []

    tr = StepTrace(2)
    for i in range(1, 4):
        tr.sent(B(i), 1.0, 2.0, 10)
        tr.scheduled(i, 0.5, 0.7)
        tr.finished(i, b"", 3.0, 4.0, 20)
    cols = tr.drain()
    assert cols["step_id"] == [2, 3] and cols["dropped"] == 1
    assert cols["t_loop"] == [0.5, 0.5] and cols["bytes_in"] == [20, 20]
    assert all(cols[f] == [0.0, 0.0] for f in RUNNER_FIELDS)  # a runner that sent no stamps
    assert tr.drain()["step_id"] == [] and tr.drain()["dropped"] == 0


SMALL = dict(max_running_requests=16, context_length=256, max_prefill_tokens=256, max_total_tokens=16 * 512)


def test_engine_step_trace_is_ordered_and_loads_in_perfetto(tiny_dir, tmp_path):
    from ringserve import Engine

    prompts = [[5 + i] * (20 + i) for i in range(4)]
    with Engine(str(tiny_dir("llama")), step_trace=1000, **SMALL) as engine:
        engine.get_server_info()
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "ignore_eos": True})
        # with overlap, a step planned before the last token came back may still be in flight when
        # generate returns: drain until the scheduler has nothing in flight, merging what comes
        cols: dict = {}
        for _ in range(200):
            info = engine.get_server_info()
            for f, v in info["step_trace"].items():
                cols[f] = cols.get(f, 0) + v if f == "dropped" else cols.get(f, []) + v
            if info["in_flight"] == 0 and info["running_batch_size"] == 0:
                break
            time.sleep(0.01)
        assert engine.get_server_info()["step_trace"]["step_id"] == []  # drained
    n = len(cols["step_id"])
    assert n >= 6 and cols["dropped"] == 0
    assert sum(cols["extend_tokens"]) == sum(map(len, prompts))  # no prefix in common: all computed
    assert sum(cols["decode_rows"]) >= 4 * 5  # 5 decode tokens each (overlap may add a discarded one)
    for i in range(n):
        c = {f: cols[f][i] for f in FIELDS}
        # one monotonic clock across the processes: the scheduler's and the runner's stamps interleave
        # (t_sent is stamped after the ring write returns: the runner may already have started)
        assert c["t_loop"] <= c["t_sched"] <= c["t_send"] <= c["t_sent"] and c["t_send"] <= c["r_start"]
        assert c["r_start"] <= c["r_applied"] <= c["r_dispatched"] <= c["r_fetch"] <= c["r_fetched"] <= c["t_got"]
        assert c["t_wait"] <= c["t_got"] <= c["t_done"]
        assert c["r_dispatched"] <= c["r_ready"] and c["bytes_out"] > 0 and c["bytes_in"] > 0
    s = summarize(cols)
    assert 0.0 <= s["device_idle_fraction"] < 1.0 and s["host_over_forward"] > 0
    names = check_chrome_trace(chrome_trace(cols))
    assert names["decode step"] + names["prefill step"] == n
