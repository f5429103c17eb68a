"""The Decoder's nnx modules against the HF map: every Param is placed by exactly one HF tensor
(the family's layout, model/families/base.py) in both layer layouts, and carries the `tp` sharding model/compute/mesh.py
states. (Loading and running them: test_hf_parity, test_step's TP test; weight updates:
tests/engine/test_rl_loop.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from jax.sharding import PartitionSpec

from ringserve.model.compute.attention.base import AttnGeometry, NoAttention
from ringserve.model.compute.plan import ComputePlan
from ringserve.model.config import ModelConfig
from ringserve.model.families import FAMILIES, family, parse_config
from ringserve.model.layers.decoder import CausalLM


def model(cfg: ModelConfig, tp: int, layer_loop: str) -> CausalLM:
    geo = AttnGeometry(cfg.num_layers, 8, 16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4, np.float32)
    return family(cfg.family).causal_lm(cfg, ComputePlan(tp=tp, layer_loop=layer_loop), NoAttention(geo))


def flat(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    out: dict[tuple, object] = {}
    for k, v in tree.items():
        out |= flat(v, (*prefix, k)) if isinstance(v, dict) else {(*prefix, k): v}
    return out


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_layout_places_every_param_once_with_its_shape(tiny_dir, name, layer_loop):
    cfg = parse_config(json.loads((tiny_dir(name) / "config.json").read_text()))
    state = flat(model(cfg, 1, layer_loop).abstract)
    stacked = layer_loop == "scan"
    placed: dict[tuple, list] = {}
    for place in family(cfg.family).layout(cfg).values():
        shape = place.hf_shape[::-1] if place.transpose else place.hf_shape
        placed.setdefault(place.state_path(stacked), []).append((place.layer, place.expert, place.experts, shape))
    assert set(placed) == set(state)
    for path, entries in placed.items():
        layers = sorted({layer for layer, *_ in entries}, key=lambda x: -1 if x is None else x)
        (experts,) = {e for _, _, e, _ in entries}
        shape = {s for *_, s in entries}.pop()
        if experts:  # a mixture of experts' per-expert tensors: one leaf [E, ...], each expert once
            assert sorted(e for _, e, _, _ in entries) == sorted(list(range(experts)) * len(layers)), path
            shape = (experts, *shape)
        if stacked and layers != [None]:
            assert layers == list(range(cfg.num_layers)), path  # index l of the stack is layer l
            assert state[path].shape == (cfg.num_layers, *shape), path
        else:
            assert len(entries) == max(experts, 1) and state[path].shape == shape, path


def test_params_carry_their_tp_sharding(tiny_dir):
    cfg = parse_config(json.loads((tiny_dir("qwen2") / "config.json").read_text()))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size) == (8, 4, 640, 2048)
    col, row, rep = PartitionSpec(None, "tp"), PartitionSpec("tp", None), PartitionSpec()
    specs = flat(model(cfg, 4, "unrolled").specs)
    assert specs["layers", 0, "self_attn", "q_proj", "weight"] == col
    assert specs["layers", 3, "self_attn", "k_proj", "weight"] == col
    assert specs["layers", 0, "self_attn", "v_proj", "bias"] == PartitionSpec("tp")
    assert specs["layers", 0, "self_attn", "o_proj", "weight"] == row
    assert specs["layers", 0, "mlp", "gate_proj", "weight"] == col
    assert specs["layers", 0, "mlp", "down_proj", "weight"] == row
    assert specs["lm_head", "weight"] == col
    assert specs["embed_tokens", "weight"] == specs["norm", "weight"] == rep
    assert specs["layers", 0, "input_layernorm", "weight"] == rep
    # 8 devices: 4 KV heads do not split, so k/v stay replicated; q (8 heads) still splits
    specs8 = flat(model(cfg, 8, "unrolled").specs)
    assert specs8["layers", 0, "self_attn", "k_proj", "weight"] == specs8["layers", 0, "self_attn", "k_proj", "bias"] == rep
    assert specs8["layers", 0, "self_attn", "q_proj", "weight"] == col
    # stacked: the same after a None for the layer axis
    stacked = flat(model(cfg, 4, "scan").specs)
    assert stacked["layers", "self_attn", "q_proj", "weight"] == PartitionSpec(None, None, "tp")
    assert stacked["layers", "mlp", "down_proj", "weight"] == PartitionSpec(None, "tp", None)
    assert stacked["layers", "post_attention_layernorm", "weight"] == rep
    assert set(flat(model(cfg, 1, "scan").specs).values()) == {rep}  # one device: nothing split


def test_silu_rounds_once_as_torch_does_in_bf16():
    """The MLP's activation in bf16 is torch's: computed in f32 and rounded once (jax.nn.silu
    rounds after each of its ops, and differs from torch on some inputs)."""
    import jax.numpy as jnp
    import torch

    from ringserve.model.layers.mlp import silu

    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32) * 6
    xb = jnp.asarray(x, jnp.bfloat16)
    want = torch.nn.functional.silu(torch.tensor(np.asarray(xb.astype(jnp.float32))).to(torch.bfloat16))
    got = silu(xb)
    assert got.dtype == jnp.bfloat16
    got32, want32 = np.asarray(got.astype(jnp.float32)), want.float().numpy()
    ulp = np.abs(got32 - want32) / np.maximum(np.abs(want32), 1e-30)
    assert np.mean(got32 == want32) > 0.999 and ulp.max() <= 2**-8, ulp.max()  # at most one bf16 ulp, rarely
    f32 = jnp.asarray(x)
    np.testing.assert_array_equal(np.asarray(silu(f32)), np.asarray(f32 * (1 / (1 + jnp.exp(-f32)))))
