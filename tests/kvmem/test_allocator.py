"""PageAllocator: whole pages, page 0 never handed out, every bad transition raises naming the
page and changing nothing, grouped frees."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.kvmem import KVUsageError, PageAllocator, token_locations
from ringserve.kvmem.allocator import FREE, HELD, SINK, TREE


def test_pages_come_out_in_order_and_never_page_0():
    a = PageAllocator(9, 4)
    assert a.capacity == 8 and a.num_free == 8
    assert a.alloc(3).tolist() == [1, 2, 3]
    assert a.alloc(5).tolist() == [4, 5, 6, 7, 8]
    assert a.num_free == 0 and a.alloc(1) is None
    assert a.state.tolist() == [SINK] + [HELD] * 8


def test_alloc_refusal_changes_nothing():
    a = PageAllocator(5, 1)
    a.alloc(2)
    assert a.alloc(3) is None and a.num_free == 2
    assert a.alloc(0).tolist() == []


def test_freed_pages_come_back_in_the_order_freed():
    a = PageAllocator(9, 2)
    a.alloc(8)
    a.free(np.array([6, 2, 5]))
    assert a.num_free == 3
    assert a.alloc(3).tolist() == [6, 2, 5]


def test_token_locations():
    assert token_locations(np.array([5, 2], np.int32), 4, 6).tolist() == [20, 21, 22, 23, 8, 9]


def test_double_free_names_the_page_and_changes_nothing():
    a = PageAllocator(9, 1)
    a.alloc(4)
    a.free(np.array([3]))
    with pytest.raises(KVUsageError, match=r"free of page 3: it is already free \(double free"):
        a.free(np.array([1, 3]))
    assert a.state[1] == HELD and a.num_free == 5  # page 1 was not freed either


def test_free_of_a_page_never_allocated():
    a = PageAllocator(9, 1)
    with pytest.raises(KVUsageError, match="free of page 7: it is already free"):
        a.free(np.array([7]))


def test_free_of_the_sink_and_out_of_range():
    a = PageAllocator(9, 1)
    a.alloc(8)
    with pytest.raises(KVUsageError, match="free of page 0: page 0 is the sink"):
        a.free(np.array([0]))
    with pytest.raises(KVUsageError, match=r"free of page 9: out of range \[1, 9\)"):
        a.free(np.array([9]))


def test_same_page_twice_in_one_free():
    a = PageAllocator(9, 1)
    a.alloc(4)
    with pytest.raises(KVUsageError, match="free of page 2: it appears twice in one call"):
        a.free(np.array([1, 2, 4, 2]))
    assert a.num_free == 4 and (a.state[1:5] == HELD).all()


def test_tree_pages_are_freed_only_by_free_tree():
    a = PageAllocator(9, 1)
    pages = a.alloc(3)
    a.adopt(pages[:2])
    assert a.state[1:4].tolist() == [TREE, TREE, HELD]
    with pytest.raises(KVUsageError, match=r"free of page 1: it is held by the radix tree \(only eviction"):
        a.free(pages)
    with pytest.raises(KVUsageError, match="free_tree of page 3: it is held by a request"):
        a.free_tree(pages)
    with pytest.raises(KVUsageError, match="adopt of page 2: it is held by the radix tree"):
        a.adopt(pages[1:])
    a.free_tree(pages[:2])
    a.free(pages[2:])
    assert a.num_free == 8 and (a.state[1:] == FREE).all()


def test_free_group_checks_at_once_and_pushes_at_the_end():
    a = PageAllocator(17, 1)
    a.alloc(16)
    with a.free_group():
        a.free(np.array([1, 2]))
        with a.free_group():  # nested groups push once, at the outer end
            a.free(np.array([3]))
        with pytest.raises(KVUsageError, match="free of page 2: it is already free"):
            a.free(np.array([2]))
        assert a.num_free == 0 and sorted(a.free_pages().tolist()) == [1, 2, 3]
        assert a.alloc(1) is None  # pending frees are not allocatable yet
    assert a.num_free == 3
    assert a.alloc(3).tolist() == [1, 2, 3]


def test_reset_only_when_everything_is_free():
    a = PageAllocator(5, 1)
    p = a.alloc(2)
    with pytest.raises(KVUsageError, match="allocator reset while page 1 is held by a request"):
        a.reset()
    a.free(p[::-1])
    a.reset()
    assert a.alloc(4).tolist() == [1, 2, 3, 4]


def test_bad_sizes():
    with pytest.raises(ValueError, match="page 0 is the sink"):
        PageAllocator(1, 4)
