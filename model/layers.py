"""Building blocks shared by the model families: linear, RMSNorm, gated MLP, rotary embedding.

Modules are Flax NNX modules built from already-loaded arrays (no random init: weights always
come from a checkpoint). Linear weights are stored `[in, out]` (the transpose of HF's `[out, in]`)
so every projection is `x @ w`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from model.checkpoints.config import RopeConfig


class Linear(nnx.Module):
    def __init__(self, w: ArrayLike, b: ArrayLike | None = None):
        self.w = nnx.Param(w)
        self.b = nnx.Param(b) if b is not None else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.w[...]
        if self.b is not None:
            y = y + self.b[...]
        return y


class RMSNorm(nnx.Module):
    def __init__(self, w: ArrayLike, eps: float):
        self.w = nnx.Param(w)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in f32 whatever the compute dtype, as HF does.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.w[...] * xf.astype(x.dtype)


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)), the Llama/Qwen/Mistral MLP."""

    def __init__(self, gate: Linear, up: Linear, down: Linear):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with llama3 / linear scaling applied.

    Computed in float32 the way transformers does, so positions in the thousands rotate by the
    same angles as the reference to the last bit that matters."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(rope.theta), exponent)).astype(np.float32)
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention: pairs are (i, i + d/2)). x: [T, heads, D], positions: [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
