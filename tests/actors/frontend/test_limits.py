"""The front doors' bounds without a server (actors/frontend/limits.py): the JSON depth scan, the
depth walk, the frame head a too-deep frame is answered by, and the bytes-per-token bound that
refuses a text untokenized, which must never refuse a text that fits."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from ringserve.actors.frontend import protocol as p
from ringserve.actors.frontend.inputs import GenerateArgs
from ringserve.actors.frontend.limits import MAX_DEPTH, bytes_per_token, check_depth, json_too_deep
from ringserve.kvmem.allocator import cdiv


@pytest.mark.parametrize(("body", "error"), [
    (b'{"a": 1}', None),
    (b"[" * 64 + b"]" * 64, None),
    (b"[" * 65 + b"]" * 65, "request body"),
    (b'{"text": "' + b"[" * 500 + b'", "x": [1]}', None),  # in a string: not structure
    (b'{"t\\"[": "\\\\", "deep": ' + b"[" * 70 + b"]" * 70 + b"}", "deep"),  # escapes
    (b'{"a": {"b": ' + b"{}," * 100 + b"1}, " + b'"c": ' + b"[" * 63 + b"]" * 63 + b"}", None),  # wide, 64 deep
    (b'{"a": 1, "k\\u0041": ' + b"[" * 64 + b"]" * 64 + b"}", "kA"),
    (b"[" * 10_000_000, "request body"),
], ids=range(8))  # fmt: skip
def test_json_depth_scan(body, error):
    got = json_too_deep(body)
    assert got == (None if error is None else f"{error}: nested deeper than the limit of {MAX_DEPTH} levels")


@given(st.recursive(st.none() | st.integers() | st.text(alphabet='[]{}"\\:,ab'), lambda kids:
                    st.lists(kids, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\:a'), kids, max_size=3),
                    max_leaves=30))  # fmt: skip
@settings(max_examples=300, deadline=None)
def test_json_depth_scan_agrees_with_the_decoded_value(value):
    def depth(v) -> int:
        kids = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        return 0 if kids is None else 1 + max((depth(k) for k in kids), default=0)

    for limit in (1, 2, 3, 5):
        assert (json_too_deep(msgspec.json.encode(value), limit) is None) == (depth(value) <= limit)


def test_check_depth_walks_without_recursing():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match="stop: nested deeper than the limit of 64 levels"):
        check_depth({"a": deep}, "stop")
    check_depth([[[1]]], "x", limit=3)
    with pytest.raises(ValueError):
        check_depth([[[1]]], "x", limit=2)
    check_depth(5, "x")


def test_peek_reads_a_frames_call_id_and_first_container_field():
    enc = msgspec.msgpack.encode
    assert p.peek(enc(p.Generate(7, GenerateArgs(input_ids=[1])))) == (7, "args")
    assert p.peek(enc(p.Control(2**40, "get_load", {"a": [1]}))) == (2**40, "kwargs")
    assert p.peek(enc(p.Cancel(-3))) == (-3, "frame")
    for junk in (b"", b"\x01", b"\x81", enc([1, 2]), enc({"id": "x"}), enc({"id": True}), b"\x82\xa2id"):
        assert p.peek(junk) is None


# ---- bytes per token: sound, or None -----------------------------------------------------------
class Wrapped:
    """What bytes_per_token reads of a transformers tokenizer."""

    def __init__(self, tok: Tokenizer):
        self.backend_tokenizer = tok

    def encode(self, text: str) -> list[int]:
        return self.backend_tokenizer.encode(text).ids


CORPUS = ["The quick brown fox jumps over the lazy dog. " * 20, "Ein Großbuchstabe: ẞ, Å, Ω, ﬁ, 한국어 텍스트. " * 20,
          "def f(x):\n    return [x, {'a': x}]  # ==== ---- ++++\n" * 20, "数字 12345 67890 and emoji 🙂🙃 " * 20]  # fmt: skip


def trained(normalizer=None, pre=None, *, byte_fallback=False, unk: str | None = None, fuse_unk=False) -> Wrapped:
    tok = Tokenizer(models.BPE(unk_token=unk, byte_fallback=byte_fallback, fuse_unk=fuse_unk))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    special = ["<|im_start|>", "<|im_end|>"] + ([unk] if unk else [])
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre, pre_tokenizers.ByteLevel) else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=special, initial_alphabet=alphabet))
    return Wrapped(tok)


KINDS = {
    "byte-level (GPT-2, Llama 3, SmolLM)": lambda: trained(None, pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "NFC + byte-level (Qwen2)": lambda: trained(normalizers.NFC(), pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "sentencepiece-style, byte fallback (Llama 2, Mistral)": lambda: trained(
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None, byte_fallback=True,
        unk="<unk>"),
    "unknown chars one by one": lambda: trained(None, pre_tokenizers.Metaspace(), unk="<unk>"),
}  # fmt: skip
TEXTS = st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", " ", "\n", "ﬁ", "한", "ᄒ", "ᅡ", "ᆫ", "K", "Å", "e\u0301"])
                 | st.text(max_size=30), max_size=20).map("".join)  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_bytes_per_token_is_a_bound_every_text_respects(kind):
    tok = KINDS[kind]()
    bound = bytes_per_token(tok)
    assert isinstance(bound, int) and bound >= 1

    @given(TEXTS)
    @settings(max_examples=400, deadline=None)
    def holds(text: str) -> None:
        assert len(tok.encode(text)) >= cdiv(len(text.encode("utf-8", "surrogatepass")), bound)

    holds()


def test_bytes_per_token_of_the_tiny_model(tiny_dir):
    from ringserve.model.checkpoints.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dir("llama"))
    spec = json.loads(tok.backend_tokenizer.to_str())
    longest = max(len(t) for t in spec["model"]["vocab"])  # byte-level: one character per byte
    assert bytes_per_token(tok) == longest

    @given(TEXTS)
    @settings(max_examples=300, deadline=None)
    def holds(text: str) -> None:
        assert len(tok.encode(text, add_special_tokens=False)) >= cdiv(len(text.encode("utf-8", "surrogatepass")), longest)

    holds()


@pytest.mark.parametrize(("why", "make"), [
    ("NFKC can shrink a text unboundedly often", lambda: trained(normalizers.NFKC(), pre_tokenizers.ByteLevel())),
    ("Strip removes whitespace", lambda: trained(normalizers.Strip(), pre_tokenizers.ByteLevel())),
    ("Whitespace drops what it splits on", lambda: trained(None, pre_tokenizers.Whitespace())),
    ("Split with behavior removed", lambda: trained(None, pre_tokenizers.Split(" ", "removed"))),
    ("a run of unknown characters is one token", lambda: trained(None, pre_tokenizers.Metaspace(), unk="<unk>",
                                                                 fuse_unk=True)),
    ("WordPiece: a whole unknown word is one token", lambda: Wrapped(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1},
                                                                                                 unk_token="[UNK]")))),
    ("not a tokenizers pipeline", lambda: object()),
], ids=lambda x: x if isinstance(x, str) else "")  # fmt: skip
def test_no_bound_where_text_can_vanish(why, make):
    assert bytes_per_token(make()) is None, why


def test_an_added_token_that_swallows_whitespace_has_no_bound():
    from tokenizers import AddedToken

    tok = trained(None, pre_tokenizers.ByteLevel())
    tok.backend_tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert bytes_per_token(tok) is None
    assert len(tok.encode(" " * 1000 + "<mask>")) == 1  # why: 1,006 bytes, one token
