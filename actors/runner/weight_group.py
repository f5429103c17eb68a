"""SGLang's weight-update groups on the runner: the trainer's `torch.distributed` group joined,
each update's tensors received by broadcast from the trainer's rank 0, and the group left.

    trainer (rank 0)                                   each runner holding weights
    init_custom_process_group(tcp://addr:port,   ◄──►  join(): rendezvous at addr:port as rank
      rank 0, world_size, group_name)                  rank_offset + its index, PrefixStore(group_name)
    broadcast(t, src=0) for each tensor          ────► receive(): names / dtypes / shapes in that order,
                                                       each into a fresh buffer
                                                       (then WeightSync commits, all or nothing)
    destroy                                            leave()

The protocol is slime's, AReaL's, ROLL's and verl's trainer code unchanged (SGLang's
`init_weights_update_group` / `update_weights_from_distributed` / `destroy_weights_update_group`),
so the group is made the way they make theirs: a TCP rendezvous on the trainer's address, the
store prefixed by the group's name, a process group of `world_size` ranks built on it (no default
group in this process). Backend "gloo" receives into host buffers; "nccl" (GPUs) into CUDA tensors
that become JAX arrays through DLPack without a host copy.

torch is an optional extra (`pip install 'ringserve[torch]'`), imported here only, by the
process that joins: ringserve's actors block its import at start (actors/transport/actor.py
`without_torch`, so transformers takes its torch-less paths); joining undoes that.

Every receiver must take part in every broadcast, in order, or the trainer waits: a refused update
still drains the group (`receive(keep=False)`). A broadcast that fails (the trainer died: gloo
sees the connection close; or stalled past the group's timeout) tears the group down; the old
weights keep serving and the trainer must make a new group.
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ringserve.actors.transport import messages as m
from ringserve.model.weights.segments import WeightError

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def import_torch() -> Any:
    """torch, in a process whose start blocked it (`without_torch`); WeightError if not installed."""
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]
    try:
        import torch
        import torch.distributed  # noqa: F401
    except ImportError as e:
        raise WeightError(f"update groups need torch where the runner runs (pip install 'ringserve[torch]'): {e}") from None
    return torch


@dataclass
class Joined:
    pg: Any  # the torch ProcessGroup
    rank: int
    world_size: int
    backend: str


class UpdateGroups:
    """The update groups this runner has joined, by name. `index`: this runner's place among the
    engine's runners that hold weights (data-parallel group x hosts), added to a group's
    `rank_offset`; `timeout_s`: the group's rendezvous and each broadcast's limit; `backend`:
    the one a group gets when the trainer names none (the compute plan's); `device`: where
    NCCL receives (torch's name of this runner's GPU)."""

    def __init__(self, index: int, timeout_s: float, backend: str = "gloo", device: Any = None):
        self.index, self.timeout_s, self.backend, self.device = index, timeout_s, backend, device
        self.groups: dict[str, Joined] = {}

    def join(self, g: m.WeightGroup) -> str:
        if g.group_name in self.groups:
            raise WeightError(f"update group {g.group_name!r} is already joined (destroy it first)")
        rank = g.rank_offset + self.index
        if not 0 < rank < g.world_size:
            raise WeightError(f"update group {g.group_name!r}: rank {rank} (rank_offset {g.rank_offset} + this "
                              f"runner's index {self.index}) is outside [1, world_size={g.world_size})")  # fmt: skip
        import_torch()
        from torch.distributed import distributed_c10d as c10d

        backend = g.backend or self.backend
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            host = g.master_address if ":" not in g.master_address else f"[{g.master_address}]"
            store, _, _ = next(c10d.rendezvous(f"tcp://{host}:{g.master_port}", rank, g.world_size, timeout=timeout))
            store.set_timeout(timeout)
            store = c10d.PrefixStore(g.group_name, store)
            # (torch's own helper, as SGLang's and AReaL's: a group without a default group)
            pg, _ = c10d._new_process_group_helper(g.world_size, rank, [], c10d.Backend(backend), store,
                                                   group_name=g.group_name,  # type: ignore[arg-type]  # (a NewType of str)
                                                   timeout=timeout, group_desc=g.group_name)  # fmt: skip
            c10d._world.pg_group_ranks[pg] = {i: i for i in range(g.world_size)}  # group ranks = its own ranks
        except Exception as e:  # noqa: BLE001 -- any failure to join is the caller's refusal
            raise WeightError(f"update group {g.group_name!r}: joining {g.master_address}:{g.master_port} as rank "
                              f"{rank} of {g.world_size} failed: {type(e).__name__}: {e}") from None  # fmt: skip
        self.groups[g.group_name] = Joined(pg, rank, g.world_size, backend)
        return f"joined update group {g.group_name!r} as rank {rank} of {g.world_size} ({backend})"

    def receive(self, g: m.WeightGroup, keep: bool = True) -> dict[str, Any]:
        """Every tensor `g` names, broadcast from rank 0 in that order: host arrays (gloo) or JAX
        arrays on this runner's device (nccl); `keep=False` receives and drops them (a refused
        update: the trainer still sends). A failed broadcast leaves the group."""
        joined = self.groups.get(g.group_name)
        if joined is None:
            raise WeightError(f"update group {g.group_name!r} is not joined here (init_weights_update_group first)")
        torch = import_torch()
        import torch.distributed as dist

        out: dict[str, Any] = {}
        k = 0
        try:
            for k in range(len(g.names)):
                name, dt, shape = g.names[k], g.dtypes[k], g.shapes[k]
                tdt = getattr(torch, dt.removeprefix("torch."))
                if joined.backend == "nccl":
                    t = torch.empty(shape, dtype=tdt, device=self.device or "cuda")
                    dist.broadcast(t, src=0, group=joined.pg)
                    if keep:
                        out[name] = jax.dlpack.from_dlpack(t)
                    continue
                buf = np.empty(shape, DTYPES[dt.removeprefix("torch.")])
                # bf16: torch has no NumPy bfloat16, so it receives into the same bytes as int16
                t = torch.from_numpy(buf.view(np.int16) if tdt == torch.bfloat16 else buf)
                dist.broadcast(t.view(tdt), src=0, group=joined.pg)
                if keep:
                    out[name] = buf
        except Exception as e:  # noqa: BLE001 -- the trainer died or stalled: the group is unusable
            self.leave(g.group_name, quiet=True)
            raise WeightError(f"update group {g.group_name!r}: the broadcast of tensor {g.names[k]!r} ({k + 1} of "
                              f"{len(g.names)}) failed, so the group is left and the old weights keep serving "
                              f"(init a new group): {type(e).__name__}: {e}") from None  # fmt: skip
        return out

    def on_device(self, name: str) -> bool:
        """Whether group `name` receives onto the device (NCCL: JAX arrays through DLPack)."""
        joined = self.groups.get(name)
        return joined is not None and joined.backend == "nccl"

    def leave(self, name: str, quiet: bool = False) -> str:
        joined = self.groups.pop(name, None)
        if joined is None:
            if quiet:
                return ""
            raise WeightError(f"update group {name!r} is not joined here")
        import torch.distributed as dist

        try:
            dist.destroy_process_group(joined.pg)
        except Exception:  # noqa: BLE001 -- a group whose peer died may not shut down cleanly; it is dropped anyway
            pass
        return f"left update group {name!r}"

    def close(self) -> None:
        for name in list(self.groups):
            self.leave(name, quiet=True)
