"""KVCache's per-request contract: admit with a locked prefix, reserve (lookahead, eviction,
refusal changing nothing), cache_unfinished without rewriting the row, release with and
without caching; exact page counts after each operation, integrity after each."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.kvmem import KVCache, KVUsageError


def ids(n, start=100):
    return np.arange(start, start + n, dtype=np.int32)


def counts(c: KVCache):
    """(free pages, tree pages, evictable tree pages, free slots)."""
    return c.allocator.num_free, c.tree.total_pages, c.tree.evictable_pages, c.slots.num_free


def run(c: KVCache, tokens: np.ndarray, keep: int | None = None):
    """A request computing all of `tokens` from scratch (after its prefix), then finishing."""
    kv = c.admit(tokens[:-1])
    assert c.reserve(kv, len(tokens) - kv.committed_len) is not None
    c.commit(kv, len(tokens) - kv.committed_len)
    c.release(kv, tokens[: len(tokens) if keep is None else keep])
    c.check_integrity([])
    return kv


def test_admit_reserve_commit_release_page_counts():
    c = KVCache(33, 4, 4)
    kv = c.admit(ids(9))
    assert (kv.slot, kv.cached_len, kv.committed_len, kv.allocated_len) == (0, 0, 0, 0)
    assert c.reserve(kv, 10).tolist() == [1, 2, 3] and kv.allocated_len == 10
    assert c.reserve(kv, 10).tolist() == [] and c.reserve(kv, 12).tolist() == []  # same pages
    c.commit(kv, 10)
    assert c.reserve(kv, 3).tolist() == [4]  # lookahead: 13 tokens reserved, 4 pages
    c.commit(kv, 1)
    c.check_integrity([kv])
    assert counts(c) == (28, 0, 0, 3)
    c.release(kv, ids(11))  # 11 tokens worth keeping: 2 whole pages cached, 2 pages freed
    c.check_integrity([])
    assert counts(c) == (30, 2, 2, 4) and c.available_tokens() == 32 * 4


def test_commit_past_allocated_raises_naming_the_slot():
    c = KVCache(9, 4, 2)
    kv = c.admit(ids(3))
    c.reserve(kv, 3)
    with pytest.raises(KVUsageError, match="slot 0: commit of 4 tokens past allocated_len=3"):
        c.commit(kv, 4)


def test_second_request_gets_the_cached_prefix_locked():
    c = KVCache(33, 4, 4)
    run(c, ids(20))  # caches 5 pages (1-5)
    kv = c.admit(ids(30)[:-1])  # 29 tokens: 7 whole pages, 5 cached
    assert (kv.cached_len, kv.committed_len, kv.allocated_len) == (20, 20, 20)
    assert c.slots.pages(kv.slot).tolist() == [1, 2, 3, 4, 5] and not c.slots.owned_mask(kv.slot).any()
    assert counts(c) == (27, 5, 0, 3) and c.available_tokens() == 27 * 4
    c.check_integrity([kv])
    c.release(kv)  # abort: nothing inserted, the prefix is unlocked again
    assert counts(c) == (27, 5, 5, 4)


def test_cached_prefix_is_capped_by_the_admitted_ids():
    c = KVCache(33, 4, 4)
    run(c, ids(20))
    assert c.match_len(ids(20)[:-1]) == 16  # the caller caps: one token is always computed
    assert c.admit(ids(20)[:-1]).cached_len == 16


def test_cache_unfinished_keeps_the_row_and_moves_the_lock():
    c = KVCache(33, 4, 4)
    a = c.admit(ids(19))
    c.reserve(a, 19)
    c.commit(a, 19)
    b = c.admit(ids(19))  # same prompt, admitted before a cached anything
    c.reserve(b, 19)
    c.commit(b, 19)
    row_a, row_b = c.slots.pages(a.slot).tolist(), c.slots.pages(b.slot).tolist()
    assert row_a == [1, 2, 3, 4, 5] and row_b == [6, 7, 8, 9, 10]
    c.cache_unfinished(a, ids(19))  # 4 whole pages go to the tree
    assert c.slots.owned_mask(a.slot).tolist() == [False] * 4 + [True]
    assert a.node.lock_ref == 1 and counts(c) == (22, 4, 0, 2)
    c.cache_unfinished(b, ids(19))  # already cached under a's pages: b keeps its own
    assert c.slots.pages(b.slot).tolist() == row_b and c.slots.owned_mask(b.slot).all()
    assert b.node is a.node and a.node.lock_ref == 2
    c.check_integrity([a, b])
    c.release(b, ids(19))  # b's 5 pages are freed; the tree is unchanged
    assert counts(c) == (27, 4, 0, 3)
    c.release(a, ids(19))
    assert counts(c) == (28, 4, 4, 4)
    c.check_integrity([])


def test_chunks_cached_one_after_another():
    c = KVCache(33, 2, 2)
    kv = c.admit(ids(13))
    for chunk in (4, 4, 5):
        c.cache_unfinished(kv, ids(kv.committed_len))
        c.reserve(kv, chunk)
        c.commit(kv, chunk)
    assert c.tree.total_pages == 4 and c.tree.protected_pages == 4  # 8 tokens after chunk 2
    assert c.slots.owned_mask(kv.slot).tolist() == [False] * 4 + [True] * 3
    c.check_integrity([kv])
    c.release(kv, ids(13))
    assert counts(c) == (26, 6, 6, 2)


def test_reserve_evicts_and_refuses_without_changes():
    c = KVCache(9, 2, 4)  # 8 pages
    run(c, ids(10))  # 5 pages cached
    run(c, ids(4, start=500))  # 2 more
    assert counts(c) == (1, 7, 7, 4)
    kv = c.admit(ids(9))  # 4 pages matched and locked: 3 left to evict
    assert kv.cached_len == 8 and c.available_tokens() == 4 * 2
    assert c.reserve(kv, 9) is None and kv.allocated_len == 8 and counts(c) == (1, 7, 3, 3)
    # page 8 was free; eviction frees the LRU leaves [108 109] (page 5), then [500..503] (6, 7)
    assert c.reserve(kv, 8).tolist() == [5, 6, 7, 8]
    assert counts(c) == (0, 4, 0, 3)
    c.check_integrity([kv])


def test_flush_refuses_while_a_slot_is_live():
    c = KVCache(17, 2, 2)
    run(c, ids(10))
    kv = c.admit(ids(3))
    with pytest.raises(KVUsageError, match="flush while slot 0 is live"):
        c.flush()
    assert c.tree.total_pages == 5
    c.release(kv)
    c.flush()
    assert counts(c) == (16, 0, 0, 2)
    assert c.admit(ids(4)).slot == 0 and c.allocator.alloc(1).tolist() == [1]


def test_disabled_cache_frees_everything_at_release():
    c = KVCache(17, 2, 2, disable_radix_cache=True)
    run(c, ids(10))
    assert counts(c) == (16, 0, 0, 2)
    kv = c.admit(ids(9))
    assert kv.cached_len == 0
