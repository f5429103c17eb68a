"""Device mesh and the tensor-parallel sharding of parameters and KV cache.

One mesh axis, `tp`, with Auto axis type (a default `jax.make_mesh` has Explicit axes, under
which a plain jit of sharded matmuls fails to type-check). Megatron-style layout:

    q/k/v, gate/up   [in, out]  column-parallel  P(None, "tp")   (by heads for q/k/v)
    o, down          [in, out]  row-parallel     P("tp", None)
    lm_head          [H, V]     vocab-parallel   P(None, "tp")
    embed, norms                replicated
    KV cache         [KV, slots, D]              P("tp", None, None)

A dimension that `tp` does not divide (e.g. 2 KV heads on 4 devices) stays replicated: the
program is still correct, XLA just does that part redundantly.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from model.checkpoints.config import ModelConfig


def make_mesh(tp_size: int) -> Mesh:
    devices = jax.devices()
    if tp_size < 1 or tp_size > len(devices):
        raise ValueError(
            f"tp_size={tp_size} but {len(devices)} {devices[0].platform} device(s) are visible "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    return Mesh(np.array(devices[:tp_size]), ("tp",), axis_types=(AxisType.Auto,))


def param_spec(path: tuple, shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> PartitionSpec:
    """PartitionSpec of one parameter, from its path in the CausalLM module tree."""
    names = [str(p) for p in path if str(p) != "value"]  # nnx.Param leaves end in ".value"
    leaf_owner = names[-2] if len(names) >= 2 else ""

    def split(dim: int) -> PartitionSpec:
        if tp == 1 or shape[dim] % tp:
            return PartitionSpec()
        return PartitionSpec(*[("tp" if i == dim else None) for i in range(len(shape))])

    heads_ok = {"q": cfg.num_heads % tp == 0, "k": cfg.num_kv_heads % tp == 0, "v": cfg.num_kv_heads % tp == 0}
    if leaf_owner in heads_ok:
        return split(len(shape) - 1) if heads_ok[leaf_owner] else PartitionSpec()
    if leaf_owner in ("gate", "up"):
        return split(len(shape) - 1)
    if leaf_owner in ("o", "down") and names[-1] == "w":
        return split(0)
    if names[-1] == "lm_head" or leaf_owner == "lm_head":
        return split(1)
    return PartitionSpec()


def kv_sharding(mesh: Mesh, cfg: ModelConfig) -> NamedSharding:
    tp = mesh.shape["tp"]
    spec = PartitionSpec("tp", None, None) if cfg.num_kv_heads % tp == 0 else PartitionSpec()
    return NamedSharding(mesh, spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
