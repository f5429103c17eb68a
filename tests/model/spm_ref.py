"""An independent SentencePiece (GGUF 'llama' model) encoder with llama.cpp's semantics, to check
rebuilt tokenizers (src/llama-vocab.cpp: llm_tokenizer_spm and the SPM case of tokenize).

Nothing here comes from `tokenizers`: control, unknown and user-defined tokens are split off the
raw text first, longest first; each remaining fragment gets ' ' in front (add_space_prefix) and
its spaces become '▁'; then, starting from its characters, the adjacent pair whose concatenation
is a token of the highest score is merged (leftmost on ties) until no pair is a token; a symbol
that is no token becomes its UTF-8 bytes' <0xNN> tokens. Quadratic, for test-sized texts.
"""

from __future__ import annotations

from collections.abc import Sequence

SPLIT_OFF = (2, 3, 4)  # unknown, control, user-defined


class RefSPM:
    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                 add_space_prefix: bool, bos_id: int | None = None, add_bos: bool = False):  # fmt: skip
        self.ids: dict[str, int] = {}
        for i, t in enumerate(tokens):
            self.ids.setdefault(t, i)
        self.scores = scores
        self.split_off = sorted({t for t, ty in zip(tokens, types, strict=True) if ty in SPLIT_OFF}, key=len,
                                reverse=True)  # fmt: skip
        self.add_space_prefix = add_space_prefix
        self.bos = bos_id if add_bos else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        fragments: list[str | int] = [text]
        for tok in self.split_off:
            out: list[str | int] = []
            for f in fragments:
                if isinstance(f, int):
                    out.append(f)
                    continue
                for j, part in enumerate(f.split(tok)):
                    if j:
                        out.append(self.ids[tok])
                    if part:
                        out.append(part)
            fragments = out
        ids = [self.bos] if add_special_tokens and self.bos is not None else []
        for f in fragments:
            if isinstance(f, int):
                ids.append(f)
            else:
                ids += self._merge(((" " if self.add_space_prefix else "") + f).replace(" ", "▁"))
        return ids

    def _merge(self, text: str) -> list[int]:
        symbols = list(text)
        while True:
            best = None  # (score, -position)
            for i in range(len(symbols) - 1):
                t = self.ids.get(symbols[i] + symbols[i + 1])
                if t is not None and (best is None or self.scores[t] > best[0]):
                    best = (self.scores[t], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        ids = []
        for s in symbols:
            if s in self.ids:
                ids.append(self.ids[s])
            else:
                ids += [self.ids[f"<0x{b:02X}>"] for b in s.encode()]
        return ids
