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
