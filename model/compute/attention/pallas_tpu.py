"""TPU: jax's Pallas ragged paged attention kernel
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), in the KV layout it wants.

    kv : [total_pages, page_size, 2 * Hkv', D']      one array, K and V interleaved
         along the head axis (K0 V0 K1 V1 ...); page p of layer l at index layer_base(l) + p
         (base.py: a sliding layer's own page space where there is one).

The kernel's limits shape the layout: D' is head_dim rounded up to 128 (zero-padded: q.k and
p.v are unchanged), and the combined head count 2 * Hkv' must tile (2 * Hkv' / packing in
{1, 2, 4, 8} or a multiple of 8), so KV heads are padded with zero heads up to Hkv' and the
query heads to Hkv' * G (padded query heads attend to the zero heads; their outputs are
dropped). On a `tp` mesh the kernel runs per device under shard_map, each device padding its
own Hkv / tp heads.

Block sizes and the scoped VMEM limit come from model/compute/attention/tpu_fit.py for the chip
the programs compile for (the mesh's device kind): the kernel's own choice reads jax.devices()[0]
and, off its tuned table, takes the whole page table as one KV block, which overflowed Mosaic's
default 16 MiB at page 64 and context 4096.

The kernel reads the cache but does not write it: the step's new K/V are scattered first.
Per step it takes what ForwardBatch already has: cu_q_lens = row_start, kv_lens = kv_len,
page_indices = the page tables (+ layer offset), num_seqs = num_rows. Output rows past the last
real token are undefined (NaN in interpret mode) and are zeroed.

Off TPU the kernel runs in Pallas's TPU interpreter (`interpret=True`, for tests), which in
jax 0.10.2 differs from a TPU in two ways the interpreter path works around:

  - it cannot discharge the kernel's masked `pltpu.store`: that one function is rebound, in the
    kernel module only, to an equivalent read-modify-write;
  - a kernel's writes to its scalar-prefetch refs do not reach the next grid point (each one
    reads the initial values). The kernel carries (seq_idx, buf_idx) there from one grid point
    to the next: which row a query block starts at, and which of its two KV buffers holds the
    block the previous grid point prefetched. Restarted at (0, 0), a grid point past the first
    reads a stale buffer (a 40-token chunk over 300 cached tokens in query blocks of 32: the
    second block's outputs were wrong). So the interpreter path runs one grid point per call:
    all T query tokens in one query block, and one call per heads block (the kernel's
    `get_min_heads_per_blk` grouping), each over its slice of query and K/V heads.
"""

from __future__ import annotations

import functools
import types
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ringserve.kvmem.allocator import cdiv
from ringserve.model.compute.attention import tpu_fit
from ringserve.model.compute.attention.base import AttentionBackend, AttnGeometry
from ringserve.model.compute.attention.layout import padded_kv_heads


@functools.cache
def _interpret_shim() -> None:
    """Rebind the kernel module's `pltpu.store` to a read-modify-write (interpreter path only)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    def store(ref, val, *, mask=None):
        ref[...] = val if mask is None else jnp.where(mask, val, ref[...])

    shim = types.ModuleType("pltpu_interpret_shim")
    shim.__dict__.update(pltpu.__dict__)
    shim.store = store  # type: ignore[attr-defined]
    kernel.pltpu = shim  # type: ignore[attr-defined]


def _interpret_call(kernel, q, cache, kv_len, tables, cu_q_lens, num_seqs):
    """The kernel in Pallas's TPU interpreter, one grid point per call (see the module
    docstring): one query block of all T tokens, one call per heads block. Block sizes are
    given (off TPU the kernel's tuned-size lookup raises)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

    hq, hc = get_min_heads_per_blk(q.shape[1], cache.shape[2], q.dtype, cache.dtype)
    outs = []
    with pltpu.force_tpu_interpret_mode(True):  # type: ignore[arg-type]
        for b in range(q.shape[1] // hq):
            qb = q[:, b * hq : (b + 1) * hq]
            cb = cache if hc == cache.shape[2] else cache[:, :, b * hc : (b + 1) * hc]
            blocks = dict(num_kv_pages_per_block=min(8, tables.shape[1]), num_queries_per_block=q.shape[0])
            outs.append(kernel(qb, cb, kv_len, tables, cu_q_lens, num_seqs, **blocks))
    return jnp.concatenate(outs, axis=1)


def device_kind(mesh) -> str | None:
    """The device kind a backend's programs run on: its mesh's (when compiling ahead of time
    for a topology, that topology's chips), else this process's first device."""
    return mesh.devices.flat[0].device_kind if mesh is not None else jax.devices()[0].device_kind


class PallasTPUAttention(AttentionBackend):
    name: ClassVar[str] = "pallas"

    @classmethod
    def make(cls, geo: AttnGeometry, plan, mesh=None):
        return cls(geo, interpret=plan.options.attention_interpret, tp=plan.tp, mesh=mesh, chip=device_kind(mesh))

    def __init__(self, geo: AttnGeometry, interpret: bool = False, tp: int = 1, mesh=None, chip: str | None = None):
        """`chip`: the device kind the programs compile for (tpu_fit.CHIPS); needed unless
        `interpret`."""
        super().__init__(geo)
        self.interpret = interpret
        self.mesh = mesh
        self.chip = None if interpret else tpu_fit.chip_of(chip or "")
        # Heads are split over `tp` only when it divides them; otherwise every device runs all.
        self.tp = tp if geo.num_kv_heads % tp == 0 else 1
        self.local_kv = geo.num_kv_heads // self.tp
        self.local_kv_pad = padded_kv_heads(self.local_kv, jnp.dtype(geo.dtype).itemsize)
        self.d_pad = cdiv(geo.head_dim, 128) * 128
        if interpret:
            _interpret_shim()

    def kv_avals(self):
        g = self.geo
        shape = (g.total_pages, g.page_size, 2 * self.tp * self.local_kv_pad, self.d_pad)
        return (jax.ShapeDtypeStruct(shape, g.dtype),)

    def kv_specs(self, tp: int):
        return (P(None, None, "tp", None) if self.tp > 1 else P(),)

    def kernel_shape(self, tokens: int) -> tpu_fit.KernelShape:
        """What one heads block of the kernel holds in a program of `tokens` query tokens."""
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

        g = self.geo
        hq, hc = get_min_heads_per_blk(self.local_kv_pad * g.group, 2 * self.local_kv_pad, g.dtype, g.dtype)
        size = jnp.dtype(g.dtype).itemsize
        return tpu_fit.KernelShape(hq, hc // 2, self.d_pad, g.page_size, g.max_pages, tokens, size, size)

    def blocks(self, tokens: int) -> tpu_fit.Blocks:
        """Block sizes and VMEM limit of a program of `tokens` query tokens on this chip;
        ValueError naming the budget when none fits (tpu_fit.choose)."""
        assert self.chip is not None, "interpreted: no chip"
        return tpu_fit.choose(self.chip, self.kernel_shape(tokens))

    # ---- head layout ---------------------------------------------------------------------------
    def _pad_heads(self, x: jax.Array, per_kv: int) -> jax.Array:
        """[T, tp * local_kv * per_kv, D] -> [T, tp * local_kv_pad * per_kv, D'] (zero heads and lanes)."""
        t = x.shape[0]
        x = x.reshape(t, self.tp, self.local_kv, per_kv, self.geo.head_dim)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, self.local_kv_pad - self.local_kv), (0, 0), (0, self.d_pad - self.geo.head_dim)))
        return x.reshape(t, self.tp * self.local_kv_pad * per_kv, self.d_pad)

    def write(self, kv, layer, k, v, fb):
        g = self.geo
        (cache,) = kv
        kvn = jnp.stack([self._pad_heads(k, 1), self._pad_heads(v, 1)], axis=2)  # [T, Hkv', 2, D']
        kvn = kvn.reshape(k.shape[0], -1, self.d_pad).astype(cache.dtype)  # K0 V0 K1 V1 ...
        flat = cache.reshape(-1, *cache.shape[2:])
        loc = g.layer_loc(layer, fb)
        return (flat.at[loc].set(kvn).reshape(cache.shape),)

    def attend(self, q, kv, layer, fb):
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

        g = self.geo
        t = q.shape[0]
        qp = self._pad_heads(q, g.group)
        tables = g.layer_pages(layer, fb.pages, fb.local_pages)
        args = (qp, kv[0], fb.kv_len, tables, fb.row_start, fb.num_rows)

        def run(window: int | None) -> jax.Array:  # the kernel takes the layer's window static
            call = functools.partial(ragged_paged_attention, sm_scale=g.scale, sliding_window=window, soft_cap=g.softcap)
            if self.interpret:
                call = functools.partial(_interpret_call, call)
            else:
                b = self.blocks(t)
                call = functools.partial(call, num_kv_pages_per_block=b.kv_pages, num_queries_per_block=b.queries,
                                         vmem_limit_bytes=b.vmem_limit)  # fmt: skip
            if self.tp > 1:
                call = jax.shard_map(
                    call, mesh=self.mesh, in_specs=(P(None, "tp", None), P(None, None, "tp", None), P(), P(), P(), P()),
                    out_specs=P(None, "tp", None), check_vma=False,
                )  # fmt: skip
            return call(*args)

        out = g.by_window(layer, run)
        real = jnp.arange(t) < fb.row_start[fb.num_rows[0]]
        out = jnp.where(real[:, None, None], out, 0)  # rows past the last real token are undefined
        out = out.reshape(t, self.tp, self.local_kv_pad, g.group, self.d_pad)[:, :, : self.local_kv, :, : g.head_dim]
        return out.reshape(t, g.num_heads, g.head_dim).astype(q.dtype)
