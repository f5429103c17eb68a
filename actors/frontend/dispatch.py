"""The dispatcher: which data-parallel group a request goes to (SGLang's DataParallelController,
seed 004; the frontend asks it, nothing else in the frontend knows there are groups' loads).

    pick(ids, explicit, session) ─► explicit data_parallel_rank (the router's hook) wins
                                 ─► a session's turns stay where its first turn went
                                 ─► the load-balance method over `loads()`
    sent(rank, ids)              ─► counted at once: the next pick sees it

A group's load is what its scheduler last published on the load board (actors/transport/
loads.py: running, waiting, KV tokens used, pending prefill tokens) plus what the frontend sent
it that the scheduler has not taken off its ring yet (`sent - received`, requests and prompt
tokens). So a burst that arrives before any report spreads as it is sent (vLLM #22910), and a
report never resets the count of what is still in a ring (the stale-budget problem SGLang
throttles its refresh for).

Methods (ties go to the fewest requests, then round robin from the last pick, so no rank is
favoured by a fixed tie-break: vLLM #47420):

    round_robin     0, 1, ..., N-1, 0, ...
    total_requests  fewest running + waiting + unseen requests
    total_tokens    fewest KV tokens used + pending prefill + unseen prompt tokens
    cache_aware     least expected work: the prompt tokens the group still has to compute for
                    the requests in flight there + the tokens of this prompt it does not have
                    cached (tpu-inference #3315's `pending_prefill + (num_tokens -
                    cached_on_rank)`), so a shared prefix stays where it is cached until that
                    group is busier than recomputing it elsewhere costs (a GRPO group spreads
                    instead of pinning one rank: #3307)

cache_aware's pending work is the frontend's own count: each request in flight counts the tokens
its group did not have cached when it was sent (`uncached`), until its first output arrives
(`started`; a request that does not stream reports only when it finishes). The scheduler's
published `pending_prefill` cannot serve here: a waiting request has matched no prefix yet, so a
burst of requests over one cached prefix would read as whole prompts and spread for nothing.

"Cached" is the frontend's approximate per-group prefix index (`PrefixIndex`): the chained
hashes of the full pages of every prompt it sent there, forgotten least recently used past the
group's KV pool size. It does not see evictions or flushes (flush_cache clears it).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from ringserve.actors.transport.loads import GroupLoad

METHODS = ("round_robin", "total_requests", "total_tokens", "cache_aware")


class PrefixIndex:
    """Hashes of page-aligned prefixes sent to one group: `match(ids)` is how many leading
    tokens of `ids` (whole pages) were sent there before. At most `capacity` pages (LRU)."""

    def __init__(self, page_size: int, capacity: int):
        self.page_size, self.capacity = page_size, capacity
        self.pages: collections.OrderedDict[int, None] = collections.OrderedDict()

    def _chain(self, ids: Sequence[int]) -> list[int]:
        p, h, out = self.page_size, 0, []
        for k in range(len(ids) // p):
            h = hash((h, tuple(ids[k * p:(k + 1) * p])))
            out.append(h)
        return out

    def match(self, ids: Sequence[int]) -> int:
        n = 0
        for h in self._chain(ids):
            if h not in self.pages:
                break
            n += 1
        return n * self.page_size

    def add(self, ids: Sequence[int]) -> None:
        for h in self._chain(ids):
            self.pages[h] = None
            self.pages.move_to_end(h)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)

    def clear(self) -> None:
        self.pages.clear()


class Dispatcher:
    """Picks a group per request for `dp_size` groups; `loads()` reads the groups' published
    loads (None: no board, every group reads as idle: what was sent still counts)."""

    def __init__(self, dp_size: int, method: str, page_size: int = 16, index_pages: int = 1 << 16,
                 loads: Callable[[], list[GroupLoad]] | None = None):  # fmt: skip
        if method not in METHODS:
            raise ValueError(f"load_balance_method={method!r}: choose one of {list(METHODS)}")
        self.dp_size, self.method = dp_size, method
        self.index = [PrefixIndex(page_size, index_pages) for _ in range(dp_size)]
        self.sessions: dict[str, int] = {}  # session id -> its group
        self.attach(loads)

    def attach(self, loads: Callable[[], list[GroupLoad]] | None) -> None:
        """A (new) set of groups: their schedulers count from 0, so do we (the prefix indexes
        are emptied: a restarted group's cache is empty)."""
        self.read = loads
        self.sent_reqs = [0] * self.dp_size
        self.sent_tokens = [0] * self.dp_size
        self.next = 0  # round robin cursor (and where ties start)
        self.work = [0] * self.dp_size  # cache_aware: uncached prompt tokens of the requests in flight
        self.in_flight: dict[str, tuple[int, int]] = {}  # rid -> (rank, its uncached tokens)
        for ix in self.index:
            ix.clear()

    # ---- picking --------------------------------------------------------------------------
    def pick(self, ids: Sequence[int], explicit: int | None = None, session: str | None = None) -> int:
        if explicit is not None:
            return explicit
        if session is not None and session in self.sessions:
            return self.sessions[session]
        if self.dp_size == 1:
            return 0
        if self.method == "round_robin":
            return self.next
        loads = self.loads()
        reqs = [ld.num_reqs for ld in loads]
        if self.method == "total_requests":
            cost = reqs
        elif self.method == "total_tokens":
            cost = [ld.used_tokens + ld.pending_prefill for ld in loads]
        else:
            cost = [self.work[r] + len(ids) - self.index[r].match(ids) for r in range(self.dp_size)]
        return self._least(cost, reqs)

    def _least(self, cost: list[int], reqs: list[int]) -> int:
        best = min(zip(cost, reqs, strict=True))
        ties = [r for r in range(self.dp_size) if (cost[r], reqs[r]) == best]
        return min(ties, key=lambda r: (r - self.next) % self.dp_size)

    def loads(self) -> list[GroupLoad]:
        """Each group's published load plus what was sent to it and not yet taken off its ring
        (requests counted as waiting, their prompt tokens as pending prefill)."""
        board = self.read() if self.read is not None else [GroupLoad()] * self.dp_size
        out = []
        for r, ld in enumerate(board):
            unseen = max(0, self.sent_reqs[r] - ld.received)
            unseen_tokens = max(0, self.sent_tokens[r] - ld.received_tokens)
            out.append(GroupLoad(ld.running, ld.waiting + unseen, ld.used_tokens, ld.total_tokens,
                                 ld.pending_prefill + unseen_tokens, ld.received, ld.received_tokens))  # fmt: skip
        return out

    # ---- bookkeeping ----------------------------------------------------------------------
    def sent(self, rank: int, ids: Sequence[int], session: str | None = None, rid: str | None = None) -> None:
        """A request went to `rank` (a resubmission after a restart too)."""
        if self.method == "cache_aware" and self.dp_size > 1:
            uncached = len(ids) - self.index[rank].match(ids)
            if rid is not None:
                self.in_flight[rid] = (rank, uncached)
            self.work[rank] += uncached
        self.sent_reqs[rank] += 1
        self.sent_tokens[rank] += len(ids)
        self.next = (rank + 1) % self.dp_size
        if session is not None:
            self.sessions[session] = rank
        if self.method == "cache_aware" and self.dp_size > 1:
            self.index[rank].add(ids)

    def started(self, rid: str) -> None:
        """Request `rid` has its first output (or finished): its prompt is computed."""
        got = self.in_flight.pop(rid, None)
        if got is not None:
            self.work[got[0]] -= got[1]

    def session_closed(self, session: str) -> None:
        self.sessions.pop(session, None)

    def flushed(self) -> None:
        for ix in self.index:
            ix.clear()
