"""The vocabulary axis of the sampler's [S, V] arrays: whole on one device, or split over the `tp`
mesh axis as the LM head computes it (vocab-parallel, model/compute/mesh.py), so the logits are
never gathered.

    VocabAxis       what the sampler's reductions over V go through (model/runtime/sampler.py):
                    plain ones over a whole row (axis None), or over this device's columns
                    combined across the shards by collectives of [S] or [S, k] (axis "tp")
    VocabSplit      the step's side: the mesh, and `run`, which calls a sampler function on
                    each device's columns of the logits under `jax.shard_map`

Device d of tp holds tokens [d * n, (d + 1) * n), n = V / tp (the LM head's column split):

    logits [S, V]   | d0: ids 0..n-1 | d1: ids n..2n-1 | ... |      each device: [S, n]
    grammar mask    | words 0..n/32-1 | ...                          (n a multiple of 32: a
                                                                     shard's bits are whole words)
    token counts    [slots, V] split the same way (the penalties read their own columns)

Every combine is exact: a maximum, a minimum and a count are the same whichever way they are
split, an argmax merges the shards' (max, first index) pairs taking the lowest shard holding
the maximum, and a top-k merges the shards' top-k candidates (lax.top_k keeps the lower index
first among equal values, and the shards are concatenated in id order: the merged order is
the whole row's). A float sum (softmax's normaliser, the top-p masses) adds the shards' partial
sums, whose rounding may differ from one sum over the whole row in the last bit. The random
draw reads the global token id (model/runtime/sampler.py `gumbel_noise`), so a seed draws the
same token on any split of the same logits.

A split is used where the LM head's columns are split (tp divides V) and every shard's columns
are whole mask words (V / tp a multiple of 32): Llama-3's 128,256 over 4 or 8, Qwen's 151,936
over 4 or 8, the tiny model's 2,048; otherwise (`VocabSplit.of` returns None) the logits are
whole on every device and the sampler runs as on one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class VocabAxis:
    """The last axis of the sampler's arrays: `size` tokens in all, `local` of them here
    (axis None: all of them, and every method is the plain reduction over the row)."""

    size: int
    local: int
    axis: str | None = None

    @classmethod
    def whole(cls, v: int) -> VocabAxis:
        return cls(v, v)

    @property
    def split(self) -> bool:
        return self.axis is not None

    def offset(self) -> jax.Array | int:
        """The global id of this device's first column."""
        return 0 if self.axis is None else jax.lax.axis_index(self.axis) * self.local

    def ids(self) -> jax.Array:
        """[1, local] int32 global token ids of this device's columns."""
        return (jnp.arange(self.local, dtype=jnp.int32) + self.offset())[None, :]

    def local_ids(self, ids: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """Global token ids as this device's column indices, `local` (out of range: a scatter
        with mode="drop" drops it) for ids elsewhere or not `valid`."""
        at = ids - self.offset()
        keep = (at >= 0) & (at < self.local)
        if valid is not None:
            keep &= valid
        return jnp.where(keep, at, self.local)

    # ---- reductions over the row (keepdims as given) ---------------------------------------
    def max(self, x: jax.Array, keepdims: bool = False) -> jax.Array:
        m = x.max(-1, keepdims=keepdims)
        return m if self.axis is None else jax.lax.pmax(m, self.axis)

    def min(self, x: jax.Array, keepdims: bool = False) -> jax.Array:
        m = x.min(-1, keepdims=keepdims)
        return m if self.axis is None else jax.lax.pmin(m, self.axis)

    def sum(self, x: jax.Array, keepdims: bool = False) -> jax.Array:
        s = x.sum(-1, keepdims=keepdims)
        return s if self.axis is None else jax.lax.psum(s, self.axis)

    def any(self, x: jax.Array, keepdims: bool = False) -> jax.Array:
        return self.max(x.astype(jnp.int32), keepdims) > 0

    def before(self, n: jax.Array) -> jax.Array:
        """Per row, the sum of `n` ([S] int) over the shards before this one (0 when whole):
        a count over the row up to this device's first column."""
        if self.axis is None:
            return jnp.zeros_like(n)
        every = jax.lax.all_gather(n, self.axis)  # [tp, S]
        me = jax.lax.axis_index(self.axis)
        return jnp.where(jnp.arange(every.shape[0])[:, None] < me, every, 0).sum(0)

    def softmax(self, x: jax.Array) -> jax.Array:
        """softmax over the row (jax.nn.softmax's bits when whole)."""
        if self.axis is None:
            return jax.nn.softmax(x, axis=-1)
        e = jnp.exp(x - jax.lax.stop_gradient(self.max(x, keepdims=True)))
        return e / self.sum(e, keepdims=True)

    def take(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """x[row, ids[row, j]] for global ids [S, n] (in range)."""
        if self.axis is None:
            return jnp.take_along_axis(x, ids, axis=-1)
        at = ids - self.offset()
        here = (at >= 0) & (at < self.local)
        got = jnp.take_along_axis(x, jnp.clip(at, 0, self.local - 1), axis=-1)
        return jax.lax.pmax(jnp.where(here, got, -jnp.inf), self.axis)

    def first_max(self, x: jax.Array, local_first_max: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """The global argmax of each row (lowest id on ties), from this device's
        `local_first_max` (an argmax of [S, local], lowest index on ties)."""
        idx = local_first_max(x)
        if self.axis is None:
            return idx
        m = jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0]
        ms, idxs = jax.lax.all_gather(m, self.axis), jax.lax.all_gather(idx, self.axis)  # [tp, S]
        shard = jnp.argmax(ms == ms.max(0, keepdims=True), axis=0)  # the first shard holding the max
        return shard.astype(jnp.int32) * self.local + jnp.take_along_axis(idxs, shard[None], axis=0)[0]

    def top_k(self, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """(values, global ids) of each row's k largest (k <= size), descending, lower id first
        on ties: each shard's min(k, local) largest, then the k largest of those."""
        vals, ids = jax.lax.top_k(x, min(k, self.local))
        ids = ids.astype(jnp.int32)
        if self.axis is None:
            return vals, ids
        ids = ids + self.offset()
        s = x.shape[0]
        every_v = jnp.moveaxis(jax.lax.all_gather(vals, self.axis), 0, 1).reshape(s, -1)  # [S, tp * k], id order
        every_i = jnp.moveaxis(jax.lax.all_gather(ids, self.axis), 0, 1).reshape(s, -1)
        top, at = jax.lax.top_k(every_v, k)
        return top, jnp.take_along_axis(every_i, at, axis=-1)

    def mask_words(self, mask: jax.Array) -> jax.Array:
        """This device's words of a packed [S, ceil(V / 32)] mask (bit t % 32 of word t // 32)."""
        if self.axis is None:
            return mask
        n = self.local // 32
        return jax.lax.dynamic_slice_in_dim(mask, jax.lax.axis_index(self.axis) * n, n, axis=1)


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """A vocabulary of `size` split over the mesh's `tp` axis (the module docstring)."""

    mesh: Mesh
    size: int

    @classmethod
    def of(cls, mesh: Mesh, v: int) -> VocabSplit | None:
        """The split of `v` tokens over `mesh`, or None where the logits stay whole: one
        device, or a split the LM head does not make or whose shards are not whole mask words."""
        tp = mesh.shape.get(AXIS, 1)
        if tp == 1 or v % tp or (v // tp) % 32:
            return None
        return cls(mesh, v)

    @property
    def axis(self) -> VocabAxis:
        """The axis as each device sees it inside `run`."""
        tp = self.mesh.shape[AXIS]
        return VocabAxis(self.size, self.size // tp, AXIS)

    def run(self, fn: Callable[..., Any], split: tuple[Any, ...], whole: tuple[Any, ...], out_specs: Any) -> Any:
        """fn(*split, *whole) on each device: the `split` arrays [..., V] (or None) by their last
        axis (each device gets its columns), the `whole` pytrees replicated; `out_specs` as
        shard_map's (`spec`: split by the last axis, P(): the same on every device)."""
        split = tuple(None if a is None else jax.lax.with_sharding_constraint(a, self.sharding(a.ndim)) for a in split)
        whole = jax.tree.map(jnp.asarray, whole)  # (Python scalars: tests' SamplingBatch defaults)
        in_specs = tuple(P() if a is None else self.spec(a.ndim) for a in split) + tuple(P() for _ in whole)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*split, *whole)

    def spec(self, ndim: int) -> P:
        """An ndim-array split by its last axis."""
        return P(*([None] * (ndim - 1)), AXIS)

    def sharding(self, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(ndim))
