"""A tiny random LoRA adapter in PEFT's format for a checkpoint (tests, benchmarks), made offline.

Writes `adapter_config.json` and `adapter_model.safetensors` the way PEFT's `save_pretrained`
does (tensor names `base_model.model.model.layers.{l}.{self_attn|mlp}.{module}.lora_{A|B}.weight`),
so PEFT loads it onto the base model and ringserve reads it (model/checkpoints/peft.py).
Same arguments and seed -> same bytes.

Trained adapters start with B = 0; a random one needs both factors non-zero to change anything.
A has std 1/sqrt(in) and B std `gain`/sqrt(r), so with lora_alpha = r (scale 1) each targeted
projection's output moves by about `gain` times its own size: enough that the greedy tokens
differ from the base model's within a few steps, not so much that the model only repeats.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ringserve.model.checkpoints.peft import TARGET_MODULES, module_block, module_dims
from ringserve.model.families import read_config
from ringserve.model.paths import atomic_dir


def make_tiny_lora(out_dir: str | Path, base_dir: str | Path, rank: int = 8, seed: int = 0,
                   target_modules: tuple[str, ...] = TARGET_MODULES, alpha: float | None = None,
                   gain: float = 0.5, use_rslora: bool = False) -> Path:  # fmt: skip
    """Write a random rank-`rank` adapter of the checkpoint at `base_dir` into `out_dir`
    (atomically) and return it. `alpha` defaults to `rank` (scale 1)."""
    from safetensors.numpy import save_file

    cfg = read_config(base_dir)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(cfg.num_layers):
        for mod in TARGET_MODULES:
            if mod not in target_modules:
                continue
            n_in, n_out = module_dims(cfg, mod)
            block = module_block(cfg, mod)
            base = f"base_model.model.model.layers.{layer}.{block}.{mod}"
            tensors[f"{base}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{base}.lora_B.weight"] = (gain * rng.standard_normal((n_out, rank)) / np.sqrt(rank)).astype(np.float32)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir),
        "r": rank, "lora_alpha": float(rank if alpha is None else alpha), "lora_dropout": 0.0,
        "target_modules": [m for m in TARGET_MODULES if m in target_modules], "bias": "none",
        "use_rslora": use_rslora, "fan_in_fan_out": False, "inference_mode": True,
    }  # fmt: skip
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
