"""generate() input normalisation: shapes, n > 1, and errors that name the field and limit."""

from __future__ import annotations

import pytest

from ringserve.actors.frontend.inputs import GenerateArgs, Limits, normalize_generate


def norm(prompt=None, **kw):
    """normalize_generate of the Engine's keyword arguments (`prompt` is GenerateArgs.text)."""
    seeds = iter(range(7, 1000))
    args = GenerateArgs(text=prompt, **kw)
    return normalize_generate(args, Limits(vocab_size=100, context_length=64, max_top_logprobs_num=5),
                              encode=lambda s: [ord(c) % 100 for c in s], next_seed=lambda: next(seeds))  # fmt: skip


def test_single_and_batched_forms():
    specs, batched = norm(prompt="hi")
    assert not batched and specs[0].input_ids == [4, 5] and specs[0].seed == 7
    specs, batched = norm(
        input_ids=[[1, 2], [3]], sampling_params=[{"max_new_tokens": 2}, {"max_tokens": 3}], rid=["a", "b"]
    )
    assert (
        batched
        and [s.rid for s in specs] == ["a", "b"]
        and [s.sampling.max_new_tokens for s in specs] == [2, 3]
    )


def test_n_expands_with_distinct_seeds_and_rids():
    specs, batched = norm(
        input_ids=[1, 2], sampling_params={"n": 3, "sampling_seed": 10, "temperature": 1.0}, rid="x"
    )
    assert (
        batched
        and [s.rid for s in specs] == ["x-0", "x-1", "x-2"]
        and [s.seed for s in specs] == [10, 11, 12]
    )


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(prompt=""), "input_ids: the prompt is empty"),
        (dict(input_ids=[]), "the prompt is empty"),
        (
            dict(input_ids=[1, 100]),
            "input_ids: token id 100 at position 1 is outside the vocabulary [0, 100)",
        ),
        (dict(input_ids=[[1], [-1]]), "input_ids[1]: token id -1 at position 0 is outside the vocabulary"),
        (dict(input_ids=list(range(64))), "prompt of 64 tokens does not fit the context length 64"),
        (
            dict(input_ids=[1], sampling_params={"max_new_tokens": 64}),
            "max_new_tokens=64 exceeds the limit 63",
        ),
        (
            dict(input_ids=[1], sampling_params={"max_new_tokens": -1}),
            "max_new_tokens=-1 must be an integer >= 0",
        ),
        (dict(input_ids=[1], sampling_params={"top_p": 0}), "top_p=0 must be in (0, 1]"),
        (dict(input_ids=[1], sampling_params={"temperature": -1}), "temperature=-1 must be in [0, 1e4]"),
        (dict(input_ids=[1], sampling_params={"bogus": 1}), "unknown parameter(s) ['bogus']"),
        (dict(input_ids=[1], top_logprobs_num=9), "top_logprobs_num=9 must be in [0, 5]"),
        (dict(input_ids=[[1], [2]], sampling_params=[{}]), "sampling_params: 1 given for 2 prompts"),
        (dict(prompt="a", input_ids=[1]), "exactly one of 'prompt' or 'input_ids'"),
        (dict(input_ids=[[1], [2]], rid=["a", "a"]), "duplicate request ids"),
    ],
)
def test_bad_input_names_field_and_limit(kw, message):
    with pytest.raises(ValueError) as e:
        norm(**kw)
    assert message in str(e.value)


def test_unseeded_prompts_get_distinct_seeds():
    specs, _ = norm(input_ids=[[1, 2], [1, 2]], sampling_params={"temperature": 1.0})
    assert [s.seed for s in specs] == [7, 8]


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(input_ids=[1, 2], rid=123), "rid[0]=123: a request id must be a non-empty string"),
        (dict(input_ids=[[1], [2]], return_logprob=[True]), "1 / 2 given for 2 prompts"),
        (dict(input_ids=[1, 2.5]), "token id 2.5 at position 1 is not an integer"),
        (
            dict(input_ids=[1, 2], sampling_params="greedy"),
            "sampling_params: expected a dict of parameters, got str",
        ),
        (
            dict(input_ids=[1, 2], sampling_params={"top_k": -5}),
            "top_k=-5 must be -1 (off) or in [1, 2**31)",
        ),
        (
            dict(input_ids=[1, 2], sampling_params={"temperature": float("inf")}),
            "temperature=inf must be in [0, 1e4]",
        ),
    ],
)
def test_more_bad_inputs_name_the_field(kw, msg):
    with pytest.raises(ValueError) as e:
        norm(**kw)
    assert msg in str(e.value)


def test_numpy_token_ids_are_accepted():
    import numpy as np

    specs, _ = norm(input_ids=[np.int64(3), np.int32(4)])
    assert specs[0].input_ids == [3, 4] and type(specs[0].input_ids[0]) is int


def session_norm(sessions, **kw):
    args = GenerateArgs(**kw)
    return normalize_generate(args, Limits(vocab_size=100, context_length=64, max_top_logprobs_num=5),
                              encode=lambda s: [1] + [ord(c) % 100 for c in s], next_seed=lambda: 7,
                              sessions=sessions, bos_token_id=1)  # fmt: skip


def test_a_session_turn_is_put_behind_its_earlier_turn():
    from ringserve.actors.frontend.sessions import Sessions

    sessions = Sessions()
    sid = sessions.open_session()
    (first,), _ = session_norm(sessions, input_ids=[1, 5, 6], rid="t1", session_params={"id": sid})
    assert first.input_ids == [1, 5, 6] and first.session is not None and first.session.parent is None
    sessions.begin(first.session, "t1", first.input_ids)
    sessions.finished(sid, "t1", [40, 41])
    # text: encoded once, its BOS dropped behind the earlier turn; input + output + new tokens
    specs, batched = session_norm(sessions, text=["hi"], session_params=[{"id": sid, "rid": "t1"}])
    assert batched and specs[0].input_ids == [1, 5, 6, 40, 41, 4, 5]
    assert specs[0].session is not None and specs[0].session.parent is sessions.open[sid].turns["t1"]
    (cut,), _ = session_norm(sessions, input_ids=[9], session_params={"id": sid, "rid": "t1", "offset": 2})
    assert cut.input_ids == [1, 5, 9]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(input_ids=[5], session_params={"id": "nope"}), "session id 'nope' does not exist"),
        (dict(input_ids=[[5], [6]], session_params=[{"id": "S"}]), "session_params: 1 given for 2 prompts"),
        (dict(input_ids=[5], session_params={"id": "S"}, sampling_params={"n": 2}), "n > 1 samples cannot share"),
        (dict(input_ids=[5, 100], session_params={"id": "S"}), "token id 100 at position 1 is outside the vocabulary"),
    ],
)
def test_bad_session_turns_name_the_field(kw, message):
    from ringserve.actors.frontend.sessions import Sessions

    sessions = Sessions()
    sessions.open_session(session_id="S")
    with pytest.raises(ValueError) as e:
        session_norm(sessions, **kw)
    assert message in str(e.value)


def test_routed_experts_are_checked():
    """return_routed_experts (SGLang's routing replay) needs the server flag; its start position
    routed_experts_start_len is a prompt position, one per prompt or one for all."""
    seeds = iter(range(7, 1000))
    on = Limits(vocab_size=100, context_length=64, max_top_logprobs_num=5, routed_experts=True)

    def with_limits(limits: Limits, **kw):
        return normalize_generate(GenerateArgs(**kw), limits, encode=lambda s: [1], next_seed=lambda: next(seeds))

    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        norm(input_ids=[1, 2, 3], return_routed_experts=True)
    specs, _ = with_limits(on, input_ids=[[1, 2, 3], [4, 5]], return_routed_experts=[True, False],
                           routed_experts_start_len=[2, 0])  # fmt: skip
    assert [(s.return_routed_experts, s.routed_experts_start_len) for s in specs] == [(True, 2), (False, 0)]
    with pytest.raises(ValueError, match=r"routed_experts_start_len\[1\]=3: past the prompt's 2 tokens"):
        with_limits(on, input_ids=[[1, 2, 3], [4, 5]], return_routed_experts=True, routed_experts_start_len=[0, 3])
    for bad in (-1, True, "2", [0]):
        with pytest.raises(ValueError, match="routed_experts_start_len: a position >= 0"):
            with_limits(on, input_ids=[[1, 2, 3], [4, 5]], return_routed_experts=True, routed_experts_start_len=bad)
    with pytest.raises(ValueError, match="return_routed_experts: a boolean"):
        with_limits(on, input_ids=[1, 2], return_routed_experts=1)
