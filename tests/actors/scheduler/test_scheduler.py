"""The scheduler on CPU with a fake runner whose outputs are known: exact batch composition,
chunking, mixed batches, retract under a tiny KV pool, overlap, stop strings."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.scheduler.prefill import BucketFit
from ringserve.actors.scheduler.req import Req
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport.sampling import SamplingParams
from ringserve.kvmem import KVCache
from tests.actors.scheduler.fake_runner import FakeRunner, reference

VOCAB = 1000
PREFIX_CACHE = False  # exact page counts without the tree; test_books reruns these with it


def letters(ids: list[int]) -> str:
    """Fake detokenizer: token t -> two letters, so a stop string can straddle tokens."""
    return "".join(chr(97 + t % 26) + chr(97 + (t // 26) % 26) for t in ids)


def make(num_pages=256, page=1, max_running=8, **kw):
    kw.setdefault("context_length", (num_pages - 2) * page)  # the longest request the pool holds
    args = ServerArgs(
        page_size=page, max_total_tokens=num_pages * page, max_running_requests=max_running, **kw
    )
    books = KVCache(num_pages, page, max_running, disable_radix_cache=not PREFIX_CACHE)
    return SchedulerCore(args, books, letters), FakeRunner(page, VOCAB), books


def req(rid: str, prompt: list[int], max_new: int, session: str | None = None, **sp) -> Req:
    return Req(
        rid, np.asarray(prompt, np.int32), SamplingParams(max_new_tokens=max_new, temperature=0, sampling_seed=0, **sp),
        stream=True,  # an output per token, so the tests see each one
        session_id=session,
    )


def drive(core: SchedulerCore, runner: FakeRunner, overlap: bool = False, max_steps: int = 10_000):
    """Run to completion; overlap: batch N+1 is scheduled and run before N's result is processed."""
    outputs: dict[str, list[int]] = {}
    pending = None
    for _ in range(max_steps):
        batch = core.get_next_batch()
        result = runner.run(batch) if batch is not None else None
        if overlap:
            if pending is not None:
                for o in core.process_result(*pending):
                    outputs.setdefault(o.req.rid, []).extend(o.new_ids)
            pending = (batch, result) if batch is not None else None
        elif batch is not None:
            for o in core.process_result(batch, result):
                outputs.setdefault(o.req.rid, []).extend(o.new_ids)
        if batch is None and pending is None:
            if core.idle:
                return outputs
            core.check_idle()
    raise AssertionError("did not finish")


def test_admission_then_decode_exact_batches():
    core, runner, books = make()
    prompts = {"a": [11, 12, 13, 14, 15], "b": [21, 22, 23], "c": [31, 32, 33, 34, 35, 36, 37]}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, 3))
    out = drive(core, runner)
    # one prefill batch of all three, then two decode steps of three rows
    assert runner.log == [[(0, 5), (1, 3), (2, 7)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]]
    assert out == {rid: reference(p, 3, VOCAB) for rid, p in prompts.items()}
    core.check_idle()
    assert books.available_tokens() == 255


def test_chunked_prefill_runs_4_4_2():
    core, runner, _ = make(chunked_prefill_size=4)
    prompt = list(range(100, 110))
    core.add_request(req("a", prompt, 2))
    out = drive(core, runner)
    assert runner.log == [[(0, 4)], [(0, 4)], [(0, 2)], [(0, 1)]]
    assert out["a"] == reference(prompt, 2, VOCAB)


def test_chunk_boundary_is_page_aligned():
    core, runner, _ = make(page=4, chunked_prefill_size=6)
    prompt = list(range(100, 114))  # 14 tokens, chunk budget 6 -> page-aligned chunks of 4
    core.add_request(req("a", prompt, 1))
    out = drive(core, runner)
    assert runner.log == [[(0, 4)], [(0, 4)], [(0, 6)]]  # the rest fits the budget whole
    assert out["a"] == reference(prompt, 1, VOCAB)


def test_only_one_chunked_request_and_it_resumes_first():
    core, runner, _ = make(chunked_prefill_size=4)
    core.add_request(req("long", list(range(100, 110)), 1))
    core.add_request(req("short", [7, 8], 1))
    drive(core, runner)
    # the long one is cut and nothing is added after it; it resumes first; the short one
    # joins when the chunk budget has room left
    assert runner.log == [[(0, 4)], [(0, 4)], [(0, 2), (1, 2)]]


def test_bucket_fit_cuts_a_step_where_its_program_would_be_mostly_padding():
    """Extend programs of 16, 32, .., 2048 tokens (and 2176), a step's own cost 32 tokens."""
    fit = BucketFit([16, 32, 64, 128, 256, 512, 1024, 2048, 2176], 32)
    # 300 tokens: one 512-token program (cost 544), or 256 + 44 in a 64 (256 + 32 + 64 + 32)
    assert (fit.take(300), fit.padded(300), fit.cost(300)) == (256, 512, 384)
    assert fit.take(1381) == 1024  # the last step of a 64-request burst (bench.peers): 2048 -> 1024 + 512
    for n in (1, 10, 16, 200, 450, 500, 1000, 2040, 2048, 2176, 3000):  # whole where a cut would not pay
        assert fit.take(n) == n, n
    for n in range(1, 3000):  # a cut is a bucket below n, and never costs more than the whole step
        assert fit.take(n) == n or fit.take(n) in fit.buckets and fit.take(n) < n
        assert fit.cost(n) <= fit.step_cost + fit.padded(n)
    with pytest.raises(ValueError, match="step_cost=0 >= 1"):
        BucketFit([16], 0)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prefill_is_cut_at_the_bucket_below_and_resumes(overlap):
    core, runner, _ = make(num_pages=1024, prefill_step_cost=32)
    prompt = list(range(100, 400))  # 300 tokens: 256 now, 44 in a step of their own
    core.add_request(req("a", prompt, 2))
    out = drive(core, runner, overlap)
    assert runner.log == [[(0, 256)], [(0, 44)], [(0, 1)]]
    assert out["a"] == reference(prompt, 2, VOCAB)
    # a step at its bucket takes no more: the next request waits for the next step
    core, runner, _ = make(num_pages=1024, prefill_step_cost=32)
    core.add_request(req("a", list(range(100, 356)), 1))
    core.add_request(req("b", [7, 8, 9], 1))
    drive(core, runner, overlap)
    assert [[n for _, n in step] for step in runner.log] == [[256], [3]]  # (b's slot: a's, freed or not)
    # the step is cut once formed: three requests of 100 fill 256, the third's rest follows;
    # five fill 500 of a 512 program, which no cut beats
    for n, steps in ((3, [[100, 100, 56], [44]]), (5, [[100] * 5])):
        core, runner, _ = make(num_pages=1024, prefill_step_cost=32)
        for i in range(n):
            core.add_request(req(f"r{i}", list(range(100 * i + 1, 100 * i + 101)), 1))
        drive(core, runner, overlap)
        assert [[n for _, n in step] for step in runner.log] == steps
    # off (0, the default of a ServerArgs made directly): one step of 300
    core, runner, _ = make(num_pages=1024, prefill_step_cost=0)
    core.add_request(req("a", prompt, 1))
    drive(core, runner, overlap)
    assert runner.log == [[(0, 300)]]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_session_turn_past_a_cut_resumes_from_its_kept_slot(overlap):
    """A session's turn that the cut sends back to waiting keeps the slot its previous turn kept:
    its step computes only the tokens the session had not (released, it would recompute all)."""
    core, runner, books = make(num_pages=1024, prefill_step_cost=32)
    first = list(range(100, 140))
    core.add_request(req("t1", first, 2, session="s"))
    out1 = drive(core, runner, overlap)["t1"]
    kept = core.sessions.kept["s"].kv
    second = first + out1 + list(range(500, 520))  # 20 new tokens
    granted = min(kept.committed_len, len(second) - 1)
    runner.log.clear()
    core.add_request(req("a", list(range(1, 257)), 1))  # fills the 256-token program alone
    core.add_request(req("t2", second, 2, session="s"))
    out = drive(core, runner, overlap)
    steps = [[n for _, n in step] for step in runner.log]
    assert steps[:2] == [[256], [len(second) - granted]], steps
    assert out["t2"] == reference(second, 2, VOCAB)
    assert core.sessions.kept["s"].kv is kept
    core.close_session("s")
    core.check_idle()
    assert books.available_tokens() == 1023


def test_mixed_chunk_batches_decode_with_a_prefill_chunk():
    core, runner, _ = make(chunked_prefill_size=4, enable_mixed_chunk=True)
    core.add_request(req("a", [1, 2, 3], 5))
    b = core.get_next_batch()
    for _ in core.process_result(b, runner.run(b)):
        pass
    core.add_request(req("b", list(range(50, 60)), 2))
    out = drive(core, runner)
    # a's decode row takes 1 of each mixed step's 4 tokens (SGLang's mixed_with_decode_tokens),
    # so the step stays within the prefill budget (and the extend bucket compiled for it):
    # a: 1 token from its prefill + 4 in mixed batches; b: 1 from its last chunk + 1
    assert runner.log == [[(0, 3)], [(1, 3), (0, 1)], [(1, 3), (0, 1)], [(1, 3), (0, 1)], [(1, 1), (0, 1)], [(1, 1)]]
    assert all(sum(n for _, n in step) <= 4 for step in runner.log)
    assert out["b"] == reference(list(range(50, 60)), 2, VOCAB)


def assert_exact_under_retraction(core: SchedulerCore, runner: FakeRunner, n: int, max_new: int, seed: int,
                                  overlap: bool) -> None:  # fmt: skip
    """`n` random prompts of 3-8 tokens, `max_new` tokens each, through a pool meant to retract:
    every output the reference's, and a retraction happened."""
    rng = np.random.default_rng(seed)
    prompts = {f"r{i}": rng.integers(10, 900, int(rng.integers(3, 9))).tolist() for i in range(n)}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, max_new))
    out = drive(core, runner, overlap=overlap)
    assert core.stats.num_retracted > 0, "the pool was meant to force a retract"
    assert out == {rid: reference(p, max_new, VOCAB) for rid, p in prompts.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_retract_under_a_tiny_pool_keeps_outputs_exact(overlap):
    core, runner, books = make(num_pages=40, page=2, max_running=8)
    assert_exact_under_retraction(core, runner, 6, 12, seed=0, overlap=overlap)
    core.check_idle()
    assert books.available_tokens() == 39 * 2


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_and_normal_give_identical_streams(overlap):
    core, runner, _ = make(chunked_prefill_size=8, max_running=4)
    rng = np.random.default_rng(1)
    prompts = {f"r{i}": rng.integers(10, 900, int(rng.integers(1, 30))).tolist() for i in range(10)}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, int(rng.integers(1, 20))))
    want = {rid: reference(p, core.by_rid[rid].max_new_tokens, VOCAB) for rid, p in prompts.items()}
    assert drive(core, runner, overlap=overlap) == want


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_plans_no_row_past_a_length_limit(overlap):
    """Batch N+1 is planned before N's tokens are in; a request that N brings to max_new_tokens
    gets no row in N+1 (its token would be dropped): each request is computed for exactly
    prompt + max_new - 1 positions, in either mode, and a 1-token request runs no decode step."""
    core, runner, books = make(max_running=4)
    prompts = {"one": [5, 6, 7], "two": [8, 9], "five": [10, 11, 12, 13]}
    max_new = {"one": 1, "two": 2, "five": 5}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, max_new[rid]))
    assert drive(core, runner, overlap=overlap) == {rid: reference(p, max_new[rid], VOCAB) for rid, p in prompts.items()}
    computed = {rid: 0 for rid in prompts}
    for step in runner.log:
        for row, n in step:
            computed[list(prompts)[row]] += n
    assert computed == {rid: len(p) + max_new[rid] - 1 for rid, p in prompts.items()}
    core.check_idle()
    assert books.available_tokens() == 255

    core, runner, _ = make()
    core.add_request(req("a", [1, 2, 3], 1))
    drive(core, runner, overlap=overlap)
    assert runner.log == [[(0, 3)]] and core.stats.forward_ct_decode == 0


def test_stop_string_across_token_boundaries():
    prompt = [5, 6, 7]
    ref = reference(prompt, 10, VOCAB)
    text = letters(ref)
    stop = text[7:10]  # last letter of token 3 + both letters of token 4 (0-based): straddles
    core, runner, _ = make()
    r = req("a", prompt, 10, stop=(stop,))
    core.add_request(r)
    out = drive(core, runner)
    assert out["a"] == ref[:5]
    assert r.finish_reason.type == "stop" and r.finish_reason.matched == stop


def test_eos_and_stop_token_ids_and_length():
    prompt = [5, 6, 7]
    ref = reference(prompt, 10, VOCAB)
    core, runner, _ = make()
    a = req("a", prompt, 10, stop_token_ids=(ref[2],))
    b = req("b", prompt, 4)
    c = req("c", prompt, 10)
    c.eos_ids = frozenset({ref[6]})
    d = req("d", prompt, 8, ignore_eos=True)
    d.eos_ids = frozenset({ref[1]})
    for x in (a, b, c, d):
        core.add_request(x)
    out = drive(core, runner)
    assert out == {"a": ref[:3], "b": ref[:4], "c": ref[:7], "d": ref[:8]}
    assert [x.finish_reason.to_dict() for x in (a, b, c, d)] == [
        {"type": "stop", "matched": ref[2]}, {"type": "length"}, {"type": "stop", "matched": ref[6]}, {"type": "length"},
    ]  # fmt: skip


def test_abort_pause_retract_and_flush():
    core, runner, books = make()
    for i in range(3):
        core.add_request(req(f"r{i}", [10 + i, 20, 30], 50))
    b = core.get_next_batch()
    core.process_result(b, runner.run(b))
    ok, why = core.flush_cache()
    assert not ok and "3 requests hold KV (3 running)" in why
    outs = core.abort("r1")
    assert outs[0].finished and outs[0].req.finish_reason.type == "abort"
    assert core.pause("retract") == [] and core.paused
    core.resume()
    assert sorted(r.rid for r in core.waiting) == ["r0", "r2"] and all(r.slot == -1 for r in core.waiting)
    assert books.available_tokens() == 255 and core.running == []
    # retracted requests wait without KV: a flush (RL weight sync) may go ahead
    assert core.flush_cache() == (True, "cache flushed")
    out = drive(core, runner)
    assert out["r0"] == reference([10, 20, 30], 50, VOCAB)[1:]  # re-prefilled, same continuation
    assert core.flush_cache() == (True, "cache flushed")


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_starved_by_a_chunked_prefill_retracts_the_chunk(overlap):
    # no decode reserve: B's chunks may take the pages A needs for its next token; the
    # scheduler must then give B's KV back (retract it), not crash
    core, runner, books = make(num_pages=40, page=1, max_running=4, chunked_prefill_size=8, max_prefill_tokens=16,
                               new_token_ratio_init=0.0, new_token_ratio_min=0.0)  # fmt: skip
    a, b = [5, 6, 7, 8, 9], list(range(100, 130))
    core.add_request(req("a", a, 30))
    first = core.get_next_batch()
    core.process_result(first, runner.run(first))
    core.add_request(req("b", b, 4))
    out = drive(core, runner, overlap=overlap)
    assert core.stats.num_retracted > 0
    assert out["a"] == reference(a, 30, VOCAB)[1:] and out["b"] == reference(b, 4, VOCAB)
    core.check_idle()
    assert books.available_tokens() == 39


def test_max_new_tokens_zero_returns_no_token():
    core, runner, _ = make()
    r = req("a", [5, 6, 7], 0)
    core.add_request(r)
    assert drive(core, runner) == {"a": []} and r.finish_reason.to_dict() == {"type": "length"}


@pytest.mark.parametrize("interval", [1, 3])
def test_outputs_every_stream_interval_tokens_and_once_when_not_streamed(interval):
    core, runner, _ = make(stream_interval=interval)
    p = [11, 12, 13]
    core.add_request(req("s", p, 7))
    quiet = Req("q", np.asarray(p, np.int32), SamplingParams(max_new_tokens=7, temperature=0, sampling_seed=0))
    core.add_request(quiet)
    sizes: dict[str, list[int]] = {"s": [], "q": []}
    while not core.idle:
        b = core.get_next_batch()
        for o in core.process_result(b, runner.run(b)):
            sizes[o.req.rid].append(len(o.new_ids))
    assert sizes["q"] == [7]  # not streamed: one output, at the finish
    assert sizes["s"] == ([1] * 7 if interval == 1 else [3, 3, 1])
    assert quiet.output_ids == reference(p, 7, VOCAB)
