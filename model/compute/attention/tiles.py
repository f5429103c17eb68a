"""Query tiles, the unit the pure-JAX backends (native, bucketed) attend with.

A tile is up to `block` consecutive new tokens of ONE row (decode programs: block 1, a tile
per row). Tiles never mix rows, so a tile has one page table and its keys are the row's
positions 0 .. its last query's position (causal):

    row a: 6 new tokens at positions 10..15, block 4     row b: 1 token at position 40
    tile 0: a10 a11 a12 a13   tile 1: a14 a15 -- --     tile 2: b40 -- -- --
    tile_tok  [NT, block]  flat token index of each query (T: the zero sink query)
    tile_pos  [NT, block]  its position (-1: a padding query, sees nothing)
    tile_row  [NT]         the row whose page table the tile reads
    tok_slot  [T]          where each token's output lands in the tiles' output, flattened

NT is static per program: T / block + R (each row adds at most one partial tile). The online
(flash) softmax state of a tile is [Hkv, G, block] (max, denominator) and [Hkv, G, block, D].
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ringserve.kvmem.allocator import cdiv
from ringserve.model.compute.attention.base import NEG_INF, AttnGeometry, StepShape, from_kv


def num_tiles(shape: StepShape) -> int:
    return shape.rows if shape.block == 1 else shape.tokens // shape.block + shape.rows


def tile_avals(shape: StepShape) -> dict[str, jax.ShapeDtypeStruct]:
    nt, b = num_tiles(shape), shape.block
    return {
        "tile_tok": jax.ShapeDtypeStruct((nt, b), jnp.int32),
        "tile_pos": jax.ShapeDtypeStruct((nt, b), jnp.int32),
        "tile_row": jax.ShapeDtypeStruct((nt,), jnp.int32),
        "tok_slot": jax.ShapeDtypeStruct((shape.tokens,), jnp.int32),
    }


def make_tiles(fb, shape: StepShape) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Host: the tile arrays of a step, and each real tile's key count (last position + 1)."""
    nt_max, b, t = num_tiles(shape), shape.block, shape.tokens
    n_rows = int(fb.num_rows[0])
    start, kv_len = fb.row_start[: n_rows + 1], fb.kv_len[:n_rows]
    ext = np.diff(start)
    per_row = cdiv(ext, b)
    tile_row = np.repeat(np.arange(n_rows, dtype=np.int32), per_row)
    nt = len(tile_row)
    assert nt <= nt_max, (nt, nt_max)
    j = np.arange(nt) - (np.cumsum(per_row) - per_row)[tile_row]  # tile index within its row
    q0 = start[tile_row] + j * b  # flat index of the tile's first query
    qn = np.minimum(b, start[tile_row + 1] - q0)  # queries in the tile
    off = np.arange(b)
    tok = q0[:, None] + off[None, :]
    valid = off[None, :] < qn[:, None]
    pos0 = kv_len[tile_row] - ext[tile_row] + j * b  # position of the tile's first query
    tile_tok = np.full((nt_max, b), t, np.int32)
    tile_tok[:nt] = np.where(valid, tok, t)
    tile_pos = np.full((nt_max, b), -1, np.int32)
    tile_pos[:nt] = np.where(valid, pos0[:, None] + off[None, :], -1)
    rows = np.full(nt_max, n_rows if n_rows < len(fb.kv_len) else 0, np.int32)  # spare tiles: a padding row
    rows[:nt] = tile_row
    tok_slot = np.full(t, nt_max * b, np.int32)  # padding tokens read the sink tile
    tok_slot[tok[valid]] = (np.arange(nt)[:, None] * b + off[None, :])[valid]
    plan = {"tile_tok": tile_tok, "tile_pos": tile_pos, "tile_row": rows, "tok_slot": tok_slot}
    return plan, (pos0 + qn).astype(np.int64)


def query_tiles(q: jax.Array, plan: dict, geo: AttnGeometry) -> jax.Array:
    """Scaled f32 queries by tile plus a zero sink tile: [NT + 1, block, Hkv, G, D]."""
    nt, b = plan["tile_tok"].shape
    qpad = jnp.concatenate([q, jnp.zeros((1, *q.shape[1:]), q.dtype)])
    qt = (qpad[plan["tile_tok"]].astype(jnp.float32) * geo.scale).reshape(nt, b, geo.num_kv_heads, geo.group, geo.head_dim)
    return jnp.concatenate([qt, jnp.zeros((1, *qt.shape[1:]), jnp.float32)])


def init_state(n: int, geo: AttnGeometry, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    kvh, g, d = geo.num_kv_heads, geo.group, geo.head_dim
    return (
        jnp.full((n, kvh, g, block), NEG_INF, jnp.float32),
        jnp.zeros((n, kvh, g, block), jnp.float32),
        jnp.zeros((n, kvh, g, block, d), jnp.float32),
    )


def online_update(state, q, k, v, key_pos, q_pos, geo: AttnGeometry, reset=None, k_major: bool = False,
                  window: jax.Array | int | None = None):  # fmt: skip
    """One key chunk into n tiles' softmax states.

    q [n, block, Hkv, G, D] (scaled f32), v [Hkv, n, chunk, D] (f32) and k the same, or with
    k_major [Hkv, n, D, chunk] (`gather_pages_t`); key_pos [n, chunk], q_pos [n, block]; reset [n]
    bool starts a tile afresh (its first chunk); `window`: the layer's sliding window
    (`AttnGeometry.window`), the scores soft-capped as `geo` says.

    Both products are batched over (Hkv, n) in the order the gathered keys and values come in,
    so only the small operands (queries, scores) are ever transposed, never a chunk of K or V
    (measured on CPU: transposing the chunks cost more than the products). With k_major the
    score product is a plain [G * block, D] x [D, chunk] matmul (2-4x faster on CPU than the
    transposed-rhs form)."""
    m, den, acc = state
    n, b, kvh, g, d = q.shape
    if geo.deterministic:  # a query's scores summed the same way whatever the tile and step shape
        k = jnp.swapaxes(k, 2, 3) if k_major else k
        sc = jnp.sum(jnp.transpose(q, (0, 2, 3, 1, 4))[:, :, :, :, None, :] * jnp.swapaxes(k, 0, 1)[:, :, None, None], -1)
    else:
        qh = jnp.transpose(q, (2, 0, 3, 1, 4)).reshape(kvh, n, g * b, d)  # [Hkv, n, G*block, D]
        contract = (3,), ((2,) if k_major else (3,))
        sc = jax.lax.dot_general(qh, k, (contract, ((0, 1), (0, 1))))  # [Hkv, n, G*block, chunk]
        sc = jnp.transpose(sc.reshape(kvh, n, g, b, -1), (1, 0, 2, 3, 4))  # [n, Hkv, G, block, chunk]
    if geo.softcap is not None:
        sc = geo.softcap * jnp.tanh(sc / geo.softcap)
    vis = key_pos[:, None, :] <= q_pos[:, :, None]  # [n, block, chunk]; padding queries (-1) see none
    if window is not None:
        vis &= key_pos[:, None, :] > q_pos[:, :, None] - window
    vis = vis[:, None, None]
    sc = jnp.where(vis, sc, NEG_INF)
    if reset is not None:
        r = reset[:, None, None, None]
        m, den, acc = jnp.where(r, NEG_INF, m), jnp.where(r, 0.0, den), jnp.where(r[..., None], 0.0, acc)
    m1 = jnp.maximum(m, sc.max(-1))
    p = jnp.where(vis, jnp.exp(sc - m1[..., None]), 0.0)
    alpha = jnp.exp(m - m1)
    den = den * alpha + p.sum(-1)
    if geo.deterministic:
        pv = jnp.sum(p[..., None] * jnp.swapaxes(v, 0, 1)[:, :, None, None], -2)
    else:
        ph = jnp.transpose(p, (1, 0, 2, 3, 4)).reshape(kvh, n, g * b, -1)  # [Hkv, n, G*block, chunk]
        pv = jax.lax.dot_general(ph, v, (((3,), (2,)), ((0, 1), (0, 1))))  # [Hkv, n, G*block, D]
        pv = jnp.transpose(pv.reshape(kvh, n, g, b, d), (1, 0, 2, 3, 4))
    acc = acc * alpha[..., None] + pv
    return m1, den, acc


def normalize(den: jax.Array, acc: jax.Array) -> jax.Array:
    """acc / den; a tile row that saw no key (padding) gives 0, not NaN."""
    return acc / jnp.maximum(den, 1e-30)[..., None]


def combine(part, seg_tile: jax.Array, n: int) -> jax.Array:
    """Segments' softmax states -> tiles' outputs [n, Hkv, G, block, D]. A tile's keys may be
    split into segments (run on different lanes); segment i belongs to tile seg_tile[i]. Each
    segment's (max, denominator, unnormalised output) is rescaled to its tile's max and summed
    (split-K, as flash-decoding does). A tile of one segment comes out exactly as normalize()."""
    m, den, acc = part
    m_tile = jax.ops.segment_max(m, seg_tile, num_segments=n)
    w = jnp.exp(m - m_tile[seg_tile])
    den_t = jax.ops.segment_sum(den * w, seg_tile, num_segments=n)
    acc_t = jax.ops.segment_sum(acc * w[..., None], seg_tile, num_segments=n)
    return normalize(den_t, acc_t)


def untile(out: jax.Array, plan: dict, geo: AttnGeometry, dtype) -> jax.Array:
    """Tiles' outputs [NT + 1, Hkv, G, block, D] -> the step's tokens [T, H, D]."""
    n, b = out.shape[0], out.shape[3]
    flat = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(n * b, geo.num_heads, geo.head_dim)
    return flat[plan["tok_slot"]].astype(dtype)


def gather_pages(cache: jax.Array, pages: jax.Array, dtype: Any = None) -> jax.Array:
    """K or V of pages [n, cp] from the paged cache [Hkv, L*P, page, D] -> f32 [Hkv, n, cp*page, D].
    `dtype`: the compute dtype of a cache stored as bits (base.kv_bits)."""
    kvh, _, ps, d = cache.shape
    n, cp = pages.shape
    g = from_kv(cache.at[:, pages].get(mode="promise_in_bounds"), dtype or cache.dtype)
    return g.reshape(kvh, n, cp * ps, d).astype(jnp.float32)


def gather_pages_t(cache_t: jax.Array, pages: jax.Array, dtype: Any = None) -> jax.Array:
    """Keys of pages [n, cp] from a key-major cache [Hkv, L*P, D, page] -> f32 [Hkv, n, D, cp*page]."""
    kvh, _, d, ps = cache_t.shape
    n, cp = pages.shape
    g = from_kv(cache_t.at[:, pages].get(mode="promise_in_bounds"), dtype or cache_t.dtype)  # [Hkv, n, cp, D, page]
    return jnp.swapaxes(g, 2, 3).reshape(kvh, n, d, cp * ps).astype(jnp.float32)
