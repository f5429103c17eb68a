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
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; supported: \['LlamaForCausalLM'"):
        family_of({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="model family 'gpt2' is not served"):
        family("gpt2")


def test_what_other_parts_ask_of_a_family(tiny_dir):
    """PEFT's module dims and blocks, GGUF's architecture names, int8's modules: the family's."""
    cfg = read_config(tiny_dir("qwen3"))
    assert module_dims(cfg, "q_proj") == (cfg.hidden_size, cfg.q_size) and module_block(cfg, "q_proj") == "self_attn"
    assert module_dims(cfg, "down_proj") == (cfg.intermediate_size, cfg.hidden_size) and module_block(cfg, "down_proj") == "mlp"
    assert gguf_family("llama") is FAMILIES["llama"] and gguf_family("qwen3") is FAMILIES["qwen3"] and gguf_family("gpt2") is None
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
        assert {k: row[k] for k in ("tp", "lora", "int8", "gguf", "attention", "moe")} == fam.capabilities
    assert rows["Qwen3ForCausalLM"]["gguf"] == "qwen3" and rows["MistralForCausalLM"]["gguf"] is None
    table = subprocess.run([sys.executable, "-m", "ringserve.actors.cli.main", "models"], capture_output=True, text=True,
                           timeout=120).stdout  # fmt: skip
    assert table.splitlines()[0].split() == ["architecture", "family", "tp", "MoE", "LoRA", "int8", "GGUF", "attention"]
    assert rows["MixtralForCausalLM"]["moe"] and not rows["LlamaForCausalLM"]["moe"]
    mixtral = next(line.split() for line in table.splitlines() if line.split()[:2] == ["MixtralForCausalLM", "mixtral"])
    assert mixtral[2:6] == ["yes", "yes", "attn", "yes"]  # tp, MoE, LoRA on attention alone, int8
    assert all(arch in table for arch in ARCHITECTURES)
