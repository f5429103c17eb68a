"""Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biases, `qkv_bias`) over a
mixture-of-experts MLP (model/layers/moe.py) with a shared expert beside the routed ones, scaled
by sigmoid(x @ shared_expert_gate). Every layer sparse (model/families/base.py `moe_options`)."""

from __future__ import annotations

from typing import Any

from ringserve.model.families.base import (
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
    return {"attention_bias": bool(d.get("qkv_bias", True)), "sliding_window": qwen_window(d),
            **moe_options(d, source)}  # fmt: skip


QWEN2_MOE = Family(
    name="qwen2_moe",
    summary="Qwen2-MoE (Qwen1.5-MoE): q/k/v biases, top-k routed experts and a gated shared expert",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    options=_options,
    decoder=lambda cfg, plan, backend: moe_decoder(cfg, plan, backend, bias=cfg.attention_bias, shared=True),
    layer_tensors=lambda cfg: moe_layer_tensors(cfg, bias=cfg.attention_bias),
    moe_tensors=lambda cfg: moe_tensors(cfg, shared=True),
    tiny=Tiny("Qwen2MoeConfig", {"tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
                                 "norm_topk_prob": False, "use_sliding_window": False,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),  # fmt: skip
    lora_modules=MOE_LORA_MODULES,
    # llama.cpp's qwen2moe never renormalizes the top-k weights (norm_topk_prob is not in the file)
    gguf=GGUFNames("qwen2moe", gguf_moe_layer(shared=True), moe=GGUFMoe(norm_topk_prob=False, shared=True)),
)
