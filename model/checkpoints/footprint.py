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
from ringserve.model.config import ModelConfig
from ringserve.model.families import read_config

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # ServerArgs.dtype: weights and KV are held in it


@dataclasses.dataclass(frozen=True, slots=True)
class Footprint:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int  # weight elements as the checkpoint stores them (a tied head counted once)
    num_heads: int  # query heads (ringserve's TPU kernel copies KV heads fewer than tp to theirs)
    sliding_layers: int = 0  # layers with a sliding window where the model mixes them with global ones; else 0
    sliding_window: int = 0  # their window (keys a query sees); 0 where sliding_layers is

    def kv_bytes_per_token(self, dtype: str, backend: str = "native", platform: str = "cpu", tp: int = 1,
                           layers: int | None = None) -> int:  # fmt: skip
        """K and V of every layer (or of `layers` of them: the global or the sliding ones of a
        local page space) for one token over a group's `tp` devices together, in the layout of
        attention `backend` on `platform` (model/compute/attention/layout.py: jax's TPU kernel
        pads heads and head_dim, ringserve's copies KV heads fewer than tp)."""
        num_layers = self.num_layers if layers is None else layers
        return kv_token_bytes(backend, platform, num_layers=num_layers, num_kv_heads=self.num_kv_heads,
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

        layers, kv_heads, head_dim, params, heads, windows = read_gguf_footprint(path)
        return Footprint(layers, kv_heads, head_dim, params, heads, *sliding_of(windows))
    from ringserve.model.checkpoints.load import safetensors_header

    mc = read_config(path)
    params = sum(math.prod(t["shape"]) for f in sorted(path.glob("*.safetensors")) for t in safetensors_header(f)[0].values())
    return footprint_of(mc, params)


def footprint_of(mc: ModelConfig, num_params: int) -> Footprint:
    """The footprint of a model of config `mc` whose weights hold `num_params` elements."""
    return Footprint(mc.num_layers, mc.num_kv_heads, mc.head_dim, num_params, mc.num_heads, *sliding_of(mc.layer_windows))


def sliding_of(windows: tuple[int, ...] | None) -> tuple[int, int]:
    """(sliding layers, their window) of per-layer `windows` (ModelConfig.layer_windows) where
    they mix sliding (> 0) and global (0) layers; (0, 0) otherwise (none slide, or all do)."""
    if windows is None or all(windows) or not any(windows):
        return 0, 0
    sliding = [w for w in windows if w]
    return len(sliding), max(sliding)
