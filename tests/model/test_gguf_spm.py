"""A GGUF's SentencePiece tokenizer (`tokenizer.ggml.model` 'llama': Gemma, Llama 2, Mistral
v0.1) rebuilt as a `tokenizers` BPE (model/checkpoints/gguf_tokenizer.py): tiny vocabularies
written as llama.cpp's converters write them give llama.cpp's ids (tests/model/spm_ref.py, an
independent encoder) and transformers' GGUF tokenizer's ids (Gemma's: transformers' llama
converter ignores add_space_prefix), decode back, keep the chat template; a real Gemma 3 270M
GGUF tokenizes as transformers does and the engine serves it from the .gguf alone."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from ringserve.model.checkpoints.gguf import gguf_tokenizer_dir, load_gguf_tokenizer, read_gguf_vocab
from ringserve.model.checkpoints.gguf_tokenizer import build_tokenizer, hf_tokenizer, score_merges
from tests.model.spm_ref import RefSPM

BYTES = [f"<0x{b:02X}>" for b in range(256)]
# (piece, score): the scores make merging by score differ from longest-match: in "▁abc" the pair
# (a, b) merges first (-8 beats ▁a's -10 and bc's -9), then (ab, c) to abc (-11) beats (▁, ab) to
# ▁ab (-12), so "▁abc" is [▁, abc], not [▁ab, c]
NORMAL = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), ("h", -5.0), ("e", -6.0), ("l", -7.0), ("ab", -8.0),
          ("bc", -9.0), ("▁a", -10.0), ("abc", -11.0), ("▁ab", -12.0), ("▁b", -13.0), ("he", -14.0), ("ll", -15.0),
          ("llo", -16.0), ("o", -17.0), ("hello", -18.0), ("▁hello", -19.0), ("cab", -21.0)]  # fmt: skip
CONTROL = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
USER = ["<sep>", "\n", "  "]  # Gemma's user-defined "\n" and runs of raw spaces
TOKENS = ["<unk>", *CONTROL, *USER, *BYTES, *(p for p, _ in NORMAL)]
TYPES = [2] + [3] * len(CONTROL) + [4] * len(USER) + [6] * 256 + [1] * len(NORMAL)
SCORES = [-1000.0] * (1 + len(CONTROL) + len(USER)) + [0.0] * 256 + [s for _, s in NORMAL]
ID = {t: i for i, t in enumerate(TOKENS)}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")  # fmt: skip

TEXTS = ["abc", " abc", "abc ", "  abc", "   abc  ", "hello", " hello", "hello abc", "cabc", "abcabc", "a b c",
         "bc\nab", "\n\nhello\n", "ab<sep>abc", "<sep>", "<sep> hello", "héllo", "日本", "a😀b", "", " ", "\n",
         "hello<start_of_turn>abc<end_of_turn>", "▁abc", "x y\tz"]  # fmt: skip


def write_spm_gguf(path: Path, *, arch: str = "gemma3", add_space_prefix: bool | None = False,
                   chat_template: str | None = TEMPLATE, tokens=TOKENS, scores=SCORES, types=TYPES) -> Path:  # fmt: skip
    """A tokenizer-only GGUF as llama.cpp's converters write an SPM vocabulary (Gemma's:
    add_space_prefix False; Llama 2's: True or absent, llama.cpp's default)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(ID["<bos>"])
    w.add_eos_token_id(ID["<eos>"])
    w.add_unk_token_id(ID["<unk>"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ref_for(prefix: bool) -> RefSPM:
    return RefSPM(TOKENS, SCORES, TYPES, add_space_prefix=prefix, bos_id=ID["<bos>"], add_bos=True)


def random_texts(n: int, seed: int, literal_metaspace: bool = True) -> list[str]:
    """Strings of the tiny vocabulary's pieces, spaces, newlines, added tokens, characters it
    lacks (byte fallback) and, unless told not to, the character '▁' itself."""
    parts = ["a", "b", "c", "h", "e", "l", "o", " ", " ", "  ", "\n", "<sep>", "<eos>", "é", "😀", "x"]
    parts += ["▁"] if literal_metaspace else []
    rng = np.random.default_rng(seed)
    return ["".join(parts[j] for j in rng.integers(0, len(parts), int(k))) for k in rng.integers(1, 24, n)]


@pytest.mark.parametrize("prefix", [False, True, None])
def test_ids_are_llama_cpps(tmp_path, prefix):
    """Every text, with and without BOS, as the llama.cpp-semantics reference encodes it
    (add_space_prefix: Gemma's False, Llama 2's True, and absent: llama.cpp's default, True)."""
    ours = load_gguf_tokenizer(write_spm_gguf(tmp_path / "t.gguf", arch="llama", add_space_prefix=prefix))
    ref = ref_for(prefix is not False)
    for text in TEXTS + random_texts(300, seed=1):
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, False), text


def test_hand_computed_ids(tmp_path):
    """A few ids worked out by hand (NORMAL's comment: merges follow scores)."""
    no_prefix = load_gguf_tokenizer(write_spm_gguf(tmp_path / "n.gguf"))
    prefix = load_gguf_tokenizer(write_spm_gguf(tmp_path / "p.gguf", arch="llama", add_space_prefix=True))
    i = ID.__getitem__
    assert no_prefix.encode(" abc") == [i("<bos>"), i("▁"), i("abc")]
    assert prefix.encode("abc") == [i("<bos>"), i("▁"), i("abc")]
    # "cabc": (a, b) first, then (c, ab) -> cab (-21) loses to (ab, c) -> abc (-11): [c, abc]
    assert no_prefix.encode("cabc", add_special_tokens=False) == [i("c"), i("abc")]
    # "hello": he, ll, llo, hello; with the prefix, then ▁hello
    assert no_prefix.encode("hello", add_special_tokens=False) == [i("hello")]
    assert prefix.encode("hello", add_special_tokens=False) == [i("▁hello")]
    # user-defined tokens are split off the raw text (two raw spaces are one token here), and in
    # the Llama 2 style each fragment after one gets the prefix space
    assert no_prefix.encode("a  b\n", add_special_tokens=False) == [i("a"), i("  "), i("b"), i("\n")]
    assert prefix.encode("ab<sep>ab", add_special_tokens=False) == [i("▁ab"), i("<sep>"), i("▁ab")]
    # é is no token: its UTF-8 bytes
    assert no_prefix.encode("é", add_special_tokens=False) == [i("<0xC3>"), i("<0xA9>")]


def test_gemma_style_ids_equal_transformers_gguf_tokenizer(tmp_path):
    """transformers reads the same file itself (its Gemma converter, a separate implementation).

    Texts holding '▁' itself are left out: transformers turns the user-defined run of raw spaces
    into a normal piece '▁▁', which a typed '▁' then merges with; llama.cpp splits the raw
    spaces off first (as ringserve: test_ids_are_llama_cpps covers those texts)."""
    from transformers import AutoTokenizer

    path = write_spm_gguf(tmp_path / "g.gguf")
    ours = load_gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [t for t in TEXTS if "▁" not in t] + random_texts(300, seed=2, literal_metaspace=False):
        assert ours.encode(text) == theirs.encode(text), text


@pytest.mark.parametrize("prefix", [False, True])
def test_decode_round_trips(tmp_path, prefix):
    """decode(encode(text)) is the text: '▁' back to spaces, bytes fused, the prefix space
    dropped; control tokens are skipped with skip_special_tokens, user-defined ones never.
    (A typed '▁' comes back as a space, in llama.cpp too; with the prefix, text after an added token gains its prefix space, in llama.cpp as in
    Llama 2's own tokenizer: those texts are left out there.)"""
    ours = load_gguf_tokenizer(write_spm_gguf(tmp_path / "t.gguf", arch="llama", add_space_prefix=prefix))
    for text in [t for t in TEXTS if "▁" not in t] + random_texts(300, seed=3, literal_metaspace=False):
        if prefix and any(t in text for t in (*CONTROL, *USER)):
            continue
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text, text
        without_control = text
        for t in CONTROL:
            without_control = without_control.replace(t, "")
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == without_control, text
    ids = ours.encode("<start_of_turn>ab<sep>\n<end_of_turn>", add_special_tokens=False)
    # (with the prefix, the one space dropped is the decoded text's first, after skipping: as
    # Llama 2's own tokenizer.json decodes; llama.cpp drops it only from the very first token)
    assert ours.decode(ids, skip_special_tokens=True) == "ab<sep>\n"
    assert ours.decode(ids) == ("<start_of_turn>ab<sep>\n<end_of_turn>" if not prefix else
                                "<start_of_turn> ab<sep>\n<end_of_turn>")  # fmt: skip


def test_ringserves_tokenizer_reads_the_gguf_chat_template(tmp_path):
    """The path the actors take (a tokenizer directory, `load_encoder`): the same ids, the file's
    chat template, BOS/EOS named."""
    from ringserve.model.checkpoints.tokenizer import load_encoder

    path = write_spm_gguf(tmp_path / "g.gguf")
    tok = load_encoder(gguf_tokenizer_dir(path))
    ref = ref_for(False)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
    assert tok.bos_token_id == ID["<bos>"] and tok.eos_token_id == ID["<eos>"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[:2] == [ID["<bos>"], ID["<start_of_turn>"]] and ids.count(ID["<bos>"]) == 1
    assert ids == ref.encode(chat, add_special_tokens=False)


def test_llguidance_reads_the_gemma_style_vocabulary_as_the_tokenizer_does(tmp_path):
    """The scheduler's grammar vocabulary (llguidance.hf.from_tokenizer, as in
    actors/scheduler/actor.py): bytes fall back, '▁' is a space, user-defined tokens are text."""
    from llguidance.hf import from_tokenizer

    tok = load_gguf_tokenizer(write_spm_gguf(tmp_path / "g.gguf"))
    ll = from_tokenizer(tok, n_vocab=len(TOKENS))
    for text in ["abc hello", " a  b\n", "héllo 😀", "ab<sep>c"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ll.decode_bytes(ids) == text.encode() and ll.tokenize_str(text) == ids, text


def test_merges_follow_scores():
    """Every split of a token into two tokens is a merge, ranked by the merged token's score."""
    merges = score_merges(["a", "b", "c", "ab", "bc", "abc"], [-1.0, -2.0, -3.0, -6.0, -4.0, -5.0])
    assert merges == [("b", "c"), ("a", "bc"), ("ab", "c"), ("a", "b")]


def test_other_models_and_missing_scores_are_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "bert")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[CLS]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"b\.gguf: GGUF tokenizer model 'bert' is not supported"):
        read_gguf_vocab(tmp_path / "b.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"s\.gguf: missing GGUF metadata 'tokenizer\.ggml\.scores'"):
        read_gguf_vocab(tmp_path / "s.gguf")


# ---- a real Gemma 3 270M GGUF -----------------------------------------------------------------

WORDS = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog.", "Hello,", "world!", "naïve", "café",
         "Straße", "日本語", "の", "テキスト", "中文", "한국어", "Привет", "мир", "مرحبا", "שלום", "😀", "🤖", "👩‍👩‍👧",
         "🇫🇷", "def", "f(x):", "return", "x**2", "{\"a\":", "[1,", "2]}", "#include", "<stdio.h>", "0", "42",
         "3.14159", "1,000,000", "2026-12-07", "0xDEADBEEF", "<table>", "<b>", "</b>", "https://example.com/a?b=c",
         "αβγ", "∑", "→", "½", "™", "©", "ﬁ", "\u200b", "e\u0301"]  # fmt: skip
SEPS = [" ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "", "\r\n", "    "]


def gemma_texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for k in rng.integers(1, 16, n):
        words = [WORDS[j] + SEPS[s] for j, s in zip(rng.integers(0, len(WORDS), k), rng.integers(0, len(SEPS), k),
                                                         strict=True)]  # fmt: skip
        lead = SEPS[rng.integers(0, len(SEPS))] if rng.random() < 0.3 else ""
        out.append(lead + "".join(words))
    return out


def _gemma3_270m() -> str:
    from tests.model.test_gemma import _fetch_gemma3_270m

    path = os.environ.get("RINGSERVE_GEMMA3_270M_GGUF") or _fetch_gemma3_270m()
    if not Path(path).is_file():
        pytest.skip(f"RINGSERVE_GEMMA3_270M_GGUF={path!r} names no file")
    return path


@pytest.mark.slow
@pytest.mark.network
def test_a_real_gemma3_270m_gguf_tokenizes_as_transformers():
    """Gemma 3 270M's GGUF (262144 tokens, no prefix space, user-defined "\\n" and space runs):
    ringserve's ids equal transformers' GGUF tokenizer's on a few hundred varied texts (and
    llama.cpp-semantics reference's on some), and decode back."""
    from transformers import AutoTokenizer

    path = _gemma3_270m()
    v = read_gguf_vocab(path)  # (what load_gguf_tokenizer reads: the file is parsed once)
    ours = hf_tokenizer(*build_tokenizer(v, path))
    theirs = AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    ref = RefSPM(v.tokens, v.scores, v.token_types, add_space_prefix=False, bos_id=v.bos_id, add_bos=True)
    texts = gemma_texts(300, seed=0) + ["", " ", "\n", "<start_of_turn>user\nHi<end_of_turn>\n", "x<table>y"]
    for j, text in enumerate(texts):
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        if j % 10 == 0:
            assert ids == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == text.replace("<start_of_turn>", "").replace(
            "<end_of_turn>", ""), text  # fmt: skip


@pytest.mark.sweep  # 69 s (the gguf package opens the 262k-token file slowly): out of CI's 45 minutes
@pytest.mark.network
def test_a_real_gemma3_270m_gguf_serves_text_from_the_gguf_alone():
    """`Engine(<the .gguf>)`: the tokenizer rebuilt from the file encodes the prompts (a Gemma
    turn, written out: this file holds no chat template; its control tokens parsed whole) and
    the base model continues a count greedily, decoded back to text."""
    from tests.engine.conftest import engine_ctx

    path = _gemma3_270m()
    turn = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    with engine_ctx(path, context_length=128, max_total_tokens=16 * 64, max_running_requests=2) as engine:
        tok = engine.tokenizer
        # <bos> <start_of_turn> user \n What ▁is ▁the ▁capital ▁of ▁France ? <end_of_turn> \n ...
        assert tok.encode(turn) == [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]
        outs = engine.generate([turn, "1, 2, 3, 4, 5,"], {"temperature": 0, "max_new_tokens": 8})
        assert outs[0]["meta_info"]["prompt_tokens"] == 16
        for out in outs:
            assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
        assert outs[1]["text"] == " 6, 7, 8"
