"""Engine fixtures: engines over the real actors (processes + rings), leak checks after use."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

# Small shapes keep start-up (compiling every bucket) to a few seconds on the tiny model.
SMALL = dict(max_running_requests=16, context_length=256, max_prefill_tokens=256, max_total_tokens=16 * 512)


def assert_no_leak(engine) -> dict:
    """The KV books are intact and every page and slot is back (the tree's pages are evictable)."""
    info = engine.get_server_info()
    assert info["integrity_errors"] == [], info["integrity_errors"]
    assert info["running_batch_size"] == 0 and info["waiting_queue_size"] == 0
    assert info["req_to_token_pool_used"] == 0
    assert info["available_kv_tokens"] == info["initial_kv_tokens"]
    assert info["swa_available_tokens"] == info["swa_pool_tokens"]  # the sliding layers' own pool (or none)
    return info


@contextlib.contextmanager
def engine_ctx(model_path, **kw):
    from ringserve.actors.frontend.engine import Engine

    engine = Engine(str(model_path), **{**SMALL, **kw})
    try:
        yield engine
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 60, vocab: int = 2000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(lo, hi, n)]


@pytest.fixture(scope="module")
def tiny_llama(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture
def engine(shared_engine):
    """The shared engine, checked after the test: not paused, no leak."""
    yield shared_engine
    shared_engine.continue_generation()
    assert_no_leak(shared_engine)


def in_background(engine, prompts, max_new, min_decodes: int = 3, **sp):
    """Start a greedy generate of `prompts` in a thread; return once it decoded `min_decodes`
    steps. (thread, box): box["out"] is the result list, box["err"] an exception."""
    import threading
    import time

    box: dict = {}

    def go():
        try:
            box["out"] = engine.generate(
                input_ids=prompts, sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new, **sp}
            )
        except BaseException as e:  # surfaced by the test
            box["err"] = e

    base = engine.get_server_info()["forward_ct_decode"]
    t = threading.Thread(target=go)
    t.start()
    deadline = time.monotonic() + 60
    while engine.get_server_info()["forward_ct_decode"] < base + min_decodes:
        assert "err" not in box, box["err"]
        assert time.monotonic() < deadline, "generation never started decoding"
        time.sleep(0.01)
    return t, box


def rl_sampling(eos: int) -> list[dict]:
    """What RL frameworks send besides temperature (tests/engine/test_sampling_params.py checks
    each against a reference): penalties, min_new_tokens with a pushed-for EOS, logit_bias, the
    sampling mask; greedy and seeded."""
    return [
        {"temperature": 0, "ignore_eos": True, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
        {"temperature": 0, "ignore_eos": True, "presence_penalty": 1.5, "logit_bias": {"5": 2.0}},
        {"temperature": 0, "min_new_tokens": 6, "logit_bias": {str(eos): 50.0}, "frequency_penalty": 0.5},
        {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 11, "ignore_eos": True, "repetition_penalty": 1.2,
         "presence_penalty": 0.5, "custom_params": {"return_top_p_token_ids": True}},
    ]  # fmt: skip


def assert_same_rl_outputs(engine, reference, prompts: list[list[int]], max_new: int) -> None:
    """`engine` gives `reference`'s tokens, finish reasons, logprobs and sampling masks for every
    prompt under each of `rl_sampling`'s parameters (all in one batch)."""
    cases = rl_sampling(engine.tokenizer.eos_token_id)
    ps = [p for p in prompts for _ in cases]
    sps = [{**c, "max_new_tokens": max_new} for _ in prompts for c in cases]
    want = reference.generate(input_ids=ps, sampling_params=sps, return_logprob=True)
    got = engine.generate(input_ids=ps, sampling_params=sps, return_logprob=True)
    for g, w, sp in zip(got, want, sps, strict=True):
        assert g["output_ids"] == w["output_ids"], sp
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], sp
        np.testing.assert_allclose([x[0] for x in g["meta_info"]["output_token_logprobs"]],
                                   [x[0] for x in w["meta_info"]["output_token_logprobs"]], rtol=1e-4, atol=1e-4)  # fmt: skip
        for key in ("top_p_token_ids", "top_p_token_offsets"):
            assert g["meta_info"].get(key) == w["meta_info"].get(key), sp
    early = [len(w["output_ids"]) for w, sp in zip(want, sps, strict=True) if sp.get("min_new_tokens")]
    assert min(early) >= 6 and any(n < max_new for n in early), "EOS was meant to end them right after min_new_tokens"
