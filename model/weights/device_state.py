"""The served state built on the device, for a weight update from JAX arrays already in the
engine's process (a trainer's, `runner_in_process`: model/runtime/weight_sync.py `load_local`).

The walk is `build_host_state`'s (model/weights/state.py) over the same family `layout`: each HF
tensor transposed where its Placement says, cast to the serving dtype, layers stacked into
[L, ...] when they scan, int8 quantized as model/weights/quant.py does (from the HF layout, the
scale over its last axis) — written in jnp and jitted once with `out_shardings` = the served
state's, so every leaf lands on its own sharding and the result fits the compiled programs.

    HF-named arrays: a trainer's, on any of this process's devices and any sharding
      │ `onto`: on the engine's devices, device to device (never through the host):
      │   same devices, same order              as they are (the jit reshards them)
      │   a NamedSharding over as many devices  shard i copied onto the engine's device i
      │   anything else                         gathered on its own devices, then copied whole
      │ (host arrays: the served ones a partial update keeps, put on the leaf's sharding)
      ▼
    the jitted walk (out_shardings: the served state's) ──► the new state, as `place` gives it

Why the routes: `jax.device_put` across device sets with another split falls back to a host
round trip (the whole array read back, `ArrayImpl._value`); a copy shard for shard, or of a
whole array, stays device to device. The build runs under
`jax.transfer_guard_device_to_host("disallow")`, so on an accelerator a route that would pass
through the host is refused, naming the tensor, instead of silently costing a round trip (on CPU
the guard sees no transfer: device memory is the host's; tests/model/test_device_state.py
counts the reads back instead).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ringserve.model.config import ModelConfig
from ringserve.model.families.base import Family, Placement
from ringserve.model.weights.quant import quantize_int8_jnp
from ringserve.model.weights.state import Tree, checked_layout


class DeviceStateBuilder:
    """`builder(tensors)` -> the state of `avals` (the executor's `params_avals`: structure,
    shapes, dtypes, shardings) from HF-named arrays; the same checks and errors as
    `build_host_state` (a missing or misshapen tensor: ValueError naming it). One jitted walk,
    compiled once per set of input shardings (a trainer's stay the same from step to step)."""

    def __init__(
        self, family: Family, cfg: ModelConfig, dtype: Any, stacked: bool, quant: str | None, avals: Tree
    ):
        self.family, self.cfg, self.stacked = family, cfg, stacked
        self.dtype, self.quant = jnp.dtype(dtype), quant
        self.layout = family.layout(cfg)
        self.avals = avals
        self.mesh: Mesh = jax.tree_util.tree_leaves(avals)[0].sharding.mesh
        self._walk = jax.jit(self._state, out_shardings=jax.tree.map(lambda a: a.sharding, avals))

    def __call__(self, tensors: dict[str, Any]) -> Tree:
        layout = checked_layout(self.family, self.cfg, tensors)
        inputs = {}
        with jax.transfer_guard_device_to_host("disallow"):
            for name, place in layout.items():
                try:
                    inputs[name] = onto(tensors[name], self.mesh, self._hf_sharding(place))
                except RuntimeError as e:  # the transfer guard (or a failed copy)
                    raise ValueError(f"tensor {name!r}: cannot reach the engine's devices device to device "
                                     f"({type(e).__name__}: {e})") from None  # fmt: skip
            return self._walk(inputs, np.float32(127))

    def _quantized(self, place: Placement) -> bool:
        *parents, key = place.path
        return bool(self.quant) and key == "weight" and bool(parents) and parents[-1] in self.family.quantized

    def _hf_sharding(self, place: Placement) -> NamedSharding:
        """The sharding of the served leaf `place` lands in, in the HF tensor's layout: where a
        host array (a served tensor a partial update keeps) goes first, each device its part."""
        leaf: Any = self.avals
        for k in place.state_path(self.stacked):
            leaf = leaf[k]
        spec = (*leaf.sharding.spec, *(None,) * (len(leaf.shape) - len(leaf.sharding.spec)))
        if place.layer is not None and self.stacked:
            spec = spec[1:]  # the layer axis (never split)
        if place.expert is not None:
            spec = spec[1:]  # the expert axis (one expert's tensor)
        if place.transpose and not self._quantized(place):  # (int8 is kept in the HF layout)
            spec = spec[::-1]
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def _state(self, inputs: dict[str, jax.Array], qmax: jax.Array) -> Tree:
        """The walk, traced: `build_host_state`'s values, in jnp."""
        tree: Tree = {}
        stacks: dict[tuple[Any, ...], dict[int, jax.Array]] = {}
        experts: dict[tuple[Any, ...], dict[int, jax.Array]] = {}  # (leaf path, layer) -> expert -> tensor
        for name, place in self.layout.items():
            *parents, key = place.path
            src = inputs[name]
            if self._quantized(place):
                q, scale = quantize_int8_jnp(src, self.dtype, qmax)
                leaves = {"weight": q, "scale": scale}
            else:
                leaves = {key: (src.T if place.transpose else src).astype(self.dtype)}
            for k, a in leaves.items():
                path = (*parents, k)
                if place.expert is not None:
                    experts.setdefault((path, place.layer), {})[place.expert] = a
                elif place.layer is None:
                    _put(tree, path, a)
                elif self.stacked:
                    stacks.setdefault(path, {})[place.layer] = a
                else:
                    _put(tree, (path[0], place.layer, *path[1:]), a)
        for (path, layer), per_expert in experts.items():  # a layer's experts: one [E, ...] leaf
            whole = jnp.stack([per_expert[e] for e in range(len(per_expert))])
            if self.stacked:
                stacks.setdefault(path, {})[layer] = whole
            else:
                _put(tree, (path[0], layer, *path[1:]), whole)
        for path, per_layer in stacks.items():
            _put(tree, path, jnp.stack([per_layer[layer] for layer in range(self.cfg.num_layers)]))
        return tree


def _put(tree: Tree, path: tuple[Any, ...], a: Any) -> None:
    *parents, key = path
    node = tree
    for k in parents:
        node = node.setdefault(k, {})
    node[key] = a


def onto(a: Any, mesh: Mesh, host_sharding: NamedSharding) -> jax.Array:
    """`a` on `mesh`'s devices (the routes in the module's docstring); a host array goes onto
    `host_sharding`."""
    if not isinstance(a, jax.Array):
        return jax.device_put(np.asarray(a), host_sharding)
    ours = tuple(mesh.devices.flat)
    src = a.sharding
    if isinstance(src, NamedSharding):
        if tuple(src.mesh.devices.flat) == ours:
            return a
        if src.mesh.size == len(ours):  # the same split over our devices: per-shard copies
            same = Mesh(
                np.array(ours).reshape(src.mesh.devices.shape),
                src.mesh.axis_names,
                axis_types=src.mesh.axis_types,
            )
            return jax.device_put(a, NamedSharding(same, src.spec))
        if not src.is_fully_replicated:  # whole on each of its devices first (their collectives)
            a = jax.jit(lambda x: x, out_shardings=NamedSharding(src.mesh, PartitionSpec()))(a)
    elif len(src.device_set) == 1 and len(ours) == 1 and src.device_set == set(ours):
        return a
    # whole (replicated, or one device's) onto every one of ours: device-to-device copies
    return jax.device_put(a, NamedSharding(mesh, PartitionSpec()))
