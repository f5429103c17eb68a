"""A trainer's rank 0 in SGLang's weight-update protocol, as slime's and AReaL's update code does
it (AReaL `areal/engine/core/distributed.py` init_custom_process_group, slime's
`init_process_group`): a TCP rendezvous on its own address as rank 0, the store prefixed by the
group's name, a process group on it without a default group; then each tensor broadcast from
rank 0 in the order the engine was told. Run as its own process
(tests/engine/test_update_group.py, bench/weight_updates.py's "group" path):

    python -m ringserve.bench.group_trainer PORT WORLD_SIZE GROUP CHECKPOINT [--die-after K] [--dtype bfloat16]

It prints "joined" once the group is made, then for each line "go" on stdin broadcasts every
tensor of CHECKPOINT (safetensors, sorted by name; in `--dtype`, default as stored) and prints
"sent N"; "--die-after K" kills itself (SIGKILL) after K tensors of the first update; "quit"
destroys the group and exits. Needs torch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file


def init_custom_process_group(init_method: str, world_size: int, rank: int, group_name: str, backend: str,
                              timeout: datetime.timedelta):  # fmt: skip
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout,
                                      group_desc=group_name)  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def tensors(checkpoint: str, dtype: str | None = None) -> list[tuple[str, torch.Tensor]]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        out.update(load_file(f))
    return [(name, out[name] if dtype is None else out[name].to(getattr(torch, dtype))) for name in sorted(out)]


def specs(checkpoint: str, dtype: str | None = None) -> tuple[list[str], list[str], list[list[int]]]:
    """What the engine is told (names, dtypes, shapes), in broadcast order."""
    ts = tensors(checkpoint, dtype)
    return [n for n, _ in ts], [str(t.dtype).removeprefix("torch.") for _, t in ts], [list(t.shape) for _, t in ts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("world_size", type=int)
    ap.add_argument("group")
    ap.add_argument("checkpoint")
    ap.add_argument("--die-after", type=int, default=-1)
    ap.add_argument("--stall-after", type=int, default=-1, help="stop sending (alive) after K tensors of the first update")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: as stored)")
    a = ap.parse_args()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # as AReaL: never torchrun's store
    pg = init_custom_process_group(f"tcp://127.0.0.1:{a.port}", a.world_size, 0, a.group, "gloo",
                                   datetime.timedelta(seconds=120))  # fmt: skip
    print("joined", flush=True)
    ts = tensors(a.checkpoint, a.dtype)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        handles = []
        for k, (_, t) in enumerate(ts):
            if k == a.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if k == a.stall_after:
                print("stalled", flush=True)
                sys.stdin.readline()  # until told to quit: the group is never finished
                os._exit(0)
            handles.append(dist.broadcast(t, src=0, group=pg, async_op=True))  # AReaL's bucket: async, then wait
        for h in handles:
            h.wait()
        print(f"sent {len(ts)}", flush=True)
    dist.destroy_process_group(pg)


if __name__ == "__main__":
    main()
