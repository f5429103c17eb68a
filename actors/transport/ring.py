"""Shared-memory rings: `Ring` (one writer, one reader) and `BroadcastRing` (one writer, N readers).

Segment `/rs-<pid>-<random>-<edge>` (mode 0600; little-endian; one writer per cache line):

    offset          size  field
    0               8     magic b"RSRING2\\0"
    8               4     N, the number of readers
    12              1     closed flag: 0, or 1 once mark_closed() ran (never cleared)
    16              8     C, capacity of the data area in bytes (a power of two, >= 64)
    64              8     write cursor (advisory: stored after each frame, before its post)
    128 + 64*i      8     read cursor of reader i (advisory: stored before each free_i post)
    D = 128 + 64*N  C     data area; cursor c lives at D + (c & (C - 1))

Cursors are free-running byte counts from 0. A frame starts at a cursor that is a multiple of
8, so its 8-byte header never straddles the end of the data area; the payload may wrap:

    u32 L (payload bytes) | u32 flags (MORE: a later frame continues this message;
    ABORT: drop the partial message) | L payload bytes | zero to 7 pad bytes

Publication never relies on the order of plain stores (Python has no memory model). Per reader
i there are two POSIX semaphores, `<segment>-i<i>` and `<segment>-f<i>`:

    items_i  frames written and not yet taken by reader i. The writer posts it after writing a
             frame; reader i's acquire is its barrier before reading that frame.
    free_i   granules (G = C/8 bytes) reader i has finished copying out of, not yet credited
             to the writer. Reader i posts once each time its cursor passes a multiple of G;
             the writer's acquire is its barrier before overwriting those bytes.

Invariants: the writer's view of reader i is tail_i = G * (free_i tokens taken) <= reader i's
cursor, and the writer keeps head - min_i(tail_i) <= C (the slowest reader holds it back). At
most G bytes are consumed but uncredited, and a frame is at most C/2 bytes, so a writer facing
a drained ring always has room. Reader i reads only frames it holds an items_i token for, in
order. Each role starts at cursor 0: attach before the handle's first send/recv, one writer and
one handle per reader for the ring's life. No decision reads another process's cursor.
`mark_closed()` sets the closed flag and posts every semaphore once, so a blocked or later
send/recv in any process raises RingClosed (the token is put back for the next caller).

sem_post and sem_trywait are atomics that enter the kernel only to wake a sleeper. A waiting reader
(or a writer facing a full ring) spins up to `spin_us` polling its semaphore's value, yielding the
core every few polls (so a peer pinned to the same core still runs), then sleeps in
sem_timedwait: no CPU when idle. spin_us=0 sleeps at once.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import secrets
import struct
import time
import weakref
from typing import Self

import posix_ipc

__all__ = ["BroadcastRing", "Ring", "RingClosed", "RingTimeout", "shm_files"]

_MAGIC = b"RSRING2\0"
_HEAD = struct.Struct("<8sIB3xQ")  # magic, N, closed, C
_U64 = struct.Struct("<Q")
_FRAME = struct.Struct("<II")  # payload length, flags
_MORE, _ABORT = 1, 2
_CLOSED = 12  # offset of the closed flag
_WCUR = 64  # offset of the write cursor
_EDGE = re.compile(r"[A-Za-z0-9_]{1,32}")


_OWNED: weakref.WeakSet[_RingBase] = weakref.WeakSet()  # rings this process created, not yet closed


@atexit.register
def _unlink_owned() -> None:
    """An owner that exits without close() still removes its names (SIGKILL: `ringserve cleanup`)."""
    for ring in list(_OWNED):
        if ring._creator == os.getpid():  # not in a fork()ed child that inherited the set
            ring.unlink()


class RingTimeout(TimeoutError):
    """A send found the ring full for its whole timeout (the reader is stuck or gone)."""


class RingClosed(ConnectionError):
    """The ring was marked closed (its group is shutting down or a peer died)."""


def _rcur(i: int) -> int:
    return 128 + 64 * i


def shm_files(name: str, num_readers: int = 1) -> list[str]:
    """Paths in /dev/shm of a ring's segment and semaphores (for tests and diagnostics)."""
    base = name.lstrip("/")
    sems = [f"sem.{base}-{k}{i}" for i in range(num_readers) for k in "if"]
    return [f"/dev/shm/{base}"] + [f"/dev/shm/{s}" for s in sems]


def unlink_name(name: str) -> None:
    """Remove a ring's segment and semaphore names (or the load board's segment), given only
    its name (an actor whose parent, the creator, was killed: actors/transport/actor.py; else
    `ringserve cleanup` would)."""
    segment = f"/dev/shm/{name.lstrip('/')}"
    try:
        with open(segment, "rb") as f:
            magic, n, _closed, _cap = _HEAD.unpack(f.read(_HEAD.size))
    except (OSError, struct.error):
        magic, n = None, 0
    for path in shm_files(name, n) if magic == _MAGIC else [segment]:  # (not a ring: the load board)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class _RingBase:
    """Both ends of a ring; a process uses a handle as the writer (send) or as one reader (recv)."""

    def __init__(self, name: str, m: mmap.mmap, reader: int | None, owner: bool, spin_us: int) -> None:
        magic, n, _closed, cap = _HEAD.unpack_from(m, 0)
        if magic != _MAGIC:
            raise ValueError(f"{name} is not a ringserve ring")
        self.name = name
        self.num_readers: int = n
        self.capacity: int = cap
        self.max_frame = cap // 2 - 8  # longer messages are split into frames of this size
        self._m = m
        self._mask = cap - 1
        self._data = _rcur(n)
        self._gshift = cap.bit_length() - 4  # G = C / 8
        self._owner = owner
        self._spin_ns = spin_us * 1000
        self._items = [posix_ipc.Semaphore(f"{name}-i{i}") for i in range(n)]
        self._free = [posix_ipc.Semaphore(f"{name}-f{i}") for i in range(n)]
        self._post = self._items[0].release if n == 1 else self._post_all  # publish one frame
        # writer view: head, and each reader's credited tail (a multiple of G)
        self._head = 0
        self._tails = [0] * n
        self._low = 0
        self._partial = False  # a split message was cut short by a timeout
        # reader view
        if reader is not None and not 0 <= reader < n:
            raise ValueError(f"reader index {reader} out of range for {n} readers")
        self._reader = reader
        self._item = self._items[reader] if reader is not None else None
        self._tail = 0
        self._rcur_off = _rcur(reader or 0)
        self._parts: list[bytes] = []
        self._closed_handle = False
        self._creator = os.getpid()
        if owner:
            _OWNED.add(self)

    # ---- creation ------------------------------------------------------------------------
    @classmethod
    def _new(cls, edge: str, n: int, capacity: int, spin_us: int, reader: int | None) -> Self:
        if not _EDGE.fullmatch(edge):
            raise ValueError(f"ring edge {edge!r} must be 1-32 characters of [A-Za-z0-9_]")
        if capacity < 64 or capacity & (capacity - 1) or capacity > 1 << 31:
            raise ValueError(f"ring capacity {capacity} must be a power of two in [64, 2**31]")
        if not 1 <= n <= 64:
            raise ValueError(f"num_readers {n} must be in [1, 64]")
        name = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-{edge}"
        size = _rcur(n) + capacity
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        made: list[str] = []
        try:
            m = mmap.mmap(shm.fd, size)
            shm.close_fd()
            for i in range(n):
                for k in "if":
                    posix_ipc.Semaphore(f"{name}-{k}{i}", posix_ipc.O_CREX, 0o600, 0).close()
                    made.append(f"{name}-{k}{i}")
            _HEAD.pack_into(m, 0, _MAGIC, n, 0, capacity)  # the rest is zero (ftruncate)
            return cls(name, m, reader, True, spin_us)
        except BaseException:
            shm.unlink()
            for s in made:
                posix_ipc.unlink_semaphore(s)
            raise

    @classmethod
    def _open(cls, name: str, reader: int | None, spin_us: int) -> Self:
        name = "/" + name.lstrip("/")
        shm = posix_ipc.SharedMemory(name)
        try:
            m = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        return cls(name, m, reader, False, spin_us)

    # ---- writer --------------------------------------------------------------------------
    def send(self, data: bytes | bytearray | memoryview, timeout: float | None = 60.0) -> None:
        """Append one message; block while the ring is full, at most `timeout` s (None: forever).

        Raises RingTimeout naming the ring and the timeout, or RingClosed. A message longer than
        `max_frame` is split into frames that recv() reassembles."""
        if type(data) is not bytes and type(data) is not bytearray:
            data = memoryview(data).cast("B")
        n = len(data)
        m = self._m
        if m[_CLOSED] or self._partial or n > self.max_frame:
            return self._send_slow(data, n, timeout)
        cap, base, h = self.capacity, self._data, self._head
        need = (n + 15) & ~7
        if h + need - self._low > cap:
            self._room(need, None if timeout is None else time.monotonic() + timeout, timeout, n)
        # the frame: header, payload (maybe in two pieces), then the cursor, then publish
        off = h & self._mask
        _FRAME.pack_into(m, base + off, n, 0)
        p = off + 8 if off + 8 < cap else 0
        end = p + n
        if end <= cap:
            m[base + p : base + end] = data
        else:
            view = memoryview(data)
            m[base + p : base + cap] = view[: cap - p]
            m[base : base + end - cap] = view[cap - p :]
        self._head = h = h + need
        _U64.pack_into(m, _WCUR, h)
        self._post()

    def _send_slow(self, data: bytes | bytearray | memoryview, n: int, timeout: float | None) -> None:
        """send() when closed, after a cut message, or for a message split into frames."""
        if self._m[_CLOSED]:
            raise RingClosed(f"ring {self.name} is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._partial:  # the reader holds the head of a message we gave up on: drop it
            self._put(b"", 0, _ABORT, deadline, timeout, 0)
            self._partial = False
        view = memoryview(data)
        step = self.max_frame
        self._partial = True
        for a in range(0, max(n, 1), step):
            k = min(step, n - a)
            self._put(view[a : a + k], k, _MORE if a + k < n else 0, deadline, timeout, n)
        self._partial = False

    def _put(self, data: bytes | memoryview, n: int, flags: int, deadline: float | None, timeout: float | None,
             total: int) -> None:  # fmt: skip
        """Write and publish one frame (the slow path's copy of send's inline code)."""
        m, cap, base = self._m, self.capacity, self._data
        need = (n + 15) & ~7
        if self._head + need - self._low > cap:
            self._room(need, deadline, timeout, total)
        off = self._head & self._mask
        _FRAME.pack_into(m, base + off, n, flags)
        p = off + 8 if off + 8 < cap else 0
        k = min(n, cap - p)
        m[base + p : base + p + k] = data[:k]
        m[base : base + n - k] = data[k:]
        self._head += need
        _U64.pack_into(m, _WCUR, self._head)
        self._post()

    def _post_all(self) -> None:
        for sem in self._items:
            sem.release()

    def _room(self, need: int, deadline: float | None, timeout: float | None, n: int) -> None:
        """Take free tokens until `need` bytes are free at the head, blocking on the slowest reader."""
        while True:
            for i, sem in enumerate(self._free):
                if got := sem.value:
                    for _ in range(got):  # only this writer takes free tokens: trywait succeeds
                        sem.acquire(0)
                    self._credit(i, sem, got)
            if self._head + need - self._low <= self.capacity:
                return
            slow = self._tails.index(self._low)
            left = None if deadline is None else deadline - time.monotonic()
            sem = self._free[slow]
            if (left is not None and left <= 0) or not self._wait(sem, left):
                used = self._head - self._low
                raise RingTimeout(
                    f"ring {self.name}: send of {n} bytes timed out after {timeout} s; the ring is full "
                    f"({used} of {self.capacity} bytes unread by reader {slow}): is the reader alive?"
                )
            self._credit(slow, sem, 1)

    def _credit(self, i: int, sem: posix_ipc.Semaphore, granules: int) -> None:
        if self._m[_CLOSED]:  # one of the tokens may be mark_closed()'s wake-up, not a granule
            sem.release()
            raise RingClosed(f"ring {self.name} is closed")
        self._tails[i] += granules << self._gshift
        assert self._tails[i] <= self._head, (self._tails[i], self._head)
        self._low = min(self._tails)

    # ---- reader --------------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> bytes | None:
        """The next whole message, or None if none arrived within `timeout` s (0: poll; None:
        wait forever). Raises RingClosed once the ring is marked closed."""
        sem = self._item
        if sem is None:
            raise ValueError(f"ring {self.name}: this handle is the writer; attach with a reader index")
        m, cap, base = self._m, self.capacity, self._data
        deadline = None
        while True:
            try:
                sem.acquire(0)
            except posix_ipc.BusyError:
                if timeout is not None and deadline is None and timeout > 0:
                    deadline = time.monotonic() + timeout
                if not self._wait(sem, timeout):
                    return None
            if m[_CLOSED]:
                sem.release()
                raise RingClosed(f"ring {self.name} is closed")
            t = self._tail
            off = t & self._mask
            n, flags = _FRAME.unpack_from(m, base + off)
            p = off + 8 if off + 8 < cap else 0
            end = p + n
            if end <= cap:
                data = m[base + p : base + end]
            else:  # the payload wraps
                data = m[base + p : base + cap] + m[base : base + end - cap]
            self._tail = t2 = t + ((n + 15) & ~7)
            if (t ^ t2) >> self._gshift:  # passed a multiple of G: credit the writer
                _U64.pack_into(m, self._rcur_off, t2)
                free = self._free[self._reader or 0]
                for _ in range((t2 >> self._gshift) - (t >> self._gshift)):
                    free.release()
            if not flags:
                if not self._parts:
                    return data
                self._parts.append(data)
                data = b"".join(self._parts)
                self._parts = []
                return data
            if flags & _ABORT:
                self._parts = []
            else:
                self._parts.append(data)
            if deadline is not None:  # the rest of a split message shares the timeout
                timeout = deadline - time.monotonic()

    def _wait(self, sem: posix_ipc.Semaphore, timeout: float | None) -> bool:
        """Take one token: spin up to spin_us polling the semaphore's value (a plain read; the
        trywait that follows is the barrier), yielding every 8 polls, then sleep in the kernel."""
        if timeout is not None and timeout <= 0:
            return False
        if self._spin_ns:
            clock = time.perf_counter_ns
            now = clock()
            stop = now + self._spin_ns
            if timeout is not None:
                stop = min(stop, now + int(timeout * 1e9))
            while True:
                for _ in range(8):  # read the clock once per 8 polls
                    if sem.value > 0:
                        sem.acquire(0)  # cannot fail: each semaphore has one consumer
                        return True
                if clock() >= stop:
                    break
                os.sched_yield()  # a peer sharing this core gets to run (a no-op on an idle core)
            if timeout is not None:
                timeout -= (clock() - now) / 1e9
                if timeout <= 0:
                    return False
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                sem.acquire(timeout)
                return True
            except posix_ipc.BusyError:
                return False
            except posix_ipc.SignalError:  # EINTR: the handler has run; wait out the rest (PEP 475)
                if deadline is not None:
                    timeout = deadline - time.monotonic()
                    if timeout <= 0:
                        return False

    # ---- lifetime ------------------------------------------------------------------------
    def mark_closed(self) -> None:
        """Make every blocked and later send/recv of this ring, in any process, raise RingClosed."""
        if self._closed_handle:
            return
        self._m[_CLOSED] = 1
        for s in self._items + self._free:
            s.release()

    @property
    def closed(self) -> bool:
        return self._closed_handle or bool(self._m[_CLOSED])

    def close(self) -> None:
        """Detach this handle (the owner also unlinks). Not while another thread is in send/recv."""
        if self._closed_handle:
            return
        if self._owner:
            self.unlink()
        self._closed_handle = True
        self._m.close()
        for s in self._items + self._free:
            s.close()

    def unlink(self) -> None:
        """Remove the segment and semaphore names; mapped handles keep working until closed."""
        for path in shm_files(self.name, self.num_readers):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, readers={self.num_readers}, capacity={self.capacity})"


class Ring(_RingBase):
    """Single producer, single consumer."""

    @classmethod
    def create(cls, edge: str, capacity: int = 1 << 22, *, spin_us: int = 50) -> Ring:
        """A new ring owned by this process; pass `ring.name` to the peer, which attaches."""
        return cls._new(edge, 1, capacity, spin_us, 0)

    @classmethod
    def attach(cls, name: str, *, spin_us: int = 50) -> Ring:
        return cls._open(name, 0, spin_us)


class BroadcastRing(_RingBase):
    """One writer, N readers; every reader receives every message; the slowest holds the writer."""

    @classmethod
    def create(
        cls, edge: str, num_readers: int, capacity: int = 1 << 22, *, spin_us: int = 50
    ) -> BroadcastRing:
        """A new ring owned by this process. This handle writes; readers attach with their index."""
        return cls._new(edge, num_readers, capacity, spin_us, None)

    @classmethod
    def attach(cls, name: str, reader: int | None, *, spin_us: int = 50) -> BroadcastRing:
        """Attach as reader `reader` (0..N-1), or as the writer with reader=None (any index can
        also send: the index is used by recv only)."""
        return cls._open(name, reader, spin_us)
