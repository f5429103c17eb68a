"""The decoder-only families: Llama (incl. llama3 RoPE, tied embeddings), Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm), Mistral (optional sliding window). One forward, switched by config.

`forward` runs one step over the densely packed new tokens of every row (model/step_inputs.py):
matmuls see the flat [T, hidden] tokens, attention goes through the backend's interface
(model/attention/base.py). The decoder layers run under one `lax.scan` over the stacked
parameter tree (model/params.py), carrying the hidden states and the whole KV cache, so XLA
compiles one layer body and updates the cache in place; on CPU, where a scanned layer's weights
are copied out of the stack every step, the tree holds per-layer weights and the layers are
traced one after another (model/executor.py: resolve_layer_loop).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from model.attention.base import AttentionBackend
from model.checkpoints.config import ModelConfig
from model.layers import (
    apply_rope,
    gated_mlp,
    invariant_matmul,
    rms_norm,
    rope_inv_freq,
    rope_tables,
    rowwise,
)


class CausalLM:
    """The model's static description; parameters and KV cache are passed to every call."""

    def __init__(self, cfg: ModelConfig, attn: AttentionBackend, layer_unroll: int = 1, deterministic: bool = False,
                 logits_vocab_major: bool = False):  # fmt: skip
        self.cfg = cfg
        self.logits_vocab_major = logits_vocab_major and not deterministic
        self.mm = invariant_matmul if deterministic else jnp.matmul  # every projection and the LM head
        self.deterministic = deterministic
        self.attn = attn
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        self.layer_unroll = layer_unroll

    def norm(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """RMSNorm of x [T, ...] over its last axis (batch-invariant in the deterministic mode)."""
        eps = self.cfg.rms_norm_eps
        if not self.deterministic:
            return rms_norm(x, w, eps)
        flat = x.reshape(-1, x.shape[-1])
        return rowwise(lambda a: rms_norm(a, w, eps), flat).reshape(x.shape)

    def forward(self, params: dict, ids: jax.Array, fb: Any, kv: Any) -> tuple[jax.Array, Any]:
        """Final hidden states [T, H] of the step's tokens, and the updated KV cache."""
        cfg, attn, mm = self.cfg, self.attn, self.mm
        t = ids.shape[0]
        cos, sin = rope_tables(fb.positions, self.inv_freq)
        x = jnp.take(params["embed"], ids, axis=0)

        def layer(carry, lp):
            x, kv, i = carry
            h = self.norm(x, lp["attn_norm"])
            q, k, v = mm(h, lp["wq"]), mm(h, lp["wk"]), mm(h, lp["wv"])
            if cfg.qkv_bias:
                q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = self.norm(q, lp["q_norm"])
                k = self.norm(k, lp["k_norm"])
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kv = attn.write(kv, i, k, v, fb)
            o = attn.attend(q, kv, i, fb)
            x = x + mm(o.reshape(t, cfg.q_size), lp["wo"])
            h = self.norm(x, lp["mlp_norm"])
            x = x + gated_mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"], mm)
            return (x, kv, i + 1), None

        if isinstance(params["layers"], list):  # per-layer weights (model/params.py: unstack_layers)
            carry = (x, kv, 0)
            for lp in params["layers"]:
                carry, _ = layer(carry, lp)
            x, kv, _ = carry
        else:
            (x, kv, _), _ = jax.lax.scan(layer, (x, kv, jnp.int32(0)), params["layers"], unroll=self.layer_unroll)
        return self.norm(x, params["final_norm"]), kv

    def logits(self, params: dict, h: jax.Array) -> jax.Array:
        """f32 logits [S, V] of hidden states h [S, H] (tied checkpoints reuse the embedding)."""
        w = params["lm_head"].T if "lm_head" in params else params["embed"]  # [V, H]
        if self.logits_vocab_major:
            # [V, S] then transposed: XLA:CPU runs the [V, H] x [H, S] form 1.5-3.5x faster for a
            # few rows (SmolLM2's 49,152 x 576 head, 32 rows: 28.5 ms against 41.7 as h @ embed.T
            # and 102 as h @ lm_head; the same from 64 rows up)
            return jax.lax.dot_general(w, h, (((1,), (1,)), ((), ()))).T.astype(jnp.float32)
        return self.mm(h, w.T).astype(jnp.float32)
