"""The opt-in step tracer: per step, when the scheduler and the runner did what (off by default).

With `ServerArgs.step_trace = N > 0` the runner stamps each step and sends the stamps back in
`StepResultMsg.times`; the scheduler joins them with its own and keeps the last N completed
steps, which `get_server_info()["step_trace"]` hands out (and forgets: each call returns the
steps completed since the previous one). `bench/profile.py` turns them into a Chrome trace and a
summary. Off, nothing is stamped and nothing extra crosses a ring.

Times are `time.perf_counter()` seconds: CLOCK_MONOTONIC, one clock for every process on the
host, so the scheduler's and the runner's stamps lie on one timeline. One step, in order:

    scheduler  loop ─ recv requests ─ sched ─ get_next_batch ─ send ─ StepMsg+encode+ring ─ sent
               ... (overlap: plans N+1) ...  wait ─ block on the result ring ─ got ─ process ─ done
    runner     start ─ apply msg to mirrors ─ applied ─ build + dispatch ─ dispatched
               ... (may dispatch N+1) ...     fetch ─ wait for the device, device-to-host ─ fetched
    device     compute from max(dispatched, previous step's ready) to ready

`ready` is taken by a watcher thread blocked on the step's output (the runner's own thread may be
busy building the next step when the device finishes); it can lag by the time that thread
waits for the GIL, so device time is an upper bound and idle time a lower bound.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

import numpy as np

# runner stamps, in StepResultMsg.times (float64 little-endian, this order)
RUNNER_FIELDS = ("r_start", "r_applied", "r_dispatched", "r_fetch", "r_ready", "r_fetched")
# scheduler fields of one step record, then the runner's
SCHED_FIELDS = (
    "step_id", "is_decode", "rows", "extend_tokens", "decode_rows",
    "t_loop", "t_sched", "t_send", "t_sent", "bytes_out",
    "t_wait", "t_got", "t_done", "bytes_in",
)  # fmt: skip
FIELDS = SCHED_FIELDS + RUNNER_FIELDS


class StepTrace:
    """The scheduler's side: the last `capacity` completed step records (plus the <= 2 in flight).

    `scheduled` and `sent` are called when a batch leaves, `finished` when its result is
    processed; `drain` returns the completed records as columns {field: [values]} and forgets them.
    """

    def __init__(self, capacity: int):
        assert capacity > 0
        self.done: collections.deque[tuple] = collections.deque(maxlen=capacity)
        self.open: dict[int, list] = {}
        self.dropped = 0  # completed records pushed out before anyone drained them

    def sent(self, batch: Any, t_send: float, t_sent: float, nbytes: int) -> None:
        extend = sum(r.extend_len for r in batch.rows if not r.reads_future)
        decode = sum(1 for r in batch.rows if r.reads_future)
        self.open[batch.step_id] = [batch.step_id, int(batch.is_decode), len(batch.rows), extend, decode,
                                    0.0, 0.0, t_send, t_sent, nbytes]  # fmt: skip

    def scheduled(self, step_id: int, t_loop: float, t_sched: float) -> None:
        rec = self.open.get(step_id)
        if rec is not None:
            rec[5], rec[6] = t_loop, t_sched

    def finished(self, step_id: int, runner_times: bytes, t_wait: float, t_got: float, nbytes: int) -> None:
        rec = self.open.pop(step_id, None)
        if rec is None:
            return
        r = np.frombuffer(runner_times, "<f8").tolist() if runner_times else [0.0] * len(RUNNER_FIELDS)
        if len(self.done) == self.done.maxlen:
            self.dropped += 1
        self.done.append((*rec, t_wait, t_got, time.perf_counter(), nbytes, *r))

    def drain(self) -> dict[str, Any]:
        rows = list(self.done)
        self.done.clear()
        cols: dict[str, Any] = {f: [row[i] for row in rows] for i, f in enumerate(FIELDS)}
        cols["dropped"], self.dropped = self.dropped, 0
        return cols


class RunnerStamps:
    """The runner's side: stamps each step; a watcher thread notes when the device finished it."""

    def __init__(self) -> None:
        self.marks: dict[int, list[float]] = {}
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._watch, name="step-ready-watcher", daemon=True).start()

    def _watch(self) -> None:
        while True:
            step_id, arr = self.todo.get()
            try:
                arr.block_until_ready()
            finally:
                self.ready.put((step_id, time.perf_counter()))

    def dispatched(self, step_id: int, t_start: float, t_applied: float, out: Any) -> None:
        self.marks[step_id] = [t_start, t_applied, time.perf_counter()]
        self.todo.put((step_id, out))

    def fetching(self, step_id: int) -> None:
        self.marks[step_id].append(time.perf_counter())

    def fetched(self, step_id: int) -> bytes:
        """The step's stamps (RUNNER_FIELDS) once its output is on the host."""
        t_fetched = time.perf_counter()
        ready_id, t_ready = self.ready.get()  # steps finish in dispatch order
        assert ready_id == step_id, f"device finished step {ready_id}, runner fetched {step_id}"
        m = self.marks.pop(step_id)
        return np.asarray([*m, t_ready, t_fetched], "<f8").tobytes()
