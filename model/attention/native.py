"""Native attention for CPU: work items over key chunks, balanced across lanes on the host.

The step's queries are cut into tiles of `block` consecutive tokens of one row (decode: one
token per tile). A tile's keys are its row's positions 0 .. its last query's position, read
`chunk` tokens (whole pages) at a time; one (tile, chunk) pair is a work item. The host deals
the tiles out to `lanes` lanes, longest first, each to the least-loaded lane (LPT), so every
lane runs about sum(items) / lanes items and a tile's items stay consecutive on one lane:

    schedule [S, lanes]   step s of lane w runs item (tile, chunk) or idles on the sink tile
    lane w:   t3c0 t3c1 t3c2 | t7c0 t7c1 | t0c0 | sink ...
               first      last  first last   f+l

Each loop step gathers lanes x chunk keys (a working set that stays in cache), updates each
lane's online-softmax state (reset at a tile's first item) and, at a tile's last item, writes
the tile's output. The loop's trip count is the longest lane, a runtime value: one program
serves every context length, and the cost follows each tile's own context, not the batch's
longest. Runtime trip counts are free on CPU; GPUs and TPUs use the other backends.
"""

from __future__ import annotations

import heapq
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from model.attention.base import NEG_INF, AttentionBackend, AttnGeometry, StepShape, layer_pages


def cdiv(a, b):
    return -(-a // b)


class NativeAttention(AttentionBackend):
    name: ClassVar[str] = "native"
    decode_lanes = 16
    extend_lanes = 8
    chunk_tokens = 64  # keys per item (rounded up to whole pages)

    def __init__(self, geo: AttnGeometry):
        super().__init__(geo)
        self.chunk_pages = max(1, self.chunk_tokens // geo.page_size)
        self.chunk = self.chunk_pages * geo.page_size
        self.max_chunks = cdiv(geo.max_pages, self.chunk_pages)

    def lanes(self, shape: StepShape) -> int:
        return self.decode_lanes if shape.block == 1 else self.extend_lanes

    def num_tiles(self, shape: StepShape) -> int:
        """Static tile count: every row adds at most one partial tile."""
        return shape.rows if shape.block == 1 else shape.tokens // shape.block + shape.rows

    def max_steps(self, shape: StepShape) -> int:
        """Static bound on the longest lane: LPT keeps it <= ceil(items / lanes) + the largest tile."""
        w = self.lanes(shape)
        return cdiv(self.num_tiles(shape) * self.max_chunks, w) + self.max_chunks

    # ---- host ----------------------------------------------------------------------------------
    def plan_avals(self, shape: StepShape) -> dict[str, jax.ShapeDtypeStruct]:
        nt, s, w, b = self.num_tiles(shape), self.max_steps(shape), self.lanes(shape), shape.block
        i32 = jnp.int32
        return {
            "tile_tok": jax.ShapeDtypeStruct((nt, b), i32),
            "tile_pos": jax.ShapeDtypeStruct((nt, b), i32),
            "tile_row": jax.ShapeDtypeStruct((nt,), i32),
            "tok_slot": jax.ShapeDtypeStruct((shape.tokens,), i32),
            "item_tile": jax.ShapeDtypeStruct((s, w), i32),
            "item_chunk": jax.ShapeDtypeStruct((s, w), i32),
            "item_first": jax.ShapeDtypeStruct((s, w), jnp.bool_),
            "item_last": jax.ShapeDtypeStruct((s, w), jnp.bool_),
            "num_steps": jax.ShapeDtypeStruct((), i32),
        }

    def plan(self, fb, shape: StepShape) -> dict[str, np.ndarray]:
        nt_max, s_max, w, b = self.num_tiles(shape), self.max_steps(shape), self.lanes(shape), shape.block
        t = shape.tokens
        n_rows = int(fb.num_rows[0])
        start, kv_len = fb.row_start[: n_rows + 1], fb.kv_len[:n_rows]
        ext = np.diff(start)
        n_tiles = cdiv(ext, b)  # per row
        tile_row = np.repeat(np.arange(n_rows, dtype=np.int32), n_tiles)
        nt = len(tile_row)
        assert nt <= nt_max, (nt, nt_max)
        first_tile = np.cumsum(n_tiles) - n_tiles
        j = np.arange(nt) - first_tile[tile_row]  # tile index within its row
        q0 = start[tile_row] + j * b  # flat index of the tile's first query
        qn = np.minimum(b, start[tile_row + 1] - q0)  # queries in the tile
        off = np.arange(b)
        tok = q0[:, None] + off[None, :]
        valid = off[None, :] < qn[:, None]
        tile_tok = np.full((nt_max, b), t, np.int32)  # t = the zero sink query
        tile_tok[:nt] = np.where(valid, tok, t)
        pos0 = kv_len[tile_row] - ext[tile_row] + j * b  # position of the tile's first query
        tile_pos = np.full((nt_max, b), -1, np.int32)
        tile_pos[:nt] = np.where(valid, pos0[:, None] + off[None, :], -1)
        tok_slot = np.full(t, nt_max * b, np.int32)  # padding tokens read the sink tile
        tok_slot[tok[valid]] = (np.arange(nt)[:, None] * b + off[None, :])[valid]
        # Work items: a tile reads keys 0 .. its last query's position.
        n_items = cdiv(pos0 + qn, self.chunk)
        item_tile = np.full((s_max, w), nt_max, np.int32)
        item_chunk = np.zeros((s_max, w), np.int32)
        item_first = np.zeros((s_max, w), bool)
        item_last = np.zeros((s_max, w), bool)
        loads = [(0, lane) for lane in range(w)]
        for tile in np.argsort(-n_items, kind="stable"):
            load, lane = heapq.heappop(loads)
            n = int(n_items[tile])
            item_tile[load : load + n, lane] = tile
            item_chunk[load : load + n, lane] = np.arange(n)
            item_first[load, lane] = True
            item_last[load + n - 1, lane] = True
            heapq.heappush(loads, (load + n, lane))
        num_steps = max(load for load, _ in loads)
        assert num_steps <= s_max, (num_steps, s_max)
        rows = np.full(nt_max, n_rows, np.int32)  # tiles past nt read the sink row's (empty) table
        rows[:nt] = tile_row
        return {
            "tile_tok": tile_tok, "tile_pos": tile_pos, "tile_row": rows, "tok_slot": tok_slot,
            "item_tile": item_tile, "item_chunk": item_chunk, "item_first": item_first,
            "item_last": item_last, "num_steps": np.int32(num_steps),
        }  # fmt: skip

    # ---- in the graph --------------------------------------------------------------------------
    def attend(self, q, kv, layer, fb):
        g = self.geo
        p = fb.attn
        nt, b = p["tile_tok"].shape
        w = p["item_tile"].shape[1]
        kvh, grp, d, c, cp = g.num_kv_heads, g.group, g.head_dim, self.chunk, self.chunk_pages
        k_cache, v_cache = kv
        # Tiles of queries, plus a zero sink tile for idle lanes: [NT + 1, block, Hkv, G, D].
        qpad = jnp.concatenate([q, jnp.zeros((1, *q.shape[1:]), q.dtype)])
        qt = (qpad[p["tile_tok"]].astype(jnp.float32) * g.scale).reshape(nt, b, kvh, grp, d)
        qt = jnp.concatenate([qt, jnp.zeros((1, b, kvh, grp, d), jnp.float32)])
        pos = jnp.concatenate([p["tile_pos"], jnp.full((1, b), -1, jnp.int32)])
        # Page tables with a sink row (all page 0) for the sink tile; this layer's page ids.
        tables = jnp.concatenate([fb.pages, jnp.zeros((1, fb.pages.shape[1]), jnp.int32)])
        tables = layer_pages(tables, layer, g.num_pages)
        tile_row = jnp.concatenate([p["tile_row"], jnp.full((1,), tables.shape[0] - 1, jnp.int32)])
        # Pad the tables so a chunk never reads past the row: [R + 1, max_chunks * cp].
        width = self.max_chunks * cp
        if width > tables.shape[1]:
            tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
        key_off = jnp.arange(c, dtype=jnp.int32)

        def body(s, carry):
            m, den, acc, out = carry
            tile = p["item_tile"][s]  # [W]
            chunk = p["item_chunk"][s]
            table = tables[tile_row[tile]]  # [W, width]
            pg = jax.vmap(lambda row, ch: jax.lax.dynamic_slice_in_dim(row, ch * cp, cp))(table, chunk)
            k = k_cache.at[:, pg].get(mode="promise_in_bounds").reshape(kvh, w, c, d).astype(jnp.float32)
            v = v_cache.at[:, pg].get(mode="promise_in_bounds").reshape(kvh, w, c, d).astype(jnp.float32)
            qw = qt[tile]  # [W, block, Hkv, G, D]
            sc = jnp.einsum("wbkgd,kwcd->wkgbc", qw, k)  # [W, Hkv, G, block, chunk]
            key_pos = chunk[:, None] * c + key_off[None, :]  # [W, chunk]
            qp = pos[tile]  # [W, block]
            vis = key_pos[:, None, :] <= qp[:, :, None]  # [W, block, chunk]
            if g.sliding_window is not None:
                vis &= key_pos[:, None, :] > qp[:, :, None] - g.sliding_window
            vis = vis[:, None, None]
            sc = jnp.where(vis, sc, NEG_INF)
            first = p["item_first"][s][:, None, None, None]
            m0 = jnp.where(first, NEG_INF, m)
            m1 = jnp.maximum(m0, sc.max(-1))
            pr = jnp.where(vis, jnp.exp(sc - m1[..., None]), 0.0)
            alpha = jnp.exp(m0 - m1)
            den = jnp.where(first, 0.0, den) * alpha + pr.sum(-1)
            acc = jnp.where(first[..., None], 0.0, acc) * alpha[..., None] + jnp.einsum("wkgbc,kwcd->wkgbd", pr, v)
            res = acc / jnp.maximum(den, 1e-30)[..., None]  # fully masked (padding) queries give 0
            dest = jnp.where(p["item_last"][s], tile, nt)  # unfinished tiles write the sink
            out = out.at[dest].set(res)
            return m1, den, acc, out

        init = (
            jnp.full((w, kvh, grp, b), NEG_INF, jnp.float32),
            jnp.zeros((w, kvh, grp, b), jnp.float32),
            jnp.zeros((w, kvh, grp, b, d), jnp.float32),
            jnp.zeros((nt + 1, kvh, grp, b, d), jnp.float32),
        )
        out = jax.lax.fori_loop(0, p["num_steps"], body, init)[3]
        # [NT + 1, Hkv, G, block, D] -> token-major [(NT + 1) * block, H, D] -> the step's tokens.
        out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape((nt + 1) * b, g.num_heads, d)
        return out[p["tok_slot"]].astype(q.dtype)
