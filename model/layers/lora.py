"""LoRA's per-row product inside the step (the punica / S-LoRA idea): each token adds its row's
adapter to the projections the pool targets. The pool itself (slots, loading) is
model/weights/lora.py's `LoraPool`; its layout:

    scale                [S] f32        slot s's lora_alpha / r; slot 0 = no adapter: 0
    layers  "unrolled":  [ {module: (a [S, R, in], b [S, R, out])} for each layer ]
            "scan":      {module: (a [L, S, R, in], b [L, S, R, out])}   (scanned with the layers)

A step's rows each name a slot (`LoraBatch.row_slot` [R], 0 = none); every token takes its
row's. A targeted projection of x [T, in] then adds

    delta[t] = scale[s_t] * (x[t] @ a[s_t].T) @ b[s_t]          s_t: token t's slot

in one of two static forms (same math; the compute options' `lora_gather` picks one per executor):
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
