"""Speculative decoding in the scheduler, over the fake runner that plays verify rounds as the
device does (FutureMap positions, targets, accepted prefix): outputs equal non-speculative
decoding token for token, with overlap on and off, under KV pressure; the n-gram proposer; seed
001's case table with sessions (a finish landing exactly on an accepted run, or overshooting it
by 1..k-1) and its postcondition after every save."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.scheduler.req import Req
from ringserve.actors.scheduler.spec import propose
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport.sampling import SamplingParams
from ringserve.kvmem import KVCache
from tests.actors.scheduler.fake_runner import FakeRunner, copying, reference
from tests.actors.scheduler.test_scheduler import letters

VOCAB = 1000
K = 3


def make(page=4, num_pages=512, overlap=True, model=None, **kw):
    kw.setdefault("context_length", (num_pages - 2) * page)  # the longest request the pool holds
    args = ServerArgs(page_size=page, max_total_tokens=num_pages * page, max_running_requests=8,
                      speculative_algorithm="ngram", speculative_num_draft_tokens=K,
                      disable_overlap_schedule=not overlap, **kw)  # fmt: skip
    kv = KVCache(num_pages, page, 8)
    return SchedulerCore(args, kv, letters), FakeRunner(page, VOCAB, model=model), kv


def req(rid, prompt, max_new, session=None, **sp) -> Req:
    return Req(rid, np.asarray(prompt, np.int32),
               SamplingParams(max_new_tokens=max_new, temperature=0, sampling_seed=0, **sp), stream=True,
               session_id=session)  # fmt: skip


def drive(core, runner, overlap: bool, on_finish=None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    pending = None
    for _ in range(10_000):
        batch = core.get_next_batch()
        result = runner.run(batch) if batch is not None else None
        done = [pending] if overlap and pending else ([] if overlap else [(batch, result)] if batch else [])
        for b, r in done:
            for o in core.process_result(b, r):
                out.setdefault(o.req.rid, []).extend(o.new_ids)
                if o.finished and on_finish:
                    on_finish(o.req)
        pending = (batch, result) if overlap and batch is not None else None
        if batch is None and pending is None:
            if core.idle:
                return out
            core.check_idle()
    raise AssertionError("did not finish")


def test_propose_takes_the_longest_repeated_suffix_at_its_latest_occurrence():
    c = np.array([9, 1, 2, 3, 7, 1, 2, 3, 8, 5, 1, 2, 3], np.int32)
    assert propose(c, 2).tolist() == [8, 5]  # "1 2 3" last seen before the end: followed by 8 5
    assert propose(c, 2, skip=1).tolist() == [5, 1]  # a round in flight: its tokens are skipped
    assert propose(np.array([4, 5, 6], np.int32), 3).tolist() == []
    assert propose(np.array([1, 2, 1, 2, 1], np.int32), 4, max_n=1).tolist() == [2, 1, 2, 1]  # periodic
    assert propose(np.array([7, 8, 9, 7, 8, 9, 7], np.int32), 5, skip=2).tolist() == [7, 8, 9, 7, 8]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_verify_rounds_give_the_non_speculative_tokens(overlap, page):
    model = copying(period=5, vocab=VOCAB, every=7)  # drafts right, but not always
    prompts = {f"r{i}": [(i * 13 + j) % 50 + 10 for j in range(5)] * 3 + [i + 100] for i in range(6)}
    core, runner, kv = make(page=page, overlap=overlap, model=model)
    for rid, p in prompts.items():
        core.add_request(req(rid, p, 40))
    out = drive(core, runner, overlap)
    assert out == {rid: reference(p, 40, VOCAB, model=model) for rid, p in prompts.items()}
    assert sum(core.stats.spec_accept_histogram[1:]) > 0, "no draft was ever accepted"
    assert sum(core.stats.spec_accept_histogram) < 6 * 40, "every round yielded one token: no speed-up"
    core.check_idle()
    assert kv.available_tokens() == (512 - 1) * page


def test_verify_rounds_under_kv_pressure_retract_and_stay_exact():
    model = copying(period=4, vocab=VOCAB, every=9)
    prompts = {f"r{i}": [i + 10, i + 20, i + 30, i + 40] * 2 for i in range(6)}
    core, runner, kv = make(page=4, num_pages=40, overlap=True, model=model)
    for rid, p in prompts.items():
        core.add_request(req(rid, p, 30))
    out = drive(core, runner, overlap=True)
    assert out == {rid: reference(p, 30, VOCAB, model=model) for rid, p in prompts.items()}
    assert core.stats.num_retracted > 0, "the small pool was meant to force a retract"


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("overshoot", [0, 1, 2], ids=["exact", "over1", "over2"])
def test_seed_001_case_table_with_sessions(overlap, page, overshoot):
    """A copying model accepts every draft: a round yields K + 1 tokens after the prefill's
    one, so max_new_tokens = 1 + (K + 1) * r lands exactly on a round, and one less (two
    less) makes the finishing round overshoot by 1 (2)."""
    model = copying(period=6, vocab=VOCAB)
    core, runner, kv = make(page=page, overlap=overlap, model=model)
    turns = [[11, 12, 13, 14, 15, 16] * 2, [21, 22, 23], [31, 32, 33, 34, 35]]
    ctx: list[int] = []
    prev_T = 0
    for t, new in enumerate(turns):
        ctx = ctx + new
        max_new = 1 + (K + 1) * 3 - overshoot
        r = req(f"t{t}", ctx, max_new, session="s")
        saved: dict = {}

        def check(rq, saved=saved):  # right after the save (the turn's finish)
            kept = core.sessions.kept["s"].kv
            T = rq.origin_len + len(rq.output_ids)
            saved.update(committed=kept.committed_len, allocated=kept.allocated_len, T=T,
                         out=len(rq.output_ids), pages=int(kv.slots.n_pages[kept.slot]))  # fmt: skip

        core.add_request(r)
        out = drive(core, runner, overlap, on_finish=check)[r.rid]
        assert out == reference(ctx, max_new, VOCAB, model=model)  # the non-speculative tokens
        assert core.stats.spec_accept_histogram[K] >= 3 * (t + 1) - 1, core.stats.spec_accept_histogram  # the rounds accepted every draft
        T = saved["T"]
        assert saved["out"] == max_new == len(out)  # len(output_ids) == finished_len
        exact_without_extra = overshoot == 0 and not overlap
        assert saved["committed"] == (T - 1 if exact_without_extra else T)
        assert saved["allocated"] <= T and saved["pages"] == -(-saved["allocated"] // page)
        if t:  # the turn reused what its previous turn kept: never past that turn's T
            assert r.cached_tokens <= prev_T
        prev_T = T
        ctx = ctx + out
        core.sessions.check_integrity([])
    core.close_session("s")
    core.check_idle()
    assert kv.available_tokens() == (512 - 1) * page
