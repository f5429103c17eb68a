"""Tensors in shared-memory segments, read where they lie (no JAX here: the runner's WeightSync
stages them, model/runtime/weight_sync.py, and the frontend's supervisor journal keeps a host copy of
them, actors/frontend/journal.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class WeightError(ValueError):
    pass


def read_segments(refs: list[Any], take: Callable[[Any, Any], None]) -> None:
    """Hand each TensorRef and its mapped segment to `take` (each segment mapped once; a segment
    that is gone, e.g. a push that ended, is a WeightError)."""
    import mmap

    import posix_ipc

    maps: dict[str, mmap.mmap] = {}
    try:
        for r in refs:
            mm = maps.get(r.segment)
            if mm is None:
                try:
                    shm = posix_ipc.SharedMemory(r.segment)
                except posix_ipc.ExistentialError:
                    raise WeightError(f"tensor {r.name!r}: segment {r.segment} is gone (its push ended)") from None
                try:
                    mm = maps[r.segment] = mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ)
                finally:
                    shm.close_fd()
            take(r, mm)
    finally:
        for mm in maps.values():
            mm.close()
