"""Self-attention around the attention backend: q/k/v projections (column-parallel by heads),
optional biases (Qwen2) and per-head q/k RMSNorm (Qwen3), RoPE, the backend's KV write and
attention (model/compute/attention/base.py: `write`, `attend`), the row-parallel output
projection."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ringserve.model.compute.mesh import tp_split
from ringserve.model.config import ModelConfig
from ringserve.model.layers.linear import Linear, project
from ringserve.model.layers.lora import LayerLora, apply_lora
from ringserve.model.layers.norm import RMSNorm
from ringserve.model.layers.rope import apply_rope


class Attention(nnx.Module):
    """`plan`: the compute plan (model/compute/plan.py: dot, norms, dtype, quantization, tp);
    `backend`: the attention backend; `bias`: q/k/v biases; `qk_norm`: RMSNorm over head_dim on
    q and k before RoPE (`unit_offset`: Gemma's, by 1 + weight). The scores' scale, soft cap and
    each layer's sliding window are the backend's (its geometry, model/compute/attention/base.py)."""

    def __init__(self, cfg: ModelConfig, plan: Any, backend: Any, *, bias: bool = False, qk_norm: bool = False,
                 unit_offset: bool = False):  # fmt: skip
        h, q, kv, tp, dt = cfg.hidden_size, cfg.q_size, cfg.kv_size, plan.tp, plan.jnp_dtype
        col_q, col_kv = tp_split(2, 1, cfg.num_heads, tp), tp_split(2, 1, cfg.num_kv_heads, tp)
        self.q_proj = Linear(h, q, dt, col_q, bias, plan.dot, plan.quant)
        self.k_proj = Linear(h, kv, dt, col_kv, bias, plan.dot, plan.quant)
        self.v_proj = Linear(h, kv, dt, col_kv, bias, plan.dot, plan.quant)
        self.o_proj = Linear(q, h, dt, tp_split(2, 0, q, tp), dot=plan.dot, quant=plan.quant)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, plan.norm, unit_offset) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, plan.norm, unit_offset) if qk_norm else None
        self.cfg = cfg
        self.backend = backend

    def __call__(self, x, cos, sin, kv, layer, fb, lora: LayerLora | None = None) -> tuple[jax.Array, Any]:
        """x [T, H] (normed) -> attention output [T, H], and the KV cache with layer `layer`'s
        new keys and values written; `lora`: the layer's adapters (model/layers/lora.py), if served."""
        cfg, t = self.cfg, x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj, layer=layer)  # one custom call where it can
        q = apply_lora(lora, "q_proj", x, q).reshape(t, cfg.num_heads, cfg.head_dim)
        k = apply_lora(lora, "k_proj", x, k).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = apply_lora(lora, "v_proj", x, v).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv = self.backend.write(kv, layer, k, v, fb)
        o = self.backend.attend(q, kv, layer, fb).reshape(t, cfg.q_size)
        return apply_lora(lora, "o_proj", o, self.o_proj(o, layer)), kv
