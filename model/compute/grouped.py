"""The grouped matmul of mixture-of-experts layers (model/layers/moe.py): rows sorted by expert,
each contiguous group multiplied by its own expert's weight, `lhs [M, K] x rhs [G, K, N]` with
`group_sizes [G]` (summing to M) -> [M, N]. Decided once by the compute plan (model/compute/plan.py
`grouped`), never a dense product over every expert:

    ragged_dot   `jax.lax.ragged_dot` (XLA's ragged dot: CPU, GPU, and TPU where megablox is absent)
    megablox     Pallas megablox `gmm` (TPU; `jax.experimental.pallas.ops.tpu.megablox`), rows
                 padded to its 128-row tiles

Figures (ragged_dot against a dense all-experts product and the active-parameter floor):
bench/RESULTS.md#mixture-of-experts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

GROUPED = ("ragged_dot", "megablox")
MEGABLOX_TILE = 128  # gmm's default row tile


@dataclasses.dataclass(frozen=True, slots=True)
class GroupedDot:
    name: str = "ragged_dot"
    interpret: bool = False  # megablox in Pallas's interpreter (tests on CPU)

    def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype=None) -> jax.Array:
        """lhs [M, K] (rows sorted by group) x rhs [G, K, N] -> [M, N] in `out_dtype` (lhs's if None)."""
        out_dtype = out_dtype or lhs.dtype
        if self.name == "megablox":
            from jax.experimental.pallas.ops.tpu.megablox import gmm

            m = lhs.shape[0]
            pad = -m % MEGABLOX_TILE  # padded rows join the last group and are dropped
            lhs_p = jnp.pad(lhs, ((0, pad), (0, 0)))
            sizes = group_sizes.at[-1].add(pad)
            return gmm(lhs_p, rhs, sizes, preferred_element_type=out_dtype, interpret=self.interpret)[:m]
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def resolve_grouped(platform: str, interpret: bool = False) -> GroupedDot:
    """megablox on TPU (or interpreted where asked, for tests) where it imports; else ragged_dot."""
    if platform == "tpu" or interpret:
        try:
            from jax.experimental.pallas.ops.tpu.megablox import gmm  # noqa: F401
        except ImportError:
            return GroupedDot()
        return GroupedDot("megablox", interpret=platform != "tpu")
    return GroupedDot()
