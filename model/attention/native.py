"""Native attention for CPU: work items over key chunks, balanced across lanes on the host.

A work item is one (query tile, key chunk) pair (tiles: model/attention/tiles.py; a chunk is
`chunk` keys, whole pages). The host deals the tiles out to `lanes` lanes, longest first, each
to the least-loaded lane (LPT), so every lane runs about sum(items) / lanes items and a tile's
items stay consecutive on one lane:

    schedule [S, lanes]   step s of lane w runs item (tile, chunk) or idles on the sink tile
    lane w:   t3c0 t3c1 t3c2 | t7c0 t7c1 | t0c0 | sink ...
               first      last  first last   f+l

Each loop step gathers lanes x chunk keys (a working set that stays in cache), updates each
lane's online-softmax state (reset at a tile's first item) and, at a tile's last item, writes
the tile's output. The loop's trip count is the longest lane, a runtime value: one program
serves every context length, and the cost follows each tile's own context, not the batch's
longest. Runtime trip counts are free on CPU; GPUs and TPUs use the other backends.

Measured on 2 CPU cores (SmolLM2's 3 KV heads x 64, decode batch 64, contexts 16-768):
lanes x chunk of 16 x 64 keys 10 ms per layer, against 27-35 ms for one loop over the batch's
longest context in chunks (all rows per iteration). Per item the cost is the gathers and the
two products (XLA CPU's profile, tiny model, decode 64 x 256): K is stored key-major within a
page and both products batch over (Hkv, lane) in the gathered order, so no chunk is transposed
in the loop (before: two chunk transposes per item cost more than the products); the step went
from 36.6 to 24.7 ms (11.9 ms without attention), a 4 x 512 prefill from 438 to 332 ms (187).
A program has at most as many lanes as tiles (a batch of 1 ran 15 idle lanes before).
"""

from __future__ import annotations

import heapq
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import model.attention.tiles as tiles
from model.attention.base import AttentionBackend, AttnGeometry, StepShape, layer_pages
from model.attention.tiles import cdiv


class NativeAttention(AttentionBackend):
    name: ClassVar[str] = "native"
    decode_lanes = 16
    extend_lanes = 8

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
        k, v = super().kv_avals()
        return jax.ShapeDtypeStruct((g.num_kv_heads, g.num_layers * g.num_pages, g.head_dim, g.page_size), g.dtype), v

    def write(self, kv, layer, k, v, fb):
        g = self.geo
        page = fb.out_loc // g.page_size + layer * g.num_pages
        k_cache = kv[0].at[:, page, :, fb.out_loc % g.page_size].set(k.astype(kv[0].dtype))  # k: [T, Hkv, D]
        return k_cache, self.write_paged(kv[1], v, layer, fb)

    def lanes(self, shape: StepShape) -> int:
        """Lanes of a program: never more than it has tiles (a small batch would run idle lanes
        on the sink tile, each gathering and scoring a whole chunk for nothing). The deterministic
        mode keeps one lane count per kind: the loop body, and how XLA orders its sums, is then
        the same in every program."""
        lanes = self.decode_lanes if shape.block == 1 else self.extend_lanes
        return lanes if self.geo.deterministic else min(lanes, tiles.num_tiles(shape))

    def max_steps(self, shape: StepShape) -> int:
        """Static bound on the longest lane: LPT keeps it <= ceil(items / lanes) + the largest tile."""
        return cdiv(tiles.num_tiles(shape) * self.max_chunks, self.lanes(shape)) + self.max_chunks

    # ---- host ----------------------------------------------------------------------------------
    def plan_avals(self, shape: StepShape) -> dict[str, jax.ShapeDtypeStruct]:
        s, w = self.max_steps(shape), self.lanes(shape)
        return tiles.tile_avals(shape) | {
            "item_tile": jax.ShapeDtypeStruct((s, w), jnp.int32),
            "item_chunk": jax.ShapeDtypeStruct((s, w), jnp.int32),
            "item_first": jax.ShapeDtypeStruct((s, w), jnp.bool_),
            "item_last": jax.ShapeDtypeStruct((s, w), jnp.bool_),
            "num_steps": jax.ShapeDtypeStruct((), jnp.int32),
        }

    def plan(self, fb, shape: StepShape) -> dict[str, np.ndarray]:
        plan, keys = tiles.make_tiles(fb, shape)
        s_max, w, nt_max = self.max_steps(shape), self.lanes(shape), tiles.num_tiles(shape)
        n_items = cdiv(keys, self.chunk)
        item_tile = np.full((s_max, w), nt_max, np.int32)  # idle lanes run the sink tile
        item_chunk = np.zeros((s_max, w), np.int32)
        item_first = np.zeros((s_max, w), bool)
        item_last = np.zeros((s_max, w), bool)
        loads = [(0, lane) for lane in range(w)]
        for tile in np.argsort(-n_items, kind="stable").tolist():
            load, lane = heapq.heappop(loads)
            n = int(n_items[tile])
            item_tile[load : load + n, lane] = tile
            item_chunk[load : load + n, lane] = np.arange(n)
            item_first[load, lane] = True
            item_last[load + n - 1, lane] = True
            heapq.heappush(loads, (load + n, lane))
        num_steps = max(load for load, _ in loads)
        assert num_steps <= s_max, (num_steps, s_max)
        return plan | {
            "item_tile": item_tile, "item_chunk": item_chunk, "item_first": item_first,
            "item_last": item_last, "num_steps": np.asarray(num_steps, np.int32),
        }  # fmt: skip

    # ---- in the graph --------------------------------------------------------------------------
    def attend(self, q, kv, layer, fb):
        g, p = self.geo, fb.attn
        nt, b = p["tile_tok"].shape
        cp = self.chunk_pages
        qt = tiles.query_tiles(q, p, g)  # [NT + 1, block, Hkv, G, D]
        pos = jnp.concatenate([p["tile_pos"], jnp.full((1, b), -1, jnp.int32)])
        # This layer's page tables plus an all-sink row for the sink tile, wide enough that a
        # chunk never slices past a row: [R + 1, max_chunks * cp].
        tables = layer_pages(fb.pages, layer, g.num_pages)
        width = self.max_chunks * cp
        tables = jnp.pad(tables, ((0, 1), (0, width - tables.shape[1])), constant_values=layer * g.num_pages)
        tile_row = jnp.concatenate([p["tile_row"], jnp.full((1,), tables.shape[0] - 1, jnp.int32)])
        key_off = jnp.arange(self.chunk, dtype=jnp.int32)

        def body(s, carry):
            state, out = carry
            tile, chunk = p["item_tile"][s], p["item_chunk"][s]  # [W]
            pages = jax.vmap(lambda row, c: jax.lax.dynamic_slice_in_dim(row, c * cp, cp))(tables[tile_row[tile]], chunk)
            k, v = tiles.gather_pages_t(kv[0], pages), tiles.gather_pages(kv[1], pages)
            key_pos = chunk[:, None] * self.chunk + key_off[None, :]
            state = tiles.online_update(state, qt[tile], k, v, key_pos, pos[tile], g, reset=p["item_first"][s],
                                        k_major=True)  # fmt: skip
            dest = jnp.where(p["item_last"][s], tile, nt)  # unfinished tiles write the sink tile
            return state, out.at[dest].set(tiles.normalize(state[1], state[2]))

        init = (tiles.init_state(self.lanes_of(p), g, b), jnp.zeros((nt + 1, g.num_kv_heads, g.group, b, g.head_dim)))
        _, out = jax.lax.fori_loop(0, p["num_steps"], body, init)
        return tiles.untile(out, p, g, q.dtype)

    @staticmethod
    def lanes_of(plan: dict) -> int:
        return plan["item_tile"].shape[1]
