"""What a model name means: `tiny`, `smollm2`, a model directory or a .gguf file."""

from __future__ import annotations

from pathlib import Path

KNOWN = ("tiny", "smollm2")  # names made here: `tiny` generated, `smollm2` built by `ringserve fetch-model`


def resolve_model(name: str | None) -> tuple[Path, Path]:
    """(what the runner loads, the HF-format directory holding the tokenizer) for a model name:
    None or 'smollm2' (fetched once), 'tiny' (generated once), a model directory or a .gguf."""
    if name == "tiny":
        from ringserve.model.checkpoints.tiny import tiny_model_path

        path = tiny_model_path("llama")
    elif name in (None, "smollm2"):
        from ringserve.model.checkpoints.fetch import fetch_model

        path = fetch_model("smollm2")
    else:
        path = Path(name)
    if not path.exists():
        raise ValueError(not_found(str(name)))
    if path.is_dir():
        from ringserve.model.families import read_config

        read_config(path)  # a directory that is no model (no config.json, an architecture not served) is told now
        return path, path
    from ringserve.model.checkpoints.gguf import gguf_tokenizer_dir

    return path, gguf_tokenizer_dir(path)


def not_found(name: str) -> str:
    """What a user is told of a model that is neither a known name nor a path that exists."""
    p = Path(name).expanduser()
    hub = name.count("/") == 1 and not name.startswith(("/", ".", "~")) and not p.parent.exists()
    msg = f"model {name!r}: no such directory or .gguf file (looked for {p.absolute()})"
    if hub:
        msg += ("; it looks like a Hugging Face Hub id, and ringserve never downloads from the Hub: give a "
                "local directory (config.json, *.safetensors, tokenizer files) or a .gguf file")  # fmt: skip
    return msg + f"; known names: {', '.join(repr(k) for k in KNOWN)} (`ringserve fetch-model smollm2` builds that one)"
