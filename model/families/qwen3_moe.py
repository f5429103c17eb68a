"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k RMSNorm per head) over a
mixture-of-experts MLP (model/layers/moe.py): softmax router, top-k, `norm_topk_prob`, no shared
expert. Every layer sparse (`mlp_only_layers` / `decoder_sparse_step` mixing dense layers in are
refused: model/families/base.py `moe_options`)."""

from __future__ import annotations

from typing import Any

from ringserve.model.families.base import (
    GGUF_QK_NORM,
    MOE_LORA_MODULES,
    Family,
    GGUFMoe,
    GGUFNames,
    Tiny,
    gguf_moe_layer,
    moe_decoder,
    moe_layer_tensors,
    moe_options,
    moe_tensors,
    qwen_window,
)


def _options(d: dict[str, Any], source: str) -> dict[str, Any]:
    return {"attention_bias": bool(d.get("attention_bias", False)), "sliding_window": qwen_window(d),
            **moe_options(d, source)}  # fmt: skip


QWEN3_MOE = Family(
    name="qwen3_moe",
    summary="Qwen3-MoE: Qwen3's attention, top-k routed experts (norm_topk_prob), no shared expert",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    options=_options,
    decoder=lambda cfg, plan, backend: moe_decoder(cfg, plan, backend, bias=cfg.attention_bias, qk_norm=True),
    layer_tensors=lambda cfg: moe_layer_tensors(cfg, bias=cfg.attention_bias, qk_norm=True),
    moe_tensors=lambda cfg: moe_tensors(cfg),
    tiny=Tiny("Qwen3MoeConfig", {"tie_word_embeddings": False, "head_dim": 48, "num_experts": 8,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),  # fmt: skip
    lora_modules=MOE_LORA_MODULES,
    # llama.cpp's qwen3moe renormalizes the top-k weights always (norm_topk_prob is not in the file)
    gguf=GGUFNames("qwen3moe", gguf_moe_layer() | GGUF_QK_NORM, moe=GGUFMoe(norm_topk_prob=True)),
)
