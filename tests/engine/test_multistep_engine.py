"""Multi-step decode (`decode_steps`) through the engine: a decode batch of at most
decode_steps_max_batch requests, nothing waiting, runs k steps on the device per scheduled batch.
Greedy and seeded outputs, logprobs and finish reasons equal one-step decoding token for token,
with overlap on and off, with lengths and stops that end inside a run, past the batch limit, and
across pause / abort; the KV books close after every test."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import (
    assert_no_leak,
    assert_same_rl_outputs,
    engine_ctx,
    in_background,
    random_prompts,
)

K = 4
MULTI = dict(decode_steps=K, decode_steps_max_batch=4)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def multi_engine(tiny_llama):
    from ringserve import Engine
    from ringserve.model.compute.kernels import cpu_attention
    from tests.engine.conftest import SMALL

    if (why := cpu_attention.reason()) is not None:
        pytest.skip(f"the C++ attention kernel: {why}")
    e = Engine(str(tiny_llama), page_size=16, **SMALL, **MULTI)
    yield e
    e.shutdown()


@pytest.fixture
def multi(multi_engine):
    yield multi_engine
    multi_engine.continue_generation()
    assert_no_leak(multi_engine)


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_one_request_at_a_time_equals_one_step_decoding_in_fewer_batches(multi, shared_engine):
    prompts = random_prompts(6, seed=21, lo=2, hi=40)
    lens = [1, 2, 3, 5, 17, 42]  # shorter than a run, and every residue mod K
    for p, n in zip(prompts, lens, strict=True):
        sp = {**GREEDY, "max_new_tokens": n}
        want = shared_engine.generate(input_ids=p, sampling_params=sp)
        before = multi.get_server_info()["forward_ct_decode"]
        got = multi.generate(input_ids=p, sampling_params=sp)
        assert got["output_ids"] == want["output_ids"], n
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        decodes = multi.get_server_info()["forward_ct_decode"] - before
        if n >= 17:  # runs of K tokens: about a quarter of the one-step batches (+ the tail's)
            assert decodes <= n // K + K, (n, decodes)


def test_batches_over_the_limit_and_seeded_sampling_with_logprobs(multi, shared_engine):
    prompts = random_prompts(7, seed=22, lo=2, hi=60)
    lens = np.random.default_rng(5).integers(9, 40, 7).tolist()
    greedy = [{**GREEDY, "max_new_tokens": k} for k in lens]
    assert _ids(multi.generate(input_ids=prompts, sampling_params=greedy)) == _ids(
        shared_engine.generate(input_ids=prompts, sampling_params=greedy)
    )  # 7 requests run one step at a time until at most 4 are left
    seeded = [{"temperature": 0.8, "top_k": 50, "top_p": 0.9, "sampling_seed": 7 + i, "ignore_eos": True,
               "max_new_tokens": 23} for i in range(3)]  # fmt: skip
    want = shared_engine.generate(input_ids=prompts[:3], sampling_params=seeded, return_logprob=True, top_logprobs_num=2)
    got = multi.generate(input_ids=prompts[:3], sampling_params=seeded, return_logprob=True, top_logprobs_num=2)
    assert _ids(got) == _ids(want)
    for g, w in zip(got, want, strict=True):
        gl = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
        wl = [x[0] for x in w["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(gl, wl, rtol=1e-4, atol=1e-4)
        gt = [[t[1] for t in row] for row in g["meta_info"]["output_top_logprobs"]]
        assert gt == [[t[1] for t in row] for row in w["meta_info"]["output_top_logprobs"]]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_stop_inside_a_run_drops_the_rest_and_frees_its_kv(tiny_llama, shared_engine, overlap):
    """A stop token met inside a run finishes there (the run's later tokens dropped), as it does
    one step at a time; the run's KV past the finish is given back."""
    prompts = random_prompts(3, seed=23, lo=2, hi=30)
    ref = shared_engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 30})
    sps = [{"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [o["output_ids"][j]]}
           for o, j in zip(ref, (5, 9, 14), strict=True)]  # fmt: skip
    want = shared_engine.generate(input_ids=prompts, sampling_params=sps)
    assert all(w["meta_info"]["finish_reason"]["type"] == "stop" for w in want)
    with engine_ctx(tiny_llama, page_size=16, disable_overlap_schedule=not overlap, **MULTI) as e:
        got = e.generate(input_ids=prompts, sampling_params=sps)
        assert _ids(got) == _ids(want)
        assert [g["meta_info"]["finish_reason"] for g in got] == [w["meta_info"]["finish_reason"] for w in want]
        streamed = list(e.generate(input_ids=prompts[0], sampling_params={**GREEDY, "max_new_tokens": 21}, stream=True))
        assert streamed[-1]["output_ids"] == ref[0]["output_ids"][:21]
        assert len(streamed) < 21  # tokens came K at a time


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_pause_modes_mid_run(multi, shared_engine, mode):
    prompts = random_prompts(3, seed=24, lo=2, hi=40)
    want = _ids(shared_engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 60}))
    t, box = in_background(multi, prompts, 60)
    multi.pause_generation(mode=mode)
    multi.continue_generation()
    t.join(120)
    assert "err" not in box, box.get("err")
    outs = box["out"]
    if mode == "abort":
        for o, w in zip(outs, want, strict=True):
            assert o["output_ids"] == w[: len(o["output_ids"])]
    else:
        assert _ids(outs) == want


def test_penalties_min_new_tokens_bias_and_sampling_masks_equal_one_step_decoding(multi, shared_engine):
    """Each decode step of a run counts its token before the next one samples."""
    assert_same_rl_outputs(multi, shared_engine, random_prompts(1, seed=67, lo=3, hi=30), 20)  # 4 rows: multi-step
