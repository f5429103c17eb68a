"""Mixtral (`MixtralForCausalLM`): Mistral's attention over a mixture-of-experts MLP
(model/layers/moe.py): top-k (2) of a softmax router, always renormalized; HF's checkpoint names
its experts' projections w1 (gate), w3 (up), w2 (down) under `block_sparse_moe`."""

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
)


def _options(d: dict[str, Any], source: str) -> dict[str, Any]:
    window = d.get("sliding_window")
    return {"attention_bias": False, "sliding_window": int(window) if window else None,
            **moe_options(d, source, experts="num_local_experts", size="intermediate_size", norm_topk=True)}  # fmt: skip


MIXTRAL = Family(
    name="mixtral",
    summary="Mixtral: Mistral's attention, top-2 routed experts (w1/w3/w2), renormalized",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    options=_options,
    decoder=lambda cfg, plan, backend: moe_decoder(cfg, plan, backend),
    layer_tensors=lambda cfg: moe_layer_tensors(cfg),
    moe_tensors=lambda cfg: moe_tensors(cfg, prefix="block_sparse_moe", names=("w1", "w3", "w2")),
    tiny=Tiny("MixtralConfig", {"tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2,
                                "sliding_window": None,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),  # fmt: skip
    lora_modules=MOE_LORA_MODULES,
    # llama.cpp writes Mixtral as `llama` with `llama.expert_count`, q/k permuted as Llama's, each
    # expert's size as feed_forward_length; older files hold one tensor per expert (ffn_gate.E.weight)
    gguf=GGUFNames(
        "llama",
        gguf_moe_layer(prefix="block_sparse_moe", names=("w1", "w3", "w2"), per_expert=True),
        permuted_qk=True,
        moe=GGUFMoe(norm_topk_prob=None, experts_field="num_local_experts", expert_size=False),
    ),
)
