"""Loading a tokenizer through transformers, without its torch advisory.

No ringserve process needs torch, but importing transformers without it logs "PyTorch was not
found. Models won't be available..." once per process, which reads as an error at start-up.
Every transformers import in the serving path goes through here.

Where torch is installed (the test extra, an RL trainer's venv), transformers 5 imports it as
soon as `AutoTokenizer` is used (its auto module reaches `configuration_utils`, which imports
torch): ~2.5 s of start-up and ~250 MB of RSS in each process that tokenizes (SmolLM2's
tokenizer: 3.4 s and 366 MB against 0.9 s and 122 MB). The processes ringserve owns (its actors,
`ringserve serve` and `generate`) call `actors.transport.actor.without_torch()` first, so
transformers there behaves as in an install without torch, which is README command 1's; a user's
own process is never touched.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import threading
from pathlib import Path
from typing import Any


def quiet_transformers() -> None:
    """Silence transformers' advisory warnings when torch is absent (call before importing it)."""
    if importlib.util.find_spec("torch") is None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def load_tokenizer(path: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(path)`, quietly."""
    quiet_transformers()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# ---- the actors' tokenizer: `tokenizers` alone ----------------------------------------------
#
# The scheduler and detokenizer only decode ids (and the scheduler maps the vocabulary for
# llguidance), and the frontend encodes text and decodes single ids: transformers' fast tokenizer
# does all of that by calling its `tokenizers` backend. Importing transformers costs each process
# ~1.7 s of CPU and ~70 MB at start-up, on the cores the runner is loading on. So a tokenizer that
# transformers loaded once is kept as its backend's JSON with the few facts they read
# (`decoder_spec`), under $RINGSERVE_CACHE/tokenizers/<hash of the tokenizer's files and both
# libraries' versions>.json, and later starts load that with `tokenizers` (~0.15 s). The frontend's
# `FastTokenizer` loads transformers' own tokenizer after start-up, for chat templates and
# anything else it is asked (model/checkpoints/tokenizer.py `FastTokenizer.full`).

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")  # fmt: skip


class Decoder:
    """A tokenizer's decoding from its `tokenizers` backend, with transformers' fast tokenizer's
    answers: `decode(ids, skip_special_tokens=...)`, `eos_token_id`, `len()`; `backend_json`
    is what llguidance maps the vocabulary from."""

    def __init__(self, spec: dict[str, Any]):
        import tokenizers

        self.backend_json: str = spec["backend"]
        self.backend = tokenizers.Tokenizer.from_str(self.backend_json)
        self.eos_token_id: int | None = spec["eos_token_id"]
        self._len = int(spec["len"])

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        # transformers 5's fast decode passes only skip_special_tokens to the backend (its
        # `spaces_between_special_tokens` applies to slow tokenizers)
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def __len__(self) -> int:
        return self._len


class FastTokenizer(Decoder):
    """The frontend's tokenizer: `encode` and `decode` from the `tokenizers` backend, with
    transformers' fast tokenizer's answers; `chat_template` and `apply_chat_template(...,
    tokenize=False)` from the kept template and special tokens, rendered by transformers' own
    renderer (`transformers.utils.chat_template_utils`, which imports neither torch nor the
    tokenizer classes); everything else (`__call__`, a tokenized chat, ...) from transformers'
    own tokenizer, `full`, loaded on first use. So neither start-up nor serving (completions or
    chats) loads transformers' tokenizer, and `engine.tokenizer` still answers all it does.

    Why not load it in the background once the engine serves (as before): its imports and load
    are 1.6 CPU-s without torch, 2.4 with it, GIL-bound in the frontend's process, and they ran
    beside the first requests of a server started for a burst (SmolLM2 bf16, 64 requests sent
    once compiled: the first prefill steps 550-950 ms against ~410 after)."""

    def __init__(self, spec: dict[str, Any], path: str | Path):
        super().__init__(spec)
        self.bos_token_id: int | None = spec["bos_token_id"]
        chat = spec.get("chat")
        self._chat: dict[str, Any] | None = chat if isinstance(chat, dict) else None
        self._path = str(path)
        self._full: Any = None
        self._lock = threading.Lock()

    @property
    def chat_template(self) -> Any:
        """transformers' `chat_template` (a template, named templates, or None)."""
        return self._chat["template"] if self._chat is not None else self.full.chat_template

    def apply_chat_template(self, conversation: Any, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True, **kwargs: Any) -> Any:  # fmt: skip
        """transformers' `apply_chat_template`: rendered here (`tokenize=False`, no callables
        among `tools`, no transformers-only options), else by `full`."""
        chat = self._chat
        render = _chat_renderer() if chat is not None and not tokenize else None
        if chat is None or render is None or any(callable(t) for t in tools or ()) or _HF_CHAT_OPTIONS & kwargs.keys():
            return self.full.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, **kwargs)  # fmt: skip
        normalize, render_jinja = render
        template = _pick_template(chat["template"], chat_template, tools)
        if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))  # fmt: skip
        chats = [normalize(c) for c in (conversation if batched else [conversation])]
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        rendered, _ = render_jinja(conversations=chats, tools=tools, documents=documents, chat_template=template,
                                   continue_final_message=continue_final_message,
                                   add_generation_prompt=add_generation_prompt, **{**chat["special"], **kwargs})  # fmt: skip
        return rendered if batched else rendered[0]

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):  # pairs, padding, truncation, tensors: transformers'
            return list(self.full.encode(text, add_special_tokens=add_special_tokens, **kwargs))
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    @property
    def backend_tokenizer(self) -> Any:  # transformers' name for it (actors/frontend/limits.py reads it)
        return self.backend

    @property
    def full(self) -> Any:
        """transformers' tokenizer for this path (loaded once, on first use)."""
        with self._lock:
            if self._full is None:
                self._full = load_tokenizer(self._path)
            return self._full

    def __getattr__(self, name: str) -> Any:  # only for what this class does not answer itself
        if name.startswith("__") or name in ("_full", "_lock", "_path", "_chat"):
            raise AttributeError(name)
        return getattr(self.full, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.full(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FastTokenizer({self._path!r}, {len(self)} tokens)"


# apply_chat_template options only transformers' own tokenizer takes (a tokenized result's, the
# control tokens' sanitizing): with any of them the call goes to `full`
_HF_CHAT_OPTIONS = frozenset({"sanitize_control_tokens", "return_assistant_tokens_mask", "return_dict", "padding",
                              "truncation", "max_length", "return_tensors", "tokenizer_kwargs"})  # fmt: skip


@functools.cache
def _chat_renderer() -> tuple[Any, Any] | None:
    """transformers' message normalizing and template rendering (`apply_chat_template`'s own
    steps), or None where this transformers has them elsewhere (then `full` renders). Once a
    process (`quiet_transformers` looks torch up on disk)."""
    quiet_transformers()
    try:
        from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template
    except ImportError:
        return None
    return _normalize_chat_messages, render_jinja_template


def _pick_template(kept: Any, asked: str | None, tools: list | None) -> str:
    """transformers' `get_chat_template`: the asked template (or one of the named ones), else the
    tokenizer's (of named ones: "tool_use" with tools, else "default")."""
    if isinstance(kept, dict):
        if asked is not None and asked in kept:
            return str(kept[asked])
        if asked is None:
            if tools is not None and "tool_use" in kept:
                return str(kept["tool_use"])
            if "default" in kept:
                return str(kept["default"])
            raise ValueError(f"This model has multiple chat templates with no default specified; name one of "
                             f"{sorted(kept)} as chat_template")  # fmt: skip
    if asked is not None:
        return asked
    if kept is None:
        raise ValueError("Cannot use apply_chat_template because this processor does not have a chat template.")
    return str(kept)


def decoder_spec(tok: Any) -> dict[str, Any] | None:
    """What `Decoder` needs of a transformers tokenizer, or None where its decode is more than
    the backend's (a slow tokenizer; clean_up_tokenization_spaces in effect)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or not _decodes_as_fast(type(tok)):
        return None
    if tok.clean_up_tokenization_spaces and not (
        type(backend.model).__name__ == "BPE"
        and not getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    ):
        return None  # transformers cleans the text up after the backend: keep transformers
    from copy import copy

    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos, bos = tok.eos_token_id, tok.bos_token_id
    return {"backend": backend.to_str(), "eos_token_id": None if eos is None else int(eos), "len": len(tok),
            "bos_token_id": None if bos is None else int(bos), "encodes": _encodes_as_fast(tok),
            "chat": _chat_spec(tok)}  # fmt: skip


def _chat_spec(tok: Any) -> dict[str, Any] | None:
    """What `FastTokenizer.apply_chat_template` renders with (the template or named templates,
    and the special tokens every render is given), or None where the tokenizer renders its own
    way (a subclass's apply_chat_template or get_chat_template) or these are not plain JSON."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tok)
    if (cls.apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template
            or cls.get_chat_template is not PreTrainedTokenizerBase.get_chat_template):  # fmt: skip
        return None
    chat = {"template": tok.chat_template, "special": dict(tok.special_tokens_map)}
    try:
        return chat if json.loads(json.dumps(chat)) == chat else None
    except (TypeError, ValueError):
        return None


def _decodes_as_fast(cls: Any) -> bool:
    """`cls.decode` is transformers' fast tokenizer's, not a subclass's own."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode


def _encodes_as_fast(tok: Any) -> bool:
    """`tok.encode(text, add_special_tokens=...)` is its backend's encode: transformers' fast
    tokenizer's own encode path, special tokens kept whole (not `split_special_tokens`)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tok)
    return (cls._encode_plus is TokenizersBackend._encode_plus and cls.encode is PreTrainedTokenizerBase.encode
            and not getattr(tok, "split_special_tokens", False))  # fmt: skip


def _spec_path(path: Path) -> Path | None:
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    from ringserve.model.paths import cache_dir

    h = hashlib.sha256()
    try:
        h.update(
            f"spec 3 transformers {version('transformers')} tokenizers {version('tokenizers')}\0".encode()
        )
    except PackageNotFoundError:
        return None
    found = False
    named = sorted(str(f.relative_to(path)) for f in (path / "additional_chat_templates").glob("*.jinja"))
    for name in (*TOKENIZER_FILES, *named):  # (the named templates: the kept chat templates are theirs too)
        f = path / name
        if f.is_file():
            found = found or name in TOKENIZER_FILES
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return cache_dir("tokenizers", h.hexdigest()[:24] + ".json") if found else None


def load_decoder(path: str | Path) -> Any:
    """The tokenizer at `path` for decoding: a `Decoder` from the cache when transformers has
    loaded this tokenizer before (with these library versions), else transformers' tokenizer,
    whose spec is then kept for the next start."""
    return _load(path, encoder=False)


def load_encoder(path: str | Path) -> Any:
    """The tokenizer at `path` for the frontend: a `FastTokenizer` from the cache when
    transformers has loaded it before and its backend encodes as transformers does, else
    transformers' tokenizer (its spec then kept for the next start)."""
    return _load(path, encoder=True)


def _load(path: str | Path, encoder: bool) -> Any:
    spec_file = _spec_path(Path(path))
    if spec_file is None:
        return load_tokenizer(path)
    if (tok := _from_spec(spec_file, path, encoder)) is not None:
        return tok
    # A first start: the frontend, the scheduler and the detokenizer each ask at once. One loads
    # transformers' tokenizer and keeps its spec, the others wait for it and load the spec
    # (SmolLM2: 3.9 CPU-s each for transformers', 0.15 from the spec, on the cores the runner is
    # building its kernels and compiling on)
    from ringserve.model.paths import one_maker

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(one_maker(spec_file))
        except OSError:  # a cache that cannot be written: each loads its own
            return load_tokenizer(path)
        if (tok := _from_spec(spec_file, path, encoder)) is not None:  # made while this one waited
            return tok
        tok = load_tokenizer(path)
        spec = decoder_spec(tok)
        if spec is not None:
            _keep(spec_file, spec)
        return tok


def _from_spec(spec_file: Path, path: str | Path, encoder: bool) -> Any:
    """The tokenizer from its kept spec, or None (none kept; damaged: made again; the frontend's
    where the backend does not encode as transformers does)."""
    if not spec_file.is_file():
        return None
    try:
        spec = json.loads(spec_file.read_text())
        if not encoder:
            return Decoder(spec)
        if spec["encodes"]:
            return FastTokenizer(spec, path)
    except Exception:  # noqa: BLE001 -- a damaged entry: made again
        pass
    return None


def _keep(spec_file: Path, spec: dict[str, Any]) -> None:
    """Write the spec whole or not at all (0600; a concurrent writer writes the same); a cache
    that cannot be written only costs the next start its speed."""
    import tempfile

    tmp = None
    try:
        spec_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".spec-", dir=spec_file.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        os.replace(tmp, spec_file)
    except OSError as e:
        import logging

        logging.getLogger(__name__).warning("tokenizer cache %s not written: %s", spec_file.parent, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
