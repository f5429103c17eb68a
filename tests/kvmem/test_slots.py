"""SlotPool: slot alloc/free with checks naming the slot, append-only rows, seed 001's
page-aligned free_tail (a partially kept page is never freed)."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.kvmem import KVUsageError, PageAllocator, SlotPool
from ringserve.kvmem.allocator import HELD, TREE


def pool(num_pages=33, page=4, slots=3, width=64):
    a = PageAllocator(num_pages, page)
    return a, SlotPool(slots, a, initial_width=width)


def test_slots_lowest_first_and_reused():
    _, s = pool()
    assert [s.alloc_slot() for _ in range(3)] == [0, 1, 2]
    assert s.alloc_slot() is None and s.num_free == 0
    s.free_slot(1)
    assert s.alloc_slot() == 1


def test_double_free_of_a_slot_names_it():
    _, s = pool()
    s.alloc_slot()
    s.free_slot(0)
    with pytest.raises(KVUsageError, match=r"free_slot of slot 0: it is not allocated \(double free"):
        s.free_slot(0)
    with pytest.raises(KVUsageError, match="free_slot of slot 2: it is not allocated"):
        s.free_slot(2)
    with pytest.raises(KVUsageError, match=r"append of slot 7: out of range \[0, 3\)"):
        s.append(7, np.array([1], np.int32), True)


def test_a_slot_with_pages_cannot_be_freed():
    a, s = pool()
    slot = s.alloc_slot()
    s.append(slot, a.alloc(2), owned=True)
    with pytest.raises(KVUsageError, match=r"free_slot of slot 0: it still holds pages \[1, 2\]"):
        s.free_slot(slot)


def test_rows_grow_past_their_initial_width():
    a, s = pool(num_pages=65, page=1, width=2)
    slot = s.alloc_slot()
    for _ in range(5):
        s.append(slot, a.alloc(7), owned=True)
    assert s.pages(slot).tolist() == list(range(1, 36)) and s.table.shape[1] == 56  # 2, 7, 14, 28, 56
    with pytest.raises(KVUsageError, match="a page table of 65 pages exceeds the pool"):
        s.append(slot, np.arange(30, dtype=np.int32), True)


@pytest.mark.parametrize(
    ("keep_len", "kept", "freed"),
    [(20, 5, 0), (17, 5, 0), (16, 4, 1), (13, 4, 1), (9, 3, 2), (8, 2, 3), (1, 1, 4), (0, 0, 5)],
)
def test_free_tail_frees_only_pages_wholly_past_the_kept_length(keep_len, kept, freed):
    a, s = pool(page=4)
    slot = s.alloc_slot()
    s.append(slot, a.alloc(5), owned=True)  # 20 tokens
    assert s.free_tail(slot, keep_len) == freed
    assert s.pages(slot).tolist() == [1, 2, 3, 4, 5][:kept]
    assert a.num_free == 32 - kept
    assert sorted(a.free_pages().tolist()) == list(range(kept + 1, 33))


def test_free_tail_drops_tree_pages_without_freeing_them():
    a, s = pool(page=4)
    slot = s.alloc_slot()
    tree_pages = a.alloc(2)
    a.adopt(tree_pages)
    s.append(slot, tree_pages, owned=False)
    s.append(slot, a.alloc(2), owned=True)
    assert s.owned_mask(slot).tolist() == [False, False, True, True]
    assert s.free_tail(slot, 5) == 2  # keeps 2 pages; pages 3 and 4 (owned) are freed
    assert s.free_tail(slot, 0) == 0  # the tree's pages leave the row only
    assert s.n_pages[slot] == 0 and a.state[1:3].tolist() == [TREE, TREE] and a.num_free == 30
    s.free_slot(slot)


def test_disown_marks_pages_as_the_trees():
    a, s = pool()
    slot = s.alloc_slot()
    s.append(slot, a.alloc(3), owned=True)
    s.disown(slot, 1, 3)
    assert s.owned_mask(slot).tolist() == [True, False, False]
    assert a.state[1] == HELD
