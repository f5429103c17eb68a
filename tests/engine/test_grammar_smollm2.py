"""SmolLM2-135M-Instruct (its tokenizer rebuilt from the GGUF: model/checkpoints/gguf_tokenizer.py)
behind `ringserve serve`'s HTTP server, asked through the real `openai` client with
response_format json_schema: the answer is valid JSON with the right fields, and the right
capital. Skipped only when the package registry cannot be reached (see test_smollm2.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ringserve.model.checkpoints.fetch import RegistryUnreachable, fetch_model

pytestmark = pytest.mark.network

SCHEMA = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 40},
                                           "capital": {"type": "string", "maxLength": 40}},
          "required": ["country", "capital"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def served():
    from ringserve import Engine, Servers

    try:
        path = fetch_model("smollm2")
    except RegistryUnreachable as e:
        pytest.skip(f"package registry unreachable, cannot fetch SmolLM2: {e}")
    engine = Engine(str(path), page_size=16, max_running_requests=2, context_length=512, max_prefill_tokens=256,
                    max_total_tokens=16 * 80)  # fmt: skip
    servers = Servers(engine, ipc=False, port=0).start()
    yield engine, servers
    servers.stop()
    engine.shutdown()


def test_openai_json_schema_answer_is_valid_json_with_the_right_fields(served):
    import openai

    engine, servers = served
    c = openai.OpenAI(base_url=servers.url + "/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(
        model=engine.served_model_name, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    assert "paris" in answer["capital"].lower() and "france" in answer["country"].lower()
    info = engine.get_server_info()
    assert info["grammar_steps"] > 0 and info["integrity_errors"] == []


def test_llguidance_reads_the_gguf_built_vocabulary_as_the_tokenizer_does(served):
    """The scheduler maps the vocabulary once (llguidance.hf.from_tokenizer, as in
    actors/scheduler/actor.py): every token decodes to the same bytes on both sides."""
    from llguidance.hf import from_tokenizer

    engine, _ = served
    tok = engine.tokenizer
    ll = from_tokenizer(tok, n_vocab=engine.vocab_size)
    assert ll.vocab_size == engine.vocab_size and tok.eos_token_id in ll.eos_tokens
    for text in ['{"capital": "Paris"}', "naïve café 123\n\t", "日本の首都は東京です。"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ll.decode_bytes(ids) == text.encode()
        assert ll.tokenize_str(text) == ids
