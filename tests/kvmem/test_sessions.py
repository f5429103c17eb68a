"""Streaming sessions and seed 001's case table.

A turn decodes in speculative rounds: each round reserves the bonus token plus K drafts
(over-allocation), then commits the accepted ones; `committed_len == origin_len +
len(output_ids) - 1` throughout (the last output token has no KV yet: the bonus lag). The
finishing round lands exactly on finished_len or overshoots it by j; in overlap mode an extra
round was already planned (reserved) before the finish was seen. After `finish_turn`
(T = origin_len + finished_len):

    committed_len <= T (T - 1 on an exact finish, T on an overshoot)
    allocated_len <= T,  len(output_ids) == finished_len
    pages wholly past ceil(T / page_size) are back in the free list
    the next turn is never granted more than T tokens
"""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.kvmem import KVCache, SessionSlots
from ringserve.kvmem.allocator import FREE, HELD

K = 3  # drafts per round: a round commits 1..K+1 tokens
F = 10  # finished_len


def decode_turn(c: KVCache, s: SessionSlots, origin: np.ndarray, overshoot: int, extra_round: bool):
    kv = s.start_turn("s", origin)
    c.reserve(kv, len(origin) - kv.committed_len)
    c.commit(kv, len(origin) - kv.committed_len)
    out = [1000]  # sampled by the prefill
    while True:
        accepted = 1 + (overshoot if len(out) == F - 1 else 0)  # the finishing round overshoots
        assert c.reserve(kv, K + 1) is not None
        c.commit(kv, accepted)
        out += list(range(1000 + len(out), 1000 + len(out) + accepted))
        assert kv.committed_len == len(origin) + len(out) - 1  # bonus lag
        if len(out) >= F:
            break
    if extra_round:  # overlap: planned before the finishing round's result was processed
        assert c.reserve(kv, K + 1) is not None
    return kv, out


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("origin_len", [21, 24])
@pytest.mark.parametrize("extra_round", [False, True], ids=["no_extra_round", "extra_round"])
@pytest.mark.parametrize("overshoot", [0, 1, 2, 3], ids=["exact", "over1", "over2", "over3"])
def test_seed_001_case_table(page, origin_len, extra_round, overshoot):
    c = KVCache(257, page, 2)
    s = SessionSlots(c)
    origin = np.arange(10, 10 + origin_len, dtype=np.int32)
    kv, out = decode_turn(c, s, origin, overshoot, extra_round)
    T = origin_len + F
    assert len(out) == F + overshoot and kv.committed_len == T + overshoot - 1
    before = c.slots.pages(kv.slot).copy()
    allocated_before = kv.allocated_len
    # the finishing round reserved from T - 2 on; the extra round from T - 1 + overshoot on
    assert allocated_before == (T + 3 + overshoot if extra_round else T + 2)
    freed = s.finish_turn("s", kv, origin, out, F)
    # the postcondition
    assert len(out) == F and out == list(range(1000, 1000 + F))
    assert kv.committed_len == (T - 1 if overshoot == 0 else T)
    assert kv.allocated_len == T
    kept = -(-T // page)
    assert c.slots.n_pages[kv.slot] == kept and freed == len(before) - kept
    # the stale tail is back in the free list; nothing else is held
    assert (c.allocator.state[before[kept:]] == FREE).all() and (
        c.allocator.state[before[:kept]] == HELD
    ).all()
    assert c.allocator.num_free == 256 - kept and c.tree.total_pages == 0
    s.check_integrity([])
    # the next turn repeats the kept output, then diverges where the overshoot was
    stale = list(range(1000 + F, 1000 + F + 3))
    for new in ([7, 7, 7], stale):
        nxt = np.concatenate([origin, np.asarray(out + new, np.int32)])
        kv2 = s.start_turn("s", nxt)
        assert kv2 is kv and kv2.cached_len == kv2.committed_len == (T - 1 if overshoot == 0 else T) <= T
        s.finish_turn("s", kv2, nxt[:T], [], 0)  # nothing decoded: kept as it was
    s.close("s")
    s.check_integrity([])
    assert c.tree.total_pages == kv.committed_len // page and c.available_tokens() == 256 * page


def test_next_turn_grant_stops_where_the_input_differs():
    c = KVCache(65, 4, 2)
    s = SessionSlots(c)
    origin = np.arange(10, 30, dtype=np.int32)  # 20 tokens
    kv, out = decode_turn(c, s, origin, 0, False)
    s.finish_turn("s", kv, origin, out, F)  # T = 30, committed 29
    edited = np.concatenate([origin[:13], [999], origin[14:], out, [5]]).astype(np.int32)
    kv2 = s.start_turn("s", edited)
    # granted 13 tokens: the row keeps 4 pages (the 4th partially: the turn writes the rest)
    assert kv2.cached_len == kv2.committed_len == kv2.allocated_len == 13
    assert c.slots.n_pages[kv2.slot] == 4 and c.allocator.num_free == 60
    s.check_integrity([kv2])
    c.release(kv2)
    assert c.allocator.num_free == 64


def test_a_tree_owned_partial_page_is_not_kept_for_writing():
    """If the page holding token T - 1 belongs to the tree, the next turn would overwrite the
    tree's KV past T: the cut moves back to that page's start and the page leaves the row."""
    c = KVCache(65, 4, 2)
    s = SessionSlots(c)
    origin = np.arange(10, 18, dtype=np.int32)  # 8 tokens
    kv, out = decode_turn(c, s, origin, 0, False)  # committed 17
    tokens = np.concatenate([origin, np.asarray(out, np.int32)])
    c.cache_unfinished(kv, tokens[: kv.committed_len])  # 16 tokens: 4 pages to the tree
    assert c.slots.owned_mask(kv.slot).tolist() == [False] * 4 + [True]
    s.finish_turn("s", kv, origin, out, 2)  # T = 10: page 2 is the tree's
    assert kv.committed_len == kv.allocated_len == 8 and c.slots.n_pages[kv.slot] == 2
    assert c.tree.total_pages == 4 and c.allocator.num_free == 60
    s.check_integrity([])
    kv2 = s.start_turn("s", tokens[:12])
    assert kv2.cached_len == 8
    c.release(kv2)
    s.check_integrity([])


def test_first_turn_uses_the_tree_and_close_caches_the_session():
    c = KVCache(65, 4, 2)
    s = SessionSlots(c)
    origin = np.arange(10, 31, dtype=np.int32)
    warm = c.admit(origin[:-1])
    c.reserve(warm, 21)
    c.commit(warm, 21)
    c.release(warm, origin)  # 5 pages cached
    kv, out = decode_turn(c, s, origin, 2, True)
    assert kv.cached_len == 20 and c.slots.owned_mask(kv.slot).tolist()[:5] == [False] * 5
    s.finish_turn("s", kv, origin, out, F)  # T = 31, committed 31
    assert c.slots.n_pages[kv.slot] == 8 and c.allocator.num_free == 64 - 8
    s.check_integrity([])
    s.close("s")
    assert c.tree.total_pages == 7 and c.allocator.num_free == 64 - 7
    s.check_integrity([])


def test_undo_start_keeps_the_resumed_slot_again_and_releases_a_fresh_one():
    """A turn the scheduler takes back before it runs: the kept slot it resumed is kept again, cut
    where start_turn cut it, and the next try is granted the same prefix; a first turn's fresh
    record (or one after another turn ran) is released."""
    c = KVCache(65, 4, 2)
    s = SessionSlots(c)
    origin = np.arange(10, 30, dtype=np.int32)  # 20 tokens
    kv, out = decode_turn(c, s, origin, 0, False)
    s.finish_turn("s", kv, origin, out, F)  # T = 30, committed 29: 8 pages
    edited = np.concatenate([origin, out[:5], [999] * 7]).astype(np.int32)  # repeats 25 tokens
    kv2 = s.start_turn("s", edited)
    assert kv2 is kv and kv2.committed_len == 25 and "s" not in s.kept
    s.undo_start("s", kv2)
    assert s.kept["s"].kv is kv and s.kept["s"].token_ids.tolist() == edited[:25].tolist()
    assert c.slots.n_pages[kv.slot] == 7 and c.allocator.num_free == 64 - 7
    s.check_integrity([])
    kv3 = s.start_turn("s", edited)  # the next try: the same grant
    assert kv3 is kv and kv3.cached_len == kv3.committed_len == 25
    s.undo_start("s", kv3)
    s.close("s")
    s.check_integrity([])
    assert c.tree.total_pages == 6 and c.allocator.num_free == 64 - 6  # close cached the 6 whole pages
    fresh = s.start_turn("t", np.arange(3, dtype=np.int32))  # no kept slot: a fresh admission
    s.undo_start("t", fresh)
    assert "t" not in s.kept and c.num_free_slots == 2
    s.check_integrity([])


def test_finish_turn_rejects_a_bad_finished_len():
    c = KVCache(17, 1, 2)
    s = SessionSlots(c)
    kv = s.start_turn("s", np.arange(4, dtype=np.int32))
    with pytest.raises(ValueError, match="finished_len=3 with 2 output tokens"):
        s.finish_turn("s", kv, np.arange(4, dtype=np.int32), [5, 6], 3)


def test_next_turn_caching_on_another_branch_moves_the_lock_there():
    """Found by the stateful test: turn 1 cached [0 0 0 1] (pages 1, 2) and finished at T = 3,
    so its row was cut to page 1. Turn 2 writes [0 0] at positions 2-3 and caches them: the
    tree branches after page 1 and the request must lock the new branch (pages 1, 3), not the
    old one, or page 3 could be evicted under it."""
    c = KVCache(5, 2, 1)
    s = SessionSlots(c)
    kv = s.start_turn("s", np.array([0, 0], np.int32))
    c.reserve(kv, 4)
    c.commit(kv, 4)
    c.cache_unfinished(kv, np.array([0, 0, 0, 1], np.int32))
    s.finish_turn("s", kv, np.array([0, 0], np.int32), [0, 1, 3], 1)
    assert c.slots.pages(kv.slot).tolist() == [1] and kv.committed_len == 2
    kv = s.start_turn("s", np.array([0, 0, 0, 0], np.int32))
    assert kv.cached_len == 2 and c.reserve(kv, 4).tolist() == [3, 4]
    c.commit(kv, 2)
    c.cache_unfinished(kv, np.array([0, 0, 0, 0], np.int32))
    assert c.tree.path_pages(kv.node).tolist() == [1, 3] and c.slots.owned_mask(kv.slot).tolist() == [
        False,
        False,
        True,
    ]
    assert (c.tree.total_pages, c.tree.protected_pages, c.tree.evictable_pages) == (3, 2, 1)
    s.check_integrity([kv])
    assert c.tree.evict(2) == 2 and c.allocator.num_free == 1  # the old branch (page 2) goes
    c.release(kv)
    s.check_integrity([])
