"""The decoder-only families: Llama (incl. llama3 RoPE, tied embeddings), Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm), Mistral (optional sliding window). One forward, switched by config.

`forward` runs one step over the densely packed new tokens of every row (model/step_inputs.py):
matmuls see the flat [T, hidden] tokens, attention goes through the backend's interface
(model/attention/base.py). The decoder layers run under one `lax.scan` over the stacked
parameter tree (model/params.py), carrying the hidden states and the whole KV cache, so XLA
compiles one layer body and updates the cache in place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from model.attention.base import AttentionBackend
from model.checkpoints.config import ModelConfig
from model.layers import apply_rope, gated_mlp, rms_norm, rope_inv_freq, rope_tables


class CausalLM:
    """The model's static description; parameters and KV cache are passed to every call."""

    def __init__(self, cfg: ModelConfig, attn: AttentionBackend, layer_unroll: int = 1):
        self.cfg = cfg
        self.attn = attn
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        self.layer_unroll = layer_unroll

    def forward(self, params: dict, ids: jax.Array, fb: Any, kv: Any) -> tuple[jax.Array, Any]:
        """Final hidden states [T, H] of the step's tokens, and the updated KV cache."""
        cfg, attn = self.cfg, self.attn
        t = ids.shape[0]
        cos, sin = rope_tables(fb.positions, self.inv_freq)
        x = jnp.take(params["embed"], ids, axis=0)

        def layer(carry, lp):
            x, kv, i = carry
            h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
            q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
            if cfg.qkv_bias:
                q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kv = attn.write(kv, i, k, v, fb)
            o = attn.attend(q, kv, i, fb)
            x = x + o.reshape(t, cfg.q_size) @ lp["wo"]
            h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
            x = x + gated_mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"])
            return (x, kv, i + 1), None

        (x, kv, _), _ = jax.lax.scan(layer, (x, kv, jnp.int32(0)), params["layers"], unroll=self.layer_unroll)
        return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), kv

    def logits(self, params: dict, h: jax.Array) -> jax.Array:
        """f32 logits [S, V] of hidden states h [S, H] (tied checkpoints reuse the embedding)."""
        if "lm_head" in params:
            return (h @ params["lm_head"]).astype(jnp.float32)
        return (h @ params["embed"].T).astype(jnp.float32)
