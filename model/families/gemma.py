"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`, model_type
gemma3_text): the sandwich layer (model/layers/sandwich.py: pre- and post-norms around attention
and a GeGLU MLP, every norm by 1 + weight), the embedding scaled by sqrt(hidden), tied LM head.

    Gemma 2   local (sliding-window) and global layers alternating, the first local; attention
              scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped
              (attn_logit_softcapping), the final logits too (final_logit_softcapping)
    Gemma 3   q/k RMSNorm per head; 5 local : 1 global (`layer_types`); local layers rotate by
              their own RoPE (transformers 5: rope_parameters["sliding_attention"]; 4:
              rope_local_base_freq), global ones by theirs with its scaling (linear, 4B and up);
              no attention soft cap (HF's Gemma3Attention never passes one: config.json's
              attn_logit_softcapping is ignored as HF ignores it)

Gemma3ForConditionalGeneration (the multimodal checkpoints) is not served: its language model's
tensors sit under other names, beside a vision tower.
"""

from __future__ import annotations

from typing import Any

from ringserve.model.config import ModelConfig, RopeConfig, rope_from_dict
from ringserve.model.families.base import Family, GGUFNames, LayerTensors, Tiny

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # what HF's Gemma layers compute (the tanh GELU)


def _layer_slides(d: dict[str, Any], source: str, pattern: int) -> tuple[bool, ...]:
    """Per layer whether it is local (sliding): config.json's `layer_types`, else HF's default
    pattern: every `pattern`-th layer global (Gemma 2: 2, the even layers local; Gemma 3:
    `sliding_window_pattern`, 6)."""
    n = int(d.get("num_hidden_layers") or 0)
    types = d.get("layer_types")
    if types is None:
        return tuple(bool((i + 1) % pattern) for i in range(n))
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"{source}: layer_types must give each of the {n} layers 'sliding_attention' or "
                         f"'full_attention', got {types!r}")  # fmt: skip
    return tuple(t == "sliding_attention" for t in types)


def _options(d: dict[str, Any], source: str, *, gemma3: bool) -> dict[str, Any]:
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"{source}: hidden_activation {act!r} is not served; Gemma's is 'gelu_pytorch_tanh'")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true (an encoder) is not served")
    window = d.get("sliding_window")
    if window is not None and int(window) < 1:
        raise ValueError(f"{source}: sliding_window must be at least 1, got {window!r}")
    slides = _layer_slides(d, source, int(d.get("sliding_window_pattern") or 6) if gemma3 else 2)
    # HF's class defaults where config.json leaves a field out
    out: dict[str, Any] = {
        "attention_bias": bool(d.get("attention_bias", False)),
        "sliding_window": int(window) if window and any(slides) else None,
        "sliding_layers": slides,
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or 256),
        "final_logit_softcap": _cap(d.get("final_logit_softcapping", None if gemma3 else 30.0)),
        "attn_logit_softcap": None if gemma3 else _cap(d.get("attn_logit_softcapping", 50.0)),
    }
    if gemma3:
        out["local_rope"] = _local_rope(d, source)
    return out


def _cap(v: Any) -> float | None:
    return float(v) if v else None


def _local_rope(d: dict[str, Any], source: str) -> RopeConfig:
    """Gemma 3's local layers' RoPE: rope_parameters["sliding_attention"] (transformers 5), else
    rope_local_base_freq (transformers 4; HF's default 10,000), unscaled."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        return rope_from_dict({"rope_parameters": params["sliding_attention"]}, source)
    return RopeConfig(theta=float(d.get("rope_local_base_freq") or 10000.0))


def _layer_tensors(cfg: ModelConfig, *, qk_norm: bool) -> LayerTensors:
    """The sandwich layer's tensors (model/layers/sandwich.py) in HF's names, in its init order."""
    h, d, i, q, kv = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    out: LayerTensors = {
        "input_layernorm.weight": (False, (h,)),
        "self_attn.q_proj.weight": (True, (q, h)),
        "self_attn.k_proj.weight": (True, (kv, h)),
        "self_attn.v_proj.weight": (True, (kv, h)),
        "self_attn.o_proj.weight": (True, (h, q)),
    }
    if cfg.attention_bias:
        out |= {"self_attn.q_proj.bias": (False, (q,)), "self_attn.k_proj.bias": (False, (kv,)),
                "self_attn.v_proj.bias": (False, (kv,))}  # fmt: skip
    if qk_norm:
        out |= {"self_attn.q_norm.weight": (False, (d,)), "self_attn.k_norm.weight": (False, (d,))}
    return out | {
        "post_attention_layernorm.weight": (False, (h,)),
        "pre_feedforward_layernorm.weight": (False, (h,)),
        "mlp.gate_proj.weight": (True, (i, h)),
        "mlp.up_proj.weight": (True, (i, h)),
        "mlp.down_proj.weight": (True, (h, i)),
        "post_feedforward_layernorm.weight": (False, (h,)),
    }


def _decoder(cfg: ModelConfig, plan: Any, backend: Any, *, qk_norm: bool) -> Any:
    from ringserve.model.layers.decoder import Decoder
    from ringserve.model.layers.sandwich import SandwichBlock

    return Decoder(cfg, plan, lambda: SandwichBlock(cfg, plan, backend, qk_norm=qk_norm, bias=cfg.attention_bias),
                   embed_scale=True, unit_offset_norm=True)  # fmt: skip


# llama.cpp's names of the sandwich layer's tensors (after "blk.N." / "model.layers.N.")
GGUF_GEMMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _gguf_config(arch: str, big: int):
    """config.json fields of a llama.cpp Gemma file from its metadata, as llama.cpp reads them:
    the window (`attention.sliding_window`) and its layer pattern (`attention.sliding_window_pattern`,
    a bool per layer where written, else llama.cpp's fixed one, which is HF's default), the soft
    caps, and the query scale, which the file does not hold: llama.cpp scales by head_dim ** -0.5
    but for the 27B (`big` layers), by (hidden / heads) ** -0.5, as query_pre_attn_scalar says."""

    def read(get: Any, cfg: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"sliding_window": get(f"{arch}.attention.sliding_window"),
                               "final_logit_softcapping": get(f"{arch}.final_logit_softcapping"),
                               "attn_logit_softcapping": get(f"{arch}.attn_logit_softcapping")}  # fmt: skip
        pattern = get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):
            out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        big_model = cfg["num_hidden_layers"] == big
        out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big_model else cfg["head_dim"]
        if arch == "gemma3":  # llama.cpp's local layers: base 10,000, unscaled
            out["rope_local_base_freq"] = 10000.0
        return out

    return read


GEMMA2 = Family(
    name="gemma2",
    summary="Gemma 2: sandwich norms, GeGLU, soft-capped attention and logits, local/global layers",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    options=lambda d, source: _options(d, source, gemma3=False),
    decoder=lambda cfg, plan, backend: _decoder(cfg, plan, backend, qk_norm=False),
    layer_tensors=lambda cfg: _layer_tensors(cfg, qk_norm=False),
    # a window of 24 keys (not a page multiple), a query scale and a soft cap that bite
    tiny=Tiny("Gemma2Config", {"tie_word_embeddings": True, "head_dim": 32, "sliding_window": 24,
                               "query_pre_attn_scalar": 16, "attn_logit_softcapping": 4.0,
                               "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
                               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
              gemma_scales=True),  # fmt: skip
    gguf=GGUFNames("gemma2", GGUF_GEMMA_LAYER, read_config=_gguf_config("gemma2", big=46), norms_plus_one=True),
)

GEMMA3 = Family(
    name="gemma3",
    summary="Gemma 3 (text): Gemma 2's layers with q/k norms, 5 local : 1 global, RoPE per layer type",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    options=lambda d, source: _options(d, source, gemma3=True),
    decoder=lambda cfg, plan, backend: _decoder(cfg, plan, backend, qk_norm=True),
    layer_tensors=lambda cfg: _layer_tensors(cfg, qk_norm=True),
    # local layers around a global one; the global RoPE linearly scaled as in Gemma 3 4B and up
    tiny=Tiny("Gemma3TextConfig", {"tie_word_embeddings": True, "head_dim": 32, "sliding_window": 24,
                                   "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh",
                                   "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                   "sliding_attention"],
                                   "rope_parameters": {
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}},
              gemma_scales=True),  # fmt: skip
    gguf=GGUFNames("gemma3", GGUF_GEMMA_LAYER, read_config=_gguf_config("gemma3", big=62), norms_plus_one=True),
)
