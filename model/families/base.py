"""What a model family is: `Family`, the one object its file (model/families/<name>.py) exports
and the registry (model/families/__init__.py) lists. Everything that differs between families
is asked of it, and nothing outside the family's file branches on a family:

    config.json      `options`: its own ModelConfig fields (the shared ones: model/config.py)
    module tree      `decoder`: built from model/layers/ (imported inside: a family's file
                     imports no JAX, so the frontend can read configs through the registry)
    HF layout        `layer_tensors`: each decoder layer's HF tensors (names, transposes, shapes);
                     `layout` adds the embedding, final norm and LM head (model/weights/state.py
                     builds the state from it; a weight update by HF name checks against it)
    GGUF             `gguf`: llama.cpp's architecture name, tensor names, q/k row permutation
    tiny model       `tiny`: transformers' config class and the fields of `make-tiny-model`'s
                     random checkpoint (model/checkpoints/tiny.py makes its weights from the layout)
    adapters         `lora_modules`: the projections a PEFT adapter may train
    int8             `quantized`: the modules weight-only int8 holds as int8
    capabilities     what `ringserve models` prints
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ringserve.model.config import ModelConfig


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one HF tensor lives in the state."""

    path: tuple[str, ...]  # module attributes from the Decoder, e.g. ("layers", "self_attn", "q_proj", "weight")
    layer: int | None  # decoder layer (None: not a layer's); see `state_path`
    transpose: bool  # HF [out, in] -> ours [in, out]
    hf_shape: tuple[int, ...]  # the shape the checkpoint must have (from config.json)

    def state_path(self, stacked: bool) -> tuple[Any, ...]:
        """Keys from the root of the state: per-layer layout ("layers", l, ...); the stacked one
        keeps `path`, and the tensor is index `layer` of its leading axis."""
        if self.layer is None or stacked:
            return self.path
        return (self.path[0], self.layer, *self.path[1:])


LayerTensors = dict[str, tuple[bool, tuple[int, ...]]]  # HF name after "model.layers.N." -> (transpose, HF shape)


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFNames:
    """How llama.cpp writes a family: `general.architecture`, the layer tensors' names (after
    "blk.N.") as HF names (after "model.layers.N."), whether q/k rows are permuted for
    adjacent-pair RoPE (model/checkpoints/gguf.py undoes it), and config.json fields its
    converter sets: fixed (`config`), or read from the file's metadata (`read_config`: given
    `get(key)` and the config read so far, the family's own fields). `norms_plus_one`: its
    converter stores every norm's weight plus 1 (Gemma's (1 + w) norms), which loading undoes."""

    arch: str
    layer: dict[str, str]
    permuted_qk: bool = False
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    read_config: Callable[[Callable[[str], Any], dict[str, Any]], dict[str, Any]] | None = None
    norms_plus_one: bool = False


# llama.cpp's names of the tensors outside the layers (every family so far)
GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Tiny:
    """`make-tiny-model`'s random checkpoint of a family: transformers' config class (config.json
    is written through it, so HF loads the directory) and the fields it sets beyond the shared
    dimensions. `gemma_scales`: the family scales its norms by (1 + w) and its embedding by
    sqrt(hidden) (Gemma), so its draws undo both: the same scales as the others'
    (model/checkpoints/tiny.py)."""

    config_class: str
    fields: dict[str, Any]
    gemma_scales: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    name: str
    summary: str
    architectures: tuple[str, ...]  # HF `architectures` it serves
    model_types: tuple[str, ...]  # HF `model_type` (where `architectures` is absent)
    options: Callable[[dict[str, Any], str], dict[str, Any]]  # config.json -> its own ModelConfig fields
    decoder: Callable[[ModelConfig, Any, Any], Any]  # (cfg, compute plan, attention backend) -> nnx Decoder
    layer_tensors: Callable[[ModelConfig], LayerTensors]  # in init order (make-tiny-model draws them so)
    tiny: Tiny
    gguf: GGUFNames | None = None
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    quantized: frozenset[str] = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj", "lm_head", "embed_tokens"})  # fmt: skip
    tp: bool = True  # tensor parallelism over the mesh
    attention: tuple[str, ...] = ("cpu", "gpu", "tpu")  # platforms whose attention backends serve it

    def config(self, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """This family's ModelConfig of a config.json dict; ValueError naming the field."""
        from ringserve.model.config import shared_fields

        return ModelConfig(family=self.name, **shared_fields(d, source), **self.options(d, source))

    def causal_lm(self, cfg: ModelConfig, plan: Any, backend: Any) -> Any:
        """The functional face of this family's Decoder for `cfg`, built as the compute plan says
        over the attention backend (model/layers/decoder.py `CausalLM`: abstract, no weights)."""
        from ringserve.model.layers.decoder import CausalLM

        return CausalLM(cfg, backend, lambda: self.decoder(cfg, plan, backend))

    def layout(self, cfg: ModelConfig) -> dict[str, Placement]:
        """HF tensor name -> Placement, for every tensor the model needs: THE map from HF names
        to places in the state (loading, weight updates by HF name, tiny checkpoints)."""
        h, v = cfg.hidden_size, cfg.vocab_size
        out = {"model.embed_tokens.weight": Placement(("embed_tokens", "weight"), None, False, (v, h))}
        for layer in range(cfg.num_layers):
            for suffix, (transpose, shape) in self.layer_tensors(cfg).items():
                out[f"model.layers.{layer}.{suffix}"] = Placement(("layers", *suffix.split(".")), layer, transpose, shape)
        out["model.norm.weight"] = Placement(("norm", "weight"), None, False, (h,))
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = Placement(("lm_head", "weight"), None, True, (v, h))
        return out

    def module_dims(self, cfg: ModelConfig, module: str) -> tuple[str, int, int]:
        """(block, in, out) of a projection adapters may train (`lora_modules`), from the layout:
        e.g. ("self_attn", hidden, q_size) for q_proj."""
        for suffix, (_, shape) in self.layer_tensors(cfg).items():
            block, _, rest = suffix.partition(".")
            if rest == f"{module}.weight":
                return block, shape[1], shape[0]
        raise ValueError(f"the {self.name} family has no projection {module!r}")

    @property
    def capabilities(self) -> dict[str, Any]:
        """What `ringserve models` prints of it."""
        return {"tp": self.tp, "lora": bool(self.lora_modules), "int8": bool(self.quantized),
                "gguf": self.gguf.arch if self.gguf else None, "attention": list(self.attention)}  # fmt: skip


def llama_layer_tensors(cfg: ModelConfig, *, bias: bool = False, qk_norm: bool = False) -> LayerTensors:
    """A PreNormBlock's tensors (model/layers/block.py) in HF's names, in make-tiny-model's draw
    order: the layer of the Llama lineage, with the options its families choose."""
    h, d, i, q, kv = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    out: LayerTensors = {
        "input_layernorm.weight": (False, (h,)),
        "self_attn.q_proj.weight": (True, (q, h)),
        "self_attn.k_proj.weight": (True, (kv, h)),
        "self_attn.v_proj.weight": (True, (kv, h)),
        "self_attn.o_proj.weight": (True, (h, q)),
    }
    if bias:
        out |= {"self_attn.q_proj.bias": (False, (q,)), "self_attn.k_proj.bias": (False, (kv,)),
                "self_attn.v_proj.bias": (False, (kv,))}  # fmt: skip
    if qk_norm:
        out |= {"self_attn.q_norm.weight": (False, (d,)), "self_attn.k_norm.weight": (False, (d,))}
    out |= {
        "post_attention_layernorm.weight": (False, (h,)),
        "mlp.gate_proj.weight": (True, (i, h)),
        "mlp.up_proj.weight": (True, (i, h)),
        "mlp.down_proj.weight": (True, (h, i)),
    }
    return out


def llama_decoder(cfg: ModelConfig, plan: Any, backend: Any, *, bias: bool = False, qk_norm: bool = False) -> Any:
    """The Decoder of PreNormBlocks (model/layers/block.py) with the attention options given."""
    from ringserve.model.layers.block import PreNormBlock
    from ringserve.model.layers.decoder import Decoder

    return Decoder(cfg, plan, lambda: PreNormBlock(cfg, plan, backend, bias=bias, qk_norm=qk_norm))


# llama.cpp's names of a PreNormBlock's tensors (after "blk.N." / "model.layers.N.")
GGUF_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
