"""The family registry (model/families/): every family is found by its HF architecture, reads its
own config fields, makes its tiny checkpoint through transformers' config class, names its GGUF
tensors and its adapters' projections; `ringserve models` prints it. (Each family's greedy tokens
against HF: test_hf_parity; its layout against its module tree: test_modules.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ringserve.model.checkpoints.peft import module_block, module_dims
from ringserve.model.families import (
    ARCHITECTURES,
    FAMILIES,
    family,
    family_of,
    gguf_family,
    parse_config,
    read_config,
)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_is_found_by_its_architecture_and_reads_its_own_fields(tiny_dir, name):
    d = json.loads((tiny_dir(name) / "config.json").read_text())
    fam = family(name)
    assert d["architectures"] == [fam.architectures[0]] and family_of(d) is fam
    cfg = read_config(tiny_dir(name))
    assert cfg.family == name and cfg == parse_config(d)
    assert cfg.attention_bias == (name in ("qwen2", "qwen2_moe"))  # Qwen2's biases are the family's (MoE: qkv_bias)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == ((8, 2) if name.endswith("moe") or name == "mixtral" else (0, 0))
    assert family_of({"model_type": fam.model_types[0]}) is fam  # no `architectures`: by model_type


def test_an_architecture_no_family_serves_is_refused_naming_the_supported():
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; supported: \['Gemma2ForCausalLM', 'Gemma3ForCausalLM', 'Llama"):
        family_of({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="model family 'gpt2' is not served"):
        family("gpt2")


def test_what_other_parts_ask_of_a_family(tiny_dir):
    """PEFT's module dims and blocks, GGUF's architecture names, int8's modules: the family's."""
    cfg = read_config(tiny_dir("qwen3"))
    assert module_dims(cfg, "q_proj") == (cfg.hidden_size, cfg.q_size) and module_block(cfg, "q_proj") == "self_attn"
    assert module_dims(cfg, "down_proj") == (cfg.intermediate_size, cfg.hidden_size) and module_block(cfg, "down_proj") == "mlp"
    assert gguf_family("llama") is FAMILIES["llama"] and gguf_family("qwen3") is FAMILIES["qwen3"] and gguf_family("gpt2") is None
    assert gguf_family("llama", moe=True) is FAMILIES["mixtral"] and gguf_family("qwen3moe") is FAMILIES["qwen3_moe"]  # fmt: skip
    assert "self_attn.q_norm.weight" in FAMILIES["qwen3"].gguf.layer.values()  # type: ignore[union-attr]
    assert "self_attn.q_norm.weight" not in FAMILIES["qwen2"].gguf.layer.values()  # type: ignore[union-attr]
    layout = FAMILIES["qwen3"].layout(cfg)
    assert "model.layers.0.self_attn.k_norm.weight" in layout and "model.layers.0.self_attn.q_proj.bias" not in layout
    assert {"embed_tokens", "lm_head", "q_proj", "down_proj"} <= FAMILIES["qwen3"].quantized


def test_ringserve_models_lists_every_architecture_with_its_capabilities():
    r = subprocess.run([sys.executable, "-m", "ringserve.actors.cli.main", "models", "--json"], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {row["architecture"]: row for row in json.loads(r.stdout)}
    assert set(rows) == set(ARCHITECTURES)
    for arch, row in rows.items():
        fam = ARCHITECTURES[arch]
        assert row["family"] == fam.name and row["summary"] == fam.summary
        assert {k: row[k] for k in fam.capabilities} == fam.capabilities
    assert rows["Qwen3ForCausalLM"]["gguf"] == "qwen3" and rows["MistralForCausalLM"]["gguf"] is None
    assert rows["Gemma2ForCausalLM"]["gguf"] == "gemma2" and rows["Gemma3ForCausalLM"]["gguf"] == "gemma3"
    moe_gguf = [rows[f"{a}ForCausalLM"]["gguf"] for a in ("Qwen3Moe", "Qwen2Moe", "Mixtral")]
    assert moe_gguf == ["qwen3moe", "qwen2moe", "llama"]  # Mixtral's: llama's, with llama.expert_count
    table = subprocess.run([sys.executable, "-m", "ringserve.actors.cli.main", "models"], capture_output=True, text=True,
                           timeout=120).stdout  # fmt: skip
    assert table.splitlines()[0].split() == ["architecture", "family", "tp", "MoE", "LoRA", "int8", "GGUF", "attention"]
    assert rows["MixtralForCausalLM"]["moe"] and not rows["LlamaForCausalLM"]["moe"]
    mixtral = next(line.split() for line in table.splitlines() if line.split()[:2] == ["MixtralForCausalLM", "mixtral"])
    assert mixtral[2:6] == ["yes", "yes", "attn", "yes"]  # tp, MoE, LoRA on attention alone, int8
    assert all(arch in table for arch in ARCHITECTURES)


def test_gemmas_own_fields_and_refusals():
    """Gemma reads its layer pattern (transformers 5's layer_types, else HF's default: Gemma 2
    every other layer local, Gemma 3 every sixth global), soft caps (HF's defaults where left
    out; Gemma 3's attention cap ignored, as HF's Gemma3Attention ignores it) and local RoPE;
    what it does not serve is refused naming the field."""
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32,
            "intermediate_size": 128, "num_hidden_layers": 7, "sliding_window": 8}  # fmt: skip
    g2 = parse_config(base | {"architectures": ["Gemma2ForCausalLM"]})
    assert g2.layer_windows == (8, 0, 8, 0, 8, 0, 8)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    g3 = parse_config(base | {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0, "rope_theta": 1e6,
                              "rope_local_base_freq": 5000.0})  # fmt: skip
    assert g3.layer_windows == (8, 8, 8, 8, 8, 0, 8) and g3.attn_logit_softcap is None and g3.final_logit_softcap is None
    assert g3.local_rope is not None and g3.local_rope.theta == 5000.0 and g3.rope.theta == 1e6
    types = ["full_attention"] * 6 + ["sliding_attention"]
    assert parse_config(base | {"model_type": "gemma3_text", "layer_types": types}).layer_windows == (0,) * 6 + (8,)
    with pytest.raises(ValueError, match=r"config.json: layer_types must give each of the 7 layers"):
        parse_config(base | {"model_type": "gemma2", "layer_types": types[:3]})
    with pytest.raises(ValueError, match=r"hidden_activation 'gelu' is not served; Gemma's is 'gelu_pytorch_tanh'"):
        parse_config(base | {"model_type": "gemma2", "hidden_activation": "gelu"})
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=true"):
        parse_config(base | {"model_type": "gemma3_text", "use_bidirectional_attention": True})
    gguf = FAMILIES["gemma2"].gguf
    assert gguf is not None and gguf.norms_plus_one and gguf.layer["post_ffw_norm.weight"] == "post_feedforward_layernorm.weight"


def test_make_tiny_model_takes_a_familys_own_sizes_only_where_it_has_them(tmp_path):
    """make-tiny-model's FAMILY_DIMS flags (a mixture of experts' sizes, head_dim) replace the
    family's tiny fields; one the family does not have is refused, naming those it has."""
    from ringserve.model.checkpoints.tiny import main

    assert main([str(tmp_path / "moe"), "--arch", "qwen3_moe", "--num-experts", "6", "--num-experts-per-tok", "3",
                 "--moe-intermediate-size", "40", "--head-dim", "32", "--num-hidden-layers", "1"]) == 0  # fmt: skip
    cfg = read_config(tmp_path / "moe")
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (6, 3)
    assert (cfg.moe_intermediate_size, cfg.head_dim) == (40, 32)
    with pytest.raises(ValueError, match=r"--arch llama has no num_experts: .* and \[\]"):
        main([str(tmp_path / "llama"), "--arch", "llama", "--num-experts", "4"])
