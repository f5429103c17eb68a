"""Structured outputs on every surface of the shared tiny engine: the Engine, the IPC client and
SGLang's /generate take json_schema / regex / ebnf / structural_tag in sampling_params and
return the Engine's very tokens; the OpenAI routes take response_format (json_object,
json_schema with strict) and SGLang's regex / ebnf extras, through the real `openai` package,
streaming and n > 1 included; a constraint that does not compile, or two at once, is a
ValueError / 400 naming the problem, and the engine goes on serving."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                                           "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}  # fmt: skip
GREEDY = {"temperature": 0, "max_new_tokens": 96}
PROMPT = [11, 12, 13, 14]


def test_every_surface_returns_the_engines_constrained_tokens(engine, client, servers):
    for sp in ({"json_schema": json.dumps(SCHEMA)}, {"regex": r"[A-Z][a-z]{2,9}, [A-Z]{2}"}, {"ebnf": 'root ::= "x" [0-9]{2}'},
               {"structural_tag": json.dumps({"structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}],
                                              "triggers": ["<f="]}), "max_new_tokens": 24}):  # fmt: skip
        sp = {**GREEDY, **sp}
        want = engine.generate(input_ids=PROMPT, sampling_params=sp)
        assert client.generate(input_ids=PROMPT, sampling_params=sp)["output_ids"] == want["output_ids"]
        r = httpx.post(servers.url + "/generate", json={"input_ids": PROMPT, "sampling_params": sp})
        assert r.status_code == 200 and r.json()["output_ids"] == want["output_ids"]
        if "json_schema" in sp:
            jsonschema.validate(json.loads(want["text"]), SCHEMA)
        elif "regex" in sp:
            assert re.fullmatch(sp["regex"], want["text"])
        elif "ebnf" in sp:
            assert re.fullmatch("x[0-9]{2}", want["text"])
        else:  # free text until the trigger, then the structure's begin (the output may stop at max_new_tokens)
            rest = want["text"].partition("<f=")[2]
            assert rest.startswith("a>") or "a>".startswith(rest)
    # an object works as the schema too (the clients send it as it is)
    as_obj = client.generate(input_ids=PROMPT, sampling_params={**GREEDY, "json_schema": SCHEMA})
    assert as_obj["output_ids"] == engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "json_schema": json.dumps(SCHEMA)})["output_ids"]


BAD = [
    ({"json_schema": '{"type": "objectx"}'}, "Invalid type: objectx"),
    ({"regex": "[a-z"}, "unclosed character class"),
    ({"ebnf": 'root ::= "yes'}, "Unexpected end of input"),
    ({"json_schema": json.dumps(SCHEMA), "regex": "a+"}, "at most one of"),
]


@pytest.mark.parametrize(("sp", "words"), BAD, ids=["schema", "regex", "ebnf", "two"])
def test_a_bad_constraint_is_refused_on_every_surface(engine, client, servers, sp, words):
    with pytest.raises(ValueError, match=re.escape(words)) as theirs:
        engine.generate(input_ids=PROMPT, sampling_params=sp)
    with pytest.raises(ValueError) as mine:
        client.generate(input_ids=PROMPT, sampling_params=sp)
    assert str(mine.value) == str(theirs.value)
    r = httpx.post(servers.url + "/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    assert r.status_code == 400 and words in r.json()["error"]["message"]
    assert engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 2})["output_ids"]


def test_openai_response_format_on_chat_and_completions(engine, servers):
    import openai

    c = openai.OpenAI(base_url=servers.url + "/v1", api_key="unused", max_retries=0)
    model = engine.served_model_name
    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=96, temperature=0, response_format=rf)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    prompt = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    want = engine.generate(input_ids=engine.tokenizer.encode(prompt, add_special_tokens=False),
                           sampling_params={**GREEDY, "json_schema": json.dumps(SCHEMA)})  # fmt: skip
    assert r.choices[0].message.content == want["text"]
    # streamed, the deltas join into the same JSON
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=model, messages=msgs, max_tokens=96, temperature=0, response_format=rf, stream=True) if ch.choices]  # fmt: skip
    assert "".join(parts) == want["text"]
    # n > 1 samples, each valid
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=96, temperature=8.0, n=3, seed=4, response_format=rf)
    assert len(r.choices) == 3 and len({ch.message.content for ch in r.choices}) > 1
    for ch in r.choices:
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    # json_object: any JSON object (unbounded: the random model may run out of tokens inside it)
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, response_format={"type": "json_object"})
    obj = engine.generate(input_ids=engine.tokenizer.encode(prompt, add_special_tokens=False),
                          sampling_params={"temperature": 0, "max_new_tokens": 24, "json_schema": '{"type": "object"}'})  # fmt: skip
    assert r.choices[0].message.content == obj["text"] and obj["text"].startswith("{")
    # completions take response_format as well, and SGLang's regex extra
    r = c.completions.create(model=model, prompt="City:", max_tokens=96, temperature=0, extra_body={"response_format": rf})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = c.completions.create(model=model, prompt="Code:", max_tokens=16, temperature=0, extra_body={"regex": "[A-Z]{3}-[0-9]{4}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", r.choices[0].text)
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0, response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"  # plain text: unconstrained


@pytest.mark.parametrize(("body", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "Invalid type: objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type='yaml'"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "at most one of"),
    ({"ebnf": "root ::= nothing_here"}, "Rule 'nothing_here' not found"),
])  # fmt: skip
def test_openai_bad_response_format_is_a_400(engine, servers, body, words):
    for path, extra in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(servers.url + path, json={"model": engine.served_model_name, "max_tokens": 4, **extra, **body})
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"] and r.json()["error"]["type"] == "BadRequestError"
