"""`MemoryBooks` over kvmem: the scheduler's KV memory with a radix prefix cache.

Each admitted request carries a `kvmem.ReqKV` in `req.kv`; its committed_len is synced from
`req.committed_len` (the scheduler advances it when it schedules a step) on every call.

The runner mirrors each live row incrementally (prefix pages at admission, then appended
pages only), so a live request's row is append-only here: a prefix the tree already holds
under other pages (another request inserted it first) never replaces the request's own
pages; those stay the request's and are freed when it is released.
"""

from __future__ import annotations

import numpy as np

from actors.scheduler.memory import MemoryBooks
from actors.scheduler.req import Req
from kvmem import KVCache, ReqKV


class KVBooks:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, disable_radix_cache: bool = False):
        self.page_size = page_size
        self.cache = KVCache(num_pages, page_size, max_slots, disable_radix_cache)

    def _kv(self, req: Req) -> ReqKV:
        kv = req.kv
        assert isinstance(kv, ReqKV) and kv.slot == req.slot, (
            f"request {req.rid} holds no KV record for slot {req.slot}"
        )
        kv.committed_len = req.committed_len
        return kv

    @staticmethod
    def _prefix_ids(req: Req) -> np.ndarray:
        return req.fill_ids(0, req.fill_len - 1)  # one token is always computed

    def match_len(self, req: Req) -> int:
        return self.cache.match_len(self._prefix_ids(req))

    def admit(self, req: Req) -> bool:
        kv = self.cache.admit(self._prefix_ids(req))
        if kv is None:
            return False
        req.kv, req.slot = kv, kv.slot
        req.cached_len = req.committed_len = kv.cached_len
        return True

    def pages(self, req: Req) -> np.ndarray:
        return self.cache.slots.pages(req.slot)

    def alloc(self, req: Req, n_tokens: int) -> np.ndarray | None:
        return self.cache.reserve(self._kv(req), n_tokens)

    def cache_unfinished(self, req: Req) -> None:
        kv = self._kv(req)
        self.cache.cache_unfinished(kv, req.fill_ids(0, min(kv.committed_len, req.fill_len)))

    def release(self, req: Req, keep_len: int | None) -> None:
        kv = self._kv(req)
        self.cache.release(kv, None if keep_len is None else req.fill_ids(0, keep_len))
        req.kv = None

    def available_tokens(self) -> int:
        return self.cache.available_tokens()

    def free_slots(self) -> int:
        return self.cache.slots.num_free

    def flush(self) -> None:
        self.cache.flush()

    def check_integrity(self, live: list[Req]) -> None:
        self.cache.check_integrity([self._kv(r) for r in live])


def _conforms(books: KVBooks) -> MemoryBooks:
    return books  # mypy checks KVBooks against the protocol here
