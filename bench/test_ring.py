"""Ring latency and throughput next to multiprocessing.Pipe, multiprocessing.Queue and ZeroMQ ipc,
with the two processes pinned to different cores and to one core; and msgspec encode+decode of a
256-request decode step.

    .venv/bin/python -m pytest bench/test_ring.py --benchmark-enable -p no:cacheprovider

prints a table: round trip p50/p99 (us) of 64 B and 64 KB messages, one-way 1 KB messages/s.
Without --benchmark-enable every case runs a few iterations as a smoke test.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import tempfile
import time

import numpy as np
import pytest

from ringserve.actors.transport import messages as m
from ringserve.actors.transport.ring import Ring

TRANSPORTS = ["ring-spin", "ring-sleep", "pipe", "queue", "zmq"]
CPUS = sorted(os.sched_getaffinity(0))
PLACEMENTS = {"cross-core": (CPUS[0], CPUS[-1]), "same-core": (CPUS[0], CPUS[0])}
TABLE: dict[tuple[str, str], dict[str, float]] = {}
ENABLED: list[bool] = []  # non-empty once a case ran with --benchmark-enable


class Link:
    """One end of a bidirectional byte-message channel of the given kind."""

    def __init__(self, kind: str, ends: tuple, child: bool) -> None:
        self.kind = kind
        if kind.startswith("ring"):
            spin = 50 if kind == "ring-spin" else 0
            a, b = (Ring.attach(n, spin_us=spin) for n in ends)
            self.tx, self.rx = (b, a) if child else (a, b)
            self.send, self.recv = self.tx.send, self.rx.recv
        elif kind == "pipe":
            conn = ends[1] if child else ends[0]
            self.send, self.recv = conn.send_bytes, conn.recv_bytes
        elif kind == "queue":
            tx, rx = (ends[1], ends[0]) if child else ends
            self.send, self.recv = tx.put, rx.get
        else:
            import zmq

            self._ctx = zmq.Context()
            self.sock = self._ctx.socket(zmq.PAIR)
            (self.sock.connect if child else self.sock.bind)(ends[0])
            self.send, self.recv = self.sock.send, self.sock.recv


def peer(kind: str, ends: tuple, cpu: int) -> None:
    """Child process: echo messages of >= 32 bytes; b"S<n>": swallow n messages, answer b"done"."""
    os.sched_setaffinity(0, {cpu})
    link = Link(kind, ends, child=True)
    while True:
        msg = link.recv()
        if len(msg) >= 32:
            link.send(msg)
        elif msg == b"stop":
            return
        else:
            recv = link.recv
            for _ in range(int(msg[1:])):
                recv()
            link.send(b"done")


@pytest.fixture(scope="module", params=[f"{t}/{p}" for p in PLACEMENTS for t in TRANSPORTS])
def link(request):
    kind, placement = request.param.split("/")
    if placement == "cross-core" and len(CPUS) < 2:
        pytest.skip("needs two cores")
    mine, theirs = PLACEMENTS[placement]
    mp = multiprocessing.get_context("spawn")
    owned: list[Ring] = []
    if kind.startswith("ring"):
        owned = [Ring.create("bench", 1 << 22), Ring.create("bench", 1 << 22)]
        ends: tuple = tuple(r.name for r in owned)
    elif kind == "pipe":
        ends = mp.Pipe()
    elif kind == "queue":
        ends = (mp.Queue(), mp.Queue())
    else:
        ends = (f"ipc://{tempfile.gettempdir()}/rs-bench-{os.getpid()}-{secrets.token_hex(4)}",)
    here = Link(kind, ends, child=False)
    proc = mp.Process(target=peer, args=(kind, ends, theirs), daemon=True)
    proc.start()
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {mine})
    try:
        for _ in range(200):  # the peer is up and both sides are warm
            here.send(b"w" * 64)
            assert here.recv() == b"w" * 64
        here.id = request.param  # type: ignore[attr-defined]
        yield here
    finally:
        os.sched_setaffinity(0, saved)
        here.send(b"stop")
        proc.join(10)
        for r in owned:
            r.close()
        if kind == "zmq":
            here.sock.close(linger=0)
            here._ctx.term()
            os.unlink(ends[0].removeprefix("ipc://"))


def _round_trip(benchmark, link, size: int, trips: int) -> None:
    msg = os.urandom(size)
    trips = trips if not benchmark.disabled else 20
    times: list[int] = []
    clock, send, recv = time.perf_counter_ns, link.send, link.recv

    def run() -> None:
        for _ in range(trips):
            t = clock()
            send(msg)
            got = recv()
            times.append(clock() - t)
        assert got == msg

    benchmark.pedantic(run, rounds=5, iterations=1)
    ENABLED.extend([] if benchmark.disabled else [True])
    p50, p99 = np.percentile(times, [50, 99]) / 1e3
    benchmark.extra_info.update(p50_us=p50, p99_us=p99)
    TABLE.setdefault(tuple(link.id.split("/")), {}).update({f"{size} B p50": p50, f"{size} B p99": p99})


def test_round_trip_64b(benchmark, link):
    _round_trip(benchmark, link, 64, 2000)


def test_round_trip_64kb(benchmark, link):
    _round_trip(benchmark, link, 1 << 16, 300)


def test_one_way_throughput_1kb(benchmark, link):
    n = 100_000 if not benchmark.disabled else 100
    if link.kind == "queue" or "same-core" in link.id:
        n //= 4
    msg = os.urandom(1024)
    rates: list[float] = []

    def run() -> None:
        link.send(b"S%d" % n)
        send = link.send
        t = time.perf_counter()
        for _ in range(n):
            send(msg)
        assert link.recv() == b"done"
        rates.append(n / (time.perf_counter() - t))

    benchmark.pedantic(run, rounds=3, iterations=1)
    rate = float(np.median(rates))
    benchmark.extra_info["msgs_per_s"] = rate
    TABLE.setdefault(tuple(link.id.split("/")), {})["1 KB msg/s"] = rate


def test_decode_step_message_encode_decode(benchmark):
    """msgspec encode + typed decode of a decode step for 256 running requests."""
    rng = np.random.default_rng(0)
    new_page = rng.random(256) < 1 / 16
    step = m.StepMsg(step_id=12345, released=m.i32([3, 9]), slots=m.i32(np.arange(256)),
                     committed=m.i32(rng.integers(1, 4096, 256)), token_counts=m.i32(np.ones(256)),
                     tokens=m.i32(-(np.arange(256) + 1)), page_counts=m.i32(new_page),
                     pages=m.i32(rng.integers(1, 1 << 16, int(new_page.sum()))), keep=m.u8(np.ones(256)))  # fmt: skip

    def round_trip() -> m.StepMsg:
        return m.to_runner.decode(m.encode(step))  # type: ignore[no-any-return]

    assert benchmark(round_trip) == step
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats else float("nan")
    TABLE[("msgspec", "step of 256")] = {"bytes": float(len(m.encode(step))), "us": median * 1e6}


@pytest.fixture(scope="module", autouse=True)
def _print_table(request):
    """After the module: the table, written past pytest's output capture."""
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    cap = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is None or cap is None or not TABLE or not ENABLED:
        return
    lat = ["64 B p50", "64 B p99", "65536 B p50", "65536 B p99"]
    lines = [
        "",
        f"{'transport':11s} {'placement':10s} "
        + " ".join(f"{c:>11s}" for c in lat)
        + f" {'1 KB msg/s':>11s}",
    ]
    order = {t: i for i, t in enumerate(TRANSPORTS)}
    for (kind, placement), row in sorted(TABLE.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 99))):
        if kind in order:
            cells = " ".join(f"{row.get(c, float('nan')):11.1f}" for c in lat)
            lines.append(f"{kind:11s} {placement:10s} {cells} {row.get('1 KB msg/s', float('nan')):11,.0f}")
    lines.append("(round-trip latency in us)")
    if ("msgspec", "step of 256") in TABLE:
        row = TABLE[("msgspec", "step of 256")]
        lines.append(
            f"msgspec encode+decode, decode step of 256 requests ({row['bytes']:.0f} B): {row['us']:.2f} us"
        )
    with cap.global_and_fixture_disabled():
        for line in lines:
            tr.write_line(line)
