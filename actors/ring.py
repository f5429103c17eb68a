"""Shared-memory rings: `Ring` (one writer, one reader) and `BroadcastRing` (one writer, N readers).

Segment `/rs-<pid>-<random>-<edge>` (mode 0600; little-endian; one writer per cache line):

    offset          size  field
    0               8     magic b"RSRING1\\0"
    8               4     N, the number of readers
    12              1     closed flag: 0, or 1 once mark_closed() ran (never cleared)
    16              8     C, capacity of the data area in bytes (a power of two, >= 64)
    64              8     write cursor: bytes ever written (advisory, see below)
    128 + 64*i      8     read cursor of reader i (advisory)
    D = 128 + 64*N  C     data area; cursor c lives at D + (c & (C - 1))

Cursors are free-running byte counts. A frame starts at a cursor that is a multiple of 8, so its
8-byte header never straddles the end of the data area; the payload may wrap to the start:

    u32 L (payload bytes) | u32 flags (MORE: a later frame continues this message;
    ABORT: drop the partial message) | L payload bytes | zero to 7 pad bytes

Publication never relies on the order of plain stores (Python has no memory model). Per reader
i there are two POSIX semaphores, `<segment>-i<i>` and `<segment>-f<i>`:

    items_i  frames written and not yet taken by reader i. The writer posts it after writing a
             frame; reader i's acquire is its barrier before reading that frame.
    free_i   frames reader i has copied out and the writer has not reclaimed. Reader i posts it
             after copying; the writer's acquire is its barrier before overwriting them.

Invariants: the writer keeps head - min_i(tail_i) <= C, where tail_i only advances by frames
whose free_i token it holds (so the slowest reader holds the writer back); reader i reads only
frames it holds an items_i token for, in order. The header cursors are stored before the
matching post for diagnostics and attach; no decision reads another process's cursor.
`mark_closed()` sets the closed flag and posts every semaphore once, so a blocked or later
send/recv in any process raises RingClosed (the token is put back for the next caller).

sem_post and sem_trywait are atomics that enter the kernel only to wake a sleeper. A reader spins
up to `spin_us` polling its semaphore's value, then sleeps in sem_timedwait: no CPU when idle.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import struct
import time
import weakref

import posix_ipc

__all__ = ["BroadcastRing", "Ring", "RingClosed", "RingTimeout", "shm_files"]

_MAGIC = b"RSRING1\0"
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
        ring.unlink()


class RingTimeout(TimeoutError):
    """A send found the ring full for its whole timeout (the reader is stuck or gone)."""


class RingClosed(ConnectionError):
    """The ring was marked closed (its group is shutting down or a peer died)."""


def _rcur(i: int) -> int:
    return 128 + 64 * i


def _frame_bytes(n: int) -> int:
    """Bytes a frame with an n-byte payload occupies: 8-byte header + payload padded to 8."""
    return (n + 15) & ~7


def shm_files(name: str, num_readers: int = 1) -> list[str]:
    """Paths in /dev/shm of a ring's segment and semaphores (for tests and diagnostics)."""
    base = name.lstrip("/")
    sems = [f"sem.{base}-{k}{i}" for i in range(num_readers) for k in "if"]
    return [f"/dev/shm/{base}"] + [f"/dev/shm/{s}" for s in sems]


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
        self._owner = owner
        self._spin_ns = spin_us * 1000
        self._items = [posix_ipc.Semaphore(f"{name}-i{i}") for i in range(n)]
        self._free = [posix_ipc.Semaphore(f"{name}-f{i}") for i in range(n)]
        # writer view: head, and each reader's tail as far as the writer has reclaimed it
        self._head: int = _U64.unpack_from(m, _WCUR)[0]
        self._tails: list[int] = [_U64.unpack_from(m, _rcur(i))[0] for i in range(n)]
        self._low = min(self._tails)
        self._partial = False  # a split message was cut short by a timeout
        # reader view
        self._reader = reader
        if reader is not None and not 0 <= reader < n:
            raise ValueError(f"reader index {reader} out of range for {n} readers")
        self._tail = self._tails[reader] if reader is not None else 0
        self._rcur_off = _rcur(reader) if reader is not None else 0
        self._parts: list[bytes] = []
        self._closed_handle = False
        if owner:
            _OWNED.add(self)

    # ---- creation ------------------------------------------------------------------------
    @classmethod
    def _new(cls, edge: str, n: int, capacity: int, spin_us: int, reader: int | None) -> _RingBase:
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
    def _open(cls, name: str, reader: int | None, spin_us: int) -> _RingBase:
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
        if self._m[_CLOSED]:
            raise RingClosed(f"ring {self.name} is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._partial:  # the reader holds the head of a message we gave up on: drop it
            self._room(8, deadline, timeout, 0)
            self._put(b"", 0, _ABORT)
            self._partial = False
        if n <= self.max_frame:
            need = (n + 15) & ~7
            if self._head + need - self._low > self.capacity:
                self._room(need, deadline, timeout, n)
            self._put(data, n, 0)
            return
        view = memoryview(data)
        step = self.max_frame
        self._partial = True
        for a in range(0, n, step):
            k = min(step, n - a)
            self._room(_frame_bytes(k), deadline, timeout, n)
            self._put(view[a : a + k], k, _MORE if a + k < n else 0)
        self._partial = False

    def _put(self, data: bytes | bytearray | memoryview, n: int, flags: int) -> None:
        m, cap, base, h = self._m, self.capacity, self._data, self._head
        off = h & self._mask
        _FRAME.pack_into(m, base + off, n, flags)
        p = off + 8 if off + 8 < cap else 0
        end = p + n
        if end <= cap:
            m[base + p : base + end] = data
        else:  # the payload wraps: tail piece at the end of the data area, rest at the start
            k = cap - p
            view = memoryview(data)
            m[base + p : base + cap] = view[:k]
            m[base : base + end - cap] = view[k:]
        self._head = h = h + ((n + 15) & ~7)
        _U64.pack_into(m, _WCUR, h)
        for s in self._items:
            s.release()

    def _room(self, need: int, deadline: float | None, timeout: float | None, n: int) -> None:
        """Reclaim frames the readers have released until `need` bytes are free at the head."""
        while True:
            for i, sem in enumerate(self._free):
                got = 0
                while sem.value > 0:  # only this writer takes free tokens: trywait succeeds
                    sem.acquire(0)
                    got += 1
                if got:
                    self._reclaimed(i, sem, got)
            if self._head + need - self._low <= self.capacity:
                return
            slow = self._tails.index(self._low)
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not self._acquire(self._free[slow], left):
                used = self._head - self._low
                raise RingTimeout(
                    f"ring {self.name}: send of {n} bytes timed out after {timeout} s; the ring is full "
                    f"({used} of {self.capacity} bytes unread by reader {slow}): is the reader alive?"
                )
            self._reclaimed(slow, self._free[slow], 1)

    def _reclaimed(self, i: int, sem: posix_ipc.Semaphore, frames: int) -> None:
        """Advance reader i's tail over `frames` frames whose free_i tokens the writer took."""
        if self._m[_CLOSED]:  # one of the tokens may be mark_closed()'s wake-up, not a frame
            sem.release()
            raise RingClosed(f"ring {self.name} is closed")
        m, base, mask, t = self._m, self._data, self._mask, self._tails[i]
        for _ in range(frames):
            t += _frame_bytes(_FRAME.unpack_from(m, base + (t & mask))[0])
        assert t <= self._head, (t, self._head)
        self._tails[i] = t
        self._low = min(self._tails)

    # ---- reader --------------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> bytes | None:
        """The next whole message, or None if none arrived within `timeout` s (0: poll; None:
        wait forever). Raises RingClosed once the ring is marked closed."""
        if self._reader is None:
            raise ValueError(f"ring {self.name}: this handle is the writer; attach with a reader index")
        sem = self._items[self._reader]
        deadline = None if timeout is None or timeout <= 0 else time.monotonic() + timeout
        m, cap, base = self._m, self.capacity, self._data
        while True:
            if not self._acquire(sem, timeout):
                return None
            if m[_CLOSED]:
                sem.release()
                raise RingClosed(f"ring {self.name} is closed")
            t = self._tail
            off = t & self._mask
            n, flags = _FRAME.unpack_from(m, base + off)
            p = off + 8 if off + 8 < cap else 0
            end = p + n
            data = (
                m[base + p : base + end]
                if end <= cap
                else m[base + p : base + cap] + m[base : base + end - cap]
            )
            self._tail = t = t + ((n + 15) & ~7)
            _U64.pack_into(m, self._rcur_off, t)
            self._free[self._reader].release()
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

    def _acquire(self, sem: posix_ipc.Semaphore, timeout: float | None) -> bool:
        """Take one token: try, spin up to spin_us polling the value, then sleep in the kernel."""
        try:
            sem.acquire(0)
            return True
        except posix_ipc.BusyError:
            pass
        if timeout is not None and timeout <= 0:
            return False
        if self._spin_ns:
            now = time.perf_counter_ns()
            stop = now + self._spin_ns
            if timeout is not None:
                stop = min(stop, now + int(timeout * 1e9))
            while time.perf_counter_ns() < stop:
                if sem.value > 0:
                    try:
                        sem.acquire(0)
                        return True
                    except posix_ipc.BusyError:  # pragma: no cover - single consumer per token
                        pass
            if timeout is not None:
                timeout -= (time.perf_counter_ns() - now) / 1e9
                if timeout <= 0:
                    return False
        try:
            sem.acquire(timeout)
            return True
        except posix_ipc.BusyError:
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
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

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
        ring = cls._new(edge, 1, capacity, spin_us, 0)
        assert isinstance(ring, Ring)
        return ring

    @classmethod
    def attach(cls, name: str, *, spin_us: int = 50) -> Ring:
        ring = cls._open(name, 0, spin_us)
        assert isinstance(ring, Ring)
        return ring


class BroadcastRing(_RingBase):
    """One writer, N readers; every reader receives every message; the slowest holds the writer."""

    @classmethod
    def create(
        cls, edge: str, num_readers: int, capacity: int = 1 << 22, *, spin_us: int = 50
    ) -> BroadcastRing:
        """A new ring owned by this process. This handle writes; readers attach with their index."""
        ring = cls._new(edge, num_readers, capacity, spin_us, None)
        assert isinstance(ring, BroadcastRing)
        return ring

    @classmethod
    def attach(cls, name: str, reader: int | None, *, spin_us: int = 50) -> BroadcastRing:
        """Attach as reader `reader` (0..N-1), or as the writer with reader=None (any index can
        also send: the index is used by recv only)."""
        ring = cls._open(name, reader, spin_us)
        assert isinstance(ring, BroadcastRing)
        return ring
