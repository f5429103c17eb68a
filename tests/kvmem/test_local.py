"""The sliding layers' own page space (kvmem/local.py): what a request keeps, what the tree keeps,
where a match may end, and the sweep that makes the sized pool enough."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.server_args import ServerArgs
from ringserve.kvmem import KVCache

PAGE, WINDOW = 4, 6


def cache(local_pages: int = 40, num_pages: int = 64, slots: int = 4) -> KVCache:
    return KVCache(num_pages, PAGE, slots, local_pages=local_pages, window=WINDOW, slack=2)


def run(c: KVCache, kv, n: int) -> None:
    assert c.reserve(kv, n) is not None
    c.commit(kv, n)


def test_a_request_keeps_only_its_windows_local_pages():
    c = cache()
    kv = c.admit(np.arange(1, 2, dtype=np.int32))
    for _ in range(10):
        run(c, kv, 4)  # 40 positions, 10 pages
    c.begin_step()
    run(c, kv, 1)
    local = c.local_pages(kv)
    first = int(c.local.first[kv.slot])
    # keep = window - 1 + slack = 7 positions before 40: pages from (40 - 7) // 4 = 8 on
    assert first == 8 and (local[:first] == 0).all() and (local[first:] != 0).all()
    assert c.local.allocator.num_free == c.local.allocator.capacity - (len(local) - first)
    assert len(c.pages(kv)) == 11  # the global table keeps every page
    c.check_integrity([kv])
    c.release(kv, None)
    assert c.local.allocator.num_free == c.local.allocator.capacity
    c.check_integrity([])


def test_a_match_ends_only_where_its_window_has_local_pages():
    c = cache()
    ids = np.arange(100, 140, dtype=np.int32)  # 40 tokens, 10 pages
    kv = c.admit(ids[:1])
    run(c, kv, 40)
    c.release(kv, ids)  # the tree keeps the window before 40 (the rest was never dropped: one step)
    assert c.match_len(ids) == 40
    node = c.tree.match_prefix(ids).node
    node.local[6] = 0  # a tombstone (the test frees nothing: only the match rule is read)
    # a match at 40 needs pages from first_needed(40) = (40 - 5) // 4 = 8: still fine
    assert c.match_len(ids) == 40
    node.local[9] = 0
    assert c.match_len(ids) == 36  # 40 needs page 9; 36 needs keys from 31: pages 7 and 8
    node.local[7] = 0
    assert c.match_len(ids) == 24  # 32 needs pages 6, 7; 28 pages 5, 6; 24 pages 4, 5
    node.local[4] = 0
    assert c.match_len(ids) == 16  # needs pages 2, 3
    assert c.tree.match_prefix(ids).length == 16  # and the match is split there


def test_the_trees_local_pages_a_live_slot_reads_are_never_tombstoned():
    c = cache(local_pages=16)
    ids = np.arange(100, 140, dtype=np.int32)
    kv = c.admit(ids[:1])
    run(c, kv, 40)
    c.release(kv, ids)
    reader = c.admit(ids)  # matched 40: it reads the tree's local pages 8 and 9
    assert reader.cached_len == 40
    read = set(c.local_pages(reader)[c.local.first[reader.slot] :].tolist())
    assert len(read) == 2 and 0 not in read
    freed = c.tree.evict_local(100, c.local.protected(np.flatnonzero(c.slots.live), c.slots.n_pages))
    assert freed == 10 - 2  # every other local page of the tree
    assert set(np.concatenate([n.local for n in c.tree.nodes()]).tolist()) - {0} == read
    c.check_integrity([reader])
    c.release(reader, None)
    c.check_integrity([])


def test_a_short_local_pool_sweeps_then_tombstones_and_the_sized_pool_never_refuses():
    rng = np.random.default_rng(0)
    args = ServerArgs(page_size=PAGE, swa_window=WINDOW, max_running_requests=3, context_length=64,
                      max_prefill_tokens=16, chunked_prefill_size=8, extend_block=8)  # fmt: skip
    c = KVCache(200, PAGE, 3, local_pages=args.swa_need_tokens // PAGE, window=WINDOW, slack=args.swa_slack)
    live = []
    for step in range(400):
        c.begin_step()
        if len(live) < 3 and rng.random() < 0.3:
            prompt = rng.integers(0, 3, int(rng.integers(2, 40))).astype(np.int32)
            kv = c.admit(prompt[:-1])
            live.append((kv, prompt))
        budget = 16  # one step's tokens, all rows together
        for kv, prompt in live:
            n = min(budget, 8 if kv.committed_len < len(prompt) else 1)
            if n:
                assert c.reserve(kv, n) is not None, f"step {step}: the sized pool refused"
                c.commit(kv, n)
                budget -= n
        for kv, prompt in list(live):
            if kv.committed_len >= 60 or rng.random() < 0.05:
                live.remove((kv, prompt))
                ids = np.concatenate([prompt, np.full(max(0, kv.committed_len - len(prompt)), 7, np.int32)])
                c.release(kv, ids[: kv.committed_len])
        c.check_integrity([kv for kv, _ in live])
    assert c.tree.num_nodes  # prefixes were cached, their local pages tombstoned as needed


def test_a_session_cut_before_its_dropped_window_starts_over():
    c = cache()
    kv = c.admit(np.arange(1, 2, dtype=np.int32))
    for _ in range(10):
        c.begin_step()
        run(c, kv, 4)
    c.begin_step()
    run(c, kv, 1)  # drops up to (40 - 7) // 4 = page 8
    c.trim(kv, 38)  # its window (page 8 on) is still there
    assert kv.committed_len == 38
    c.trim(kv, 20)  # needs pages from 3: dropped, and nothing before a window can be recomputed alone
    assert kv.committed_len == 0 and len(c.pages(kv)) == 0
    c.check_integrity([kv])


def test_max_swa_tokens_below_what_the_windows_need_is_refused():
    with pytest.raises(ValueError, match="max_swa_tokens=64: must hold every running request's window"):
        ServerArgs(swa_window=512, max_swa_tokens=64)
    with pytest.raises(ValueError, match="max_swa_tokens=-1"):
        ServerArgs(max_swa_tokens=-1)


def test_a_finishing_request_refills_the_trees_dropped_local_pages():
    """The tree dropped the window of a cached prompt (pressure): a request that recomputed that
    prompt gives its own local pages to the tree when it lets go of its slot, and the next one
    matches the whole prompt again."""
    c = cache()
    ids = np.arange(100, 140, dtype=np.int32)
    a = c.admit(ids[:1])
    run(c, a, 40)
    c.release(a, ids)
    assert c.tree.evict_local(100, np.zeros(0, np.int32)) == 10  # every local page dropped
    assert c.match_len(ids) == 0
    b = c.admit(ids)
    run(c, b, 40)  # recomputed: its own local pages for the prompt
    c.release(b, ids)
    assert c.match_len(ids) == 40
    c.check_integrity([])
    again = c.admit(ids)
    assert again.cached_len == 40
    c.check_integrity([again])
