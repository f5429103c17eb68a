"""The frontend's tokenizer (model/checkpoints/tokenizer.py `load_encoder`): transformers the first
time, then `FastTokenizer` from the cached backend, encoding and decoding as transformers does and
answering everything else through transformers' own tokenizer, loaded on first use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from model.checkpoints.tokenizer import FastTokenizer, load_encoder, load_tokenizer

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


def test_preload_loads_transformers_in_the_background(tiny_dir, cache):
    d = tiny_dir("llama")
    load_encoder(d)
    tok = load_encoder(d)
    tok.preload()
    for _ in range(600):
        if tok._full is not None:
            break
        time.sleep(0.05)
    assert tok._full is not None and tok.encode("ab cd") == tok.full.encode("ab cd")


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
        "from model.checkpoints.tokenizer import load_encoder\n"
        f"tok = load_encoder({str(d)!r})\n"
        "ids = tok.encode('hello there'); tok.decode(ids)\n"
        "from actors.frontend.limits import bytes_per_token\n"
        "assert bytes_per_token(tok) is not None\n"
        "before = 'transformers' in sys.modules\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True, tokenize=False)\n"
        "print(type(tok).__name__, before, 'transformers' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "RINGSERVE_CACHE": str(cache)})  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["FastTokenizer", "False", "True"]


def test_engine_tokenizer_is_transformers_own(shared_engine):
    """`engine.tokenizer` stays transformers' tokenizer (callers pass it to libraries that check
    its type, llguidance's `from_tokenizer` among them); the frontend's may be a FastTokenizer."""
    from transformers import PreTrainedTokenizerBase

    tok = shared_engine.tokenizer
    assert isinstance(tok, PreTrainedTokenizerBase) and shared_engine.tokenizer is tok
    fe = shared_engine.frontend.tok
    assert fe is tok or (isinstance(fe, FastTokenizer) and fe.full is tok)
    assert fe.encode("hello world") == tok.encode("hello world")
