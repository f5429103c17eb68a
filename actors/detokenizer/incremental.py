"""Incremental detokenization and stop-string search (pure functions of a tokenizer).

Region map of one request's output ids inside `IncrementalDecoder`:

    ids:  [ ........ | prefix_offset .......... | read_offset .......... ]
                       └ context re-decoded so    └ ids not yet turned into
                         BPE merges across the      emitted text
                         boundary come out right

Each call receives only the NEW ids (nothing is ever resent). It decodes
`ids[prefix_offset:read_offset]` and `ids[prefix_offset:]`; the difference is the new text,
emitted only if it does not end in U+FFFD (an incomplete UTF-8 sequence: the byte-level BPE
has produced part of a character). Otherwise it waits for more ids. `finish()` flushes the
rest, replacement characters included, since no more bytes will come.
"""

from __future__ import annotations

from typing import Any, Protocol


class Decodes(Protocol):
    def decode(self, ids: list[int], **kw: Any) -> str: ...


class IncrementalDecoder:
    __slots__ = ("tok", "ids", "prefix_offset", "read_offset", "kw", "text")

    def __init__(self, tokenizer: Decodes, *, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.kw = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.kw["spaces_between_special_tokens"] = False
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, **self.kw) if ids else ""

    def push(self, new_ids: list[int]) -> str:
        """Append new ids; return the newly complete text ('' while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def finish(self) -> str:
        """Flush whatever is left (the request ended; no more bytes will complete it)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
