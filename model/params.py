"""The parameter tree: every decoder layer's weights stacked along a leading layer axis.

    params = {
      "embed":      [V, H]                     token embedding (tied checkpoints: also the LM head)
      "final_norm": [H]
      "lm_head":    [H, V]                     only when the checkpoint does not tie embeddings
      "layers": {                              each [L, ...]: index l is decoder layer l
        "attn_norm": [L, H]      "mlp_norm": [L, H]
        "wq": [L, H, Hq*D]   "wk": [L, H, Hkv*D]   "wv": [L, H, Hkv*D]   "wo": [L, Hq*D, H]
        "bq": [L, Hq*D]      "bk": [L, Hkv*D]      "bv": [L, Hkv*D]           (qkv_bias only)
        "q_norm": [L, D]     "k_norm": [L, D]                                (qk_norm only)
        "w_gate": [L, H, I]  "w_up": [L, H, I]     "w_down": [L, I, H]
      }
    }

Linear weights are `[in, out]` (the transpose of HF's `[out, in]`), so every projection is
`x @ w`. The stacked layout lets the forward run the layers under one `jax.lax.scan` (one
layer body to compile) and passes a dozen buffers per step instead of ~10 per layer. On CPU
the executor unstacks it (`unstack_layers`: "layers" becomes a list of per-layer dicts of the
same names, each [...] without the L axis), since XLA:CPU copies a scanned layer's slice.

`hf_layout(cfg)` is THE map from HF tensor names to tree positions: loading uses it, and a
weight update by HF name places one tensor with `to_tree_layout` at `Placement.path` (and at
`Placement.layer` along the layer axis) without touching the compiled programs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from model.checkpoints.config import ModelConfig

Tree = dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one HF tensor lives in the parameter tree."""

    path: tuple[str, ...]  # keys from the root, e.g. ("layers", "wq")
    layer: int | None  # index along the stacked layer axis; None for unstacked leaves
    transpose: bool  # HF [out, in] -> ours [in, out]
    hf_shape: tuple[int, ...]  # the shape the checkpoint must have (from config.json)


def hf_layout(cfg: ModelConfig) -> dict[str, Placement]:
    """HF tensor name -> Placement, for every tensor the model needs."""
    h, d, v, i = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size
    out = {
        "model.embed_tokens.weight": Placement(("embed",), None, False, (v, h)),
        "model.norm.weight": Placement(("final_norm",), None, False, (h,)),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = Placement(("lm_head",), None, True, (v, h))
    per_layer = {
        "input_layernorm.weight": ("attn_norm", False, (h,)),
        "post_attention_layernorm.weight": ("mlp_norm", False, (h,)),
        "self_attn.q_proj.weight": ("wq", True, (cfg.q_size, h)),
        "self_attn.k_proj.weight": ("wk", True, (cfg.kv_size, h)),
        "self_attn.v_proj.weight": ("wv", True, (cfg.kv_size, h)),
        "self_attn.o_proj.weight": ("wo", True, (h, cfg.q_size)),
        "mlp.gate_proj.weight": ("w_gate", True, (i, h)),
        "mlp.up_proj.weight": ("w_up", True, (i, h)),
        "mlp.down_proj.weight": ("w_down", True, (h, i)),
    }
    if cfg.qkv_bias:
        per_layer |= {
            "self_attn.q_proj.bias": ("bq", False, (cfg.q_size,)),
            "self_attn.k_proj.bias": ("bk", False, (cfg.kv_size,)),
            "self_attn.v_proj.bias": ("bv", False, (cfg.kv_size,)),
        }
    if cfg.qk_norm:
        per_layer |= {
            "self_attn.q_norm.weight": ("q_norm", False, (d,)),
            "self_attn.k_norm.weight": ("k_norm", False, (d,)),
        }
    for layer in range(cfg.num_layers):
        for suffix, (key, transpose, shape) in per_layer.items():
            out[f"model.layers.{layer}.{suffix}"] = Placement(("layers", key), layer, transpose, shape)
    return out


def to_tree_layout(place: Placement, a: np.ndarray, dtype) -> np.ndarray:
    """One HF tensor as its tree slot holds it: transposed to [in, out] if a projection, cast."""
    a = np.asarray(a)
    return np.ascontiguousarray((a.T if place.transpose else a).astype(dtype))


def build_host_tree(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype) -> Tree:
    """The parameter tree as host (NumPy) arrays. Raises ValueError naming a missing tensor or
    one whose shape disagrees with config.json."""
    layout = hf_layout(cfg)
    missing = [n for n in layout if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name, place in layout.items():
        shape = tuple(np.shape(tensors[name]))
        if shape != place.hf_shape:
            raise ValueError(f"tensor {name!r} has shape {shape}, but config.json implies {place.hf_shape}")
    tree: Tree = {"layers": {}}
    for name, place in layout.items():
        a = to_tree_layout(place, tensors[name], dtype)
        if place.layer is None:
            tree[place.path[0]] = a
            continue
        stacked = tree["layers"].get(place.path[1])
        if stacked is None:
            stacked = tree["layers"][place.path[1]] = np.empty((cfg.num_layers, *a.shape), a.dtype)
        stacked[place.layer] = a
    return tree


def unstack_layers(tree: Tree) -> Tree:
    """The tree with `layers` as a list of per-layer dicts (views of the stacked arrays), for a
    forward that runs its layers unrolled (model/executor.py: resolve_layer_loop)."""
    stacked = tree["layers"]
    n = len(next(iter(stacked.values())))
    return {**tree, "layers": [{k: v[i] for k, v in stacked.items()} for i in range(n)]}


def leaf_at(tree: Tree, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree
