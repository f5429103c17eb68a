"""The grouped matmul of mixture-of-experts layers (model/layers/moe.py): rows sorted by expert,
each contiguous group multiplied by its own expert's weight, `lhs [M, K] x w [G, K, N]` (int8:
`[G, N, K]` + scale `[G, N]`) with `group_sizes [G]` (summing to M) -> [M, N]. Decided once by the
compute plan (model/compute/plan.py `grouped`), never a dense product over every expert:

    tiles        CPU: a loop over the groups' row tiles (`tile` rows each; a group of n rows is
                 ceil(n / tile) of them, an empty group none), each tile through the plan's `Dot`
                 with the expert as the stack index (model/compute/dots.py `layer=`): ringserve's
                 kernel reads that expert's weight in place, so a step reads each chosen expert
                 once and no other
    ragged_dot   `jax.lax.ragged_dot` (GPU; XLA:CPU expands it into a product over every group,
                 slower than the dense all-experts one: bench/RESULTS.md#mixture-of-experts)
    megablox     Pallas megablox `gmm` (TPU; `jax.experimental.pallas.ops.tpu.megablox`), rows
                 padded to its 128-row tiles

    rows (sorted by expert), tile = 4:
        [ e0 e0 e0 e0 | e0 e2 e2 e5 ...]      items: (e0, rows 0-3), (e0, row 4), (e2, rows 5-6), ...
        each item reads the tile starting at its first row and keeps only its own rows

Figures: bench/RESULTS.md#mixture-of-experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

MEGABLOX_TILE = 128  # gmm's default row tile


@dataclasses.dataclass(frozen=True, slots=True)
class GroupedDot:
    name: str = "ragged_dot"  # "tiles", "ragged_dot" or "megablox"
    tile: int = 8  # the fewest rows of one tiles item (`rows`)
    max_tile: int = 128
    interpret: bool = False  # megablox in Pallas's interpreter (tests on CPU)

    def rows(self, m: int, groups: int) -> int:
        """Rows of one tiles item for M rows over G groups: about a group's mean (a power of two
        in [tile, max_tile]), so the rows multiplied past their group's end stay under M + G * tile
        and decode's few rows go in one item per expert; never more than M."""
        mean = max(1, m // groups)
        return min(m, max(self.tile, min(self.max_tile, 1 << (mean.bit_length() - 1))))

    def __call__(self, lhs: jax.Array, w: jax.Array, sizes: jax.Array, dot: Any, transposed: bool = False,
                 scale: jax.Array | None = None, base: jax.Array | int = 0, row0: jax.Array | int = 0) -> jax.Array:  # fmt: skip
        """lhs [M, K] (rows sorted by group, `sizes` [G] of them each from row `row0` on) x
        w[base + g] for each group g -> [M, N] in lhs's dtype, zero outside the groups' rows (an
        expert-parallel device's share: its experts' rows). w: [S, K, N] ([S, N, K]
        `transposed`), S >= base + G (a stack of layers' experts flattened: `base` = layer * G);
        `scale` [S, N]: int8 w."""
        if self.name == "tiles":
            return _tiles(lhs, w, sizes, dot, transposed, scale, base, row0, self.rows(lhs.shape[0], sizes.shape[0]))
        m = lhs.shape[0]
        lhs = jnp.roll(lhs, -row0, axis=0)  # the groups' rows first
        g = sizes.shape[0]
        if w.shape[0] != g:  # (only the tiles path reads a stack in place)
            w = jax.lax.dynamic_slice_in_dim(w, base, g)
            scale = None if scale is None else jax.lax.dynamic_slice_in_dim(scale, base, g)
        if scale is not None:
            w = w.astype(lhs.dtype)
        if transposed:
            w = jnp.swapaxes(w, 1, 2)
        out_dtype = jnp.float32 if scale is not None else lhs.dtype
        if self.name == "megablox":
            from jax.experimental.pallas.ops.tpu.megablox import gmm

            pad = -m % MEGABLOX_TILE  # padded rows join the last group and are dropped
            lhs_p = jnp.pad(lhs, ((0, pad), (0, 0)))
            y = gmm(lhs_p, w, sizes.at[-1].add(pad), preferred_element_type=out_dtype, interpret=self.interpret)[:m]
        else:
            y = jax.lax.ragged_dot(lhs, w, sizes, preferred_element_type=out_dtype)
        if scale is not None:
            row_group = jnp.repeat(jnp.arange(g), sizes, total_repeat_length=m)
            y = y * jnp.take(scale, row_group, axis=0)
        y = jnp.where(jnp.arange(m)[:, None] < sizes.sum(), y, 0)  # rows past the groups: zero
        return jnp.roll(y.astype(lhs.dtype), row0, axis=0)


def _tiles(lhs, w, sizes, dot, transposed, scale, base, row0, b: int) -> jax.Array:
    """The "tiles" path (the module docstring): a while loop over the work items, as many as the
    groups' ceil(n / b) tiles together."""
    m, k = lhs.shape
    n = w.shape[-2] if transposed else w.shape[-1]
    ends = row0 + jnp.cumsum(sizes)
    starts = ends - sizes
    per = (sizes + b - 1) // b  # items of each group
    item_ends = jnp.cumsum(per)
    lhs_p = jnp.pad(lhs, ((0, b), (0, 0)))  # a tile starting at any row < m stays in bounds
    rows = jnp.arange(b)[:, None]

    def item(j, out):
        g = jnp.searchsorted(item_ends, j, side="right")  # the group of item j
        r0 = starts[g] + (j - (item_ends[g] - per[g])) * b
        tile = jax.lax.dynamic_slice(lhs_p, (r0, 0), (b, k))
        y = dot(tile, w, transposed, scale, out_dtype=lhs.dtype, layer=base + g)
        old = jax.lax.dynamic_slice(out, (r0, 0), (b, n))
        return jax.lax.dynamic_update_slice(out, jnp.where(rows < ends[g] - r0, y, old), (r0, 0))

    out = jax.lax.fori_loop(0, item_ends[-1], item, jnp.zeros((m + b, n), lhs.dtype))  # (no groups: none)
    return out[:m]


def resolve_grouped(platform: str, interpret: bool = False) -> GroupedDot:
    """CPU: tiles; TPU: megablox where it imports (or interpreted where asked, for tests);
    otherwise ragged_dot."""
    if platform == "cpu" and not interpret:
        return GroupedDot("tiles")
    if platform == "tpu" or interpret:
        try:
            from jax.experimental.pallas.ops.tpu.megablox import gmm  # noqa: F401
        except ImportError:
            return GroupedDot()
        return GroupedDot("megablox", interpret=platform != "tpu")
    return GroupedDot()
