"""Multi-step decode in the scheduler (`decode_steps`), over the fake runner that plays a
multi-step batch as the device does (k decode steps from each row's exact length): outputs equal
one-step decoding token for token with overlap on and off, under KV pressure, with finishes
inside a run; which batches run multi-step (nothing waiting, at most decode_steps_max_batch
rows, no grammar or session row, k tokens to go) and what each books."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.scheduler.decode import decode_steps
from tests.actors.scheduler.fake_runner import reference
from tests.actors.scheduler.test_scheduler import VOCAB, assert_exact_under_retraction, drive, make, req

K = 4


def multi(num_pages=256, page=4, max_running=8, **kw):
    return make(num_pages=num_pages, page=page, max_running=max_running, decode_steps=K, decode_steps_max_batch=4, **kw)


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_equal_one_step_decoding_and_the_books_close(overlap):
    core, runner, books = multi()
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": rng.integers(10, 900, int(rng.integers(1, 20))).tolist() for i in range(7)}
    lens = {rid: int(n) for rid, n in zip(prompts, rng.integers(1, 30, 7), strict=True)}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, lens[rid]))
    out = drive(core, runner, overlap=overlap)
    assert out == {rid: reference(p, lens[rid], VOCAB) for rid, p in prompts.items()}
    multi_rows = [rows for rows in runner.log if rows and all(n == K for _, n in rows)]
    assert multi_rows and all(len(rows) <= 4 for rows in multi_rows)
    core.check_idle()
    assert books.available_tokens() == 255 * 4


@pytest.mark.parametrize("overlap", [False, True])
def test_kv_pressure_retracts_and_stays_exact(overlap):
    core, runner, _ = multi(num_pages=28, page=2, max_running=4)
    assert_exact_under_retraction(core, runner, 4, 24, seed=4, overlap=overlap)
    assert any(rows and all(n == K for _, n in rows) for rows in runner.log)
    core.check_idle()


def test_a_finish_inside_a_run_drops_the_rest():
    prompt = [5, 6, 7]
    ref = reference(prompt, 30, VOCAB)
    core, runner, books = multi()
    a = req("a", prompt, 30, stop_token_ids=(ref[6],))  # inside the second run (tokens 5..8)
    b = req("b", prompt, 30)
    b.eos_ids = frozenset({ref[13]})
    for x in (a, b):
        core.add_request(x)
    assert drive(core, runner) == {"a": ref[:7], "b": ref[:14]}
    assert [x.finish_reason.to_dict() for x in (a, b)] == [{"type": "stop", "matched": ref[6]},
                                                           {"type": "stop", "matched": ref[13]}]  # fmt: skip
    core.check_idle()
    assert books.available_tokens() == 255 * 4


def test_which_batches_run_multi_step():
    core, runner, _ = multi(max_running=8)
    for i in range(5):  # over the limit of 4: one step at a time until one finishes
        core.add_request(req(f"r{i}", [10 + i, 11], 6 if i == 0 else 20))
    drive(core, runner)
    kinds = [tuple(n for _, n in rows) for rows in runner.log]
    first_multi = next(i for i, k in enumerate(kinds) if k[0] == K)
    assert all(len(k) <= 4 for k in kinds[first_multi:] if k[0] == K)
    assert all(k == (1,) * 5 for k in kinds[1:first_multi])  # (after the one prefill of all five)
    # the tail: fewer than K tokens to go runs one step at a time
    assert kinds[-1] == (1,) * len(kinds[-1])

    core, runner, _ = multi()
    r = req("a", [5, 6, 7], 40)
    r.kv = core.cache.admit(r.prefix_ids(), "")  # (committed_len 0: 40 tokens to go)
    assert decode_steps(core.args, [r], False) == K
    r.session_id = "s"  # a session's turn keeps its KV: one step at a time
    assert decode_steps(core.args, [r], False) == 1
    r.session_id = None
    assert decode_steps(core.args, [r] * 5, False) == 1  # more rows than decode_steps_max_batch
    assert decode_steps(core.args, [r], True) == 1  # a request waits to prefill


def test_a_request_waiting_stops_multi_step_until_it_is_admitted():
    core, runner, _ = multi(max_running=8)
    core.add_request(req("a", [5, 6, 7], 40))
    batch = core.get_next_batch()  # the prefill
    core.process_result(batch, runner.run(batch))
    batch = core.get_next_batch()
    assert batch.multistep and batch.rows[0].extend_len == K and batch.rows[0].committed_len == 3
    core.process_result(batch, runner.run(batch))
    core.add_request(req("b", [8, 9], 3))
    batch = core.get_next_batch()  # b's prefill goes first
    assert not batch.is_decode
    core.process_result(batch, runner.run(batch))
    batch = core.get_next_batch()  # both decode: b has fewer than K to go, so one step
    assert not batch.multistep and [r.extend_len for r in batch.rows] == [1, 1]
