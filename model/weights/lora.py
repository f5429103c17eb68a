"""LoRA adapters on device: a fixed pool of adapter slots every step program reads, and the
per-row batched product (the punica / S-LoRA idea) the projections add.

The pool (`LoraPool.weights`, a pytree the step takes as an argument like the parameters):

    scale                [S] f32        slot s's lora_alpha / r; slot 0 = no adapter: 0
    layers  "unrolled":  [ {module: (a [S, R, in], b [S, R, out])} for each layer ]
            "scan":      {module: (a [L, S, R, in], b [L, S, R, out])}   (scanned with the layers)

S = max_loras_per_batch + 1 slots, R = max_lora_rank; an adapter of rank r < R fills rows
[0, r) of its slot and leaves zeros (model/checkpoints/peft.py pads it), so one compiled program
serves every mix of adapters and ranks. Slot 0 is all zeros. Loading an adapter writes its slot
in place (`write`, one jitted update with the slot as an argument, compiled once: nothing else
recompiles); the step programs never change.

A step's rows each name a slot (`LoraBatch.row_slot` [R], 0 = none); every token takes its
row's. A targeted projection of x [T, in] then adds

    delta[t] = scale[s_t] * (x[t] @ a[s_t].T) @ b[s_t]          s_t: token t's slot

in one of two static forms (same math; `ExecutorConfig.lora_gather` picks one per executor):
- dense (the default): x times every slot's A at once ([T, S * R]: S * R is small), the
  columns of other slots than the token's zeroed (with the scale), times every slot's B
  stacked ([S * R, out]); two plain matmuls, no gather;
- gather (punica's BGMV): each token's own a and b gathered ([T, R, in], [T, R, out]), two
  batched products of rank R: S times fewer flops, but T copies of the factors.
Measured on CPU (tiny model, decode step of 64 rows, rank 16, all 7 projections, the cases
interleaved, load ~10): no LoRA 28.0 ms, dense 35.1 ms (5 slots) / 36.0 ms (9 slots), gather
85.1 / 92.0 ms: XLA:CPU's gathers cost more than the S-fold flops. Accelerators are not
measured yet (`python -m ringserve.bench.lora --gather` compares the two).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from ringserve.model.checkpoints.peft import Adapter, module_dims
from ringserve.model.config import ModelConfig


class LoraBatch(NamedTuple):
    """A step's LoRA input: each row's adapter slot, and the pool (kept on device)."""

    row_slot: Any  # [R] int32, 0 = no adapter
    weights: Any  # the pool (module docstring)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, tok_slot: jax.Array, scale: jax.Array,
               gather: bool = False) -> jax.Array:  # fmt: skip
    """x [T, in], a [S, R, in], b [S, R, out], tok_slot [T], scale [S] -> [T, out] (in x's
    dtype); the dense form, or with `gather` the gather form (module docstring)."""
    t, (s, r, n_in) = x.shape[0], a.shape
    w = scale[tok_slot].astype(x.dtype)  # [T]
    if gather:
        xa = jnp.einsum("ti,tri->tr", x, a[tok_slot]) * w[:, None]
        return jnp.einsum("tr,tro->to", xa, b[tok_slot])
    xa = (x @ a.reshape(s * r, n_in).T).reshape(t, s, r)
    keep = jnp.where(tok_slot[:, None] == jnp.arange(s)[None, :], w[:, None], 0).astype(x.dtype)  # [T, S]
    return (xa * keep[:, :, None]).reshape(t, s * r) @ b.reshape(s * r, -1)


class LayerLora:
    """One layer's adapters as a projection sees them (inside the trace): `apply(name, x, y)`
    is y plus the delta of module `name`, or y where the pool does not target it."""

    def __init__(self, layer: dict[str, tuple[jax.Array, jax.Array]], tok_slot: jax.Array, scale: jax.Array,
                 gather: bool = False):  # fmt: skip
        self.layer, self.tok_slot, self.scale, self.gather = layer, tok_slot, scale, gather

    def apply(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        ab = self.layer.get(name)
        if ab is None:
            return y
        return y + lora_delta(x, ab[0], ab[1], self.tok_slot, self.scale, self.gather).astype(y.dtype)


def token_slots(row_slot: jax.Array, row_start: jax.Array, num_rows: jax.Array, t: int) -> jax.Array:
    """[T] int32: each packed token's row's slot (padding tokens: 0)."""
    r = row_slot.shape[0]
    flat = jnp.arange(t)
    tok_row = jnp.clip(jnp.searchsorted(row_start, flat, side="right") - 1, 0, r - 1)
    return jnp.where(flat < row_start[num_rows[0]], row_slot[tok_row], 0).astype(jnp.int32)


def apply_lora(lora: LayerLora | None, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y plus module `name`'s adapter delta (y itself without adapters)."""
    return y if lora is None else lora.apply(name, x, y)


class LoraPool:
    """The pool's device arrays and the host copy of each slot's adapter (to rebuild the pool
    after `release`). Slots are written whole: `write(slot, adapter)` / `clear(slot)`."""

    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, targets: tuple[str, ...], stacked: bool,
                 dtype: Any, sharding: Any):  # fmt: skip
        self.cfg, self.slots, self.max_rank, self.targets = cfg, slots, max_rank, targets
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

        dims = {m: module_dims(self.cfg, m) for m in self.targets}
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
        a = {m: np.zeros((L, R, module_dims(self.cfg, m)[0]), np.float32) for m in self.targets}
        b = {m: np.zeros((L, R, module_dims(self.cfg, m)[1]), np.float32) for m in self.targets}
        return a, b
