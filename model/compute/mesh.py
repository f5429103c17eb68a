"""Device mesh and the tensor-parallel sharding of parameters (the KV cache's is its backend's).

One mesh axis, `tp`, with Auto axis type (a default `jax.make_mesh` has Explicit axes, under
which a plain jit of sharded matmuls fails to type-check). Megatron-style layout; each
`nnx.Param` of the model's modules (model/compute/dots.py, model/layers/decoder.py) carries its own as
`out_sharding`, built here by `tp_split`:

    q/k/v_proj, gate/up_proj   weight [in, out]  column-parallel  (None, "tp")  (q/k/v by heads)
    q/k/v_proj bias            [out]                              ("tp",)
    o_proj, down_proj          weight [in, out]  row-parallel     ("tp", None)
    lm_head                    weight [H, V]     vocab-parallel   (None, "tp")
    embed_tokens, norms                          replicated       ()
    stacked layers (scan)      [L, ...]          the same, after a None: the layer axis is never split
    experts (ep_size = tp)     [E, ...]          split by expert  ("tp", None, None)  (ep_split; the
                                                 tokens reach them by psum or all_to_all under
                                                 shard_map: model/layers/expert_parallel.py)
    KV cache                   split by KV head (model/compute/attention/base.py)

A dimension that `tp` does not divide (e.g. 2 KV heads on 4 devices) stays replicated: the
program is still correct, XLA just does that part redundantly.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec


def make_mesh(tp_size: int) -> Mesh:
    """The `tp` mesh: this host's first `tp_size` devices, or under `jax.distributed` (several
    processes, one per host) every device of every process, in the topology order
    `mesh_utils.create_device_mesh` gives (a process's devices are contiguous on the axis)."""
    devices = jax.devices()
    if jax.process_count() > 1:
        if tp_size != len(devices):
            raise ValueError(
                f"tp_size={tp_size} but the {jax.process_count()} processes of this jax.distributed cluster have "
                f"{len(devices)} devices together: a multi-host tp_size counts every host's devices"
            )
        from jax.experimental import mesh_utils

        return Mesh(mesh_utils.create_device_mesh((tp_size,), devices), ("tp",), axis_types=(AxisType.Auto,))
    if tp_size < 1 or tp_size > len(devices):
        raise ValueError(
            f"tp_size={tp_size} but {len(devices)} {devices[0].platform} device(s) are visible "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    return Mesh(np.array(devices[:tp_size]), ("tp",), axis_types=(AxisType.Auto,))


def place_host_array(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array on `sharding`, each process filling only its own devices' shards.

    Not `jax.device_put`: over a mesh of several processes it first checks that every process
    holds the same value, an allgather of the whole array (tpu-inference #3078 ran out of memory
    that way); `make_array_from_callback` asks `a` only for the slices of local devices."""
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def tp_split(ndim: int, axis: int, units: int, tp: int) -> tuple[str | None, ...]:
    """The `out_sharding` of an ndim-parameter split over `tp` along `axis` when tp divides
    `units` (the heads that axis holds, or its length); otherwise () -- replicated."""
    if tp == 1 or units % tp:
        return ()
    return tuple("tp" if i == axis else None for i in range(ndim))


def ep_split(ndim: int, experts: int, ep: int) -> tuple[str | None, ...]:
    """The `out_sharding` of an expert weight [E, ...] split over the `tp` devices by expert
    (expert parallelism, `ep_size`: each device holds E / ep experts whole) when ep divides E;
    otherwise () -- every device holds every expert."""
    if ep == 1 or experts % ep:
        return ()
    return ("tp",) + (None,) * (ndim - 1)


def ep_mesh(ep: int) -> AbstractMesh:
    """The `tp` axis of `ep` devices as an abstract mesh, for the experts' shard_map inside a
    traced program (model/layers/moe.py): the devices are the arguments' own."""
    return AbstractMesh((ep,), ("tp",), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
