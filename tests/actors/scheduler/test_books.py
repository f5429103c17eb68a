"""The scheduler over kvmem's KVCache with the radix prefix cache, with the fake runner that reads every
context back through its mirrored page tables: shared prefixes, chunked prefill with the
cache, retract, abort, flush. After every step the books pass their integrity check and every
live row equals the runner's mirror (rows are append-only); at the end available_tokens is
back to its initial value."""

from __future__ import annotations

import numpy as np
import pytest

import tests.actors.scheduler.test_scheduler as scheduler_tests
from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.scheduler.req import Req
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport.sampling import SamplingParams
from ringserve.kvmem import KVCache
from tests.actors.scheduler.fake_runner import FakeRunner, reference
from tests.actors.scheduler.test_scheduler import letters

VOCAB = 1000


def make(num_pages=256, page=16, max_running=8, **kw):
    kw.setdefault("context_length", (num_pages - 2) * page)  # the longest request the pool holds
    args = ServerArgs(
        page_size=page, max_total_tokens=num_pages * page, max_running_requests=max_running, **kw
    )
    books = KVCache(num_pages, page, max_running, disable_radix_cache=args.disable_radix_cache)
    return SchedulerCore(args, books, letters), FakeRunner(page, VOCAB), books


def req(rid: str, prompt, max_new: int) -> Req:
    return Req(
        rid, np.asarray(prompt, np.int32), SamplingParams(max_new_tokens=max_new, temperature=0, sampling_seed=0),
        stream=True,  # an output per token, so the tests see each one
    )


def check(core: SchedulerCore, runner: FakeRunner, books: KVCache) -> None:
    """Integrity of the books, and every live row exactly as the runner mirrors it."""
    live = core.live()
    books.check_integrity([r.kv for r in live])
    for r in live:  # every live request was in the batch that admitted it
        m = runner.slots[r.slot]
        assert m.pages == books.pages(r.kv).tolist(), (
            f"{r.rid}: row {books.pages(r.kv).tolist()} != mirror {m.pages}"
        )


def step(core, runner, books, outputs) -> bool:
    batch = core.get_next_batch()
    if batch is None:
        return False
    for o in core.process_result(batch, runner.run(batch)):
        outputs.setdefault(o.req.rid, []).extend(o.new_ids)
    check(core, runner, books)
    return True


def drive(core, runner, books, overlap=False, max_steps=10_000, outputs=None):
    """Run to completion (overlap: batch N+1 is scheduled and run before N is processed)."""
    outputs = {} if outputs is None else outputs
    pending = None
    for _ in range(max_steps):
        batch = core.get_next_batch()
        result = runner.run(batch) if batch is not None else None
        done = [pending] if overlap and pending is not None else []
        if not overlap and batch is not None:
            done = [(batch, result)]
        for b, r in done:
            for o in core.process_result(b, r):
                outputs.setdefault(o.req.rid, []).extend(o.new_ids)
        pending = (batch, result) if overlap and batch is not None else None
        check(core, runner, books)
        if batch is None and pending is None:
            if core.idle:
                return outputs
            core.check_idle()
    raise AssertionError("did not finish")


PREFIX = list(range(100, 300))  # 200 tokens: 12 whole pages of 16, and 8 tokens more


@pytest.mark.parametrize("overlap", [False, True])
def test_second_request_shares_a_200_token_prefix(overlap):
    core, runner, books = make()
    initial = books.available_tokens()
    assert initial == 255 * 16
    a, b = PREFIX + [7, 8, 9, 10, 11], PREFIX + [21, 22, 23]
    core.add_request(req("a", a, 4))
    out = drive(core, runner, books, overlap)
    # a keeps 208 tokens at its finish (209 filled, the last one never fed back): 13 pages
    assert books.tree.total_pages == 13 and books.available_tokens() == initial
    tree_prefix = books.tree.match_prefix(np.asarray(PREFIX, np.int32)).pages.tolist()
    rb = req("b", b, 4)
    core.add_request(rb)
    n_steps = len(runner.log)
    out |= drive(core, runner, books, overlap)
    assert rb.cached_tokens == 192 and runner.log[n_steps] == [(0, 11)]  # 203 - 192 computed
    assert out == {"a": reference(a, 4, VOCAB), "b": reference(b, 4, VOCAB)}
    cold, cold_runner, cold_books = make()
    cold.add_request(req("b", b, 4))
    assert drive(cold, cold_runner, cold_books, overlap) == {"b": out["b"]}
    assert books.tree.match_prefix(np.asarray(PREFIX, np.int32)).pages.tolist() == tree_prefix
    core.check_idle()
    assert books.available_tokens() == initial


def test_prefix_is_shared_while_the_first_request_still_decodes():
    core, runner, books = make()
    a, b = PREFIX + [7, 8, 9], PREFIX + [30, 31]
    core.add_request(req("a", a, 20))
    out: dict[str, list[int]] = {}
    assert step(core, runner, books, out)  # a's prefill; its prompt is cached once its first token is back
    assert books.tree.total_pages == 12 and books.tree.protected_pages == 12
    rb = req("b", b, 5)
    core.add_request(rb)
    drive(core, runner, books, outputs=out)
    assert rb.cached_tokens == 192
    assert out == {"a": reference(a, 20, VOCAB), "b": reference(b, 5, VOCAB)}
    assert books.available_tokens() == 255 * 16


def test_same_prompt_in_one_batch_keeps_each_row_its_own_pages():
    """Both compute the prompt; the first to cache it gives its pages to the tree, the other
    keeps its own (its row is never rewritten) and frees them when it finishes."""
    core, runner, books = make(page=4)
    p = list(range(500, 530))  # 30 tokens: 7 whole pages of 4
    core.add_request(req("a", p, 6))
    core.add_request(req("b", p, 6))
    out: dict[str, list[int]] = {}
    assert step(core, runner, books, out)
    assert runner.log == [[(0, 30), (1, 30)]]
    a, b = core.by_rid["a"], core.by_rid["b"]
    own_a, own_b = (
        books.slots.owned_mask(a.slot).tolist(),
        books.slots.owned_mask(b.slot).tolist(),
    )
    assert own_a == [False] * 7 + [True] and own_b == [True] * 8  # a's 7 pages are the tree's
    assert books.tree.total_pages == 7 and books.allocator.num_free == 255 - 16
    drive(core, runner, books, outputs=out)
    assert out == {"a": reference(p, 6, VOCAB), "b": reference(p, 6, VOCAB)}
    # a then b finished with 35 tokens worth keeping: the tree holds 8 pages (32 tokens), once
    assert books.tree.total_pages == 8 and books.allocator.num_free == 255 - 8
    assert books.available_tokens() == 255 * 4


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_caches_between_chunks(overlap):
    core, runner, books = make(chunked_prefill_size=64)
    a, c = PREFIX + [1, 2, 3, 4, 5, 6, 7], PREFIX + [40, 41]
    rc = req("c", c, 3)
    core.add_request(req("a", a, 3))
    core.add_request(rc)
    out = drive(core, runner, books, overlap)
    # a: chunks of 64, 64, 64, then 15; before its last chunk the tree holds its first 192
    # tokens, so c (admitted next to that chunk) computes only 202 - 192 = 10
    assert runner.log[:4] == [[(0, 64)], [(0, 64)], [(0, 64)], [(0, 15), (1, 10)]]
    assert rc.cached_tokens == 192
    assert out == {"a": reference(a, 3, VOCAB), "c": reference(c, 3, VOCAB)}
    assert books.available_tokens() == 255 * 16


@pytest.mark.parametrize("overlap", [False, True])
def test_retract_under_a_tiny_pool(overlap):
    core, runner, books = make(num_pages=24, page=2)
    rng = np.random.default_rng(0)
    shared = rng.integers(10, 900, 6).tolist()
    prompts = {f"r{i}": shared + rng.integers(10, 900, int(rng.integers(1, 5))).tolist() for i in range(6)}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, 12))
    out = drive(core, runner, books, overlap)
    assert core.stats.num_retracted > 0, "the pool was meant to force a retract"
    assert out == {rid: reference(p, 12, VOCAB) for rid, p in prompts.items()}
    core.check_idle()
    assert books.available_tokens() == 23 * 2


def test_abort_mid_decode_frees_everything():
    core, runner, books = make(page=4)
    for i in range(3):
        core.add_request(req(f"r{i}", PREFIX[:30] + [i], 50))
    out: dict[str, list[int]] = {}
    for _ in range(5):
        step(core, runner, books, out)
    outs = core.abort("r1")
    assert outs[0].finished and outs[0].req.finish_reason.type == "abort" and outs[0].req.kv is None
    check(core, runner, books)
    drive(core, runner, books, outputs=out)
    assert out["r0"] == reference(PREFIX[:30] + [0], 50, VOCAB)
    assert out["r1"] == reference(PREFIX[:30] + [1], 50, VOCAB)[:5]
    core.abort(None)
    assert books.available_tokens() == 255 * 4 and books.num_free_slots == 8


def test_flush_empties_the_tree_and_runs_stay_identical():
    core, runner, books = make(page=4)
    p = PREFIX[:50]
    core.add_request(req("a", p, 10))
    first = drive(core, runner, books)
    assert books.tree.total_pages == 14  # 59 tokens worth keeping: 14 pages of 4
    assert books.allocator.num_free == 255 - 14
    assert core.flush_cache() == (True, "cache flushed")
    assert books.tree.total_pages == 0 and books.allocator.num_free == 255
    assert books.available_tokens() == 255 * 4
    r = req("a", p, 10)
    core.add_request(r)
    assert drive(core, runner, books) == first and r.cached_tokens == 0
    core.add_request(req("busy", p, 10))
    assert core.flush_cache() == (True, "cache flushed")  # waiting without KV does not block it
    step(core, runner, books, {})
    ok, why = core.flush_cache()
    assert not ok and why.startswith("1 requests hold KV")
    assert books.tree.protected_pages == 12  # 48 of busy's 50 prompt tokens, locked by it


def test_locked_prefixes_do_not_count_as_room_for_the_prefill_budget():
    """Two requests each match a different cached prefix that fills the pool: locking them at
    admission leaves too little room for both extends, so the second waits for the first."""
    core, runner, books = make(num_pages=101, page=1, chunked_prefill_size=-1)
    p1, p2 = list(range(100, 146)), list(range(200, 246))  # 46 tokens each
    core.add_request(req("w1", p1, 1))
    core.add_request(req("w2", p2, 1))
    drive(core, runner, books)
    assert books.tree.total_pages == 92 and books.allocator.num_free == 8
    x, y = p1 + list(range(600, 620)), p2 + list(range(700, 720))
    core.add_request(req("x", x, 1))
    core.add_request(req("y", y, 1))
    out = drive(core, runner, books)
    assert out == {"x": reference(x, 1, VOCAB), "y": reference(y, 1, VOCAB)}
    assert books.available_tokens() == 100


def test_prefill_budget_counts_whole_pages():
    """3 free pages of 16: short prompts take a whole page each, so only 2 fit (with their
    decode reserve) in one batch, however few tokens they compute."""
    core, runner, books = make(num_pages=4, page=16)
    prompts = {f"r{i}": [10 + i, 20, 30, 40, 50] for i in range(4)}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, 1))
    out: dict[str, list[int]] = {}
    assert step(core, runner, books, out)
    assert runner.log == [[(0, 5), (1, 5)]]
    drive(core, runner, books, outputs=out)
    assert out == {rid: reference(p, 1, VOCAB) for rid, p in prompts.items()}
    assert books.available_tokens() == 3 * 16


@pytest.mark.parametrize("disable", [False, True])
def test_disabled_radix_cache_caches_nothing(disable):
    core, runner, books = make(page=4, disable_radix_cache=disable)
    core.add_request(req("a", PREFIX[:40], 3))
    drive(core, runner, books)
    r = req("b", PREFIX[:40], 3)
    core.add_request(r)
    assert drive(core, runner, books) == {"b": reference(PREFIX[:40], 3, VOCAB)}
    assert r.cached_tokens == (0 if disable else 36)
    assert books.tree.total_pages == (0 if disable else 10)


SCENARIOS = [
    ("test_admission_then_decode_exact_batches", {}),
    ("test_chunked_prefill_runs_4_4_2", {}),
    ("test_chunk_boundary_is_page_aligned", {}),
    ("test_only_one_chunked_request_and_it_resumes_first", {}),
    ("test_mixed_chunk_batches_decode_with_a_prefill_chunk", {}),
    ("test_retract_under_a_tiny_pool_keeps_outputs_exact", {"overlap": False}),
    ("test_retract_under_a_tiny_pool_keeps_outputs_exact", {"overlap": True}),
    ("test_overlap_and_normal_give_identical_streams", {"overlap": False}),
    ("test_overlap_and_normal_give_identical_streams", {"overlap": True}),
    ("test_stop_string_across_token_boundaries", {}),
    ("test_eos_and_stop_token_ids_and_length", {}),
    ("test_abort_pause_retract_and_flush", {}),
]


@pytest.mark.parametrize(("name", "kwargs"), SCENARIOS, ids=[f"{n}{kw}" for n, kw in SCENARIOS])
def test_scheduler_scenarios_with_the_prefix_cache(name, kwargs, monkeypatch):
    """tests/actors/scheduler/test_scheduler.py's scenarios, unchanged, with the radix tree on."""
    monkeypatch.setattr(scheduler_tests, "PREFIX_CACHE", True)
    getattr(scheduler_tests, name)(**kwargs)
