"""N-gram (prompt lookup) drafts for speculative decoding, proposed on the host.

A request's draft is what followed the most recent earlier occurrence of its context's longest
repeated suffix (n from `max_n` down to 1), continued periodically past the context's end:
text that copies from its own context (code edits, summaries, quotes, loops) repeats long runs,
and a verify round then accepts several tokens at once.

With overlap, rounds still in flight will produce tokens the host has not seen yet; the draft
for the next round assumes they accept all of theirs (the continuation, `skip` tokens on). A
wrong guess only costs acceptance: every draft is checked against the target model.
"""

from __future__ import annotations

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
