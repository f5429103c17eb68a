"""Linear projections and the token embedding. Linear weights are `[in, out]` (HF's `[out, in]`
transposed at load, model/weights/state.py), so every projection is `x @ w`; each parameter is
an `nnx.Param` annotated with its `tp` sharding (`out_sharding`, model/compute/mesh.py), which the
loader places (model/layers/decoder.py `CausalLM.place`): nothing shards eagerly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ringserve.model.compute.dots import Dot

Sharding = tuple[str | None, ...]  # an `out_sharding`: mesh axis (or None) per dimension; () = replicated


def param(shape: tuple[int, ...], dtype, sharding: Sharding = ()) -> nnx.Param:
    """A parameter of `shape` with its `tp` sharding annotation. Zeros: modules are built
    abstractly (`nnx.eval_shape`) and filled from the checkpoint."""
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=sharding, eager_sharding=False)


class Linear(nnx.Module):
    """x [T, in] @ weight [in, out] (+ bias [out], which shares the weight's output split).
    `sharding` of the [in, out] weight: (None, "tp") column-parallel, ("tp", None) row-parallel, ().
    `dot`: how the product is computed (model/compute/dots.py). `quant="int8"`: weight-only int8,
    the weight int8 and `scale` [out] f32 (output n is (x @ weight[n, :]) * scale[n];
    model/weights/quant.py quantizes), stored [out, in] (`transposed`, HF's own layout): each
    output's inputs are then one run of bytes, which the decode kernel streams 1.65x faster than
    [in, out]'s strided rows (SmolLM2's layers at M=1: 7.3 -> 4.4 ms; a whole bf16 + int8 decode
    step 14.7 -> 13.7 ms, medians of 4 alternating runs, 64 rows even; bf16 gains 1.14x and f32
    1.09x alone: they stay [in, out])."""

    def __init__(self, n_in: int, n_out: int, dtype, sharding: Sharding = (), bias: bool = False,
                 dot: Dot = Dot(), quant: str | None = None):  # fmt: skip
        self.transposed = quant is not None
        shape, split = ((n_out, n_in), tuple(reversed(sharding))) if quant else ((n_in, n_out), sharding)
        self.weight = param(shape, jnp.int8 if quant else dtype, split)
        self.scale = param((n_out,), jnp.float32, sharding[1:]) if quant else None
        self.bias = param((n_out,), dtype, sharding[1:]) if bias else None
        self.dot = dot

    def __call__(self, x: jax.Array, layer: jax.Array | int | None = None) -> jax.Array:
        return project(x, self, layer=layer)[0]


def project(x: jax.Array, *linears: Linear, layer: jax.Array | int | None = None) -> list[jax.Array]:
    """[lin(x) for lin in linears]: projections that share x (q/k/v, gate/up) as one custom call
    where the dot groups them (model/compute/dots.py `Dot.matmuls`).

    Weights stacked over the layers (`Decoder`'s scan on CPU hands over each projection's
    whole stack, `[L, ...]`, weight and scale) multiply as layer `layer`'s."""
    ws = [lin.weight[...] for lin in linears]
    scales = [None if lin.scale is None else lin.scale[...] for lin in linears]
    at = layer if ws[0].ndim == 3 else None  # per-layer weights (unrolled): `layer` is not theirs to index
    dot = linears[0].dot
    ys = None
    if len({lin.transposed for lin in linears}) == 1:
        given = [s for s in scales if s is not None]  # every projection int8 (transposed), or none
        ys = dot.matmuls(x, ws, linears[0].transposed, given or None, at)
    if ys is None:
        ys = [lin.dot(x, w, lin.transposed, s, layer=at) for lin, w, s in zip(linears, ws, scales, strict=True)]
    return [y if lin.bias is None else y + lin.bias[...] for lin, y in zip(linears, ys, strict=True)]


class Embedding(nnx.Module):
    """Token embedding, weight [V, H] (replicated); a tied checkpoint's LM head reads it too.
    `quant="int8"`: weight int8 and `scale` [V] f32, one per token's row (the LM head's columns)."""

    def __init__(self, vocab: int, hidden: int, dtype, quant: str | None = None):
        self.weight = param((vocab, hidden), jnp.int8 if quant else dtype)
        self.scale = param((vocab,), jnp.float32) if quant else None
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        rows = jnp.take(self.weight[...], ids, axis=0)
        if self.scale is None:
            return rows
        return (rows.astype(jnp.float32) * jnp.take(self.scale[...], ids)[:, None]).astype(self.dtype)
