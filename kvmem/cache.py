"""`KVCache`: the one facade the scheduler calls for KV memory (page allocator + slot pool +
radix tree), with the per-request contract. Lengths are in tokens; see kvmem/slots.py for a
page table's regions and kvmem/req_kv.py for the record.

- `match_len(prefix_ids)`: what `admit` would grant now (changes nothing; LPM ordering).
- `admit(prefix_ids)`: a request slot, plus the longest cached page-aligned prefix of
  `prefix_ids` (the caller caps it so at least one token is computed); the prefix node is
  locked and its pages (tree-owned) start the page table. cached_len == committed_len ==
  allocated_len == matched. None (nothing changed) when no slot is free.
- `reserve(kv, extend_len)`: allocated_len >= committed_len + extend_len, evicting unlocked
  tree leaves if the free list is short. Returns the pages appended to the page table, or None with
  nothing changed when even eviction cannot make room. Idempotent.
- `commit(kv, n)`: n more positions hold KV (the caller wrote, or scheduled, them in order);
  `uncommit(kv, n)` takes back the last n of them (a speculative round's rejected drafts).
- `cache_unfinished(kv, ids)`: ids = the tokens [0, committed_len) (or fewer); their whole
  pages enter the tree. The page table is unchanged (the runner mirrors it).
- `release(kv, ids)`: finish (ids = tokens [0, keep_len) worth keeping, inserted
  page-aligned) or abort / retract (ids None). Every page the page table still owns is freed (the
  partial last page included), the lock is dropped, the slot is freed.
- `trim(kv, keep_len)`: seed 001's page-aligned tail free, for a slot that lives on.

With a local page space (`local_pages` > 0: the sliding layers' own pages, kvmem/local.py) every
slot also has a local page table of the same length: `admit` starts it with the tree's local
pages of the matched prefix's last window, `reserve` drops what fell out of the window before it
appends one local page per global page (tombstoning the tree's unread local pages when the local
pool is short), and the tree adopts both at an insert. The local pool is sized so that the
windows of every slot fit at once (actors/transport/memory.py): it never refuses a reserve.

Who owns a page table's pages: the request (HELD) or the tree (TREE, kept alive by the request's lock
on `kv.node`, whose root path holds those pages at the same indices). A live page table is
append-only: where the tree already holds a prefix under other pages, the request keeps its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ringserve.kvmem.allocator import KVUsageError, PageAllocator, cdiv
from ringserve.kvmem.integrity import check_integrity
from ringserve.kvmem.local import LocalTables, first_needed
from ringserve.kvmem.radix import InsertResult, RadixCache, TreeNode
from ringserve.kvmem.req_kv import ReqKV
from ringserve.kvmem.slots import SlotPool

_EMPTY = np.zeros(0, np.int32)


class KVCache:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, disable_radix_cache: bool = False,
                 local_pages: int = 0, window: int = 0, slack: int = 0):  # fmt: skip
        """`local_pages` > 0: the sliding layers' own page space of that many pages (the sink
        included), for their `window`; `slack`: positions a step may commit and take back."""
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        self.slots = SlotPool(max_slots, self.allocator)
        self.local = LocalTables(local_pages, page_size, max_slots, window, slack) if local_pages else None
        self.tree = RadixCache(page_size, self.allocator, disable=disable_radix_cache,
                               local=self.local.allocator if self.local else None, window=window)  # fmt: skip
        self.records: dict[int, ReqKV] = {}  # slot -> its live record (a running request or a kept session)
        self.step = 0  # the step being planned (`begin_step`)
        self.local_sweeps = self.local_tombstoned = 0  # the local pool's shortages met (server info)

    # ---- sizes ------------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Tokens allocatable now: free pages plus evictable tree pages."""
        return (self.allocator.num_free + self.tree.evictable_pages) * self.page_size

    def local_available_tokens(self) -> int:
        """The local pool's tokens allocatable now: free pages plus the tree's pages no live slot
        reads (0 without a local space)."""
        if self.local is None:
            return 0
        live = np.flatnonzero(self.slots.live)
        protected = self.local.protected(live, self.slots.n_pages)
        in_tree = sum(int(np.count_nonzero(n.local)) for n in self.tree.nodes() if n.local is not None)
        return (self.local.allocator.num_free + in_tree - len(np.unique(protected))) * self.page_size

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    def match_len(self, prefix_ids: np.ndarray, extra_key: str | None = None) -> int:
        return self.tree.prefix_len(prefix_ids, extra_key)

    # ---- per request ------------------------------------------------------------------------
    def admit(self, prefix_ids: np.ndarray, extra_key: str | None = None) -> ReqKV | None:
        slot = self.slots.alloc_slot()
        if slot is None:
            return None
        m = self.tree.match_prefix(prefix_ids, extra_key)
        self.tree.inc_lock_ref(m.node)
        self.slots.append(slot, m.pages, owned=False)
        if self.local is not None:
            self.local.start(slot, m.local, first_needed(m.length, self.local.window, self.page_size))
        kv = self.records[slot] = ReqKV(slot, m.node, extra_key, m.length, m.length, m.length)
        return kv

    def begin_step(self) -> None:
        """The scheduler starts planning a new step: the lengths its records have now were
        committed by steps that run before it on the device (what a local sweep may drop)."""
        self.step += 1

    def pages(self, kv: ReqKV) -> np.ndarray:
        """The page table's page ids (a view: copy it to keep it)."""
        return self.slots.pages(kv.slot)

    def local_pages(self, kv: ReqKV, last: int | None = None) -> np.ndarray:
        """The local page table (a view; 0 where dropped), or its `last` entries; empty without
        a local space."""
        if self.local is None:
            return _EMPTY
        n = int(self.slots.n_pages[kv.slot])
        table = self.local.pages(kv.slot, n)
        return table if last is None else table[n - last :]

    def reserve(self, kv: ReqKV, extend_len: int) -> np.ndarray | None:
        target = kv.committed_len + extend_len
        if target <= kv.allocated_len:
            return _EMPTY
        n = int(self.slots.n_pages[kv.slot])
        need = cdiv(target, self.page_size) - n
        pages = _EMPTY
        if self.local is not None:
            if kv.step != self.step:
                kv.step, kv.step_len = self.step, kv.committed_len
            self.local.drop_before(kv.slot, kv.step_len)
        if need > 0:
            short = need - self.allocator.num_free
            if short > 0:
                if short > self.tree.evictable_pages:
                    return None
                self.tree.evict(short * self.page_size)
            if self.local is not None and not self._local_room(need):
                return None
            got = self.allocator.alloc(need)
            assert got is not None, f"eviction freed too little for {need} pages"
            self.slots.append(kv.slot, got, owned=True)
            if self.local is not None:
                local = self.local.allocator.alloc(need)
                assert local is not None
                self.local.append(kv.slot, n, local)
            pages = got
        kv.allocated_len = target
        return pages

    def _local_room(self, need: int) -> bool:
        """`need` free local pages, tombstoning the tree's unread ones if short."""
        assert self.local is not None
        local = self.local
        if need > local.allocator.num_free:  # every slot up to its length before this step
            self.local_sweeps += 1
            for kv in self.records.values():
                local.drop_before(kv.slot, kv.step_len if kv.step == self.step else kv.committed_len)
        short = need - local.allocator.num_free
        if short > 0:
            live = np.flatnonzero(self.slots.live)
            self.local_tombstoned += self.tree.evict_local(short, local.protected(live, self.slots.n_pages))
        return local.allocator.num_free >= need

    def commit(self, kv: ReqKV, n: int) -> None:
        if kv.committed_len + n > kv.allocated_len:
            raise KVUsageError(
                f"slot {kv.slot}: commit of {n} tokens past allocated_len={kv.allocated_len} (committed_len={kv.committed_len})"
            )
        kv.committed_len += n

    def uncommit(self, kv: ReqKV, n: int) -> None:
        """n positions committed as an upper bound (a speculative round's rejected drafts) hold
        no valid KV after all; their pages stay allocated for the request's next positions."""
        if not 0 <= n <= kv.committed_len - kv.cached_len:
            raise KVUsageError(f"slot {kv.slot}: uncommit of {n} tokens (committed_len={kv.committed_len}, cached_len={kv.cached_len})")
        kv.committed_len -= n

    def cache_unfinished(self, kv: ReqKV, token_ids: np.ndarray) -> None:
        """Between prefill chunks (or once the prompt is done): cache the written KV.

        The page-aligned part of `token_ids` is inserted. Pages the tree adopts become
        tree-owned in the page table. A prefix has one path in the tree, so the inserted node's path
        holds every tree-owned page of the page table it spans; the lock moves there when that is all
        of them (a shorter insert adopts nothing and keeps the lock where it is)."""
        assert len(token_ids) <= kv.committed_len, (
            f"slot {kv.slot}: caching {len(token_ids)} tokens, committed_len={kv.committed_len}"
        )
        n_pages = len(token_ids) // self.page_size
        res = self._adopt_table(kv, token_ids)
        shared = np.flatnonzero(~self.slots.owned_mask(kv.slot))
        if res.node is not kv.node and (shared.size == 0 or shared[-1] < n_pages):
            self.tree.inc_lock_ref(res.node)
            self.tree.dec_lock_ref(kv.node)
            kv.node = res.node
        assert shared.size == 0 or shared[-1] < n_pages or res.adopted_from == n_pages, (
            "a shorter insert adopted pages"
        )

    def release(self, kv: ReqKV, token_ids: np.ndarray | None = None) -> None:
        assert token_ids is None or len(token_ids) <= kv.committed_len, (
            f"slot {kv.slot}: keeping {len(token_ids)} tokens, committed_len={kv.committed_len}"
        )
        if token_ids is not None and len(token_ids) >= self.page_size:
            self._adopt_table(kv, token_ids, refill=True)
        if self.local is not None:
            self.local.cut(kv.slot, 0, int(self.slots.n_pages[kv.slot]))
        with self.allocator.free_group():
            self.slots.free_tail(kv.slot, 0)
        self.tree.dec_lock_ref(kv.node)
        kv.node = self.tree.root
        self.slots.free_slot(kv.slot)
        del self.records[kv.slot]

    def trim(self, kv: ReqKV, keep_len: int) -> int:
        """Cut a live record to `keep_len` tokens: committed_len and allocated_len are capped at
        keep_len and pages wholly past ceil(keep_len / page_size) are freed (seed 001). The
        partially kept page stays; if the tree owns it, the cut moves back to its start, since
        the slot's next turn will write into the rest of that page. With a local space, a cut
        whose window's local pages were dropped goes back to 0 (nothing before it can be
        recomputed alone). Returns pages freed."""
        page, n = self.page_size, int(self.slots.n_pages[kv.slot])
        if keep_len % page and keep_len // page < n and not self.slots.owned[kv.slot, keep_len // page]:
            keep_len -= keep_len % page
        if self.local is not None:
            if first_needed(keep_len, self.local.window, page) < self.local.first[kv.slot]:
                keep_len = 0
            self.local.cut(kv.slot, cdiv(keep_len, page), n)
        freed = self.slots.free_tail(kv.slot, keep_len)
        kv.allocated_len = min(kv.allocated_len, keep_len)
        kv.committed_len = min(kv.committed_len, keep_len)
        kv.cached_len = min(kv.cached_len, kv.committed_len)
        return freed

    def _adopt_table(self, kv: ReqKV, token_ids: np.ndarray, refill: bool = False) -> InsertResult:
        """Insert the page table's page-aligned prefix of `token_ids`; the pages the tree takes from
        the page table stop being the request's (the page table itself is unchanged)."""
        n_pages = len(token_ids) // self.page_size
        local = None if self.local is None else self.local.pages(kv.slot, n_pages)
        res = self.tree.insert(
            np.asarray(token_ids[: n_pages * self.page_size], np.int32),
            self.slots.pages(kv.slot)[:n_pages],
            kv.extra_key,
            local,
            refill,
        )
        self.slots.disown(kv.slot, res.adopted_from, n_pages)
        if self.local is not None:
            self.local.disown(kv.slot, res.adopted_from, n_pages)
            self.local.owned[kv.slot, res.refilled] = False  # (release: the slot goes next)
        return res

    # ---- whole pool -------------------------------------------------------------------------
    def flush(self) -> None:
        """Empty the tree and reset the pools; refuses (changing nothing) while a slot is live."""
        live = np.flatnonzero(self.slots.live)
        if live.size:
            raise KVUsageError(f"flush while slot {int(live[0])} is live")
        self.tree.reset()
        self.allocator.reset()
        self.slots.reset()
        if self.local is not None:
            self.local.reset()

    def check_integrity(self, live: Iterable[ReqKV], locks: Iterable[TreeNode] = ()) -> None:
        """`live`: the record of every slot in use (running requests and sessions' kept slots);
        `locks`: nodes locked by other callers of `tree.inc_lock_ref`, one entry per lock."""
        check_integrity(self.allocator, self.slots, self.tree, live, locks, self.local)
