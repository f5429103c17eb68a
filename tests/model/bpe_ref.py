"""An independent byte-level BPE encoder with llama.cpp's semantics, to check rebuilt tokenizers.

Nothing here comes from `tokenizers`: special tokens are split off first; each regex of the
pre-tokenizer's list then splits every piece into its matches and the gaps between them (both
kept, as llama.cpp's unicode_regex_split does); each word is mapped to GPT-2's byte alphabet and
merged pair by pair, lowest merge rank first, leftmost on ties.
"""

from __future__ import annotations

import functools

import regex

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# llama.cpp's regex list per pre-tokenizer name (src/llama-vocab.cpp), and whether whole words
# found in the vocabulary skip the merges (ignore_merges, llama3 only).
PRE = {
    "gpt2": ([GPT2], False),
    "smollm": ([r"\p{N}", GPT2], False),
    "llama-bpe": ([LLAMA3], True),
    "qwen2": ([QWEN2], False),
}


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _split(pieces: list[str], pattern: str) -> list[str]:
    out = []
    for p in pieces:
        pos = 0
        for m in regex.finditer(pattern, p):
            if m.start() > pos:
                out.append(p[pos : m.start()])
            if m.end() > m.start():
                out.append(m.group())
            pos = m.end()
        if pos < len(p):
            out.append(p[pos:])
    return out


class RefBPE:
    def __init__(self, tokens: list[str], merges: list[str], pre: str, specials: list[str]):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.regexes, self.ignore_merges = PRE[pre]
        self.specials = sorted(specials, key=len, reverse=True)

    def _word(self, word: str) -> list[int]:
        alpha = byte_alphabet()
        w = "".join(alpha[b] for b in word.encode("utf-8"))
        if self.ignore_merges and w in self.ids:
            return [self.ids[w]]
        syms = list(w)
        while len(syms) > 1:
            ranked = [
                (self.ranks.get((a, b), 1 << 62), i)
                for i, (a, b) in enumerate(zip(syms, syms[1:], strict=False))
            ]
            rank, i = min(ranked)
            if rank == 1 << 62:
                break
            syms[i : i + 2] = [syms[i] + syms[i + 1]]
        return [self.ids[s] for s in syms]

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        parts = (
            regex.split("(" + "|".join(regex.escape(s) for s in self.specials) + ")", text)
            if self.specials
            else [text]
        )
        for k, part in enumerate(parts):
            if k % 2 == 1:
                out.append(self.ids[part])
                continue
            pieces = [part] if part else []
            for rx in self.regexes:
                pieces = _split(pieces, rx)
            for word in pieces:
                out.extend(self._word(word))
        return out


TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; we've DONE it, haven't WE'LL?",
    "Numbers: 1234567, 3.14159, 2024-11-22, 0x1F, 1e-5 and -42.",
    "  leading spaces, double  spaces,\ttabs\t\tand trailing   ",
    "lines\n\nwith\r\nbreaks\n   indented\n",
    "café naïve résumé Ångström e\u0301 ß straße",
    "日本語のテキストと中文字符，한국어 텍스트",
    "emoji 👍🏽🚀🎉 and symbols ∑∫≠ → ★ ©®™",
    "Arabic مرحبا بالعالم and Hebrew שלום, digits ٣٤٥ ① ½ ²",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "a",
]
