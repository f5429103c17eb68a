"""Device mesh and the tensor-parallel sharding of parameters (the KV cache's is its backend's).

One mesh axis, `tp`, with Auto axis type (a default `jax.make_mesh` has Explicit axes, under
which a plain jit of sharded matmuls fails to type-check). Megatron-style layout over the
stacked parameter tree (model/params.py; the leading L axis is never split):

    wq/wk/wv, w_gate/w_up  [L, in, out]  column-parallel  P(None, None, "tp")  (q/k/v by heads)
    bq/bk/bv               [L, out]                       P(None, "tp")
    wo, w_down             [L, in, out]  row-parallel     P(None, "tp", None)
    lm_head                [H, V]        vocab-parallel   P(None, "tp")
    embed, norms                         replicated
    KV cache               split by KV head (model/attention/base.py)

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


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> PartitionSpec:
    """PartitionSpec of one leaf of the parameter tree, from its path (e.g. ("layers", "wq"))."""
    name = path[-1]

    def split(dim: int) -> PartitionSpec:
        if tp == 1 or shape[dim] % tp:
            return PartitionSpec()
        return PartitionSpec(*[("tp" if i == dim else None) for i in range(len(shape))])

    heads_ok = cfg.num_heads % tp == 0 if name in ("wq", "bq") else cfg.num_kv_heads % tp == 0
    if name in ("wq", "wk", "wv", "bq", "bk", "bv"):
        return split(len(shape) - 1) if heads_ok else PartitionSpec()
    if name in ("w_gate", "w_up"):
        return split(len(shape) - 1)
    if name in ("wo", "w_down"):
        return split(len(shape) - 2)  # the input dim: [L, in, out] stacked, [in, out] per layer
    if name == "lm_head":
        return split(1)
    return PartitionSpec()


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
