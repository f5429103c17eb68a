"""Where ringserve keeps what it makes or fetches (see resolve.py for what a model name means).

    $RINGSERVE_CACHE (default ~/.cache/ringserve)/
        models/tiny-<family>-s<seed>/   the generated tiny checkpoints (`tiny`)
        smollm2-135m-instruct/          `ringserve fetch-model smollm2`
        gguf-tokenizers/<hash>/         tokenizer files rebuilt from a .gguf
        xla/                            the persistent compilation cache
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache root, or a path inside it (nothing is created)."""
    root = Path(os.environ.get("RINGSERVE_CACHE") or Path.home() / ".cache" / "ringserve")
    return root.joinpath(*parts)
