"""LoRA adapters in PEFT's format, read and checked on the host (NumPy, no JAX).

An adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
optionally `use_rslora`) and `adapter_model.safetensors`, whose tensors are named

    base_model.model.model.layers.{l}.self_attn.{q,k,v,o}_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{l}.mlp.{gate,up,down}_proj.lora_B.weight    [out, r]

A target module's output becomes `W x + scale * B (A x)`, scale = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). `read_adapter` returns every targeted module's A and B for every layer,
padded with zeros to the server's `max_lora_rank` and laid out for the pool (model/weights/lora.py):

    a[module]  [L, max_rank, in]    rows r.. are zero
    b[module]  [L, max_rank, out]   B transposed; rows r.. are zero

so the product of the padded pair is the adapter's own. A layer a module's tensors leave out
(PEFT's `layers_to_transform`) gets zeros. Anything the served model or the server's LoRA
shapes cannot hold is a `ValueError` naming the adapter, the tensor or field, and the limit:
a rank above max_lora_rank, a module the server does not target, an unknown tensor, a shape
other than the model's, DoRA, trained biases, `modules_to_save`, per-module rank or alpha
patterns. Nothing is half-read: the caller gets a whole adapter or an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from ringserve.model.checkpoints.load import read_safetensors
from ringserve.model.config import ModelConfig
from ringserve.model.families import family

# every projection some family's adapters may train (a family names its own: Family.lora_modules)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def module_dims(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a target module of the served model (its family's layout)."""
    return family(cfg.family).module_dims(cfg, module)[1:]


def module_block(cfg: ModelConfig, module: str) -> str:
    """The layer's submodule holding `module` ("self_attn", "mlp"), as PEFT's tensor names say."""
    return family(cfg.family).module_dims(cfg, module)[0]


def parse_target_modules(value: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The server's LoRA targets (`lora_target_modules`): names of TARGET_MODULES, or "all"."""
    names = list(value)
    if names == ["all"] or names == ["all-linear"]:
        return TARGET_MODULES
    bad = [n for n in names if n not in TARGET_MODULES]
    if not names or bad:
        raise ValueError(f"lora_target_modules={names!r}: choose among {list(TARGET_MODULES)} or 'all'")
    return tuple(n for n in TARGET_MODULES if n in names)  # the model's order, once each


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter, padded to the pool's rank (see the module docstring)."""

    path: str
    rank: int  # the adapter's own r
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    a: dict[str, np.ndarray]  # module -> [L, max_rank, in] float32
    b: dict[str, np.ndarray]  # module -> [L, max_rank, out] float32 (B transposed)


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int, targets: tuple[str, ...]) -> Adapter:
    """The PEFT adapter at `path` for the served model `cfg`, every module of `targets` (zeros
    for those the adapter does not train), padded to `max_rank`. ValueError naming what is wrong."""
    p = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    if not p.is_dir():
        raise ValueError(f"{where}: no such directory")
    conf_path = p / "adapter_config.json"
    if not conf_path.is_file():
        raise ValueError(f"{where}: no adapter_config.json")
    try:
        conf = json.loads(conf_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: adapter_config.json is not JSON ({e})") from None
    if not isinstance(conf, dict):
        raise ValueError(f"{where}: adapter_config.json is not a JSON object")
    peft_type = conf.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type={peft_type!r}; only LORA adapters are served")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r={r!r} must be an integer >= 1")
    if r > max_rank:
        raise ValueError(f"{where}: rank r={r} exceeds the server's max_lora_rank={max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise ValueError(f"{where}: lora_alpha={alpha!r} must be a number > 0")
    for field, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("rank_pattern", "per-module ranks"),
                       ("alpha_pattern", "per-module alphas"), ("layer_replication", "layer replication")):  # fmt: skip
        if conf.get(field):
            raise ValueError(f"{where}: {field}={conf[field]!r}: {why} is not supported")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={conf['bias']!r}: trained biases are not supported (bias must be 'none')")
    wanted = conf.get("target_modules")
    if isinstance(wanted, str):
        wanted = list(TARGET_MODULES) if wanted == "all-linear" else [wanted]
    if not isinstance(wanted, list) or not wanted:
        raise ValueError(f"{where}: target_modules={wanted!r} must name the modules the adapter trains")
    served = family(cfg.family).lora_modules
    for mod in wanted:
        if mod not in served:
            moe = " (a mixture-of-experts model's MLP is its experts: they take no adapters)" if cfg.num_experts else ""
            raise ValueError(f"{where}: target module {mod!r} is unknown; LoRA serves {list(served)} of a {cfg.family} "
                             f"model{moe}")  # fmt: skip
        if mod not in targets:
            raise ValueError(f"{where}: target module {mod!r} is not among the server's lora_target_modules {list(targets)}")
    weights = p / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{where}: no adapter_model.safetensors (only the safetensors format is read)")
    L = cfg.num_layers
    a = {mod: np.zeros((L, max_rank, module_dims(cfg, mod)[0]), np.float32) for mod in targets}
    b = {mod: np.zeros((L, max_rank, module_dims(cfg, mod)[1]), np.float32) for mod in targets}
    seen: set[tuple[int, str, str]] = set()
    for name, t in read_safetensors(weights):
        m = _NAME.match(name)
        if m is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA A/B weight of a decoder layer's projection")
        layer, block, mod, ab = int(m[1]), m[2], m[3], m[4]
        if mod not in served or module_block(cfg, mod) != block:
            raise ValueError(f"{where}: tensor {name!r}: {block}.{mod} is not a module LoRA serves")
        if mod not in wanted:
            raise ValueError(f"{where}: tensor {name!r}: module {mod!r} is not in its target_modules {wanted}")
        if layer >= L:
            raise ValueError(f"{where}: tensor {name!r}: layer {layer}, the served model has {L}")
        n_in, n_out = module_dims(cfg, mod)
        want = (r, n_in) if ab == "A" else (n_out, r)
        if tuple(t.shape) != want:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {want} "
                             f"(r={r}, the served model's {mod} is {n_in} -> {n_out})")  # fmt: skip
        if not np.issubdtype(t.dtype, np.floating) and t.dtype.name != "bfloat16":
            raise ValueError(f"{where}: tensor {name!r} has dtype {t.dtype.name}; LoRA weights are floating point")
        if ab == "A":
            a[mod][layer, :r] = np.asarray(t, np.float32)
        else:
            b[mod][layer, :r] = np.asarray(t, np.float32).T
        seen.add((layer, mod, ab))
    for layer, mod, ab in seen:
        if (layer, mod, "B" if ab == "A" else "A") not in seen:
            other = "lora_B" if ab == "A" else "lora_A"
            raise ValueError(f"{where}: layer {layer} {mod} has lora_{ab} but no {other}")
    if not seen:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    return Adapter(str(path), r, float(scale), a, b)
