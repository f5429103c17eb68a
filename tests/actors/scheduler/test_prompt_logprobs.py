"""Prompt logprobs in the scheduler (actors/scheduler/logprobs.py), over the fake runner whose
logprob of a position is a function of the context it reads back through the page table: each
wanted position is computed exactly once, by the extend rows that run anyway (chunked or not,
overlap or not), a cached prefix is bypassed up to the first position still wanted, a
retracted request does not report a position twice, and what goes on the wire is columnar."""

from __future__ import annotations

import numpy as np
import pytest

import tests.actors.scheduler.test_books as books_tests
import tests.actors.scheduler.test_scheduler as sched_tests
from ringserve.actors.runner.slot_mirrors import SlotMirrors
from ringserve.actors.scheduler.logprobs import PromptLogprobs
from ringserve.actors.scheduler.output import step_msg, token_out
from ringserve.actors.scheduler.req import Req
from ringserve.actors.transport import messages as m
from tests.actors.scheduler.fake_runner import prompt_reference, reference

VOCAB = 1000


def with_logprobs(r: Req, start: int) -> Req:
    """As the scheduler actor makes it from a GenerateReq with return_logprob and logprob_start_len."""
    r.return_logprob = True
    r.prompt_lp = PromptLogprobs(start, r.origin_len)
    return r


def spans_of(runner, rid: str) -> list[int]:
    """Every position computed for `rid`, in order, over all its rows."""
    return [p for r, first, n in runner.spans if r == rid for p in range(first, first + n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prompts_compute_each_wanted_position_once(overlap):
    core, runner, _ = sched_tests.make(chunked_prefill_size=8, max_running=4)
    prompts = {"a": list(range(100, 130)), "b": list(range(200, 220)), "c": list(range(300, 311))}
    starts = {"a": 0, "b": 5}
    reqs = {rid: sched_tests.req(rid, p, 4) for rid, p in prompts.items()}
    for rid, r in reqs.items():
        core.add_request(with_logprobs(r, starts[rid]) if rid in starts else r)
    out = sched_tests.drive(core, runner, overlap=overlap)
    assert out == {rid: reference(p, 4, VOCAB) for rid, p in prompts.items()}
    for rid, start in starts.items():
        assert spans_of(runner, rid) == list(range(start, len(prompts[rid]) - 1))  # each once, in order
        assert reqs[rid].prompt_lp.logprobs == prompt_reference(prompts[rid], start, VOCAB)
        assert reqs[rid].prompt_lp.sent
    assert spans_of(runner, "c") == []
    # a's 30 tokens went in chunks of 8: its spans follow the chunks, the last one stops before
    # the last prompt token (whose logprob is the first output's)
    assert [(f, n) for r, f, n in runner.spans if r == "a"] == [(0, 8), (8, 8), (16, 8), (24, 5)]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cached_prefix_is_bypassed_up_to_the_first_wanted_position(overlap):
    core, runner, books = books_tests.make()
    prompt = books_tests.PREFIX + [7, 8, 9]  # 203 tokens: 12 whole pages of 16 cacheable
    core.add_request(books_tests.req("warm", prompt, 2))
    books_tests.drive(core, runner, books, overlap)
    reqs = {
        "plain": books_tests.req("plain", prompt, 2),  # granted the cached 192
        "zero": with_logprobs(books_tests.req("zero", prompt, 2), 0),  # granted nothing
        "late": with_logprobs(books_tests.req("late", prompt, 2), 100),  # granted up to 96 (page-aligned)
        "tail": with_logprobs(books_tests.req("tail", prompt, 2), 201),  # one position: 192 granted
    }
    out: dict[str, list[int]] = {}
    for r in reqs.values():  # one at a time: the grant depends on the tree only
        core.add_request(r)
        books_tests.drive(core, runner, books, overlap, outputs=out)
    assert {rid: r.cached_tokens for rid, r in reqs.items()} == {"plain": 192, "zero": 0, "late": 96, "tail": 192}
    assert all(o == reference(prompt, 2, VOCAB) for o in out.values())
    for rid, start in (("zero", 0), ("late", 100), ("tail", 201)):
        assert reqs[rid].prompt_lp.logprobs == prompt_reference(prompt, start, VOCAB), rid
        assert spans_of(runner, rid) == list(range(start, len(prompt) - 1))
    core.check_idle()
    assert books.available_tokens() == 255 * 16


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_retracted_mid_prompt_reports_each_position_once(overlap):
    """b's chunks are retracted to feed a's decode (test_scheduler's starved case); re-admitted,
    b's rows compute only the positions whose logprobs did not come back, and the values are
    those of a quiet run."""
    core, runner, _ = sched_tests.make(num_pages=40, page=1, max_running=4, chunked_prefill_size=8,
                                       max_prefill_tokens=16, new_token_ratio_init=0.0, new_token_ratio_min=0.0)  # fmt: skip
    a, b = [5, 6, 7, 8, 9], list(range(100, 130))
    core.add_request(sched_tests.req("a", a, 30))
    first = core.get_next_batch()
    core.process_result(first, runner.run(first))
    rb = with_logprobs(sched_tests.req("b", b, 4), 3)
    core.add_request(rb)
    out = sched_tests.drive(core, runner, overlap=overlap)
    assert core.stats.num_retracted > 0 and rb.retractions > 0, "b was meant to be retracted"
    assert out["a"] == reference(a, 30, VOCAB)[1:] and out["b"] == reference(b, 4, VOCAB)
    assert rb.prompt_lp.logprobs == prompt_reference(b, 3, VOCAB)
    computed = spans_of(runner, "b")
    assert sorted(set(computed)) == list(range(3, 29))  # every position, some twice (retracted in flight)


def test_the_wire_carries_positions_and_results_columnar():
    """A step's PromptPositions rebuild each row's span and targets on the runner's mirror; the
    request's prompt logprobs leave the scheduler once, in its TokenOut's MoreLogprobs."""
    core, runner, _ = sched_tests.make(chunked_prefill_size=8, max_running=4)
    p = list(range(100, 120))
    ra = with_logprobs(sched_tests.req("a", p, 2), 2)
    core.add_request(ra)
    core.add_request(sched_tests.req("b", [5, 6, 7], 2))
    mirrors = SlotMirrors(4)
    sent = []
    while (batch := core.get_next_batch()) is not None:
        msg = m.to_runner.decode(m.encode(step_msg(batch)))
        rows = mirrors.apply(msg)
        for i, row in enumerate(batch.rows):
            dev = rows[i]
            if row.logprob_span is None:
                assert dev.logprob_targets is None
                continue
            first, n = row.logprob_span
            assert dev.logprob_start == first - row.committed_len
            assert dev.logprob_targets.tolist() == p[first + 1 : first + n + 1]
        if all(r.logprob_span is None for r in batch.rows):
            assert msg.prompt is None
        sent += [token_out(o) for o in core.process_result(batch, runner.run(batch))]
    with_inputs = [o for o in sent if o.more is not None and o.more.input_logprobs]
    assert [o.rid for o in with_inputs] == ["a"]  # once
    assert m.as_f32(with_inputs[0].more.input_logprobs).tolist() == prompt_reference(p, 2, VOCAB)
    assert all(o.more is None for o in sent if o.rid == "b")


def test_spans_and_the_cache_cap():
    lp = PromptLogprobs(5, 20)  # positions [5, 19)
    assert lp.cap() == 5 and lp.span(0, 8) == (5, 3) and lp.span(8, 8) == (8, 8) and lp.span(16, 4) == (16, 3)
    assert lp.span(0, 5) is None and lp.span(19, 1) is None
    lp.record(5, np.array([-1.0, -2.0, -3.0], np.float32), None, None)
    assert lp.cap() == 8 and lp.span(0, 20) == (8, 11)  # re-admitted: only what did not come back
    lp.record(5, np.arange(14, dtype=np.float32), None, None)  # a row planned before: the rest only
    assert lp.complete and lp.cap() is None and lp.logprobs[:4] == [-1.0, -2.0, -3.0, 3.0]
