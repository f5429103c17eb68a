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
