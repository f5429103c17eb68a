"""RoPE's cos and sin: on CPU every program gathers them from tables made on the host
(model/layers/rope.py rope_tables with table_positions), elsewhere it computes them. XLA:CPU fuses cos and
sin into every layer's q and k rotation and evaluates them per head; the tables avoid that."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.config import RopeConfig, rope_inv_freq
from ringserve.model.layers.rope import ROPE_TABLE_MAX, rope_tables

ROPES = [RopeConfig(theta=100000.0), RopeConfig(rope_type="llama3", theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0, original_max_position_embeddings=8192)]  # fmt: skip


@pytest.mark.parametrize("rope", ROPES, ids=["default", "llama3"])
def test_tables_give_the_computed_values_correctly_rounded(rope):
    inv = rope_inv_freq(rope, 64)
    span = 4096
    positions = jnp.asarray(
        np.r_[0, 1, 17, 1000, span - 1, np.random.default_rng(0).integers(0, span, 59)], jnp.int32
    )
    got = jax.jit(lambda p: rope_tables(p, inv, span))(positions)
    computed = jax.jit(lambda p: rope_tables(p, inv))(positions)
    angles = (
        np.asarray(positions, np.float32)[:, None] * inv.astype(np.float32)[None, :]
    )  # f32 angles, as computed
    exact = (np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64)))
    for g, c, e in zip(got, computed, exact, strict=True):
        assert g.shape == c.shape == (len(positions), 1, 32)
        np.testing.assert_array_equal(np.asarray(g)[:, 0], e.astype(np.float32))  # correctly rounded
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(c), rtol=0, atol=2e-6
        )  # XLA's cos and sin: within ulps


def _hlo(fn, positions) -> str:
    return jax.jit(fn).lower(positions).as_text()


def test_a_program_with_tables_computes_no_cos_or_sin():
    inv = rope_inv_freq(ROPES[0], 64)
    positions = jnp.zeros(8, jnp.int32)
    assert "cosine" not in _hlo(lambda p: rope_tables(p, inv, 512), positions)
    assert "cosine" in _hlo(lambda p: rope_tables(p, inv), positions)
    too_long = ROPE_TABLE_MAX // inv.size + 1  # a table over the cap is not baked in: computed instead
    assert "cosine" in _hlo(lambda p: rope_tables(p, inv, too_long), positions)
