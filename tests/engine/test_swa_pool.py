"""The sliding layers' own KV pool (kvmem/local.py) through every process, on tiny Gemma 3 and
Gemma 2 checkpoints (window 24): sized by start-up to what the running requests' windows need,
under pressure (more requests than slots, long outputs: the per-step sweep and the tree's
tombstones at work), with prefixes shared across requests and chunks smaller than the window,
overlap off, greedy tokens equal HF transformers'; the KV books intact and both pools whole
after each test. A second Gemma 3 engine runs with overlap and n-gram speculation (verify rounds
commit an upper bound and take back the rejected drafts: the slack the pool keeps)."""

from __future__ import annotations

import pytest

from tests.engine.conftest import SMALL, assert_no_leak, random_prompts
from tests.hf_ref import hf_greedy

KW = dict(SMALL, max_running_requests=4, max_prefill_tokens=64, chunked_prefill_size=16, page_size=8,
          context_length=160, max_total_tokens=8 * 100, disable_overlap_schedule=True)  # fmt: skip
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 40}
SHARED = random_prompts(1, seed=91, lo=50, hi=51)[0]  # a 50-token prefix, twice the window
PROMPTS = [SHARED + p for p in random_prompts(6, seed=92, lo=1, hi=30)] + random_prompts(4, seed=93, lo=20, hi=90)


VARIANTS = {"gemma3": ("gemma3", {}), "gemma2": ("gemma2", {}),
            "gemma3-spec": ("gemma3", dict(disable_overlap_schedule=False, speculative_algorithm="ngram",
                                           speculative_num_draft_tokens=3))}  # fmt: skip


@pytest.fixture(scope="module", params=["gemma3", pytest.param("gemma3-spec", marks=pytest.mark.slow),
                                        pytest.param("gemma2", marks=pytest.mark.sweep)])  # fmt: skip
def served(request, tiny_dir):
    from ringserve import Engine

    family, extra = VARIANTS[request.param]
    path = tiny_dir(family)
    engine = Engine(str(path), **{**KW, **extra})
    yield path, engine, request.param
    engine.shutdown()


def test_the_pool_is_sized_to_the_windows(served):
    _, engine, name = served
    info = assert_no_leak(engine)
    # 4 slots x (cdiv(24 - 1 + 2 x slack, 8) + 3 pages) + the largest step's 128 tokens (16
    # pages), and the sink page the pool holds besides; slack 2, with 3 drafts 2 x 4
    slot = 8 if "spec" in name else 7
    assert info["swa_pool_tokens"] == (4 * slot + 16) * 8
    assert info["kv_pool"]["swa_tokens"] == info["swa_pool_tokens"] + 8
    assert info["kv_pool"]["swa_tokens"] < info["kv_pool"]["max_total_tokens"]


def test_greedy_equals_hf_under_pressure_with_shared_prefixes(served):
    path, engine, _ = served
    want = hf_greedy(path, PROMPTS, GREEDY["max_new_tokens"])
    first = engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)  # its prefix cached...
    got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # ...then 10 requests on 4 slots
    assert [o["output_ids"] for o in first + got] == want[:1] + want
    cached = [o["meta_info"]["cached_tokens"] for o in got[1:6]]
    assert all(c >= 24 for c in cached), cached  # the shared prefix, matched where its window's KV is
    info = assert_no_leak(engine)
    assert info["swa_sweeps"] > 0 and info["swa_tombstoned_pages"] > 0, info  # it ran short, and coped


def test_a_flush_empties_both_pools(served):
    _, engine, _ = served
    engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)
    assert engine.flush_cache()["success"]
    info = assert_no_leak(engine)
    assert info["tree_cache_size"] == 0
