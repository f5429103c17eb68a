"""The frontend's tokenizer (model/checkpoints/tokenizer.py `load_encoder`): transformers the first
time, then `FastTokenizer` from the cached backend, encoding and decoding as transformers does and
answering everything else through transformers' own tokenizer, loaded on first use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringserve.model.checkpoints.tokenizer import FastTokenizer, load_encoder, load_tokenizer

TEXTS = ["Héllo wörld — naïve café, 世界 🙂🚀 ok.", "", " ", "  leading and trailing  ", "a\n\nb\tc\r\n",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "x<|im_end|>y<|im_start|>", "1234567 89.5%"]  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _texts(hf) -> list[str]:
    rng = np.random.default_rng(0)
    out = list(TEXTS)
    out += [hf.decode(rng.integers(0, len(hf), rng.integers(1, 30)).tolist()) for _ in range(100)]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_cached_encoder_encodes_and_decodes_as_transformers(tiny_dir, cache, family):
    d = tiny_dir(family)
    hf = load_tokenizer(d)
    assert not isinstance(load_encoder(d), FastTokenizer)  # nothing cached yet: transformers, spec kept
    tok = load_encoder(d)
    assert isinstance(tok, FastTokenizer)
    assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (hf.eos_token_id, hf.bos_token_id, len(hf))
    for text in _texts(hf):
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            ), text
    ids = hf.encode(TEXTS[0] + TEXTS[5])
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_a_bos_the_post_processor_adds_is_added_the_same(tmp_path, cache):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "a": 3, "b": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="[UNK]"
    ).save_pretrained(tmp_path / "bos")
    hf = load_tokenizer(tmp_path / "bos")
    load_encoder(tmp_path / "bos")
    tok = load_encoder(tmp_path / "bos")
    assert isinstance(tok, FastTokenizer) and tok.bos_token_id == hf.bos_token_id == 0
    for text in ("a b", "b a c", ""):
        assert tok.encode(text) == hf.encode(text) and tok.encode(text)[:1] == [0]
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_everything_else_is_transformers_own(tiny_dir, cache):
    d = tiny_dir("llama")
    hf = load_tokenizer(d)
    load_encoder(d)
    tok = load_encoder(d)
    assert tok._full is None  # nothing of transformers' yet
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]  # fmt: skip
    assert tok.chat_template == hf.chat_template
    assert tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    ) == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    full = tok.full
    assert tok.full is full and type(full) is type(hf)  # loaded once
    assert tok.backend_tokenizer.to_str() == tok.backend.to_str()
    assert tok(["a b", "c"])["input_ids"] == hf(["a b", "c"])["input_ids"]
    assert tok.convert_ids_to_tokens([5, 6, 7]) == hf.convert_ids_to_tokens([5, 6, 7])
    assert tok.encode("a b c d e", truncation=True, max_length=3) == hf.encode(
        "a b c d e", truncation=True, max_length=3
    )
    with pytest.raises(AttributeError):
        tok.no_such_attribute  # noqa: B018


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
NAMED = {"default": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}",
         "tool_use": "{{ tools | tojson }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}  # fmt: skip


def _chats() -> list[tuple[object, dict]]:
    """(conversation, keyword arguments) pairs apply_chat_template is asked with."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 世界"},
            {"role": "assistant", "content": "hi", "tool_calls": None}, {"role": "user", "content": "and?"}]  # fmt: skip
    return [(msgs, {"add_generation_prompt": True}), (msgs, {}), (msgs[:2], {"add_generation_prompt": False}),
            ([msgs[:2], msgs], {"add_generation_prompt": True}),  # batched
            ([*msgs, {"role": "assistant", "content": "I think"}], {"continue_final_message": True}),
            (msgs, {"add_generation_prompt": True, "tools": TOOLS, "custom_flag": 3}),
            (msgs, {"chat_template": "{% for m in messages %}{{ m.content | upper }}|{% endfor %}{{ bos_token }}"})]  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2", "named"])
def test_chats_render_as_transformers_without_its_tokenizer(tiny_dir, cache, tmp_path, family):
    d = tiny_dir("qwen2" if family == "qwen2" else "llama")
    if family == "named":  # a tokenizer with named templates
        d = tmp_path / "named"
        shutil.copytree(tiny_dir("llama"), d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = [{"name": k, "template": v} for k, v in NAMED.items()]
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = load_tokenizer(d)
    load_encoder(d)
    tok = load_encoder(d)
    assert isinstance(tok, FastTokenizer) and tok.chat_template == hf.chat_template
    for conv, kw in _chats():
        if family == "named" and "chat_template" in kw:
            kw = {**kw, "chat_template": "tool_use"}  # a template by its name
        want = hf.apply_chat_template(conv, tokenize=False, **kw)
        assert tok.apply_chat_template(conv, tokenize=False, **kw) == want, (conv, kw)
    assert tok._full is None  # transformers' tokenizer never loaded
    for bad in ([], [["x"]]):
        with pytest.raises((ValueError, TypeError)):
            hf.apply_chat_template(bad, tokenize=False)
        with pytest.raises((ValueError, TypeError)):
            tok.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match="not compatible"):
        tok.apply_chat_template(_chats()[0][0], add_generation_prompt=True, continue_final_message=True, tokenize=False)
    # a tokenized chat (or an option of transformers' alone) is transformers' own
    ids = tok.apply_chat_template(_chats()[0][0], add_generation_prompt=True, return_dict=False)
    assert tok._full is not None
    assert ids == hf.apply_chat_template(_chats()[0][0], add_generation_prompt=True, return_dict=False)


def test_split_special_tokens_stays_with_transformers(tiny_dir, cache, tmp_path):
    d = tmp_path / "split"
    shutil.copytree(tiny_dir("llama"), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["split_special_tokens"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    load_encoder(d)
    tok = load_encoder(d)
    assert not isinstance(tok, FastTokenizer)  # its encode is not the backend's default
    assert tok.encode("<|im_start|>") == load_tokenizer(d).encode("<|im_start|>")


def test_a_cached_start_imports_no_transformers(tiny_dir, cache):
    d = tiny_dir("llama")
    load_encoder(d)  # the spec, once
    code = (
        "import sys\nsys.modules['torch'] = None\n"
        "from ringserve.model.checkpoints.tokenizer import load_encoder\n"
        f"tok = load_encoder({str(d)!r})\n"
        "ids = tok.encode('hello there'); tok.decode(ids)\n"
        "from ringserve.actors.frontend.limits import bytes_per_token\n"
        "assert bytes_per_token(tok) is not None\n"
        "before = 'transformers' in sys.modules\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True, tokenize=False)\n"
        "print(type(tok).__name__, before, 'transformers.tokenization_utils_base' in sys.modules, tok._full is None)"
    )
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "RINGSERVE_CACHE": str(cache)})  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["FastTokenizer", "False", "False", "True"]  # a chat: transformers' renderer alone


def test_engine_tokenizer_is_transformers_own(shared_engine):
    """`engine.tokenizer` stays transformers' tokenizer (callers pass it to libraries that check
    its type, llguidance's `from_tokenizer` among them); the frontend's may be a FastTokenizer."""
    from transformers import PreTrainedTokenizerBase

    tok = shared_engine.tokenizer
    assert isinstance(tok, PreTrainedTokenizerBase) and shared_engine.tokenizer is tok
    fe = shared_engine.frontend.tok
    assert fe is tok or (isinstance(fe, FastTokenizer) and fe.full is tok)
    assert fe.encode("hello world") == tok.encode("hello world")
