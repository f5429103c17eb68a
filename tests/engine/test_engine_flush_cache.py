"""Seed 000, 4.2: flush_cache empties the radix tree, the slot pool and the KV pool and resets
the scheduling state; refused while a request holds KV; generation after it is unchanged."""

from __future__ import annotations

from tests.engine.conftest import in_background, random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True}


def assert_flushed(engine) -> dict:
    info = engine.get_server_info()
    assert info["available_kv_tokens"] == info["initial_kv_tokens"]  # KV pool restored
    assert info["tree_cache_size"] == 0  # radix tree empty
    assert info["req_to_token_pool_used"] == 0  # slot pool empty
    assert info["forward_ct_decode"] == 0  # decode counter reset
    assert info["new_token_ratio"] == info["server_args"]["new_token_ratio_init"]
    return info


def test_1_flush_cache_after_generation(engine):
    engine.generate(input_ids=random_prompts(4, seed=31, lo=20, hi=60), sampling_params={**GREEDY, "max_new_tokens": 16})
    info = engine.get_server_info()
    assert info["tree_cache_size"] > 0 and info["forward_ct_decode"] > 0
    r = engine.flush_cache()
    assert r["success"] and r["message"] == "cache flushed"
    assert_flushed(engine)


def test_2_flush_cache_clears_scheduling_state(engine):
    engine.generate(input_ids=random_prompts(3, seed=32, lo=20, hi=60), sampling_params={**GREEDY, "max_new_tokens": 8})
    assert engine.flush_cache()["success"]
    info = assert_flushed(engine)
    assert info["running_batch_size"] == 0 and info["waiting_queue_size"] == 0
    assert info["cur_batch"] is None and info["last_batch"] is None and info["chunked_req"] is None


def test_3_generation_works_after_flush(engine):
    prompts = random_prompts(3, seed=33, lo=20, hi=60)
    sp = {**GREEDY, "max_new_tokens": 24}
    before = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    assert engine.flush_cache()["success"]
    after = engine.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in after] == before
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in after)  # cold: nothing was cached


def test_4_multiple_flush_cycles(engine):
    prompts = random_prompts(2, seed=34, lo=20, hi=60)
    sp = {**GREEDY, "max_new_tokens": 12}
    first = None
    for _ in range(4):
        out = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
        first = first or out
        assert out == first
        assert engine.flush_cache()["success"]
        assert_flushed(engine)


def test_flush_refused_while_running_then_allowed_after_retract(engine):
    t, box = in_background(engine, random_prompts(2, seed=2), 200)
    r = engine.flush_cache()
    assert not r["success"] and "hold KV" in r["message"]
    engine.pause_generation("retract")
    assert engine.flush_cache()["success"]
    info = engine.get_server_info()
    assert (
        info["tree_cache_size"] == 0
        and info["req_to_token_pool_used"] == 0
        and info["forward_ct_decode"] == 0
    )
    engine.continue_generation()
    t.join(60)
    assert "err" not in box
