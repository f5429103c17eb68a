"""Speculative decoding's part of the scheduler: n-gram (prompt lookup) drafts, proposed on the
host, and each request's speculation state (`SpecState`, `req.spec`).

A request's draft is what followed the most recent earlier occurrence of its context's longest
repeated suffix (n from `max_n` down to 1), continued periodically past the context's end:
text that copies from its own context (code edits, summaries, quotes, loops) repeats long runs,
and a verify round then accepts several tokens at once.

With overlap, rounds still in flight will produce tokens the host has not seen yet; the draft
for the next round assumes they accept all of theirs (the continuation, `skip` tokens on). A
wrong guess only costs acceptance: every draft is checked against the target model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

NO_DRAFT = -1  # pads a round's drafts; never equal to a sampled token


def propose(context: np.ndarray, k: int, skip: int = 0, max_n: int = 4) -> np.ndarray:
    """Up to `k` draft tokens continuing `context` (int32), `skip` tokens past its end."""
    L = len(context)
    for n in range(min(max_n, L - 1), 0, -1):
        tail = context[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(context[: L - 1], n)  # [L - n, n], ends before the tail
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            # what followed the match, and past the context's end the same again: the tail
            # repeated the match, so the continuation repeats with period L - start
            start = int(hits[-1]) + n
            cont = np.resize(context[start:], skip + k)
            return cont[skip:].astype(np.int32)
    return np.zeros(0, np.int32)


def padded(drafts: np.ndarray, k: int) -> np.ndarray:
    out = np.full(k, NO_DRAFT, np.int32)
    out[: len(drafts)] = drafts[:k]
    return out


@dataclasses.dataclass(slots=True)
class SpecState:
    """One request's speculation: what each of its sampling steps in flight is expected to
    yield (so the next round drafts past them) and the rounds' counts (reported at finish)."""

    k: int  # drafts per round
    max_n: int  # longest suffix n-gram looked up
    in_flight: list[int] = dataclasses.field(default_factory=list)  # tokens each step in flight yields if all accepted
    verify_ct: int = 0  # verify rounds processed
    accepted: int = 0  # drafts they accepted

    def scheduled(self, context: np.ndarray | None, valid: Callable[[np.ndarray], int] | None = None) -> np.ndarray | None:
        """A sampling step of the request was planned: the last prefill chunk (context None: it
        yields one token) or a verify round, whose k drafts (padded) are returned. `valid(drafts)`
        (a grammar's) says how many leading drafts may be kept; the rest are never proposed."""
        if context is None:
            self.in_flight.append(1)
            return None
        drafts = propose(context, self.k, sum(self.in_flight), self.max_n)
        if valid is not None:
            drafts = drafts[: valid(drafts)]
        self.in_flight.append(len(drafts) + 1)  # what the round yields if all are accepted
        return padded(drafts, self.k)

    def resolved(self, yielded: int) -> None:
        """The oldest step in flight came back with `yielded` tokens (a verify round's accepted
        drafts + 1); a round drafted on a wrong guess now expects its bonus token only."""
        if not self.in_flight:
            return
        expected = self.in_flight.pop(0)
        if yielded != expected and self.in_flight:
            self.in_flight[0] = 1

    def counted(self, accepted: int) -> None:
        """A verify round of the request's output was processed."""
        self.verify_ct += 1
        self.accepted += accepted

    def retracted(self) -> None:
        """Steps in flight are dropped with the request's KV (their results are stale)."""
        self.in_flight.clear()
