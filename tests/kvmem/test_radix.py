"""RadixCache: page-granular match / insert / split, namespaces, lock refs, LRU eviction,
reset, disable mode; exact page counts after every operation."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.kvmem import KVUsageError, PageAllocator, RadixCache
from ringserve.kvmem.allocator import FREE, HELD, TREE


def ids(*xs):
    return np.asarray(xs, np.int32)


def setup(num_pages=33, page=2, disable=False):
    a = PageAllocator(num_pages, page)
    return a, RadixCache(page, a, disable=disable)


def put(a, t, key, extra_key=None):
    """Insert `key` with freshly allocated pages; free the ones the tree did not adopt."""
    pages = a.alloc(len(key) // t.page_size)
    res = t.insert(np.asarray(key, np.int32), pages, extra_key)
    a.free(pages[: res.adopted_from])
    return pages, res


def sizes(t):
    return t.total_pages, t.evictable_pages, t.protected_pages, t.num_nodes


def test_match_is_page_aligned():
    a, t = setup(page=4)
    pages, res = put(a, t, range(12))
    assert pages.tolist() == [1, 2, 3] and res.adopted_from == 0 and sizes(t) == (3, 3, 0, 1)
    m = t.match_prefix(ids(*range(11)))  # 11 tokens: 2 whole pages
    assert m.pages.tolist() == [1, 2] and m.length == 8
    assert m.locations().tolist() == list(range(4, 12))
    assert t.num_nodes == 2  # the node was split at the match
    assert t.match_prefix(ids(0, 1, 2, 9)).length == 0  # a mismatch inside the first page
    assert t.match_prefix(ids(*range(7), 99)).pages.tolist() == [1]
    assert t.prefix_len(ids(*range(16))) == 12 and t.prefix_len(ids(*range(10))) == 8
    assert a.num_free == 29


def test_prefix_len_changes_nothing():
    a, t = setup(page=4)
    put(a, t, range(12))
    assert t.prefix_len(ids(*range(8))) == 8 and t.num_nodes == 1


def test_insert_adopts_only_past_the_cached_prefix():
    a, t = setup(page=2)
    put(a, t, [1, 2, 3, 4])
    pages, res = put(a, t, [1, 2, 3, 4, 5, 6, 7, 8])  # pages 3..6: 3, 4 duplicate the tree's
    assert res.adopted_from == 2 and t.path_pages(res.node).tolist() == [1, 2, 5, 6]
    assert a.state[[3, 4]].tolist() == [FREE, FREE] and a.state[[5, 6]].tolist() == [TREE, TREE]
    pages, res = put(a, t, [1, 2, 9, 9])  # diverges after one page: split + new leaf
    assert pages.tolist() == [3, 4] and res.adopted_from == 1 and sizes(t) == (5, 5, 0, 4)
    assert t.match_prefix(ids(1, 2, 9, 9, 9)).pages.tolist() == [1, 4]
    _, res = put(a, t, [1, 2])  # already cached: nothing adopted, node ends at the key
    assert res.adopted_from == 1 and t.path_pages(res.node).tolist() == [1]
    assert a.num_free == 32 - 5


def test_insert_needs_the_callers_pages_and_whole_pages():
    a, t = setup(page=2)
    pages = a.alloc(2)
    a.adopt(pages)
    with pytest.raises(KVUsageError, match="adopt of page 1: it is held by the radix tree"):
        t.insert(ids(1, 2, 3, 4), pages)
    assert sizes(t) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="insert of 3 tokens with 2 pages of 2: not page-aligned"):
        t.insert(ids(1, 2, 3), a.alloc(2))


def test_namespaces_never_share_a_prefix():
    a, t = setup(page=2)
    put(a, t, [1, 2, 3, 4], extra_key="lora-a")
    assert t.match_prefix(ids(1, 2, 3, 4)).length == 0
    assert t.match_prefix(ids(1, 2, 3, 4), "lora-b").length == 0
    assert t.match_prefix(ids(1, 2, 3, 4), "lora-a").length == 4
    _, res = put(a, t, [1, 2, 3, 4])  # the default namespace gets its own copy
    assert res.adopted_from == 0 and sizes(t) == (4, 4, 0, 2)


def test_locks_protect_a_path_and_move_sizes():
    a, t = setup(page=2)
    put(a, t, [1, 2, 3, 4, 5, 6])
    m = t.match_prefix(ids(1, 2, 3, 4))  # splits: [1 2 3 4] -> [5 6]
    t.inc_lock_ref(m.node)
    assert sizes(t) == (3, 1, 2, 2) and m.node.lock_ref == 1 and m.node.parent is t.root
    t.inc_lock_ref(m.node)
    assert sizes(t) == (3, 1, 2, 2) and m.node.lock_ref == 2
    t.dec_lock_ref(m.node)
    t.dec_lock_ref(m.node)
    assert sizes(t) == (3, 3, 0, 2)


def test_unlocking_below_zero_names_the_node():
    a, t = setup(page=2)
    _, res = put(a, t, [1, 2, 3, 4])
    t.inc_lock_ref(res.node)
    t.dec_lock_ref(res.node)
    with pytest.raises(
        KVUsageError, match=rf"dec_lock_ref of node {res.node.id} \(pages \[1, 2\].*below zero"
    ):
        t.dec_lock_ref(res.node)
    assert sizes(t) == (2, 2, 0, 1)


def test_eviction_is_lru_over_unlocked_leaves():
    a, t = setup(page=1)
    put(a, t, [1, 2, 3])  # pages 1-3
    put(a, t, [1, 2, 7, 8])  # split at 2; leaf [7 8] adopts pages 6, 7 (4, 5 freed)
    put(a, t, [9, 9])  # pages 4, 5
    t.match_prefix(ids(1, 2, 3))  # [1 2] and [3] most recent; then [9 9]; [7 8] least recent
    assert t.evict(1) == 2 and t.match_prefix(ids(1, 2, 7)).length == 2  # [7 8] went first
    assert a.free_pages()[-2:].tolist() == [7, 6] and a.num_free == 32 - 5
    locked = t.match_prefix(ids(9, 9)).node
    t.inc_lock_ref(locked)
    assert t.evict(100) == 3  # [3], then its parent [1 2]; the locked [9 9] stays
    assert sizes(t) == (2, 0, 2, 1) and a.num_free == 30
    assert t.evict(1) == 0
    t.dec_lock_ref(locked)
    assert t.evict(1) == 2 and sizes(t) == (0, 0, 0, 0) and a.num_free == 32


def test_evicted_node_cannot_be_locked():
    a, t = setup(page=1)
    _, res = put(a, t, [1, 2])
    t.evict(2)
    with pytest.raises(KVUsageError, match=rf"inc_lock_ref of node {res.node.id} .* it was evicted"):
        t.inc_lock_ref(res.node)
    with pytest.raises(KVUsageError, match=rf"dec_lock_ref of node {res.node.id} "):
        t.dec_lock_ref(res.node)


def test_freeing_a_locked_nodes_pages_raises():
    a, t = setup(page=2)
    _, res = put(a, t, [1, 2, 3, 4])
    t.inc_lock_ref(res.node)
    with pytest.raises(KVUsageError, match="free of page 1: it is held by the radix tree"):
        a.free(res.node.pages)
    with pytest.raises(KVUsageError, match=rf"reset of the radix cache: node {res.node.id} .*is locked"):
        t.reset()
    with pytest.raises(KVUsageError, match=rf"free of node {res.node.id} .*it is locked"):
        t._delete_leaf(res.node)
    assert sizes(t) == (2, 0, 2, 1) and a.state[1:3].tolist() == [TREE, TREE]
    t.dec_lock_ref(res.node)
    t.reset()
    assert sizes(t) == (0, 0, 0, 0) and a.num_free == 32
    assert t.match_prefix(ids(1, 2, 3, 4)).length == 0


def test_stale_lru_entries_are_compacted():
    a, t = setup(num_pages=9, page=1)
    put(a, t, [1, 2])
    for _ in range(500):
        t.match_prefix(ids(1, 2))
    assert len(t._heap) <= 4 * t.num_nodes + 64
    assert t.evict(1) == 2


def test_disabled_tree_caches_nothing():
    a, t = setup(page=2, disable=True)
    pages = a.alloc(2)
    res = t.insert(ids(1, 2, 3, 4), pages)
    assert res.adopted_from == 2 and res.node is t.root and sizes(t) == (0, 0, 0, 0)
    assert a.state[pages].tolist() == [HELD, HELD]
    assert t.match_prefix(ids(1, 2, 3, 4)).length == 0 and t.prefix_len(ids(1, 2)) == 0
