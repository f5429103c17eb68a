"""A GGUF's byte-level BPE vocabulary, rebuilt as a Hugging Face `tokenizers` tokenizer.

A GGUF stores the tokenizer as data: `tokenizer.ggml.tokens` (the vocabulary in id order, in
GPT-2's byte-to-unicode alphabet), `token_type` (3 = control, 4 = user-defined: both are added
special tokens), `merges` ("a b" strings in rank order) and `pre`, the name llama.cpp gives the
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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

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
    """The tokenizer fields of one GGUF file (ids index `tokens`)."""

    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    pre: str
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    max_length: int = 8192


def build_tokenizer(v: GGUFVocab, source: str) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json dict) equivalent to the GGUF's tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

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

    def tok_str(i: int | None) -> str | None:
        return v.tokens[i] if i is not None and 0 <= i < len(v.tokens) else None

    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(v.tokens)},
        merges=merges,
        unk_token=tok_str(v.unk_id),
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
    bos = tok_str(v.bos_id)
    if v.add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, int(v.bos_id or 0))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(v.tokens, v.token_types, strict=True)
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    if tok.get_vocab_size() != len(v.tokens):  # a duplicate token string would shift every id after it
        raise ValueError(
            f"{source}: tokenizer.ggml.tokens has duplicates ({len(v.tokens)} entries, {tok.get_vocab_size()} distinct)"
        )
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": tok_str(v.eos_id),
        "unk_token": tok_str(v.unk_id),
        "pad_token": tok_str(v.pad_id),
        "add_bos_token": bool(v.add_bos and bos is not None),
        "clean_up_tokenization_spaces": False,
        "model_max_length": v.max_length,
    }
    if v.chat_template:
        cfg["chat_template"] = v.chat_template
    return tok.to_str(), cfg


def hf_tokenizer(tokenizer_json: str, tokenizer_config: dict[str, Any]):
    """A transformers tokenizer built in memory (no files), as `AutoTokenizer` would load it."""
    from tokenizers import Tokenizer

    from ringserve.model.checkpoints.tokenizer import quiet_transformers

    quiet_transformers()
    from transformers import PreTrainedTokenizerFast

    kwargs = {k: v for k, v in tokenizer_config.items() if k != "tokenizer_class" and v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), **kwargs)
