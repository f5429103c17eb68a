"""A GGUF's vocabulary, rebuilt as a Hugging Face `tokenizers` tokenizer: byte-level BPE
(`tokenizer.ggml.model` 'gpt2') or SentencePiece ('llama': Gemma, Llama 2, Mistral v0.1).
Any other model ('bert', 'rwkv', 't5', ...) is refused by name.

Byte-level BPE. A GGUF stores the tokenizer as data: `tokenizer.ggml.tokens` (the vocabulary in
id order, in GPT-2's byte-to-unicode alphabet), `token_type` (3 = control, 4 = user-defined: both
are added special tokens), `merges` ("a b" strings in rank order) and `pre`, the name llama.cpp gives the
pre-tokenizer. The pre-tokenizer is not stored, only named, so each supported name maps to the
splits llama.cpp applies for it (src/llama-vocab.cpp), written the way the model's original
tokenizer.json writes them:

    pre name                      splits, in order                         then
    gpt2 (mpt, olmo, jais)        GPT-2 regex (inside ByteLevel)           BPE
    smollm (starcoder, refact,    every \\p{N} alone (Digits individual),   BPE
      codeshell, command-r)       then GPT-2 regex
    llama-bpe (dbrx, smaug)       llama3 regex (digits in runs of <= 3)    BPE, ignore_merges
    qwen2 (stablelm2)             qwen2 regex (every digit alone)          BPE

Anything else is refused with the name, rather than tokenized almost right.

SentencePiece. The file stores `tokens` (pieces, '▁' for a space, `<0xNN>` byte tokens),
`scores` and `token_type`, no merges. llama.cpp's SPM tokenizer (src/llama-vocab.cpp,
llm_tokenizer_spm) encodes text in these steps, each rebuilt here as:

    llama.cpp                                            tokenizers
    split off control (3), unknown (2) and user-         added tokens on the raw text
      defined (4) tokens, longest first                    (user-defined ones not special)
    ' ' before each remaining fragment, if               normalizer Prepend('▁'), which runs
      add_space_prefix (default true; Gemma: false)        on each fragment between added tokens
    spaces -> '▁'                                         normalizer Replace(' ', '▁')
    start from the fragment's characters; merge the      BPE, no pre-tokenizer: a merge (a, b) for
      adjacent pair whose concatenation is a token         every token a + b whose halves are both
      of highest score, leftmost on ties, until none       tokens, ranked by the token's score
    a character that is no token: its UTF-8 bytes'       byte_fallback=True
      <0xNN> tokens

and decodes by copying control and user-defined tokens, turning '▁' back into spaces and
<0xNN> runs into their bytes, less the one prefix space (decoder: Replace, ByteFallback, Fuse,
Strip). Ties differ in one corner only: two pairs merging into tokens of the same score (or into
the same token split differently) are taken leftmost by llama.cpp and in rank order here; in
SentencePiece files the normal tokens' scores are distinct, and the -1000 of control and
user-defined tokens is never reached by merging text that has them split off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values read here (see the docstring)
# per model, the token types split off the raw text as added tokens -> whether they are special:
# SentencePiece's user-defined tokens are text ("\n", runs of spaces, "<table>": never skipped),
# and llama.cpp splits its unknown token off too
ADDED_SPECIAL = {
    "gpt2": {TOKEN_TYPE_CONTROL: True, TOKEN_TYPE_USER_DEFINED: True},
    "llama": {TOKEN_TYPE_CONTROL: True, TOKEN_TYPE_UNKNOWN: True, TOKEN_TYPE_USER_DEFINED: False},
}

_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# llama.cpp pre-tokenizer name -> family of splits (see the table above).
PRE_FAMILIES = {
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "command-r": "digits",
    "llama-bpe": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "stablelm2": "qwen2",
}


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer fields of one GGUF file (ids index `tokens`; `scores`, when given, and
    `token_types` run beside it). `merges` and `pre` are byte-level BPE's ('gpt2'); `scores`
    and `add_space_prefix` SentencePiece's ('llama')."""

    model: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str] = ()
    pre: str = "default"
    scores: Sequence[float] = ()
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    chat_template: str | None = None
    max_length: int = 8192


def build_tokenizer(v: GGUFVocab, source: str) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json dict) equivalent to the GGUF's tokenizer."""
    from tokenizers import AddedToken, processors

    if v.model == "gpt2":
        tok = _byte_level_bpe(v, source)
    elif v.model == "llama":
        tok = _sentencepiece_bpe(v, source)
    else:
        raise ValueError(f"{source}: GGUF tokenizer model {v.model!r} is not supported; supported: {list(MODELS)}")

    def tok_str(i: int | None) -> str | None:
        return v.tokens[i] if i is not None and 0 <= i < len(v.tokens) else None

    bos, eos = tok_str(v.bos_id), tok_str(v.eos_id)
    add_bos, add_eos = v.add_bos and bos is not None, v.add_eos and eos is not None
    if add_bos or add_eos:
        first, last = (f"{bos}:0 " if add_bos else ""), (f" {eos}:0" if add_eos else "")
        pair_first, pair_last = (f"{bos}:1 " if add_bos else ""), (f" {eos}:1" if add_eos else "")
        added = {t: i for t, i, on in ((bos, v.bos_id, add_bos), (eos, v.eos_id, add_eos)) if on}
        tok.post_processor = processors.TemplateProcessing(
            single=f"{first}$A:0{last}",
            pair=f"{first}$A:0{last} {pair_first}$B:1{pair_last}",
            special_tokens=[(t, int(i or 0)) for t, i in added.items()],
        )
    elif v.model == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # added tokens, matched whole in the raw text; special ones are skipped by skip_special_tokens
    added_types = ADDED_SPECIAL[v.model]
    tok.add_tokens([
        AddedToken(t, special=added_types[ty], normalized=False)
        for t, ty in zip(v.tokens, v.token_types, strict=True)
        if ty in added_types
    ])  # fmt: skip
    if tok.get_vocab_size() != len(v.tokens):  # a duplicate token string would shift every id after it
        raise ValueError(
            f"{source}: tokenizer.ggml.tokens has duplicates ({len(v.tokens)} entries, {tok.get_vocab_size()} distinct)"
        )
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": tok_str(v.unk_id),
        "pad_token": tok_str(v.pad_id),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": v.max_length,
    }
    if v.chat_template:
        cfg["chat_template"] = v.chat_template
    return tok.to_str(), cfg


def _byte_level_bpe(v: GGUFVocab, source: str) -> Any:
    """The 'gpt2' model: the file's merges, the pre-tokenizer its `pre` names (table above)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    family = PRE_FAMILIES.get(v.pre)
    if family is None:
        raise ValueError(
            f"{source}: GGUF pre-tokenizer {v.pre!r} is not supported; supported: {sorted(PRE_FAMILIES)}"
        )
    merges = []
    for m in v.merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"{source}: malformed tokenizer.ggml.merges entry {m!r} (expected 'left right')")
        merges.append((a, b))
    unk = v.tokens[v.unk_id] if v.unk_id is not None and 0 <= v.unk_id < len(v.tokens) else None
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(v.tokens)},
        merges=merges,
        unk_token=unk,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=family == "llama3",
    )
    tok = Tokenizer(bpe)
    if family == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif family == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        regex = _LLAMA3_REGEX if family == "llama3" else _QWEN2_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(v: GGUFVocab, source: str) -> Any:
    """The 'llama' model: merges from the scores, byte fallback, '▁' for spaces (docstring)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if len(v.scores) != len(v.tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.scores has {len(v.scores)} entries for {len(v.tokens)} tokens"
        )
    unk = v.tokens[v.unk_id] if v.unk_id is not None and 0 <= v.unk_id < len(v.tokens) else None
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(v.tokens)},
        merges=score_merges(v.tokens, v.scores),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    prefix = [normalizers.Prepend("▁")] if v.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if v.add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def score_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges that reproduce merging by score: (a, b) for every token a + b whose halves
    are both tokens, highest merged score first (then lower id, then shorter left half)."""
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    ranked = []
    for i, t in enumerate(tokens):
        if ids[t] != i:
            continue
        for k in range(1, len(t)):
            if t[:k] in ids and t[k:] in ids:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]


def hf_tokenizer(tokenizer_json: str, tokenizer_config: dict[str, Any]):
    """A transformers tokenizer built in memory (no files), as `AutoTokenizer` would load it."""
    from tokenizers import Tokenizer

    from ringserve.model.checkpoints.tokenizer import quiet_transformers

    quiet_transformers()
    from transformers import PreTrainedTokenizerFast

    kwargs = {k: v for k, v in tokenizer_config.items() if k != "tokenizer_class" and v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), **kwargs)
