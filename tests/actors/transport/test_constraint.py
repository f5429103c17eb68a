"""Output constraints at the front door (SamplingParams.from_dict): at most one of json_schema,
regex, ebnf, structural_tag; one that does not compile is a ValueError naming the problem; a JSON
schema or structural tag may come as an object; the constraint travels on the wire as text."""

from __future__ import annotations

import json

import llguidance as llg
import msgspec
import pytest

from ringserve.actors.transport.constraint import grammar
from ringserve.actors.transport.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {"structures": [{"begin": "<function=f>", "schema": SCHEMA, "end": "</function>"}], "triggers": ["<function="]}

BAD = [
    ({"json_schema": '{"type": "objectx"}'}, ["json_schema", "Invalid type: objectx"]),
    ({"json_schema": '{"type": '}, ["json_schema is not valid JSON"]),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 3}}, ["Unsatisfiable schema", "minimum (5)"]),
    ({"json_schema": {"$ref": "#/defs/x"}}, ["/defs/x", "does not exist"]),
    ({"json_schema": {"type": "string", "pattern": "[a-z"}}, ["json_schema does not compile", "unclosed character class"]),
    ({"regex": "[a-z"}, ["regex does not compile", "unclosed character class"]),
    ({"regex": "a{3,2}"}, ["regex", "invalid repetition count"]),
    ({"ebnf": 'root ::= "yes'}, ["ebnf", "Unexpected end of input"]),
    ({"ebnf": "root ::= undefined_rule"}, ["ebnf", "Rule 'undefined_rule' not found"]),
    ({"structural_tag": {"structures": [], "triggers": ["<f"]}}, ["structural_tag", "'structures' must be a non-empty list"]),
    ({"structural_tag": {**TAG, "triggers": ["<tool"]}}, ["structural_tag", "starts with none of the triggers"]),
    ({"json_schema": SCHEMA, "regex": "a+"}, ["at most one of", "json_schema", "regex"]),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, ["at most one of", "['regex', 'ebnf']"]),
    ({"regex": ""}, ["regex must be a non-empty string"]),
    ({"regex": 5}, ["regex", "expected str"]),
]


@pytest.mark.parametrize(("sp", "words"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_it(sp, words):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict(sp)
    assert str(e.value).startswith("sampling_params: ")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("sp", [
    {"json_schema": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}, {"json_schema": True}, {"regex": r"\d{3}-[a-z]+"},
    {"ebnf": 'root ::= "yes" | "no"'}, {"ebnf": 'start: "a"+'}, {"structural_tag": TAG},
    {"structural_tag": json.dumps(TAG)}, {"regex": None},
])  # fmt: skip
def test_good_constraints_pass_and_travel_as_text(sp):
    p = SamplingParams.from_dict(sp)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert back == p
    if p.constraint is None:
        assert sp == {"regex": None}
        return
    kind, text = p.constraint
    assert kind == next(iter(sp)) and isinstance(text, str)
    assert llg.LLMatcher.validate_grammar(grammar(kind, text)) == ""


def test_json_schema_given_as_an_object_is_its_json_text():
    assert SamplingParams.from_dict({"json_schema": SCHEMA}).json_schema == json.dumps(SCHEMA)
    assert SamplingParams.from_dict({"json_schema": True}).json_schema == "true"


def test_whitespace_options_shape_the_json_grammar():
    tok = llg.LLTokenizer(_byte_tokenizer())
    strict = llg.LLMatcher(tok, grammar("json_schema", json.dumps(SCHEMA), {"whitespace_flexible": False}))
    loose = llg.LLMatcher(tok, grammar("json_schema", json.dumps(SCHEMA)))
    spaced = list(b'{ "a": 1}')
    assert loose.validate_tokens(spaced) == len(spaced)
    assert strict.validate_tokens(spaced) == 1  # "{" then no whitespace


def _byte_tokenizer() -> str:
    """A tokenizers JSON whose vocabulary is the 256 bytes (GPT-2's byte alphabet) plus an EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bytes_to_unicode = {b: c for b, c in zip(range(256), _gpt2_alphabet(), strict=True)}
    assert set(bytes_to_unicode.values()) == set(alphabet)
    vocab = {bytes_to_unicode[b]: b for b in range(256)} | {"<eos>": 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok.to_str()


def _gpt2_alphabet() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]
