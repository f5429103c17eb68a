"""The scheduler's view of KV memory: the calls it makes, and nothing else.

`MemoryBooks` is the contract; `actors.scheduler.books.KVBooks` implements it over kvmem/.
Who does what:
- `admit` gives a WAITING request a slot and the longest cached prefix (page-aligned, capped
  so at least one token is computed), and locks that prefix in the tree.
- `alloc` reserves KV for `n` more tokens past `committed_len`, evicting unlocked tree leaves
  if needed; it returns the pages appended to the request's table, or None (nothing changed)
  when even eviction cannot make room. Pages are whole: allocated_len is page-rounded.
- `cache_unfinished` (between prefill chunks) and `release` (finish / abort / retract) hand
  KV back: finished requests insert their prefix into the tree, the rest is freed; tails are
  freed page-aligned, never a partially kept page.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from actors.scheduler.req import Req


class MemoryBooks(Protocol):
    page_size: int

    def match_len(self, req: Req) -> int:
        """Cached prefix length the tree would grant `req` now (no locking; for LPM ordering)."""
        ...

    def admit(self, req: Req) -> bool:
        """Slot + prefix for a WAITING request; sets req.slot, req.cached_len, req.committed_len.
        False (nothing changed) when no slot is free."""
        ...

    def pages(self, req: Req) -> np.ndarray:
        """The request's page table (pages covering its allocated tokens)."""
        ...

    def alloc(self, req: Req, n_tokens: int) -> np.ndarray | None: ...

    def cache_unfinished(self, req: Req) -> None: ...

    def release(self, req: Req, keep_len: int | None) -> None:
        """Free the request's slot. keep_len=None: free all its own KV (abort / retract);
        else insert fill_ids[:keep_len] into the tree and free the tail page-aligned."""
        ...

    def available_tokens(self) -> int:
        """Tokens allocatable now: free pages plus evictable tree pages, times page_size."""
        ...

    def free_slots(self) -> int: ...

    def flush(self) -> None:
        """Empty the tree and pools (only called when no request holds memory)."""
        ...

    def check_integrity(self, live: list[Req]) -> None: ...
