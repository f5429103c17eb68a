"""Prompt logprobs through the engine (SGLang's `logprob_start_len`, `input_token_logprobs`,
`input_top_logprobs`, `token_ids_logprob`): equal HF's log-softmax cold, after the prompt was
cached (the cache is bypassed for the positions still wanted), from a later start (the cache
grants up to it), in one extend row (overlap on) and chunked at 16 (overlap off); the default
(-1) is SGLang's one entry; n > 1 samples and a batch mixing starts; a retracted request does
not report a position twice; nothing recompiles. The bits across chunkings and overlap:
tests/engine/test_deterministic.py; the scheduler's books: tests/actors/scheduler."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.engine.conftest import SMALL, assert_no_leak, random_prompts
from tests.hf_ref import hf_logits, hf_logprobs

SP = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}
IDS = [0, 7, 100]


@pytest.fixture(scope="module")
def chunked16(tiny_dir):
    """The shared engine's checkpoint and shapes (the compiled programs are the cache's), prompts
    chunked at 16 tokens, overlap off."""
    from ringserve import Engine

    e = Engine(str(tiny_dir("llama")), page_size=16, chunked_prefill_size=16, disable_overlap_schedule=True, **SMALL)
    yield e
    e.shutdown()


@pytest.fixture(params=["one-row-overlap", "chunked16-normal"])
def any_engine(request, shared_engine):
    e = shared_engine if request.param == "one-row-overlap" else request.getfixturevalue("chunked16")
    yield e
    e.continue_generation()
    assert_no_leak(e)


def check_against_hf(path, prompt: list[int], out: dict, start: int) -> None:
    """input_* from `start` and the output's token_ids_logprob equal HF's log-softmax."""
    meta = out["meta_info"]
    ref = hf_logprobs(path, prompt)
    tol = 1e-5 * np.abs(hf_logits(path, prompt)).max()
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt[start:] and inp[0][0] is None  # SGLang's shape: entry 0 None
    got = np.array([lp for lp, _, _ in inp[1:]])
    assert np.abs(got - ref[np.arange(start, len(prompt) - 1), prompt[start + 1 :]]).max() <= tol
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(prompt) - start
    assert [row[0][1] for row in tops[1:]] == ref[start:-1].argmax(-1).tolist()
    assert np.abs(np.array([[lp for lp, _, _ in row] for row in tops[1:]]) - np.sort(ref[start:-1])[:, ::-1][:, :2]).max() <= tol
    ids = meta["input_token_ids_logprobs"]
    assert ids[0] is None and [[t for _, t, _ in row] for row in ids[1:]] == [IDS] * (len(prompt) - 1 - start)
    assert np.abs(np.array([[lp for lp, _, _ in row] for row in ids[1:]]) - ref[start:-1][:, IDS]).max() <= tol
    # the output side: the first token's logprob (and its token_ids_logprob) are the last prompt position's
    first_lp, first, _ = meta["output_token_logprobs"][0]
    assert first == ref[-1].argmax() and abs(first_lp - ref[-1, first]) <= tol
    out_ids = meta["output_token_ids_logprobs"]
    assert len(out_ids) == len(out["output_ids"]) and [t for _, t, _ in out_ids[0]] == IDS
    assert np.abs(np.array([lp for lp, _, _ in out_ids[0]]) - ref[-1, IDS]).max() <= tol


def test_prompt_logprobs_equal_hf_cold_cached_and_from_a_start(any_engine):
    engine = any_engine
    path = str(engine.model_dir)
    traces = engine.wait_compiled()["runner_trace_count"]
    prompt = random_prompts(1, seed=91, lo=70, hi=71)[0]
    ask = dict(return_logprob=True, top_logprobs_num=2, token_ids_logprob=IDS, sampling_params=SP)
    assert engine.flush_cache()["success"]
    cold = engine.generate(input_ids=prompt, logprob_start_len=0, **ask)
    check_against_hf(path, prompt, cold, 0)
    assert cold["meta_info"]["cached_tokens"] == 0
    engine.generate(input_ids=prompt, sampling_params=SP)
    assert engine.generate(input_ids=prompt, sampling_params=SP)["meta_info"]["cached_tokens"] == 64  # 4 pages
    warm = engine.generate(input_ids=prompt, logprob_start_len=0, **ask)
    assert warm["meta_info"]["cached_tokens"] == 0  # bypassed: every position is computed
    check_against_hf(path, prompt, warm, 0)
    late = engine.generate(input_ids=prompt, logprob_start_len=40, **ask)
    assert late["meta_info"]["cached_tokens"] == 32  # granted up to the start, page-aligned
    check_against_hf(path, prompt, late, 40)
    assert engine.get_server_info()["runner_trace_count"] == traces  # nothing recompiled


def test_starts_mixed_in_one_batch_and_n_samples(engine):
    """A batch mixing a start, the default and a start at the last token, two samples each:
    every sample reports its own (equal) prompt logprobs; the default is SGLang's one entry."""
    prompt = random_prompts(1, seed=93, lo=70, hi=71)[0]
    outs = engine.generate(input_ids=[prompt, prompt[:20], prompt[:9]], logprob_start_len=[5, -1, 8],
                           return_logprob=True, top_logprobs_num=1, sampling_params={**SP, "n": 2})  # fmt: skip
    metas = [o["meta_info"] for o in outs]
    assert [len(x["input_token_logprobs"]) for x in metas] == [65, 65, 1, 1, 1, 1]
    assert metas[2]["input_token_logprobs"] == [(None, prompt[19], engine.tokenizer.decode([prompt[19]]))]
    assert metas[2]["input_top_logprobs"] == [None] and metas[4]["input_top_logprobs"] == [None]
    lps = [[lp for lp, _, _ in x["input_token_logprobs"][1:]] for x in metas[:2]]
    alone = engine.generate(input_ids=prompt, logprob_start_len=5, return_logprob=True, sampling_params=SP)
    lps.append([lp for lp, _, _ in alone["meta_info"]["input_token_logprobs"][1:]])
    tol = 1e-5 * np.abs(lps).max()  # float32 error: 1e-5 of the scale (other batch, other shapes)
    assert np.abs(np.array(lps) - lps[0]).max() <= tol
    # without return_logprob nothing is reported, whatever logprob_start_len says
    plain = engine.generate(input_ids=prompt, logprob_start_len=0, sampling_params=SP)
    assert "input_token_logprobs" not in plain["meta_info"] and "output_token_logprobs" not in plain["meta_info"]


def test_a_retracted_request_reports_each_prompt_position_once(engine):
    """Retracted mid-generation and resumed (re-prefilled): its prompt logprobs are those of a
    quiet run, each position once."""
    prompt = random_prompts(1, seed=92, lo=50, hi=51)[0]
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 60}
    want = engine.generate(input_ids=prompt, logprob_start_len=3, return_logprob=True, sampling_params=sp)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=prompt, logprob_start_len=3, return_logprob=True, sampling_params=sp)))  # fmt: skip
    base = engine.get_server_info()["forward_ct_decode"]
    t.start()
    while engine.get_server_info()["forward_ct_decode"] < base + 5 and t.is_alive():
        time.sleep(0.005)
    engine.pause_generation("retract")
    engine.continue_generation()
    t.join(60)
    got = box["out"]["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt[3:]
    lps = np.array([[lp for lp, _, _ in x[1:]] for x in (got, want["meta_info"]["input_token_logprobs"])])
    assert np.abs(lps[0] - lps[1]).max() <= 1e-5 * np.abs(lps).max()
    assert box["out"]["output_ids"] == want["output_ids"]
