"""Waiting-queue order: `fcfs` (arrival) or cache-aware `lpm` (longest prefix match first).

LPM sorts by the prefix the radix tree would grant right now, longest first, so requests that
reuse cached KV run while it is still cached. Past `LPM_FALLBACK_QUEUE` waiting requests the
tree walks cost more than they save and the order falls back to FCFS (as SGLang does).

In-batch prefix sharing (LPM): when several waiting requests share a prefix that is not cached
yet, only the first is admitted in this batch; once its prefill is inserted into the tree, the
others match it instead of recomputing it.
"""

from __future__ import annotations

from collections.abc import Callable

from ringserve.actors.scheduler.req import Req

LPM_FALLBACK_QUEUE = 128
SHARED_PREFIX_TOKENS = 32  # a prefix at least this long, shared in-batch, defers the followers


def order_waiting(policy: str, waiting: list[Req], match_len: Callable[[Req], int]) -> list[Req]:
    """`match_len(req)`: the cached prefix the tree would grant `req` now."""
    if policy == "fcfs" or len(waiting) > LPM_FALLBACK_QUEUE:
        return sorted(waiting, key=lambda r: r.arrival)
    if policy == "lpm":
        matched = {id(r): match_len(r) for r in waiting}
        return sorted(waiting, key=lambda r: (-matched[id(r)], r.arrival))
    raise ValueError(f"schedule_policy={policy!r}: choose one of ['fcfs', 'lpm']")


class InBatchPrefix:
    """Remembers the uncached prefixes admitted in this batch (LPM only)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.seen: set[bytes] = set()

    def defer(self, req: Req, cached_len: int) -> bool:
        if not self.enabled or req.origin_len <= SHARED_PREFIX_TOKENS or cached_len >= SHARED_PREFIX_TOKENS:
            return False
        key = req.origin_ids[:SHARED_PREFIX_TOKENS].tobytes()
        if key in self.seen:
            return True
        self.seen.add(key)
        return False
