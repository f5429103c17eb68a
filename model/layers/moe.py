"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral) and its decoder layer.

    router   logits = x @ gate [H, E] (in the model's dtype), softmax in f32, top-k
             (`norm_topk_prob`: the k probabilities renormalized to sum to 1), as HF's routers
    experts  each token's k (token, expert) pairs sorted by expert, so each expert's rows are one
             contiguous group; gate/up/down multiply as ragged groups (the plan's `grouped`,
             model/compute/grouped.py: `jax.lax.ragged_dot`, megablox on TPU), never a dense
             product over every expert; outputs put back in token order, weighted, summed over k
    shared   Qwen2-MoE: a dense gated MLP beside them, scaled by sigmoid(x @ shared_expert_gate)

    rows of the grouped product (T tokens, k = 2, sorted by expert id):
        pair p = t * k + j  (token t's j-th choice)  --argsort(expert of p)-->  [e0 e0 e0 e1 e2 e2 ...]
        group_sizes [E] = how many pairs chose each expert;  inverse permutation puts them back

Expert weights are one leaf per projection, [E, in, out] ([L, E, in, out] stacked; int8: [E, out,
in] + scale [E, out], model/weights/quant.py), loaded from HF's per-expert tensors
(model/families/base.py `MoeTensor`). With expert parallelism the expert axis is split over the
mesh's `tp` devices (model/compute/mesh.py `ep_split`) and the pairs reach their experts in one of
two forms (model/layers/expert_parallel.py): "psum" (every device sorts every token's pairs,
multiplies its own experts' run, one psum of the combined [T, H]) below the plan's
`moe_a2a_rows`, "a2a" (each device routes its T / ep tokens, all_to_all to the experts' devices
and back, all_gather) from it on; with tokens replicated by the tensor-parallel attention the
plan keeps psum at every size (expert_parallel.py says why, with the compiled figures).
On CPU the grouped product runs the plan's dot per group tile (model/compute/grouped.py "tiles"),
reading an expert's weight in place from the stack, as the dense projections do. `MoeBlock.__call__` returns the expert ids
[T, k] for routing replay (model/layers/decoder.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ringserve.model.compute.dots import Dot
from ringserve.model.compute.grouped import GroupedDot
from ringserve.model.compute.mesh import ep_split, tp_split
from ringserve.model.config import ModelConfig
from ringserve.model.layers.attention import Attention
from ringserve.model.layers.expert_parallel import combine_pairs, expert_parallel
from ringserve.model.layers.linear import Linear, Sharding, param
from ringserve.model.layers.lora import LayerLora
from ringserve.model.layers.mlp import GatedMLP, silu
from ringserve.model.layers.norm import RMSNorm


class ExpertProj(nnx.Module):
    """E experts' projections: weight [E, in, out]; int8: [E, out, in] (HF's layout) + scale [E, out]."""

    def __init__(self, experts: int, n_in: int, n_out: int, dtype, sharding: Sharding, dot: Dot, quant: str | None):
        self.transposed = quant is not None
        self.weight = param((experts, n_out, n_in) if quant else (experts, n_in, n_out), jnp.int8 if quant else dtype,
                            sharding)  # fmt: skip
        self.scale = param((experts, n_out), jnp.float32, sharding[:1] + (None,) * bool(sharding)) if quant else None
        self.dot = dot

    @property
    def arrays(self) -> tuple[jax.Array, ...]:
        return (self.weight[...],) if self.scale is None else (self.weight[...], self.scale[...])


def expert_product(xs: jax.Array, sizes: jax.Array, row0: Any, w: tuple[jax.Array, ...], layer: Any,
                   grouped: GroupedDot, dot: Dot, transposed: bool) -> jax.Array:  # fmt: skip
    """xs [P, in] (rows grouped by expert, `sizes` [E] of them each from row `row0` on) times
    each group's expert of `w` (an ExpertProj's `arrays`) -> [P, out], zero outside those rows.
    Where the scan hands the whole stack over ([L, E, ...]: the plan's dot reads it in place,
    model/layers/decoder.py), layer `layer`'s experts multiply."""
    weight, scale = w[0], w[1] if len(w) > 1 else None
    base: Any = 0
    if weight.ndim == 4:  # [L, E, ...] -> [L * E, ...] (a view): expert e of layer l is l * E + e
        base = layer * weight.shape[1]
        weight = weight.reshape(-1, *weight.shape[2:])
        scale = None if scale is None else scale.reshape(-1, scale.shape[-1])
    return grouped(xs, weight, sizes, dot, transposed, scale, base, row0)


class Experts(nnx.Module):
    """gate_proj, up_proj, down_proj of every expert (SwiGLU each), and how the routed tokens
    reach them: one device (ep 1), or split by expert over the `tp` devices in one of two forms
    (model/layers/expert_parallel.py), chosen per program by its rows (`a2a_rows`)."""

    def __init__(self, cfg: ModelConfig, plan: Any):
        e, h, i, dt, q = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, plan.jnp_dtype, plan.quant
        split, dot = ep_split(3, e, plan.ep), plan.dot
        self.gate_proj = ExpertProj(e, h, i, dt, split, dot, q)
        self.up_proj = ExpertProj(e, h, i, dt, split, dot, q)
        self.down_proj = ExpertProj(e, i, h, dt, split, dot, q)
        self.ep = plan.ep if split else 1  # devices the experts are split over
        self.a2a_rows = plan.moe_a2a_rows  # the fewest tokens a step routes by all-to-all (None: never)

    def mlp(self, xs: jax.Array, sizes: jax.Array, row0: Any, arrays: Any, layer: Any, grouped: GroupedDot) -> jax.Array:
        """down(silu(gate(xs)) * up(xs)) of each row's expert, xs [P, H] grouped by expert
        (`sizes` [G] of them from row `row0` on; `arrays`: the three projections' weights, all
        experts or a device's G), zero outside those rows."""
        p = self.gate_proj
        wg, wu, wd = arrays
        h = silu(expert_product(xs, sizes, row0, wg, layer, grouped, p.dot, p.transposed))
        h = h * expert_product(xs, sizes, row0, wu, layer, grouped, p.dot, p.transposed)
        return expert_product(h, sizes, row0, wd, layer, grouped, p.dot, p.transposed)

    def form(self, tokens: int) -> str:
        """How a step of `tokens` rows reaches the experts: "local" (ep 1), "a2a" (at least
        `a2a_rows` tokens, split evenly over the devices) or "psum"."""
        if self.ep == 1:
            return "local"
        a2a = self.a2a_rows is not None and tokens >= self.a2a_rows and tokens % self.ep == 0
        return "a2a" if a2a else "psum"

    def __call__(self, x: jax.Array, top_p: jax.Array, top_i: jax.Array, grouped: GroupedDot, layer: Any) -> jax.Array:
        """sum_j top_p[t, j] * expert_{top_i[t, j]}(x[t]), float32 [T, H], for x [T, H] (the same on
        every device between the tensor-parallel layers) and its routing [T, k]."""
        arrays = (self.gate_proj.arrays, self.up_proj.arrays, self.down_proj.arrays)
        form = self.form(x.shape[0])
        if form == "local":
            e = arrays[0][0].shape[-3]
            return combine_pairs(x, top_p, top_i, e, lambda xs, sizes: self.mlp(xs, sizes, 0, arrays, layer, grouped))
        layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
        return expert_parallel(form, self.ep, self.mlp, grouped, x, top_p, top_i, arrays, layer)


class SparseMoe(nnx.Module):
    """The router (`gate`), the experts and, where `shared`, Qwen2-MoE's shared expert and its gate."""

    def __init__(self, cfg: ModelConfig, plan: Any, *, shared: bool = False):
        h, e, dt, tp = cfg.hidden_size, cfg.num_experts, plan.jnp_dtype, plan.tp
        # The gates (router, shared expert's) in float, replicated, never int8 (HF's routing to the
        # bit), by XLA's dot; in the deterministic mode by its batch-invariant one, else a token's
        # routing weights would depend on the step's other rows.
        gates = plan.dot if plan.dot.invariant else Dot()
        self.gate = Linear(h, e, dt, dot=gates)
        self.experts = Experts(cfg, plan)
        i = cfg.shared_expert_intermediate_size
        self.shared_expert = nnx.data(
            GatedMLP(h, i, dt, tp_split(2, 1, i, tp), tp_split(2, 0, i, tp), plan.dot, plan.quant) if shared else None)
        self.shared_expert_gate = nnx.data(Linear(h, 1, dt, dot=gates) if shared else None)
        self.k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.grouped = plan.grouped

    def __call__(self, x: jax.Array, layer: Any = None) -> tuple[jax.Array, jax.Array]:
        """x [T, H] -> (the MoE output [T, H], each token's expert ids [T, k] int32)."""
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
        top_p, top_i = jax.lax.top_k(probs, self.k)  # [T, k], largest first (torch.topk's order)
        if self.norm_topk:
            top_p = top_p / top_p.sum(axis=-1, keepdims=True)
        out = self.experts(x, top_p, top_i, self.grouped, layer)  # [T, H] f32
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            g = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))
            out = out + g * self.shared_expert(x, None, layer).astype(jnp.float32)
        return out.astype(x.dtype), top_i.astype(jnp.int32)


class MoeBlock(nnx.Module):
    """input_layernorm -> self_attn -> + residual -> post_attention_layernorm -> mlp (SparseMoe)
    -> + residual: the Llama lineage's layer (model/layers/block.py) with a routed MLP. Returns
    (x, kv, expert ids [T, k]) (model/layers/decoder.py, routing replay)."""

    def __init__(self, cfg: ModelConfig, plan: Any, backend: Any, *, bias: bool = False, qk_norm: bool = False,
                 shared: bool = False):  # fmt: skip
        h, eps, dt = cfg.hidden_size, cfg.rms_norm_eps, plan.jnp_dtype
        self.input_layernorm = RMSNorm(h, eps, dt, plan.block_norm)
        self.self_attn = Attention(cfg, plan, backend, bias=bias, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(h, eps, dt, plan.block_norm)
        self.mlp = SparseMoe(cfg, plan, shared=shared)

    def __call__(self, x, cos, sin, kv, layer, fb, lora: LayerLora | None = None) -> tuple[jax.Array, Any, jax.Array]:
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, fb, lora)
        x, h = self.post_attention_layernorm.add(x, a)
        y, ids = self.mlp(h, layer)
        return x + y, kv, ids
