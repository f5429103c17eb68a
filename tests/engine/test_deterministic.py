"""enable_deterministic_inference: a request's tokens AND the bits of its logprobs are the same
whatever else runs: alone or among other requests (other decode and extend buckets), its prefix
cached (computed under another chunk split) or cold, chunked or not, overlap on or off, retracted
and recomputed half-way. Greedy and seeded sampling. The logprobs are compared as floats with ==:
one ulp of difference anywhere in the forward shows there."""

from __future__ import annotations

import threading

import pytest

from tests.engine.conftest import SMALL, assert_no_leak, assert_same_rl_outputs, random_prompts, rl_sampling

DET = dict(SMALL, enable_deterministic_inference=True, chunked_prefill_size=48)
SAMPLING = [
    {"temperature": 0, "ignore_eos": True, "max_new_tokens": 20},
    {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 7, "ignore_eos": True, "max_new_tokens": 20},
]


def signature(outs: list[dict]) -> list[tuple[list[int], list[float]]]:
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def run(engine, prompts, sp) -> list[tuple[list[int], list[float]]]:
    return signature(engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True))


@pytest.fixture(scope="module")
def det_engines(tiny_llama):
    """Two deterministic engines that batch and chunk differently: overlap on, chunks of 48;
    overlap off, chunks of 96."""
    from ringserve import Engine

    a = Engine(str(tiny_llama), page_size=16, **DET)
    b = Engine(
        str(tiny_llama), page_size=16, **{**DET, "chunked_prefill_size": 96, "disable_overlap_schedule": True}
    )
    yield a, b
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("sp", SAMPLING, ids=["greedy", "seeded"])
def test_a_requests_bits_do_not_depend_on_what_else_runs(det_engines, sp):
    a, b = det_engines
    targets = random_prompts(3, seed=71, lo=60, hi=140)  # chunked (> 48 tokens)
    others = random_prompts(13, seed=72, lo=2, hi=120)
    assert a.flush_cache()["success"] and b.flush_cache()["success"]
    alone = [run(a, [t], sp)[0] for t in targets]  # batch of 1, cold
    mixed = run(a, others[:5] + targets + others[5:], sp)[5:8]  # other buckets, other neighbours
    assert mixed == alone
    # a cached prefix computed under a different split: the first 37 tokens, then the whole
    assert a.flush_cache()["success"]
    a.generate(input_ids=[t[:37] for t in targets], sampling_params={"max_new_tokens": 1})
    warm = run(a, targets, sp)
    assert warm == alone
    assert run(b, targets[::-1] + others[:2], sp)[:3] == alone[::-1]  # overlap off, chunks of 96
    assert_no_leak(a)
    assert_no_leak(b)


def test_retract_and_recompute_gives_the_same_bits(det_engines):
    a, _ = det_engines
    prompts = random_prompts(6, seed=73, lo=10, hi=60)
    sp = dict(SAMPLING[1], max_new_tokens=48)
    want = run(a, prompts, sp)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=run(a, prompts, sp)))
    base = a.get_server_info()["forward_ct_decode"]
    t.start()
    while a.get_server_info()["forward_ct_decode"] < base + 10 and t.is_alive():
        pass
    a.pause_generation("retract")
    a.continue_generation()
    t.join(120)
    assert box["out"] == want  # the KV of the generated tokens was recomputed by an extend step
    assert_no_leak(a)


def test_prompt_logprobs_have_the_same_bits_chunked_differently_and_overlap_on_or_off(det_engines):
    """Prompt logprobs (from position 0, top-2, token_ids_logprob) computed in chunks of 48 with
    overlap and of 96 without, in other batches, with a part of the prompt cached: equal as
    floats (==)."""
    a, b = det_engines
    targets = random_prompts(3, seed=74, lo=60, hi=140)
    others = random_prompts(5, seed=75, lo=2, hi=120)
    ask = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2, token_ids_logprob=[3, 4],
               sampling_params=SAMPLING[0])  # fmt: skip

    def prompt_part(outs: list[dict]) -> list:
        return [[o["meta_info"][k] for k in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
                                             "output_token_logprobs")] for o in outs]  # fmt: skip

    alone = [prompt_part([a.generate(input_ids=t, **ask)])[0] for t in targets]
    assert all(len(p[0]) == len(t) for p, t in zip(alone, targets, strict=True))
    a.generate(input_ids=[t[:37] for t in targets], sampling_params={"max_new_tokens": 1})  # cached under another split
    assert prompt_part(a.generate(input_ids=others[:2] + targets, **ask))[2:] == alone
    assert prompt_part(b.generate(input_ids=targets[::-1] + others[2:], **ask))[:3] == alone[::-1]
    assert_no_leak(a)
    assert_no_leak(b)


def test_penalized_biased_and_masked_requests_have_the_same_bits_too(det_engines):
    a, b = det_engines
    targets = random_prompts(2, seed=74, lo=60, hi=140)
    others = random_prompts(6, seed=75, lo=2, hi=120)
    for sp in rl_sampling(a.tokenizer.eos_token_id):
        sp = {**sp, "max_new_tokens": 16}
        alone = [run(a, [t], sp)[0] for t in targets]
        assert run(a, others[:3] + targets + others[3:], sp)[3:5] == alone, sp
    assert_same_rl_outputs(b, a, targets, 16)
    assert_no_leak(a)
    assert_no_leak(b)
