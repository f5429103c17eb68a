"""Building a prefill (extend) batch: token budgets, chunking, one chunked request at a time.

Budgets of one prefill batch (as in SGLang's PrefillAdder, seed 003):
- rem_input : new tokens this batch may compute (max_prefill_tokens)
- rem_chunk : new tokens this batch may still compute before a request is cut to a chunk
              (chunked_prefill_size, spent by every request as in SGLang; None = off)
- rem_total : KV tokens left after reserving, for every running request and every request
              admitted here, `min(remaining max_new_tokens, CLIP) * new_token_ratio` decode room

A request whose remaining extend exceeds rem_chunk is cut to a (page-aligned) chunk and becomes
THE chunked request; nothing else is added after it. It resumes first in the next batch.
"""

from __future__ import annotations

import enum

from actors.scheduler.batch import Row
from actors.scheduler.decode import decode_reserve
from actors.scheduler.req import Req
from kvmem import KVCache, cdiv


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
    ):
        self.cache = cache
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

    def _take(self, req: Req, n: int, last: bool) -> None:
        self.planned.append(Row.extend(req, n, last_chunk=last))
        self.rem_input -= n
        if self.rem_chunk is not None:
            self.rem_chunk -= n
        self.planned_kv += self._paged(req, n) + (decode_reserve(req, self.ratio) if last else 0)
