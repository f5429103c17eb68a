"""What the front doors bound before the work starts: how deep a request may nest, and how long a
text prompt may be before it certainly cannot fit the context (so it is refused untokenized).

Nesting. No request needs more than a few levels (a batch of sampling_params with stop lists is
four), but a decoder recurses once per level: past ~1,000 msgspec raises RecursionError, and the
code that walks a decoded value (repr, validation) can too. So every surface holds a request to
`MAX_DEPTH` levels and names the field and the limit when it refuses:

    HTTP    `json_too_deep(body)` scans the raw body before it is decoded (top-level object = 1)
    socket  a frame too deep for the decoder is answered `Failed` (ipc_server.py); the free-form
            values that do decode (sampling_params, session_params, verb arguments) are held to
            the limit by `check_depth` where every surface validates them (inputs.py, verbs.py)

Prompt length. `bytes_per_token(tokenizer)` is the most bytes of text one token can stand for,
when the tokenizer's pipeline makes that certain (None otherwise): a text of n bytes is then at
least ceil(n / bytes_per_token) tokens, and one whose bound reaches the context length is
refused without tokenizing it (a 10^6-token text took 10 s to be refused). The bound holds when
nothing in the pipeline can make text vanish: no normalizer that removes characters (NFC / NFD
shrink a text at most `UNICODE_SHRINK` times, counted in), no pre-tokenizer that drops what it
splits on, a BPE model whose unknown characters, if any, are one token each, and no added token
that swallows the whitespace beside it. Every other tokenizer is tokenized in full, as before.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np

from ringserve.kvmem.allocator import cdiv

MAX_DEPTH = 64  # lists / objects nested in one request, at any front door

_CHUNK = 1 << 20  # bytes of a JSON body scanned per step
_STEP = np.zeros(256, np.int8)  # +1 opens a container, -1 closes one
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def too_deep(where: str, limit: int = MAX_DEPTH) -> str:
    return f"{where}: nested deeper than the limit of {limit} levels"


def json_too_deep(body: bytes, limit: int = MAX_DEPTH) -> str | None:
    """None if the JSON text `body` nests at most `limit` arrays / objects deep, else the error
    naming the top-level field the deep value is in ("request body" when there is none).

    Brackets inside strings do not count. Once `\\\\` and `\\"` are blanked out (same length),
    every quote left delimits a string, so a bracket is structural exactly when an even number
    of quotes precede it. Scanned in chunks with NumPy: linear, and free for a body with fewer
    than `limit` opening brackets in all."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None
    clean = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    data = np.frombuffer(clean, np.uint8)
    depth, quotes, colon = 0, 0, -1  # carried over chunks; colon: the last top-level key's ':'
    for start in range(0, len(data), _CHUNK):
        c = data[start : start + _CHUNK]
        q = c == ord('"')
        outside = ((np.cumsum(q, dtype=np.int64) - q + quotes) & 1) == 0
        level = depth + np.cumsum(_STEP[c] * outside, dtype=np.int64)  # depth after each byte
        over = np.flatnonzero(level > limit)
        end = over[0] if len(over) else len(c)
        keys = np.flatnonzero((c[:end] == ord(":")) & outside[:end] & (level[:end] == 1))
        if len(keys):
            colon = start + int(keys[-1])
        if len(over):
            return too_deep(_key_before(body, clean, colon), limit)
        depth, quotes = int(level[-1]), quotes + int(q.sum())
    return None


def _key_before(body: bytes, clean: bytes, colon: int) -> str:
    """The object key that ends just before the ':' at `colon` (quotes found in `clean`)."""
    if colon < 0:
        return "request body"
    end = clean.rfind(b'"', 0, colon)
    start = clean.rfind(b'"', 0, end) if end > 0 else -1
    try:
        key = msgspec.json.decode(body[start : end + 1]) if start >= 0 else None
    except msgspec.DecodeError:
        key = None
    return key if isinstance(key, str) and key else "request body"


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """ValueError naming `where` if `value` nests lists / tuples / dicts more than `limit` deep
    (`value` itself a list or dict is level 1). Iterative, so any depth is safe to check."""
    if not isinstance(value, list | tuple | dict):
        return
    stack = [(value, 1)]
    while stack:
        v, level = stack.pop()
        if level > limit:
            raise ValueError(too_deep(where, limit))
        items = v.values() if isinstance(v, dict) else v
        stack.extend((x, level + 1) for x in items if isinstance(x, list | tuple | dict))


# ---- prompt length before tokenizing -----------------------------------------------------------
UNICODE_SHRINK = 4  # NFC / NFD make a text at most 3x shorter in UTF-8 (Hangul jamo, the Kelvin sign)
_KEEPS_EVERYTHING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}  # pre-tokenizers that drop nothing


def bytes_per_token(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of the caller's text one token can stand for, if certain (see the
    module docstring); None when the tokenizer is not a `tokenizers` pipeline this knows."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 -- an unknown tokenizer: no bound, tokenize in full
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    model = spec.get("model") or {}
    if shrink is None or not _keeps_everything(spec.get("pre_tokenizer")) or model.get("type") != "BPE":
        return None  # WordPiece / Unigram / WordLevel: one unknown token can stand for a whole word
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None  # a run of unknown characters is one token
    # byte-level BPE spells its tokens one character per byte (GPT-2's alphabet of 256): those
    # count one byte each (translated to one ASCII letter), any other character its UTF-8
    one = _ONE_BYTE if _has(spec.get("pre_tokenizer"), "ByteLevel") else {}
    longest = 4 if model.get("unk_token") is not None else 1  # an unknown character: one token
    vocab = model.get("vocab") or {}
    longest = max(longest, max((len(t.translate(one).encode("utf-8", "surrogatepass")) for t in vocab), default=0))
    for added in spec.get("added_tokens") or []:  # matched in the raw text
        if added.get("lstrip") or added.get("rstrip"):
            return None  # it swallows any run of whitespace beside it
        longest = max(longest, len(str(added.get("content", "")).encode("utf-8", "surrogatepass")))
    return shrink * longest


def _gpt2_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE writes bytes as (GPT-2's bytes_to_unicode)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return frozenset(map(chr, kept)) | frozenset(chr(256 + i) for i in range(len(moved)))


_ONE_BYTE = str.maketrans(dict.fromkeys(_gpt2_alphabet(), "a"))


def _has(pre: dict[str, Any] | None, kind: str) -> bool:
    if pre is None:
        return False
    return pre.get("type") == kind or any(_has(p, kind) for p in pre.get("pretokenizers") or [])


def _normalizer_shrink(n: dict[str, Any] | None) -> int | None:
    """How many times shorter (UTF-8) the normalizer can make a text; None: unbounded/unknown."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind == "Sequence":
        total = 1
        for part in n.get("normalizers") or []:
            s = _normalizer_shrink(part)
            if s is None:
                return None
            total *= s
        return total
    if kind in ("NFC", "NFD"):
        return UNICODE_SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
        if not (isinstance(pattern, str) and pattern and isinstance(content, str) and content):
            return None  # a regex, or replacing with nothing
        return max(1, cdiv(len(pattern.encode()), len(content.encode())))
    return None  # NFKC / NFKD, Lowercase, Strip, StripAccents, Bert, Precompiled, ...


def _keeps_everything(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_everything(p) for p in pre.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return pre.get("behavior", "Isolated") != "Removed"
    return kind in _KEEPS_EVERYTHING
