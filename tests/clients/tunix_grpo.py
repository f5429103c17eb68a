"""Tunix's own GRPO (`GRPOLearner` over `RLCluster`) with ringserve's rollout engine, on a tiny
Qwen2 on CPU; run in Tunix's venv (tools/install_clients.sh tunix) with the checkout on
PYTHONPATH by tests/clients/test_tunix.py, which reads the JSON it prints last:

    steps, losses (each finite), syncs (the largest |served - trainer| over every tensor after
    each sync), greedy_equal (ringserve's greedy rollouts == Tunix's vanilla rollout on the
    trained weights), logps_max_diff (get_per_token_logps against Tunix's own), lora (the same
    with a LoRA actor, where Tunix's LoRA path runs)

    python tests/clients/tunix_grpo.py OUT_DIR [--steps 5] [--lora]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from grain import python as grain
from transformers import AutoTokenizer
from tunix.generate import tokenizer_adapter
from tunix.models.qwen2 import model as qwen2_model
from tunix.models.qwen2 import params as qwen2_params
from tunix.rl import common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout, vanilla_rollout

from ringserve.integrations.tunix import RingserveRollout, flat_state
from ringserve.model.checkpoints.tiny import make_tiny_model

PROMPTS = [
    "the cat sat",
    "hello world",
    "one two three",
    "a b c d",
    "ring serve",
    "jax and flax",
    "tiny model",
    "zz",
]


def tunix_config(path: Path) -> qwen2_model.ModelConfig:
    c = json.loads((path / "config.json").read_text())
    rope = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    return qwen2_model.ModelConfig(
        num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"], embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"], num_heads=c["num_attention_heads"],
        head_dim=c["hidden_size"] // c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
        rope_theta=int(rope), norm_eps=c["rms_norm_eps"], use_tied_embedding=c.get("tie_word_embeddings", False),
    )  # fmt: skip


class CheckedRollout(RingserveRollout):
    """RingserveRollout that, after every sync, reads every tensor back from the engine and
    records the largest difference from the trainer's (mapped to HF names)."""

    syncs: list[float] = []

    def update_params(self, params, filter_types=None):
        super().update_params(params, filter_types)
        with jax.transfer_guard("allow"):
            want = (
                self.to_hf(flat_state(params))
                if not any(k.endswith("_lora_a") for k in flat_state(params))
                else {}
            )
            want = want or self.served  # (LoRA: the merged tensors the rollout computed)
            want = {n: np.asarray(w, np.float32) for n, w in want.items()}  # (JAX arrays, on the trainer's devices)
        CheckedRollout.syncs.append(max(float(np.abs(self.served_tensor(n) - w).max())
                                        for n, w in want.items()))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lora", action="store_true")
    a = ap.parse_args()
    path = make_tiny_model(a.out / "tiny-qwen2", "qwen2", seed=0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    cfg = tunix_config(path)
    actor = qwen2_params.create_model_from_safe_tensors(str(path), cfg, mesh)
    reference = qwen2_params.create_model_from_safe_tensors(str(path), cfg, mesh)
    if a.lora:
        import qwix

        provider = qwix.LoraProvider(module_path=".*q_proj|.*v_proj|.*gate_proj", rank=4, alpha=8.0)
        actor = qwix.apply_lora_to_model(actor, provider, **actor.get_model_input())
    tok = tokenizer_adapter.TokenizerAdapter(AutoTokenizer.from_pretrained(str(path)))
    rollout_config = base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=16, temperature=1.0,
                                                top_p=0.95, kv_cache_size=64, return_logprobs=True)  # fmt: skip
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine=functools.partial(CheckedRollout, model_path=path, lora_alpha=8.0, context_length=256,
                                         max_running_requests=16),
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.adamw(1e-2), eval_every_n_steps=100,
                                                        max_steps=a.steps),
        rollout_config=rollout_config,
    )  # fmt: skip
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=tok, cluster_config=cluster_config
    )
    rollout = cluster.rollout
    assert isinstance(rollout, RingserveRollout)

    def reward(prompts, completions, **kw):  # longer completions and more distinct characters score higher
        return jnp.array([len(set(c)) + 0.1 * len(c) for c in completions], jnp.float32)

    learner = grpo_lib.GRPOLearner(rl_cluster=cluster, algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1),
                                   reward_fns=[reward])  # fmt: skip
    data = grain.MapDataset.source(PROMPTS * 4).batch(2).map(lambda x: {"prompts": x})
    before = [np.asarray(v).copy() for v in jax.tree.leaves(nnx.state(actor, nnx.Param))]
    learner.train(data)
    after = [np.asarray(v) for v in jax.tree.leaves(nnx.state(actor, nnx.Param))]
    losses = [
        float(x) for x in cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")
    ]

    # greedy rollouts on the trained weights: ringserve's against Tunix's vanilla rollout
    greedy = base_rollout.RolloutConfig(
        max_tokens_to_generate=8, max_prompt_length=16, top_p=None, kv_cache_size=64
    )
    got = rollout.generate(PROMPTS, greedy)
    model = nnx.merge(*nnx.split(actor)) if not a.lora else actor
    vanilla = vanilla_rollout.VanillaRollout(model, tok, base_rollout.CacheConfig(64, cfg.num_layers, cfg.num_kv_heads,
                                                                                   cfg.head_dim))  # fmt: skip
    want = vanilla.generate(PROMPTS, greedy)
    greedy_equal = [
        g.tolist() == np.asarray(w).tolist() for g, w in zip(got.tokens, want.tokens, strict=True)
    ]
    prompts_equal = (
        got.left_padded_prompt_tokens.tolist() == np.asarray(want.left_padded_prompt_tokens).tolist()
    )
    # per-token logps: ringserve's against Tunix's own computation on the actor
    p, c = jnp.asarray(want.left_padded_prompt_tokens), jnp.asarray(np.array([
        np.pad(np.asarray(t), (0, 8 - len(t)), constant_values=tok.pad_id()) for t in want.tokens]))  # fmt: skip
    ours = np.asarray(rollout.get_per_token_logps(p, c))
    theirs = np.asarray(common.compute_per_token_logps(*nnx.split(model), prompt_tokens=p, completion_tokens=c,
                                                       pad_id=tok.pad_id(), eos_id=tok.eos_id()))  # fmt: skip
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    mask = np.array([[j < len(t) for j in range(8)] for t in want.tokens])
    result = {
        "steps": cluster.actor_trainer.train_steps, "losses": losses,
        "loss_finite": bool(losses) and all(np.isfinite(losses)), "syncs": CheckedRollout.syncs,
        "weights_changed": any(not np.array_equal(x, y) for x, y in zip(before, after, strict=True)),
        "greedy_equal": greedy_equal, "prompts_equal": prompts_equal,
        "logps_max_diff": float(np.abs((ours - theirs) * mask).max()), "lora": a.lora,
        "completions": [t.tolist() for t in got.tokens],
    }  # fmt: skip
    rollout.shutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
