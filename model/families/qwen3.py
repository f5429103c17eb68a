"""Qwen3 (`Qwen3ForCausalLM`): the pre-norm decoder layer (model/layers/block.py) with RMSNorm over
each head's q and k before RoPE, biases only where config.json asks, head_dim decoupled from hidden / heads."""

from __future__ import annotations

from typing import Any

from ringserve.model.families.base import (
    GGUF_LLAMA_LAYER,
    GGUF_QK_NORM,
    Family,
    GGUFNames,
    Tiny,
    llama_decoder,
    llama_layer_tensors,
    qwen_window,
)


def _options(d: dict[str, Any], source: str) -> dict[str, Any]:
    return {"attention_bias": bool(d.get("attention_bias", False)), "sliding_window": qwen_window(d)}


QWEN3 = Family(
    name="qwen3",
    summary="Qwen3 (dense): q/k RMSNorm per head, head_dim decoupled",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    options=_options,
    decoder=lambda cfg, plan, backend: llama_decoder(cfg, plan, backend, bias=cfg.attention_bias, qk_norm=True),
    layer_tensors=lambda cfg: llama_layer_tensors(cfg, bias=cfg.attention_bias, qk_norm=True),
    # head_dim decoupled from hidden/heads, as in real Qwen3
    tiny=Tiny("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 48,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),  # fmt: skip
    gguf=GGUFNames("qwen3", GGUF_LLAMA_LAYER | GGUF_QK_NORM),
)
