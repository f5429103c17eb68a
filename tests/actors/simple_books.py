"""A minimal MemoryBooks (no prefix cache) for scheduler tests that need exact page counts
without the radix tree; the engine uses actors.scheduler.books.KVBooks over kvmem/."""

from __future__ import annotations

import numpy as np

from actors.scheduler.req import Req


class SimpleBooks:
    def __init__(self, num_pages: int, page_size: int, max_slots: int):
        self.page_size = page_size
        self.free_pages = list(range(1, num_pages))  # page 0 is the sink
        self.free_slot_ids = list(range(max_slots))
        self.tables: dict[int, list[int]] = {}  # slot -> pages
        self.num_pages = num_pages

    def match_len(self, req: Req) -> int:
        return 0

    def admit(self, req: Req) -> bool:
        if not self.free_slot_ids:
            return False
        req.slot = self.free_slot_ids.pop(0)
        self.tables[req.slot] = []
        req.cached_len = req.committed_len = 0
        return True

    def pages(self, req: Req) -> np.ndarray:
        return np.asarray(self.tables[req.slot], np.int32)

    def alloc(self, req: Req, n_tokens: int) -> np.ndarray | None:
        table = self.tables[req.slot]
        need = -(-(req.committed_len + n_tokens) // self.page_size) - len(table)
        if need > len(self.free_pages):
            return None
        new = [self.free_pages.pop(0) for _ in range(max(0, need))]
        table += new
        return np.asarray(new, np.int32)

    def cache_unfinished(self, req: Req) -> None:
        pass

    def release(self, req: Req, keep_len: int | None) -> None:
        self.free_pages += self.tables.pop(req.slot)
        self.free_slot_ids.append(req.slot)

    def available_tokens(self) -> int:
        return len(self.free_pages) * self.page_size

    def free_slots(self) -> int:
        return len(self.free_slot_ids)

    def flush(self) -> None:
        pass

    def check_integrity(self, live: list[Req]) -> None:
        held = [p for t in self.tables.values() for p in t]
        assert sorted(held + self.free_pages) == list(range(1, self.num_pages)), "page leak or double hold"
        assert sorted(r.slot for r in live) == sorted(self.tables), "slot table disagrees with live requests"
