"""A request's output constraint as an llguidance grammar: SGLang's sampling parameters
`json_schema`, `regex`, `ebnf` and `structural_tag` (at most one per request).

Both sides of the scheduler's ring use it: the frontend checks a constraint once
(`SamplingParams.validate` calls `check`, so a schema, regex or grammar that does not compile is
a ValueError naming the problem before the request is sent), and the scheduler compiles it into
matchers (actors/scheduler/grammar.py). llguidance checks a grammar without the tokenizer; the
little only the vocabulary can refuse fails the request at the scheduler (finish reason abort).

    kind            text                                          llguidance
    json_schema     a JSON schema (JSON text)                     grammar_from_json_schema
    regex           a regular expression (Rust regex syntax)      grammar_from_regex
    ebnf            GBNF (`root ::= ...`) or Lark (`start: ...`)  grammar_from("ebnf")
    structural_tag  SGLang's {"structures": [{"begin", "schema", "end"}], "triggers": [...]}:
                    free text until a trigger, then a structure's begin, its JSON, its end
"""

from __future__ import annotations

import functools
import json
from typing import Any, cast

KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
MAX_ERROR_CHARS = 600  # llguidance echoes the grammar in some errors; the head names the problem


def grammar(kind: str, text: str, json_options: dict[str, Any] | None = None) -> str:
    """llguidance's grammar (serialized) for one constraint; ValueError naming the problem when it
    cannot even be built (not JSON, an EBNF that does not parse, a malformed structural tag).
    `json_options`: llguidance's JSON compile defaults (the server's whitespace flags)."""
    import llguidance as llg

    if kind == "json_schema":
        try:
            return llg.LLMatcher.grammar_from_json_schema(_json(kind, text), defaults=cast(Any, json_options or None))
        except ValueError as e:
            raise ValueError(f"json_schema: {e}") from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    if kind == "ebnf":
        try:
            return llg.grammar_from("ebnf", text)
        except ValueError as e:
            raise ValueError(f"ebnf: {e}") from None
    if kind == "structural_tag":
        return _structural_tag(_json(kind, text))
    raise ValueError(f"unknown constraint {kind!r}; known: {list(KINDS)}")


def check(kind: str, text: str) -> None:
    """ValueError naming the problem unless the constraint compiles (cached by its text)."""
    err = _compile_error(kind, text)
    if err:
        raise ValueError(err)


@functools.lru_cache(maxsize=512)
def _compile_error(kind: str, text: str) -> str:
    import llguidance as llg

    try:
        g = grammar(kind, text)
    except ValueError as e:
        return _short(str(e))
    err = llg.LLMatcher.validate_grammar(g)
    return _short(f"{kind} does not compile: {err}") if err else ""


def _short(msg: str) -> str:
    return msg if len(msg) <= MAX_ERROR_CHARS else msg[:MAX_ERROR_CHARS] + " ..."


def _json(kind: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{kind} is not valid JSON: {e}") from None


def _structural_tag(spec: Any) -> str:
    """SGLang's structural tag as llguidance StructTags: each structure takes the trigger its
    begin starts with."""
    from llguidance import LLMatcher, StructTag

    if not isinstance(spec, dict):
        raise ValueError("structural_tag: expected a JSON object with 'structures' and 'triggers'")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag: 'structures' must be a non-empty list")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag: 'triggers' must be a non-empty list of non-empty strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f"structural_tag: structures[{i}] needs string 'begin' and 'end' and a 'schema'")
        schema = s.get("schema")
        if not isinstance(schema, dict):
            raise ValueError(f"structural_tag: structures[{i}].schema must be a JSON schema object")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structural_tag: structures[{i}].begin {s['begin']!r} starts with none of the triggers {triggers}")
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    g = StructTag.to_grammar(tags)  # Lark text (or llguidance's JSON with side grammars)
    return g if g.startswith("{") else LLMatcher.grammar_from_lark(g)
