"""Building blocks shared by the model families, as pure functions of arrays: RMSNorm, the
gated MLP, rotary embedding. Weights come from the parameter tree (model/params.py); linear
weights are `[in, out]`, so every projection is `x @ w`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from model.checkpoints.config import RopeConfig


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in f32 whatever the compute dtype, as HF does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, mm=jnp.matmul) -> jax.Array:
    """down(silu(gate(x)) * up(x)), the Llama/Qwen/Mistral MLP."""
    return mm(jax.nn.silu(mm(x, w_gate)) * mm(x, w_up), w_down)


INVARIANT_ROWS = 64


def rowwise(f, x: jax.Array) -> jax.Array:
    """f over the rows of x [T, ...], computed as T / 64 calls on one fixed shape [64, ...].

    Kernels pick their summation order by shape: measured on XLA CPU, row 0 of x @ w differs in
    most of its bits between T = 2 and T = 64, and an RMSNorm over 576 features between fewer
    and more than 8 rows. With one shape for every call, a token's row is computed the same way
    whatever the step's other rows are: the deterministic mode (`enable_deterministic_inference`)
    pays the padding and the loop for it."""
    t = x.shape[0]
    tiles = jnp.pad(x, [(0, -t % INVARIANT_ROWS)] + [(0, 0)] * (x.ndim - 1))
    out = jax.lax.map(f, tiles.reshape(-1, INVARIANT_ROWS, *x.shape[1:]))
    return out.reshape(-1, *out.shape[2:])[:t]


def invariant_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, K] @ w [K, N], batch-invariant (see `rowwise`)."""
    return rowwise(lambda a: a @ w, x)


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


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [T, 1, D/2] for the step's positions; computed once per step, used by every layer."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention: pairs are (i, i + d/2)). x: [T, heads, D]."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
