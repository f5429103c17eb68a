"""check_integrity finds each kind of corruption and names the page, slot or node."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.kvmem import IntegrityError, KVCache


def healthy():
    """Page size 2, 16 pages: a cached 8-token prefix (pages 1-4), request a (slot 0) locking
    it with 2 own pages (5, 6), request b (slot 1) with 2 own pages (7, 8)."""
    c = KVCache(17, 2, 4)
    w = c.admit(np.arange(8, dtype=np.int32))
    c.reserve(w, 8)
    c.commit(w, 8)
    c.release(w, np.arange(8, dtype=np.int32))
    a = c.admit(np.arange(10, dtype=np.int32))
    c.reserve(a, 3)
    c.commit(a, 3)
    b = c.admit(np.arange(50, 53, dtype=np.int32))
    c.reserve(b, 4)
    c.check_integrity([a, b])
    assert c.slots.pages(a.slot).tolist() == [1, 2, 3, 4, 5, 6] and c.slots.pages(b.slot).tolist() == [7, 8]
    return c, a, b


def test_healthy_state_passes_and_counts_add_up():
    c, a, b = healthy()
    assert (c.allocator.num_free, c.tree.total_pages, c.tree.protected_pages) == (8, 4, 4)


def test_leaked_page():
    c, a, b = healthy()
    c.allocator.alloc(1)  # page 9, held by nobody
    with pytest.raises(
        IntegrityError, match=r"page 9 is allocated but no live request or session holds it \(leak\)"
    ):
        c.check_integrity([a, b])


def test_page_in_two_rows():
    c, a, b = healthy()
    c.slots.append(b.slot, np.array([6], np.int32), owned=True)
    b.allocated_len = 6
    with pytest.raises(IntegrityError, match=r"page 6 is held by two page tables: slots \[0, 1\]"):
        c.check_integrity([a, b])


def test_row_page_freed_behind_its_back():
    c, a, b = healthy()
    c.allocator.free(np.array([8], np.int32))
    with pytest.raises(IntegrityError, match="page 8 is owned by slot 1 but free"):
        c.check_integrity([a, b])


def test_row_page_adopted_behind_its_back():
    c, a, b = healthy()
    c.allocator.adopt(np.array([7], np.int32))
    with pytest.raises(IntegrityError, match="page 7 is marked as the tree's but no node holds it"):
        c.check_integrity([a, b])


def test_tree_owned_page_not_on_the_locked_path():
    c, a, b = healthy()
    c.slots.table[a.slot, 1] = 3
    with pytest.raises(
        IntegrityError, match="slot 0: page 3 at table index 1 is marked tree-owned but its locked path"
    ):
        c.check_integrity([a, b])


def test_slot_without_holder_and_holder_without_slot():
    c, a, b = healthy()
    with pytest.raises(IntegrityError, match="slot 1 is allocated but no live request or session holds it"):
        c.check_integrity([a])
    c.slots.live[1] = False
    with pytest.raises(IntegrityError, match="slot 1 is held by a live record but not allocated"):
        c.check_integrity([a, b])


def test_same_slot_twice():
    c, a, b = healthy()
    with pytest.raises(IntegrityError, match="slot 0 is held by two live records"):
        c.check_integrity([a, b, a])


def test_undeclared_lock():
    c, a, b = healthy()
    c.tree.inc_lock_ref(a.node)
    with pytest.raises(
        IntegrityError, match=rf"node {a.node.id} .*: 2 direct lock\(s\), but 1 holder\(s\) lock it"
    ):
        c.check_integrity([a, b])
    c.check_integrity([a, b], locks=[a.node])


def test_lengths_and_pages_disagree():
    c, a, b = healthy()
    b.allocated_len = 2
    with pytest.raises(IntegrityError, match=r"slot 1: 2 pages for allocated_len=2 \(page_size 2\)"):
        c.check_integrity([a, b])
    b.allocated_len, a.committed_len = 4, 12
    with pytest.raises(
        IntegrityError, match="slot 0: cached_len=8 committed_len=12 allocated_len=11 out of order"
    ):
        c.check_integrity([a, b])


def test_free_list_corruption():
    c, a, b = healthy()
    c.allocator._stack[1] = c.allocator._stack[0]
    with pytest.raises(IntegrityError, match=r"page \d+ is on the free list twice"):
        c.check_integrity([a, b])


def test_tree_counter_drift():
    c, a, b = healthy()
    c.tree.evictable_pages += 1
    with pytest.raises(
        IntegrityError,
        match=r"tree counters \(nodes, evictable, protected\) = \(1, 1, 4\), counted \(1, 0, 4\)",
    ):
        c.check_integrity([a, b])
