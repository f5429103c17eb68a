"""Llama (`LlamaForCausalLM`: llama3 RoPE scaling, tied embeddings, optional q/k/v biases) and
Mistral (`MistralForCausalLM`: Llama's tree with a sliding attention window): the pre-norm
decoder layer (model/layers/block.py) over grouped-query attention and a SwiGLU MLP."""

from __future__ import annotations

from typing import Any

from ringserve.model.config import ModelConfig
from ringserve.model.families.base import (
    GGUF_LLAMA_LAYER,
    Family,
    GGUFNames,
    Tiny,
    llama_decoder,
    llama_layer_tensors,
)


def _options(d: dict[str, Any], source: str) -> dict[str, Any]:
    window = d.get("sliding_window")
    return {"attention_bias": bool(d.get("attention_bias", False)), "sliding_window": int(window) if window else None}


def _decoder(cfg: ModelConfig, plan: Any, backend: Any) -> Any:
    return llama_decoder(cfg, plan, backend, bias=cfg.attention_bias)


def _layer_tensors(cfg: ModelConfig):
    return llama_layer_tensors(cfg, bias=cfg.attention_bias)


LLAMA = Family(
    name="llama",
    summary="Llama 2/3.x: llama3 RoPE scaling, tied or untied embeddings, optional attention biases",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    options=_options,
    decoder=_decoder,
    layer_tensors=_layer_tensors,
    # exercises llama3 RoPE scaling and tied embeddings
    tiny=Tiny("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}),  # fmt: skip
    # llama.cpp's converter permutes q/k rows so each head's rotary pairs are adjacent
    gguf=GGUFNames("llama", GGUF_LLAMA_LAYER, permuted_qk=True),
)

MISTRAL = Family(
    name="mistral",
    summary="Mistral: Llama's layers with a sliding attention window (v0.2+: full attention)",
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    options=_options,
    decoder=_decoder,
    layer_tensors=_layer_tensors,
    # no sliding window here (v0.2+ style), so full attention
    tiny=Tiny("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),  # fmt: skip
)
