"""The load board: each data-parallel group's scheduler publishes its load into one small
shared-memory block that the frontend reads without a message (SGLang's DP controller reads
shared-memory snapshots for the same reason: a load asked through the rings arrives behind
the requests it should have been counted before).

    segment /rs-<pid>-<hex>-loads (mode 0600), int64 little-endian, one row of FIELDS per group:

    row r  [ seq | running | waiting | used_tokens | total_tokens | pending_prefill | received | received_tokens ]
              ▲ seqlock: odd while the scheduler writes the row, even when it is whole

- Writer: group r's scheduler only (`publish`), at most once per loop iteration.
- Reader: the frontend (`read`), any time; a row read while it was being written (seq odd or
  changed under the read) is read again, so a snapshot is always one published state.
- `received` / `received_tokens` count the requests (and their prompt tokens) the scheduler has
  taken off its ring since it started; the frontend counts what it sent, so the difference is
  what is still in the ring, which no scheduler has counted yet (a burst before any report).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np
import posix_ipc

__all__ = ["FIELDS", "GroupLoad", "LoadBoard"]

FIELDS = ("seq", "running", "waiting", "used_tokens", "total_tokens", "pending_prefill", "received",
          "received_tokens")  # fmt: skip
_SEQ_TRIES = 1000


@dataclass(frozen=True, slots=True)
class GroupLoad:
    """One group's published load (all zero before its scheduler's first report)."""

    running: int = 0  # requests holding KV (the chunked one included)
    waiting: int = 0  # requests queued, not admitted
    used_tokens: int = 0  # KV tokens in use (evictable cached prefixes count as free)
    total_tokens: int = 0  # the KV pool's tokens
    pending_prefill: int = 0  # prompt tokens of the waiting requests not yet computed
    received: int = 0  # requests taken off the ring since the scheduler started
    received_tokens: int = 0  # their prompt tokens

    @property
    def num_reqs(self) -> int:
        return self.running + self.waiting


class LoadBoard:
    """A seqlocked table of `n` rows; created by the parent (it owns and unlinks the name),
    attached by each scheduler (`attach`) and read by the frontend."""

    def __init__(self, name: str, m: mmap.mmap, n: int, owner: bool) -> None:
        self.name, self.n, self._m, self._owner = name, n, m, owner
        self._rows = np.ndarray((n, len(FIELDS)), dtype="<i8", buffer=m)
        self._closed = False

    @classmethod
    def create(cls, n: int) -> LoadBoard:
        if not 1 <= n <= 64:
            raise ValueError(f"load board rows {n} must be in [1, 64]")
        name = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-loads"
        size = n * len(FIELDS) * 8
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            m = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close_fd()
        return cls(name, m, n, True)

    @classmethod
    def attach(cls, name: str) -> LoadBoard:
        shm = posix_ipc.SharedMemory("/" + name.lstrip("/"))
        size = shm.size
        try:
            m = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(shm.name, m, size // (len(FIELDS) * 8), False)

    # ---- the writer (group `rank`'s scheduler) -------------------------------------------
    def publish(self, rank: int, load: GroupLoad) -> None:
        row = self._rows[rank]
        seq = int(row[0])
        row[0] = seq + 1  # odd: being written
        row[1:] = (load.running, load.waiting, load.used_tokens, load.total_tokens, load.pending_prefill,
                   load.received, load.received_tokens)  # fmt: skip
        row[0] = seq + 2

    # ---- the reader (the frontend) -------------------------------------------------------
    def read(self, rank: int) -> GroupLoad:
        row = self._rows[rank]
        for _ in range(_SEQ_TRIES):
            before = int(row[0])
            if before % 2 == 0:
                values = [int(v) for v in row[1:]]
                if int(row[0]) == before:
                    return GroupLoad(*values)
            time.sleep(0)
        raise RuntimeError(f"load board {self.name}: row {rank} stayed mid-write for {_SEQ_TRIES} reads")

    def read_all(self) -> list[GroupLoad]:
        return [self.read(r) for r in range(self.n)]

    # ---- lifetime (as a ring's, so an ActorGroup owns it: launcher.py) ---------------------
    def mark_closed(self) -> None:
        """(Nothing blocks on a board.)"""

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{self.name.lstrip('/')}")

    def close(self) -> None:
        if self._closed:
            return
        if self._owner:
            self.unlink()
        self._closed = True
        del self._rows
        with contextlib.suppress(BufferError):  # a view still held: the map goes with the process
            self._m.close()
