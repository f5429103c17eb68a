"""The decoder-only families: Llama (incl. llama3 RoPE, tied embeddings), Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm), Mistral (optional sliding window). One `flax.nnx` module tree, switched
by config, and `CausalLM`, its functional face for the step programs.

    Decoder                         embed_tokens, layers, norm, lm_head (untied checkpoints)
      layers: DecoderLayer          input_layernorm, self_attn, post_attention_layernorm, mlp
        self_attn: Attention        q/k/v/o_proj (Linear), q_norm/k_norm (qk_norm only)
        mlp: GatedMLP               gate/up/down_proj

`Decoder.__call__` runs one step over the densely packed new tokens of every row
(model/compute/step_inputs.py): matmuls see the flat [T, hidden] tokens, attention goes through the
backend's interface (model/compute/attention/base.py: `write`, `attend`; a plain object the Attention
module holds). Two layouts of the layers (model/compute/plan.py: resolve_layer_loop):

    "scan"      one DecoderLayer whose Params carry a leading L axis; one `lax.scan` over its
                state carries the hidden states and the whole KV cache, so XLA compiles one
                layer body and updates the cache in place (accelerators; CPU with its
                custom-call dots, ringserve's kernel or oneDNN's, which are handed each
                projection's whole stack and the layer index and read the layer in place: a
                scanned slice would be a copy every step)
    "unrolled"  an nnx.List of L DecoderLayers, each layer's weights in buffers of their own,
                traced one after another (CPU with XLA's dot alone)

Every compiled program takes the Decoder's state (model/weights/state.py) as its first argument and
rebuilds the module inside the trace (`CausalLM.forward` / `logits`: `nnx.merge`), so jit sees
pytrees of arrays and new weights of the same shapes and shardings never recompile.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ringserve.model.compute.attention.base import AttentionBackend
from ringserve.model.compute.dots import (
    STACK_READING_DOTS,
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    apply_rope,
    few_rows,
    matmul,
    project,
    rope_inv_freq,
    rope_tables,
)
from ringserve.model.compute.mesh import place_host_array, tp_split
from ringserve.model.config import ModelConfig
from ringserve.model.weights.lora import LayerLora, LoraBatch, apply_lora, token_slots


class Attention(nnx.Module):
    """q/k/v projections (column-parallel by heads), q/k RMSNorm (Qwen3), RoPE, the backend's
    KV write and attention, and the row-parallel output projection."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype, tp: int, dot: str,
                 quant: str | None = None):  # fmt: skip
        h, q, kv, det = cfg.hidden_size, cfg.q_size, cfg.kv_size, dot == "invariant"
        col_q, col_kv = tp_split(2, 1, cfg.num_heads, tp), tp_split(2, 1, cfg.num_kv_heads, tp)
        self.q_proj = Linear(h, q, dtype, col_q, cfg.qkv_bias, dot, quant)
        self.k_proj = Linear(h, kv, dtype, col_kv, cfg.qkv_bias, dot, quant)
        self.v_proj = Linear(h, kv, dtype, col_kv, cfg.qkv_bias, dot, quant)
        self.o_proj = Linear(q, h, dtype, tp_split(2, 0, q, tp), dot=dot, quant=quant)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, det) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, det) if cfg.qk_norm else None
        self.cfg = cfg
        self.backend = backend

    def __call__(self, x, cos, sin, kv, layer, fb, lora: LayerLora | None = None) -> tuple[jax.Array, Any]:
        """x [T, H] (normed) -> attention output [T, H], and the KV cache with layer `layer`'s
        new keys and values written; `lora`: the layer's adapters (model/weights/lora.py), if served."""
        cfg, t = self.cfg, x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj, layer=layer)  # one custom call where it can
        q = apply_lora(lora, "q_proj", x, q).reshape(t, cfg.num_heads, cfg.head_dim)
        k = apply_lora(lora, "k_proj", x, k).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = apply_lora(lora, "v_proj", x, v).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv = self.backend.write(kv, layer, k, v, fb)
        o = self.backend.attend(q, kv, layer, fb).reshape(t, cfg.q_size)
        return apply_lora(lora, "o_proj", o, self.o_proj(o, layer)), kv


class DecoderLayer(nnx.Module):
    """Pre-norm attention and gated MLP, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype, tp: int, dot: str,
                 quant: str | None = None):  # fmt: skip
        h, i, eps, det = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, dot == "invariant"
        self.input_layernorm = RMSNorm(h, eps, dtype, det, dot)
        self.self_attn = Attention(cfg, backend, dtype, tp, dot, quant)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, det, dot)
        self.mlp = GatedMLP(h, i, dtype, tp_split(2, 1, i, tp), tp_split(2, 0, i, tp), dot, quant)

    def __call__(self, x, cos, sin, kv, layer, fb, lora: LayerLora | None = None) -> tuple[jax.Array, Any]:
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, fb, lora)
        x, h = self.post_attention_layernorm.add(x, a)
        return x + self.mlp(h, lora, layer), kv


class Decoder(nnx.Module):
    """The whole model: token embedding, the decoder layers (either layout), final norm, LM head
    (vocab-parallel; tied checkpoints reuse the embedding instead)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype=jnp.float32, tp: int = 1,
                 layer_loop: str = "scan", layer_unroll: int = 1, deterministic: bool = False,
                 logits_vocab_major: bool = False, lora_gather: bool = False, dot: str = "xla",
                 quant: str | None = None, rope_table_positions: int | None = None):  # fmt: skip
        # how the projections and the LM head multiply (model/compute/dots.py matmul): batch-invariant
        # in the deterministic mode, else XLA's dot or oneDNN's (ExecutorConfig.cpu_matmul)
        self.dot = "invariant" if deterministic else dot

        def layer() -> DecoderLayer:
            return DecoderLayer(cfg, backend, dtype, tp, self.dot, quant)

        # quant="int8": every projection, the LM head and the embedding are weight-only int8
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, quant)
        self.layers: nnx.List[DecoderLayer] | DecoderLayer
        if layer_loop == "unrolled":
            self.layers = nnx.List([layer() for _ in range(cfg.num_layers)])
        else:  # one layer's modules, every Param [L, ...]; the sharding gains a None for L
            stack = nnx.vmap(layer, in_axes=None, out_axes=0, axis_size=cfg.num_layers,
                             transform_metadata={nnx.PARTITION_NAME: None})  # fmt: skip
            self.layers = stack()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, deterministic)
        v, h = cfg.vocab_size, cfg.hidden_size
        self.lm_head = None if cfg.tie_word_embeddings else Linear(h, v, dtype, tp_split(2, 1, v, tp), quant=quant)
        self.cfg = cfg
        self.layer_unroll = layer_unroll
        self.deterministic = deterministic
        self.logits_vocab_major = logits_vocab_major and self.dot in ("xla", "kernel") and quant is None
        self.lora_gather = lora_gather  # the adapters' product in its gather form (model/weights/lora.py)
        self.rope_table_positions = rope_table_positions  # RoPE from host-made tables (layers.rope_tables)

    def __call__(self, ids: jax.Array, fb: Any, kv: Any, lora: LoraBatch | None = None) -> tuple[jax.Array, Any]:
        """Final hidden states [T, H] of the step's tokens, and the updated KV cache. `lora`:
        each row's adapter slot and the adapter pool (model/weights/lora.py), when adapters are served."""
        inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim)
        cos, sin = rope_tables(fb.positions, inv_freq, self.rope_table_positions)
        x = self.embed_tokens(ids)
        tok_slot = token_slots(lora.row_slot, fb.row_start, fb.num_rows, ids.shape[0]) if lora is not None else None

        def layer_lora(pool_layer: Any) -> LayerLora | None:
            if lora is None or tok_slot is None:
                return None
            return LayerLora(pool_layer, tok_slot, lora.weights["scale"], self.lora_gather)

        if isinstance(self.layers, nnx.List):
            for i, layer in enumerate(self.layers):  # i: a Python int, static in each layer's graph
                x, kv = layer(x, cos, sin, kv, i, fb, layer_lora(lora.weights["layers"][i] if lora is not None else None))
        else:
            # With CPU's custom-call dots (ringserve's kernel, oneDNN) the projections' weights
            # stay whole: the call reads layer i's in place from the stack (layers.matmul),
            # where a scanned slice of them would be a copy every step; the rest (norms,
            # biases) is sliced by the scan
            in_place = _stack_read_in_place if self.dot in STACK_READING_DOTS else nnx.Nothing
            graphdef, whole, stacked = nnx.split(self.layers, in_place, ...)  # type: ignore[misc]
            pool = lora.weights["layers"] if lora is not None else None

            def body(carry, xs):
                x, kv, i = carry
                state, pool_layer = xs
                x, kv = nnx.merge(graphdef, whole, state)(x, cos, sin, kv, i, fb, layer_lora(pool_layer))
                return (x, kv, i + 1), None

            (x, kv, _), _ = jax.lax.scan(body, (x, kv, jnp.int32(0)), (stacked, pool), unroll=self.layer_unroll)
        return self.norm(x), kv

    def logits(self, h: jax.Array) -> jax.Array:
        """f32 logits [S, V] of hidden states h [S, H] (tied checkpoints reuse the embedding)."""
        head: Linear | Embedding = self.embed_tokens if self.lm_head is None else self.lm_head
        transpose = self.lm_head is None or self.lm_head.transposed  # the embedding, an int8 head: [V, H]
        w, scale = head.weight[...], None if head.scale is None else head.scale[...]
        if self.logits_vocab_major and not few_rows(self.dot, h, w):
            # [V, S] then transposed: XLA:CPU runs the [V, H] x [H, S] form 1.5-3.5x faster for a
            # few rows (SmolLM2's 49,152 x 576 head, 32 rows: 28.5 ms against 41.7 as h @ embed.T
            # and 102 as h @ lm_head; the same from 64 rows up)
            w = w if transpose else w.T
            return jax.lax.dot_general(w, h, (((1,), (1,)), ((), ()))).T.astype(jnp.float32)
        # f32 out of the product: the logits are never rounded to bf16 by a custom call
        return matmul(h, w, self.dot, transpose_w=transpose, scale=scale, out_dtype=jnp.float32)


def _stack_read_in_place(path: tuple, _value: Any) -> bool:
    """A projection's weight or int8 scale (a Linear's: q/k/v/o, gate/up/down `_proj`)."""
    return len(path) >= 2 and str(path[-2]).endswith("_proj") and path[-1] in ("weight", "scale")


class CausalLM:
    """The functional face of a `Decoder`: its graphdef, and the calls the step programs make
    (model/runtime/step.py), each taking the Decoder's state `params` (model/weights/state.py: a pure dict of
    arrays, the shape of `nnx.split`'s state) and rebuilding the module inside the trace.

    The Decoder is built abstractly (`nnx.eval_shape`: no weights allocated); `abstract` holds
    its state as ShapeDtypeStructs, `specs` each Param's PartitionSpec, both keyed like `params`.
    The state travels as plain arrays, not as `nnx.State` of Variables: a compiled program
    flattens its arguments on every call, and Variables flatten in Python with their metadata
    (SmolLM2's 272 leaves: 332 us a call, against 123 us as a dict; measured).
    """

    def __init__(self, cfg: ModelConfig, attn: AttentionBackend, dtype=jnp.float32, tp: int = 1,
                 layer_loop: str = "scan", layer_unroll: int = 1, deterministic: bool = False,
                 logits_vocab_major: bool = False, lora_gather: bool = False, dot: str = "xla",
                 quant: str | None = None, rope_table_positions: int | None = None):  # fmt: skip
        self.cfg = cfg
        self.attn = attn
        decoder = nnx.eval_shape(lambda: Decoder(cfg, attn, dtype, tp, layer_loop, layer_unroll, deterministic,
                                                 logits_vocab_major, lora_gather, dot, quant,
                                                 rope_table_positions))  # fmt: skip
        self.graphdef, state = nnx.split(decoder)
        self.abstract: dict = nnx.to_pure_dict(state)
        self.specs: dict = nnx.to_pure_dict(nnx.get_partition_spec(state))

    def bind(self, params: dict) -> Decoder:
        """The Decoder over `params` (inside a trace: over its tracers)."""
        return nnx.merge(self.graphdef, params)

    def forward(self, params: dict, ids: jax.Array, fb: Any, kv: Any, lora: LoraBatch | None = None) -> tuple[jax.Array, Any]:
        """Final hidden states [T, H] of the step's tokens, and the updated KV cache."""
        return self.bind(params)(ids, fb, kv, lora)

    def logits(self, params: dict, h: jax.Array) -> jax.Array:
        """f32 logits [S, V] of hidden states h [S, H]."""
        return self.bind(params).logits(h)

    def place(self, host: dict, mesh: Mesh) -> dict:
        """Host arrays of the state (model/weights/state.py: build_host_state) on the devices, each on
        its Param's `tp` sharding."""
        want = jax.tree.map(lambda a: (a.shape, a.dtype), self.abstract)
        got = jax.tree.map(lambda a: (a.shape, a.dtype), host)
        assert got == want, "the host state does not match the Decoder's (model/weights/state.py: hf_layout)"
        return jax.tree.map(place_host_array, host, self._shardings(mesh))

    def state_avals(self, mesh: Mesh) -> dict:
        """What `place` returns, abstract (shape, dtype, sharding): what the programs compile
        against, known before any weight is read."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract,
                            self._shardings(mesh))  # fmt: skip

    def _shardings(self, mesh: Mesh) -> dict:
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
