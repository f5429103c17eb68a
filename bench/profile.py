"""The timeline profiler: step records (actors/transport/trace.py, `get_server_info()["step_trace"]`)
turned into a Chrome trace JSON (opens in Perfetto / chrome://tracing) and a summary.

Tracks (one Chrome "process" each; timestamps in microseconds from the first record):

    scheduler  recv (requests; a blocking wait when idle) | schedule | send (StepMsg, encode,
               ring write) | wait runner | process (book tokens, outputs to the detokenizer)
    rings      StepMsg in ring (sent -> runner picks it up), result in ring (runner has the
               tokens -> scheduler reads them); async slices, they may overlap
    runner     apply (StepMsg -> slot mirrors) | build + dispatch (inputs, device_put, launch)
               | wait device | device-to-host
    device     one slice per step: from max(dispatched, previous step ready) to ready

Summary (per step means unless named otherwise; see `summarize`):
    device_idle_fraction  1 - device busy / (last ready - first device start)
    host_over_forward     scheduler host time (schedule + send + process) / device time
    bytes_per_step        StepMsg bytes scheduler -> runner (decode and prefill steps apart),
                          result bytes runner -> scheduler
The device's ready time comes from a watcher thread and can lag (see trace.py): device time is an
upper bound, idle a lower bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.actors.transport.trace import FIELDS


def records(cols: dict[str, list]) -> dict[str, np.ndarray]:
    """Columns as float64 arrays, ordered by step id; device start/ready derived."""
    order = np.argsort(np.asarray(cols["step_id"], dtype=np.int64), kind="stable")
    r = {f: np.asarray(cols[f], dtype=np.float64)[order] for f in FIELDS}
    ready = np.minimum(r["r_ready"], r["r_fetched"])  # the runner's own fetch bounds the watcher's lag
    prev_ready = np.concatenate([[-np.inf], ready[:-1]])
    r["dev_ready"] = ready
    r["dev_start"] = np.maximum(r["r_dispatched"], prev_ready)
    return r


def merge(chunks: list[dict[str, list]]) -> dict[str, list]:
    """Concatenate drained step_trace columns (several get_server_info calls)."""
    out: dict[str, list] = {f: [] for f in FIELDS}
    dropped = 0
    for c in chunks:
        for f in FIELDS:
            out[f] += list(c.get(f, []))
        dropped += int(c.get("dropped", 0))  # type: ignore[arg-type]
    out["dropped"] = dropped  # type: ignore[assignment]
    return out


def summarize(cols: dict[str, list]) -> dict[str, Any]:
    n = len(cols["step_id"])
    if n == 0:
        return {"steps": 0}
    r = records(cols)
    dec = r["is_decode"] > 0
    device = r["dev_ready"] - r["dev_start"]
    span = r["dev_ready"][-1] - r["dev_start"][0]
    sched_host = (r["t_send"] - r["t_sched"]) + (r["t_sent"] - r["t_send"]) + (r["t_done"] - r["t_got"])
    runner_host = (r["r_applied"] - r["r_start"]) + (r["r_dispatched"] - r["r_applied"]) + (
        r["r_fetched"] - np.maximum(r["r_fetch"], r["dev_ready"])
    )

    def ms(a: np.ndarray) -> float | None:
        return float(a.mean() * 1e3) if len(a) else None

    def mean(a: np.ndarray) -> float | None:
        return float(a.mean()) if len(a) else None

    dev_total = float(device.sum())
    return {
        "steps": n,
        "decode_steps": int(dec.sum()),
        "prefill_steps": int((~dec).sum()),
        "dropped_records": int(cols.get("dropped", 0) or 0),  # type: ignore[call-overload,arg-type]
        "window_s": float(r["t_done"][-1] - r["t_sched"][0]),
        "device_span_s": float(span),
        "device_busy_s": dev_total,
        "device_idle_fraction": float(max(0.0, 1.0 - dev_total / span)) if span > 0 else None,
        "device_ms_per_step": ms(device),
        "device_ms_per_decode_step": ms(device[dec]),
        "device_ms_per_prefill_step": ms(device[~dec]),
        "scheduler_host_ms_per_step": ms(sched_host),
        "schedule_ms_per_step": ms(r["t_send"] - r["t_sched"]),
        "send_ms_per_step": ms(r["t_sent"] - r["t_send"]),
        "process_ms_per_step": ms(r["t_done"] - r["t_got"]),
        "recv_ms_per_step": ms(r["t_sched"] - r["t_loop"]),
        "runner_host_ms_per_step": ms(runner_host),
        "apply_ms_per_step": ms(r["r_applied"] - r["r_start"]),
        "build_dispatch_ms_per_step": ms(r["r_dispatched"] - r["r_applied"]),
        "d2h_ms_per_step": ms(r["r_fetched"] - np.maximum(r["r_fetch"], r["dev_ready"])),
        "stepmsg_ring_ms_per_step": ms(r["r_start"] - np.minimum(r["t_sent"], r["r_start"])),  # 0 if it started first
        "result_ring_ms_per_step": ms(r["t_got"] - np.maximum(r["r_fetched"], r["t_wait"])),
        "host_over_forward": float(sched_host.sum() / dev_total) if dev_total > 0 else None,
        "runner_host_over_forward": float(runner_host.sum() / dev_total) if dev_total > 0 else None,
        "bytes_per_step": mean(r["bytes_out"]),
        "bytes_per_decode_step": mean(r["bytes_out"][dec]),
        "bytes_per_prefill_step": mean(r["bytes_out"][~dec]),
        "result_bytes_per_step": mean(r["bytes_in"]),
        "decode_rows_per_decode_step": mean(r["decode_rows"][dec]),
        "prefill_tokens_computed": int(r["extend_tokens"].sum()),
    }


PROCESSES = {1: "scheduler", 2: "rings", 3: "runner", 4: "device"}


def chrome_trace(cols: dict[str, list]) -> dict[str, Any]:
    """Trace Event Format: {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    events: list[dict[str, Any]] = []
    for pid, name in PROCESSES.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    if not cols["step_id"]:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    r = records(cols)
    stamps = np.concatenate([r[f] for f in FIELDS if f.startswith(("t_", "r_"))])
    t0 = float(stamps[stamps > 0].min())  # 0.0: a stamp never taken

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    def span(pid: int, tid: int, name: str, a: float, b: float, args: dict | None = None) -> None:
        if b > a > 0:
            ev = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": us(a), "dur": round((b - a) * 1e6, 3)}
            if args:
                ev["args"] = args
            events.append(ev)

    for i in range(len(r["step_id"])):
        g = {f: float(r[f][i]) for f in r}
        sid = int(g["step_id"])
        kind = "decode" if g["is_decode"] else "prefill"
        info = {"step": sid, "kind": kind, "rows": int(g["rows"]), "extend_tokens": int(g["extend_tokens"]),
                "decode_rows": int(g["decode_rows"])}  # fmt: skip
        span(1, 1, "recv", g["t_loop"], g["t_sched"])
        span(1, 1, "schedule", g["t_sched"], g["t_send"], info)
        span(1, 1, "send", g["t_send"], g["t_sent"], {"step": sid, "bytes": int(g["bytes_out"])})
        span(1, 1, "wait runner", g["t_wait"], g["t_got"], {"step": sid})
        span(1, 1, "process", g["t_got"], g["t_done"], {"step": sid, "bytes": int(g["bytes_in"])})
        for tid, name, a, b in ((1, "StepMsg in ring", g["t_sent"], g["r_start"]),
                                (2, "result in ring", g["r_fetched"], g["t_got"])):  # fmt: skip
            if b > a > 0:
                events.append({"ph": "b", "cat": "ring", "name": name, "id": sid, "pid": 2, "tid": tid, "ts": us(a)})
                events.append({"ph": "e", "cat": "ring", "name": name, "id": sid, "pid": 2, "tid": tid, "ts": us(b)})
        span(3, 1, "apply", g["r_start"], g["r_applied"], {"step": sid})
        span(3, 1, "build + dispatch", g["r_applied"], g["r_dispatched"], {"step": sid})
        span(3, 1, "wait device", g["r_fetch"], g["dev_ready"], {"step": sid})
        span(3, 1, "device-to-host", max(g["r_fetch"], g["dev_ready"]), g["r_fetched"], {"step": sid})
        span(4, 1, f"{kind} step", g["dev_start"], g["dev_ready"], info)
        events.append({"ph": "C", "name": "batch", "pid": 1, "tid": 1, "ts": us(g["t_send"]),
                       "args": {"extend_tokens": int(g["extend_tokens"]), "decode_rows": int(g["decode_rows"])}})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(cols: dict[str, list], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(cols)))
    return path


def format_summary(s: dict[str, Any]) -> str:
    def f(key: str, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
        v = s.get(key)
        return "-" if v is None else f"{v * scale:.{digits}f}{unit}"

    return "\n".join([
        f"step profile: {s.get('steps', 0)} steps ({s.get('decode_steps', 0)} decode, {s.get('prefill_steps', 0)} prefill)"
        + (f", {s['dropped_records']} records dropped" if s.get("dropped_records") else ""),
        f"  device idle fraction     {f('device_idle_fraction', digits=3)}  (busy {f('device_busy_s', ' s', digits=2)} of {f('device_span_s', ' s', digits=2)})",
        f"  host / forward           {f('host_over_forward')} (scheduler)   {f('runner_host_over_forward')} (runner)",
        f"  device per step          {f('device_ms_per_step', ' ms')}  (decode {f('device_ms_per_decode_step', ' ms')}, prefill {f('device_ms_per_prefill_step', ' ms')})",
        f"  scheduler per step       schedule {f('schedule_ms_per_step', ' ms')}  send {f('send_ms_per_step', ' ms')}  process {f('process_ms_per_step', ' ms')}  recv {f('recv_ms_per_step', ' ms')}",
        f"  runner per step          apply {f('apply_ms_per_step', ' ms')}  build+dispatch {f('build_dispatch_ms_per_step', ' ms')}  d2h {f('d2h_ms_per_step', ' ms')}",
        f"  rings per step           StepMsg {f('stepmsg_ring_ms_per_step', ' ms')}  result {f('result_ring_ms_per_step', ' ms')}",
        f"  bytes per step           {f('bytes_per_step', ' B', digits=0)} (decode {f('bytes_per_decode_step', ' B', digits=0)}, prefill {f('bytes_per_prefill_step', ' B', digits=0)}; result {f('result_bytes_per_step', ' B', digits=0)})",
    ])  # fmt: skip
