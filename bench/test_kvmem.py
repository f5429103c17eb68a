"""kvmem's host-side costs: prefix match and insert on a 10,000-node tree, alloc + free of 64
pages, and the integrity check over a full pool of 65,536 pages.

    .venv/bin/python -m pytest bench/test_kvmem.py --benchmark-enable -p no:cacheprovider

Without --benchmark-enable each runs once as a smoke test (with its assertions).
"""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.kvmem import KVCache, PageAllocator, RadixCache

PAGE = 16


@pytest.fixture(scope="module")
def tree():
    """A tree of >= 10,000 nodes: each insert branches off a random earlier sequence at a
    random page and adds 1-4 pages of its own (a split plus a leaf)."""
    rng = np.random.default_rng(0)
    alloc = PageAllocator(65_536, PAGE)
    t = RadixCache(PAGE, alloc)
    seqs = [rng.integers(0, 32_000, 8 * PAGE, dtype=np.int32)]
    t.insert(seqs[0], alloc.alloc(8))
    while t.num_nodes < 10_000:
        base = seqs[int(rng.integers(len(seqs)))]
        cut = int(rng.integers(1, len(base) // PAGE + 1)) * PAGE
        seq = np.concatenate(
            [base[:cut], rng.integers(0, 32_000, int(rng.integers(1, 5)) * PAGE, dtype=np.int32)]
        )
        pages = alloc.alloc(len(seq) // PAGE)
        res = t.insert(seq, pages)
        alloc.free(pages[: res.adopted_from])
        seqs.append(seq)
    return t, alloc, seqs, rng


def test_match_prefix_10k_nodes(benchmark, tree):
    t, _, seqs, rng = tree
    keys = [seqs[int(i)] for i in rng.integers(len(seqs), size=256)]
    it = iter(range(10**9))

    def match():
        return t.match_prefix(keys[next(it) % len(keys)])

    m = benchmark(match)
    assert m.length > 0 and t.num_nodes >= 10_000


def test_insert_10k_nodes(benchmark, tree):
    t, alloc, seqs, rng = tree

    def setup():
        base = seqs[int(rng.integers(len(seqs)))]
        cut = int(rng.integers(1, len(base) // PAGE + 1)) * PAGE
        seq = np.concatenate([base[:cut], rng.integers(0, 32_000, 2 * PAGE, dtype=np.int32)])
        return (seq, alloc.alloc(len(seq) // PAGE)), {}

    def insert(seq, pages):
        res = t.insert(seq, pages)
        alloc.free(pages[: res.adopted_from])
        return res

    res = benchmark.pedantic(insert, setup=setup, rounds=200, iterations=1)
    assert res.node is not t.root


def test_alloc_free_64_pages(benchmark):
    alloc = PageAllocator(65_536, PAGE)
    alloc.alloc(30_000)

    def alloc_free():
        pages = alloc.alloc(64)
        alloc.free(pages)
        return pages

    pages = benchmark(alloc_free)
    assert len(pages) == 64 and alloc.num_free == 65_535 - 30_000


def test_integrity_full_pool_65536_pages(benchmark):
    """128 live requests and a tree of ~3,000 nodes share every one of the 65,535 pages."""
    rng = np.random.default_rng(1)
    c = KVCache(65_536, PAGE, 256)
    prompts = [rng.integers(0, 32_000, 64 * PAGE, dtype=np.int32) for _ in range(32)]
    while c.allocator.num_free > 40_000:  # fill the tree with branching sequences
        base = prompts[int(rng.integers(len(prompts)))]
        seq = np.concatenate(
            [base[: int(rng.integers(1, 64)) * PAGE], rng.integers(0, 32_000, 16 * PAGE, dtype=np.int32)]
        )
        kv = c.admit(seq)
        c.reserve(kv, len(seq) - kv.committed_len)
        c.commit(kv, len(seq) - kv.committed_len)
        c.release(kv, seq)
    live = []
    per = c.allocator.num_free // 128
    for i in range(128):  # each matches a cached prefix, then owns its share of the free pages
        kv = c.admit(prompts[i % len(prompts)][: 32 * PAGE])
        c.reserve(kv, (per if i < 127 else c.allocator.num_free) * PAGE)
        live.append(kv)
    assert c.allocator.num_free == 0 and c.tree.num_nodes > 2_000, c.tree.num_nodes
    benchmark(c.check_integrity, live)
