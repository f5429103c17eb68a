"""ringserve's own Pallas TPU ragged paged attention kernel, over a cache with no padding.

Cache layout (one array, K and V side by side on the lane axis):

    kv : [total_pages, Hkv', page_size, 2 * D]     lanes 0..D-1 K, D..2D-1 V
         page p of layer l at index layer_base(l) + p, as every backend's

Heads sit outside the two minor (tiled) dimensions, so nothing is padded to a tile: a token
costs 2 * Hkv * D values, the real K and V (head_dim 64: 128 lanes a head, as tpu-inference's
hd64 kernel shares them; its heads are padded to the packing, ours are not). Only 2 * D under
128 lanes pads (head_dim 32: 64 of 128).

K and V are never split apart. A query is stored zero-padded to 2 * D lanes (q, 0): its product
with a K|V row is q.k exactly, and p @ [K|V] carries p @ V in lanes D..2D-1, which is the output
(lanes 0..D-1, p @ K, are dropped). Twice the MXU work for the scores, none for the layout.

Work is cut into query tiles (as model/compute/attention/tiles.py cuts it for the CPU backends,
but on device, from ForwardBatch alone: no host plan): a tile is up to `block` consecutive query
tokens of ONE row, so a tile has one page table and one causal diagonal. The grid is
(tile, KV block); a KV block is `kv_pages` pages, each fetched by its own input (the same cache
array `kv_pages` times, each BlockSpec picking one page from the scalar-prefetched page table),
so Pallas's pipeline double-buffers them and skips a fetch whose page did not change. Pages past
the tile's last key, or before its window, are clamped to the nearest page it needs (no fetch)
and the block's compute is skipped.

Per tile the queries of one KV head are one matrix, rows in (G, block) order, so a row's query
token is `row % block` (block a power of two: a mask, not a division):

    q tiles [NT, Hkv, G * block, 2D]   scaled, zero-padded lanes
    out     [NT, Hkv, G * block, 2D]   lanes D..2D-1 = softmax(q k^T) v

Masks: causal (key <= query position), the sliding window (key > position - window; `window`
is a traced scalar, so a per-layer window under the layer scan needs no program per layer), and
the logit soft-cap (cap * tanh(s / cap), static). Fully masked rows (padding) come out 0.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringserve.kvmem.allocator import cdiv
from ringserve.model.compute.attention import tpu_fit

NEG_INF = -1e30  # finite: a fully masked row's max stays finite and its output 0


def vmem_bytes(s: tpu_fit.KernelShape, b: tpu_fit.Blocks) -> int:
    """Scoped VMEM of this kernel at blocks `b` (`s.head_dim` = the 2D lanes of a K|V row):

        KV       kv_pages inputs x 2 buffers x Hkv x page x 2D     cache dtype
        q, out   2 x 2 x Hkv x G * block x 2D                       query dtype
        acc      Hkv x G * block x 2D; m, l: 2 x Hkv x G * block x 128   f32
        scores   G * block x keys, twice (s and p of one head)      f32
    """
    keys = b.kv_pages * s.page_size
    rows = (s.q_heads // s.kv_heads) * b.queries
    kv = 2 * keys * s.kv_heads * s.head_dim * s.kv_bytes
    qo = 4 * s.kv_heads * rows * s.head_dim * s.q_bytes
    scratch = s.kv_heads * rows * (s.head_dim + 2 * 128) * 4
    return kv + qo + scratch + 2 * rows * keys * 4


class TileMap:
    """Where each query tile sits (module docstring), computed in the graph from ForwardBatch's
    row_start, kv_len and num_rows: NT = T // block + R tiles (each row adds at most one partial
    tile), the unused ones empty (qn 0)."""

    def __init__(self, row_start: jax.Array, kv_len: jax.Array, num_rows: jax.Array, tokens: int, block: int):
        r = kv_len.shape[0]
        nt = tokens // block + r
        real = jnp.arange(r) < num_rows[0]
        ext = jnp.where(real, row_start[1:] - row_start[:-1], 0)
        per_row = (ext + block - 1) // block
        cum = jnp.cumsum(per_row)
        first = cum - per_row  # each row's first tile
        i = jnp.arange(nt)
        row = jnp.minimum(jnp.searchsorted(cum, i, side="right"), r - 1).astype(jnp.int32)
        j = i - first[row]
        q0 = row_start[row] + j * block
        self.tiles, self.block, self.tokens = nt, block, tokens
        self.row = row
        self.q0 = q0
        self.qn = jnp.where(i < cum[-1], jnp.clip(row_start[row + 1] - q0, 0, block), 0).astype(jnp.int32)
        self.pos0 = (kv_len[row] - ext[row] + j * block).astype(jnp.int32)  # position of the tile's first query
        # token t -> its place in the tiles' outputs, flattened [NT * block]
        t = jnp.arange(tokens)
        trow = jnp.clip(jnp.searchsorted(row_start, t, side="right") - 1, 0, r - 1)
        u = t - row_start[trow]
        self.slot = (first[trow] + u // block) * block + u % block
        self.real = t < row_start[num_rows[0]]

    def gather(self, q: jax.Array) -> jax.Array:
        """q [T, Hq, D] -> the tiles' queries [NT, block, Hq, D] (rows past a tile's qn: any token)."""
        tok = jnp.clip(self.q0[:, None] + jnp.arange(self.block)[None, :], 0, self.tokens - 1)
        return q[tok]

    def scatter(self, out: jax.Array) -> jax.Array:
        """Tiles' outputs [NT, block, Hq, D] -> the tokens' [T, Hq, D] (0 past the last real token)."""
        flat = out.reshape(-1, *out.shape[2:])[self.slot]
        return jnp.where(self.real[:, None, None], flat, 0)


def query_tiles(q: jax.Array, tm: TileMap, hkv: int, scale: float, lanes: int, dtype: Any) -> jax.Array:
    """q [T, Hq, D] -> [NT, Hkv, G * block, lanes]: scaled, rows in (G, block) order, zero-padded
    to the K|V lanes."""
    nt, b = tm.tiles, tm.block
    _, hq, d = q.shape
    g = hq // hkv
    qt = tm.gather(q).reshape(nt, b, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(nt, hkv, g * b, d)
    qt = (qt.astype(jnp.float32) * scale).astype(dtype)
    return jnp.concatenate([qt, jnp.zeros((nt, hkv, g * b, lanes - d), dtype)], -1)


def untile(out: jax.Array, tm: TileMap, d: int) -> jax.Array:
    """The kernel's [NT, Hkv, G * block, 2D] -> the tokens' [T, Hq, D] (lanes D..2D-1)."""
    nt, hkv, rows, _ = out.shape
    g = rows // tm.block
    out = out[..., d:].reshape(nt, hkv, g, tm.block, d).transpose(0, 3, 1, 2, 4)
    return tm.scatter(out.reshape(nt, tm.block, hkv * g, d))


def paged_call(qt: jax.Array, kv: jax.Array, tables: jax.Array, row: jax.Array, pos0: jax.Array, qn: jax.Array,
               window: jax.Array, *, block: int, soft_cap: float | None, kv_pages: int, vmem_limit: int | None,
               interpret: bool = False) -> jax.Array:  # fmt: skip
    """The kernel: query tiles qt [NT, Hkv, G * block, 2D] over `kv` [L*P, Hkv, page, 2D] with page
    tables [R, max_pages] (this layer's page ids), each tile's row, first position and query
    count [NT], `window` int32 [1] (0: none) -> [NT, Hkv, G * block, 2D] (module docstring)."""
    nt, hkv, rows, lanes = qt.shape
    page = kv.shape[2]
    max_pages = tables.shape[1]
    n_kv = cdiv(max_pages, kv_pages)

    def pages_of(i, row, pos0, qn, win):
        """The tile's first and last page (inclusive) it needs keys of."""
        last = jnp.maximum(pos0 + qn - 1, 0) // page
        lo_key = jnp.where(win[0] > 0, jnp.maximum(pos0 - win[0] + 1, 0), 0)
        return jnp.minimum(lo_key // page, last), last

    def page_spec(j):
        def index(i, kb, tabs, row, pos0, qn, win):
            lo, hi = pages_of(i, row[i], pos0[i], qn[i], win)
            p = jnp.clip(kb * kv_pages + j, lo, hi)
            return tabs[row[i] * max_pages + p], 0, 0, 0

        return pl.BlockSpec((1, hkv, page, lanes), index)

    tile_spec = pl.BlockSpec((1, hkv, rows, lanes), lambda i, kb, *_: (i, 0, 0, 0))
    kernel = functools.partial(_kernel, hkv=hkv, rows=rows, block=block, page=page, kv_pages=kv_pages,
                               soft_cap=soft_cap, pages_of=pages_of)  # fmt: skip
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(nt, n_kv),
            in_specs=[tile_spec] + [page_spec(j) for j in range(kv_pages)],
            out_specs=tile_spec,
            scratch_shapes=[pltpu.VMEM((hkv, rows, 128), jnp.float32), pltpu.VMEM((hkv, rows, 128), jnp.float32),
                            pltpu.VMEM((hkv, rows, lanes), jnp.float32)],  # fmt: skip
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit),
        out_shape=jax.ShapeDtypeStruct(qt.shape, qt.dtype),
        interpret=interpret,
        name="ringserve_ragged_paged_attention",
    )
    prefetch = (tables.reshape(-1).astype(jnp.int32), row, pos0, qn, window.astype(jnp.int32))
    return call(*prefetch, qt, *([kv] * kv_pages))


def _kernel(tabs, row, pos0_ref, qn_ref, win, q_ref, *refs: Any, hkv: int, rows: int, block: int, page: int,
            kv_pages: int, soft_cap: float | None, pages_of) -> None:  # fmt: skip
    """One (tile, KV block) grid point: the online softmax of every KV head's query rows over
    the block's keys (refs: kv_pages page refs, the output ref, then m, l, acc scratch)."""
    kv_refs, (o_ref, m_ref, l_ref, acc_ref) = refs[:kv_pages], refs[kv_pages:]
    i, kb = pl.program_id(0), pl.program_id(1)
    pos0, qn = pos0_ref[i], qn_ref[i]
    lo, hi = pages_of(i, row[i], pos0, qn, win)
    first_page = kb * kv_pages

    @pl.when(kb == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((qn > 0) & (first_page <= hi) & (first_page + kv_pages - 1 >= lo))
    def _block():
        keys = kv_pages * page
        key_pos = first_page * page + jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 1)
        q_tok = jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 0) & (block - 1)  # row order (G, block)
        q_pos = pos0 + q_tok
        vis = (key_pos <= q_pos) & (q_tok < qn)
        vis &= (win[0] <= 0) | (key_pos > q_pos - win[0])
        # keys past the tile's last (a clamped page's, or a page's unwritten tail) read as 0:
        # they are masked, but a NaN there would survive p = 0 in p @ v
        key_ok = (first_page * page + jax.lax.broadcasted_iota(jnp.int32, (keys, 1), 0)) < pos0 + qn
        for h in range(hkv):
            kvh = jnp.concatenate([r[0, h] for r in kv_refs], axis=0) if kv_pages > 1 else kv_refs[0][0, h]
            kvh = jnp.where(key_ok, kvh, jnp.zeros_like(kvh))  # [keys, 2D]
            q = q_ref[0, h]  # [rows, 2D]
            s = jax.lax.dot_general(q, kvh, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(vis, s, NEG_INF)
            m_prev, l_prev = m_ref[h], l_ref[h]  # [rows, 128], every lane the same
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(vis, jnp.exp(s - m_next[:, :1]), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_ref[h] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = m_next
            pv = jnp.dot(p.astype(kvh.dtype), kvh, preferred_element_type=jnp.float32)  # [rows, 2D]
            acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv

    @pl.when(kb == pl.num_programs(1) - 1)
    def _finish():
        for h in range(hkv):
            den = jnp.maximum(l_ref[h][:, :1], 1e-30)
            o_ref[0, h] = (acc_ref[h] / den).astype(o_ref.dtype)
