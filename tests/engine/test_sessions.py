"""Streaming sessions through the engine: a turn extends the KV its previous turn kept (only the
new tokens are computed), branches from an earlier turn (rid + offset, replace), many sessions
at once, and retract, pause, abort, flush and close with sessions; outputs equal the runs of the
concatenated prompts, and the KV is back to its initial value once the sessions close."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.conftest import random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True}


def conversation(engine, turns: list[list[int]], max_new: int, sid: str | None = None) -> list[dict]:
    """Each turn appended to the previous one in the session (or, with sid None, the reference:
    every turn sent as the whole conversation so far, no session)."""
    outs, ctx, prev = [], [], None
    for t in turns:
        sp = {**GREEDY, "max_new_tokens": max_new}
        if sid is None:
            out = engine.generate(input_ids=ctx + t, sampling_params=sp)
        else:
            out = engine.generate(input_ids=t, sampling_params=sp, session_params={"id": sid, "rid": prev})
        ctx = ctx + t + out["output_ids"]
        prev = out["meta_info"]["id"]
        outs.append(out)
    return outs


def test_turns_extend_the_kept_kv_and_equal_the_concatenated_runs(engine):
    turns = random_prompts(4, seed=61, lo=3, hi=30)
    assert engine.flush_cache()["success"]
    want = [o["output_ids"] for o in conversation(engine, turns, 12)]
    assert engine.flush_cache()["success"]
    sid = engine.open_session(capacity_of_str_len=4096)
    outs = conversation(engine, turns, 12, sid)
    assert [o["output_ids"] for o in outs] == want
    prompt_len = 0
    for k, o in enumerate(outs):
        prompt_len += len(turns[k])
        assert o["meta_info"]["prompt_tokens"] == prompt_len
        if k:  # everything before this turn's new tokens came from the kept slot
            assert o["meta_info"]["cached_tokens"] == prompt_len - len(turns[k])
        prompt_len += len(o["output_ids"])
    assert engine.get_server_info()["sessions_keeping_kv"] == 1
    engine.close_session(sid)
    assert engine.get_server_info()["sessions_keeping_kv"] == 0
    with pytest.raises(ValueError, match="no such open session"):
        engine.close_session(sid)


def test_branching_with_rid_offset_replace_and_drop_previous_output(engine):
    sp = {**GREEDY, "max_new_tokens": 8}
    a, b, c = [5, 6, 7, 8, 9, 10], [20, 21, 22], [30, 31]
    sid = engine.open_session()
    t1 = engine.generate(input_ids=a, sampling_params=sp, session_params={"id": sid})
    t2 = engine.generate(input_ids=b, sampling_params=sp, session_params={"id": sid, "rid": t1["meta_info"]["id"]})
    r1 = t1["meta_info"]["id"]
    # branch from turn 1 again (its output replaced by c): the offset cuts turn 1's context
    off = len(a) + 3
    br = engine.generate(input_ids=c, sampling_params=sp, session_params={"id": sid, "rid": r1, "offset": off})
    want = engine.generate(input_ids=(a + t1["output_ids"])[:off] + c, sampling_params=sp)
    assert br["output_ids"] == want["output_ids"] and br["meta_info"]["prompt_tokens"] == off + len(c)
    # drop_previous_output: turn 1's prompt, then c
    dr = engine.generate(input_ids=c, sampling_params=sp,
                         session_params={"id": sid, "rid": r1, "drop_previous_output": True})  # fmt: skip
    assert dr["output_ids"] == engine.generate(input_ids=a + c, sampling_params=sp)["output_ids"]
    # replace: turn 1's children (turn 2 and the branches) are dropped, the new turn follows it
    rep = engine.generate(input_ids=b, sampling_params=sp, session_params={"id": sid, "rid": r1, "replace": True})
    assert rep["output_ids"] == t2["output_ids"]
    with pytest.raises(ValueError, match="is not a turn of session"):  # turn 2 was replaced away
        engine.generate(input_ids=c, sampling_params=sp, session_params={"id": sid, "rid": t2["meta_info"]["id"]})
    # rid None: no history; replace without rid clears the session
    fresh = engine.generate(input_ids=c, sampling_params=sp, session_params={"id": sid, "rid": None, "replace": True})
    assert fresh["output_ids"] == engine.generate(input_ids=c, sampling_params=sp)["output_ids"]
    with pytest.raises(ValueError, match="is not a turn of session"):
        engine.generate(input_ids=c, sampling_params=sp, session_params={"id": sid, "rid": r1})
    engine.close_session(sid)


def test_bad_session_params_name_the_field(engine):
    sid = engine.open_session()
    for params, words in [({"id": "nope"}, ["session id 'nope' does not exist"]),
                          ({"id": sid, "colour": 1}, ["unknown key", "colour"]),
                          ({"id": sid, "rid": "x"}, ["rid 'x' is not a turn"]),
                          ({"id": sid, "offset": -1}, ["offset=-1"]),
                          ("not a dict", ["expected a dict"])]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            engine.generate(input_ids=[5, 6], session_params=params)
        for w in words:
            assert w in str(e.value)
    with pytest.raises(ValueError, match="already open"):
        engine.open_session(session_id=sid)
    with pytest.raises(ValueError, match="n > 1"):
        engine.generate(input_ids=[5, 6], sampling_params={"n": 2}, session_params={"id": sid})
    engine.close_session(sid)


def test_32_concurrent_sessions_of_5_turns(engine):
    convs = [random_prompts(5, seed=100 + i, lo=2, hi=12) for i in range(32)]
    assert engine.flush_cache()["success"]
    want = [[o["output_ids"] for o in conversation(engine, turns, 6)] for turns in convs]
    assert engine.flush_cache()["success"]
    sids = [engine.open_session() for _ in convs]

    async def one(sid, turns) -> list[list[int]]:
        ctx_prev, outs = None, []
        for t in turns:
            out = await engine.async_generate(input_ids=t, sampling_params={**GREEDY, "max_new_tokens": 6},
                                              session_params={"id": sid, "rid": ctx_prev})  # fmt: skip
            ctx_prev = out["meta_info"]["id"]
            outs.append(out["output_ids"])
        return outs

    async def all_of_them():
        return await asyncio.gather(*(one(s, t) for s, t in zip(sids, convs, strict=True)))

    assert asyncio.run(all_of_them()) == want
    for s in sids:
        engine.close_session(s)
    info = engine.get_server_info()  # the engine fixture checks integrity and every page back
    assert info["sessions_keeping_kv"] == 0 and info["available_kv_tokens"] == info["initial_kv_tokens"]


@pytest.fixture
def session(engine):
    sid = engine.open_session()
    yield sid
    if sid in engine.frontend.core.sessions.open:
        engine.close_session(sid)


def test_retract_pause_abort_and_flush_with_sessions(engine, session):
    turns = random_prompts(3, seed=62, lo=4, hi=20)
    want = [o["output_ids"] for o in conversation(engine, turns, 40)]
    sid = session
    t1 = engine.generate(input_ids=turns[0], sampling_params={**GREEDY, "max_new_tokens": 40}, session_params={"id": sid})
    assert t1["output_ids"] == want[0]
    # turn 2 is retracted by a pause half-way, then continues: exact
    stream = engine.generate(input_ids=turns[1], sampling_params={**GREEDY, "max_new_tokens": 40}, stream=True,
                             session_params={"id": sid, "rid": t1["meta_info"]["id"]})  # fmt: skip
    next(stream)
    assert engine.pause_generation("retract")["success"] and engine.continue_generation()["success"]
    *_, t2 = stream
    assert t2["output_ids"] == want[1]
    # flush drops the kept KV but the session goes on: the next turn computes from scratch
    assert engine.flush_cache()["success"] and engine.get_server_info()["sessions_keeping_kv"] == 0
    t3 = engine.generate(input_ids=turns[2], sampling_params={**GREEDY, "max_new_tokens": 40},
                         session_params={"id": sid, "rid": t2["meta_info"]["id"]})  # fmt: skip
    assert t3["output_ids"] == want[2] and t3["meta_info"]["cached_tokens"] == 0
    # an aborted turn keeps its partial output; the next turn may follow it
    stream = engine.generate(input_ids=[7, 7], sampling_params={**GREEDY, "max_new_tokens": 60}, stream=True,
                             session_params={"id": sid, "rid": t3["meta_info"]["id"]})  # fmt: skip
    first = next(stream)
    engine.abort_request(first["meta_info"]["id"])
    *_, ab = stream
    assert ab["meta_info"]["finish_reason"]["type"] == "abort"
    nxt = engine.generate(input_ids=[8], sampling_params={**GREEDY, "max_new_tokens": 5},
                          session_params={"id": sid, "rid": ab["meta_info"]["id"]})  # fmt: skip
    ctx = turns[0] + want[0] + turns[1] + want[1] + turns[2] + want[2] + [7, 7] + ab["output_ids"] + [8]
    assert nxt["output_ids"] == engine.generate(input_ids=ctx, sampling_params={**GREEDY, "max_new_tokens": 5})["output_ids"]
    # pause abort ends a running turn too; closing the session aborts nothing left
    engine.close_session(sid)
