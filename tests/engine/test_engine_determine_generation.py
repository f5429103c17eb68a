"""Seed 000, 4.3: deterministic generation across interruptions, at temperature 0.

A request paused with retract and continued gives exactly its uninterrupted tokens; an aborted
one returns a prefix of them (exactly the tokens produced so far), and resubmitting prompt +
partial gives the rest (the partial-rollout resubmit RL frameworks do; sglang-jax #580 fails
it). Aborts are checked from every state a request can be in: waiting, half-way through a
chunked prefill, decoding, and with a batch of it in flight (overlap). `generate(prompt +
out[:k])` continues with `out[k:]` for k on and off page boundaries, with the prefix cache warm
and cold. The same on SmolLM2."""

from __future__ import annotations

import threading
import time

import pytest

from tests.engine.conftest import SMALL, assert_no_leak, in_background, random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True}
MAX_NEW = 150


def baseline(engine, prompts, max_new=MAX_NEW):
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new})
    return [o["output_ids"] for o in outs]


def resubmit_matches(engine, prompt, partial, want, max_new=MAX_NEW):
    assert partial == want[: len(partial)], "the partial output is not a prefix of the uninterrupted one"
    rest = engine.generate(input_ids=prompt + partial, sampling_params={**GREEDY, "max_new_tokens": max_new - len(partial)})
    assert partial + rest["output_ids"] == want


def test_1_single_request_retract_vs_no_pause(engine):
    prompt = random_prompts(1, seed=41, lo=10, hi=40)
    want = baseline(engine, prompt)
    t, box = in_background(engine, prompt, MAX_NEW, min_decodes=10)
    assert engine.pause_generation("retract")["success"]
    assert engine.get_server_info()["retracted_waiting"] == 1
    assert engine.continue_generation()["success"]
    t.join(60)
    assert [o["output_ids"] for o in box["out"]] == want


def test_2_single_request_abort_vs_no_pause(engine):
    prompt = random_prompts(1, seed=42, lo=10, hi=40)
    want = baseline(engine, prompt)
    t, box = in_background(engine, prompt, MAX_NEW, min_decodes=10)
    engine.abort_request(engine.get_server_info()["running_rids"][0])
    t.join(60)
    out = box["out"][0]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < MAX_NEW
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    resubmit_matches(engine, prompt[0], out["output_ids"], want[0])


def test_3_multiple_requests_retract_vs_no_pause(engine):
    prompts = random_prompts(5, seed=43, lo=5, hi=50)
    want = baseline(engine, prompts)
    t, box = in_background(engine, prompts, MAX_NEW, min_decodes=5)
    for _ in range(3):
        assert engine.pause_generation("retract")["success"]
        assert engine.continue_generation()["success"]
        time.sleep(0.1)
    t.join(60)
    assert [o["output_ids"] for o in box["out"]] == want


def test_4_multiple_requests_abort_vs_no_pause(engine):
    prompts = random_prompts(3, seed=4, lo=5, hi=30)
    want = baseline(engine, prompts)
    t, box = in_background(engine, prompts, MAX_NEW)
    assert engine.pause_generation("abort")["success"]
    t.join(30)
    outs = box["out"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    info = engine.get_server_info()
    assert info["running_batch_size"] == 0 and info["waiting_queue_size"] == 0
    engine.continue_generation()
    for o, p, w in zip(outs, prompts, want, strict=True):  # partial rollouts resubmitted
        resubmit_matches(engine, p, o["output_ids"], w)


@pytest.mark.parametrize("k", [7, 16, 17, 32, 41])  # on (16, 32) and off page boundaries
@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_prompt_plus_first_k_continues_with_the_rest(engine, k, cache):
    prompt = random_prompts(1, seed=44, lo=20, hi=21)[0]  # 20 tokens: k moves the boundary
    out = baseline(engine, [prompt], 60)[0]
    if cache == "cold":
        assert engine.flush_cache()["success"]
    rest = engine.generate(input_ids=prompt + out[:k], sampling_params={**GREEDY, "max_new_tokens": 60 - k})
    assert rest["output_ids"] == out[k:]
    cached = rest["meta_info"]["cached_tokens"]
    if cache == "warm":  # the first request cached its whole pages (prompt + output but the last)
        assert cached == ((len(prompt) + k - 1) // 16) * 16
    else:
        assert cached == 0


# ---- aborts from every state ---------------------------------------------------------------------
def test_abort_while_waiting_returns_nothing_and_resubmit_gives_all(engine):
    prompt = [5, 6, 7, 8]
    want = baseline(engine, [prompt], 20)[0]
    assert engine.pause_generation("in_place")["success"]
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=prompt, rid="queued", sampling_params={**GREEDY, "max_new_tokens": 20})))  # fmt: skip
    t.start()
    deadline = time.monotonic() + 10
    while "queued" not in engine.get_server_info()["waiting_rids"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.abort_request("queued")
    t.join(10)
    out = box["out"]
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "abort"
    engine.continue_generation()
    resubmit_matches(engine, prompt, [], want, 20)


def test_abort_while_decoding_with_a_batch_in_flight(engine):
    """Overlap is on: every decode step of a running request has the next one in flight; the
    abort returns the tokens processed so far, the in-flight token is dropped."""
    prompts = random_prompts(2, seed=45, lo=5, hi=30)
    want = baseline(engine, prompts)
    for delay in (0.0, 0.03, 0.1):
        stream = engine.generate(input_ids=prompts, rid=["a", "b"], stream=True,
                                 sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})  # fmt: skip
        seen = {}
        for chunk in stream:
            seen[chunk["index"]] = chunk
            if len(seen) == 2:
                break
        time.sleep(delay)
        engine.abort_request("a")
        last = dict(seen)
        for chunk in stream:
            last[chunk["index"]] = chunk
        a, b = last[0], last[1]
        assert a["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(a["output_ids"]) >= len(seen[0]["output_ids"])  # nothing it produced is lost
        assert b["output_ids"] == want[1]
        resubmit_matches(engine, prompts[0], a["output_ids"], want[0])


@pytest.fixture(scope="module")
def chunky(tiny_llama):
    """Prefill in chunks of 16 tokens, at most 2 running requests."""
    from ringserve import Engine

    e = Engine(str(tiny_llama), page_size=16, **{**SMALL, "chunked_prefill_size": 16, "max_running_requests": 2})
    yield e
    e.continue_generation()
    assert_no_leak(e)
    e.shutdown()


def test_abort_half_way_through_a_chunked_prefill(chunky):
    prompt = random_prompts(1, seed=46, lo=200, hi=201)[0]  # 13 chunks of 16
    want = baseline(chunky, [prompt], 20)[0]
    assert chunky.flush_cache()["success"]
    for attempt in range(20):
        box: dict = {}
        rid = f"long{attempt}"
        t = threading.Thread(target=lambda rid=rid, box=box: box.update(out=chunky.generate(
            input_ids=prompt, rid=rid, sampling_params={**GREEDY, "max_new_tokens": 20})))  # fmt: skip
        t.start()
        while chunky.get_server_info()["chunked_req"] != rid and t.is_alive():
            time.sleep(0.002)
        assert chunky.pause_generation("in_place")["success"]
        info = chunky.get_server_info()
        if info["chunked_req"] == rid:  # caught between two chunks
            assert 0 < info["available_kv_tokens"] < info["initial_kv_tokens"]
            chunky.abort_request(rid)
            chunky.continue_generation()
            t.join(10)
            out = box["out"]
            assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "abort"
            resubmit_matches(chunky, prompt, [], want, 20)
            return
        chunky.continue_generation()
        t.join(30)
        assert chunky.flush_cache()["success"]
    pytest.fail("never caught the request between two prefill chunks")


def test_abort_while_waiting_behind_a_full_running_batch(chunky):
    prompts = random_prompts(3, seed=47, lo=5, hi=20)
    want = baseline(chunky, prompts, 60)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=chunky.generate(
        input_ids=prompts, rid=["r0", "r1", "r2"], sampling_params={**GREEDY, "max_new_tokens": 60})))  # fmt: skip
    t.start()
    deadline = time.monotonic() + 20
    while "r2" not in chunky.get_server_info()["waiting_rids"]:
        assert time.monotonic() < deadline, "r2 never waited (max_running_requests=2)"
        time.sleep(0.005)
    chunky.abort_request("r2")
    t.join(60)
    outs = box["out"]
    assert outs[2]["output_ids"] == [] and outs[2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert [o["output_ids"] for o in outs[:2]] == want[:2]
    resubmit_matches(chunky, prompts[2], [], want[2], 60)
