"""Loading a tokenizer through transformers, without its torch advisory.

No ringserve process needs torch, but importing transformers without it logs "PyTorch was not
found. Models won't be available..." once per process, which reads as an error at start-up.
Every transformers import in the serving path goes through here.
"""

from __future__ import annotations

import importlib.util
import os
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
