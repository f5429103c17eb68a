"""LoRA adapters on device: the fixed pool of adapter slots every step program reads (its layout
and the per-row product the projections add: model/layers/lora.py).

S = max_loras_per_batch + 1 slots, R = max_lora_rank; an adapter of rank r < R fills rows
[0, r) of its slot and leaves zeros (model/checkpoints/peft.py pads it), so one compiled program
serves every mix of adapters and ranks. Slot 0 is all zeros. Loading an adapter writes its slot
in place (`write`, one jitted update with the slot as an argument, compiled once: nothing else
recompiles); the step programs never change.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ringserve.model.checkpoints.peft import Adapter
from ringserve.model.config import ModelConfig
from ringserve.model.families.base import Family


class LoraPool:
    """The pool's device arrays and the host copy of each slot's adapter (to rebuild the pool
    after `release`). Slots are written whole: `write(slot, adapter)` / `clear(slot)`."""

    def __init__(self, family: Family, cfg: ModelConfig, slots: int, max_rank: int, targets: tuple[str, ...],
                 stacked: bool, dtype: Any, sharding: Any):  # fmt: skip
        self.cfg, self.slots, self.max_rank, self.targets = cfg, slots, max_rank, targets
        self.dims = {m: family.module_dims(cfg, m)[1:] for m in targets}  # (in, out) of each targeted projection
        self.stacked, self.dtype, self.sharding = stacked, dtype, sharding
        self.host: dict[int, Adapter] = {}  # slot -> adapter written there
        self.write_traces = 0  # traces of the slot writer (1: it never recompiles)

        def write(weights, slot, scale, a, b):
            self.write_traces += 1
            axis = 1 if stacked else 0
            layers: Any
            if stacked:
                layers = {m: (jax.lax.dynamic_update_index_in_dim(pa, a[m], slot, axis),
                              jax.lax.dynamic_update_index_in_dim(pb, b[m], slot, axis))
                          for m, (pa, pb) in weights["layers"].items()}  # fmt: skip
            else:
                layers = [{m: (jax.lax.dynamic_update_index_in_dim(pa, a[m][i], slot, 0),
                               jax.lax.dynamic_update_index_in_dim(pb, b[m][i], slot, 0))
                           for m, (pa, pb) in layer.items()} for i, layer in enumerate(weights["layers"])]  # fmt: skip
            return {"scale": weights["scale"].at[slot].set(scale), "layers": layers}

        self._write = jax.jit(write, donate_argnums=0)
        self.weights: Any = None
        self.resume()

    # ---- shapes -----------------------------------------------------------------------------
    def _zeros(self) -> Any:
        L, S, R = self.cfg.num_layers, self.slots, self.max_rank

        def z(*shape: int) -> np.ndarray:
            return np.zeros(shape, self.dtype)

        dims = self.dims
        if self.stacked:
            layers: Any = {m: (z(L, S, R, i), z(L, S, R, o)) for m, (i, o) in dims.items()}
        else:
            layers = [{m: (z(S, R, i), z(S, R, o)) for m, (i, o) in dims.items()} for _ in range(L)]
        return {"scale": np.zeros(S, np.float32), "layers": layers}

    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(self.weights))

    # ---- slots ------------------------------------------------------------------------------
    def write(self, slot: int, adapter: Adapter) -> None:
        """Slot `slot` (1..S-1) holds `adapter` from the next step on (its shapes were checked
        against the pool's by the reader)."""
        if not 1 <= slot < self.slots:
            raise ValueError(f"LoRA slot {slot} outside [1, {self.slots})")
        self._put(slot, adapter.scale, adapter.a, adapter.b)
        self.host[slot] = adapter

    def clear(self, slot: int) -> None:
        """Slot `slot` back to zeros (its adapter was unloaded)."""
        self.host.pop(slot, None)
        self._put(slot, 0.0, *self._zero_adapter())

    def _put(self, slot: int, scale: float, a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
        if self.weights is None:  # released: written on resume
            return
        cast = {m: x.astype(self.dtype) for m, x in a.items()}, {m: x.astype(self.dtype) for m, x in b.items()}
        self.weights = self._write(self.weights, np.int32(slot), np.float32(scale), *cast)

    # ---- device memory ----------------------------------------------------------------------
    def release(self) -> None:
        """Free the pool on the device (the adapters' host copies stay)."""
        if self.weights is not None:
            for leaf in jax.tree_util.tree_leaves(self.weights):
                leaf.delete()
            self.weights = None

    def resume(self) -> None:
        """The pool on the device again, every loaded adapter in its slot."""
        if self.weights is not None:
            return
        self.weights = jax.device_put(self._zeros(), self.sharding)
        for slot, ad in sorted(self.host.items()):
            self._put(slot, ad.scale, ad.a, ad.b)
        if not self.host:  # compile the writer now (slot 0 stays zero), not at the first load
            self._put(0, 0.0, *self._zero_adapter())

    def _zero_adapter(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        L, R = self.cfg.num_layers, self.max_rank
        a = {m: np.zeros((L, R, self.dims[m][0]), np.float32) for m in self.targets}
        b = {m: np.zeros((L, R, self.dims[m][1]), np.float32) for m in self.targets}
        return a, b
