"""Weight-only int8 (`quantization="int8"`, model/weights/state.py): the quantizer's error bound, the
state's layout (int8 weight + f32 scale per output column, per token row for the embedding)
in both layer layouts and lazily on many hosts, and the served model: its greedy tokens equal
those of the same model whose float weights are the dequantized int8 ones, at load and after a
weight update (which re-quantizes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ringserve.model.checkpoints.load import load_checkpoint
from ringserve.model.families import family
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from ringserve.model.weights.quant import quantize_int8
from ringserve.model.weights.state import build_host_state, build_lazy_state
from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix

QUANTIZED = family("llama").quantized  # every family of these tests holds the same modules as int8

CFG = ExecutorConfig(page_size=16, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=128,
                     precompile=False, cpu_matmul="xla")  # fmt: skip


def test_quantize_int8_is_within_half_a_step_per_column():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 40, 24)).astype(np.float32) * rng.uniform(0.01, 3, size=(1, 1, 24)).astype(np.float32)
    a[1, :, 5] = 0  # an all-zero column keeps scale 1, not a division by zero
    q, s = quantize_int8(a, -2)
    assert q.dtype == np.int8 and s.dtype == np.float32 and q.shape == a.shape and s.shape == (3, 24)
    assert np.abs(q).max() == 127 and s[1, 5] == 1 and not q[1, :, 5].any()
    assert np.all(np.abs(q * s[:, None, :] - a) <= s[:, None, :] / 2 + 1e-7)
    q0, s0 = quantize_int8(a[0], 0)  # a positive axis means the same as its negative
    np.testing.assert_array_equal(q0, q[0])
    np.testing.assert_array_equal(s0, s[0])
    qe, se = quantize_int8(a[0], -1)  # an embedding: one scale per row
    assert se.shape == (40,) and np.all(np.abs(qe * se[:, None] - a[0]) <= se[:, None] / 2 + 1e-7)



def _quantize_reference(a: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The definition, pass by pass, on the whole array."""
    f = np.asarray(a, np.float32)
    amax = np.max(np.abs(f), axis=axis)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.rint(f / np.expand_dims(scale, axis)), -127, 127).astype(np.int8), scale


@pytest.mark.parametrize("round_to", [None, ml_dtypes.bfloat16])
def test_quantize_int8_in_row_blocks_and_in_place_has_the_definitions_bits(round_to):
    """A large matrix scaled along its last axis goes in blocks of rows (an embedding), its
    passes in place: the same bits as the definition on the whole array, rounded first."""
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((1200, 1000)) * rng.uniform(0.01, 3, (1200, 1))).astype(np.float32)  # 4.8 MB
    a[3], a[4], a[5, :3] = 0, -0.0, [1e-30, -1e30, 7]
    for axis in (-1, -2):
        want = _quantize_reference(a if round_to is None else a.astype(round_to), axis)
        got = quantize_int8(a, axis, round_to)
        for w, g in zip(want, got, strict=True):
            assert w.dtype == g.dtype and w.shape == g.shape
            np.testing.assert_array_equal(g, w)
    stacked = a[:600].reshape(3, 200, 1000)
    for w, g in zip(_quantize_reference(stacked, -2), quantize_int8(stacked, -2), strict=True):
        np.testing.assert_array_equal(g, w)

@pytest.mark.parametrize("stacked", [True, False])
def test_the_state_holds_int8_and_a_scale_beside_every_quantized_weight(tiny_dir, stacked):
    cfg, tensors = load_checkpoint(tiny_dir("qwen2"))  # qkv biases stay float beside an int8 weight
    built = build_host_state(family(cfg.family), cfg, tensors, np.float32, stacked, "int8")
    layer = built["layers"] if stacked else built["layers"][0]
    q = layer["self_attn"]["q_proj"]
    assert q["weight"].dtype == np.int8 and q["bias"].dtype == np.float32
    # stored [out, in] (HF's layout): one scale per output row of it
    assert q["weight"].shape[-2:] == (cfg.q_size, cfg.hidden_size) and q["weight"].flags.c_contiguous
    assert q["scale"].shape == q["weight"].shape[:-1]
    hf = np.asarray(tensors["model.layers.0.self_attn.q_proj.weight"], np.float32)
    q0 = q["weight"][0] if stacked else q["weight"]
    np.testing.assert_array_equal(q0, quantize_int8(hf, -1)[0])
    emb = built["embed_tokens"]
    assert emb["weight"].dtype == np.int8 and emb["scale"].shape == (cfg.vocab_size,)
    assert layer["input_layernorm"]["weight"].dtype == np.float32  # norms stay float
    lazy = build_lazy_state(family(cfg.family), cfg, tensors, np.float32, stacked, "int8")
    assert jax.tree.structure(built) == jax.tree.structure(lazy)
    for b, z in zip(jax.tree.leaves(built), jax.tree.leaves(lazy), strict=True):
        assert (b.shape, b.dtype) == (z.shape, z.dtype)
        np.testing.assert_array_equal(z[tuple(slice(None) for _ in b.shape)], b)
        # a row-parallel shard splits the reduced axis: it still quantizes with the whole column's scale
        half = tuple(slice(0, max(1, n // 2)) for n in b.shape)
        np.testing.assert_array_equal(z[half], b[half])


def dequantized(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint with each quantized weight replaced by its int8 image in float (HF [out, in]:
    the scale is per row here, which is per column of ours)."""
    out = {}
    for name, a in tensors.items():
        module = name.split(".")[-2]
        if module in QUANTIZED and name.endswith(".weight"):
            q, s = quantize_int8(np.asarray(a, np.float32), -1)
            out[name] = q.astype(np.float32) * s[:, None]
        else:
            out[name] = a
    return out


@pytest.mark.parametrize("family,layer_loop", [("llama", "unrolled"), ("llama", "scan"), ("qwen2", "unrolled"), ("gemma3", "scan")])
def test_int8_serves_the_tokens_of_its_dequantized_weights(tiny_dir, family, layer_loop):
    cfg = dataclasses.replace(CFG, layer_loop=layer_loop)
    ex = ModelExecutor(tiny_dir(family), dataclasses.replace(cfg, quantization="int8"))
    assert ex.params["embed_tokens"]["weight"].dtype == jnp.int8
    ref = ModelExecutor(tiny_dir(family), cfg)
    deq = dequantized(ref.host_tensors)
    ref.swap_params(ref.build_params(deq), deq)
    prompts = prompts_with_shared_prefix(16, [5, 30, 9, 17])
    assert greedy_with_cached_prefix(ex, prompts, 16, 12) == greedy_with_cached_prefix(ref, prompts, 16, 12)


def test_a_weight_update_requantizes(tiny_dir):
    """New float weights through the update path come out int8 like a fresh load of them."""
    ex = ModelExecutor(tiny_dir("llama"), dataclasses.replace(CFG, quantization="int8"))
    rng = np.random.default_rng(1)
    new = {k: (np.asarray(v, np.float32) * rng.uniform(0.5, 1.5)).astype(np.float32) for k, v in ex.host_tensors.items()}
    params = ex.build_params(new)
    ex.swap_params(params, new)
    w = np.asarray(ex.params["layers"][1]["mlp"]["down_proj"]["weight"])
    s = np.asarray(ex.params["layers"][1]["mlp"]["down_proj"]["scale"])
    q, sc = quantize_int8(new["model.layers.1.mlp.down_proj.weight"].T, -2)
    np.testing.assert_array_equal(w, q.T)  # int8 projections are stored [out, in]
    np.testing.assert_array_equal(s, sc)


def test_an_unknown_quantization_is_refused_by_name(tiny_dir):
    with pytest.raises(ValueError, match="quantization='int4'"):
        ModelExecutor(tiny_dir("llama"), dataclasses.replace(CFG, quantization="int4"))


def test_int8_through_onednn_agrees_with_xla(tiny_dir):
    """bf16 activations times int8 weights inside oneDNN (tied LM head: the [V, H] embedding with
    its per-row scales) against XLA's dequantizing dot: greedy continuations agree."""
    from ringserve.model.compute.kernels import onednn

    if (why := onednn.supports("bfloat16", "int8")) is not None:
        pytest.skip(f"oneDNN custom call: {why}")
    cfg = dataclasses.replace(CFG, dtype="bfloat16", quantization="int8")
    fast = ModelExecutor(tiny_dir("llama"), dataclasses.replace(cfg, cpu_matmul="onednn"))
    ref = ModelExecutor(tiny_dir("llama"), cfg)
    assert (fast.plan.dot.name, ref.plan.dot.name) == ("onednn", "xla")
    prompts = prompts_with_shared_prefix(16, [5, 30, 9, 17])
    a, b = greedy_with_cached_prefix(fast, prompts, 16, 12), greedy_with_cached_prefix(ref, prompts, 16, 12)
    same = sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
    assert same >= 0.9 * sum(map(len, a)), (a, b)


@pytest.mark.parametrize("quantization, prompts", [(None, [9]), (None, [5, 30]), ("int8", [5, 30, 9, 17])])
def test_decode_through_the_small_row_kernel_keeps_xla_tokens(tiny_dir, quantization, prompts):
    """f32 decode steps of 1-2 rows, and int8 ones of up to 16, through ringserve's kernel
    (model/compute/kernels/cpu_matmul.py): the greedy tokens of XLA's dot on the same weights."""
    from ringserve.model.compute.kernels import cpu_matmul

    if (why := cpu_matmul.reason(quantization or "float32")) is not None:
        pytest.skip(f"cpu_matmul kernel: {why}")
    cfg = dataclasses.replace(CFG, quantization=quantization)
    fast = ModelExecutor(tiny_dir("llama"), dataclasses.replace(cfg, cpu_matmul="kernel"))
    ref = ModelExecutor(tiny_dir("llama"), cfg)
    assert fast.plan.dot.kernel and ref.plan.dot.name == "xla"
    ps = prompts_with_shared_prefix(16, prompts)
    assert greedy_with_cached_prefix(fast, ps, 16, 12) == greedy_with_cached_prefix(ref, ps, 16, 12)


TP_INT8 = r"""
import json, sys
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix
path, tp, loop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = ExecutorConfig(page_size=16, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=128, tp_size=tp,
                     precompile=False, layer_loop=loop, quantization="int8", cpu_matmul="xla")
ex = ModelExecutor(path, cfg)
scale = ex.params["layers"]["self_attn"]["q_proj"]["scale"] if loop == "scan" else ex.params["layers"][0]["self_attn"]["q_proj"]["scale"]
print(json.dumps({"tokens": greedy_with_cached_prefix(ex, prompts_with_shared_prefix(16, [5, 30, 9]), 16, 12),
                  "scale_spec": repr(tuple(scale.sharding.spec))}))
"""


@pytest.mark.sweep  # 32 s: out of CI's 45 minutes
def test_int8_under_tensor_parallelism_matches_tp1(tiny_dir):
    """The scales shard with their weights' output columns (column-parallel: split; row-parallel:
    replicated), and tp 2 serves tp 1's greedy tokens, unrolled and scanned."""
    import json
    import os
    import subprocess
    import sys

    path = str(tiny_dir("llama"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = {}
    for tp, loop in ((1, "unrolled"), (2, "unrolled"), (2, "scan")):
        r = subprocess.run([sys.executable, "-c", TP_INT8, path, str(tp), loop], env=env, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        out[tp, loop] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out[2, "unrolled"]["tokens"] == out[1, "unrolled"]["tokens"]
    assert out[2, "scan"]["tokens"] == out[1, "unrolled"]["tokens"]
    assert out[2, "unrolled"]["scale_spec"] == "('tp',)" and out[2, "scan"]["scale_spec"] == "(None, 'tp')"
