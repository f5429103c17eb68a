"""The KV books of one engine: page allocator + slot pool + radix tree + streaming sessions.

The per-request contract (lengths in tokens, see kvmem/slots.py for a row's regions):
- `admit(prefix_ids)`: a slot, plus the longest cached page-aligned prefix of `prefix_ids`
  (the caller caps it so at least one token is computed); the prefix node is locked and its
  pages (tree-owned) start the row. cached_len == committed_len == allocated_len == matched.
- `reserve(kv, extend_len)`: allocated_len >= committed_len + extend_len (lookahead included),
  evicting unlocked tree leaves if the free list is short. Returns the pages appended to the
  row, or None with nothing changed when even eviction cannot make room. Idempotent.
- `commit(kv, n)`: n more positions hold KV (the caller wrote, or scheduled, them).
- `cache_unfinished(kv, ids)`: ids = the tokens [0, committed_len); caches their whole pages.
- `release(kv, ids)`: finish (ids = tokens [0, keep_len) worth keeping, inserted page-aligned)
  or abort / retract (ids None). Every page the row still owns is freed, the lock is dropped,
  the slot is freed.
- `trim(kv, keep_len)`: seed 001's page-aligned tail free for a slot that lives on.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvmem.allocator import KVUsageError, PageAllocator
from kvmem.integrity import check_integrity
from kvmem.radix import RadixCache, TreeNode
from kvmem.sessions import SessionSlots
from kvmem.slots import ReqKV, SlotPool

_EMPTY = np.zeros(0, np.int32)


class KVCache:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, disable_radix_cache: bool = False):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        self.slots = SlotPool(max_slots, self.allocator)
        self.tree = RadixCache(page_size, self.allocator, disable=disable_radix_cache)
        self.sessions = SessionSlots(self)

    # ---- sizes ------------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Tokens allocatable now: free pages plus evictable tree pages."""
        return (self.allocator.num_free + self.tree.evictable_pages) * self.page_size

    def match_len(self, prefix_ids: np.ndarray, extra_key: str | None = None) -> int:
        """Tokens `admit(prefix_ids)` would be granted now (changes nothing)."""
        return self.tree.prefix_len(prefix_ids, extra_key)

    # ---- per request ------------------------------------------------------------------------
    def admit(self, prefix_ids: np.ndarray, extra_key: str | None = None) -> ReqKV | None:
        slot = self.slots.alloc_slot()
        if slot is None:
            return None
        m = self.tree.match_prefix(prefix_ids, extra_key)
        self.tree.inc_lock_ref(m.node)
        self.slots.append(slot, m.pages, owned=False)
        return ReqKV(slot, m.node, extra_key, m.length, m.length, m.length)

    def reserve(self, kv: ReqKV, extend_len: int) -> np.ndarray | None:
        target = kv.committed_len + extend_len
        if target <= kv.allocated_len:
            return _EMPTY
        need = -(-target // self.page_size) - int(self.slots.n_pages[kv.slot])
        pages = _EMPTY
        if need > 0:
            short = need - self.allocator.num_free
            if short > 0:
                if short > self.tree.evictable_pages:
                    return None
                self.tree.evict(short * self.page_size)
            got = self.allocator.alloc(need)
            assert got is not None, f"eviction freed too little for {need} pages"
            self.slots.append(kv.slot, got, owned=True)
            pages = got
        kv.allocated_len = target
        return pages

    def commit(self, kv: ReqKV, n: int) -> None:
        if kv.committed_len + n > kv.allocated_len:
            raise KVUsageError(
                f"slot {kv.slot}: commit of {n} tokens past allocated_len={kv.allocated_len} (committed_len={kv.committed_len})"
            )
        kv.committed_len += n

    def cache_unfinished(self, kv: ReqKV, token_ids: np.ndarray) -> None:
        assert len(token_ids) <= kv.committed_len, (
            f"slot {kv.slot}: caching {len(token_ids)} tokens, committed_len={kv.committed_len}"
        )
        self.tree.cache_unfinished_req(self.slots, kv, token_ids)

    def release(self, kv: ReqKV, token_ids: np.ndarray | None = None) -> None:
        assert token_ids is None or len(token_ids) <= kv.committed_len, (
            f"slot {kv.slot}: keeping {len(token_ids)} tokens, committed_len={kv.committed_len}"
        )
        self.tree.cache_finished_req(self.slots, kv, token_ids)

    def trim(self, kv: ReqKV, keep_len: int) -> int:
        """Cut a live record to `keep_len` tokens: committed_len and allocated_len are capped at
        keep_len and pages wholly past ceil(keep_len / page_size) are freed (seed 001). The
        partially kept page stays; if the tree owns it, the cut moves back to its start, since
        the slot's next turn will write into the rest of that page. Returns pages freed."""
        page, n = self.page_size, int(self.slots.n_pages[kv.slot])
        if keep_len % page and keep_len // page < n and not self.slots.owned[kv.slot, keep_len // page]:
            keep_len -= keep_len % page
        freed = self.slots.free_tail(kv.slot, keep_len)
        kv.allocated_len = min(kv.allocated_len, keep_len)
        kv.committed_len = min(kv.committed_len, keep_len)
        kv.cached_len = min(kv.cached_len, kv.committed_len)
        return freed

    # ---- whole pool -------------------------------------------------------------------------
    def flush(self) -> None:
        """Empty the tree and reset the pools; refuses (changing nothing) while a slot is live."""
        live = np.flatnonzero(self.slots.live)
        if live.size:
            raise KVUsageError(f"flush while slot {int(live[0])} is live")
        self.tree.reset()
        self.allocator.reset()
        self.slots.reset()

    def check_integrity(self, live: Iterable[ReqKV], locks: Iterable[TreeNode] = ()) -> None:
        """`live`: the records of every running request; sessions' kept slots are added here;
        `locks`: nodes locked by other callers of `tree.inc_lock_ref`, one entry per lock."""
        check_integrity(self.allocator, self.slots, self.tree, [*live, *self.sessions.records()], locks)
