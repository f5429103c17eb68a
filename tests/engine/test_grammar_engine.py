"""Structured outputs through the engine on the tiny random model, whose free text is gibberish,
so the constraint does all the work: 200 requests over 10 JSON schemas (nested objects, arrays,
enums, bounded numbers, required fields, patterned strings; bounded so that a random model
finishes: maxLength, maxItems, a multipleOf on each float), greedy and seeded, every output
parses and validates; regex and EBNF likewise; the same outputs with overlap off, speculation on,
chunked prefill and retraction under a small KV pool; n > 1 and streaming; pause modes, abort,
flush_cache (the grammar cache empties) and session turns keep matchers with their tokens;
nothing recompiles."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from tests.engine.conftest import SMALL, assert_no_leak, in_background

SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "ok": {"type": "boolean"}},
     "required": ["id", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{2,8}$"},
                                      "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 8}, "last": {"type": "string", "maxLength": 8}},
        "required": ["first", "last"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}, "required": ["user", "score"], "additionalProperties": False},
    {"enum": ["alpha", "beta", "gamma", 42, None]},
    {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                                                "minItems": 2, "maxItems": 3},
                                      "weight": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.5}},
     "required": ["point", "weight"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                                      "kind": {"enum": ["a", "b"]}}, "required": ["date", "kind"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 4},
                                                                  "v": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["k", "v"], "additionalProperties": False}, "maxItems": 2},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 10},
                                      "level": {"type": "integer", "enum": [1, 2, 3]}},
     "required": ["flag", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"tree": {"type": "object", "properties": {"left": {"type": "object", "properties": {
        "leaf": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["leaf"], "additionalProperties": False},
        "right": {"type": "string", "pattern": "^[A-Z][a-z]{0,5}$"}}, "required": ["left", "right"],
        "additionalProperties": False}}, "required": ["tree"], "additionalProperties": False},
]  # fmt: skip
REGEXES = [r"[a-z]{3,8}@[a-z]{2,6}\.(com|org|net)", r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no|maybe)( because [a-z ]{1,20})?"]
EBNF = [
    ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]{1,3} | "(" expr ")"', None),
    ('root ::= "The answer is " ("yes" | "no") "."', r"The answer is (yes|no)\."),
]
MAX_NEW = 160


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 2000, int(k)).tolist() for k in rng.integers(4, 60, n)]


def json_requests(n: int = 200) -> tuple[list[list[int]], list[dict]]:
    """n requests over the 10 schemas, half greedy and half seeded sampling."""
    sps = []
    for i in range(n):
        sp = {"json_schema": json.dumps(SCHEMAS[i % 10]), "max_new_tokens": MAX_NEW}
        sp.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "sampling_seed": 1000 + i})
        sps.append(sp)
    return prompts(n, seed=5), sps


def other_requests() -> tuple[list[list[int]], list[dict]]:
    sps = []
    for i in range(24):
        c = {"regex": REGEXES[i % 3]} if i < 12 else {"ebnf": EBNF[i % 2][0]}
        sps.append({**c, "max_new_tokens": MAX_NEW, **({"temperature": 0} if i % 4 < 2 else {"temperature": 0.9, "sampling_seed": i})})
    return prompts(24, seed=6), sps


def arithmetic(s: str) -> bool:
    """The first EBNF's language: terms of 1-3 digits or parenthesised expressions, joined by +/-."""
    while True:
        t = re.sub(r"\((\d{1,3}([+-]\d{1,3})*)\)", "0", s)
        if t == s:
            return re.fullmatch(r"\d{1,3}([+-]\d{1,3})*", s) is not None
        s = t


@pytest.fixture(scope="module")
def modes_engine(tiny_llama):
    """Every mode the shared engine does not run: overlap off, speculation on, prompts chunked
    in 16-token pieces, a KV pool small enough (and admission bold enough) that requests retract."""
    from ringserve import Engine

    e = Engine(str(tiny_llama), page_size=16, constrained_json_disable_any_whitespace=True, disable_overlap_schedule=True,
               speculative_algorithm="ngram", speculative_num_draft_tokens=3, chunked_prefill_size=16,
               new_token_ratio_init=0.02, new_token_ratio_min=0.01, **{**SMALL, "max_total_tokens": 16 * 32})  # fmt: skip
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference(shared_engine):
    """The shared engine's outputs (overlap on, speculation off, no chunking, a roomy pool)."""
    p, sps = json_requests()
    q, osps = other_requests()
    info = shared_engine.wait_compiled()
    assert info["programs_compiled"] == info["programs_total"] == info["runner_trace_count"]
    outs = shared_engine.generate(input_ids=p + q, sampling_params=sps + osps)
    return outs[:200], outs[200:], info["runner_trace_count"]


def test_200_json_requests_over_10_schemas_all_validate(reference, shared_engine):
    outs, _, traces_before = reference
    for i, o in enumerate(outs):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", (i, o["text"])
        jsonschema.validate(json.loads(o["text"]), SCHEMAS[i % 10])
    assert len({o["text"] for o in outs}) > 100  # the constraint shapes, the model still chooses
    info = shared_engine.get_server_info()
    assert info["runner_trace_count"] == traces_before  # nothing traced: the mask is an input of every program
    assert info["grammar_steps"] > 0 and info["grammar_cache_size"] >= 15


def test_regex_and_ebnf_outputs_match(reference):
    _, outs, _ = reference
    for i, o in enumerate(outs):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", (i, o["text"])
        if i < 12:
            assert re.fullmatch(REGEXES[i % 3], o["text"]), (i, o["text"])
        elif EBNF[i % 2][1] is None:
            assert arithmetic(o["text"]), (i, o["text"])
        else:
            assert re.fullmatch(EBNF[i % 2][1], o["text"]), (i, o["text"])


def test_same_outputs_with_overlap_off_speculation_chunking_and_retract(reference, modes_engine):
    outs, others, _ = reference
    p, sps = json_requests()
    q, osps = other_requests()
    before = modes_engine.get_server_info()
    got = modes_engine.generate(input_ids=p + q, sampling_params=sps + osps)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in outs + others]
    info = modes_engine.get_server_info()
    assert info["num_retracted"] > before["num_retracted"]  # the small pool retracted constrained requests
    assert sum(info["spec_accept_histogram"][1:]) > sum(before["spec_accept_histogram"][1:])  # drafts were accepted
    # prompts were chunked: one chunked request at a time, so a prompt of n tokens is in ceil(n / 16) steps
    chunks = sum(-(-len(x) // 16) - 1 for x in p + q)
    assert info["forward_ct_prefill"] - before["forward_ct_prefill"] >= chunks > len(got)
    assert_no_leak(modes_engine)


def test_n_samples_and_streaming_with_a_constraint(engine):
    sp = {"json_schema": json.dumps(SCHEMAS[2]), "temperature": 8.0, "n": 4, "sampling_seed": 7, "max_new_tokens": MAX_NEW}
    outs = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)
    assert len(outs) == 4 and len({o["text"] for o in outs}) > 1
    for o in outs:
        jsonschema.validate(json.loads(o["text"]), SCHEMAS[2])
    chunks = list(engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp, stream=True))
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert [finals[i]["output_ids"] for i in range(4)] == [o["output_ids"] for o in outs]
    assert len(chunks) > 8  # streamed token by token


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_modes_keep_matchers_with_their_tokens(engine, mode):
    p = prompts(16, seed=8)
    sp = {"json_schema": json.dumps(SCHEMAS[9])}
    want = engine.generate(input_ids=p, sampling_params={**sp, "temperature": 0, "ignore_eos": True, "max_new_tokens": MAX_NEW})
    t, box = in_background(engine, p, MAX_NEW, **sp)
    engine.pause_generation(mode=mode)
    engine.continue_generation()
    t.join(120)
    for o, w in zip(box["out"], want, strict=True):
        if mode == "abort":  # a partial rollout: a prefix of the uninterrupted output
            assert o["output_ids"] == w["output_ids"][: len(o["output_ids"])]
        else:
            assert o["output_ids"] == w["output_ids"]
            jsonschema.validate(json.loads(o["text"]), SCHEMAS[9])
    if mode == "abort":
        assert any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in box["out"])


def test_abort_one_constrained_request_and_flush_empties_the_grammar_cache(engine):
    assert engine.get_server_info()["grammar_cache_size"] > 0
    assert engine.flush_cache()["success"]
    assert engine.get_server_info()["grammar_cache_size"] == 0  # sglang-jax #425
    o = engine.generate(input_ids=[9, 9, 9], sampling_params={"json_schema": json.dumps(SCHEMAS[5]), "temperature": 0})
    jsonschema.validate(json.loads(o["text"]), SCHEMAS[5])
    assert engine.get_server_info()["grammar_cache_size"] == 1


def test_session_turns_each_follow_their_constraint(engine):
    sid = engine.open_session(capacity_of_str_len=4096)
    t1 = engine.generate(input_ids=[11, 12, 13], session_params={"id": sid},
                         sampling_params={"json_schema": json.dumps(SCHEMAS[0]), "temperature": 0})  # fmt: skip
    t2 = engine.generate(input_ids=[14, 15], session_params={"id": sid, "rid": t1["meta_info"]["id"]},
                         sampling_params={"regex": REGEXES[1], "temperature": 0})  # fmt: skip
    jsonschema.validate(json.loads(t1["text"]), SCHEMAS[0])
    assert re.fullmatch(REGEXES[1], t2["text"])
    engine.close_session(sid)
    # the same conversation without a session: identical turns
    r1 = engine.generate(input_ids=[11, 12, 13], sampling_params={"json_schema": json.dumps(SCHEMAS[0]), "temperature": 0})
    r2 = engine.generate(input_ids=[11, 12, 13] + r1["output_ids"] + [14, 15],
                         sampling_params={"regex": REGEXES[1], "temperature": 0})  # fmt: skip
    assert (t1["output_ids"], t2["output_ids"]) == (r1["output_ids"], r2["output_ids"])
