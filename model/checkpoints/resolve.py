"""What a model name means: `tiny`, `smollm2`, a model directory or a .gguf file."""

from __future__ import annotations

from pathlib import Path


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
        raise ValueError(f"model_path={str(path)!r}: no such directory or file")
    if path.is_dir():
        return path, path
    from ringserve.model.checkpoints.gguf import gguf_tokenizer_dir

    return path, gguf_tokenizer_dir(path)
