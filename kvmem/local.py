"""The sliding layers' own page space (models that mix sliding-window and global layers: Gemma 2/3).

A sliding layer's query at position q reads keys (q - window, q] only, so a request's sliding
layers need the pages of its last `window` positions, not of its whole context. With a local
space (`KVCache(local_pages=...)`) those layers keep their KV in a second, smaller pool of pages
and every slot has a second page table, indexed like the global one (logical page i covers
positions [i * page_size, (i + 1) * page_size)):

    logical page     0 ........ first - 1 | first ................... n_pages - 1
    global table     [ every page of the context .................................. ]
    local table      [ dropped (0)        | the window's pages: own (HELD) or the tree's ]

At each `KVCache.reserve` the pages wholly before `committed_len - keep` are dropped (own ones
freed, the tree's only no longer referenced), `keep = window - 1 + slack`: the slack covers
positions a verify round commits as an upper bound and takes back. When the local pool runs
short, every live slot is swept alike first, each up to its length before the step being
planned (`KVCache.begin_step`): what that step's queries read stays, what earlier steps (still
running on the device, in stream order before it) read may go. The runner's mirror keeps
the dropped ids (another request may own them by now): no query of the row sees a key there
unmasked (model/compute/attention/base.py). The tree keeps local pages beside its global ones,
0 where dropped (a tombstone); a prefix is matched only where its last window's local pages are
all there (radix.py), and `protected` says which of the tree's local pages live slots still read.
"""

from __future__ import annotations

import numpy as np

from ringserve.kvmem.allocator import KVUsageError, PageAllocator

_EMPTY = np.zeros(0, np.int32)


def first_needed(pos: int, window: int, page_size: int) -> int:
    """The first logical page a query at position `pos` or later reads in a sliding layer."""
    return max(0, pos - window + 1) // page_size


class LocalTables:
    """The local page allocator and every slot's local page table (the slots are SlotPool's)."""

    def __init__(self, num_pages: int, page_size: int, max_slots: int, window: int, slack: int):
        if window < 1 or slack < 0:
            raise ValueError(f"a local page space needs window >= 1 and slack >= 0, got {window}, {slack}")
        self.allocator = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.window = window
        self.keep = window - 1 + slack  # positions before committed_len whose pages stay
        self.table = np.zeros((max_slots, 64), np.int32)
        self.owned = np.zeros((max_slots, 64), bool)
        self.first = np.zeros(max_slots, np.int32)  # first live entry; earlier ones are dropped (0)

    def pages(self, slot: int, n: int) -> np.ndarray:
        """The slot's first `n` local entries (a view; 0 before `first`)."""
        return self.table[slot, :n]

    def start(self, slot: int, local: np.ndarray, first: int) -> None:
        """A slot (re)admitted over a tree prefix: the tree's local pages from `first` on (all
        present: the match guarantees it), nothing before."""
        n = len(local)
        self._fit(n)
        self.table[slot, :n] = local
        self.table[slot, : min(first, n)] = 0
        self.owned[slot, :n] = False
        self.first[slot] = min(first, n)
        if (self.table[slot, self.first[slot] : n] == 0).any():
            raise KVUsageError(f"slot {slot}: a matched prefix lacks local pages in its window")

    def append(self, slot: int, at: int, pages: np.ndarray) -> None:
        """Own pages for logical pages [at, at + len(pages))."""
        k = len(pages)
        self._fit(at + k)
        self.table[slot, at : at + k] = pages
        self.owned[slot, at : at + k] = True

    def drop_before(self, slot: int, committed_len: int) -> None:
        """Drop the entries wholly before `committed_len - keep`: no query from there on reads them."""
        stop = max(0, committed_len - self.keep) // self.page_size
        first = int(self.first[slot])
        if stop <= first:
            return
        own = self.owned[slot, first:stop]
        self.allocator.free(self.table[slot, first:stop][own])
        self.table[slot, first:stop] = 0
        self.owned[slot, first:stop] = False
        self.first[slot] = stop

    def cut(self, slot: int, keep_pages: int, n: int) -> None:
        """Entries [keep_pages, n) leave the table (own ones freed)."""
        if keep_pages >= n:
            return
        own = self.owned[slot, keep_pages:n]
        self.allocator.free(self.table[slot, keep_pages:n][own])
        self.table[slot, keep_pages:n] = 0
        self.owned[slot, keep_pages:n] = False
        self.first[slot] = min(int(self.first[slot]), keep_pages)

    def disown(self, slot: int, start: int, stop: int) -> None:
        """The tree adopted the slot's local pages [start, stop) (the dropped ones stay 0)."""
        self.owned[slot, start:stop] = False

    def protected(self, slots: np.ndarray, n_pages: np.ndarray) -> np.ndarray:
        """The tree's local pages that the live `slots` still read (their windows' shared entries)."""
        parts = [self.table[s, self.first[s] : n_pages[s]][~self.owned[s, self.first[s] : n_pages[s]]] for s in slots]
        return np.concatenate(parts) if parts else _EMPTY

    def reset(self) -> None:
        self.allocator.reset()
        self.table[:] = 0
        self.owned[:] = False
        self.first[:] = 0

    def _fit(self, need: int) -> None:
        width = self.table.shape[1]
        if need <= width:
            return
        width = max(need, 2 * width)
        table = np.zeros((self.table.shape[0], width), np.int32)
        owned = np.zeros((self.table.shape[0], width), bool)
        table[:, : self.table.shape[1]] = self.table
        owned[:, : self.owned.shape[1]] = self.owned
        self.table, self.owned = table, owned
