"""What a checkpoint costs in memory, read without loading it: the KV bytes of one token and the
weights' element count, from a model directory's config.json and safetensors headers or a GGUF's
metadata and tensor shapes. No JAX and no weight bytes are read: the frontend sizes the KV pool
with it before any actor starts (actors/transport/memory.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ringserve.model.compute.attention.layout import kv_token_bytes
from ringserve.model.families import read_config

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # ServerArgs.dtype: weights and KV are held in it


@dataclasses.dataclass(frozen=True, slots=True)
class Footprint:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int  # weight elements as the checkpoint stores them (a tied head counted once)
    num_heads: int  # query heads (ringserve's TPU kernel copies KV heads fewer than tp to theirs)

    def kv_bytes_per_token(self, dtype: str, backend: str = "native", platform: str = "cpu", tp: int = 1) -> int:
        """K and V of every layer for one token over a group's `tp` devices together, in the
        layout of attention `backend` on `platform` (model/compute/attention/layout.py: jax's TPU
        kernel pads heads and head_dim, ringserve's copies KV heads fewer than tp)."""
        return kv_token_bytes(backend, platform, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                              num_heads=self.num_heads, head_dim=self.head_dim, tp=tp, itemsize=ITEMSIZE[dtype])  # fmt: skip

    def weight_bytes(self, dtype: str, quantization: str | None = None) -> int:
        """Bytes of the served weights: int8 holds nearly every element in one byte (the
        norms' few thousand and the per-column scales are left out of the estimate)."""
        return self.num_params * (1 if quantization == "int8" else ITEMSIZE[dtype])


def read_footprint(path: str | Path) -> Footprint:
    """The footprint of what `load_checkpoint` would load from `path` (a directory or a .gguf).
    ValueError naming the file when its config or headers cannot be read."""
    path = Path(path)
    if path.suffix == ".gguf":
        from ringserve.model.checkpoints.gguf import read_gguf_footprint

        layers, kv_heads, head_dim, params, heads = read_gguf_footprint(path)
        return Footprint(layers, kv_heads, head_dim, params, heads)
    from ringserve.model.checkpoints.load import safetensors_header

    mc = read_config(path)
    params = sum(math.prod(t["shape"]) for f in sorted(path.glob("*.safetensors")) for t in safetensors_header(f)[0].values())
    return Footprint(mc.num_layers, mc.num_kv_heads, mc.head_dim, params, mc.num_heads)
