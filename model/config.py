"""A model's configuration: one frozen dataclass of what every decoder family has, read from an
HF `config.json` by its family (model/families/: `read_config`, `parse_config`), which adds what
is its own. The helpers here read the shared fields.

Accepts both the transformers 4 spelling (`rope_theta` + `rope_scaling`) and transformers 5's
`rope_parameters`. Every error names the file and the field so a user can fix it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    family: str  # the family's name (model/families/): it builds the module tree
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2 always; Llama where config.json asks)
    sliding_window: int | None = None  # keys a query sees (Mistral); None = full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # dtype the checkpoint was saved in
    # mixture of experts (model/layers/moe.py; 0 experts: dense MLPs). Every layer's MLP is sparse
    # where num_experts > 0 (a family refuses a config.json mixing dense layers in)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # the top-k probabilities renormalized to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The decoder layers whose MLP is a mixture of experts (model/layers/moe.py), in order:
        the layers whose routed expert ids `Decoder.__call__(routed=True)` returns."""
        return tuple(range(self.num_layers)) if self.num_experts else ()


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with llama3 / linear scaling applied.

    Computed in float32 the way transformers does, so positions in the thousands rotate by the
    same angles as the reference to the last bit that matters."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(rope.theta), exponent)).astype(np.float32)
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_from_dict(d: dict[str, Any], source: str) -> RopeConfig:
    """RoPE from transformers 5 `rope_parameters` or transformers 4 `rope_theta` + `rope_scaling`."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(d.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: unsupported rope type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def shared_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields of ModelConfig every decoder family reads the same way (all but `family` and
    each family's own), from a config.json dict; ValueError naming a missing or bad field."""

    def need(key: str) -> Any:
        if key not in d or d[key] is None:
            raise ValueError(f"{source}: missing required field {key!r}")
        return d[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(d.get("num_key_value_heads") or heads)
    head_dim = int(d.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    eos = d.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    return dict(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=rope_from_dict(d, source),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
    )


# What a weight update from another checkpoint may not change (model/runtime/weight_sync.py): the fields
# that are not the architecture's.
NOT_ARCHITECTURE = ("bos_token_id", "eos_token_ids", "dtype", "max_position_embeddings")
