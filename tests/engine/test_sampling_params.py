"""The sampling parameters RL frameworks send, implemented: each penalty equal to HF's logits
processor (repetition) or to a reference of SGLang's and vLLM's semantics (frequency, presence)
over HF's logits, greedy and seeded; min_new_tokens never ends early; logit_bias; the sampling
mask equal to the set top-p keeps; logprobs raw or processed; hidden states equal to HF's."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.engine.conftest import assert_no_leak, engine_ctx, random_prompts
from tests.hf_ref import hf_greedy, hf_logits, hf_repetition_greedy, reference_decode

MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def engine(shared_engine):
    yield shared_engine
    assert_no_leak(shared_engine)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=67, lo=4, hi=24)


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_equals_hfs_processor(engine, tiny_llama, prompts, penalty):
    want = hf_repetition_greedy(tiny_llama, prompts, MAX_NEW, penalty)
    assert want != hf_greedy(tiny_llama, prompts, MAX_NEW), (
        "the penalty was meant to change some continuation"
    )
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "repetition_penalty": penalty})
    assert _ids(outs) == want


def test_frequency_and_presence_equal_the_reference_and_leave_their_neighbours_alone(
    engine, tiny_llama, prompts
):
    cases = [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"frequency_penalty": -0.5, "presence_penalty": 1.0},
             {"repetition_penalty": 1.2, "frequency_penalty": 0.8, "presence_penalty": 0.4}]  # fmt: skip
    ps = [p for p in prompts[:2] for _ in cases] + prompts[2:]
    sps = [{**GREEDY, **c} for _ in prompts[:2] for c in cases] + [GREEDY] * len(prompts[2:])
    outs = engine.generate(input_ids=ps, sampling_params=sps)  # penalized and plain rows in one batch
    for o, p, sp in zip(outs, ps, sps, strict=True):
        want = reference_decode(tiny_llama, p, MAX_NEW, repetition=sp.get("repetition_penalty", 1.0),
                                frequency=sp.get("frequency_penalty", 0.0), presence=sp.get("presence_penalty", 0.0))  # fmt: skip
        assert o["output_ids"] == want, sp
    plain = hf_greedy(tiny_llama, prompts[2:], MAX_NEW)
    assert _ids(outs[-len(plain) :]) == plain
    assert any(
        o["output_ids"] != hf_greedy(tiny_llama, [p], MAX_NEW)[0] for o, p in zip(outs, ps, strict=True)
    )


def test_seeded_penalized_draws_equal_the_reference(engine, tiny_llama, prompts):
    sp = {"max_new_tokens": MAX_NEW, "temperature": 0.8, "ignore_eos": True, "repetition_penalty": 1.2,
          "frequency_penalty": 0.5, "presence_penalty": 0.3}  # fmt: skip
    outs = engine.generate(
        input_ids=prompts, sampling_params=[{**sp, "sampling_seed": 1000 + i} for i in range(len(prompts))]
    )
    for i, (o, p) in enumerate(zip(outs, prompts, strict=True)):
        want = reference_decode(tiny_llama, p, MAX_NEW, repetition=1.2, frequency=0.5, presence=0.3, temperature=0.8,
                                seed=1000 + i)  # fmt: skip
        assert o["output_ids"] == want


def test_min_new_tokens_never_ends_early(engine, tiny_llama, prompts):
    p = prompts[0]
    free = hf_greedy(tiny_llama, [p], MAX_NEW)[0]
    stop = free[2]  # the third token would end it
    short = engine.generate(input_ids=p, sampling_params={**GREEDY, "stop_token_ids": [stop]})
    assert (
        short["output_ids"] == free[: free.index(stop) + 1]
        and short["meta_info"]["finish_reason"]["type"] == "stop"
    )
    for min_new in (6, MAX_NEW):
        out = engine.generate(
            input_ids=p, sampling_params={**GREEDY, "stop_token_ids": [stop], "min_new_tokens": min_new}
        )
        ids = out["output_ids"]
        assert len(ids) >= min_new and stop not in ids[:min_new]
        assert ids == reference_decode(
            tiny_llama, p, MAX_NEW, min_new=min_new, held_back=(stop,), stop=(stop,)
        )
    # vLLM's name, min_tokens, and the EOS id (held back unless ignore_eos)
    eos = engine.tokenizer.eos_token_id
    out = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 8, "temperature": 0, "min_tokens": 8,
                                                        "logit_bias": {str(eos): 50.0}})  # fmt: skip
    assert len(out["output_ids"]) == 8 and eos not in out["output_ids"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_logit_bias(engine, tiny_llama, prompts):
    p = prompts[1]
    out = engine.generate(input_ids=p, sampling_params={**GREEDY, "logit_bias": {"7": 100}})
    assert out["output_ids"] == [7] * MAX_NEW
    first = hf_greedy(tiny_llama, [p], 1)[0][0]
    bias = {first: -100.0, 33: 3.0}
    out = engine.generate(
        input_ids=p, sampling_params={**GREEDY, "logit_bias": {str(k): v for k, v in bias.items()}}
    )
    assert out["output_ids"] == reference_decode(tiny_llama, p, MAX_NEW, bias=bias)
    assert out["output_ids"][0] != first
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate(input_ids=p, sampling_params={"logit_bias": {"7": 101}})
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate(input_ids=p, sampling_params={"logit_bias": {"x": 1}})


def _decode_i32(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), "<i4")


def _top_p_set(logits: np.ndarray, temperature: float, top_p: float) -> set[int]:
    """The smallest prefix of the descending order (ties: lower id first) whose mass reaches top_p."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.lexsort((np.arange(len(p)), -p))
    c = int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)
    return set(order[:c].tolist())


def test_the_sampling_mask_is_the_set_top_p_keeps(engine, tiny_llama, prompts):
    p = prompts[2]
    sp = {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.8, "sampling_seed": 7, "ignore_eos": True,
          "custom_params": {"return_top_p_token_ids": True, "some_other_processor_arg": 1}}  # fmt: skip
    out = engine.generate(input_ids=p, sampling_params=sp)
    meta, ids = out["meta_info"], out["output_ids"]
    kept, offsets = _decode_i32(meta["top_p_token_ids"]), _decode_i32(meta["top_p_token_offsets"])
    assert len(offsets) == len(ids) + 1 and offsets[0] == 0 and offsets[-1] == len(kept)  # slime's checks
    for i, t in enumerate(ids):
        got = set(kept[offsets[i] : offsets[i + 1]].tolist())
        assert t in got
        assert got == _top_p_set(hf_logits(tiny_llama, p + ids[:i])[-1], 0.9, 0.8), i
    assert len(kept) > len(ids), "the random model's top-p sets were meant to hold more than one token"
    # the same tokens without asking (the mask changes nothing drawn); top_k bounds the set
    plain = engine.generate(
        input_ids=p, sampling_params={k: v for k, v in sp.items() if k != "custom_params"}
    )
    assert plain["output_ids"] == ids and "top_p_token_ids" not in plain["meta_info"]
    out = engine.generate(input_ids=p, sampling_params={**sp, "top_p": 1.0, "top_k": 3})
    offsets = _decode_i32(out["meta_info"]["top_p_token_offsets"])
    assert (np.diff(offsets) == 3).all()
    # a greedy row's set is its token
    out = engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 4,
                                                        "custom_params": {"return_top_p_token_ids": True}})  # fmt: skip
    assert _decode_i32(out["meta_info"]["top_p_token_ids"]).tolist() == out["output_ids"]
    with pytest.raises(ValueError, match="return_top_p_token_ids"):
        engine.generate(
            input_ids=p,
            sampling_params={"temperature": 1.0, "custom_params": {"return_top_p_token_ids": True}},
        )


def test_bad_penalties_are_refused_naming_the_field(engine, prompts):
    for sp, field in [({"frequency_penalty": 3}, "frequency_penalty"), ({"presence_penalty": -2.5}, "presence_penalty"),
                      ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_new_tokens": -1}, "min_new_tokens"),
                      ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
                      ({"stop_token_ids": list(range(17))}, "stop_token_ids")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            engine.generate(input_ids=prompts[0], sampling_params=sp)
    # the neutral values, and None for each (as clients send), are accepted
    out = engine.generate(input_ids=prompts[0], sampling_params={**GREEDY, "frequency_penalty": None, "presence_penalty": 0,
                                                                 "repetition_penalty": 1.0, "min_new_tokens": None,
                                                                 "logit_bias": None, "top_k": 1e8})  # fmt: skip
    assert len(out["output_ids"]) == MAX_NEW


# ---- a server with processed logprobs and hidden states ------------------------------------------
@pytest.fixture(scope="module")
def processed(tiny_llama):
    with engine_ctx(tiny_llama, logprobs_mode="processed_logprobs", enable_return_hidden_states=True) as e:
        yield e


def test_processed_logprobs_are_of_the_distribution_drawn_from(processed, engine, tiny_llama, prompts):
    p = prompts[3]
    sp = {"max_new_tokens": 6, "temperature": 0.7, "top_k": 5, "sampling_seed": 3, "ignore_eos": True,
          "repetition_penalty": 1.3}  # fmt: skip
    got = processed.generate(input_ids=p, sampling_params=sp, return_logprob=True, top_logprobs_num=3)
    raw = engine.generate(input_ids=p, sampling_params=sp, return_logprob=True, top_logprobs_num=3)
    assert got["output_ids"] == raw["output_ids"]  # the same draws; only what the logprobs are of differs
    ids = got["output_ids"]
    for i, t in enumerate(ids):
        x = hf_logits(tiny_llama, p + ids[:i])[-1].astype(np.float64)
        lp_raw = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert raw["meta_info"]["output_token_logprobs"][i][0] == pytest.approx(lp_raw[t], abs=1e-4)
        seen = set(
            p + ids[:i]
        )  # repetition penalty (HF's rule), then temperature, then top-k's 5, renormalised
        y = np.array([(v / 1.3 if v > 0 else v * 1.3) if j in seen else v for j, v in enumerate(x)]) / 0.7
        top = np.argsort(-y, kind="stable")[:5]
        z = y[top] - y[top].max()
        lp = dict(zip(top.tolist(), (z - np.log(np.exp(z).sum())).tolist(), strict=True))
        assert got["meta_info"]["output_token_logprobs"][i][0] == pytest.approx(lp[t], abs=1e-4)
        tops = got["meta_info"]["output_top_logprobs"][i]
        assert [e[1] for e in tops] == top[:3].tolist()
        assert sum(np.exp(list(lp.values()))) == pytest.approx(1.0, abs=1e-5)


def test_hidden_states_equal_hfs_last_layer(processed, tiny_llama, prompts):
    import torch

    from tests.hf_ref import hf_model

    p = prompts[0]
    out = processed.generate(
        input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 5}, return_hidden_states=True
    )
    hs = out["meta_info"]["hidden_states"]
    assert len(hs) == 1 + 4 and len(hs[0]) == len(
        p
    )  # the prompt's positions, then each output's but the last
    got = np.array(hs[0] + hs[1:], np.float32)
    with torch.no_grad():
        want = hf_model(str(tiny_llama))(
            torch.tensor([p + out["output_ids"][:-1]]), output_hidden_states=True
        )
    np.testing.assert_allclose(got, want.hidden_states[-1][0].numpy(), atol=2e-4, rtol=1e-4)
    # a prompt the prefix cache holds is computed again for them; the others are not held up
    again = processed.generate(input_ids=[p, p], sampling_params={**GREEDY, "max_new_tokens": 5},
                               return_hidden_states=[True, False])  # fmt: skip
    np.testing.assert_allclose(
        np.array(again[0]["meta_info"]["hidden_states"][0], np.float32), got[: len(p)], atol=1e-5
    )
    assert "hidden_states" not in again[1]["meta_info"] and again[1]["output_ids"] == out["output_ids"]


def test_hidden_states_need_the_server_flag(engine, prompts):
    with pytest.raises(ValueError, match="enable_return_hidden_states"):
        engine.generate(input_ids=prompts[0], sampling_params=GREEDY, return_hidden_states=True)


def test_penalties_and_min_new_tokens_under_a_grammar(engine, prompts):
    """The grammar's mask comes first: a penalized, biased, min_new_tokens request still parses as
    its schema says, and its grammar's end ends it (EOS is all the grammar allows then)."""
    import json

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    base = {"json_schema": schema, "max_new_tokens": 64, "temperature": 0}
    plain = engine.generate(input_ids=prompts[0], sampling_params=base)
    for extra in ({"repetition_penalty": 1.6, "frequency_penalty": 1.0}, {"min_new_tokens": 60},
                  {"logit_bias": {"7": 5.0}, "presence_penalty": 2.0}):  # fmt: skip
        out = engine.generate(input_ids=prompts[0], sampling_params={**base, **extra})
        assert set(json.loads(out["text"])) == {"a", "b"}, (extra, out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop", extra
    assert set(json.loads(plain["text"])) == {"a", "b"}
