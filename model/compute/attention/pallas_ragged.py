"""TPU: ringserve's own ragged paged attention kernel (model/compute/attention/tpu_ragged.py) over
K and V stored with no padding, K|V side by side on the lanes:

    kv : [total_pages, Hkv'', page_size, 2 * head_dim]      (sharded over Hkv'' on `tp`; every
         layer's page space one after another, base.py's AttnGeometry.layer_base)

Bytes a token (all layers) = num_layers x Hkv'' x 2 x head_dim x itemsize: the real K and V,
against jax's kernel layout (pallas_tpu.py: heads padded to the packing, head_dim to 128), e.g.
SmolLM2 (3 KV heads of 64, bf16, 30 layers): 23,040 B, not 61,440.

KV heads on a `tp` mesh: split when tp divides them; when there are fewer KV heads than devices
and tp is a multiple of them (and divides the query heads), each KV head is stored tp / Hkv
times, once on each device whose query heads use it (SGLang's replication), so Hkv'' = tp and
the query heads still split over tp; otherwise every device runs all heads (tp 1 here).

The step's new K/V are written by one scatter of the [T, Hkv'', 2D] rows before the kernel reads
(a fused write: K and V are one row); the kernel needs no host plan (its tiles come from
ForwardBatch in the graph), so multi-step decode runs on it.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ringserve.model.compute.attention import tpu_fit, tpu_ragged
from ringserve.model.compute.attention.base import AttentionBackend, AttnGeometry
from ringserve.model.compute.attention.layout import ragged_kv_layout
from ringserve.model.compute.attention.pallas_tpu import device_kind

QUERY_BLOCK = 32  # query tokens a tile of an extend program holds (at most; a power of two)
INTERPRET_KV_PAGES = 8  # KV pages a block reads in the interpreter (no chip to size against)


kv_layout = ragged_kv_layout  # (tp the heads split over, copies of each KV head): layout.py


class PallasRaggedAttention(AttentionBackend):
    name: ClassVar[str] = "pallas_ragged"

    @classmethod
    def make(cls, geo: AttnGeometry, plan, mesh=None):
        return cls(geo, interpret=plan.options.attention_interpret, tp=plan.tp, mesh=mesh, chip=device_kind(mesh),
                   soft_cap=geo.softcap)  # fmt: skip

    def __init__(self, geo: AttnGeometry, interpret: bool = False, tp: int = 1, mesh=None, chip: str | None = None,
                 soft_cap: float | None = None):  # fmt: skip
        """`chip`: the device kind the programs compile for (tpu_fit.CHIPS), needed unless
        `interpret`; `soft_cap`: the logit soft-cap (None: none)."""
        super().__init__(geo)
        self.interpret = interpret
        self.mesh = mesh
        self.tp, self.copies = kv_layout(geo.num_kv_heads, geo.num_heads, tp)
        self.heads = geo.num_kv_heads * self.copies  # KV heads stored (Hkv'')
        self.lanes = 2 * geo.head_dim
        self.soft_cap = soft_cap
        self.chip = None if interpret else tpu_fit.chip_of(chip or "")

    # ---- the cache -----------------------------------------------------------------------------
    def kv_avals(self):
        g = self.geo
        return (jax.ShapeDtypeStruct((g.total_pages, self.heads, g.page_size, self.lanes), g.dtype),)

    def kv_specs(self, tp: int):
        return (P(None, "tp", None, None) if self.tp > 1 else P(),)

    def kv_bytes_per_token(self) -> int:
        """Cache bytes a token takes over all layers (every device's share together), every layer
        counted (a local page space holds fewer pages, not smaller ones)."""
        g = self.geo
        return g.num_layers * self.heads * self.lanes * jnp.dtype(g.dtype).itemsize

    def write(self, kv, layer, k, v, fb):
        g = self.geo
        (cache,) = kv
        rows = jnp.concatenate([k, v], axis=-1).astype(cache.dtype)  # [T, Hkv, 2D]
        if self.copies > 1:
            rows = jnp.repeat(rows, self.copies, axis=1)  # KV head h on devices h * copies ...
        # one row scatter into the cache seen as [L*P * Hkv'' * page, 2D] rows (a bitcast of its
        # row-major layout): scattered as [L*P, Hkv'', page, 2D] with (page, offset) indices, XLA
        # laid the scan's cache out heads-minor for the scatter and copied the whole cache to the
        # kernel's layout and back every layer (tiny model: 1.5 GiB of temporaries a step).
        # Over `tp` each device scatters its own heads into its own shard (shard_map): the
        # flattening reshape of a cache split on its head axis is not a bitcast of any one
        # device's shard, and XLA's partitioner all-gathered the whole pool for it
        # (Qwen3-30B-A3B, 4 KV heads stored 8 times over v6e:2x4: 172 GB of temporaries)
        page, offset = g.layer_page_slot(layer, fb)  # (a local layer's: its own space)

        def scatter(cache, rows, page, offset):
            t, h = rows.shape[:2]
            at = (page[:, None] * h + jnp.arange(h)[None, :]) * g.page_size + offset[:, None]  # [T, h]
            flat = cache.reshape(-1, self.lanes).at[at.reshape(-1)].set(rows.reshape(t * h, self.lanes))
            return flat.reshape(cache.shape)

        if self.tp > 1:
            heads = P(None, "tp", None, None)
            scatter = jax.shard_map(scatter, mesh=self.mesh, in_specs=(heads, P(None, "tp", None), P(), P()),
                                    out_specs=heads, check_vma=False)  # fmt: skip
        return (scatter(cache, rows, page, offset),)

    # ---- per program ---------------------------------------------------------------------------
    def query_block(self, tokens: int, rows: int) -> int:
        """Query tokens a tile holds: 1 in decode programs (a token a row), else QUERY_BLOCK or
        the largest power of two <= tokens."""
        if tokens == rows:
            return 1
        return min(QUERY_BLOCK, 1 << (tokens.bit_length() - 1))

    def kernel_shape(self, block: int) -> tpu_fit.KernelShape:
        """What one device's kernel holds (tpu_ragged.vmem_bytes reads head_dim as the K|V lanes)."""
        g = self.geo
        size = jnp.dtype(g.dtype).itemsize
        local = self.heads // self.tp
        return tpu_fit.KernelShape(g.num_heads // self.tp, local, self.lanes, g.page_size, g.max_pages, block, size, size)

    def blocks(self, block: int) -> tpu_fit.Blocks:
        """KV pages a block reads, the query tile (<= `block`) and the VMEM limit on this chip;
        ValueError naming the budget when none fits."""
        if self.chip is None:
            return tpu_fit.Blocks(min(INTERPRET_KV_PAGES, self.geo.max_pages), block, 0)
        return tpu_fit.choose(self.chip, self.kernel_shape(block), tpu_ragged.vmem_bytes, tuned={})

    def window(self, layer: jax.Array) -> jax.Array:
        """Layer `layer`'s sliding window as the kernel takes it: int32 [1], traced (0: none; so
        is base.NO_WINDOW, 1 << 30, in effect), per layer (Gemma's alternating local and global
        layers: the geometry's `window`)."""
        w = self.geo.window(layer)
        return jnp.zeros((1,), jnp.int32) if w is None else jnp.reshape(jnp.asarray(w, jnp.int32), (1,))

    # ---- in the graph --------------------------------------------------------------------------
    def attend(self, q, kv, layer, fb):
        g = self.geo
        t, r = q.shape[0], fb.kv_len.shape[0]
        b = self.blocks(self.query_block(t, r))
        tm = tpu_ragged.TileMap(fb.row_start, fb.kv_len, fb.num_rows, t, b.queries)
        qt = tpu_ragged.query_tiles(q, tm, self.heads, g.scale, self.lanes, g.dtype)
        tables = g.layer_pages(layer, fb.pages, fb.local_pages)
        window = self.window(layer)
        call = functools.partial(tpu_ragged.paged_call, block=b.queries, soft_cap=self.soft_cap, kv_pages=b.kv_pages,
                                 vmem_limit=b.vmem_limit or None, interpret=self.interpret)  # fmt: skip
        if self.tp > 1:
            heads = P(None, "tp", None, None)
            call = jax.shard_map(call, mesh=self.mesh, in_specs=(heads, heads, P(), P(), P(), P(), P()),
                                 out_specs=heads, check_vma=False)  # fmt: skip
        out = call(qt, kv[0], tables, tm.row, tm.pos0, tm.qn, window)
        return tpu_ragged.untile(out, tm, g.head_dim).astype(q.dtype)
