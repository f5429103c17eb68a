"""Native attention for CPU: work items over key chunks, split evenly across lanes on the host.

A work item is one (query tile, key chunk) pair (tiles: model/compute/attention/tiles.py; a chunk is
`chunk` keys, whole pages). The host lays every tile's items end to end and cuts the sequence
into `lanes` equal runs (stream-K), so every lane runs ceil(items / lanes) items whatever the
tiles' lengths. A run of one tile's consecutive items on one lane is a segment; a tile cut by a
lane boundary has two (or more) segments, combined after the loop as flash-decoding combines
its splits (tiles.combine):

    schedule [S, lanes]   step s of lane w runs item (tile, chunk) or idles on the sink
    lane 0:   t0c0 t0c1 t0c2 t0c3 | t1c0 t1c1      segments: s0 = t0c0..3, s1 = t1c0..1
    lane 1:   t1c2 t1c3 | t2c0 t2c1 t2c2 t2c3            s2 = t1c2..3, s3 = t2c0..3

Each loop step gathers lanes x chunk keys (a working set that stays in cache), updates each
lane's online-softmax state (reset at a segment's first item) and, at a segment's last item,
writes the segment's (max, denominator, output). The loop's trip count is a runtime value: one
program serves every context length, and the cost follows each tile's own context, not the
batch's longest. Runtime trip counts are free on CPU; GPUs and TPUs use the other backends.
Splitting matters when a few tiles are long: a 64-token chunk of a 4,096-token prompt beside
32 decoding rows ran its 4 tiles' 64 items each on 4 lanes while the others idled (193 ms a
step, tiny model); split, the 8 lanes share them (113 ms). The deterministic mode (a query's
sums must not depend on the batch) keeps each tile whole on one lane, longest first to the
least-loaded lane (LPT).

Measured on 2 CPU cores (SmolLM2's 3 KV heads x 64, decode batch 64, contexts 16-768):
lanes x chunk of 16 x 64 keys 10 ms per layer, against 27-35 ms for one loop over the batch's
longest context in chunks (all rows per iteration). Per item the cost is the gathers and the
two products (XLA CPU's profile, tiny model, decode 64 x 256): K is stored key-major within a
page and both products batch over (Hkv, lane) in the gathered order, so no chunk is transposed
in the loop (before: two chunk transposes per item cost more than the products); the step went
from 36.6 to 24.7 ms (11.9 ms without attention), a 4 x 512 prefill from 438 to 332 ms (187).
"""

from __future__ import annotations

import heapq
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import ringserve.model.compute.attention.tiles as tiles
from ringserve.kvmem.allocator import cdiv
from ringserve.model.compute.attention.base import (
    AttentionBackend,
    AttnGeometry,
    StepShape,
    kv_bits,
    to_kv,
)


class NativeAttention(AttentionBackend):
    name: ClassVar[str] = "native"
    decode_lanes = 16
    extend_lanes = 8

    @classmethod
    def make(cls, geo: AttnGeometry, plan, mesh=None):
        return cls(geo, plan.options.attn_chunk_tokens)

    def __init__(self, geo: AttnGeometry, chunk_tokens: int = 64):
        super().__init__(geo)
        self.chunk_pages = max(1, chunk_tokens // geo.page_size)  # keys per item: whole pages
        self.chunk = self.chunk_pages * geo.page_size
        self.max_chunks = cdiv(geo.max_pages, self.chunk_pages)

    # ---- the cache: keys stored key-major within a page ----------------------------------------
    def kv_avals(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """K [Hkv, L*P, D, page] (each page's keys transposed), V [Hkv, L*P, page, D]: a gathered
        chunk of keys is then the [D, chunk] operand the score product wants, no transpose."""
        g = self.geo
        bits = kv_bits(g.dtype)  # 16-bit floats stored as their bits: written and read in place on CPU
        shape_k = (g.num_kv_heads, g.total_pages, g.head_dim, g.page_size)
        return jax.ShapeDtypeStruct(shape_k, bits), jax.ShapeDtypeStruct(super().kv_avals()[1].shape, bits)

    def write(self, kv, layer, k, v, fb):
        g = self.geo
        page, slot = g.layer_page_slot(layer, fb)
        k_cache = kv[0].at[:, page, :, slot].set(to_kv(k, kv[0].dtype, g.dtype))  # k: [T, Hkv, D]
        return k_cache, self.write_paged(kv[1], v, layer, fb)

    def lanes(self, shape: StepShape) -> int:
        """Lanes of a program. A tile's keys are split across lanes, so a few long tiles still
        fill them; a program with fewer tiles than lanes gets 8 (measured on 2 CPU cores, tiny
        model: decode 1x2048 7.3 -> 5.7 ms and 4x512 12.1 -> 6.5 ms against one lane per tile,
        no loss at batch 64; idle lanes gather and score a chunk for nothing). The deterministic
        mode keeps one lane count per kind: the loop body, and how XLA orders its sums, is then
        the same in every program."""
        lanes = self.decode_lanes if shape.block == 1 else self.extend_lanes
        return lanes if self.geo.deterministic else min(lanes, max(8, tiles.num_tiles(shape)))

    def max_steps(self, shape: StepShape) -> int:
        """Static bound on the longest lane: split, ceil(items / lanes); whole tiles (LPT, the
        deterministic mode), <= ceil(items / lanes) + the largest tile."""
        bound = cdiv(tiles.num_tiles(shape) * self.max_chunks, self.lanes(shape))
        return bound + self.max_chunks if self.geo.deterministic else bound

    def max_segments(self, shape: StepShape) -> int:
        """Segments (one lane's consecutive items of one tile): cutting the item sequence into
        lanes adds at most lanes - 1 to the tiles."""
        return tiles.num_tiles(shape) + self.lanes(shape)

    # ---- host ----------------------------------------------------------------------------------
    def plan_avals(self, shape: StepShape) -> dict[str, jax.ShapeDtypeStruct]:
        s, w = self.max_steps(shape), self.lanes(shape)
        item = {k: jax.ShapeDtypeStruct((s, w), jnp.bool_ if k.endswith(("first", "last")) else jnp.int32)
                for k in ("item_tile", "item_chunk", "item_seg", "item_first", "item_last")}  # fmt: skip
        return tiles.tile_avals(shape) | item | {
            "seg_tile": jax.ShapeDtypeStruct((self.max_segments(shape) + 1,), jnp.int32),
            "num_steps": jax.ShapeDtypeStruct((), jnp.int32),
        }

    def plan(self, fb, shape: StepShape) -> dict[str, np.ndarray]:
        plan, keys = tiles.make_tiles(fb, shape)
        s_max, w, nt_max, ns_max = self.max_steps(shape), self.lanes(shape), tiles.num_tiles(shape), self.max_segments(shape)
        n_items = cdiv(keys, self.chunk)
        if self.geo.deterministic:
            lane, step = self._whole_tiles(n_items, w)
        else:  # the items of all tiles in one sequence, cut into `w` equal runs
            per = max(1, cdiv(int(n_items.sum()), w))
            g = np.arange(int(n_items.sum()))
            lane, step = g // per, g % per
        tile = np.repeat(np.arange(len(n_items)), n_items)
        chunk = np.arange(len(tile)) - np.repeat(np.cumsum(n_items) - n_items, n_items)
        first = (chunk == 0) | (step == 0)  # a segment starts at a tile's first item or a lane's
        last = np.append(first[1:], True)  # the next item starts a segment (or there is none)
        seg = np.cumsum(first) - 1
        num_steps = int(step.max()) + 1 if len(step) else 0
        assert num_steps <= s_max and (len(seg) == 0 or seg[-1] < ns_max), (num_steps, s_max, seg[-1:], ns_max)
        out = {"item_tile": np.full((s_max, w), nt_max, np.int32),  # idle lanes run the sink tile
               "item_chunk": np.zeros((s_max, w), np.int32), "item_seg": np.full((s_max, w), ns_max, np.int32),
               "item_first": np.zeros((s_max, w), bool), "item_last": np.zeros((s_max, w), bool)}  # fmt: skip
        for key, val in (("item_tile", tile), ("item_chunk", chunk), ("item_seg", seg), ("item_first", first), ("item_last", last)):
            out[key][step, lane] = val
        seg_tile = np.full(ns_max + 1, nt_max, np.int32)  # unused segments and the sink: the sink tile
        seg_tile[seg[first]] = tile[first]
        return plan | out | {"seg_tile": seg_tile, "num_steps": np.asarray(num_steps, np.int32)}

    @staticmethod
    def _whole_tiles(n_items: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(lane, step) of every item, each tile's items consecutive on one lane: longest tile
        first to the least-loaded lane (LPT). A query's sums then never depend on the batch."""
        lane, step = np.zeros(int(n_items.sum()), np.int64), np.zeros(int(n_items.sum()), np.int64)
        start = np.cumsum(n_items) - n_items
        loads = [(0, ln) for ln in range(w)]
        for t in np.argsort(-n_items, kind="stable").tolist():
            load, ln = heapq.heappop(loads)
            n = int(n_items[t])
            lane[start[t] : start[t] + n], step[start[t] : start[t] + n] = ln, np.arange(load, load + n)
            heapq.heappush(loads, (load + n, ln))
        return lane, step

    # ---- in the graph --------------------------------------------------------------------------
    def attend(self, q, kv, layer, fb):
        g, p = self.geo, fb.attn
        nt, b = p["tile_tok"].shape
        cp = self.chunk_pages
        qt = tiles.query_tiles(q, p, g)  # [NT + 1, block, Hkv, G, D]
        pos = jnp.concatenate([p["tile_pos"], jnp.full((1, b), -1, jnp.int32)])
        # This layer's page tables plus an all-sink row for the sink tile, wide enough that a
        # chunk never slices past a row: [R + 1, max_chunks * cp].
        tables = g.layer_pages(layer, fb.pages, fb.local_pages)
        width = self.max_chunks * cp
        tables = jnp.pad(tables, ((0, 1), (0, width - tables.shape[1])), constant_values=g.layer_base(layer))
        tile_row = jnp.concatenate([p["tile_row"], jnp.full((1,), tables.shape[0] - 1, jnp.int32)])
        key_off = jnp.arange(self.chunk, dtype=jnp.int32)
        window = g.window(layer)

        ns = p["seg_tile"].shape[0] - 1

        def body(s, carry):
            state, part = carry
            tile, chunk = p["item_tile"][s], p["item_chunk"][s]  # [W]
            pages = jax.vmap(lambda row, c: jax.lax.dynamic_slice_in_dim(row, c * cp, cp))(tables[tile_row[tile]], chunk)
            k, v = tiles.gather_pages_t(kv[0], pages, g.dtype), tiles.gather_pages(kv[1], pages, g.dtype)
            key_pos = chunk[:, None] * self.chunk + key_off[None, :]
            state = tiles.online_update(state, qt[tile], k, v, key_pos, pos[tile], g, reset=p["item_first"][s],
                                        k_major=True, window=window)  # fmt: skip
            dest = jnp.where(p["item_last"][s], p["item_seg"][s], ns)  # unfinished segments write the sink
            return state, tuple(buf.at[dest].set(x) for buf, x in zip(part, state, strict=True))

        part = tiles.init_state(ns + 1, g, b)  # each segment's (max, denominator, unnormalised output)
        _, part = jax.lax.fori_loop(0, p["num_steps"], body, (tiles.init_state(self.lanes_of(p), g, b), part))
        return tiles.untile(tiles.combine(part, p["seg_tile"], nt + 1), p, g, q.dtype)

    @staticmethod
    def lanes_of(plan: dict) -> int:
        return plan["item_tile"].shape[1]
