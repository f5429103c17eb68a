"""Prompt logprobs through the engine (SGLang's `logprob_start_len`, `input_token_logprobs`,
`input_top_logprobs`, `token_ids_logprob`): equal HF's log-softmax cold, after the prompt was
cached (the cache is bypassed for the positions still wanted), from a later start (the cache
grants up to it), chunked; a retracted request does not report a position twice; nothing
recompiles. The bits across chunkings and overlap: tests/engine/test_deterministic.py."""

from __future__ import annotations

import numpy as np

from tests.engine.conftest import random_prompts
from tests.hf_ref import hf_logits, hf_logprobs

SP = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}
IDS = [0, 7, 100]


def check_against_hf(path, prompt: list[int], out: dict, start: int) -> None:
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
    ids = meta["input_token_ids_logprobs"]
    assert ids[0] is None and [[t for _, t, _ in row] for row in ids[1:]] == [IDS] * (len(prompt) - 1 - start)
    assert np.abs(np.array([[lp for lp, _, _ in row] for row in ids[1:]]) - ref[start:-1][:, IDS]).max() <= tol
    # the output side: the first token's logprob is the last prompt position's
    first_lp, first, _ = meta["output_token_logprobs"][0]
    assert first == ref[-1].argmax() and abs(first_lp - ref[-1, first]) <= tol
    assert len(meta["output_token_ids_logprobs"]) == len(out["output_ids"])
    assert abs(meta["output_token_ids_logprobs"][0][1][0] - ref[-1, IDS[1]]) <= tol


def test_prompt_logprobs_equal_hf_cold_cached_and_from_a_start(engine):
    path = str(engine.model_dir)
    traces = engine.wait_compiled()["runner_trace_count"]
    prompt = random_prompts(1, seed=91, lo=70, hi=71)[0]
    ask = dict(return_logprob=True, top_logprobs_num=2, token_ids_logprob=IDS, sampling_params=SP)
    assert engine.flush_cache()["success"]
    cold = engine.generate(input_ids=prompt, logprob_start_len=0, **ask)
    check_against_hf(path, prompt, cold, 0)
    assert cold["meta_info"]["cached_tokens"] == 0
    engine.generate(input_ids=prompt, sampling_params=SP)  # the prompt is cached now (64 tokens: 4 pages)
    assert engine.generate(input_ids=prompt, sampling_params=SP)["meta_info"]["cached_tokens"] == 64
    warm = engine.generate(input_ids=prompt, logprob_start_len=0, **ask)
    assert warm["meta_info"]["cached_tokens"] == 0  # bypassed: every position is computed
    assert warm["meta_info"]["input_token_logprobs"] == cold["meta_info"]["input_token_logprobs"]
    late = engine.generate(input_ids=prompt, logprob_start_len=40, **ask)
    assert late["meta_info"]["cached_tokens"] == 32  # granted up to the start, page-aligned
    check_against_hf(path, prompt, late, 40)
    # a batch mixing starts, none, the default; n > 1 samples each compute theirs
    outs = engine.generate(input_ids=[prompt, prompt[:20], prompt[:9]], logprob_start_len=[5, -1, 8],
                           return_logprob=True, sampling_params={**SP, "n": 2})  # fmt: skip
    assert [len(o["meta_info"].get("input_token_logprobs", [])) for o in outs] == [65, 65, 0, 0, 1, 1]
    np.testing.assert_allclose([lp for lp, _, _ in outs[1]["meta_info"]["input_token_logprobs"][36:]],
                               [lp for lp, _, _ in late["meta_info"]["input_token_logprobs"][1:]], atol=1e-4)  # fmt: skip
    assert engine.get_server_info()["runner_trace_count"] == traces  # nothing recompiled


def test_a_retracted_request_reports_each_prompt_position_once(engine):
    """Retracted mid-generation and resumed: its prompt logprobs are those of a quiet run."""
    prompt = random_prompts(1, seed=92, lo=50, hi=51)[0]
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 60}
    want = engine.generate(input_ids=prompt, logprob_start_len=3, return_logprob=True, sampling_params=sp)
    import threading

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=prompt, logprob_start_len=3, return_logprob=True, sampling_params=sp)))  # fmt: skip
    base = engine.get_server_info()["forward_ct_decode"]
    t.start()
    while engine.get_server_info()["forward_ct_decode"] < base + 5 and t.is_alive():
        pass
    engine.pause_generation("retract")
    engine.continue_generation()
    t.join(60)
    got = box["out"]["meta_info"]["input_token_logprobs"]
    assert len(got) == len(prompt) - 3 and [t for _, t, _ in got] == prompt[3:]
    np.testing.assert_allclose([lp for lp, _, _ in got[1:]], [lp for lp, _, _ in want["meta_info"]["input_token_logprobs"][1:]],
                               atol=1e-4)  # fmt: skip
    assert box["out"]["output_ids"] == want["output_ids"]
