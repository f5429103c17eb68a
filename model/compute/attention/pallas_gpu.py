"""GPU: jax's Pallas (Triton) paged decode kernel (`jax.experimental.pallas.ops.gpu.
paged_attention`) for decode programs; extend programs run the bucketed static path.

The kernel reads the paged layout as it is ([Hkv, L * pages, page_size, D]: its k_pages /
v_pages with layers folded into the page axis), one query token per row, split-K over the
row's pages with a log-sum-exp combine. Programs keep the bucketed backend's context buckets:
a decode program's page tables are C / page_size wide (rounded up to a power of two, as the
kernel's split sizes need), so pages past a row's kv_len are masked by `lengths`, not read.

It has no sm_scale (queries are pre-scaled), no sliding window and no soft cap (a model with
either decodes on the bucketed path too: `AttnGeometry.causal_only`). `interpret=True` runs it in Pallas's interpreter (tests on CPU). On a
`tp` mesh it runs per device under shard_map, over that device's KV heads.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ringserve.kvmem.allocator import cdiv
from ringserve.model.compute.attention.base import AttnGeometry, StepShape
from ringserve.model.compute.attention.bucketed import BucketedAttention


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class PallasGPUAttention(BucketedAttention):
    name: ClassVar[str] = "pallas_gpu"
    pages_per_compute_block = 8
    max_k_splits = 16

    @classmethod
    def make(cls, geo: AttnGeometry, plan, mesh=None):
        return cls(geo, plan.options.context_bucket_min, interpret=plan.options.attention_interpret, tp=plan.tp, mesh=mesh)

    def __init__(self, geo: AttnGeometry, context_bucket_min: int = 512, interpret: bool = False, tp: int = 1, mesh=None):
        super().__init__(geo, context_bucket_min)
        self.interpret = interpret
        self.mesh = mesh
        self.tp = tp if geo.num_kv_heads % tp == 0 else 1

    def _decode_pages(self, shape: StepShape) -> int:
        return _pow2_at_least(cdiv(shape.context, self.geo.page_size))

    def plan_avals(self, shape: StepShape) -> dict[str, jax.ShapeDtypeStruct]:
        if shape.block != 1 or not self.geo.causal_only:
            return super().plan_avals(shape)
        return {"tables": jax.ShapeDtypeStruct((shape.rows, self._decode_pages(shape)), jnp.int32)}

    def plan(self, fb, shape: StepShape) -> dict[str, np.ndarray]:
        if shape.block != 1 or not self.geo.causal_only:
            return super().plan(fb, shape)
        n = self._decode_pages(shape)
        tables = np.zeros((shape.rows, n), np.int32)  # page 0 past a row's pages: masked by lengths
        w = min(n, fb.pages.shape[1])
        tables[:, :w] = fb.pages[:, :w]
        return {"tables": tables}

    def attend(self, q, kv, layer, fb):
        if "tile_pos" in fb.attn:  # an extend program (or a sliding window, a local page space too): the static path
            return super().attend(q, kv, layer, fb)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        g = self.geo
        tables = fb.attn["tables"] + g.layer_base(layer)  # (causal only: no local page space)
        pps = tables.shape[1]
        ppcb = min(self.pages_per_compute_block, pps)
        kernel = functools.partial(
            paged_attention, block_h=16, pages_per_compute_block=ppcb,
            k_splits=min(self.max_k_splits, pps // ppcb), interpret=self.interpret,
        )  # fmt: skip

        def call(q, k_pages, v_pages, tables, lengths):
            return kernel(q, k_pages, v_pages, tables, lengths)

        if self.tp > 1:
            call = jax.shard_map(
                call, mesh=self.mesh, in_specs=(P(None, "tp", None), P("tp"), P("tp"), P(), P()),
                out_specs=P(None, "tp", None), check_vma=False,
            )  # fmt: skip
        qs = (q.astype(jnp.float32) * g.scale).astype(kv[0].dtype)
        out = call(qs, kv[0], kv[1], tables, fb.kv_len)
        return out.astype(q.dtype)
