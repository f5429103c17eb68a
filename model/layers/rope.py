"""Rotary position embedding (HF's rotate-half convention): cos and sin per step (`rope_tables`,
from model/config.py's `rope_inv_freq`), the rotation (`apply_rope`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# The most entries (positions x D/2) of a cos or sin table baked into a program (4 MB of f32).
ROPE_TABLE_MAX = 1 << 20


@functools.lru_cache(maxsize=8)
def _rope_table(positions: int, inv_freq: bytes) -> np.ndarray:
    """[2, positions, D/2]: cos and sin of position x inv_freq (f32 angles), made once for every
    program that traces them (a server traces a few dozen)."""
    angles = np.arange(positions, dtype=np.float32)[:, None] * np.frombuffer(inv_freq, np.float32)[None, :]
    return np.stack([np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))]).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, table_positions: int | None = None,
                ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(cos, sin) [T, 1, D/2] for the step's positions, used by every layer.

    With `table_positions` (CPU: the KV pages' whole span, every position a step can hold) they
    are gathered from tables made once on the host, else computed in the program. XLA:CPU fuses
    cos and sin into every layer's q and k rotation and evaluates them per head and layer, and
    drops optimization barriers before fusion: SmolLM2's 2048-token bf16 prefill spent 2.9 ms
    a layer in the q rotation's fusion (0.4 ms with the tables). The tables hold the same f32
    angles' cos and sin, correctly rounded (computed in float64)."""
    if table_positions is not None and table_positions * inv_freq.size <= ROPE_TABLE_MAX:
        table = _rope_table(table_positions, inv_freq.astype(np.float32).tobytes())
        cs = jnp.take(jnp.asarray(table), positions, axis=1, mode="clip")  # [2, T, D/2]
        return cs[0][:, None, :], cs[1][:, None, :]
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention: pairs are (i, i + d/2)). x: [T, heads, D]."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
