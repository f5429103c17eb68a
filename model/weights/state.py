"""The model's state: the `nnx.Param`s of the family's Decoder (model/layers/decoder.py) as a pure
dict of arrays, keyed by module attribute the way `nnx.split` lays them out (HF's names, less the
"model." prefix). Two layouts of the layers (the compute plan's `layer_loop`, model/compute/plan.py);
the Llama lineage's (model/layers/block.py PreNormBlock):

    params = {
      "embed_tokens": {"weight": [V, H]}         token embedding (tied checkpoints: also the LM head)
      "norm":         {"weight": [H]}
      "lm_head":      {"weight": [H, V]}         only when the checkpoint does not tie embeddings
      "layers": {                                "unrolled": {0: layer, 1: layer, ...}, each as below
                                                 "scan": one layer, every leaf [L, ...] (index l: layer l)
        "input_layernorm":          {"weight": [H]}
        "self_attn": {
          "q_proj": {"weight": [H, Hq*D], "bias": [Hq*D]}      bias: attention_bias only
          "k_proj": {"weight": [H, Hkv*D], "bias": [Hkv*D]}
          "v_proj": {"weight": [H, Hkv*D], "bias": [Hkv*D]}
          "o_proj": {"weight": [Hq*D, H]}
          "q_norm": {"weight": [D]}   "k_norm": {"weight": [D]}  Qwen3 only
        }
        "post_attention_layernorm": {"weight": [H]}
        "mlp": {"gate_proj": {"weight": [H, I]}, "up_proj": {"weight": [H, I]}, "down_proj": {"weight": [I, H]}}
      }
    }

Linear weights are `[in, out]` (the transpose of HF's `[out, in]`), so every projection is
`x @ w`. The stacked layout lets the forward run the layers under one `jax.lax.scan` (one
layer body to compile) and passes a dozen buffers per step instead of ~10 per layer; on CPU
with XLA's dot alone, where a scanned layer's slice is a copy, each layer's weights are buffers
of their own (ringserve's kernel and oneDNN's call read a layer in place from the stack).
Weight-only int8 (model/weights/quant.py) holds the family's `quantized` modules as int8 weights
with a f32 `scale` leaf beside each.

The family's `layout` (model/families/base.py) is THE map from HF tensor names to places in the
state: loading uses it (`build_host_state`), and so does a weight update by HF name
(model/runtime/weight_sync.py), which builds a whole new state the same way; the compiled programs take
the state as an argument, so nothing recompiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ringserve.model.config import ModelConfig
from ringserve.model.families.base import Family, Placement
from ringserve.model.weights.memory import scratch
from ringserve.model.weights.quant import out_in, quant_axis, quant_transposed, quantize_int8

Tree = dict[Any, Any]


def checked_layout(family: Family, cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, Placement]:
    """The family's layout of `cfg`, once every tensor it names is in `tensors` with the shape
    config.json implies; otherwise a ValueError naming the first missing or misshapen one."""
    layout = family.layout(cfg)
    missing = [n for n in layout if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name, place in layout.items():
        shape = tuple(np.shape(tensors[name]))
        if shape != place.hf_shape:
            raise ValueError(f"tensor {name!r} has shape {shape}, but config.json implies {place.hf_shape}")
    return layout


class LazyLeaf:
    """A leaf of the state that is read only where asked: `leaf[idx]` (a tuple of slices in the
    state's layout, as `jax.make_array_from_callback` asks for one device's shard) reads just
    that part of its HF tensor(s) and casts it. Over memory-mapped safetensors (model/checkpoints/
    weights.py) a host so reads only the pages of its own devices' shards."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, read: Callable[[tuple[slice, ...]], np.ndarray]):
        self.shape, self.dtype, self._read = shape, np.dtype(dtype), read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, idx: Any) -> np.ndarray:
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (self.ndim - len(idx))
        return self._read(idx)


def _read_one(place: Placement, a: np.ndarray, idx: tuple[slice, ...], dtype) -> np.ndarray:
    """Slice `idx` (our layout) of HF tensor `a`: a projection's [in, out] slice is the
    transpose of HF's [out, in] one."""
    src = a[idx[1], idx[0]].T if place.transpose else a[idx]
    return np.ascontiguousarray(np.asarray(src).astype(dtype))


def build_lazy_state(family: Family, cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype, stacked: bool,
                     quant: str | None = None) -> Tree:  # fmt: skip
    """`build_host_state`'s tree (the same structure, shapes and dtypes) of LazyLeafs: nothing is
    read until a shard is asked for (many hosts: each places only its own devices' shards,
    model/compute/mesh.py place_host_array). Same checks, same errors."""
    layout = checked_layout(family, cfg, tensors)
    dtype = np.dtype(dtype)
    tree: Tree = {}
    stacks: dict[tuple[str, ...], list[tuple[Placement, np.ndarray]]] = {}
    experts: dict[tuple[Any, ...], list[tuple[Placement, np.ndarray]]] = {}  # one leaf's experts, in order
    for name, place in layout.items():
        shape = place.hf_shape[::-1] if place.transpose else place.hf_shape
        if place.expert is not None:
            experts.setdefault(place.state_path(stacked), []).append((place, tensors[name]))
            continue
        if place.layer is not None and stacked:
            stacks.setdefault(place.path, []).append((place, tensors[name]))
            continue
        path = place.state_path(stacked=False)

        def read_one(idx: tuple[slice, ...], p: Placement = place, a: np.ndarray = tensors[name]) -> np.ndarray:
            return _read_one(p, a, idx, dtype)

        leaf = LazyLeaf(shape, dtype, read_one)
        *parents, key = path
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[key] = leaf
    for path, per_layer in stacks.items():
        place0 = per_layer[0][0]
        shape = (len(per_layer), *(place0.hf_shape[::-1] if place0.transpose else place0.hf_shape))

        def read(idx: tuple[slice, ...], per_layer=per_layer) -> np.ndarray:
            return np.stack([_read_one(p, a, idx[1:], dtype) for p, a in per_layer[idx[0]]])

        *parents, key = path
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[key] = LazyLeaf(shape, dtype, read)
    for path, items in experts.items():
        p0 = items[0][0]
        e = p0.experts
        grid = [items[i : i + e] for i in range(0, len(items), e)]  # [layers][experts] (stacked), else one row
        shape = (*((len(grid),) if stacked else ()), e, *(p0.hf_shape[::-1] if p0.transpose else p0.hf_shape))

        def read_experts(idx: tuple[slice, ...], grid=grid) -> np.ndarray:
            if stacked:
                return np.stack([np.stack([_read_one(p, a, idx[2:], dtype) for p, a in row[idx[1]]]) for row in grid[idx[0]]])
            return np.stack([_read_one(p, a, idx[1:], dtype) for p, a in grid[0][idx[0]]])

        *parents, key = path
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[key] = LazyLeaf(shape, dtype, read_experts)
    if quant:
        _quantize_lazy(tree, family.quantized)
    return tree


def _quantize_lazy(tree: Tree, quantized: frozenset[str]) -> None:
    """Every quantized module's float `weight` LazyLeaf -> int8 `weight` + `scale` LazyLeafs, in
    place (`build_host_state`'s values): a shard of the int8 weight or of its scale reads the whole
    reduced axis of the float slice it covers (a row-parallel shard splits a column's inputs;
    its scale is the whole column's), quantizes, and keeps its own part."""
    for key, node in tree.items():
        if not isinstance(node, dict):
            continue
        if key not in quantized or "weight" not in node:
            _quantize_lazy(node, quantized)
            continue
        src: LazyLeaf = node["weight"]
        axis = src.ndim + quant_axis(key)
        t = quant_transposed(key)

        def read_q(idx: tuple[slice, ...], src=src, axis=axis, t=t) -> np.ndarray:
            if t:  # a slice of the [.., out, in] int8 weight is the swapped slice of the float one
                idx = (*idx[:-2], idx[-1], idx[-2])
            whole = idx[:axis] + (slice(None),) + idx[axis + 1 :]
            q = quantize_int8(src[whole], axis)[0][(slice(None),) * axis + (idx[axis],)]
            return out_in(q) if t else q

        def read_scale(idx: tuple[slice, ...], src=src, axis=axis) -> np.ndarray:
            return quantize_int8(src[idx[:axis] + (slice(None),) + idx[axis:]], axis)[1]

        shape = (*src.shape[:-2], src.shape[-1], src.shape[-2]) if t else src.shape
        node["weight"] = LazyLeaf(shape, np.int8, read_q)
        node["scale"] = LazyLeaf(src.shape[:axis] + src.shape[axis + 1 :], np.float32, read_scale)


def build_host_state(family: Family, cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype, stacked: bool,
                     quant: str | None = None) -> Tree:  # fmt: skip
    """The state as host (NumPy) arrays, layers stacked or per layer; `quant="int8"`: quantized
    (see the module's docstring). Raises ValueError naming a missing tensor or one whose shape
    disagrees with config.json.

    One pass over each tensor: read (from the memory-mapped checkpoint), transposed and cast
    straight into its place in the state (a fresh [L, ...] stack per name). A quantized weight
    is stored as HF holds it (`[out, in]`, the embedding `[V, H]`, scales over the last axis), so
    it is quantized from the checkpoint's own layout: the same values as quantizing our `[in,
    out]` copy, without the two transposes. (Three copies a tensor before: a warm start's weight
    build was 0.7-1.0 s for SmolLM2 f32 and 2.4 s for int8.) The large arrays are
    model/weights/memory.py `scratch`'s."""
    layout = checked_layout(family, cfg, tensors)
    dtype = np.dtype(dtype)
    tree: Tree = {}

    def put(node: Tree, key: str, place: Placement, a: np.ndarray, dt) -> None:
        # a layer's tensor is index `layer` of an [L, ...] stack; an expert's, [L, E, ...]
        lead = (() if place.layer is None else (cfg.num_layers,)) + (() if place.expert is None else (place.experts,))
        if key not in node:
            node[key] = scratch((*lead, *a.shape), dt)
        at = tuple(i for i in (place.layer, place.expert) if i is not None)
        np.copyto(node[key][at], a, casting="unsafe")

    for name, place in layout.items():
        *parents, key = place.path
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        src = np.asarray(tensors[name])
        if quant and key == "weight" and parents and parents[-1] in family.quantized:
            q, scale = quantize_int8(src, -1, dtype)
            put(node, "weight", place, q, np.int8)
            put(node, "scale", place, scale, np.float32)
        else:
            put(node, key, place, src.T if place.transpose else src, dtype)
    if not stacked:
        # per layer as views of the stacked arrays: one host allocation per weight name. Freed
        # per-layer arrays of a few MB stay in the process's heap (SmolLM2: 311 MB more RSS
        # after loading, measured); one large array per name goes back to the OS.
        tree["layers"] = {layer: _layer_view(tree["layers"], layer) for layer in range(cfg.num_layers)}
    return tree


def _layer_view(node: Tree, layer: int) -> Tree:
    return {k: _layer_view(v, layer) if isinstance(v, dict) else v[layer] for k, v in node.items()}
