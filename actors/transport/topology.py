"""One engine's topology: its rings and actors on this host (`start_engine`: every data-parallel
group's scheduler, runner(s), relay and detokenizer), or a multi-host engine's other host
(`start_node`); `EngineLinks`, the frontend's ends of them. The processes themselves are an
ActorGroup's (actors/transport/launcher.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringserve.actors.transport.devices import group_envs
from ringserve.actors.transport.launcher import ActorGroup, OnFailure
from ringserve.actors.transport.loads import LoadBoard

if TYPE_CHECKING:
    from ringserve.actors.server_args import ServerArgs


@dataclass(eq=False)
class EngineLinks:
    """The frontend's ends of one engine's actors: per data-parallel group r, the scheduler's
    inbox `to_scheduler[r]` and the detokenizer's outbox `from_detok[r]`; the groups' load board
    (None: no board, e.g. a test's fake rings)."""

    to_scheduler: list
    from_detok: list
    loads: LoadBoard | None = None

    @property
    def dp_size(self) -> int:
        return len(self.to_scheduler)


def actor_name(kind: str, rank: int, dp_size: int) -> str:
    """"scheduler" with one group (as before), "scheduler-1" for group 1 of several."""
    return kind if dp_size == 1 else f"{kind}-{rank}"


def start_engine(args: ServerArgs, configs: list[bytes], on_failure: OnFailure,
                 envs: list[dict[str, str]] | None = None) -> tuple[ActorGroup, EngineLinks]:  # fmt: skip
    """Create one engine's rings and spawn its actors: `args.dp_size` independent groups, each a
    scheduler, a runner (on devices of its own: devices.py) and a detokenizer, group r's actors
    given `configs[r]` (an encoded ActorConfig naming its rank), its runner `envs[r]` (default:
    `group_envs` of this process's environment; an engine plans them once, so a restart gets the
    same devices). Returns the group and the
    frontend's ends; the caller waits for the actors with `group.wait_ready()`. If anything
    fails here, the group is shut down before the error is raised. One ActorGroup holds every
    group's actors: a death anywhere tears all of them down (the supervisor restarts them all).

        frontend ──"sched<r>"──► scheduler ──"runner<r>" (broadcast)──► runner (devices of group r)
                  ▲                  ▲ ◄────────── "result<r>" ─────────────┘
                  │                  ├──"detok<r>"──► detokenizer ──"front<r>"──► frontend
                  └── load board ◄───┘ (row r: group r's published load)

    Many hosts (nnodes > 1, dp_size 1): the broadcast ring has one more reader, the relay to
    the other hosts (actors/relay/), each running `start_node`; with `dist_local_runners` every
    node's runner is spawned here instead (runner, runner1, ...), one reader each, no relay.
    """
    if len(configs) != args.dp_size:
        raise ValueError(f"start_engine: {len(configs)} configs for dp_size={args.dp_size}")
    if envs is None:
        envs = group_envs(args.dp_size, args.tp_size)  # (a ValueError before anything is made)
    group = ActorGroup(on_failure=on_failure, log_level=getattr(logging, args.log_level.upper()))
    try:
        cap, spin, dp = args.ring_bytes, args.spin_us, args.dp_size
        local = args.nnodes if args.dist_local_runners else 1  # runners of a group on this machine
        relay = args.multihost and not args.dist_local_runners  # the other hosts' runners, via actors/relay
        links = EngineLinks([], [], group.load_board(dp))
        for r in range(dp):
            sfx = "" if dp == 1 else str(r)
            sched_in = group.ring(f"sched{sfx}", cap, spin_us=spin)
            runner_in = group.broadcast_ring(f"runner{sfx}", local + relay, cap, spin_us=spin)
            runner_out = group.ring(f"result{sfx}", cap, spin_us=spin)
            detok_in = group.ring(f"detok{sfx}", cap, spin_us=spin)
            front_in = group.ring(f"front{sfx}", cap, spin_us=spin)
            assert links.loads is not None
            sched_rings = {"inbox": sched_in.name, "to_runner": runner_in.name, "from_runner": runner_out.name,
                           "to_detok": detok_in.name, "loads": links.loads.name}  # fmt: skip
            group.spawn(actor_name("scheduler", r, dp), "ringserve.actors.scheduler.actor:run", configs[r], sched_rings)
            for k in range(local):  # runner k reads the broadcast ring as reader k; only runner 0 sends
                runner_rings = {"inbox": runner_in.name, "outbox": runner_out.name}
                if args.runner_in_process:  # on this process's devices (a trainer's); dp_size 1, one host
                    group.spawn_thread("runner", "ringserve.actors.runner.actor:run", configs[r], runner_rings)
                else:
                    group.spawn(actor_name("runner", r, dp) if k == 0 else f"runner{k}", "ringserve.actors.runner.actor:run",
                                _on_node(configs[r], k), runner_rings, env=envs[r])  # fmt: skip
            if relay:  # reader `local`: every message down one TCP stream per other host
                group.spawn("relay", "ringserve.actors.relay.actor:run_out", configs[r], {"inbox": runner_in.name})
            group.spawn(actor_name("detokenizer", r, dp), "ringserve.actors.detokenizer.actor:run", configs[r],
                        {"inbox": detok_in.name, "outbox": front_in.name})  # fmt: skip
            links.to_scheduler.append(sched_in)
            links.from_detok.append(front_in)
    except BaseException:
        group.shutdown()
        raise
    return group, links


def start_node(args: ServerArgs, config: bytes, on_failure: OnFailure) -> ActorGroup:
    """Host `args.node_rank` > 0 of a multi-host engine: a relay-in that writes host 0's step
    messages into a ring and the runner that reads it (it sends nothing back: runner 0 does).

        host 0's relay ──TCP──► relay (in) ──"runner" (broadcast, 1 reader)──► runner
    """
    group = ActorGroup(on_failure=on_failure, log_level=getattr(logging, args.log_level.upper()))
    try:
        ring = group.broadcast_ring("runner", 1, args.ring_bytes, spin_us=args.spin_us)
        group.spawn("relay", "ringserve.actors.relay.actor:run_in", config, {"outbox": ring.name})
        group.spawn("runner", "ringserve.actors.runner.actor:run", config, {"inbox": ring.name})
    except BaseException:
        group.shutdown()
        raise
    return group


def _on_node(config: bytes, rank: int) -> bytes:
    """`config` (an encoded ActorConfig) for the runner of node `rank` (its ServerArgs.node_rank)."""
    if rank == 0:
        return config

    from ringserve.actors.transport import messages as m

    cfg = m.actor_config.decode(config)
    cfg.args = cfg.args.replace(node_rank=rank)
    return m.encode(cfg)
