"""The scheduler actor: the event loop around `SchedulerCore` (no JAX in this process).

    recv requests ─► get_next_batch ─► send StepMsg ─► [overlap: process result of N-1]
         ▲                                              [normal : process result of N  ]
         └──────────── outputs ─► detokenizer ◄─────────────┘

Normal mode waits for batch N's tokens before planning N+1. Overlap mode (default) sends
N+1 first, then processes N: the runner computes N+1 while the host books N's tokens; where
N+1 needs a token N has not returned yet it reads the runner's FutureMap (see core.py).
At most two batches are ever in flight. A batch with grammar-constrained rows is the exception
(SGLang #13425's choice): the next mask needs its tokens, so it is booked before the next batch
is planned; unconstrained traffic keeps the overlap.

Control requests (pause, continue, flush, info) are answered through the detokenizer, so a
reply arrives at the frontend after every output sent before it. Pause and flush first finish
the batches in flight (seed 000). When nothing runs, the KV books' integrity check runs once;
a violation is logged loudly and counted in get_server_info (tests assert it stays 0). Every
scheduling fact lives in the core; this loop owns only what is in flight and the runner's
compile status.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable

import numpy as np

from ringserve.actors.scheduler.batch import ScheduledBatch, StepResult
from ringserve.actors.scheduler.booking import ReqOutput
from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.scheduler.grammar import Grammars
from ringserve.actors.scheduler.logprobs import PromptLogprobs
from ringserve.actors.scheduler.output import step_msg, token_out
from ringserve.actors.scheduler.report import group_load, load, server_info
from ringserve.actors.scheduler.req import Req
from ringserve.actors.scheduler.tape import PositionTape
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport import messages as m
from ringserve.actors.transport import routed
from ringserve.actors.transport.loads import LoadBoard
from ringserve.actors.transport.trace import StepTrace
from ringserve.kvmem import KVCache

log = logging.getLogger("ringserve.scheduler")

IDLE_WAIT_S = 0.5  # longest blocking wait for a request while idle (then `stopping` is checked)
GRAMMAR_WAIT_S = 0.002  # wait for a request while nothing runs but a grammar compiles


def to_req(g: m.GenerateReq, eos_ids: frozenset[int]) -> Req:
    ids = m.as_i32(g.input_ids).copy()
    req = Req(g.rid, ids, g.sampling, eos_ids, g.return_logprob, g.top_logprobs_num,
              m.as_i32(g.token_ids_logprob).copy() if g.token_ids_logprob else None,
              stream=g.stream, session_id=g.session_id, cache_salt=g.cache_salt,
              hidden=PositionTape() if g.return_hidden_states else None,
              routed=PositionTape(g.routed_experts_start_len) if g.return_routed_experts else None)  # fmt: skip
    if g.return_logprob and 0 <= g.logprob_start_len < len(ids) - 1:  # some prompt position to compute
        req.prompt_lp = PromptLogprobs(g.logprob_start_len, len(ids))
    if g.resume is None:
        return req
    if len(g.resume.output_ids):  # the prompt's logprobs went out with the first token already
        req.prompt_lp = None
    return req.continuing(g.resume)


def step_result(res: m.StepResultMsg) -> StepResult:
    """The runner's result message as the core reads it (views into the message, no copies)."""
    tokens = m.as_i32(res.tokens)
    top_ids = top_lp = None
    if res.top_n:
        top_ids = m.as_i32(res.top_ids).reshape(len(tokens), res.top_n)
        top_lp = m.as_f32(res.top_logprobs).reshape(len(tokens), res.top_n)
    result = StepResult(res.step_id, tokens, m.as_f32(res.logprobs) if res.logprobs else None, top_ids, top_lp,
                        m.as_i32(res.accepted) if res.accepted else None)  # fmt: skip
    if res.kept_counts:
        result.kept_starts = np.concatenate([[0], np.cumsum(m.as_i32(res.kept_counts))]).astype(np.int32)
        result.kept_ids = m.as_i32(res.kept_ids)
    if res.hidden_rows:
        result.hidden_starts = np.concatenate([[0], np.cumsum(m.as_i32(res.hidden_rows))]).astype(np.int32)
        result.hidden = m.as_f32(res.hidden).reshape(-1, res.hidden_dim)
    if res.routed_rows:
        result.routed_starts = np.concatenate([[0], np.cumsum(m.as_i32(res.routed_rows))]).astype(np.int32)
        dt = routed.dtype_of(res.routed_itemsize)
        result.routed = np.frombuffer(res.routed, dt).reshape(-1, *res.routed_shape)
    more = res.more
    if more is None:
        return result
    if more.ids_logprobs:
        result.ids_logprobs = m.as_f32(more.ids_logprobs).reshape(len(tokens), more.ids_n)
    if more.input_logprobs:
        result.input_logprobs = lp = m.as_f32(more.input_logprobs)
        if res.top_n and more.input_top_ids:
            result.input_top_ids = m.as_i32(more.input_top_ids).reshape(len(lp), res.top_n)
            result.input_top_logprobs = m.as_f32(more.input_top_logprobs).reshape(len(lp), res.top_n)
        if more.input_ids_logprobs:
            result.input_ids_logprobs = m.as_f32(more.input_ids_logprobs).reshape(len(lp), more.ids_n)
    return result


class SchedulerActor:
    def __init__(self, args: ServerArgs, eos_ids: list[int], decode_tail: Callable[[list[int]], str],
                 inbox, to_runner, from_runner, to_detok, grammars: Grammars | None = None,
                 loads: LoadBoard | None = None, dp_rank: int = 0):  # fmt: skip
        self.args = args
        self.eos = frozenset(eos_ids)
        cache = KVCache(args.num_pages, args.page_size, args.max_running_requests, args.disable_radix_cache,
                        local_pages=(args.max_swa_tokens or 0) // args.page_size, window=args.swa_window,
                        slack=args.swa_slack)  # fmt: skip
        self.core = SchedulerCore(args, cache, decode_tail, grammars)
        self.stats = self.core.stats
        self.inbox, self.to_runner, self.from_runner, self.to_detok = inbox, to_runner, from_runner, to_detok
        self.in_flight: collections.deque[ScheduledBatch] = collections.deque()
        self.checked_idle = False
        self.runner_trace_count = 0
        self.compile_status: dict = {}  # the runner's, asked for until every program is compiled
        self.trace = StepTrace(args.step_trace) if args.step_trace else None  # off by default
        self.loads, self.dp_rank = loads, dp_rank  # where this group's load is published (DP)
        self.received = self.received_tokens = 0  # requests (prompt tokens) taken off the inbox

    # ---- main loop --------------------------------------------------------------------------
    def serve(self, stopping: Callable[[], bool]) -> None:
        overlap = self.args.enable_overlap
        while not stopping():
            t_loop = time.perf_counter()
            self._recv_requests(self._recv_timeout())
            self._emit(self.core.grammar_failures())
            if any(b.masked for b in self.in_flight):
                self._drain()  # the next masks need these tokens (their matchers advance first)
            t0 = time.perf_counter()
            batch = self.core.get_next_batch()
            if batch is not None:
                self._send(batch)
                if self.trace is not None:
                    self.trace.scheduled(batch.step_id, t_loop, t0)
            self.stats.schedule_s += time.perf_counter() - t0
            if self.in_flight and (not overlap or batch is None or len(self.in_flight) > 1):
                self._finish_oldest()
            if batch is None and not self.in_flight:
                self._on_idle()
            if self.loads is not None:
                self.loads.publish(self.dp_rank, group_load(self.core, self.received, self.received_tokens))

    def _recv_timeout(self) -> float:
        """How long to wait for a request: long when nothing can run, a moment while a grammar
        compiles with nothing else to do (its request then becomes ready), else not at all."""
        if self.in_flight:
            return 0
        if self.core.stalled:
            return IDLE_WAIT_S
        return GRAMMAR_WAIT_S if self.core.compiling else 0

    def _recv_requests(self, timeout: float) -> None:
        raw = self.inbox.recv(timeout=timeout)
        while raw is not None:
            try:
                msg = m.to_scheduler.decode(raw)
            except m.msgspec.DecodeError as e:  # never let one malformed message stop the server
                log.error("scheduler: dropped a malformed request (%s)", e)
            else:
                self._handle(msg)
            raw = self.inbox.recv(timeout=0)

    def _send(self, batch: ScheduledBatch) -> None:
        self.checked_idle = False
        t_send = time.perf_counter()
        raw = m.encode(step_msg(batch))
        self.to_runner.send(raw)
        if self.trace is not None:
            self.trace.sent(batch, t_send, time.perf_counter(), len(raw))
        self.in_flight.append(batch)

    def _finish_oldest(self) -> None:
        batch = self.in_flight.popleft()
        t0 = time.perf_counter()
        raw = self.from_runner.recv(timeout=None)
        t1 = time.perf_counter()
        res = m.from_runner.decode(raw)
        assert isinstance(res, m.StepResultMsg) and res.step_id == batch.step_id, (
            f"runner answered {res!r:.80}, expected step {batch.step_id}"
        )
        self.stats.wait_runner_s += t1 - t0
        self.stats.runner_forward_s += res.forward_s
        self.runner_trace_count = res.trace_count
        if self.compile_status:
            self.compile_status["programs_compiled"] = res.programs_compiled
            self.compile_status["programs_pending"] = res.programs_pending
            self.compile_status["compile_error"] = res.compile_error or None
        result = step_result(res)
        self._emit(self.core.process_result(batch, result))
        self.stats.process_s += time.perf_counter() - t1
        if self.trace is not None:
            self.trace.finished(batch.step_id, res.times, t0, t1, len(raw))

    def _drain(self) -> None:
        while self.in_flight:
            self._finish_oldest()

    def _runner_call(self, msg: m.ToRunner) -> m.RunnerReply:
        """A control message to the runner(s), after every batch in flight; its reply."""
        self._drain()
        self.to_runner.send(m.encode(msg))
        reply = m.from_runner.decode(self.from_runner.recv(timeout=None))
        assert isinstance(reply, m.RunnerReply), f"runner answered {reply!r:.80} to a control message"
        return reply

    def _emit(self, outs: list[ReqOutput]) -> None:
        if outs:
            self.to_detok.send(m.encode(m.BatchTokenOut([token_out(o) for o in outs])))

    def _on_idle(self) -> None:
        if self.checked_idle:
            return
        self.checked_idle = True
        try:
            self.core.check_idle()
        except AssertionError as e:  # kvmem's IntegrityError is an AssertionError
            self.stats.integrity_errors.append(str(e))
            log.error("KV INTEGRITY VIOLATION: %s", e)

    # ---- requests ---------------------------------------------------------------------------
    def _handle(self, msg: m.ToScheduler) -> None:
        core = self.core
        if isinstance(msg, m.GenerateReq):
            self.received += 1
            self.received_tokens += len(msg.input_ids) // 4
            try:
                core.add_request(to_req(msg, self.eos), msg.lora_path)
            except ValueError as e:  # e.g. a duplicate rid: answer that request, nothing else
                self.to_detok.send(m.encode(m.BatchTokenOut([m.TokenOut(
                    msg.rid, b"", len(msg.input_ids) // 4, 0, finished=True,
                    finish_reason={"type": "abort", "message": str(e)}, open=msg.sampling)])))  # fmt: skip
        elif isinstance(msg, m.AbortReq):
            self._emit(core.abort(msg.rid))
        elif isinstance(msg, m.PauseReq):
            self._drain()
            self._emit(core.pause(msg.mode))
            self._reply("pause", True, f"paused ({msg.mode})")
        elif isinstance(msg, m.ContinueReq):
            core.resume()
            self._reply("continue", True, "continued")
        elif isinstance(msg, m.FlushCacheReq):
            self._drain()
            ok, why = core.flush_cache()
            if ok:
                self.checked_idle = False
            self._reply("flush", ok, why)
        elif isinstance(msg, m.InfoReq):
            self._reply("info", True, "", json.dumps(self.info()).encode())
        elif isinstance(msg, m.LoadReq):
            self._reply("load", True, "", json.dumps(load(core)).encode())
        elif isinstance(msg, m.UpdateWeightsReq):
            self._update_weights(msg)
        elif isinstance(msg, m.GetWeightsReq):
            r = self._runner_call(m.RunnerGetWeights(msg))
            self._reply("get_weights", r.ok, r.message, r.payload, r.shape)
        elif isinstance(msg, m.MemoryReq):
            self._memory(msg)
        elif isinstance(msg, m.CloseSessionReq):
            core.close_session(msg.session_id)
            self.checked_idle = False
        elif isinstance(msg, m.LoraReq):
            self._lora(msg)

    def _lora(self, msg: m.LoraReq) -> None:
        """load_lora_adapter / unload_lora_adapter (no pause needed: a load writes a slot no
        request uses; an unload is refused while one does). The reply carries the adapters
        loaded afterwards, refused or not."""
        table = self.core.loras
        ok, text = False, ""
        try:
            if table is None:
                raise ValueError("this server serves no LoRA adapters (start it with enable_lora)")
            if msg.action == "load":
                slot = table.free_slot(msg.name)
                r = self._runner_call(m.RunnerLora("load", msg.name, slot, msg.path))
                if r.ok:
                    table.add(msg.name, msg.path, slot)
            else:
                if msg.name not in table.by_name:
                    raise ValueError(f"lora_name={msg.name!r}: no LoRA adapter of that name is loaded "
                                     f"(loaded: {sorted(table.by_name)})")  # fmt: skip
                users = self.core.lora_users(msg.name)
                if users:
                    raise ValueError(f"LoRA adapter {msg.name!r} is used by {users} requests; unload it once they finish")
                slot = table.get(msg.name).slot
                r = self._runner_call(m.RunnerLora("unload", msg.name, slot))
                if r.ok:
                    table.remove(msg.name)
            ok, text = r.ok, r.message
        except ValueError as e:
            text = str(e)
        loaded = table.loaded() if table is not None else {}
        self._reply("lora", ok, text, json.dumps({"loaded_adapters": loaded}).encode())

    def _update_weights(self, msg: m.UpdateWeightsReq) -> None:
        """Forward an update (or one part of it) to the runner(s); the reply always carries the
        version serving afterwards (the frontend keeps no copy). An update made against another
        version than the one serving (`base_weight_version`, a delta) is refused at every part,
        before the runner stages anything, and at the commit."""
        # dropping staged parts, joining or leaving an update group: nothing served changes
        changes = msg.source not in ("abandon", "group_init", "group_destroy", "group_drain")
        why = self.core.busy() or self._stale(msg) if changes else None
        if msg.source == "check":  # the DP frontend asks every group before any commits (all or nothing)
            ok, text = why is None, f"update_weights refused: {why}" if why else "an update would be taken"
        elif why is not None:
            ok, text = False, f"update_weights refused: {why}"
            if msg.source == "group":  # the trainer broadcasts anyway: the runner takes part and drops it
                drained = self._runner_call(m.RunnerWeights(m.UpdateWeightsReq("group_drain", group=msg.group)))
                if not drained.ok:
                    text += f"; {drained.message}"
        else:
            last = changes and msg.part == msg.parts - 1
            if last:  # the final part swaps: version it
                msg.weight_version = self.core.next_weight_version(msg.weight_version)
            r = self._runner_call(m.RunnerWeights(msg))
            if r.ok and last:
                self.core.new_weights(msg.weight_version or "")
                self.checked_idle = False
            ok, text = r.ok, r.message
        self._reply("update_weights", ok, text, json.dumps({"weight_version": self.core.weight_version}).encode())

    def _stale(self, msg: m.UpdateWeightsReq) -> str | None:
        """Why an update made against `base_weight_version` cannot apply to the weights serving."""
        base, serving = msg.base_weight_version, self.core.weight_version
        if base is None or base == serving:
            return None
        return f"base_weight_version={base!r} but the engine serves {serving!r}"

    def _memory(self, msg: m.MemoryReq) -> None:
        if msg.action == "release":
            why = self.core.can_release(msg.tags)
            if why is not None:
                self._reply("memory", False, f"release_memory_occupation refused: {why}")
                return
        r = self._runner_call(m.RunnerMemory(msg))  # (after the batches in flight)
        if r.ok:
            (self.core.released if msg.action == "release" else self.core.resumed)(msg.tags)
        self._reply("memory", r.ok, r.message)

    def _reply(self, kind: str, ok: bool, message: str, payload: bytes = b"", shape: list[int] | None = None) -> None:
        self.to_detok.send(m.encode(m.ControlReply(kind, ok, message, payload, shape or [])))

    def runner_compile_status(self) -> dict:
        """Programs compiled / total / pending (the runner compiles in the background after
        start-up). Every step result brings the counts; the runner is asked (a control call:
        after the steps in flight) only at first, and while some are pending and no step is in
        flight (an idle engine), so polling never breaks the pipeline up."""
        st = self.compile_status
        if not st or (st["programs_pending"] and not st["compile_error"] and not self.in_flight):
            st = json.loads(self._runner_call(m.RunnerStatus()).payload)
            self.runner_trace_count = st.pop("trace_count")
            self.compile_status = st
        return st

    def info(self) -> dict:
        """get_server_info: the core's facts and stats, and what this loop owns."""
        compiled = self.runner_compile_status()  # first: it finishes the steps in flight
        return {
            **server_info(self.core),
            **compiled,
            "runner_trace_count": self.runner_trace_count,
            "in_flight": len(self.in_flight),
            "cur_batch": self.in_flight[-1].step_id if self.in_flight else None,
            "last_batch": self.in_flight[0].step_id if self.in_flight else None,
            **({"step_trace": self.trace.drain()} if self.trace is not None else {}),
        }


def run(ctx) -> None:
    """Actor entry point (actors/transport/actor.py): rings `inbox`, `to_runner`, `from_runner`, `to_detok`."""
    from ringserve.actors.transport.ring import BroadcastRing, Ring

    cfg = m.actor_config.decode(ctx.config)
    args = cfg.args
    from ringserve.model.checkpoints.tokenizer import Decoder, load_decoder

    tok = load_decoder(cfg.tokenizer_dir)  # decoding only: `tokenizers` alone once cached
    own_eos = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
    eos_ids = sorted({*cfg.eos_ids, *own_eos})  # the model's and the tokenizer's (the engine sends the model's)

    def decode_tail(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    def ll_tokenizer():  # the vocabulary mapped once, for every grammar (ids past the tokenizer's: never)
        n_vocab = max(cfg.vocab_size, len(tok))
        if isinstance(tok, Decoder):  # what llguidance.hf.from_tokenizer maps, without transformers
            from llguidance import LLTokenizer

            return LLTokenizer(tok.backend_json, n_vocab=n_vocab, eos_token=eos_ids or tok.eos_token_id)
        from llguidance.hf import from_tokenizer

        return from_tokenizer(tok, n_vocab=n_vocab, eos_token=eos_ids or None)

    spin = args.spin_us
    actor = SchedulerActor(
        args, eos_ids, decode_tail, grammars=Grammars(ll_tokenizer, cfg.vocab_size, args.json_options),
        inbox=Ring.attach(ctx.rings["inbox"], spin_us=spin),
        to_runner=BroadcastRing.attach(ctx.rings["to_runner"], reader=None, spin_us=spin),  # the writer
        from_runner=Ring.attach(ctx.rings["from_runner"], spin_us=spin),
        to_detok=Ring.attach(ctx.rings["to_detok"], spin_us=spin),
        loads=LoadBoard.attach(ctx.rings["loads"]) if "loads" in ctx.rings else None, dp_rank=cfg.dp_rank,
    )  # fmt: skip
    actor.core.started_with(cfg.weights)
    ctx.ready()
    actor.serve(ctx.stopping)
