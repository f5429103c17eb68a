"""What a model family is: `Family`, the one object its file (model/families/<name>.py) exports
and the registry (model/families/__init__.py) lists. Everything that differs between families
is asked of it, and nothing outside the family's file branches on a family:

    config.json      `options`: its own ModelConfig fields (the shared ones: model/config.py)
    module tree      `decoder`: built from model/layers/ (imported inside: a family's file
                     imports no JAX, so the frontend can read configs through the registry)
    HF layout        `layer_tensors`: each decoder layer's HF tensors (names, transposes, shapes);
                     `layout` adds the embedding, final norm and LM head (model/weights/state.py
                     builds the state from it; a weight update by HF name checks against it)
    GGUF             `gguf`: llama.cpp's architecture name, tensor names, q/k row permutation,
                     a mixture of experts' stacked experts and metadata (`GGUFMoe`)
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
    expert: int | None = None  # one expert's tensor: index `expert` of the leaf's expert axis [.., E, ...]
    experts: int = 0  # E, the length of that axis (the leaf's expert axis follows the layer's)

    def state_path(self, stacked: bool) -> tuple[Any, ...]:
        """Keys from the root of the state: per-layer layout ("layers", l, ...); the stacked one
        keeps `path`, and the tensor is index `layer` of its leading axis."""
        if self.layer is None or stacked:
            return self.path
        return (self.path[0], self.layer, *self.path[1:])


LayerTensors = dict[str, tuple[bool, tuple[int, ...]]]  # HF name after "model.layers.N." -> (transpose, HF shape)


@dataclasses.dataclass(frozen=True, slots=True)
class MoeTensor:
    """A mixture-of-experts layer's HF tensor (after "model.layers.N."; "{e}" in a per-expert
    name is the expert's index) and its place in the layer's modules (model/layers/moe.py): the
    E per-expert tensors of a name are one leaf [E, ...] (stacked: [L, E, ...])."""

    path: tuple[str, ...]  # e.g. ("mlp", "experts", "gate_proj", "weight")
    transpose: bool
    hf_shape: tuple[int, ...]  # one expert's, for a per-expert name


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFMoe:
    """How llama.cpp writes a family's mixture of experts (model/checkpoints/gguf.py reads it).

    Tensors: each layer's experts stacked, `blk.N.ffn_{gate,up,down}_exps.weight` [E, out, in]
    (ggml ne [in, out, E]); HF's per-expert names carry "{e}" in the layer table (`gguf_moe_layer`),
    and the reader splits the stack along E. Metadata: `{arch}.expert_count` (config.json's
    `experts_field`), `{arch}.expert_used_count`, each expert's size `{arch}.expert_feed_forward_length`
    (`expert_size`; Mixtral's files use `feed_forward_length` itself) and, with `shared`, the shared
    expert's `{arch}.expert_shared_feed_forward_length`. Whether the top-k weights are renormalized is
    not in the file: llama.cpp fixes it per architecture (its build_moe_ffn's norm_w: qwen3moe
    always, qwen2moe never), written as `norm_topk_prob` (None: the family fixes it itself)."""

    norm_topk_prob: bool | None
    experts_field: str = "num_experts"
    expert_size: bool = True
    shared: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFNames:
    """How llama.cpp writes a family: `general.architecture`, the layer tensors' names (after
    "blk.N.") as HF names (after "model.layers.N."), whether q/k rows are permuted for
    adjacent-pair RoPE (model/checkpoints/gguf.py undoes it), and config.json fields its
    converter sets: fixed (`config`), or read from the file's metadata (`read_config`: given
    `get(key)` and the config read so far, the family's own fields). `norms_plus_one`: its
    converter stores every norm's weight plus 1 (Gemma's (1 + w) norms), which loading undoes.
    `moe`: a mixture of experts' layout (also what tells Mixtral's `llama` files, which have
    `llama.expert_count`, from Llama's: model/families/__init__.py `gguf_family`)."""

    arch: str
    layer: dict[str, str]
    permuted_qk: bool = False
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    read_config: Callable[[Callable[[str], Any], dict[str, Any]], dict[str, Any]] | None = None
    norms_plus_one: bool = False
    moe: GGUFMoe | None = None


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
    moe_tensors: Callable[[ModelConfig], dict[str, MoeTensor]] | None = None  # a MoE family's own tensors
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
            for name, t in (self.moe_tensors(cfg) if self.moe_tensors else {}).items():
                experts = range(cfg.num_experts) if "{e}" in name else [None]
                for e in experts:
                    out[f"model.layers.{layer}.{name.format(e=e)}"] = Placement(
                        ("layers", *t.path), layer, t.transpose, t.hf_shape, e, cfg.num_experts if e is not None else 0)
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
        if self.moe_tensors is not None:
            raise ValueError(f"lora_target_modules: {module!r} of a {self.name} model is its experts', which take no "
                             f"adapters; LoRA serves {list(self.lora_modules)} (lora_target_modules)")  # fmt: skip
        raise ValueError(f"the {self.name} family has no projection {module!r}")

    @property
    def capabilities(self) -> dict[str, Any]:
        """What `ringserve models` prints of it."""
        return {"tp": self.tp, "lora": bool(self.lora_modules), "int8": bool(self.quantized),
                "gguf": self.gguf.arch if self.gguf else None, "attention": list(self.attention),
                "moe": self.moe_tensors is not None}  # fmt: skip


def qwen_window(d: dict[str, Any]) -> int | None:
    """The Qwen lineage's sliding window: config.json's `sliding_window` where `use_sliding_window`
    turns it on (Qwen2, Qwen3 and their MoE models), else None."""
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    return int(window) if window else None


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
GGUF_QK_NORM = {  # Qwen3's q/k norms
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


# ---- mixture of experts (model/layers/moe.py): what Qwen3-MoE, Qwen2-MoE and Mixtral share ----
def moe_options(d: dict[str, Any], source: str, *, experts: str = "num_experts", size: str = "moe_intermediate_size",
                norm_topk: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """The ModelConfig fields of a MoE config.json (`experts`, `size`: its field names of the
    expert count and each expert's intermediate size; `norm_topk`: fixed by the family, else
    `norm_topk_prob`). Every layer's MLP must be sparse: `mlp_only_layers` and a
    `decoder_sparse_step` leaving dense layers among them are refused (ValueError)."""
    # transformers 5 writes either name (its configs map num_experts to num_local_experts)
    e = int(d.get(experts) or d.get("num_local_experts") or d.get("num_experts") or 0)
    k = int(d.get("num_experts_per_tok") or 0)
    if e < 1 or not 1 <= k <= e:
        raise ValueError(f"{source}: {experts}={e}, num_experts_per_tok={k}: need 1 <= num_experts_per_tok <= {experts}")
    layers = int(d.get("num_hidden_layers") or 0)
    step = int(d.get("decoder_sparse_step") or 1)
    dense = sorted(set(d.get("mlp_only_layers") or []) | {i for i in range(layers) if (i + 1) % step})
    if dense:
        raise ValueError(f"{source}: layers {dense[:8]} have dense MLPs (mlp_only_layers / decoder_sparse_step="
                         f"{step}); ringserve serves MoE models whose every layer is sparse")  # fmt: skip
    if size not in d:
        raise ValueError(f"{source}: missing required field {size!r}")
    return {"num_experts": e, "num_experts_per_tok": k, "moe_intermediate_size": int(d[size]),
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)) if norm_topk is None else norm_topk,
            "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size") or 0)}  # fmt: skip


def moe_layer_tensors(cfg: ModelConfig, *, bias: bool = False, qk_norm: bool = False) -> LayerTensors:
    """A MoE layer's dense tensors: a PreNormBlock's less its MLP (the MLP's: `moe_tensors`)."""
    return {k: v for k, v in llama_layer_tensors(cfg, bias=bias, qk_norm=qk_norm).items() if not k.startswith("mlp.")}


def moe_tensors(cfg: ModelConfig, *, prefix: str = "mlp", names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                shared: bool = False) -> dict[str, MoeTensor]:  # fmt: skip
    """The router and expert tensors of a MoE layer (model/layers/moe.py `SparseMoe`) under HF's
    `prefix` ("mlp"; Mixtral's "block_sparse_moe") with HF's names of the experts' gate, up and
    down projections (Mixtral's w1, w3, w2); `shared`: Qwen2-MoE's shared expert and its gate."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    out = {f"{prefix}.gate.weight": MoeTensor(("mlp", "gate", "weight"), True, (e, h))}
    for hf, ours, shape in zip(names, ("gate_proj", "up_proj", "down_proj"), ((i, h), (i, h), (h, i)), strict=True):
        out[f"{prefix}.experts.{{e}}.{hf}.weight"] = MoeTensor(("mlp", "experts", ours, "weight"), True, shape)
    if shared:
        s = cfg.shared_expert_intermediate_size
        for name, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
            out[f"mlp.shared_expert.{name}.weight"] = MoeTensor(("mlp", "shared_expert", name, "weight"), True, shape)
        out["mlp.shared_expert_gate.weight"] = MoeTensor(("mlp", "shared_expert_gate", "weight"), True, (1, h))
    return out


def moe_decoder(cfg: ModelConfig, plan: Any, backend: Any, *, bias: bool = False, qk_norm: bool = False,
                shared: bool = False) -> Any:  # fmt: skip
    """The Decoder of MoeBlocks (model/layers/moe.py) with the attention options given."""
    from ringserve.model.layers.decoder import Decoder
    from ringserve.model.layers.moe import MoeBlock

    return Decoder(cfg, plan, lambda: MoeBlock(cfg, plan, backend, bias=bias, qk_norm=qk_norm, shared=shared))


# adapters train attention alone on MoE families (experts' adapters are refused: model/checkpoints/peft.py)
MOE_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def gguf_moe_layer(*, prefix: str = "mlp", names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                   shared: bool = False, per_expert: bool = False) -> dict[str, str]:  # fmt: skip
    """llama.cpp's names of a MoE layer's tensors (after "blk.N.") as HF's (`moe_tensors`' names and
    arguments): Llama's attention and norms, the router `ffn_gate_inp`, the stacked experts
    `ffn_{gate,up,down}_exps` ("{e}" in the HF name: one tensor per expert), with `shared` Qwen2-MoE's
    shared expert (`ffn_*_shexp`) and its gate (`ffn_gate_inp_shexp`), with `per_expert` the one
    tensor per expert of llama.cpp's older Mixtral files (`ffn_gate.E.weight`, "{e}" both sides)."""
    out = {k: v for k, v in GGUF_LLAMA_LAYER.items() if not v.startswith("mlp.")}
    out["ffn_gate_inp.weight"] = f"{prefix}.gate.weight"
    for ggml, hf in zip(("gate", "up", "down"), names, strict=True):
        out[f"ffn_{ggml}_exps.weight"] = f"{prefix}.experts.{{e}}.{hf}.weight"
        if per_expert:
            out[f"ffn_{ggml}.{{e}}.weight"] = f"{prefix}.experts.{{e}}.{hf}.weight"
    if shared:
        out |= {f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
        out["ffn_gate_inp_shexp.weight"] = "mlp.shared_expert_gate.weight"
    return out
