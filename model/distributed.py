"""Many hosts: one `jax.distributed` program, one process (a runner) per host.

    init_cluster(...)   before anything touches a device: joins the cluster (node 0 hosts the
                        coordinator); the mesh (model/mesh.py make_mesh) then spans every
                        process's devices
    all_ok(ok)          an allgather of each process's bool: True only if every one is; every
                        process must call it at the same point of the message stream (it is a
                        collective), which the runners are (they apply the same messages in order)

Fate-sharing is JAX's: a process that stops sending heartbeats for `heartbeat_s` ends every
process of the cluster ("Terminating process because the JAX distributed service detected
fatal errors"); there is no partial recovery.
"""

from __future__ import annotations

import os

import jax
import numpy as np


def init_cluster(coordinator: tuple[str, int], num_processes: int, process_id: int, *, timeout_s: int,
                 heartbeat_s: int, local_devices: int | None = None) -> None:  # fmt: skip
    """Join the cluster whose coordinator node 0 serves at `coordinator` (bound to that address,
    not to every interface). On CPU, `local_devices` devices per process (JAX_NUM_CPU_DEVICES
    wins where set); CPU collectives are gloo's (JAX's default)."""
    if local_devices is not None and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", local_devices)
    host, port = coordinator
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    jax.distributed.initialize(
        addr, num_processes, process_id,
        coordinator_bind_address=addr if process_id == 0 else None,
        initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_s,
    )  # fmt: skip


def all_ok(ok: bool) -> bool:
    """True if every process of the cluster says ok (a collective: see the module docstring); on
    one process, `ok`."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))
