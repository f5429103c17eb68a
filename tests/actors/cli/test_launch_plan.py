"""`ringserve launch-plan` (actors/cli/launch_plan.py): dp x tp, page size, running requests and
the program count for the tiny model, SmolLM2 and a Llama-3-8B shape on v5e-4, v5e-8 and v6e-8
hosts; given flags win; a model no split holds is refused by name."""

from __future__ import annotations

import pytest

from ringserve.actors.cli.launch_plan import HBM_BYTES, chip_of, choose, weight_bytes
from ringserve.model.checkpoints.random_shapes import SHAPES
from ringserve.model.compute.step_inputs import Buckets
from ringserve.model.families import parse_config
from ringserve.model.runtime.programs import compile_order

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5)
LLAMA_3_8B = dict(LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                  max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # fmt: skip


def config(name: str):
    if name == "tiny":
        from ringserve.model.checkpoints.tiny import DEFAULT_DIMS, _hf_config
        from ringserve.model.families import FAMILIES

        return parse_config(_hf_config(FAMILIES["llama"], dict(DEFAULT_DIMS), 0))
    if name == "smollm2":
        return parse_config(dict(LLAMA, **SHAPES["smollm2-135m"]))
    return parse_config(LLAMA_3_8B)


HOSTS = {"v5e-4": ("v5e", 4), "v5e-8": ("v5e", 8), "v6e-8": ("v6e", 8)}
# (dp, tp) per model and host: small models data parallel, SmolLM2's 9 / 3 heads split over none
# of 2, 4, 8; Llama-3-8B's 16 GB of weights take 4 v5e chips (8 GB each would be half a 16 GB
# chip), 2 v6e chips
EXPECTED = {
    ("tiny", "v5e-4"): (4, 1), ("tiny", "v5e-8"): (8, 1), ("tiny", "v6e-8"): (8, 1),
    ("smollm2", "v5e-4"): (4, 1), ("smollm2", "v5e-8"): (8, 1), ("smollm2", "v6e-8"): (8, 1),
    ("llama-3-8b", "v5e-4"): (1, 4), ("llama-3-8b", "v5e-8"): (2, 4), ("llama-3-8b", "v6e-8"): (4, 2),
}  # fmt: skip


@pytest.mark.parametrize(("model", "host"), list(EXPECTED))
def test_dp_times_tp_is_the_chips(model, host):
    chip, chips = HOSTS[host]
    cfg = config(model)
    plan = choose(cfg, chips, HBM_BYTES[chip])
    assert (plan.dp, plan.tp) == EXPECTED[model, host]
    assert plan.dp * plan.tp == chips
    assert cfg.num_heads % plan.tp == 0 and cfg.num_kv_heads % plan.tp == 0
    assert plan.page_size == {128: 64, 64: 128, 32: 128}[cfg.head_dim]  # 16 KiB of one KV head a page
    assert plan.programs <= 20
    flags = plan.flags()
    assert flags[:4] == ["--dp-size", str(plan.dp), "--tp-size", str(plan.tp)]


def test_smollm2_says_why_not_tensor_parallel():
    plan = choose(config("smollm2"), 8, HBM_BYTES["v5e"])
    assert "split 9 query / 3 KV heads (not 2, 4, 8)" in plan.why[0]


def test_the_program_count_is_the_servers():
    """The count printed is what the executor compiles with a ragged kernel's one context:
    decode batches in powers of two, extend buckets up to the prefill budget plus a block per
    running request."""
    plan = choose(config("llama-3-8b"), 4, HBM_BYTES["v5e"])
    serve = dict(plan.serve)
    most = (serve["max_prefill_tokens"] + serve["extend_block"] * plan.max_running_requests)
    buckets = Buckets.make(plan.max_running_requests, most, serve["extend_block"], plan.decode_bucket_step)
    assert len(compile_order(buckets, (0,), 0, 0)[0]) == plan.programs
    assert plan.max_running_requests == 128  # 38 GB of KV over 4 chips, 128 KiB a token, 2048 tokens a request


def test_the_ragged_kernel_compiles_one_context():
    """The TPU backend the launcher names asks for no context buckets (so `programs` above is
    the server's count); the bucketed GPU path asks for several."""
    from ringserve.model.compute.attention.base import AttnGeometry
    from ringserve.model.compute.mesh import make_mesh
    from ringserve.model.compute.options import ComputeOptions
    from ringserve.model.compute.plan import ComputePlan

    geo = AttnGeometry(num_layers=2, num_pages=64, page_size=64, num_heads=8, num_kv_heads=4, head_dim=128,
                       max_pages=64, dtype="bfloat16")  # fmt: skip
    contexts = {}
    for backend in ("pallas", "bucketed"):
        plan = ComputePlan.resolve(ComputeOptions(attention_backend=backend, attention_interpret=True), "cpu")
        contexts[backend] = plan.make_backend(geo, make_mesh(1)).context_buckets()
    assert contexts["pallas"] == (0,) and len(contexts["bucketed"]) > 1


def test_given_flags_win():
    plan = choose(config("llama-3-8b"), 8, HBM_BYTES["v6e"], {"tp_size": 4, "page_size": 32})
    assert (plan.dp, plan.tp, plan.page_size) == (2, 4, 32)
    with pytest.raises(ValueError, match="dp_size=4 x tp_size=4 needs 16 chips"):
        choose(config("tiny"), 8, HBM_BYTES["v5e"], {"tp_size": 4, "dp_size": 4})


def test_a_model_no_split_holds_is_refused():
    with pytest.raises(ValueError, match=r"16\.1 GB of weights over at most 1 chip"):
        choose(config("llama-3-8b"), 1, HBM_BYTES["v5e"])
    assert weight_bytes(config("llama-3-8b")) == 16_060_522_496  # Meta-Llama-3-8B's bf16 safetensors


def test_device_kinds():
    assert [chip_of(k) for k in ("TPU v5 lite", "TPU v6 lite", "TPU v5p", "TPU v4")] == ["v5e", "v6e", "v5p", "v4"]
    with pytest.raises(ValueError, match="not a TPU generation"):
        chip_of("NVIDIA H100")


@pytest.mark.parametrize("model, host, attention, tp, ep", [
    ("smollm2", "v5e-4", "pallas_ragged", 1, 1),  # jax's layout: 3 heads of 64 padded to 4 of 128 (2.67x)
    ("tiny", "v5e-4", "pallas", 1, 1),  # head_dim 32: ringserve's kernel copies such a cache each step
    ("llama-3-8b", "v6e-8", "pallas", 2, 1),  # 8 KV heads of 128: jax's layout is exact
    ("gemma-2-2b", "v5e-4", "pallas_ragged", 1, 1),  # head_dim 256: jax's kernel does not compile
    ("qwen3-30b-a3b", "v6e-8", "pallas_ragged", 8, 8),  # 4 KV heads over 8 chips: replicated; experts split
])  # fmt: skip
def test_the_kernel_and_the_expert_split_suit_the_model(model, host, attention, tp, ep):
    """The TPU attention kernel that stores the model's KV unpadded and compiles for it, and a
    mixture of experts' experts split over the tp chips (ep = tp, SGLang's --ep-size)."""
    from ringserve.model.checkpoints.config_shapes import model_config

    cfg = config(model) if model in ("tiny", "smollm2", "llama-3-8b") else model_config(model)[0]
    chip, chips = HOSTS[host]
    plan = choose(cfg, chips, HBM_BYTES[chip])
    assert (plan.attention, plan.tp, plan.ep) == (attention, tp, ep), plan.why
    flags = plan.flags()
    assert flags[flags.index("--attention-backend") + 1] == attention
    assert ("--ep-size" in flags) == (ep > 1)
    assert weight_bytes(cfg) > 0 and any(attention in w for w in plan.why)
