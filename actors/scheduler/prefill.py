"""Building a prefill (extend) batch: token budgets, chunking, one chunked request at a time.

Budgets of one prefill batch (as in SGLang's PrefillAdder, seed 003):
- rem_input : new tokens this batch may compute (max_prefill_tokens)
- rem_chunk : new tokens this batch may still compute before a request is cut to a chunk
              (chunked_prefill_size, spent by every request as in SGLang; None = off)
- rem_total : KV tokens left after reserving, for every running request and every request
              admitted here, `min(remaining max_new_tokens, CLIP) * new_token_ratio` decode room

A request whose remaining extend exceeds rem_chunk is cut to a (page-aligned) chunk and becomes
THE chunked request; nothing else is added after it. It resumes first in the next batch.

A step runs in the smallest extend program holding its tokens (powers of two, model/compute/step_inputs.py
`Buckets`), so a step of 300 tokens computes 512. Where a step's own cost is small beside a
token's (CPU: `ServerArgs.prefill_step_cost`), `BucketFit` cuts such a step at the bucket below
(256) and leaves the rest to the next step, where it runs in a small program or beside the next
requests: SmolLM2 f32 on 2 cores, a 300-token prompt's prefill 811 ms in one step, 413 + 143 ms
in two (bench.step_floor).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence

from ringserve.actors.scheduler.batch import Row
from ringserve.actors.scheduler.decode import decode_reserve
from ringserve.actors.scheduler.req import Req
from ringserve.kvmem import KVCache, cdiv


class BucketFit:
    """How many of a prefill step's tokens to compute in it. A step of n tokens costs about
    `step_cost` + the bucket holding n (the extend programs' token counts, ascending), in prefill
    tokens; a step is cut at the largest bucket below n when that plus the least cost of the rest,
    in steps of its own, is less than running it whole (the rest's steps would often be shared
    with other requests: this never cuts where sharing was needed to gain)."""

    def __init__(self, buckets: Sequence[int], step_cost: int):
        if not buckets or step_cost < 1:
            raise ValueError(f"BucketFit: buckets {list(buckets)!r} and step_cost={step_cost} >= 1")
        self.buckets = sorted(buckets)
        self.step_cost = step_cost
        self._cost: dict[int, int] = {}  # n -> cost(n), at most one entry per token count

    def padded(self, n: int) -> int:
        """The tokens the step's program computes (n itself past the largest bucket)."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else n

    def _below(self, n: int) -> int:
        """The largest bucket under n; 0 when there is none."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i - 1] if i > 0 else 0

    def cost(self, n: int) -> int:
        """The least cost of n tokens in steps of their own, each cut at a bucket or whole."""
        if (known := self._cost.get(n)) is None:
            whole = self.step_cost + self.padded(n)
            lo = self._below(n)
            known = self._cost[n] = min(whole, self.step_cost + lo + self.cost(n - lo)) if lo else whole
        return known

    def take(self, n: int) -> int:
        """n, or the bucket under n where cutting there costs less than the whole step."""
        return self._below(n) if self.cost(n) < self.step_cost + self.padded(n) else n


class AddResult(enum.Enum):
    CONTINUE = 0  # added (fully); try the next request
    NO_TOKEN = 1  # out of KV or input budget: stop adding
    CHUNKED = 2  # added a chunk; stop adding


class PrefillAdder:
    def __init__(
        self,
        cache: KVCache,
        *,
        reserved_decode: float,
        max_prefill_tokens: int,
        chunk_size: int | None,
        new_token_ratio: float,
        other_tokens: int = 0,
    ):
        """`other_tokens`: the step's tokens besides its extends (mixed decode rows)."""
        self.cache = cache
        self.other_tokens = other_tokens
        self.page = cache.page_size
        self.reserved_decode = reserved_decode
        self.planned_kv = 0.0  # KV this batch will take: its extends' new pages + decode reserves
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunk_size
        self.ratio = new_token_ratio
        self.planned: list[Row] = []  # extend rows, pages not reserved yet

    @property
    def rem_total(self) -> float:
        """KV tokens left for this batch. Read live, as admitting a request locks its cached
        prefix, which then stops counting as evictable room (SGLang's `_lock_node`)."""
        return self.cache.available_tokens() - self.reserved_decode - self.planned_kv

    def _paged(self, req: Req, n: int) -> int:
        """Tokens of the whole pages `n` more tokens past committed_len take from the pool."""
        p, start = self.page, req.committed_len
        return (cdiv(start + n, p) - cdiv(start, p)) * p

    def add(self, req: Req) -> AddResult:
        """Plan `req`'s next extend (already admitted: slot and cached prefix set)."""
        want = req.remaining_extend
        assert want > 0, f"request {req.rid} has nothing to extend"
        limit = self.rem_input
        if self.rem_chunk is not None:
            limit = min(limit, self.rem_chunk)
        if limit <= 0 or self.rem_total - decode_reserve(req, self.ratio) < self._paged(req, min(want, limit)):
            return AddResult.NO_TOKEN
        if want <= limit:
            self._take(req, want, True)
            return AddResult.CONTINUE
        # Chunk: end on a page boundary when that still computes something, so the tree can
        # cache whole pages between chunks; a chunk budget below a page is used as is.
        n = ((req.committed_len + limit) // self.page) * self.page - req.committed_len
        self._take(req, n if n > 0 else limit, False)
        return AddResult.CHUNKED

    def fit(self, fit: BucketFit) -> list[Req]:
        """Once every request is added: cut the step where `fit` says (never into its other
        tokens, and its first row keeps a token at least). The row across the cut becomes a
        (page-aligned where that computes something) chunk, the chunked request; the rows past it
        leave the step, and their requests are returned, for their admission to be undone."""
        extends = sum(r.extend_len for r in self.planned)
        room = fit.take(self.other_tokens + extends) - self.other_tokens
        if room <= 0 or room >= extends:
            return []
        kept: list[Row] = []
        for row in self.planned:
            if room <= 0:
                break
            if row.extend_len <= room:
                kept.append(row)
            else:
                req = row.req
                n = ((req.committed_len + room) // self.page) * self.page - req.committed_len
                kept.append(Row.extend(req, n if n > 0 else room, last_chunk=False))
            room -= row.extend_len
        dropped = [r.req for r in self.planned[len(kept) :]]
        self.planned = kept
        return dropped

    def _take(self, req: Req, n: int, last: bool) -> None:
        self.planned.append(Row.extend(req, n, last_chunk=last))
        self.rem_input -= n
        if self.rem_chunk is not None:
            self.rem_chunk -= n
        self.planned_kv += self._paged(req, n) + (decode_reserve(req, self.ratio) if last else 0)
