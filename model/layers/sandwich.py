"""Gemma 2 and 3's decoder layer: each sublayer's output is normed again before it joins the
residual stream (the "sandwich"), every norm Gemma's RMSNorm by (1 + weight), the MLP a GeGLU.

    x -> input_layernorm -> self_attn -> post_attention_layernorm -> + x
      -> pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm -> + x

(the HF module names, which are the state's keys). The attention's scale, soft cap and each
layer's sliding window are the backend's geometry's (model/compute/attention/base.py)."""

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


class SandwichBlock(nnx.Module):
    """`qk_norm`: Gemma 3's per-head RMSNorm on q and k (by 1 + weight too); `bias`: q/k/v biases
    (config.json's attention_bias)."""

    def __init__(self, cfg: ModelConfig, plan: Any, backend: Any, *, qk_norm: bool = False, bias: bool = False):
        h, i, eps, dt, tp = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, plan.jnp_dtype, plan.tp

        def norm() -> RMSNorm:
            return RMSNorm(h, eps, dt, plan.block_norm, unit_offset=True)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, plan, backend, bias=bias, qk_norm=qk_norm, unit_offset=True)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(h, i, dt, tp_split(2, 1, i, tp), tp_split(2, 0, i, tp), plan.dot, plan.quant, act="gelu_tanh")
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, cos, sin, kv, layer, fb, lora: LayerLora | None = None) -> tuple[jax.Array, Any]:
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, fb, lora)
        x, h = self.pre_feedforward_layernorm.add(x, self.post_attention_layernorm(a))
        return x + self.post_feedforward_layernorm(self.mlp(h, lora, layer)), kv
