"""The decoder-only families: Llama (incl. llama3 RoPE, tied embeddings), Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm), Mistral (optional sliding window). One module tree, switched by config.

`CausalLM.__call__` runs one ragged step over flat tokens (see model/attention.py for the block
layout); matmuls see only the flat [T, hidden] tokens, attention sees [NB, block] query blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention import paged_attention, write_kv
from model.checkpoints.config import ModelConfig
from model.layers import GatedMLP, Linear, RMSNorm, apply_rope, rope_inv_freq
from model.step_inputs import ForwardBatch

Arr = Any  # jax.Array on device; np.ndarray while the host builds it


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, w: Mapping[str, Arr], prefix: str):
        def lin(name: str, bias: bool = False) -> Linear:
            return Linear(w[f"{prefix}{name}.weight"], w.get(f"{prefix}{name}.bias") if bias else None)

        self.q = lin("q_proj", cfg.qkv_bias)
        self.k = lin("k_proj", cfg.qkv_bias)
        self.v = lin("v_proj", cfg.qkv_bias)
        self.o = lin("o_proj")
        self.q_norm = RMSNorm(w[f"{prefix}q_norm.weight"], cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(w[f"{prefix}k_norm.weight"], cfg.rms_norm_eps) if cfg.qk_norm else None
        self.cfg = cfg

    def __call__(self, x, batch: ForwardBatch, kv, inv_freq, page_size: int, chunk_pages: int):
        cfg = self.cfg
        t = x.shape[0]
        q = self.q(x).reshape(t, cfg.num_heads, cfg.head_dim)
        k = self.k(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, batch.positions, inv_freq)
        k = apply_rope(k, batch.positions, inv_freq)
        k_cache = write_kv(kv[0], k, batch.out_loc)
        v_cache = write_kv(kv[1], v, batch.out_loc)
        nb = batch.committed_len.shape[0]
        blk = t // nb
        out = paged_attention(
            q.reshape(nb, blk, cfg.num_heads, cfg.head_dim),
            batch.positions.reshape(nb, blk),
            k_cache,
            v_cache,
            batch.block_pages,
            batch.committed_len,
            page_size=page_size,
            chunk_pages=chunk_pages,
            scale=cfg.head_dim**-0.5,
            sliding_window=cfg.sliding_window,
        )
        return self.o(out.reshape(t, cfg.q_size)), (k_cache, v_cache)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, w: Mapping[str, Arr], i: int):
        p = f"model.layers.{i}."
        self.input_norm = RMSNorm(w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.attn = Attention(cfg, w, p + "self_attn.")
        self.post_norm = RMSNorm(w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.mlp = GatedMLP(
            Linear(w[p + "mlp.gate_proj.weight"]), Linear(w[p + "mlp.up_proj.weight"]), Linear(w[p + "mlp.down_proj.weight"])
        )

    def __call__(self, x, batch, kv, inv_freq, page_size, chunk_pages):
        a, kv = self.attn(self.input_norm(x), batch, kv, inv_freq, page_size, chunk_pages)
        x = x + a
        return x + self.mlp(self.post_norm(x)), kv


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, w: Mapping[str, Arr]):
        self.cfg = cfg
        self.embed = nnx.Param(w["model.embed_tokens.weight"])  # [V, H]
        self.layers = nnx.List([DecoderLayer(cfg, w, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], cfg.rms_norm_eps)
        # lm_head stored [H, V]; tied checkpoints reuse the embedding (transposed at use).
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(w["lm_head.weight"])
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg.rope, cfg.head_dim)))

    def __call__(self, ids: jax.Array, batch: ForwardBatch, kv_caches: list, page_size: int, chunk_pages: int):
        """Run all layers on flat tokens; returns (final hidden [T, H], updated kv caches)."""
        x = jnp.take(self.embed[...], ids, axis=0)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, kv = layer(x, batch, kv, self.inv_freq[...], page_size, chunk_pages)
            new_caches.append(kv)
        return self.norm(x), new_caches

    def logits(self, h: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return (h @ self.embed[...].T).astype(jnp.float32)
        return (h @ self.lm_head[...]).astype(jnp.float32)


def hf_to_ours(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """HF names/layouts -> the arrays CausalLM takes: linear weights transposed to [in, out],
    cast to the compute dtype; norms kept in f32-compatible dtype too. Fails naming a missing tensor."""
    out: dict[str, np.ndarray] = {}
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        needed.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        needed += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        needed += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        needed += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if cfg.qkv_bias:
            needed += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        if cfg.qk_norm:
            needed += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    h, hd, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    expect = {
        "embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "q_proj.weight": (cfg.q_size, h),
        "k_proj.weight": (cfg.kv_size, h), "v_proj.weight": (cfg.kv_size, h), "o_proj.weight": (h, cfg.q_size),
        "gate_proj.weight": (cfg.intermediate_size, h), "up_proj.weight": (cfg.intermediate_size, h),
        "down_proj.weight": (h, cfg.intermediate_size), "q_norm.weight": (hd,), "k_norm.weight": (hd,),
        "q_proj.bias": (cfg.q_size,), "k_proj.bias": (cfg.kv_size,), "v_proj.bias": (cfg.kv_size,),
    }  # fmt: skip
    for n in needed:
        a = np.asarray(tensors[n])
        want = next((shape for suffix, shape in expect.items() if n.endswith(suffix)), (h,))
        if tuple(a.shape) != want:
            raise ValueError(f"tensor {n!r} has shape {tuple(a.shape)}, but config.json implies {want}")
        if n.endswith("proj.weight") or n == "lm_head.weight":
            a = a.T
        out[n] = np.ascontiguousarray(a.astype(dtype))
    return out
