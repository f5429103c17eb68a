"""The runner actor: applies the scheduler's StepMsgs in order (actors/runner/core.py, through the
slot mirrors of actors/runner/slot_mirrors.py), runs each step and sends the sampled tokens back
(rank 0 only on a multi-host slice).

Pipelining: JAX dispatch is asynchronous, so after dispatching step N the runner looks for
step N+1 before it blocks on N's tokens. In overlap mode the scheduler has usually sent N+1
already, so N+1's host work (mirrors, padding, transfer) overlaps N's device time and the
device never waits for the host between two steps.
"""

from __future__ import annotations

import json
import time

from ringserve.actors.runner.core import Pending, RunnerCore, executor_config, ready_info
from ringserve.actors.runner.weight_group import UpdateGroups
from ringserve.actors.transport import messages as m
from ringserve.model.runtime.executor import ModelExecutor
from ringserve.model.runtime.programs import enable_compilation_cache


def serve(core: RunnerCore, inbox, outbox, stopping, send_results: bool = True) -> None:
    """Apply messages until shutdown; a step's result is sent once the next message is in
    hand (or the ring is empty), so step N+1 is dispatched before step N is waited for."""
    pending: Pending | None = None

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            res = core.result(pending)
            pending = None
            if send_results:
                outbox.send(m.encode(res))

    while not stopping():
        raw = inbox.recv(timeout=0 if pending is not None else 0.5)
        if raw is None:
            flush()
            continue
        msg = m.to_runner.decode(raw)
        if isinstance(msg, m.RunnerShutdown):
            break
        if not isinstance(msg, m.StepMsg):  # a control message: after the step in flight
            flush()
            reply = core.control(msg)
            if send_results:
                outbox.send(m.encode(reply))
            continue
        nxt = core.dispatch(msg)
        flush()
        pending = nxt
    flush()


def run(ctx) -> None:
    """Actor entry point: rings `inbox` (broadcast reader 0) and `outbox` (results)."""
    import threading

    from tqdm import tqdm

    from ringserve.actors.transport.ring import BroadcastRing, Ring

    # tqdm's default lock is a multiprocessing semaphore, which an actor's os._exit at the end
    # would leave registered with the resource tracker ("leaked semaphore" at shutdown).
    tqdm.set_lock(threading.RLock())
    cfg = m.actor_config.decode(ctx.config)
    args = cfg.args
    if args.multihost:  # before anything touches a device (else the cluster silently does not form)
        from ringserve.model.runtime.distributed import init_cluster

        init_cluster(args.dist_addr, args.nnodes, args.node_rank, timeout_s=args.dist_timeout,
                     heartbeat_s=args.dist_heartbeat_s, local_devices=args.tp_size // args.nnodes)  # fmt: skip
        ctx.log.info("node %d of %d joined the jax.distributed cluster at %s", args.node_rank, args.nnodes,
                     args.dist_init_addr)  # fmt: skip
    if args.xla_cache and not args.runner_in_process:  # (a trainer's process keeps its own JAX settings)
        enable_compilation_cache()
    t0 = time.perf_counter()
    ex = ModelExecutor(cfg.model_dir, executor_config(args))
    load_s = time.perf_counter() - t0
    ctx.log.info("model loaded and %d of %d step programs compiled in %.1fs (attention: %s)",
                 ex.num_programs, ex.num_programs_total, load_s, ex.plan.attention)  # fmt: skip
    # this runner's rank in a trainer's update group is the group's rank_offset + its index among
    # the engine's runners: data-parallel group by group, host by host (actors/runner/weight_group.py)
    groups = UpdateGroups(cfg.dp_rank * args.nnodes + args.node_rank, args.weight_group_timeout,
                          ex.plan.update_group_backend)  # fmt: skip
    runner = RunnerCore(ex, args.max_running_requests, args.max_top_logprobs_num, trace=args.step_trace > 0,
                        groups=groups)  # fmt: skip
    if cfg.weights.tensors:  # a restart: the tensors pushed since `model_dir` was loaded
        ctx.log.info("%s", runner.start_weights(cfg.weights))
    runner.start_loras(args.lora_adapters)
    # several runners of one machine (dist_local_runners) read one broadcast ring, reader k each;
    # a host of its own reads its relayed ring (actors/relay/) as reader 0
    reader = args.node_rank if args.dist_local_runners else 0
    inbox = BroadcastRing.attach(ctx.rings["inbox"], reader=reader, spin_us=args.spin_us)
    outbox = Ring.attach(ctx.rings["outbox"], spin_us=args.spin_us) if "outbox" in ctx.rings else None
    if args.multihost:  # host 0 is ready once every host's runner is (each compiled every program)
        from ringserve.model.runtime.distributed import barrier

        barrier("ringserve-runners-ready", args.dist_timeout + 3600)  # + compiling everything
    ctx.ready(json.dumps(ready_info(ex, load_s)).encode())
    if args.jax_profile_dir:  # optional: the device's own view (bench/profile.py has the steps')
        import jax

        jax.profiler.start_trace(args.jax_profile_dir, create_perfetto_trace=True)
    try:
        serve(runner, inbox, outbox, ctx.stopping, send_results=args.node_rank == 0)
    finally:
        runner.groups.close()  # (a trainer waiting on a broadcast sees the group go)
        if args.jax_profile_dir:
            jax.profiler.stop_trace()
        if args.runner_in_process:  # the process goes on: its compile thread and device memory must not
            ex.close()
