"""Qwen2 (`Qwen2ForCausalLM`): the pre-norm decoder layer (model/layers/block.py) with q/k/v
biases always; a sliding window where config.json turns it on (`use_sliding_window`)."""

from __future__ import annotations

from typing import Any

from ringserve.model.families.base import (
    GGUF_LLAMA_LAYER,
    Family,
    GGUFNames,
    Tiny,
    llama_decoder,
    llama_layer_tensors,
    qwen_window,
)


def _options(d: dict[str, Any], source: str) -> dict[str, Any]:
    return {"attention_bias": True, "sliding_window": qwen_window(d)}


QWEN2 = Family(
    name="qwen2",
    summary="Qwen2 / Qwen2.5: q/k/v biases",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    options=_options,
    decoder=lambda cfg, plan, backend: llama_decoder(cfg, plan, backend, bias=True),
    layer_tensors=lambda cfg: llama_layer_tensors(cfg, bias=True),
    tiny=Tiny("Qwen2Config", {"tie_word_embeddings": False, "use_sliding_window": False,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),  # fmt: skip
    gguf=GGUFNames("qwen2", GGUF_LLAMA_LAYER, config={"use_sliding_window": False}),
)
