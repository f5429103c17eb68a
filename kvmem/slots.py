"""The slot pool (SGLang's req_to_token): one page table of KV page ids per live request.

A slot's page table, in tokens (`page_size` tokens per page):

    0          cached_len         committed_len        allocated_len     n_pages * page_size
    [ tree prefix | KV written this turn | reserved, not written | page padding ]
    |<----------------------- table[:n_pages] (page ids) ----------------------->|

- cached_len    : prefix granted at admission (tree match or a session's kept slot)
- committed_len : positions whose KV is written (or scheduled to be, in stream order)
- allocated_len : positions reserved; n_pages == ceil(allocated_len / page_size)

Each page of a page table is either OWNED by the request (allocator state HELD; freed when the
request lets go of it) or owned by the radix tree (state TREE; kept alive by the lock the
request holds on `ReqKV.node`, whose root path holds that very page at the same index).
A live page table only grows at its end or is cut at its end (`free_tail`): pages already in it are
never replaced or reordered, because the runner mirrors page tables incrementally. A page table is a
*request slot*; a page id times page_size plus an offset is a *token location*.
"""

from __future__ import annotations

import numpy as np

from ringserve.kvmem.allocator import KVUsageError, PageAllocator, cdiv


class SlotPool:
    def __init__(self, max_slots: int, allocator: PageAllocator, initial_width: int = 64):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.max_slots = max_slots
        self.max_width = allocator.capacity  # a page table can at most hold the whole pool
        width = max(1, min(initial_width, self.max_width))
        self.table = np.zeros((max_slots, width), np.int32)  # page ids; unused cells are 0 (sink)
        self.owned = np.zeros((max_slots, width), bool)
        self.n_pages = np.zeros(max_slots, np.int32)
        self.live = np.zeros(max_slots, bool)
        self._free = list(range(max_slots - 1, -1, -1))  # alloc pops the lowest id first

    # ---- slots ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_slot_ids(self) -> list[int]:
        return list(self._free)

    def alloc_slot(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.live[slot] = True
        return slot

    def free_slot(self, slot: int) -> None:
        """Return an empty slot (its pages must have been given back first)."""
        self._check_live(slot, "free_slot")
        if self.n_pages[slot]:
            raise KVUsageError(f"free_slot of slot {slot}: it still holds pages {self.pages(slot).tolist()}")
        self.live[slot] = False
        self._free.append(slot)

    def reset(self) -> None:
        """Every slot free again, lowest id first (only when none is live)."""
        if self.live.any():
            raise KVUsageError(f"slot pool reset while slot {int(np.flatnonzero(self.live)[0])} is live")
        self._free = list(range(self.max_slots - 1, -1, -1))

    # ---- page tables ---------------------------------------------------------------------------
    def pages(self, slot: int) -> np.ndarray:
        """The page table's page ids (a view: copy it to keep it)."""
        return self.table[slot, : self.n_pages[slot]]

    def owned_mask(self, slot: int) -> np.ndarray:
        return self.owned[slot, : self.n_pages[slot]]

    def append(self, slot: int, pages: np.ndarray, owned: bool) -> None:
        self._check_live(slot, "append")
        n, k = int(self.n_pages[slot]), len(pages)
        if n + k > self.table.shape[1]:
            self._grow(n + k)
        self.table[slot, n : n + k] = pages
        self.owned[slot, n : n + k] = owned
        self.n_pages[slot] = n + k

    def disown(self, slot: int, start: int, stop: int) -> None:
        """Pages [start, stop) of the page table now belong to the tree (the caller adopted them)."""
        assert self.owned[slot, start:stop].all(), f"slot {slot}: disown of pages it does not own"
        self.owned[slot, start:stop] = False

    def free_tail(self, slot: int, keep_len: int) -> int:
        """Cut the page table after the page holding token `keep_len - 1`: pages wholly past
        ceil(keep_len / page_size) leave it (owned ones are freed, tree ones only dropped).
        A partially kept page is never freed. Returns the number of pages freed."""
        self._check_live(slot, "free_tail")
        keep = cdiv(max(keep_len, 0), self.page_size)
        n = int(self.n_pages[slot])
        if keep >= n:
            return 0
        tail, own = self.table[slot, keep:n], self.owned[slot, keep:n]
        freed = tail[own]
        self.allocator.free(freed)
        self.table[slot, keep:n] = 0
        self.owned[slot, keep:n] = False
        self.n_pages[slot] = keep
        return int(freed.size)

    # ---- internals --------------------------------------------------------------------------
    def _check_live(self, slot: int, what: str) -> None:
        if not 0 <= slot < self.max_slots:
            raise KVUsageError(f"{what} of slot {slot}: out of range [0, {self.max_slots})")
        if not self.live[slot]:
            raise KVUsageError(
                f"{what} of slot {slot}: it is not allocated (double free, or never allocated)"
            )

    def _grow(self, need: int) -> None:
        if need > self.max_width:
            raise KVUsageError(f"a page table of {need} pages exceeds the pool ({self.max_width} pages)")
        width = min(self.max_width, max(need, 2 * self.table.shape[1]))
        table = np.zeros((self.max_slots, width), np.int32)
        owned = np.zeros((self.max_slots, width), bool)
        old = self.table.shape[1]
        table[:, :old] = self.table
        owned[:, :old] = self.owned
        self.table, self.owned = table, owned
