"""Shared-memory rings: order and content across wrap-around (cross-process), broadcast with a
slow reader, split messages, back-pressure, timeouts, closure, a reader killed mid-stream."""

from __future__ import annotations

import glob
import os
import signal
import stat
import threading
import time
import zlib

import msgspec
import numpy as np
import pytest

from ringserve.actors.transport.ring import BroadcastRing, Ring, RingClosed, RingTimeout, shm_files

N_FRAMES = 1_000_000


def _leftovers(name: str) -> list[str]:
    return glob.glob(f"/dev/shm/*{name.lstrip('/')}*")


def _stream(seed: int, n: int, max_size: int) -> tuple[np.ndarray, bytes]:
    """A seeded stream: payload sizes, and a byte pool that payload i is a slice of."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, max_size + 1, n), rng.bytes(1 << 16)


def _payload(pool: bytes, i: int, size: int) -> bytes:
    """Payload i: its index (4 bytes, so loss or reordering shows) then `size` pool bytes."""
    start = (i * 7919) % ((1 << 16) - size)
    return i.to_bytes(4, "little") + pool[start : start + size]


# ---- actors run in child processes (imported there as tests.actors.transport.test_ring) --------------
def stream_writer(ctx):
    """Writes the seeded stream to ring "out", then its crc as the last message."""
    seed, n, max_size = msgspec.msgpack.decode(ctx.config)
    ring = Ring.attach(ctx.rings["out"])
    sizes, pool = _stream(seed, n, max_size)
    ctx.ready()
    crc = 0
    send = ring.send
    for i, size in enumerate(sizes.tolist()):
        msg = _payload(pool, i, size)
        crc = zlib.crc32(msg, crc)
        send(msg)
    send(crc.to_bytes(4, "little"))
    ctx.wait_stopping()


def broadcast_reader(ctx):
    """Reads `n` messages as reader `index` (sleeping `delay` s after each), then reports
    (count, crc, in_order) on its result ring."""
    index, n, delay = msgspec.msgpack.decode(ctx.config)
    ring = BroadcastRing.attach(ctx.rings["in"], index)
    out = Ring.attach(ctx.rings["result"])
    ctx.ready()
    crc, in_order = 0, True
    for i in range(n):
        msg = ring.recv(timeout=30)
        assert msg is not None, f"reader {index} got nothing for 30 s at message {i}"
        in_order &= int.from_bytes(msg[:4], "little") == i
        crc = zlib.crc32(msg, crc)
        if delay:
            time.sleep(delay)
    out.send(msgspec.msgpack.encode([n, crc, in_order]))
    ctx.wait_stopping()


def echo(ctx):
    """Sends every message of ring "in" back on ring "out" until stopped."""
    rin, rout = Ring.attach(ctx.rings["in"]), Ring.attach(ctx.rings["out"])
    ctx.ready()
    while not ctx.stopping():
        msg = rin.recv(timeout=0.2)
        if msg is not None:
            rout.send(msg)


def slow_reader(ctx):
    ring = Ring.attach(ctx.rings["in"])
    ctx.ready()
    while True:
        ring.recv()
        time.sleep(0.001)


# ---- tests ------------------------------------------------------------------------------
def test_million_frames_keep_order_and_content_across_wraparound():
    from ringserve.actors.transport.launcher import ActorGroup

    seed, max_size = 7, 300
    with ActorGroup() as group:
        ring = group.ring("wrap", 4096)  # ~28 frames: the cursor wraps ~90,000 times
        group.spawn("writer", "tests.actors.transport.test_ring:stream_writer", msgspec.msgpack.encode([seed, N_FRAMES, max_size]), {"out": ring.name})  # fmt: skip
        group.wait_ready(60)
        sizes, _ = _stream(seed, N_FRAMES, max_size)
        crc, total = 0, 0
        recv = ring.recv
        for i in range(N_FRAMES):
            msg = recv(30)
            assert msg is not None and int.from_bytes(msg[:4], "little") == i, f"frame {i} lost or reordered"
            crc = zlib.crc32(msg, crc)
            total += len(msg)
        assert total == int(sizes.sum()) + 4 * N_FRAMES
        assert recv(30) == crc.to_bytes(4, "little")
        assert ring._tail > 20 * ring.capacity * 1000  # it really wrapped, many times
        assert recv(0) is None


def test_broadcast_three_readers_one_slow_all_in_order_and_writer_held_back():
    from ringserve.actors.transport.launcher import ActorGroup

    n, delay, cap = 300, 0.002, 1024
    with ActorGroup() as group:
        ring = group.broadcast_ring("bcast", 3, cap)
        results = [group.ring(f"res{i}", 4096) for i in range(3)]
        for i in range(3):
            cfg = msgspec.msgpack.encode([i, n, delay if i == 2 else 0.0])
            group.spawn(f"reader{i}", "tests.actors.transport.test_ring:broadcast_reader", cfg, {"in": ring.name, "result": results[i].name})  # fmt: skip
        group.wait_ready(60)
        _, pool = _stream(0, 1, 0)
        crc, t0 = 0, time.monotonic()
        for i in range(n):
            msg = _payload(pool, i, 96)  # 100 B payload, a 112-byte frame: 9 fit in the ring
            crc = zlib.crc32(msg, crc)
            ring.send(msg, timeout=30)
            assert ring._head - ring._low <= cap
        elapsed = time.monotonic() - t0
        for res in results:
            assert msgspec.msgpack.decode(res.recv(30)) == [n, crc, True]
        # the slow reader sleeps `delay` per message; the writer can run at most 9 frames ahead
        assert elapsed >= (n - 10) * delay * 0.9, elapsed


def test_split_messages_larger_than_the_ring_round_trip_cross_process():
    from ringserve.actors.transport.launcher import ActorGroup

    rng = np.random.default_rng(3)
    with ActorGroup() as group:
        rin, rout = group.ring("big_in", 1 << 14), group.ring("big_out", 1 << 12)
        group.spawn("echo", "tests.actors.transport.test_ring:echo", b"", {"in": rin.name, "out": rout.name})
        group.wait_ready(60)
        assert rin.max_frame == (1 << 13) - 8
        for size in (0, 1, rin.max_frame, rin.max_frame + 1, 3 * (1 << 14) + 5, 1 << 20):
            msg = rng.bytes(size)
            rin.send(msg, timeout=30)
            assert rout.recv(30) == msg, size


def test_split_message_cut_by_a_timeout_is_dropped_by_the_reader():
    with Ring.create("cut", 1024) as ring, Ring.attach(ring.name) as w:
        with pytest.raises(RingTimeout):  # two 504-byte frames fit, the third does not
            w.send(b"a" * 1500, timeout=0.05)
        assert ring.recv(0) is None  # the partial message is held, not returned
        w.send(b"next")
        assert ring.recv(0) == b"next"
        assert ring.recv(0) is None


def test_writer_blocks_on_a_full_ring_until_the_reader_drains():
    with Ring.create("full", 256) as ring, Ring.attach(ring.name) as w:
        msgs = [bytes([i]) * 56 for i in range(4)]  # 64-byte frames: 4 fill the ring
        for m in msgs:
            w.send(m, timeout=0)
        got: list[bytes | None] = []

        def drain_later():
            time.sleep(0.3)
            got.extend(ring.recv(5) for _ in range(5))

        t = threading.Thread(target=drain_later)
        t.start()
        t0 = time.monotonic()
        w.send(b"late", timeout=10)
        blocked = time.monotonic() - t0
        t.join()
        assert 0.25 <= blocked < 5
        assert got == msgs + [b"late"]


def test_full_ring_without_a_reader_times_out_naming_ring_and_timeout():
    with Ring.create("stuck", 256) as ring:
        for _ in range(4):
            ring.send(b"x" * 56, timeout=0)
        t0 = time.monotonic()
        with pytest.raises(RingTimeout, match=rf"ring {ring.name}: .*timed out after 0.2 s") as e:
            ring.send(b"y", timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 2
        assert isinstance(e.value, TimeoutError)
        assert ring.recv(0) == b"x" * 56  # nothing was lost or half-written


def test_recv_timeout_poll_and_wrapped_payloads():
    with Ring.create("poll", 64, spin_us=0) as ring:
        t0 = time.monotonic()
        assert ring.recv(0) is None
        assert ring.recv(0.1) is None
        assert 0.08 < time.monotonic() - t0 < 2
        for i in range(200):  # sizes that straddle the end of a 64-byte data area
            msg = os.urandom(i % 24)
            ring.send(msg, timeout=0)
            assert ring.recv(0) == msg


def test_a_signal_during_a_wait_neither_kills_nor_shortens_it():
    """A signal handled while recv sleeps in the kernel (EINTR) resumes the wait for the time
    left (PEP 475), so an actor that gets one keeps serving (it used to die of SignalError)."""
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda *_: seen.append(time.monotonic()))
    main = threading.get_ident()
    try:
        with Ring.create("eintr", 1024, spin_us=0) as ring:
            threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1)).start()
            t0 = time.monotonic()
            assert ring.recv(1.0) is None  # (margins wide enough for a loaded machine's timers)
            assert len(seen) == 1 and time.monotonic() - t0 >= 0.95
            threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1)).start()
            threading.Timer(0.6, ring.send, (b"after",)).start()
            assert ring.recv(None) == b"after" and len(seen) == 2
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_an_idle_reader_sleeps_instead_of_spinning():
    with Ring.create("idle", 1024, spin_us=200) as ring:
        t0, c0 = time.monotonic(), time.process_time()
        assert ring.recv(0.5) is None
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
        assert wall >= 0.45 and cpu < 0.05, (wall, cpu)


def test_accepts_memoryviews_of_any_format():
    with Ring.create("views", 1024) as ring:
        a = np.arange(10, dtype=np.int32)
        ring.send(memoryview(a))
        ring.send(bytearray(b"ba"))
        assert np.frombuffer(ring.recv(0), dtype=np.int32).tolist() == list(range(10))
        assert ring.recv(0) == b"ba"


def test_segments_and_semaphores_are_private_and_unlinked():
    ring = BroadcastRing.create("mode", 2, 1024)
    files = shm_files(ring.name, 2)
    assert len(files) == 5 and files[0] == f"/dev/shm/rs-{os.getpid()}-{ring.name.split('-')[2]}-mode"
    for path in files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    reader = BroadcastRing.attach(ring.name, 1)
    ring.send(b"hi")
    assert reader.recv(0) == b"hi"
    reader.close()
    ring.close()  # the owner unlinks
    assert _leftovers(ring.name) == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        Ring.create("x", 1000)
    with pytest.raises(ValueError, match="edge"):
        Ring.create("no/slash")
    with BroadcastRing.create("idx", 2, 256) as ring:
        with pytest.raises(ValueError, match="out of range"):
            BroadcastRing.attach(ring.name, 2)
        with pytest.raises(ValueError, match="writer"):
            ring.recv(0)


def test_mark_closed_wakes_blocked_reader_and_writer():
    with Ring.create("closing", 256) as ring, Ring.attach(ring.name) as w:
        errors: list[BaseException] = []

        def blocked_recv():
            try:
                ring.recv(10)
            except RingClosed as e:
                errors.append(e)

        t = threading.Thread(target=blocked_recv)
        t.start()
        time.sleep(0.1)
        w.mark_closed()
        t.join(5)
        assert len(errors) == 1 and ring.name in str(errors[0])
        with pytest.raises(RingClosed):
            w.send(b"x")
        with pytest.raises(RingClosed):  # sticky: every later call sees it too
            ring.recv(0)


def test_reader_killed_mid_stream_is_detected_by_the_writer():
    from ringserve.actors.transport.launcher import ActorGroup

    failures: list[tuple[str, int | None, float]] = []
    group = ActorGroup(on_failure=lambda name, code, tb: failures.append((name, code, time.monotonic())))
    ring = group.ring("victim", 1024)
    group.spawn("reader", "tests.actors.transport.test_ring:slow_reader", b"", {"in": ring.name})
    pid = group.pid("reader")
    group.wait_ready(60)
    sent, killed_at = 0, 0.0
    with pytest.raises(RingClosed):
        while True:
            ring.send(b"z" * 100, timeout=10)
            sent += 1
            if sent == 50:
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
    detected = time.monotonic() - killed_at
    assert detected < 1.0, detected
    assert group.wait_closed(10)
    assert [(n, c) for n, c, _ in failures] == [("reader", -signal.SIGKILL)]
    assert failures[0][2] - killed_at < 1.0
    assert _leftovers(ring.name) == []
    group.shutdown()


def test_unlink_name_removes_a_ring_known_only_by_name():
    """An actor whose parent (the creator) was killed removes its rings' names (actor.py)."""
    import os

    from ringserve.actors.transport.ring import BroadcastRing, shm_files, unlink_name

    ring = BroadcastRing.create("orphan", 3, 4096)
    try:
        paths = shm_files(ring.name, 3)
        assert len(paths) == 7 and all(os.path.exists(p) for p in paths)
        unlink_name(ring.name)
        assert not any(os.path.exists(p) for p in paths)
        unlink_name(ring.name)  # gone already: nothing to do
    finally:
        ring.close()
    from ringserve.actors.transport.loads import LoadBoard

    board = LoadBoard.create(2)  # not a ring: its one segment
    try:
        path = f"/dev/shm/{board.name.lstrip('/')}"
        assert os.path.exists(path)
        unlink_name(board.name)
        assert not os.path.exists(path)
    finally:
        board.close()
