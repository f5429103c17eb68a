"""The model families, by HF architecture: the registry that loading, `make-tiny-model`, PEFT,
GGUF, quantization and `ringserve models` consult. A family's file holds what is its own
(model/families/base.py `Family`); adding one is its file, its tests and one line in `FAMILIES`.
No family file imports another, and none imports JAX at module level (tests/test_structure.py):
the frontend reads configs through this registry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ringserve.model.config import ModelConfig
from ringserve.model.families.base import Family
from ringserve.model.families.gemma import GEMMA2, GEMMA3
from ringserve.model.families.llama import LLAMA, MISTRAL
from ringserve.model.families.mixtral import MIXTRAL
from ringserve.model.families.qwen2 import QWEN2
from ringserve.model.families.qwen2_moe import QWEN2_MOE
from ringserve.model.families.qwen3 import QWEN3
from ringserve.model.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, QWEN3_MOE, QWEN2_MOE,
                                                   MIXTRAL)}  # fmt: skip
ARCHITECTURES: dict[str, Family] = {a: f for f in FAMILIES.values() for a in f.architectures}


def family(name: str) -> Family:
    """The family called `name` (a ModelConfig's `family`)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model family {name!r} is not served; families: {sorted(FAMILIES)}") from None


def family_of(d: dict[str, Any], source: str = "config.json") -> Family:
    """The family serving a config.json dict: by its `architectures`, else its `model_type`."""
    archs = d.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    for f in FAMILIES.values():
        if d.get("model_type") in f.model_types:
            return f
    raise ValueError(f"{source}: unsupported architecture {archs or d.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}")


def parse_config(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a config.json dict, read by its family; ValueError naming the field."""
    return family_of(d, source).config(d, source)


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a model directory's config.json; ValueError saying what is missing."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory (or a .gguf file)")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{cfg}: missing; a model directory needs config.json, *.safetensors and tokenizer files")
    try:
        d = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg}: malformed JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{cfg}: expected a JSON object, got {type(d).__name__}")
    return parse_config(d, source=str(cfg))


def gguf_family(arch: str, moe: bool = False) -> Family | None:
    """The family llama.cpp's `general.architecture` names (model/checkpoints/gguf.py); `moe`:
    the file has experts (`{arch}.expert_count` > 0), which tells Mixtral from Llama (both
    `llama`). An architecture only one family writes is that family's either way."""
    named = [f for f in FAMILIES.values() if f.gguf is not None and f.gguf.arch == arch]
    return next((f for f in named if (f.gguf.moe is not None) == moe), named[0] if named else None)  # type: ignore[union-attr]


__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "family", "family_of", "gguf_family", "parse_config", "read_config"]
