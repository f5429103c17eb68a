"""Waiting-queue policies over the real prefix cache: LPM admits the longest cached prefix
first, falls back to FCFS past 128 waiting, and shares an uncached prefix within a batch."""

from __future__ import annotations

import numpy as np

from ringserve.actors.scheduler.policy import LPM_FALLBACK_QUEUE
from tests.actors.scheduler.fake_runner import reference
from tests.actors.scheduler.test_books import VOCAB, drive, make, req

PREFIX = list(range(100, 164))  # 64 tokens = 4 pages of 16


def warm(core, runner, books):
    """Cache PREFIX (+ a tail) in the tree through a finished request."""
    core.add_request(req("warm", PREFIX + [7, 8], 2))
    drive(core, runner, books)


def admission_order(core, runner) -> list[str]:
    order: list[str] = []
    while True:
        b = core.get_next_batch()
        if b is None:
            return order
        order += [r.req.rid for r in b.rows if r.prefix_pages is not None]
        core.process_result(b, runner.run(b))


def test_lpm_admits_longest_cached_prefix_first():
    core, runner, books = make(max_running=1, schedule_policy="lpm")
    warm(core, runner, books)
    core.add_request(req("cold", list(range(500, 560)), 2))  # arrived first, nothing cached
    core.add_request(req("half", PREFIX[:32] + [1, 2, 3], 2))  # 32 cached
    core.add_request(req("full", PREFIX + [9, 9, 9], 2))  # 64 cached
    assert admission_order(core, runner) == ["full", "half", "cold"]


def test_fcfs_keeps_arrival_order():
    core, runner, books = make(max_running=1, schedule_policy="fcfs")
    warm(core, runner, books)
    core.add_request(req("cold", list(range(500, 560)), 2))
    core.add_request(req("half", PREFIX[:32] + [1, 2, 3], 2))
    core.add_request(req("full", PREFIX + [9, 9, 9], 2))
    assert admission_order(core, runner) == ["cold", "half", "full"]


def test_lpm_falls_back_to_fcfs_past_128_waiting():
    core, runner, books = make(num_pages=2048, max_running=1, schedule_policy="lpm")
    warm(core, runner, books)
    n = LPM_FALLBACK_QUEUE + 1
    for i in range(n - 1):
        core.add_request(req(f"c{i}", [500 + i, 3, 4], 1))
    core.add_request(req("full", PREFIX + [9], 1))
    order = admission_order(core, runner)
    # 129 waiting: arrival order (c0); 128 waiting: LPM again, so the cached one jumps the queue
    assert order[:3] == ["c0", "full", "c1"] and len(order) == n


def test_lpm_shares_an_uncached_prefix_within_a_batch():
    core, runner, books = make(max_running=8, schedule_policy="lpm")
    rng = np.random.default_rng(0)
    shared = rng.integers(10, 900, 48).tolist()  # 3 pages, not cached yet
    a, b = shared + [1, 2], shared + [3, 4, 5]
    core.add_request(req("a", a, 3))
    core.add_request(req("b", b, 3))
    first = core.get_next_batch()
    assert [r.req.rid for r in first.rows] == ["a"]  # b waits for a's prefix to land in the tree
    outs = {o.req.rid: o.new_ids for o in core.process_result(first, runner.run(first))}
    out = drive(core, runner, books, outputs={"a": outs["a"]})
    assert out == {"a": reference(a, 3, VOCAB), "b": reference(b, 3, VOCAB)}
    assert runner.log[1] == [(1, len(b) - 48)]  # b's prefill computed only its own 3 tokens
