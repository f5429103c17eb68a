"""Streaming sessions: a finished turn's slot is kept, trimmed, for the session's next turn.

A layer over `KVCache` (which knows nothing of sessions). A turn's page table when it finishes
(O = origin_len, F = finished_len, T = O + F). A round that accepts several tokens at once
(speculative decoding) can commit past T ("overshoot"), and the round planned after it
(overlap) can reserve even further:

    positions: 0 ........ O-1 | O ....... T-1 | T ......... committed_len ... allocated_len
               [--- input ---] [- kept output -] [- overshoot: stale for the next turn -]

`finish_turn` trims it (seed 001): pages wholly past ceil(T / page_size) are freed, and

    committed_len <= T,   allocated_len <= T,   len(output_ids) == F

so `start_turn` never grants the next turn more than T tokens: the next turn's input holds
different tokens from T on. With one token per round and no extra round, committed_len is
T - 1 (the last output token is never fed back): the next turn recomputes position T - 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from ringserve.kvmem.cache import KVCache
from ringserve.kvmem.radix import TreeNode, common_prefix_len
from ringserve.kvmem.req_kv import ReqKV


@dataclasses.dataclass(slots=True)
class KeptSlot:
    kv: ReqKV  # the finished turn's record, trimmed; still holds its slot, pages and lock
    token_ids: np.ndarray  # int32 tokens [0, kv.committed_len): what its KV was computed for


class SessionSlots:
    def __init__(self, cache: KVCache):
        self.cache = cache
        self.kept: dict[str, KeptSlot] = {}
        self.resumed: dict[str, KeptSlot] = {}  # the kept slot each session's latest turn started from

    def records(self) -> list[ReqKV]:
        """The kept slots' records (they count as live page tables for the integrity check)."""
        return [k.kv for k in self.kept.values()]

    def check_integrity(self, live: Iterable[ReqKV], locks: Iterable[TreeNode] = ()) -> None:
        """The cache's check, with the kept slots among the live page tables."""
        self.cache.check_integrity([*live, *self.records()], locks)

    def start_turn(self, session_id: str, token_ids: np.ndarray, extra_key: str | None = None) -> ReqKV | None:
        """The record for a turn whose input is `token_ids` (earlier turns included).

        With a kept slot (of the same `extra_key`): it is reused, granting the longest prefix
        that `token_ids` repeats, capped at the kept committed_len and at len(token_ids) - 1
        (one token is computed); the rest of the page table is cut page-aligned. Without: a fresh
        `admit` (tree prefix). None when no slot is free."""
        token_ids = np.asarray(token_ids, np.int32)
        kept = self.kept.pop(session_id, None)
        self.resumed.pop(session_id, None)
        if kept is not None and kept.kv.extra_key != extra_key:  # KV of other weights: useless now
            self.cache.release(kept.kv, None)
            kept = None
        if kept is None:
            return self.cache.admit(token_ids[: len(token_ids) - 1], extra_key)
        self.resumed[session_id] = kept
        kv = kept.kv
        granted = min(kv.committed_len, common_prefix_len(kept.token_ids, token_ids), len(token_ids) - 1)
        self.cache.trim(kv, granted)
        kv.cached_len = kv.committed_len
        return kv

    def undo_start(self, session_id: str, kv: ReqKV) -> None:
        """Take back `start_turn`'s record of a turn that never ran (the scheduler undid its
        admission): the kept slot it resumed is kept again, as far as start_turn trimmed it (what
        it cut, the turn's input does not repeat); a fresh admission is released."""
        resumed = self.resumed.pop(session_id, None)
        if resumed is not None and resumed.kv is kv:
            self.kept[session_id] = KeptSlot(kv, resumed.token_ids[: kv.committed_len])
        else:
            self.cache.release(kv, None)

    def finish_turn(
        self, session_id: str, kv: ReqKV, origin_ids: np.ndarray, output_ids: list[int], finished_len: int
    ) -> int:
        """Keep `kv` for the session's next turn, trimmed to origin_len + finished_len; the
        overshoot is cut from `output_ids` in place. Returns the pages freed."""
        if session_id in self.kept:
            raise ValueError(f"session {session_id!r} already keeps slot {self.kept[session_id].kv.slot}")
        if not 0 <= finished_len <= len(output_ids):
            raise ValueError(f"finished_len={finished_len} with {len(output_ids)} output tokens")
        del output_ids[finished_len:]
        self.resumed.pop(session_id, None)
        freed = self.cache.trim(kv, len(origin_ids) + finished_len)
        ids = np.concatenate([np.asarray(origin_ids, np.int32), np.asarray(output_ids, np.int32)])
        self.kept[session_id] = KeptSlot(kv, ids[: kv.committed_len])
        return freed

    def close(self, session_id: str) -> int | None:
        """End a session: its kept KV is cached in the tree (whole pages), the slot freed.
        Returns that slot (None: the session kept none)."""
        self.resumed.pop(session_id, None)
        kept = self.kept.pop(session_id, None)
        if kept is None:
            return None
        self.cache.release(kept.kv, kept.token_ids)
        return kept.kv.slot

    def evict_oldest(self) -> int | None:
        """Give the least recently kept slot back (its KV cached in the tree, as `close`) when
        memory or slots run short; returns the slot, None when none is kept."""
        if not self.kept:
            return None
        return self.close(next(iter(self.kept)))

    def drop_all(self) -> list[int]:
        """Free every kept slot without caching it (flush_cache, new weights); the slots."""
        slots = []
        for kept in self.kept.values():
            self.cache.release(kept.kv, None)
            slots.append(kept.kv.slot)
        self.kept.clear()
        self.resumed.clear()
        return slots
