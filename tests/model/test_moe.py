"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral; model/layers/moe.py) against
Hugging Face transformers on tiny random checkpoints: prefill logits, greedy tokens with a cached
prefix, prompt logprobs chunked and not, the routed expert ids (routing replay) against the top-k
of HF's router logits, tensor and expert parallelism over forced CPU devices, int8 experts, and
what is refused (dense layers among sparse ones, adapters on expert weights)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ModelExecutor
from tests.hf_ref import hf_greedy, hf_logits, hf_model
from tests.model.test_hf_parity import (
    CFG,
    check_prompt_logprobs,
    greedy_with_cached_prefix,
    prompts_with_shared_prefix,
)

MOE = ["qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module")
def executors(tiny_dir):
    """One executor per (family, layer loop), shared by the tests below (each writes fresh pages)."""
    made: dict = {}

    def get(family: str, loop: str = "unrolled") -> ModelExecutor:
        if (family, loop) not in made:
            cfg = dataclasses.replace(CFG, layer_loop=loop, top_logprobs_num=3, token_ids_logprob_num=4)
            made[family, loop] = ModelExecutor(tiny_dir(family), cfg)
        return made[family, loop]

    return get


def routed_ids(ex: ModelExecutor, prompt: list[int]) -> np.ndarray:
    """The decoder's routed expert ids [len(prompt), M, k] of one prompt's prefill
    (model/layers/decoder.py: `forward(routed=True)`)."""
    hb = ex.prepare([DeviceRow(np.array(prompt, np.int32), 0, np.arange(1, 5, dtype=np.int32))])
    fb = jax.device_put(hb.forward)

    @jax.jit
    def run(params, kv, fb):
        return ex.model.forward(params, fb.input_ids, fb, kv, routed=True)[2]

    out = np.asarray(run(ex.params, ex.kv_pool.kv, fb))
    assert out.shape[1:] == ex.model.routed_shape and out.dtype == np.int32
    return out[: len(prompt)]


# CI runs each family and each layer loop once (RINGSERVE_SWEEP=1: every pair)
CI_CASES = {("qwen3_moe", "unrolled"), ("qwen3_moe", "scan"), ("qwen2_moe", "scan"), ("mixtral", "unrolled")}


def hf_routed(path, prompt: list[int], k: int) -> np.ndarray:
    """The top-k of HF's router logits [len(prompt), L, k] (`output_router_logits=True`),
    largest first (softmax preserves the order)."""
    import torch

    with torch.no_grad():
        out = hf_model(str(path))(torch.tensor([prompt]), output_router_logits=True)
    return np.stack([torch.topk(r, k, dim=-1).indices.numpy() for r in out.router_logits], axis=1)


@pytest.mark.parametrize("family,loop", [(f, loop) if (f, loop) in CI_CASES else pytest.param(f, loop, marks=pytest.mark.sweep)
                                         for f in MOE for loop in ("unrolled", "scan")])  # fmt: skip
def test_prefill_logits_and_routed_experts_match_hf(tiny_dir, executors, family, loop):
    """Last-token logits within f32 error of HF's (1e-5 of the logit scale), and every token's
    routed experts at every layer equal the top-k of HF's router logits, in its order."""
    path, ex = tiny_dir(family), executors(family, loop)
    assert (list(ex.params["layers"]) == list(range(4))) == (loop == "unrolled")
    prompt = np.random.default_rng(7).integers(3, 2000, 45).tolist()
    got = routed_ids(ex, prompt)
    ours, _ = ex.logits([DeviceRow(np.array(prompt, np.int32), 0, np.arange(5, 9, dtype=np.int32))])
    ref = hf_logits(path, prompt)[-1]
    assert np.abs(ours[0] - ref).max() <= 1e-5 * np.abs(ref).max()
    want = hf_routed(path, prompt, ex.model_config.num_experts_per_tok)
    assert got.shape == want.shape == (45, 4, 2)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) == ex.model_config.num_experts, "the router should use every expert"


@pytest.mark.parametrize("family", [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.sweep) for f in MOE])
def test_greedy_matches_hf_with_cached_prefix(tiny_dir, executors, family):
    path, ex = tiny_dir(family), executors(family)
    prompts = prompts_with_shared_prefix(32, [1, 7, 40, 90])
    ours = greedy_with_cached_prefix(ex, prompts, 32, 24)
    ref = hf_greedy(path, prompts, 24)
    assert ours == ref
    assert all(len(set(r)) > 3 for r in ref), "degenerate reference: the test would prove little"


def test_prompt_logprobs_match_hf_chunked_and_not(tiny_dir, executors):
    """Within HF's f32 tolerance, chunked at 16 or in one row (one family: the logits each family
    computes are checked above; the logprobs' path after them is every family's)."""
    path, ex = tiny_dir("qwen3_moe"), executors("qwen3_moe", "scan")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (45, 70)]
    for chunk in (16, None):
        check_prompt_logprobs(path, ex, prompts, chunk)


def test_dense_families_route_nothing(tiny_dir):
    """A dense family's `routed=True` ids are [T, 0, 0] (the decoder's contract)."""
    ex = ModelExecutor(tiny_dir("qwen3"), CFG)
    assert ex.model.routed_shape == (0, 0)
    assert routed_ids(ex, [5, 6, 7]).shape == (3, 0, 0)


def test_int8_experts(tiny_dir, executors):
    """quantization="int8": the experts' weights int8 [E, out, in] with a scale [E, out] (as a
    dense projection's), the router left in float; logits within int8's error of f32's."""
    path = tiny_dir("qwen3_moe")
    ex = ModelExecutor(path, dataclasses.replace(CFG, quantization="int8", layer_loop="scan"))
    experts = ex.params["layers"]["mlp"]["experts"]  # stacked: [L, E, ...]
    assert experts["gate_proj"]["weight"].dtype == np.int8
    assert experts["gate_proj"]["weight"].shape == (4, 8, 128, 256)
    assert experts["down_proj"]["scale"].shape == (4, 8, 256)
    assert ex.params["layers"]["mlp"]["gate"]["weight"].dtype == np.float32
    prompt = np.random.default_rng(7).integers(3, 2000, 30).tolist()
    ours, _ = ex.logits([DeviceRow(np.array(prompt, np.int32), 0, np.arange(1, 3, dtype=np.int32))])
    ref = hf_logits(path, prompt)[-1]
    assert 0 < np.abs(ours[0] - ref).max() <= 0.05 * np.abs(ref).max()


def test_dense_layers_among_sparse_ones_are_refused():
    from ringserve.model.families import parse_config

    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16)  # fmt: skip
    assert parse_config(base).moe_layers == (0, 1, 2, 3)
    with pytest.raises(ValueError, match=r"layers \[1\] have dense MLPs"):
        parse_config(base | {"mlp_only_layers": [1]})
    with pytest.raises(ValueError, match=r"layers \[0, 2\] have dense MLPs .*decoder_sparse_step=2"):
        parse_config(base | {"decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="num_experts_per_tok <= num_experts"):
        parse_config(base | {"num_experts_per_tok": 5})


def test_adapters_on_expert_weights_are_refused(tiny_dir, tmp_path):
    """LoRA on a MoE family: attention projections only; an adapter (or a server's targets)
    naming the MLP's projections is refused, saying the experts take none."""
    from ringserve.model.checkpoints.peft import read_adapter
    from ringserve.model.families import FAMILIES, read_config

    cfg = read_config(tiny_dir("mixtral"))
    with pytest.raises(ValueError, match="its experts', which take no adapters"):
        FAMILIES["mixtral"].module_dims(cfg, "gate_proj")
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj"]}))  # fmt: skip
    with pytest.raises(ValueError, match="target module 'up_proj' is unknown.*experts: they take no adapters"):
        read_adapter(tmp_path, cfg, 8, ("q_proj", "up_proj"))


PARALLEL_SCRIPT = r"""
import json, sys
import jax
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix
from ringserve.model.compute import plan
path, tp, ep, loop, a2a = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
if a2a is None:
    plan.MOE_A2A_ROWS.pop("cpu", None)  # psum only
else:
    plan.MOE_A2A_ROWS["cpu"] = a2a  # all_to_all for every step whose rows ep divides
cfg = ExecutorConfig(page_size=16, num_pages=128, max_context_len=512, max_batch=8, max_extend_tokens=256, tp_size=tp,
                     ep_size=ep, precompile=False, layer_loop=loop)
ex = ModelExecutor(path, cfg)
prompts = prompts_with_shared_prefix(32, [3, 20, 50])
layers = ex.params["layers"] if loop == "scan" else ex.params["layers"][0]
spec = repr(tuple(layers["mlp"]["experts"]["gate_proj"]["weight"].sharding.spec))
print(json.dumps({"tokens": greedy_with_cached_prefix(ex, prompts, 32, 12), "experts": spec,
                  "a2a_rows": ex.plan.moe_a2a_rows}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("tp, ep, loop, a2a", [(2, 1, "unrolled", None), (2, 2, "scan", None), (2, 2, "unrolled", 0),
                                               pytest.param(2, 2, "unrolled", None, marks=pytest.mark.sweep),
                                               pytest.param(2, 2, "scan", 0, marks=pytest.mark.sweep)])  # fmt: skip
def test_tensor_and_expert_parallel_match_hf(tiny_dir, tp, ep, loop, a2a):
    """tp 2 (experts on every device) and ep 2 (the experts split over the two devices under
    shard_map; attention tensor-parallel) in both forms (model/layers/expert_parallel.py: psum
    only, and all_to_all for every step of an even row count), scanned and unrolled, give HF's
    greedy tokens (Qwen2-MoE: a shared expert and biases too). CI runs three of the five."""
    path = str(tiny_dir("qwen2_moe"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    want = hf_greedy(path, prompts_with_shared_prefix(32, [3, 20, 50]), 12)
    r = subprocess.run([sys.executable, "-c", PARALLEL_SCRIPT, path, str(tp), str(ep), loop, json.dumps(a2a)], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tokens"] == want, (tp, ep, loop, a2a)
    assert got["a2a_rows"] == a2a, got  # the form the plan was held to
    split = "('tp', None, None)" if loop == "unrolled" else "(None, 'tp', None, None)"
    assert got["experts"] == (split if ep == 2 else "()"), (tp, ep, loop, got["experts"])


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("quant", [None, "int8"])
def test_host_lazy_and_device_states_agree(tiny_dir, stacked, quant):
    """The experts' [E, ...] leaves (from HF's per-expert tensors) built three ways: on the host
    (loading), lazily by shard (many hosts) and on the device (weights handed over in-process)."""
    from ringserve.model.checkpoints.load import load_checkpoint
    from ringserve.model.compute.mesh import make_mesh
    from ringserve.model.compute.options import ComputeOptions
    from ringserve.model.compute.plan import ComputePlan
    from ringserve.model.families import family
    from ringserve.model.weights.device_state import DeviceStateBuilder
    from ringserve.model.weights.state import build_host_state, build_lazy_state

    cfg, tensors = load_checkpoint(tiny_dir("qwen2_moe"))
    fam = family(cfg.family)
    plan = ComputePlan(ComputeOptions(quantization=quant), layer_loop="scan" if stacked else "unrolled")
    avals = fam.causal_lm(cfg, plan, None).state_avals(make_mesh(1))
    host = build_host_state(fam, cfg, tensors, np.float32, stacked, quant)
    lazy = build_lazy_state(fam, cfg, tensors, np.float32, stacked, quant)
    dev = DeviceStateBuilder(fam, cfg, np.float32, stacked, quant, avals)(tensors)
    experts = (host["layers"] if stacked else host["layers"][0])["mlp"]["experts"]["up_proj"]["weight"]
    assert experts.shape == (*((4,) if stacked else ()), 8, *((128, 256) if quant else (256, 128)))
    same = jax.tree.map(lambda h, lz, d: np.array_equal(h, lz[(slice(None),) * h.ndim]) and np.array_equal(h, np.asarray(d)),
                        host, lazy, dev, is_leaf=lambda x: hasattr(x, "shape"))  # fmt: skip
    assert all(jax.tree.leaves(same))



def test_the_deterministic_mode_routes_by_the_batch_invariant_dot(tiny_dir):
    """enable_deterministic_inference: every projection of the layers multiplies by the
    batch-invariant dot (model/compute/dots.py `rowwise`), the router and Qwen2-MoE's
    shared-expert gate included. They were left on XLA's dot, whose bits follow the step's
    other rows: a seeded request's logprobs then differed alone and in a batch
    (tests/engine/test_families_features.py's deterministic test, Qwen2-MoE)."""
    from flax import nnx

    from ringserve.model.layers.linear import Linear

    ex = ModelExecutor(tiny_dir("qwen2_moe"), dataclasses.replace(CFG, enable_deterministic_inference=True))
    layers = ex.model.bind(ex.params).layers
    dots = {".".join(map(str, path)): m.dot.name for path, m in nnx.iter_graph(layers) if isinstance(m, Linear)}
    assert {"0.mlp.gate", "0.mlp.shared_expert_gate", "3.mlp.gate", "0.self_attn.q_proj"} <= set(dots)
    assert set(dots.values()) == {"invariant"}, dots
