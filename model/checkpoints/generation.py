"""A model's own default sampling parameters: the ones its `generation_config.json` sets (as
vLLM's `--generation-config auto` and SGLang's `--sampling-defaults model` read them). A request
that leaves one of them out samples with the model's; `--sampling-defaults openai` keeps the
plain API defaults (temperature 1, top_p 1). JAX-free: the frontend reads it at start.

HF's file holds only what its author set (`save_pretrained` writes the values that differ from
transformers' defaults), so a key that is absent is no default of the model's; `do_sample` is not
read (vLLM's choice too): a client asks for greedy with temperature 0.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# generation_config.json's keys that are defaults of ringserve's sampling parameters (same names)
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def read_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """{name: value} of the sampling defaults `model_dir/generation_config.json` sets ({} for a
    GGUF file, a directory without one, or a file that is not a JSON object)."""
    path = Path(model_dir) / "generation_config.json"
    if not Path(model_dir).is_dir() or not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("%s: not read (%s); no model sampling defaults", path, e)
        return {}
    if not isinstance(d, dict):
        return {}
    return {k: d[k] for k in KEYS if d.get(k) is not None}
