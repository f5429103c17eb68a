"""The gated MLP: down(act(gate(x)) * up(x)), gate/up column-parallel, down row-parallel (each
replicated where `tp` does not divide the intermediate size); act is SiLU (SwiGLU: the Llama
lineage) or the tanh-approximated GELU (GeGLU: Gemma's `gelu_pytorch_tanh`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ringserve.model.compute.dots import Dot
from ringserve.model.layers.linear import Linear, Sharding, project


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)); `act`: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""

    def __init__(self, hidden: int, inter: int, dtype, column: Sharding, row: Sharding, dot: Dot = Dot(),
                 quant: str | None = None, act: str = "silu"):  # fmt: skip
        self.gate_proj = Linear(hidden, inter, dtype, column, dot=dot, quant=quant)
        self.up_proj = Linear(hidden, inter, dtype, column, dot=dot, quant=quant)
        self.down_proj = Linear(inter, hidden, dtype, row, dot=dot, quant=quant)
        self.act = act  # a name (static in the graphdef)

    def __call__(self, x: jax.Array, lora: Any = None, layer: jax.Array | int | None = None) -> jax.Array:
        """`lora`: the layer's adapters (model/layers/lora.py LayerLora), added to each projection;
        `layer`: which layer's weights multiply, where they are stacked (linear.py `project`)."""
        fusable = lora is None and self.act == "silu"  # the kernel's fused call is SwiGLU's
        if fusable and (h := fused_gate_up(x, self.gate_proj, self.up_proj, layer)) is not None:
            return self.down_proj(h, layer)
        g, u = project(x, self.gate_proj, self.up_proj, layer=layer)
        act = ACTIVATIONS[self.act]
        if lora is None:
            return self.down_proj(act(g) * u, layer)
        h = act(lora.apply("gate_proj", x, g)) * lora.apply("up_proj", x, u)
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


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh approximation (torch's `gelu(approximate="tanh")`, HF's gelu_pytorch_tanh) in
    f32, rounded to x's dtype once, as torch computes it for bf16."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
