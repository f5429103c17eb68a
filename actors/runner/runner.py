"""The runner actor: owns the model, the KV cache on device and the slot mirrors.

One runner per host; on one host it drives every local device through the `tp` mesh. It
applies the scheduler's StepMsgs in order (actors/runner_state.py), runs the compiled step
(model/step.py) and sends the sampled tokens back (rank 0 only on a multi-host slice).

Pipelining: JAX dispatch is asynchronous, so after dispatching step N the runner looks for
step N+1 before it blocks on N's tokens. In overlap mode the scheduler has usually sent N+1
already, so N+1's host work (mirrors, padding, transfer) overlaps N's device time and the
device never waits for the host between two steps.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from actors.runner.slot_mirrors import SlotMirrors
from actors.transport import messages as m
from actors.transport.trace import RunnerStamps
from model.sampler import SampleOut
from model.step import ExecutorConfig, ModelExecutor, enable_compilation_cache
from model.weight_sync import WeightSync, tensors_from_segments

log = logging.getLogger("ringserve.runner")


def executor_config(args) -> ExecutorConfig:
    """The executor's shapes from the server options (the scheduler plans within the same)."""
    verify = args.speculative_num_draft_tokens + 1 if args.speculative else 0
    return ExecutorConfig(
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_context_len=args.context_length,
        max_batch=args.max_running_requests,
        # a prefill batch computes <= max_prefill_tokens new tokens; each row pads to a block
        max_extend_tokens=max(
            args.max_prefill_tokens + args.extend_block * args.max_running_requests,
            verify * args.max_running_requests + args.extend_block,  # a verify step: a round per request
        ) // args.extend_block * args.extend_block,
        extend_block=args.extend_block,
        attn_chunk_tokens=args.attn_chunk_tokens,
        context_bucket_min=args.context_bucket_min,
        layer_loop=args.layer_loop,
        layer_unroll=args.layer_unroll,
        attention_interpret=args.attention_interpret,
        dtype=args.dtype,
        tp_size=args.tp_size,
        top_logprobs_num=args.max_top_logprobs_num,
        attention_backend=args.attention_backend,
        precompile=args.precompile,
        background_compile=args.serve_while_compiling,
        verify_tokens=verify,
        deterministic=args.enable_deterministic_inference,
    )


def ready_info(ex: ModelExecutor, load_s: float) -> dict:
    """What the runner tells the launcher once it serves (printed by `ringserve serve`)."""
    import jax

    devices = list(ex.mesh.devices.flat)
    mc = ex.model_config
    return {
        "platform": devices[0].platform,
        "devices": [str(d) for d in devices],
        "family": mc.family,
        "num_layers": mc.num_layers,
        "dtype": ex.cfg.dtype,
        "attention_backend": ex.backend,
        "num_programs": ex.num_programs,
        "programs_total": ex.num_programs_total,
        "load_and_compile_s": round(load_s, 2),
        "kv_pool_tokens": (ex.cfg.num_pages - 1) * ex.cfg.page_size,
        "jax_version": jax.__version__,
    }


class Pending:
    __slots__ = ("step_id", "out", "rows", "t0", "want_top", "accepted")

    def __init__(self, step_id: int, out: SampleOut, rows: list[int], t0: float, want_top: bool, accepted=None):
        self.step_id, self.out, self.rows, self.t0, self.want_top = step_id, out, rows, t0, want_top
        self.accepted = accepted  # a verify step: the device's [R] accepted counts, the first G real


class Runner:
    def __init__(self, executor: ModelExecutor, max_slots: int, top_n: int, trace: bool = False):
        self.ex = executor
        self.mirrors = SlotMirrors(max_slots)
        self.top_n = top_n
        self.weights = WeightSync(executor)
        self.stamps = RunnerStamps() if trace else None  # ServerArgs.step_trace (actors/transport/trace.py)

    def control(self, msg: m.RunnerWeights | m.RunnerGetWeights | m.RunnerMemory | m.RunnerStatus) -> m.RunnerReply:
        """A weights, memory or status message (every earlier step has been answered): its
        reply. A refusal (WeightError, bad tags) leaves everything as it was."""
        try:
            if isinstance(msg, m.RunnerStatus):
                status = self.ex.compile_status() | {"trace_count": self.ex.trace_count}
                return m.RunnerReply(True, "", json.dumps(status).encode())
            if isinstance(msg, m.RunnerWeights):
                u = msg.update
                if u.source == "disk":
                    text = self.weights.load_disk(u.model_path)
                else:
                    tensors = tensors_from_segments(u.tensors)
                    text = self.weights.stage(tensors, first=u.part == 0, last=u.part == u.parts - 1)
                return m.RunnerReply(True, text)
            if isinstance(msg, m.RunnerGetWeights):
                a = self.weights.get(msg.request.name, msg.request.truncate_size)
                return m.RunnerReply(True, "", m.f32(a.ravel()), list(a.shape))
            r = msg.request
            text = self.weights.release(r.tags) if r.action == "release" else self.weights.resume(r.tags)
            return m.RunnerReply(True, text)
        except ValueError as e:
            if isinstance(msg, m.RunnerWeights):
                self.weights.abandon()
            return m.RunnerReply(False, str(e))

    def dispatch(self, msg: m.StepMsg) -> Pending:
        t0 = time.perf_counter()
        dev_rows = self.mirrors.apply(msg)
        t_applied = time.perf_counter()
        accepted = None
        if msg.verify is not None:
            out, rows, acc = self.ex.run_verify(dev_rows, self.ex.cfg.verify_tokens)
            accepted = (acc, len(msg.verify.slots))
        else:
            out, rows = self.ex.run(dev_rows)
        if self.stamps is not None:
            self.stamps.dispatched(msg.step_id, t0, t_applied, out.tokens)
        return Pending(msg.step_id, out, rows, t0, self.top_n > 0, accepted)

    def result(self, p: Pending) -> m.StepResultMsg:
        if self.stamps is not None:
            self.stamps.fetching(p.step_id)
        rows = np.asarray(p.rows)
        tokens = np.asarray(p.out.tokens)[rows]  # blocks until the step is done
        res = m.StepResultMsg(p.step_id, m.i32(tokens), m.f32(np.asarray(p.out.logprobs)[rows]))
        if p.accepted is not None:
            acc, g = p.accepted
            res.accepted = m.i32(np.asarray(acc)[:g])
        if p.want_top:
            res.top_n = self.top_n
            res.top_ids = m.i32(np.asarray(p.out.top_ids)[rows])
            res.top_logprobs = m.f32(np.asarray(p.out.top_logprobs)[rows])
        res.forward_s = time.perf_counter() - p.t0
        res.trace_count = self.ex.trace_count
        res.programs_compiled, res.programs_pending = self.ex.num_programs, self.ex.pending
        res.compile_error = self.ex.compile_error or ""
        if self.stamps is not None:
            res.times = self.stamps.fetched(p.step_id)
        return res

    def serve(self, inbox, outbox, stopping, send_results: bool = True) -> None:
        pending: Pending | None = None
        while not stopping():
            raw = inbox.recv(timeout=0 if pending is not None else 0.5)
            if raw is None:
                if pending is not None:
                    self._send(outbox, pending, send_results)
                    pending = None
                continue
            msg = m.to_runner.decode(raw)
            if isinstance(msg, m.RunnerShutdown):
                break
            if not isinstance(msg, m.StepMsg):  # a control message: after the step in flight
                if pending is not None:
                    self._send(outbox, pending, send_results)
                    pending = None
                reply = self.control(msg)
                if send_results:
                    outbox.send(m.encode(reply))
                continue
            nxt = self.dispatch(msg)
            if pending is not None:
                self._send(outbox, pending, send_results)
            pending = nxt
        if pending is not None:
            self._send(outbox, pending, send_results)

    def _send(self, outbox, p: Pending, send_results: bool) -> None:
        res = self.result(p)
        if send_results:
            outbox.send(m.encode(res))


def run(ctx) -> None:
    """Actor entry point: rings `inbox` (broadcast reader 0) and `outbox` (results)."""
    import threading

    from tqdm import tqdm

    from actors.transport.ring import BroadcastRing, Ring

    # tqdm's default lock is a multiprocessing semaphore, which an actor's os._exit at the end
    # would leave registered with the resource tracker ("leaked semaphore" at shutdown).
    tqdm.set_lock(threading.RLock())
    cfg = m.actor_config.decode(ctx.config)
    args = cfg.args
    if args.xla_cache:
        enable_compilation_cache()
    t0 = time.perf_counter()
    ex = ModelExecutor(cfg.model_dir, executor_config(args))
    load_s = time.perf_counter() - t0
    ctx.log.info("model loaded and %d of %d step programs compiled in %.1fs (attention: %s)",
                 ex.num_programs, ex.num_programs_total, load_s, ex.backend)  # fmt: skip
    runner = Runner(ex, args.max_running_requests, args.max_top_logprobs_num, trace=args.step_trace > 0)
    inbox = BroadcastRing.attach(ctx.rings["inbox"], reader=0, spin_us=args.spin_us)
    outbox = Ring.attach(ctx.rings["outbox"], spin_us=args.spin_us)
    ctx.ready(json.dumps(ready_info(ex, load_s)).encode())
    if args.jax_profile_dir:  # optional: the device's own view (bench/profile.py has the steps')
        import jax

        jax.profiler.start_trace(args.jax_profile_dir, create_perfetto_trace=True)
    try:
        runner.serve(inbox, outbox, ctx.stopping)
    finally:
        if args.jax_profile_dir:
            jax.profiler.stop_trace()
