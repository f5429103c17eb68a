"""The scheduler's and detokenizer's tokenizer (model/checkpoints/tokenizer.py `load_decoder`):
transformers the first time, then the cached backend alone, decoding the same text."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ringserve.actors.detokenizer.incremental import IncrementalDecoder
from ringserve.model.checkpoints.tokenizer import Decoder, decoder_spec, load_decoder, load_tokenizer

TEXT = "Héllo wörld — naïve café, 世界 🙂🚀 ok. Ünïcödé ∑∫ done <|im_start|>x<|im_end|>"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_cached_decoder_decodes_as_transformers(tiny_dir, cache, family):
    d = tiny_dir(family)
    hf = load_tokenizer(d)
    first = load_decoder(d)
    assert not isinstance(first, Decoder)  # nothing cached yet: transformers, and the spec kept
    assert len(list((cache / "tokenizers").glob("*.json"))) == 1
    dec = load_decoder(d)
    assert isinstance(dec, Decoder)
    assert (dec.eos_token_id, len(dec)) == (hf.eos_token_id, len(hf))
    rng = np.random.default_rng(0)
    specials = sorted(hf.all_special_ids)
    cases = [hf.encode(TEXT, add_special_tokens=False)]
    cases += [rng.integers(0, len(hf), rng.integers(1, 40)).tolist() for _ in range(200)]
    cases += [[*c[:5], specials[i % len(specials)], *c[5:]] for i, c in enumerate(cases[1:30])]
    for ids in cases:
        for skip in (True, False):
            assert dec.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    ids = cases[0]
    for skip in (True, False):
        a, b = IncrementalDecoder(dec, skip_special_tokens=skip), IncrementalDecoder(hf, skip_special_tokens=skip)
        assert [a.push([i]) for i in ids] + [a.finish()] == [b.push([i]) for i in ids] + [b.finish()]


def test_llguidance_maps_the_same_vocabulary_from_the_decoder(tiny_dir, cache):
    from llguidance import LLTokenizer
    from llguidance.hf import from_tokenizer

    d = tiny_dir("llama")
    hf = load_tokenizer(d)
    load_decoder(d)
    dec = load_decoder(d)
    a = LLTokenizer(dec.backend_json, n_vocab=len(hf) + 7, eos_token=dec.eos_token_id)
    b = from_tokenizer(hf, n_vocab=len(hf) + 7)
    assert (a.vocab_size, a.eos_token) == (b.vocab_size, b.eos_token)
    assert a.tokenize_str(TEXT) == b.tokenize_str(TEXT)
    assert all(a.decode_bytes([i]) == b.decode_bytes([i]) for i in range(len(hf)))


def test_a_changed_tokenizer_is_not_read_from_the_cache(tiny_dir, cache, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(tiny_dir("llama"), d)
    load_decoder(d)
    assert isinstance(load_decoder(d), Decoder)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|im_start|>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    changed = load_decoder(d)
    assert not isinstance(changed, Decoder)  # a new key: transformers again
    assert load_decoder(d).eos_token_id == changed.eos_token_id != load_tokenizer(tiny_dir("llama")).eos_token_id


def test_a_damaged_entry_is_rebuilt(tiny_dir, cache):
    d = tiny_dir("llama")
    load_decoder(d)
    (entry,) = (cache / "tokenizers").glob("*.json")
    entry.write_text("{not json")
    assert not isinstance(load_decoder(d), Decoder)
    assert isinstance(load_decoder(d), Decoder)


def test_a_tokenizer_that_cleans_up_spaces_stays_with_transformers():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def wrap(model, cleanup):
        t = Tokenizer(model)
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", clean_up_tokenization_spaces=cleanup)

    vocab = {"[UNK]": 0, "a": 1, ".": 2}
    assert decoder_spec(wrap(models.WordPiece(vocab, unk_token="[UNK]"), True)) is None  # " ." -> "."
    assert decoder_spec(wrap(models.WordPiece(vocab, unk_token="[UNK]"), False)) is not None
    assert decoder_spec(wrap(models.BPE(vocab, [], unk_token="[UNK]"), True)) is not None  # ignored for BPE


def test_a_cache_that_cannot_be_written_only_costs_speed(tiny_dir, tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # the cache root is a file: nothing can be made under it
    monkeypatch.setenv("RINGSERVE_CACHE", str(blocked))
    d = tiny_dir("llama")
    tok = load_decoder(d)
    assert not isinstance(tok, Decoder) and tok.decode([5, 6]) == load_tokenizer(d).decode([5, 6])


def test_actors_starting_together_load_transformers_once(tiny_dir, cache, monkeypatch):
    """A first start's frontend, scheduler and detokenizer ask for the tokenizer at once: one
    loads transformers' and keeps the spec, the others wait for it (model/paths.py
    `one_maker`) and decode from the spec, the same text."""
    import threading
    import time

    from ringserve.model.checkpoints import tokenizer as tokenizer_module

    d = tiny_dir("llama")
    real, calls = tokenizer_module.load_tokenizer, []

    def slow(path):  # transformers' load, long enough for the others to be waiting
        calls.append(path)
        time.sleep(0.5)
        return real(path)

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", slow)
    got: list = [None] * 3
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, load_decoder(d))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(calls) == 1 and sum(isinstance(g, Decoder) for g in got) == 2
    ids = real(d).encode(TEXT)
    assert len({g.decode(ids) for g in got}) == 1
