"""The gated MLP of the Llama lineage: down(act(gate(x)) * up(x)), gate/up column-parallel, down
row-parallel (each replicated where `tp` does not divide the intermediate size)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ringserve.model.compute.dots import Dot
from ringserve.model.layers.linear import Linear, Sharding, project


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)) (SwiGLU)."""

    def __init__(self, hidden: int, inter: int, dtype, column: Sharding, row: Sharding, dot: Dot = Dot(),
                 quant: str | None = None):  # fmt: skip
        self.gate_proj = Linear(hidden, inter, dtype, column, dot=dot, quant=quant)
        self.up_proj = Linear(hidden, inter, dtype, column, dot=dot, quant=quant)
        self.down_proj = Linear(inter, hidden, dtype, row, dot=dot, quant=quant)

    def __call__(self, x: jax.Array, lora: Any = None, layer: jax.Array | int | None = None) -> jax.Array:
        """`lora`: the layer's adapters (model/layers/lora.py LayerLora), added to each projection;
        `layer`: which layer's weights multiply, where they are stacked (linear.py `project`)."""
        if lora is None and (h := fused_gate_up(x, self.gate_proj, self.up_proj, layer)) is not None:
            return self.down_proj(h, layer)
        g, u = project(x, self.gate_proj, self.up_proj, layer=layer)
        if lora is None:
            return self.down_proj(silu(g) * u, layer)
        h = silu(lora.apply("gate_proj", x, g)) * lora.apply("up_proj", x, u)
        return lora.apply("down_proj", h, self.down_proj(h, layer))


def fused_gate_up(x: jax.Array, gate: Linear, up: Linear, layer: jax.Array | int | None) -> jax.Array | None:
    """silu(gate(x)) * up(x) in one call where the dot fuses it (model/compute/dots.py
    `Dot.gated`: two projections of one layout, no bias, both int8 or neither); else None."""
    if gate.transposed != up.transposed or (gate.scale is None) != (up.scale is None):
        return None
    if gate.bias is not None or up.bias is not None:
        return None
    wg, wu = gate.weight[...], up.weight[...]
    scales = None if gate.scale is None or up.scale is None else [gate.scale[...], up.scale[...]]
    return gate.dot.gated(x, [wg, wu], gate.transposed, scales, layer if wg.ndim == 3 else None)


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x) computed in f32 and rounded to x's dtype once, as torch computes it for
    bf16 (`jax.nn.silu` on bf16 rounds after each of its five ops: XLA:CPU converts to f32 and
    back around each; SmolLM2's 2048-token bf16 prefill spent ~107 ms of 1.35 s in that fusion)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)
