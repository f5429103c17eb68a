"""Static-shape attention for GPUs: every loop bound is known when the program is compiled.

A runtime trip count costs a device-to-host round trip per iteration on a GPU (a while loop's
predicate is read by the host: ~80 us per layer per iteration measured on an H100). Here each
program is compiled for a context bucket C (powers of two from `context_bucket_min` up to the
longest context); a step runs the smallest program whose C holds its longest row. Inside, the
tiles (model/compute/attention/tiles.py) read keys 0..C-1 in `chunk`-key pieces with a loop of
C / chunk iterations fixed at compile time (unrolled when short), all tiles at once:

    for c in range(C // chunk):          # static
        K, V = pages[c*cp:(c+1)*cp] of every tile's row    [Hkv, NT, chunk, D]
        online softmax of every tile over those keys (masked past its own positions)

The cost is NT x C (the step's longest row, rounded up to its bucket); no host round trip.
Runs everywhere (it is tested on CPU against the native path).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import ringserve.model.compute.attention.tiles as tiles
from ringserve.kvmem.allocator import cdiv
from ringserve.model.compute.attention.base import AttentionBackend, AttnGeometry, StepShape


def context_buckets(geo: AttnGeometry, smallest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` (at least a page), the last one clipped to the longest context."""
    top = geo.max_context
    out, c = [], max(geo.page_size, smallest)
    while c < top:
        out.append(c)
        c *= 2
    out.append(top)
    return tuple(out)


class BucketedAttention(AttentionBackend):
    name: ClassVar[str] = "bucketed"
    uses_context_buckets: ClassVar[bool] = True
    chunk_tokens = 512  # keys per loop iteration (a multiple of the page size)
    unroll_up_to = 8  # loops this short are unrolled

    @classmethod
    def make(cls, geo: AttnGeometry, plan, mesh=None):
        return cls(geo, plan.options.context_bucket_min)

    def __init__(self, geo: AttnGeometry, context_bucket_min: int = 512):
        super().__init__(geo)
        self.buckets = context_buckets(geo, context_bucket_min)

    def context_buckets(self) -> tuple[int, ...]:
        return self.buckets

    def context_for(self, max_kv_len: int) -> int:
        for c in self.buckets:
            if c >= max_kv_len:
                return c
        raise ValueError(f"a row of {max_kv_len} tokens exceeds the longest context {self.buckets[-1]}")

    def plan_avals(self, shape: StepShape) -> dict[str, jax.ShapeDtypeStruct]:
        table = jax.ShapeDtypeStruct((shape.rows, cdiv(shape.context, self.geo.page_size)), jnp.int32)
        return tiles.tile_avals(shape) | {"tables": table} | ({"local_tables": table} if self.geo.local_pages else {})

    def plan(self, fb, shape: StepShape) -> dict[str, np.ndarray]:
        """The tiles, and the page tables (the local ones too) cut to the program's context bucket
        (its static C)."""
        width = cdiv(shape.context, self.geo.page_size)
        local = {"local_tables": fb.local_pages[:, :width]} if self.geo.local_pages else {}
        return tiles.make_tiles(fb, shape)[0] | {"tables": fb.pages[:, :width]} | local

    def attend(self, q, kv, layer, fb):
        p = fb.attn
        tables = self.geo.layer_pages(layer, p["tables"], p.get("local_tables"))
        return attend_static(q, kv, layer, tables, p, self.geo, p["tile_pos"].shape[1], self.chunk_tokens,
                             self.unroll_up_to)  # fmt: skip


def attend_static(q, kv, layer, pages, plan, geo: AttnGeometry, block: int, chunk_tokens: int, unroll_up_to: int):
    """Tiles over keys 0..C-1, C = the pages table's width in tokens (static); `pages`: layer
    `layer`'s table as indices on the caches' page axis (AttnGeometry.layer_pages)."""
    ps = geo.page_size
    c_tokens = pages.shape[1] * ps
    cp = max(1, min(chunk_tokens, c_tokens) // ps)
    n_chunks = cdiv(pages.shape[1], cp)
    qt = tiles.query_tiles(q, plan, geo)[:-1]  # [NT, block, Hkv, G, D]; no sink tile needed
    nt = qt.shape[0]
    tables = jnp.pad(pages, ((0, 0), (0, n_chunks * cp - pages.shape[1])), constant_values=geo.layer_base(layer))
    tables = tables[plan["tile_row"]]  # [NT, n_chunks * cp]
    pos = plan["tile_pos"]
    key_off = jnp.arange(cp * ps, dtype=jnp.int32)
    window = geo.window(layer)

    def body(c, state):
        pg = jax.lax.dynamic_slice_in_dim(tables, c * cp, cp, axis=1)
        k, v = tiles.gather_pages(kv[0], pg), tiles.gather_pages(kv[1], pg)
        key_pos = jnp.broadcast_to(c * cp * ps + key_off, (nt, cp * ps))
        return tiles.online_update(state, qt, k, v, key_pos, pos, geo, window=window)

    state = jax.lax.fori_loop(0, n_chunks, body, tiles.init_state(nt, geo, block), unroll=n_chunks <= unroll_up_to)
    out = tiles.normalize(state[1], state[2])
    out = jnp.concatenate([out, jnp.zeros((1, *out.shape[1:]), out.dtype)])  # the sink tile
    return tiles.untile(out, plan, geo, q.dtype)
