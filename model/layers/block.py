"""The decoder layer of the Llama lineage (Llama, Mistral, Qwen2, Qwen3): pre-norm attention and
a pre-norm gated MLP, each added to the residual stream. A family picks its attention's options
(biases, q/k norm) and builds it through `PreNormBlock` (model/families/)."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ringserve.model.compute.mesh import tp_split
from ringserve.model.config import ModelConfig
from ringserve.model.layers.attention import Attention
from ringserve.model.layers.lora import LayerLora
from ringserve.model.layers.mlp import GatedMLP
from ringserve.model.layers.norm import RMSNorm


class PreNormBlock(nnx.Module):
    """input_layernorm -> self_attn -> + residual -> post_attention_layernorm -> mlp -> + residual
    (the HF module names, which are the state's keys: model/weights/state.py)."""

    def __init__(self, cfg: ModelConfig, plan: Any, backend: Any, *, bias: bool = False, qk_norm: bool = False):
        h, i, eps, dt, tp = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, plan.jnp_dtype, plan.tp
        self.input_layernorm = RMSNorm(h, eps, dt, plan.block_norm)
        self.self_attn = Attention(cfg, plan, backend, bias=bias, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(h, eps, dt, plan.block_norm)
        self.mlp = GatedMLP(h, i, dt, tp_split(2, 1, i, tp), tp_split(2, 0, i, tp), plan.dot, plan.quant)

    def __call__(self, x, cos, sin, kv, layer, fb, lora: LayerLora | None = None) -> tuple[jax.Array, Any]:
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, fb, lora)
        x, h = self.post_attention_layernorm.add(x, a)
        return x + self.mlp(h, lora, layer), kv
