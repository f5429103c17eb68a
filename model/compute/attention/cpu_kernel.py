"""Attention on CPU through a C++ custom call on every core (model/compute/kernels/cpu_attention.cc).

The cache is the native backend's (K key-major within a page, 16-bit floats stored as bits),
and so is the write; `attend` hands the step's queries, both caches, the page tables, row
bounds, key counts and positions, and the layer's base on the caches' page axis
(AttnGeometry.layer_base: a sliding layer's own page space and table where there is one) to the
kernel, which needs no host plan: each query token sees
keys 0..its position (and its layer's sliding window, an operand) of its row's pages, so verify steps (positions
moved in the graph, model/runtime/step.py) need nothing of their own. A query's sums run page by page
in key order whatever the batch, so the deterministic mode is served as it is.

A bf16 cache where the kernel reads the pair layouts (AVX512-BF16; pages of 16 keys, head dims
32, 64 or 128, at most 16 query heads a KV head) is stored in them instead (`pairs`):

    K [Hkv, L*P, D/2, 16, 2]   a page's row p: (k[2p][s], k[2p+1][s]) for its 16 keys s
    V [Hkv, L*P, 8, D, 2]      a page's row j: (v[2j][d], v[2j+1][d]) for every dim d

the operands vdpbf16ps and AMX's tiles multiply as they lie (a B tile is 32 dims of a page's K,
or 32 keys of V; the kernel's two passes: cpu_attention.cc's header). Same elements as the
native layout, so the pool's size is the same.

Measured on 2 Zen 4 cores (SmolLM2-135M, f32): see `bench.step_floor --backend cpu_kernel`.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ringserve.model.compute.attention.base import kv_bits, to_kv
from ringserve.model.compute.attention.native import NativeAttention
from ringserve.model.compute.kernels import cpu_attention
from ringserve.model.compute.kernels.cpu_attention import TARGET


class CpuKernelAttention(NativeAttention):
    name: ClassVar[str] = "cpu_kernel"

    def __init__(self, geo, chunk_tokens: int = 64):
        super().__init__(geo, chunk_tokens)
        self.pairs = (jnp.dtype(geo.dtype) == jnp.bfloat16 and geo.page_size == 16 and geo.head_dim in (32, 64, 128)
                      and geo.group <= 16 and cpu_attention.reads_pairs())  # fmt: skip

    def kv_avals(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        if not self.pairs:
            return super().kv_avals()
        g = self.geo
        pages, bits = g.total_pages, kv_bits(g.dtype)
        return (jax.ShapeDtypeStruct((g.num_kv_heads, pages, g.head_dim // 2, 16, 2), bits),
                jax.ShapeDtypeStruct((g.num_kv_heads, pages, 8, g.head_dim, 2), bits))  # fmt: skip

    def kv_specs(self, tp: int) -> tuple[PartitionSpec, PartitionSpec]:
        if not self.pairs:
            return super().kv_specs(tp)
        spec = PartitionSpec("tp", None, None, None, None) if self.geo.num_kv_heads % tp == 0 else PartitionSpec()
        return spec, spec

    def write(self, kv, layer, k, v, fb):
        if not self.pairs:
            return super().write(kv, layer, k, v, fb)
        g = self.geo
        page, slot = g.layer_page_slot(layer, fb)
        t = k.shape[0]
        kb = to_kv(k, kv[0].dtype, g.dtype).reshape(t, g.num_kv_heads, g.head_dim // 2, 2)  # [T, Hkv, D/2, 2]
        k_cache = kv[0].at[:, page, :, slot, :].set(kb)
        v_cache = kv[1].at[:, page, slot // 2, :, slot % 2].set(to_kv(v, kv[1].dtype, g.dtype))  # v: [T, Hkv, D]
        return k_cache, v_cache

    def plan_avals(self, shape):
        return {}

    def plan(self, fb, shape):
        return {}

    def attend(self, q, kv, layer, fb):
        g = self.geo
        qk = q if q.dtype == jnp.bfloat16 else q.astype(jnp.float32)  # bf16: vdpbf16ps in prefill (AVX512-BF16)
        # a bf16 model's output comes back in bf16, rounded as astype rounds (one pass less)
        od = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
        window = g.window(layer)  # an operand: the scanned loop's layer is traced
        out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, od))(
            qk, kv[0], kv[1], g.select(layer, fb.pages, fb.local_pages), fb.row_start, fb.kv_len, fb.positions,
            jnp.asarray(g.layer_base(layer), jnp.int32), jnp.asarray(0 if window is None else window, jnp.int32),
            scale=np.float32(g.scale), softcap=np.float32(g.softcap or 0),
        )  # fmt: skip
        return out.astype(q.dtype)
