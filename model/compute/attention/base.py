"""The attention interface the model calls, and the paged KV layout most backends share.

A backend owns four things, so that the model never knows which one runs:

    kv_avals()/kv_specs(tp)   the KV cache's arrays (shapes, dtype) and their `tp` sharding
    plan(fb, shape)           host side: extra per-step inputs (NumPy, static shapes per program)
    write(kv, layer, k, v, fb)   in the graph: this step's new K/V into the cache (in place)
    attend(q, kv, layer, fb)     in the graph: [T, Hq, D] outputs of the step's query tokens

The forward runs the layers under one `lax.scan`, so `layer` is a traced scalar and the cache
arrays hold every layer: a backend reads layer l's pages by offsetting page ids by its base,
`AttnGeometry.layer_base(l)` (never by slicing a layer out, which would copy it).

Paged layout (native, bucketed, pallas_gpu, none):

    k, v : [Hkv, total_pages, page_size, D]      (sharded over Hkv on a `tp` mesh)
           page p of layer l is index layer_base(l) + p; page 0 of every layer is the sink that
           padding tokens write to and nothing reads.
    token location (ForwardBatch.out_loc) = page * page_size + offset, within one layer.

The native backend keeps V so and stores K key-major within a page, [Hkv, total_pages, D,
page_size] (same page ids and token locations): its CPU score product then reads a gathered
chunk as is.

The page axis is every layer's own page space, one after another. Without a local space
(`local_pages` 0) each layer has `num_pages` and base(l) = l * num_pages. With one (Gemma's
mixed local and global layers: the scheduler keeps a sliding layer's pages only near its
window), a sliding layer (window > 0) has `local_pages` pages of its own space, addressed by
its own page table (ForwardBatch.local_pages) and token locations (local_out_loc):

    windows      (w,        0,          w,         0)
    page axis    | local_pages | num_pages | local_pages | num_pages |      total_pages
    base         0           LP          LP + P      2LP + P

A local table's entries for pages wholly before every query's window may be stale (another
request's page now): a backend writes a sliding layer's K/V only at local_out_loc and gives a
key outside the window no weight (masked; it may read whatever finite values are there).
Stale ids are still within [0, local_pages). `AttnGeometry.select` picks the layer's table or
locations, `layer_pages` / `layer_page_slot` / `layer_loc` add the base, for a Python layer
(the unrolled loop) and a traced one alike (a select between the two tables).

Per-step inputs every backend sees (ForwardBatch, built in model/compute/step_inputs.py): the new
tokens packed densely (row r owns flat tokens row_start[r]:row_start[r+1]), their positions and
token locations, and per row its kv_len (= committed_len + extend_len: KV valid after this
step's writes) and page table. Query i of row r sits at position `kv_len[r] - extend_len + i`
and sees keys j <= its position (and j > position - window where its layer has a sliding window:
`AttnGeometry.windows`, per layer, Gemma's alternating local and global layers). A score is
q.k * `scale`, then cap * tanh(score / cap) where the model soft-caps them (Gemma 2).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ringserve.model.compute.step_inputs import StepShape  # noqa: F401 -- re-exported: the backends' shape type

NEG_INF = -1e30  # additive mask value (finite: a fully masked row gives 0, not NaN)
NO_WINDOW = 1 << 30  # the window of a layer that has none, in a traced per-layer lookup: no context reaches it


@dataclasses.dataclass(frozen=True, slots=True)
class AttnGeometry:
    """Static facts of the model and the KV pool that every backend needs."""

    num_layers: int
    num_pages: int  # per layer, the sink page 0 included
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_pages: int  # page-table width (pages of the longest context)
    dtype: Any  # KV dtype (the compute dtype)
    windows: tuple[int, ...] | None = None  # each layer's sliding window (0: none); None: no layer has one
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    query_scale: float | None = None  # the scores' scale where it is not head_dim ** -0.5 (Gemma)
    deterministic: bool = False  # contractions as products and sums whose order no shape changes
    local_pages: int = 0  # pages of each sliding layer's own space, sink included; 0: they share the global ids

    def __post_init__(self) -> None:
        if self.local_pages and not self.mixed_windows:
            raise ValueError(f"local_pages={self.local_pages}: a local KV page space is for models that mix sliding-"
                             f"window and global layers; this model's layer windows are {self.windows}")  # fmt: skip

    @property
    def mixed_windows(self) -> bool:
        """Some layers slide (window > 0) and some attend to every key."""
        return self.windows is not None and any(self.windows) and not all(self.windows)

    @property
    def layer_page_counts(self) -> tuple[int, ...]:
        """Pages of each layer's own space (the sink included)."""
        if not self.local_pages:
            return (self.num_pages,) * self.num_layers
        assert self.windows is not None
        return tuple(self.local_pages if w else self.num_pages for w in self.windows)

    @property
    def total_pages(self) -> int:
        """Length of the caches' page axis: every layer's space (the module docstring)."""
        return sum(self.layer_page_counts)

    def is_local(self, layer: jax.Array | int) -> jax.Array | bool:
        """Whether layer `layer` reads and writes the local page space (a Python bool for a
        Python layer, else a traced one); False for every layer without a local space."""
        if not self.local_pages:
            return False
        assert self.windows is not None
        if isinstance(layer, int):
            return self.windows[layer] > 0
        return jnp.asarray([w > 0 for w in self.windows])[layer]

    def layer_base(self, layer: jax.Array | int) -> jax.Array | int:
        """Index of layer `layer`'s page 0 on the caches' page axis: l * num_pages without a
        local space, else the sum of the earlier layers' page counts."""
        if not self.local_pages:
            return layer * self.num_pages
        bases = np.cumsum((0,) + self.layer_page_counts[:-1])
        if isinstance(layer, int):
            return int(bases[layer])
        return jnp.asarray(bases, jnp.int32)[layer]

    def select(self, layer: jax.Array | int, glob: Any, local: Any) -> Any:
        """Layer `layer`'s own of a (global, local) pair of page tables or token locations:
        `local` where the layer is local, else `glob` (as is without a local space)."""
        if not self.local_pages:
            return glob
        if isinstance(layer, int):
            return local if self.is_local(layer) else glob
        return jnp.where(self.is_local(layer), local, glob)

    def layer_pages(self, layer: jax.Array | int, pages: jax.Array, local_pages: jax.Array | None) -> jax.Array:
        """Layer `layer`'s page table (global `pages` or `local_pages`, [..., n]) as indices on
        the caches' page axis."""
        return self.select(layer, pages, local_pages) + self.layer_base(layer)

    def layer_page_slot(self, layer: jax.Array | int, fb: Any) -> tuple[jax.Array, jax.Array]:
        """Where the step's new tokens go in layer `layer`: (index on the caches' page axis,
        slot within the page), from fb.out_loc or, for a local layer, fb.local_out_loc."""
        loc = self.out_loc(layer, fb)
        return loc // self.page_size + self.layer_base(layer), loc % self.page_size

    def layer_loc(self, layer: jax.Array | int, fb: Any) -> jax.Array:
        """Where the step's new tokens go in layer `layer` as token indices on the flattened
        [total_pages * page_size] axis."""
        return self.out_loc(layer, fb) + self.layer_base(layer) * self.page_size

    def out_loc(self, layer: jax.Array | int, fb: Any) -> jax.Array:
        """The step's token locations within layer `layer`'s own space (fb.local_out_loc read
        only where there is a local space)."""
        return self.select(layer, fb.out_loc, fb.local_out_loc) if self.local_pages else fb.out_loc

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else float(self.head_dim) ** -0.5

    @property
    def causal_only(self) -> bool:
        """No window and no soft cap: the kernels that have neither may serve it."""
        return self.windows is None and self.softcap is None

    def window(self, layer: jax.Array | int) -> jax.Array | int | None:
        """Layer `layer`'s sliding window in the graph: None where it has none that needs a mask;
        an int for a Python layer (the unrolled loop), else a traced int32 (the scanned loop's
        layer), NO_WINDOW for a layer without one."""
        if self.windows is None:
            return None
        if isinstance(layer, int):
            return self.windows[layer] or None
        return jnp.asarray([w or NO_WINDOW for w in self.windows], jnp.int32)[layer]

    def by_window(self, layer: jax.Array | int, attend: Callable[[int | None], jax.Array]) -> jax.Array:
        """attend(w) with layer `layer`'s window as a Python int (None: none), for kernels that
        take it static (jax's TPU kernel): the layer's own for a Python layer, else one branch per
        distinct window, switched on the traced layer."""
        if self.windows is None:
            return attend(None)
        if isinstance(layer, int):
            return attend(self.windows[layer] or None)
        distinct = sorted(set(self.windows))
        if len(distinct) == 1:
            return attend(distinct[0] or None)
        branch = jnp.asarray([distinct.index(w) for w in self.windows], jnp.int32)[layer]
        return jax.lax.switch(branch, [functools.partial(attend, w or None) for w in distinct])

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def max_context(self) -> int:
        return self.max_pages * self.page_size


class AttentionBackend:
    """Base class: the paged layout and its write; subclasses implement `attend` (and `plan`)."""

    name: ClassVar[str] = ""
    uses_context_buckets: ClassVar[bool] = False  # programs keyed by a static context length

    @classmethod
    def make(cls, geo: AttnGeometry, plan: Any, mesh: Any = None) -> AttentionBackend:
        """The backend for the compute plan `plan` (its options' tunables) on `mesh` (the `tp`
        mesh, for kernels that run per device under shard_map)."""
        return cls(geo)

    def __init__(self, geo: AttnGeometry):
        self.geo = geo

    # ---- the cache ----------------------------------------------------------------------------
    def kv_avals(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        g = self.geo
        shape = (g.num_kv_heads, g.total_pages, g.page_size, g.head_dim)
        return jax.ShapeDtypeStruct(shape, g.dtype), jax.ShapeDtypeStruct(shape, g.dtype)

    def kv_specs(self, tp: int) -> tuple[PartitionSpec, PartitionSpec]:
        spec = PartitionSpec("tp", None, None, None) if self.geo.num_kv_heads % tp == 0 else PartitionSpec()
        return spec, spec

    # ---- per step ------------------------------------------------------------------------------
    def context_buckets(self) -> tuple[int, ...]:
        """The context lengths programs are compiled for; (0,) = one program serves any."""
        return (0,)

    def context_for(self, max_kv_len: int) -> int:
        """The context bucket of a step whose longest row holds `max_kv_len` tokens."""
        return 0

    def plan(self, fb: Any, shape: StepShape) -> dict[str, np.ndarray]:
        return {}

    def plan_avals(self, shape: StepShape) -> dict[str, jax.ShapeDtypeStruct]:
        return {}

    def shift_plan(self, plan: dict, shift: jax.Array) -> dict:
        """In the graph, before the layers: row r's positions are `shift[r]` lower than the host
        planned with (a verify step: the host planned with a bound, the device knows the true
        length). The keys the plan covers stay (a superset); what needs positions moves. The
        tile-based plans (native, bucketed) carry query positions; the kernels read fb.kv_len."""
        if "tile_pos" not in plan:
            return plan
        pos = plan["tile_pos"]
        moved = jnp.where(pos >= 0, pos - shift[plan["tile_row"]][:, None], -1)
        return plan | {"tile_pos": moved}

    # ---- in the graph --------------------------------------------------------------------------
    def write(self, kv, layer: jax.Array, k: jax.Array, v: jax.Array, fb) -> Any:
        """Scatter the step's k, v [T, Hkv, D] into layer `layer` at fb.out_loc (in place under
        donation: the scan carries the cache, so the update never copies it)."""
        return self.write_paged(kv[0], k, layer, fb), self.write_paged(kv[1], v, layer, fb)

    def write_paged(self, cache: jax.Array, new: jax.Array, layer: jax.Array, fb) -> jax.Array:
        """new [T, Hkv, D] into a cache of the paged layout [Hkv, total_pages, page, D]."""
        g = self.geo
        flat = (g.num_kv_heads, g.total_pages * g.page_size, g.head_dim)
        loc = g.layer_loc(layer, fb)
        upd = cache.reshape(flat).at[:, loc].set(to_kv(jnp.swapaxes(new, 0, 1), cache.dtype, g.dtype))
        return upd.reshape(cache.shape)

    def attend(self, q: jax.Array, kv, layer: jax.Array, fb) -> jax.Array:
        raise NotImplementedError


def kv_bits(dtype: Any) -> Any:
    """The dtype a backend may store a `dtype` cache as: 16-bit floats as their bits (uint16).
    XLA:CPU scatters and converts 16-bit floats through f32 over the whole operand (SmolLM2's
    bf16 cache, 64 tokens into one layer: 528 ms a write, against 0.01 ms as uint16)."""
    return jnp.uint16 if jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) else dtype


def to_kv(new: jax.Array, cache_dtype: Any, dtype: Any) -> jax.Array:
    """New keys/values of compute dtype `dtype` as the cache stores them (`kv_bits`)."""
    new = new.astype(dtype)
    return new if cache_dtype == dtype else jax.lax.bitcast_convert_type(new, cache_dtype)


def from_kv(x: jax.Array, dtype: Any) -> jax.Array:
    """Gathered cache entries back in the compute dtype `dtype` (a no-op unless stored as bits)."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


class NoAttention(AttentionBackend):
    """The floor: writes K/V like every backend, but each query's output is itself (no keys
    read). Only for benchmarks (bench/step_floor.py): the step time without attention."""

    name = "none"

    def kv_avals(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        k, v = super().kv_avals()  # stored as bits, like the native backend's (kv_bits)
        return k.update(dtype=kv_bits(k.dtype)), v.update(dtype=kv_bits(v.dtype))

    def attend(self, q, kv, layer, fb):
        return q
