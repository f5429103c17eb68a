"""Engine API behaviour on the tiny model: prefix cache, bad input, logprobs, stop strings,
pause / continue / abort / flush_cache (seed 000's plan), all through the real processes."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.engine.conftest import in_background, random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True}


def test_prefix_cache_hit_gives_identical_output(engine):
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 2000, 200).tolist()
    a, b = prefix + [11, 12, 13], prefix + [21, 22]
    sp = {**GREEDY, "max_new_tokens": 8}
    assert engine.flush_cache()["success"]
    first = engine.generate(input_ids=a, sampling_params=sp)
    assert first["meta_info"]["cached_tokens"] == 0
    warm = engine.generate(input_ids=b, sampling_params=sp)
    assert warm["meta_info"]["cached_tokens"] >= 192
    assert engine.flush_cache()["success"]
    cold = engine.generate(input_ids=b, sampling_params=sp)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["output_ids"] == cold["output_ids"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(prompt=""), ["prompt", "empty"]),
        (dict(input_ids=[]), ["input_ids", "empty"]),
        (dict(input_ids=[5, 10**6]), ["input_ids", "1000000", "vocabulary"]),
        (dict(input_ids=[-1, 5]), ["input_ids", "-1", "vocabulary"]),
        (dict(input_ids=list(range(3, 300))), ["297 tokens", "context length 256"]),
        (dict(prompt="hi", sampling_params={"max_new_tokens": -1}), ["max_new_tokens", ">= 0"]),
        (dict(prompt="hi", sampling_params={"max_new_tokens": 10_000}), ["max_new_tokens", "limit"]),
        (dict(prompt="hi", sampling_params={"top_p": 0}), ["top_p", "(0, 1]"]),
        (dict(prompt="hi", sampling_params={"top_p": 1.5}), ["top_p", "(0, 1]"]),
        (dict(prompt="hi", sampling_params={"temperature": -0.5}), ["temperature=-0.5", "[0, 1e4]"]),
        (dict(prompt="hi", sampling_params={"beam_width": 4}), ["unknown", "beam_width"]),
        (dict(prompt="hi", top_logprobs_num=99), ["top_logprobs_num", "5"]),
    ],
)
def test_bad_input_names_field_and_limit_and_engine_keeps_serving(engine, kwargs, words):
    # a long request is running while the bad one arrives; it must finish untouched
    want = engine.generate(input_ids=[7, 8, 9], sampling_params={**GREEDY, "max_new_tokens": 24})
    stream = engine.generate(
        input_ids=[7, 8, 9], sampling_params={**GREEDY, "max_new_tokens": 24}, stream=True
    )
    first = next(stream)
    with pytest.raises(ValueError) as err:
        engine.generate(**kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    *_, last = [first, *stream]  # (on a busy machine the first chunk may already be the whole answer)
    assert last["output_ids"] == want["output_ids"]


def test_empty_prompt_message(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate(input_ids=[])


def test_logprobs_and_top_logprobs(engine):
    out = engine.generate(
        input_ids=[5, 6, 7],
        sampling_params={**GREEDY, "max_new_tokens": 5},
        return_logprob=True,
        top_logprobs_num=3,
    )
    lps = out["meta_info"]["output_token_logprobs"]
    tops = out["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert len(tops) == 5 and all(len(t) == 3 for t in tops)
    for (lp, tid, _), top in zip(lps, tops, strict=True):
        assert (
            lp <= 0 and top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-5)
        )  # greedy = the argmax
        assert top[0][0] >= top[1][0] >= top[2][0]


def test_stop_string_is_trimmed_unless_no_stop_trim(engine):
    base = engine.generate(input_ids=[9, 10, 11], sampling_params={**GREEDY, "max_new_tokens": 20})
    text = base["text"]
    assert len(text) > 12, text
    stop = text[6:9]
    cut = engine.generate(
        input_ids=[9, 10, 11], sampling_params={**GREEDY, "max_new_tokens": 20, "stop": stop}
    )
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.index(stop)]
    kept = engine.generate(
        input_ids=[9, 10, 11],
        sampling_params={**GREEDY, "max_new_tokens": 20, "stop": stop, "no_stop_trim": True},
    )
    assert kept["text"].startswith(text[: text.index(stop)] + stop)


def test_seeded_sampling_is_reproducible_and_n_samples(engine):
    sp = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 1234, "ignore_eos": True}
    a = engine.generate(input_ids=[5, 6], sampling_params=sp)
    b = engine.generate(input_ids=[[5, 6], [40, 41, 42]], sampling_params=sp)[0]
    assert a["output_ids"] == b["output_ids"]
    many = engine.generate(input_ids=[5, 6], sampling_params={**sp, "n": 3})
    assert len(many) == 3 and many[0]["output_ids"] == a["output_ids"]


def test_abort_one_request(engine):
    t, box = in_background(engine, random_prompts(2, seed=8, lo=5, hi=10), 200)
    rid = engine.get_server_info()["running_rids"][0]
    engine.abort_request(rid)
    t.join(60)
    reasons = sorted(o["meta_info"]["finish_reason"]["type"] for o in box["out"])
    assert reasons == ["abort", "length"]


def test_leaving_a_stream_early_aborts_its_request(engine):
    stream = engine.generate(
        input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 200}, stream=True
    )
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    stream.close()  # the caller walks away (break / garbage collection)
    deadline = time.monotonic() + 10
    while engine.get_server_info()["running_batch_size"]:
        assert time.monotonic() < deadline, "an abandoned stream kept generating"
        time.sleep(0.01)


def test_max_new_tokens_zero_prefills_only(engine):
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 0})
    assert (
        out["output_ids"] == []
        and out["text"] == ""
        and out["meta_info"]["finish_reason"] == {"type": "length"}
    )


def test_unseeded_equal_prompts_sample_differently(engine):
    outs = engine.generate(
        input_ids=[[5, 6, 7]] * 4,
        sampling_params={"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True},
    )
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_only_the_runner_maps_jax_and_ml_dtypes(engine):
    """The scheduler and detokenizer processes never load JAX or ml_dtypes (NumPy's bfloat16,
    0.45 s of CPU to import: a warm start's CPU on this 2-core VM went 6.0 -> 4.4 s when they
    and the frontend stopped loading it just to read safetensors headers and check LoRA names)."""
    pids = engine.supervisor.pids()
    assert any(n.startswith("runner") for n in pids) and len(pids) >= 3, pids
    for name, pid in pids.items():
        maps = open(f"/proc/{pid}/maps").read()
        loaded = {"jax": "/jaxlib/" in maps, "ml_dtypes": "/ml_dtypes/" in maps}
        assert loaded == ({"jax": True, "ml_dtypes": True} if name.startswith("runner") else {"jax": False, "ml_dtypes": False}), (name, loaded)
