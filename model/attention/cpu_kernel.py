"""Attention on CPU through a C++ custom call on every core (model/kernels/cpu_attention.cc).

The cache is the native backend's (K key-major within a page, 16-bit floats stored as bits),
and so is the write; `attend` hands the step's queries, both caches, the page tables, row
bounds, key counts and positions to the kernel, which needs no host plan: each query token sees
keys 0..its position (and the sliding window) of its row's pages, so verify steps (positions
moved in the graph, model/step.py) need nothing of their own. A query's sums run page by page
in key order whatever the batch, so the deterministic mode is served as it is.

Measured on 2 Zen 4 cores (SmolLM2-135M, f32): see `bench.step_floor --backend cpu_kernel`.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from model.attention.native import NativeAttention
from model.kernels.cpu_attention import TARGET


class CpuKernelAttention(NativeAttention):
    name: ClassVar[str] = "cpu_kernel"

    def plan_avals(self, shape):
        return {}

    def plan(self, fb, shape):
        return {}

    def attend(self, q, kv, layer, fb):
        g = self.geo
        qk = q if q.dtype == jnp.bfloat16 else q.astype(jnp.float32)  # bf16: vdpbf16ps in prefill (AVX512-BF16)
        out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            qk, kv[0], kv[1], fb.pages, fb.row_start, fb.kv_len, fb.positions,
            jnp.asarray(layer, jnp.int32),
            num_pages=np.int64(g.num_pages), window=np.int64(g.sliding_window or 0), scale=np.float32(g.scale),
        )  # fmt: skip
        return out.astype(q.dtype)
