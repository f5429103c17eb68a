"""Named model shapes as config.json alone: what `ringserve compile` (actors/cli/compile.py)
builds a model from when it has no checkpoint. The fields are those of the published Hugging
Face configs, less the tokenizer's; nothing here reads or writes weights or tokenizer files.

    tiny          the embedded tiny model's config (model/checkpoints/tiny.py), made without weights
    smollm2       SmolLM2-135M-Instruct (model/checkpoints/random_shapes.py's shape)
    llama-3-8b    Meta-Llama-3-8B(-Instruct)
    qwen3-8b      Qwen3-8B
    qwen3-30b-a3b Qwen3-30B-A3B (mixture of experts: 128 experts, 8 a token)
    gemma-2-2b    Gemma-2-2B (local and global layers alternating, soft caps)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringserve.model.config import ModelConfig
from ringserve.model.families import parse_config

_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", attention_bias=False,
              rms_norm_eps=1e-5, dtype="bfloat16")  # fmt: skip

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        _LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_id=128009,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "qwen3-8b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu", attention_bias=False,
        rms_norm_eps=1e-6, dtype="bfloat16", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645, sliding_window=None,
        use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_act="silu", attention_bias=False,
        rms_norm_eps=1e-6, dtype="bfloat16", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_id=151645, sliding_window=None, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "gemma-2-2b": dict(
        model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, dtype="bfloat16", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=2, eos_token_id=1, sliding_window=4096,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}  # fmt: skip

NAMES = ("tiny", "smollm2", *CONFIGS)


def shape_config(name: str) -> dict[str, Any]:
    """The config.json of a named shape. ValueError naming the known ones."""
    if name == "tiny":
        from ringserve.model.checkpoints.tiny import DEFAULT_DIMS, _hf_config
        from ringserve.model.families import FAMILIES

        return dict(_hf_config(FAMILIES["llama"], dict(DEFAULT_DIMS), 0))
    if name == "smollm2":
        from ringserve.model.checkpoints.random_shapes import SHAPES

        return dict(_LLAMA, **SHAPES["smollm2-135m"], bos_token_id=1, eos_token_id=2)
    if name not in CONFIGS:
        raise ValueError(f"model shape {name!r}: not a directory and not one of {', '.join(NAMES)}")
    return dict(CONFIGS[name])


def model_config(name_or_dir: str | Path) -> tuple[ModelConfig, str]:
    """(ModelConfig, where it came from) for a model directory's config.json or a named shape."""
    p = Path(name_or_dir).expanduser()
    if p.is_dir():
        from ringserve.model.families import read_config

        return read_config(p), str(p / "config.json")
    return parse_config(shape_config(str(name_or_dir)), source=f"shape {name_or_dir}"), f"shape {name_or_dir}"
