"""Random-weight HF-format checkpoints of named real model shapes, made offline in place.

For benchmarks that need a real model's cost (layers, widths, vocabulary) but not its
weights: `random_model("smollm2-135m")` writes config.json + model.safetensors once into the
cache directory (seeded: same bytes every time) and returns the directory. No tokenizer: the
benchmarks feed token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ringserve.model.paths import atomic_dir, cache_dir

# config.json fields of the real checkpoints (HF hub configs), minus tokens and tokenizers.
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}  # fmt: skip


def _weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Projections with std 1/sqrt(fan_in), norms near 1, embeddings std 0.02 (float32)."""
    rng = np.random.default_rng(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def normal(*shape: int, std: float) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    w = {"model.embed_tokens.weight": normal(v, h, std=0.02), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "self_attn.q_proj.weight"] = normal(heads * hd, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(kv * hd, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv * hd, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, heads * hd, std=(heads * hd) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, inter, std=inter**-0.5)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(v, h, std=0.02)
    return w


def random_model(shape: str, seed: int = 0) -> Path:
    """The cached random checkpoint of a named shape (made on first use)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {sorted(SHAPES)}")
    out = cache_dir("models", f"random-{shape}-s{seed}")
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.numpy import save_file

    cfg = dict(SHAPES[shape], model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
               hidden_act="silu", attention_bias=False, bos_token_id=1, eos_token_id=2, dtype="float32")  # fmt: skip
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(_weights(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out
