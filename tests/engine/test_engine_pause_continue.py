"""Seed 000, 4.1: pause_generation / continue_generation in every mode, through the actors.

retract: the running batch empties into the waiting queue and the KV is freed; in_place:
everything stays (same requests, same KV, no step runs); abort: everything finishes with
'abort'. After continue_generation every request completes with exactly its uninterrupted
tokens (temperature 0)."""

from __future__ import annotations

import time

import pytest

from tests.engine.conftest import in_background, random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True}
N = 4


def uninterrupted(engine, prompts, max_new):
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new})]


def test_1_pause_generation_retract_mode(engine):
    prompts = random_prompts(N, seed=21, lo=5, hi=40)
    want = uninterrupted(engine, prompts, 120)
    t, box = in_background(engine, prompts, 120)
    running = set(engine.get_server_info()["running_rids"])
    assert engine.pause_generation("retract")["success"]
    info = engine.get_server_info()
    assert info["running_batch_size"] == 0  # the running batch is empty
    assert info["waiting_queue_size"] == N and running <= set(info["waiting_rids"])  # moved to waiting
    assert info["retracted_waiting"] == N
    assert info["available_kv_tokens"] == info["initial_kv_tokens"]  # KV freed (the tree's is evictable)
    assert info["req_to_token_pool_used"] == 0
    assert engine.continue_generation()["success"]
    t.join(60)
    assert "err" not in box and [o["output_ids"] for o in box["out"]] == want
    assert all(o["meta_info"]["finish_reason"] == {"type": "length"} for o in box["out"])


def test_2_pause_generation_in_place_mode(engine):
    prompts = random_prompts(N, seed=22, lo=5, hi=40)
    want = uninterrupted(engine, prompts, 120)
    t, box = in_background(engine, prompts, 120)
    assert engine.pause_generation("in_place")["success"]
    info = engine.get_server_info()
    assert info["running_batch_size"] == N and info["waiting_queue_size"] == 0
    assert info["available_kv_tokens"] < info["initial_kv_tokens"]  # the KV is kept
    time.sleep(0.3)
    later = engine.get_server_info()
    for key in ("running_rids", "waiting_rids", "available_kv_tokens", "forward_ct_decode", "req_to_token_pool_used"):
        assert later[key] == info[key], key  # nothing moved while paused
    assert engine.continue_generation()["success"]
    t.join(60)
    assert "err" not in box and [o["output_ids"] for o in box["out"]] == want


def test_3_pause_continue_multiple_cycles(engine):
    prompts = random_prompts(N, seed=23, lo=5, hi=40)
    want = uninterrupted(engine, prompts, 160)
    t, box = in_background(engine, prompts, 160)
    for mode in ("retract", "in_place", "retract", "in_place", "retract"):
        assert engine.pause_generation(mode)["success"]
        info = engine.get_server_info()
        if mode == "retract":
            assert info["running_batch_size"] == 0 and info["available_kv_tokens"] == info["initial_kv_tokens"]
        else:
            assert info["running_batch_size"] + info["waiting_queue_size"] > 0
        assert engine.continue_generation()["success"]
        base = engine.get_server_info()["forward_ct_decode"]
        while engine.get_server_info()["forward_ct_decode"] < base + 3 and t.is_alive():
            time.sleep(0.01)
    t.join(60)
    assert "err" not in box and [o["output_ids"] for o in box["out"]] == want


def test_4_pause_generation_abort_mode(engine):
    prompts = random_prompts(N, seed=24, lo=5, hi=40)
    t, box = in_background(engine, prompts, 150)
    assert engine.pause_generation("abort")["success"]
    t.join(30)
    assert "err" not in box
    assert [o["meta_info"]["finish_reason"]["type"] for o in box["out"]] == ["abort"] * N
    info = engine.get_server_info()
    assert info["running_batch_size"] == 0 and info["waiting_queue_size"] == 0


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_continue_gives_the_uninterrupted_tokens(engine, mode):
    prompts = random_prompts(4, seed=9, lo=5, hi=40)
    want = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 120})
    t, box = in_background(engine, prompts, 120)
    before = engine.get_server_info()
    assert engine.pause_generation(mode)["success"]
    info = engine.get_server_info()
    if mode == "retract":
        assert info["running_batch_size"] == 0 and info["waiting_queue_size"] == 4
        assert info["available_kv_tokens"] == info["initial_kv_tokens"]
    else:
        assert (
            info["running_batch_size"] + info["waiting_queue_size"]
            == before["running_batch_size"] + before["waiting_queue_size"]
        )
        assert info["available_kv_tokens"] < info["initial_kv_tokens"]
        time.sleep(0.2)
        assert engine.get_server_info()["forward_ct_decode"] == info["forward_ct_decode"], (
            "paused engine kept decoding"
        )
    assert engine.continue_generation()["success"]
    t.join(60)
    assert "err" not in box and [o["output_ids"] for o in box["out"]] == [o["output_ids"] for o in want]


def test_requests_sent_while_paused_wait_for_continue(engine):
    assert engine.pause_generation("in_place")["success"]
    t, box = None, {}
    import threading

    def go():
        box["out"] = engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 4})

    t = threading.Thread(target=go)
    t.start()
    time.sleep(0.3)
    assert "out" not in box and engine.get_server_info()["waiting_queue_size"] == 1
    engine.continue_generation()
    t.join(30)
    assert box["out"]["meta_info"]["finish_reason"] == {"type": "length"}
