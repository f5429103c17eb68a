"""Many hosts: one `jax.distributed` program, one process (a runner) per host.

    init_cluster(...)   before anything touches a device: joins the cluster (node 0 hosts the
                        coordinator); the mesh (model/compute/mesh.py make_mesh) then spans every
                        process's devices
    barrier(name, s)    every process waits for every other (the runners: each host ready)
    all_ok(ok)          each process's bool gathered: True only if every one is; every process
                        must call it equally often in the same order (the n-th calls agree),
                        which the runners do (they apply the same messages in order)

Fate-sharing is JAX's: a process that stops sending heartbeats for `heartbeat_s` ends every
process of the cluster ("Terminating process because the JAX distributed service detected
fatal errors"); there is no partial recovery.
"""

from __future__ import annotations

import itertools
import os

import jax


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


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    assert client is not None, "init_cluster first"
    return client


def barrier(name: str, timeout_s: float) -> None:
    """Wait until every process of the cluster got here, at most `timeout_s` (no-op on one
    process). The coordination service's barrier, not a device collective: gloo's collectives
    time out long before a slow host finishes compiling."""
    if jax.process_count() > 1:
        _client().wait_at_barrier(name, int(timeout_s * 1000))


_agreements = itertools.count()  # every process calls all_ok equally often, in the same order


def all_ok(ok: bool, timeout_s: float = 3600) -> bool:
    """True if every process of the cluster says ok (see the module docstring); on one process,
    `ok`. Through the coordination service's key-value store (the n-th agreement's keys are
    `ringserve/ok/<n>/<process>`), not a device collective, so a host that loads a checkpoint
    minutes after another still agrees."""
    if jax.process_count() == 1:
        return ok
    client, n = _client(), next(_agreements)
    client.key_value_set(f"ringserve/ok/{n}/{jax.process_index()}", "1" if ok else "0")
    ms = int(timeout_s * 1000)
    return all(client.blocking_key_value_get(f"ringserve/ok/{n}/{k}", ms) == "1" for k in range(jax.process_count()))
