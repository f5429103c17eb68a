"""The decoder-only stack every family builds (model/families/), and `CausalLM`, its functional
face for the step programs.

    Decoder                         embed_tokens, layers, norm, lm_head (untied checkpoints)
      layers: the family's block    e.g. model/layers/block.py PreNormBlock

`Decoder.__call__` runs one step over the densely packed new tokens of every row
(model/compute/step_inputs.py): matmuls see the flat [T, hidden] tokens, attention goes through
the backend's interface (model/compute/attention/base.py: `write`, `attend`; a plain object the
attention module holds). Two layouts of the layers (the plan's `layer_loop`, model/compute/plan.py):

    "scan"      one block whose Params carry a leading L axis; one `lax.scan` over its
                state carries the hidden states and the whole KV cache, so XLA compiles one
                layer body and updates the cache in place (accelerators; CPU with its
                custom-call dots, ringserve's kernel or oneDNN's, which are handed each
                projection's whole stack and the layer index and read the layer in place: a
                scanned slice would be a copy every step)
    "unrolled"  an nnx.List of L blocks, each layer's weights in buffers of their own,
                traced one after another (CPU with XLA's dot alone)

Routing replay (mixture-of-experts families, model/layers/moe.py): `Decoder.__call__(...,
routed=True)` (and `CausalLM.forward`) returns a third value, the expert ids each MoE layer routed
each token to, as the forward used them:

    routed   int32 [T, M, k]   T: the step's tokens (the rows of h), in h's order
                               M: the MoE layers, `cfg.moe_layers` in order (M = 0: a dense family)
                               k: `cfg.num_experts_per_tok`, in the router's order (largest
                                  probability first, as torch.topk orders them)
    `CausalLM.routed_shape` is (M, k) without tracing. Padded tokens carry ids too (ignore them).

A block whose MLP routes (model/layers/moe.py `MoeBlock`) returns (x, kv, ids [T, k]); every
other block returns (x, kv). The scanned loop stacks the ids as the scan's ys; unrolled, they are
stacked after the loop; routed=False leaves them to XLA's dead-code elimination.

Every compiled program takes the Decoder's state (model/weights/state.py) as its first argument
and rebuilds the module inside the trace (`CausalLM.forward` / `logits`: `nnx.merge`), so jit
sees pytrees of arrays and new weights of the same shapes and shardings never recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ringserve.model.compute.mesh import place_host_array, tp_split
from ringserve.model.config import ModelConfig, rope_inv_freq
from ringserve.model.layers.linear import Embedding, Linear
from ringserve.model.layers.lora import LayerLora, LoraBatch, token_slots
from ringserve.model.layers.norm import RMSNorm
from ringserve.model.layers.rope import rope_tables

Block = Callable[[], nnx.Module]  # one decoder layer: (x, cos, sin, kv, layer, fb, lora) -> (x, kv[, routed ids])


class Decoder(nnx.Module):
    """The whole model: token embedding, the decoder layers (either layout) made by `block`,
    final norm, LM head (vocab-parallel; tied checkpoints reuse the embedding instead)."""

    def __init__(self, cfg: ModelConfig, plan: Any, block: Block):
        dt, quant = plan.jnp_dtype, plan.quant
        # quant="int8": every projection, the LM head and the embedding are weight-only int8
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dt, quant)
        self.layers: nnx.List | nnx.Module
        if plan.layer_loop == "unrolled":
            self.layers = nnx.List([block() for _ in range(cfg.num_layers)])
        else:  # one layer's modules, every Param [L, ...]; the sharding gains a None for L
            stack = nnx.vmap(block, in_axes=None, out_axes=0, axis_size=cfg.num_layers,
                             transform_metadata={nnx.PARTITION_NAME: None})  # fmt: skip
            self.layers = stack()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, plan.norm)
        v, h = cfg.vocab_size, cfg.hidden_size
        self.lm_head = None if cfg.tie_word_embeddings else Linear(h, v, dt, tp_split(2, 1, v, plan.tp), quant=quant)
        self.cfg = cfg
        self.dot = plan.dot  # the LM head's product (model/compute/dots.py)
        self.layer_unroll = plan.layer_unroll
        self.vocab_major_logits = plan.vocab_major_logits
        self.lora_gather = plan.lora_gather  # the adapters' product in its gather form (model/layers/lora.py)
        self.rope_table_positions = plan.rope_table_positions  # RoPE from host-made tables (rope.py rope_tables)

    def __call__(self, ids: jax.Array, fb: Any, kv: Any, lora: LoraBatch | None = None,
                 routed: bool = False) -> tuple[Any, ...]:  # fmt: skip
        """Final hidden states [T, H] of the step's tokens, and the updated KV cache. `lora`:
        each row's adapter slot and the adapter pool (model/layers/lora.py), when adapters are served.
        `routed`: also each MoE layer's expert ids, int32 [T, M, k] (the module docstring)."""
        inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim)
        cos, sin = rope_tables(fb.positions, inv_freq, self.rope_table_positions)
        x = self.embed_tokens(ids)
        tok_slot = token_slots(lora.row_slot, fb.row_start, fb.num_rows, ids.shape[0]) if lora is not None else None

        def layer_lora(pool_layer: Any) -> LayerLora | None:
            if lora is None or tok_slot is None:
                return None
            return LayerLora(pool_layer, tok_slot, lora.weights["scale"], self.lora_gather)

        routes: list[jax.Array] = []  # each MoE layer's ids [T, k], in layer order
        if isinstance(self.layers, nnx.List):
            for i, layer in enumerate(self.layers):  # i: a Python int, static in each layer's graph
                x, kv, *r = layer(x, cos, sin, kv, i, fb, layer_lora(lora.weights["layers"][i] if lora is not None else None))
                routes += r
            stacked_routes = jnp.stack(routes, axis=1) if routes else None
        else:
            # With CPU's custom-call dots (ringserve's kernel, oneDNN) the projections' weights
            # stay whole: the call reads layer i's in place from the stack (dots.py `Dot`),
            # where a scanned slice of them would be a copy every step; the rest (norms,
            # biases) is sliced by the scan
            in_place = _stack_read_in_place if self.dot.reads_stack else nnx.Nothing
            graphdef, whole, stacked = nnx.split(self.layers, in_place, ...)  # type: ignore[misc]
            pool = lora.weights["layers"] if lora is not None else None

            def body(carry, xs):
                x, kv, i = carry
                state, pool_layer = xs
                x, kv, *r = nnx.merge(graphdef, whole, state)(x, cos, sin, kv, i, fb, layer_lora(pool_layer))
                return (x, kv, i + 1), (r[0] if r else None)

            (x, kv, _), ys = jax.lax.scan(body, (x, kv, jnp.int32(0)), (stacked, pool), unroll=self.layer_unroll)
            stacked_routes = None if ys is None else jnp.swapaxes(ys, 0, 1)  # [L, T, k] -> [T, L, k]
        if not routed:
            return self.norm(x), kv
        m, k = len(self.cfg.moe_layers), self.cfg.num_experts_per_tok if self.cfg.moe_layers else 0
        if stacked_routes is None:
            stacked_routes = jnp.zeros((ids.shape[0], m, k), jnp.int32)
        assert stacked_routes.shape == (ids.shape[0], m, k), "a block routed other than cfg.moe_layers says"
        return self.norm(x), kv, stacked_routes

    def logits(self, h: jax.Array) -> jax.Array:
        """f32 logits [S, V] of hidden states h [S, H] (tied checkpoints reuse the embedding)."""
        head: Linear | Embedding = self.embed_tokens if self.lm_head is None else self.lm_head
        transpose = self.lm_head is None or self.lm_head.transposed  # the embedding, an int8 head: [V, H]
        w, scale = head.weight[...], None if head.scale is None else head.scale[...]
        if self.vocab_major_logits and not self.dot.few_rows(h, w):
            # [V, S] then transposed: XLA:CPU runs the [V, H] x [H, S] form 1.5-3.5x faster for a
            # few rows (SmolLM2's 49,152 x 576 head, 32 rows: 28.5 ms against 41.7 as h @ embed.T
            # and 102 as h @ lm_head; the same from 64 rows up)
            w = w if transpose else w.T
            return jax.lax.dot_general(w, h, (((1,), (1,)), ((), ()))).T.astype(jnp.float32)
        # f32 out of the product: the logits are never rounded to bf16 by a custom call
        return self.dot(h, w, transpose_w=transpose, scale=scale, out_dtype=jnp.float32)


def _stack_read_in_place(path: tuple, _value: Any) -> bool:
    """A projection's weight or int8 scale (a Linear's: q/k/v/o, gate/up/down `_proj`; not the
    experts' of a MoE layer, whose grouped matmul multiplies the scan's slice)."""
    return len(path) >= 2 and str(path[-2]).endswith("_proj") and path[-1] in ("weight", "scale") and "experts" not in path


class CausalLM:
    """The functional face of a family's Decoder: its graphdef, and the calls the step programs
    make (model/runtime/step.py), each taking the Decoder's state `params` (model/weights/state.py:
    a pure dict of arrays, the shape of `nnx.split`'s state) and rebuilding the module inside the
    trace.

    The Decoder is built abstractly (`nnx.eval_shape`: no weights allocated) by `build` (the
    family's, model/families/); `abstract` holds its state as ShapeDtypeStructs, `specs` each
    Param's PartitionSpec, both keyed like `params`. The state travels as plain arrays, not as
    `nnx.State` of Variables: a compiled program flattens its arguments on every call, and
    Variables flatten in Python with their metadata (SmolLM2's 272 leaves: 332 us a call,
    against 123 us as a dict; measured).
    """

    def __init__(self, cfg: ModelConfig, attn: Any, build: Callable[[], Decoder]):
        self.cfg = cfg
        self.attn = attn
        self.graphdef, state = nnx.split(nnx.eval_shape(build))
        self.abstract: dict = nnx.to_pure_dict(state)
        self.specs: dict = nnx.to_pure_dict(nnx.get_partition_spec(state))

    def bind(self, params: dict) -> Decoder:
        """The Decoder over `params` (inside a trace: over its tracers)."""
        return nnx.merge(self.graphdef, params)

    def forward(self, params: dict, ids: jax.Array, fb: Any, kv: Any, lora: LoraBatch | None = None,
                routed: bool = False) -> tuple[Any, ...]:  # fmt: skip
        """Final hidden states [T, H] of the step's tokens, and the updated KV cache; `routed`:
        also the MoE layers' expert ids, int32 [T, M, k] (the module docstring)."""
        return self.bind(params)(ids, fb, kv, lora, routed)

    @property
    def routed_shape(self) -> tuple[int, int]:
        """(M, k) of `forward(routed=True)`'s ids [T, M, k]: MoE layers, experts per token
        ((0, 0) for a dense family)."""
        m = len(self.cfg.moe_layers)
        return m, self.cfg.num_experts_per_tok if m else 0

    def logits(self, params: dict, h: jax.Array) -> jax.Array:
        """f32 logits [S, V] of hidden states h [S, H]."""
        return self.bind(params).logits(h)

    def place(self, host: dict, mesh: Mesh) -> dict:
        """Host arrays of the state (model/weights/state.py: build_host_state) on the devices, each
        on its Param's `tp` sharding."""
        want = jax.tree.map(lambda a: (a.shape, a.dtype), self.abstract)
        got = jax.tree.map(lambda a: (a.shape, a.dtype), host)
        assert got == want, "the host state does not match the Decoder's (the family's layout, model/families/)"
        return jax.tree.map(place_host_array, host, self._shardings(mesh))

    def state_avals(self, mesh: Mesh) -> dict:
        """What `place` returns, abstract (shape, dtype, sharding): what the programs compile
        against, known before any weight is read."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract,
                            self._shardings(mesh))  # fmt: skip

    def _shardings(self, mesh: Mesh) -> dict:
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
