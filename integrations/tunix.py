"""A Tunix rollout engine over ringserve (google-tunix 0.1.7): `RingserveRollout`, a
`BaseRollout` a Tunix user names as the cluster's rollout engine.

    import functools
    from ringserve.integrations.tunix import RingserveRollout

    cluster_config = rl_cluster.ClusterConfig(
        ..., rollout_engine=functools.partial(RingserveRollout, model_path="/path/to/hf-checkpoint"),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=..., temperature=..., top_p=...))

Tunix builds it with the rollout actor (the trainer's model at the start), its tokenizer, the
rollout mesh and the rollout config. It serves `model_path` (an HF checkpoint of the actor's
family: its config.json and tokenizer; the weights it holds are replaced by the actor's at once)
with a `ringserve.Engine` started in the trainer's process, its runner a thread on the process's
own devices (`runner_in_process`; one process owns a TPU host's chips). Then:

    generate(prompts, rollout_config)   the prompts tokenized as Tunix's sampler does (BOS put
                                        first, once), sampled as the config says (top_p None:
                                        greedy; temperature, top_p, top_k, seed; the EOS ids),
                                        answered as Tunix's rollouts are: completion tokens
                                        without the EOS, prompts left-padded to the power of two
                                        Tunix pads to, processed logprobs when asked
    update_params(state, filter_types)  the trainer's `nnx.State` (every Param, or the LoRA
                                        params: merged into the base weights served) mapped to
                                        HF names by the family's own Tunix map (tunix.models.
                                        {llama3,qwen2,qwen3}.params), all or nothing, while
                                        nothing runs: JAX arrays (a trainer's, on its devices)
                                        go device to device, host arrays through shared memory
    get_per_token_logps(prompt, completion)  the completion tokens' logprobs, from ringserve's
                                        prompt logprobs over prompt + completion (one prefill)
    model()                             None: the learner syncs weights after every step (it
                                        skips that when the rollout model is the actor)

The weights stay on the devices: the trainer's arrays are laid out as HF's with jnp on its own
devices (`to_hf`, `merge_lora`), then lent to the runner in this process, which moves them onto
its mesh device to device and builds the served state there (ringserve's
actors/frontend/weight_local.py and model/weights/device_state.py); host (NumPy) leaves take the
shared-memory push as before.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout  # type: ignore[import-not-found]
from tunix.utils import torch_utils  # type: ignore[import-not-found]

# Tunix's own HF <-> Tunix name maps, by the HF architecture ringserve serves
TUNIX_PARAMS = {
    "LlamaForCausalLM": "tunix.models.llama3.params",
    "Qwen2ForCausalLM": "tunix.models.qwen2.params",
    "Qwen3ForCausalLM": "tunix.models.qwen3.params",
}
LORA_SUFFIXES = ("_lora_a", "_lora_b")


def hf_names(model_path: str | Path) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The architecture of the checkpoint at `model_path` and every tensor ringserve serves of
    it: HF name -> HF shape (the family's layout, ringserve.model.families)."""
    from ringserve.model.families import family, read_config

    cfg = read_config(model_path)
    arch = json.loads((Path(model_path) / "config.json").read_text())["architectures"][0]
    return arch, {name: place.hf_shape for name, place in family(cfg.family).layout(cfg).items()}


class TunixToHF:
    """The Tunix state's leaves as HF-named host arrays, by the family's Tunix map: Tunix loads
    an HF tensor as `v.transpose(permute).reshape(shape)`; this undoes it."""

    def __init__(self, arch: str, tunix_config: Any, shapes: dict[str, tuple[int, ...]]):
        import importlib

        if arch not in TUNIX_PARAMS:
            raise ValueError(f"architecture {arch}: Tunix's name map is known for {sorted(TUNIX_PARAMS)}")
        rules = importlib.import_module(TUNIX_PARAMS[arch])._get_key_and_transform_mapping(tunix_config)
        self.by_tunix: dict[
            str, tuple[str, Any, tuple[int, ...]]
        ] = {}  # tunix key -> (HF name, transform, HF shape)
        for name, shape in shapes.items():
            key, transform = torch_utils.torch_key_to_jax_key(rules, name)
            self.by_tunix[key] = (name, transform, shape)

    def __call__(self, flat: dict[str, Any]) -> dict[str, Any]:
        """HF name -> array of each leaf of `flat` (Tunix key -> array) the map knows: a JAX
        array stays one, on its devices; anything else becomes a host array."""
        out = {}
        for key, value in flat.items():
            if key not in self.by_tunix:
                continue
            name, transform, shape = self.by_tunix[key]
            out[name] = to_hf(value if isinstance(value, jax.Array) else np.asarray(value), transform, shape)
        return out


def _xp(*arrays: Any) -> Any:
    """jnp where any of `arrays` is a JAX array (the work stays on its devices), else NumPy."""
    import jax.numpy as jnp

    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def to_hf(v: Any, transform: Any, shape: tuple[int, ...]) -> Any:
    """Undo Tunix's `v.transpose(permute).reshape(reshape)` of an HF tensor of `shape` (NumPy
    or JAX, as `v` is)."""
    xp = _xp(v)
    if transform is None:
        return xp.reshape(v, shape)
    permute, reshape = transform
    if permute:
        v = xp.reshape(v, [shape[p] for p in permute]) if reshape else v
        t = xp.transpose(v, np.argsort(permute))
        return np.ascontiguousarray(t) if xp is np else t
    return xp.reshape(v, shape)


def flat_state(state: Any) -> dict[str, Any]:
    """{"layers.0.attn.q_proj.w": array, ...} of an nnx.State (or its pure dict)."""
    tree = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
    leaves, _ = jax.tree.flatten_with_path(tree)
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): v for path, v in leaves}


def merge_lora(base: dict[str, Any], lora: dict[str, Any], to_hf: TunixToHF, alpha: float) -> dict[str, Any]:
    """The HF tensors the LoRA params change, merged: for each module whose `w_lora_a` and
    `w_lora_b` (or `kernel_lora_*`: qwix's) came, its base weight plus alpha / rank * (a @ b)
    laid out as HF's (a: [in..., rank], b: [rank, out...]); in jnp on the trainer's devices where
    the arrays are JAX ones."""
    out = {}
    for key, a in lora.items():
        if not key.endswith(LORA_SUFFIXES[0]):
            continue
        stem = key[: -len(LORA_SUFFIXES[0])]
        if stem not in to_hf.by_tunix:
            raise ValueError(f"LoRA params of {stem!r}: no HF tensor in the family's map")
        name, transform, shape = to_hf.by_tunix[stem]
        b = lora[stem + LORA_SUFFIXES[1]]
        xp = _xp(a, b, base[name])
        a, b = xp.asarray(a, np.float32), xp.asarray(b, np.float32)
        scale = alpha / a.shape[-1]
        delta = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)  # [in, out] flattened
        out[name] = (xp.asarray(base[name], np.float32) + scale * to_hf_delta(delta, transform, shape)).astype(
            base[name].dtype
        )
    return out


def to_hf_delta(delta: Any, transform: Any, shape: tuple[int, ...]) -> Any:
    """A LoRA product in the Tunix module's flattened [in, out] layout as the HF tensor's."""
    if transform is None or not transform[0]:
        return delta.reshape(shape)
    permute = transform[0]
    t = delta.reshape([shape[p] for p in permute]).transpose(np.argsort(permute))
    return np.ascontiguousarray(t) if isinstance(t, np.ndarray) else t


class RingserveRollout(base_rollout.BaseRollout):  # type: ignore[misc]
    """A Tunix rollout engine over a ringserve Engine in the trainer's process (the module
    docstring). `model_path`: the HF checkpoint served (config and tokenizer; its weights are
    replaced by the actor's); `lora_alpha`: the actor's LoRA alpha (qwix's LoraProvider's; its LoRA
    params are merged into the base weights served, scaled by alpha / rank); `engine_options`:
    ringserve's (ServerArgs' names)."""

    def __init__(self, rollout_actor: Any = None, tokenizer: Any = None, mesh: Any = None, rollout_config: Any = None,
                 *, model_path: str | Path, lora_alpha: float | None = None, **engine_options: Any) -> None:  # fmt: skip
        from ringserve.actors.frontend.engine import Engine

        self._tokenizer = tokenizer
        self._mesh = mesh
        self._config = rollout_config
        self.lora_alpha = lora_alpha
        self.model_path = str(model_path)
        arch, shapes = hf_names(model_path)
        self.to_hf = TunixToHF(arch, rollout_actor.config, shapes)
        ctx = max(2048, (rollout_config.max_prompt_length + rollout_config.max_tokens_to_generate) * 2)
        options = dict(runner_in_process=True, logprobs_mode="processed_logprobs", context_length=ctx,
                       max_running_requests=64, disable_radix_cache=True, log_level="warning")  # fmt: skip
        self.engine = Engine(self.model_path, **{**options, **engine_options})
        # With lora_alpha only (else a full copy of the model would stay in the trainer's device
        # memory between syncs): the HF tensors of the Params but the LoRA ones, which LoRA
        # merges onto, and the HF tensors served now.
        self.base: dict[str, Any] = {}
        self.served: dict[str, Any] = {}
        with jax.transfer_guard("allow"):
            self.update_params(nnx.state(rollout_actor, nnx.Param))

    # ---- Tunix's interface -------------------------------------------------------------------
    def generate(self, prompts: list[str], rollout_config: Any, **kwargs: Any) -> Any:
        cfg = rollout_config
        ids = [self._tokenize(p) for p in prompts]
        longest = max(len(x) for x in ids)
        width = cfg.max_prompt_length if cfg.max_prompt_length >= longest else 1 << (longest - 1).bit_length()
        eos = list(cfg.eos_tokens or [self.eos_id()])
        sp: dict[str, Any] = {
            "max_new_tokens": cfg.max_tokens_to_generate,
            "ignore_eos": True,
            "stop_token_ids": eos,
        }
        if cfg.top_p is None:  # Tunix's sampler: greedy when no top_p is given
            sp["temperature"] = 0.0
        else:
            sp.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k else -1)
            if cfg.seed is not None:
                sp["sampling_seed"] = _seed(cfg.seed)
        outs = self.engine.generate(input_ids=[list(map(int, x)) for x in ids], sampling_params=sp,
                                    return_logprob=bool(cfg.return_logprobs))  # fmt: skip
        tokens, logprobs = [], []
        for o in outs:
            t = list(o["output_ids"])
            lp = [e[0] for e in o["meta_info"].get("output_token_logprobs", [])]
            if t and t[-1] in eos:  # Tunix's completions stop before the EOS
                t, lp = t[:-1], lp[: len(t) - 1]
            tokens.append(np.asarray(t, np.int32))
            logprobs.append(np.asarray(lp, np.float32))
        pad = self.pad_id()
        padded = np.array([[pad] * (width - len(x)) + list(x) for x in ids], np.int32)
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens], logits=None, tokens=tokens,
            left_padded_prompt_tokens=padded, logprobs=logprobs if cfg.return_logprobs else None,
        )  # fmt: skip

    def get_per_token_logps(
        self, prompt_tokens: Any, completion_tokens: Any, completion_mask: Any = None
    ) -> Any:
        """[B, C] logprobs of each completion token after its prompt (left padding dropped), as
        the rollout policy serves them (raw: no temperature); 0 where the completion is padding."""
        import jax.numpy as jnp

        with jax.transfer_guard("allow"):
            prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        pad = self.pad_id()
        out = np.zeros(completions.shape, np.float32)
        inputs, starts = [], []
        for p, c in zip(prompts, completions, strict=True):
            p = p[np.argmax(p != pad) :] if (p != pad).any() else p[-1:]
            inputs.append([int(x) for x in (*p, *c)])
            starts.append(len(p) - 1)
        res = self.engine.generate(input_ids=inputs, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                   logprob_start_len=starts)  # fmt: skip
        for i, r in enumerate(res):
            lps = [e[0] for e in r["meta_info"]["input_token_logprobs"][1:]]
            out[i, : len(lps)] = lps
        if completion_mask is not None:
            out = out * np.asarray(completion_mask)
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: Any = None) -> None:
        """Serve the trainer's weights: every Param mapped to its HF tensor, or the LoRA params
        merged into the base ones; all or nothing (the engine must be idle, as it is between
        Tunix's steps). JAX arrays stay on the devices (the engine's device-to-device update)."""
        with jax.transfer_guard("allow"):
            flat = flat_state(params)
            lora = {k: v for k, v in flat.items() if k.endswith(LORA_SUFFIXES)}
            tensors = self.to_hf({k: v for k, v in flat.items() if k not in lora})
            if self.lora_alpha is not None:
                self.base.update(tensors)
            if lora:  # onto the base weights (never onto an earlier merge)
                if self.lora_alpha is None:
                    raise ValueError(
                        "update_params: LoRA params came; give RingserveRollout the actor's lora_alpha"
                    )
                tensors.update(merge_lora(self.base, lora, self.to_hf, self.lora_alpha))
        if not tensors:
            raise ValueError(f"update_params: none of the {len(flat)} leaves maps to a served tensor "
                             f"(e.g. {list(flat)[:3]})")  # fmt: skip
        with jax.transfer_guard("allow"):
            out = self.engine.update_weights_from_tensor(tensors)
        if not out.get("success"):
            raise RuntimeError(f"ringserve refused the weights: {out.get('message')}")
        if self.lora_alpha is not None:
            self.served.update(tensors)

    def pad_id(self) -> int:
        return int(self._tokenizer.pad_id())

    def eos_id(self) -> int:
        return int(self._tokenizer.eos_id())

    def model(self) -> Any:
        return None

    # ---- ringserve's ---------------------------------------------------------------------------
    def served_tensor(self, name: str) -> np.ndarray:
        """An HF tensor as the engine serves it now (the whole of it)."""
        rows = self.engine.get_weights_by_name(name, truncate_size=1 << 30)
        return np.asarray(rows, np.float32)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _tokenize(self, prompt: str) -> list[int]:
        """As Tunix's sampler: its tokenizer's ids with BOS first (once), when it has one."""
        ids = list(self._tokenizer.encode(prompt))
        bos = self._tokenizer.bos_id()
        return list(self._tokenizer.dedup_bos_ids([bos] + ids)) if bos is not None else ids

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown()


def _seed(seed: Any) -> int:
    """A ringserve sampling seed from Tunix's (an int, or a PRNG key: its key data)."""
    if isinstance(seed, int):
        return seed % (1 << 63)
    data = np.asarray(
        jax.random.key_data(seed) if jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key) else seed
    )
    return int(
        np.bitwise_xor.reduce(data.astype(np.uint64).ravel() * np.uint64(0x9E3779B97F4A7C15)) % (1 << 63)
    )
