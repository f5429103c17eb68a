"""The frontend (SGLang's TokenizerManager): the process side around `FrontendCore`
(actors/frontend/core.py). It validates and tokenizes (actors/frontend/inputs.py), sends
requests to the scheduler, hands the detokenizer's outputs to the core's request table and
serves results and streams. Every surface calls the async verbs below on the frontend loop:
the in-process Engine (through actors/frontend/bridge.py), the IPC socket server and the HTTP
server. So they share one request table, one abort path, one set of metrics.

Threads: one asyncio loop (a LoopThread) holds every request's state; a reader thread per
data-parallel group blocks on that group's detokenizer ring and hands each message to that loop.
Sends to the schedulers' rings (single producer each) go through one lock, so any thread may
send. Results are SGLang's dicts (their shape is drawn in core.py).

Data-parallel groups (dp_size > 1): a request goes to the group the `Dispatcher` picks
(actors/frontend/dispatch.py) and stays there (a resubmission after a restart too); a control
call goes to every group and is answered once every group did (`combine`).

The frontend's own state is the record of what the scheduler must know: when an actor dies,
what was sent to the dead actors is lost with them (a send to their closed ring is dropped), and
once the supervisor has started them again (actors/frontend/supervisor.py) `reattach` gives the
new scheduler everything again: the request table (each request with what its caller already
has; an abort asked meanwhile is redone) and the control calls still waiting for their reply.
If the supervisor gives up, `fail_all` ends them all instead.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, TypeVar

from ringserve.actors.frontend.bridge import LoopThread
from ringserve.actors.frontend.core import FrontendCore, ReqState, generate_req
from ringserve.actors.frontend.dispatch import Dispatcher
from ringserve.actors.frontend.errors import EngineDead
from ringserve.actors.frontend.inputs import GenerateArgs, Limits, RequestSpec, normalize_generate
from ringserve.actors.frontend.limits import bytes_per_token
from ringserve.actors.frontend.lora import LoraAPI
from ringserve.actors.frontend.weights import WeightsAPI
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport import messages as m
from ringserve.actors.transport.ring import RingClosed
from ringserve.actors.transport.topology import EngineLinks

log = logging.getLogger("ringserve.frontend")

PAUSE_MODES = ("abort", "retract", "in_place")
T = TypeVar("T")


@dataclasses.dataclass(slots=True, eq=False)
class Call:
    """A control call waiting for every group's reply (each group's replies come in the order
    its calls were sent). `replies[r]` is group r's; `fut` gets the combined reply
    (`combine`) once all are in."""

    kind: str
    fut: asyncio.Future
    msg: Any  # sent again to actors started anew while it waits (a weight update is not: it fails)
    restore: bool = False  # sent by `reattach` itself (the next one sends its own)
    replies: list[m.ControlReply | None] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(r is not None for r in self.replies)


def combine(replies: list[m.ControlReply]) -> m.ControlReply:
    """One reply for a call every group answered: ok only if every group's was; the message is
    the groups' common one, or each group's ("dp_rank r: ..."); group 0's payload."""
    first = replies[0]
    texts = {r.message for r in replies}
    message = first.message if len(texts) == 1 else "; ".join(f"dp_rank {k}: {r.message}" for k, r in enumerate(replies))
    return m.ControlReply(first.kind, all(r.ok for r in replies), message, first.payload, first.shape)


class TokenizerManager:
    def __init__(self, tokenizer, links: EngineLinks | None = None, *, args: ServerArgs, vocab_size: int,
                 sampling_defaults: dict[str, Any] | None = None):  # fmt: skip
        self.tok = tokenizer
        self.args = args
        # the model's sampling defaults (model/checkpoints/generation.py), for what a request leaves out
        self.sampling_defaults: dict[str, Any] = dict(sampling_defaults or {})
        self.dp_size = args.dp_size
        self.send_lock = threading.Lock()
        self.core = FrontendCore(tokenizer, num_draft_tokens=args.speculative_num_draft_tokens)
        self.limits = Limits(vocab_size, args.context_length, args.max_top_logprobs_num, bytes_per_token(tokenizer),
                             args.max_token_ids_logprob, args.dp_size, args.enable_return_hidden_states,
                             args.enable_return_routed_experts)  # fmt: skip
        self.dispatcher = Dispatcher(args.dp_size, args.load_balance_method, args.page_size, args.num_pages)
        self.replies: list[collections.deque[Call]] = [collections.deque() for _ in range(args.dp_size)]
        self.held: asyncio.Event | None = None  # set while a weight update holds new requests (dp_size > 1)
        self.dead: BaseException | None = None
        self.closing = False
        self.journal: Any = None  # told every confirmed control call (the supervisor's Journal), if any
        # the journal's work (a pushed bucket's host copy: up to a bucket of bytes) runs here, in
        # reply order, off the event loop; the caller's reply waits for it (its segment must live)
        self._journal_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ringserve-journal")
        self.static_info: dict[str, Any] = {}  # model_path, served_model_name: set when ready
        self.actor_pids: Callable[[], dict[str, int | None]] = dict  # the actors serving now (the Engine's)
        self.runner_info: Callable[[], dict[str, Any]] = dict  # the serving runner's (devices, programs)
        self.refusing: str | None = None  # set while shutting down: new requests are refused
        self.weights = WeightsAPI(self)
        self.loras = LoraAPI(self, args)
        self.on_close: list[Callable[[], None]] = []  # run first by close() (the servers' stop)
        self._seeds = random.Random(args.seed)  # seeds of requests that give none
        self.lt = LoopThread("ringserve-frontend-loop")
        self.loop = self.lt.loop
        self.readers: list[threading.Thread] = []
        if links is not None:
            self.attach(links)

    # ---- plumbing ---------------------------------------------------------------------------
    def attach(self, links: EngineLinks) -> None:
        """Talk to the actors through these rings (each group's scheduler inbox and detokenizer
        outbox); a reader thread per outbox; the dispatcher reads the groups' load board."""
        if links.dp_size != self.dp_size:
            raise ValueError(f"attach: {links.dp_size} groups for dp_size={self.dp_size}")
        self.links = links
        board = links.loads
        self.dispatcher.attach(board.read_all if board is not None else None)
        self.readers = [threading.Thread(target=self._read, args=(ring, r), daemon=True,
                                         name=f"ringserve-frontend-reader{'' if self.dp_size == 1 else r}")
                        for r, ring in enumerate(links.from_detok)]  # fmt: skip
        for t in self.readers:
            t.start()

    def send(self, msg: Any, rank: int = 0) -> None:
        """To group `rank`'s scheduler. A closed ring (its actors died) drops the message: the
        request table and the calls waiting are what `reattach` sends again, or `fail_all` fails."""
        if self.dead is not None:
            raise EngineDead(f"the engine is down: {self.dead}")
        with self.send_lock:
            try:
                self.links.to_scheduler[rank].send(m.encode(msg))
            except RingClosed:
                pass

    def send_all(self, msg: Any) -> None:
        for r in range(self.dp_size):
            self.send(msg, r)

    def check_up(self) -> None:
        if self.closing or self.dead is not None:
            raise EngineDead(f"the engine is down: {self.dead or 'shut down'}")

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the frontend loop from a plain thread and wait for it."""
        if self.closing or self.dead is not None:
            coro.close()
            self.check_up()
        return self.lt.run(coro)

    def submit_threadsafe(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine on the frontend loop from any thread."""
        if self.closing or self.dead is not None:
            coro.close()
            self.check_up()
        return self.lt.submit(coro)

    def _read(self, ring, rank: int) -> None:
        while not self.closing:
            try:
                raw = ring.recv(timeout=0.5)
            except RingClosed:  # its actors are gone: shut down, or died (the supervisor's to handle)
                return
            except Exception as e:
                if not self.closing:
                    self.loop.call_soon_threadsafe(self.fail_all, e)
                return
            if raw is not None:
                self.loop.call_soon_threadsafe(self._dispatch, raw, rank)

    def _dispatch(self, raw: bytes, rank: int = 0) -> None:
        try:
            msg = m.to_frontend.decode(raw)
            if isinstance(msg, m.ControlReply):
                waiting = self.replies[rank]
                if not waiting or waiting[0].kind != msg.kind:
                    raise RuntimeError(
                        f"control reply {msg.kind!r} from dp_rank {rank} while waiting for {[c.kind for c in waiting]}"
                    )
                self._replied(waiting.popleft(), msg, rank)
                return
            self.core.apply(msg, time.perf_counter())
            for o in msg.outs:
                self.dispatcher.started(o.rid)
        except Exception as e:  # a protocol bug: fail loudly rather than leave callers waiting
            log.exception("frontend: bad message from the detokenizer")
            self.fail_all(e)

    def _replied(self, call: Call, reply: m.ControlReply, rank: int) -> None:
        """Group `rank`'s reply to a control call. Once every group answered, the journal learns
        what they confirmed (even when the caller stopped waiting; on its thread, in order), then
        the caller gets it."""
        call.replies[rank] = reply
        if not call.complete:
            return
        combined = combine(call.replies)  # type: ignore[arg-type]

        def answer(_: Any = None) -> None:
            if not call.fut.done():
                call.fut.set_result(combined)

        if self.journal is None or call.restore:
            answer()
            return
        done = self.loop.run_in_executor(self._journal_thread, self.journal.confirmed, call.msg, combined)
        done.add_done_callback(answer)

    async def journal_settled(self) -> None:
        """Once every reply dispatched before this call is in the journal (the supervisor reads
        it to restart)."""
        await self.loop.run_in_executor(self._journal_thread, lambda: None)

    def fail_all(self, err: BaseException) -> None:
        """An actor died: every pending request and control call gets the error."""
        self.dead = err
        self.core.fail_all(err)
        for waiting in self.replies:
            while waiting:
                fut = waiting.popleft().fut
                if not fut.done():
                    fut.set_exception(EngineDead(f"the engine is down: {err}"))

    async def reattach(self, links: EngineLinks, restore: list[tuple[str, Any]],
                       lost_update: m.ControlReply) -> tuple[list[asyncio.Future], int]:  # fmt: skip
        """Run once the old reader has ended (every output it read is applied): the
        actors were started again; give the new scheduler, in this order, `restore` (control
        messages that bring back the engine's state: the supervisor's journal), every live
        request again (`FrontendCore.resubmission`; one whose abort was asked, aborted again),
        then every control call still waiting, sent again, but a weight update's, which gets
        `lost_update` (its parts may have reached the dead runner: the caller retries). Returns
        the futures of the `restore` replies and how many requests were resubmitted. Every
        request goes back to the group it was in (every group was started again)."""
        waiting = list({id(c): c for q in self.replies for c in q if not c.fut.done()}.values())
        for q in self.replies:
            q.clear()
        futs = []

        def send(msg: Any, rank: int) -> None:
            try:
                links.to_scheduler[rank].send(m.encode(msg))
            except RingClosed:  # these actors died too: the next reattach sends it all again
                pass

        def call_all(call: Call) -> None:
            call.replies = [None] * self.dp_size
            for r in range(self.dp_size):
                self.replies[r].append(call)
                send(call.msg, r)

        with self.send_lock:
            self.attach(links)
            for kind, msg in restore:
                futs.append(self.loop.create_future())
                call_all(Call(kind, futs[-1], msg, restore=True))
            live = list(self.core.states.values())
            for st in live:
                send(self.core.resubmission(st), st.dp_rank)
                self.dispatcher.sent(st.dp_rank, st.spec.input_ids, rid=st.spec.rid)
                if st.aborted:
                    send(m.AbortReq(st.spec.rid), st.dp_rank)
            for call in waiting:
                if call.restore:
                    call.fut.cancel()
                elif call.kind == "update_weights":
                    for r in range(self.dp_size):
                        self._replied(call, lost_update, r)
                else:
                    call_all(call)
        return futs, len(live)

    # ---- generation -------------------------------------------------------------------------
    def specs(self, args: GenerateArgs) -> tuple[list[RequestSpec], bool]:
        """Validate and normalise one generate call (any thread): ValueError naming the field
        and the limit, before anything is sent; session turns get their earlier turns' tokens.
        Returns (specs, batched)."""
        return normalize_generate(
            args, self.limits, encode=self.tok.encode, next_seed=lambda: self._seeds.getrandbits(63),
            sessions=self.core.sessions, bos_token_id=self.tok.bos_token_id, check_lora=self.loras.check,
            sampling_defaults=self.sampling_defaults,
        )  # fmt: skip

    def refuse_new(self, reason: str) -> None:
        """From now on every new request fails with EngineDead(reason) (graceful shutdown)."""
        self.refusing = reason

    async def submit(self, spec: RequestSpec, rank: int | None = None) -> ReqState:
        """Send one request to group `rank` (None: the dispatcher's pick)."""
        while self.held is not None:  # a weight update across groups is deciding (weights.py)
            await self.held.wait()
        self.check_up()
        if self.refusing is not None:
            raise EngineDead(self.refusing)
        sid = spec.session.session.id if spec.session is not None else None
        if rank is None:
            rank = self.dispatcher.pick(spec.input_ids, spec.data_parallel_rank, sid)
        st = self.core.add(spec, time.perf_counter())
        st.dp_rank = rank
        try:
            self.send(generate_req(spec), rank)
        except BaseException:
            self.core.drop(spec.rid)
            raise
        self.dispatcher.sent(rank, spec.input_ids, sid, spec.rid)
        if spec.session is not None and spec.session.abort:  # `replace` dropped these unfinished turns
            self.abort(spec.session.abort)
        self.core.metrics.submitted(len(spec.input_ids))
        return st

    async def submit_all(self, specs: list[RequestSpec]) -> list[ReqState]:
        """Submit every request or none (a failure aborts those already sent)."""
        states: list[ReqState] = []
        family: dict[str, int] = {}  # the n samples of one request go where the first went
        try:
            for s in specs:
                st = await self.submit(s, family.get(s.sample_of) if s.sample_of is not None else None)
                if s.sample_of is not None:
                    family[s.sample_of] = st.dp_rank
                states.append(st)
        except BaseException:
            self.abort_unfinished(states)
            raise
        return states

    def abort_unfinished(self, states: list[ReqState]) -> None:
        live = [st.spec.rid for st in states if not st.finished and st.error is None]
        if live and self.dead is None and not self.closing:
            try:
                self.abort(live)
            except Exception:  # the engine went down meanwhile: nothing left to abort
                pass

    def abort(self, rids: list[str] | None) -> None:
        """Ask the scheduler to abort these requests (None: every one). Each is marked first, so
        an abort that a restart of the actors loses is asked again of its resubmitted request."""
        states = list(self.core.states.values()) if rids is None else [self.core.states.get(r) for r in rids]
        for st in states:
            if st is not None:
                st.aborted = True
        if rids is None:
            self.send_all(m.AbortReq(None))
            return
        for rid, st in zip(rids, states, strict=True):
            if st is not None:
                self.send(m.AbortReq(rid), st.dp_rank)
            else:  # not live here (finished, or never known): whichever group has it
                self.send_all(m.AbortReq(rid))

    async def generate(self, specs: list[RequestSpec], batched: bool) -> Any:
        """Every request's finished result (a list when batched). Cancelling aborts them."""
        states = await self.submit_all(specs)
        try:
            outs = [await self.wait(st) for st in states]
        except BaseException:  # cancelled (caller gone, KeyboardInterrupt) or the engine died
            self.abort_unfinished(states)
            raise
        return outs if batched else outs[0]

    async def generate_stream(self, specs: list[RequestSpec], batched: bool) -> AsyncGenerator[dict, None]:
        """Chunks with the text and ids so far, as they come (each with "index" when batched);
        each request's last chunk is finished. Leaving early aborts what still runs."""
        states = await self.submit_all(specs)
        async for chunk in self.stream_states(states, batched):
            yield chunk

    async def stream_states(self, states: list[ReqState], batched: bool,
                            incremental: bool | None = None) -> AsyncGenerator[dict, None]:  # fmt: skip
        """`generate_stream` of requests already submitted (aborted if the caller leaves). A
        caller that lags costs one chunk, not one per output (`FrontendCore.chunks`). Chunks are
        cumulative, or only what is new with `incremental` (None: the server's
        `incremental_streaming_output`; OpenAI's routes make their deltas from cumulative ones)."""
        if incremental is None:
            incremental = self.args.incremental_streaming_output
        try:
            async for out in self.core.chunks(states, batched, incremental):
                yield out
        finally:
            self.abort_unfinished(states)

    async def wait(self, st: ReqState) -> dict:
        """The finished result (no intermediate results are built)."""
        while not st.finished:
            await st.changed.wait()
            st.changed.clear()
            if st.error is not None:
                raise EngineDead(f"request {st.spec.rid} lost: the engine is down: {st.error}")
        return self.core.result(st)

    # ---- control ----------------------------------------------------------------------------
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request (its partial output returns with finish_reason abort), the n
        samples `rid-0 ... rid-(n-1)` of a request made with n > 1, or every request."""
        self.check_up()
        if abort_all:
            self.abort(None)
            return
        if not (isinstance(rid, str) and rid):
            raise ValueError(f"abort_request: rid={rid!r} must be a non-empty string (or pass abort_all=True)")
        self.abort(self.core.with_samples(rid))

    async def control(self, msg: Any, kind: str) -> m.ControlReply:
        """Send `msg` to every group; their combined reply (`combine`: ok only if every group's
        was, with each group's message where they differ)."""
        return (await self._call(msg, kind)).fut.result()

    async def control_all(self, msg: Any, kind: str) -> list[m.ControlReply]:
        """Send `msg` to every group; each group's reply, by rank."""
        return (await self._call(msg, kind)).replies  # type: ignore[return-value]

    async def _call(self, msg: Any, kind: str) -> Call:
        self.check_up()
        call = Call(kind, self.loop.create_future(), msg, replies=[None] * self.dp_size)
        for q in self.replies:
            q.append(call)
        try:
            self.send_all(msg)
        except BaseException:
            for q in self.replies:
                q.remove(call)
            raise
        await call.fut
        return call

    async def _ok(self, msg: Any, kind: str) -> dict:
        r = await self.control(msg, kind)
        return {"success": r.ok, "message": r.message}

    async def pause_generation(self, mode: str = "abort") -> dict:
        """Returns when the scheduler is quiet: abort (every request finishes with 'abort'),
        retract (KV freed, requests wait) or in_place (everything kept)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: choose one of {list(PAUSE_MODES)}")
        return await self._ok(m.PauseReq(mode), "pause")

    async def pause_after_inflight(self, poll_s: float = 0.01) -> dict:
        """vLLM's pause mode `wait`: new requests wait at the front door while every request in
        flight finishes, then the scheduler pauses (in place: nothing is left running) and the
        new ones queue there until `continue_generation`."""
        while self.held is not None:  # (a weight update across groups is deciding)
            await self.held.wait()
        self.held = held = asyncio.Event()
        try:
            if not (await self.get_server_info())["paused"]:  # (paused already: nothing in flight moves)
                inflight = list(self.core.states.values())
                while any(not st.finished and st.error is None for st in inflight):
                    await asyncio.sleep(poll_s)
            return await self.pause_generation("in_place")
        finally:
            self.held = None
            held.set()

    async def continue_generation(self) -> dict:
        return await self._ok(m.ContinueReq(), "continue")

    async def flush_cache(self) -> dict:
        """Empty the prefix cache and KV pools; refused (success False, with the reason) while a
        request holds KV."""
        out = await self._ok(m.FlushCacheReq(), "flush")
        self.dispatcher.flushed()
        return out

    # ---- sessions -----------------------------------------------------------------------------
    async def open_session(self, capacity_of_str_len: int = 0, session_id: str | None = None) -> str:
        """A streaming session: its turns (generate with session_params={"id": ...}) extend
        the KV of the turn they follow instead of recomputing it. Returns its id."""
        return self.core.sessions.open_session(capacity_of_str_len, session_id)

    async def close_session(self, session_id: str) -> None:
        """Forget the session: unfinished turns are aborted, its kept KV is freed."""
        self.check_up()
        unfinished = self.core.sessions.close_session(session_id)
        if unfinished:
            self.abort(unfinished)
        self.send_all(m.CloseSessionReq(session_id))
        self.dispatcher.session_closed(session_id)

    async def get_server_info(self) -> dict:
        """The server's facts; with dp_size > 1 group 0's at the top level (as one group's) and
        every group's in `dp_groups` (by rank), `weight_version` their common one."""
        groups = [json.loads(r.payload) for r in await self.control_all(m.InfoReq(), "info")]
        info = dict(groups[0])
        info["dp_size"] = self.dp_size
        if self.dp_size > 1:
            info["dp_groups"] = groups
            info["load_balance_method"] = self.args.load_balance_method
            for key in ("programs_pending",):
                info[key] = sum(g[key] for g in groups)
            errors = [g["compile_error"] for g in groups if g["compile_error"]]
            info["compile_error"] = errors[0] if errors else None
        info["server_args"] = self.args.public()
        info["frontend_requests"] = len(self.core.states)
        info.update(self.core.metrics.restart_info(), actor_pids=self.actor_pids(), runner=self.runner_info())
        return {**self.static_info, **info}

    async def get_model_info(self) -> dict[str, Any]:
        return self.model_info()

    def model_info(self) -> dict[str, Any]:
        """SGLang's get_model_info, and the sampling defaults a request leaves out takes."""
        path = self.static_info.get("model_path")
        return {"model_path": path, "tokenizer_path": path, "is_generation": True,
                "served_model_name": self.static_info.get("served_model_name"),
                "default_sampling_params": dict(self.sampling_defaults)}  # fmt: skip

    async def wait_compiled(self, timeout: float = 900.0) -> dict:
        """Once the runner has compiled every step program: the server info. It serves as soon
        as the largest program of each kind is compiled and compiles the others in the
        background (`serve_while_compiling`), steps padding to a larger program meanwhile:
        wait for this before timing anything. TimeoutError / RuntimeError (a failed compile)."""
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        while True:
            info = await self.get_server_info()
            if info["compile_error"]:
                raise RuntimeError(f"the runner's background compile failed: {info['compile_error']}")
            if not info["programs_pending"]:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"{info['programs_pending']} step programs still compiling after {timeout:.0f}s")
            await asyncio.sleep(0.5)

    async def get_load(self) -> dict:
        """{num_running_reqs, num_waiting_reqs, kv tokens used / total, token_usage}, summed over
        the groups (`get_loads`: each group's)."""
        loads = await self.get_loads()
        if len(loads) == 1:
            return {k: v for k, v in loads[0].items() if k not in ("dp_rank", "num_reqs", "num_tokens")}
        out = {k: sum(ld[k] for ld in loads) for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                                                       "max_total_num_tokens")}  # fmt: skip
        out["token_usage"] = round(out["num_used_tokens"] / out["max_total_num_tokens"], 6)
        return out

    async def get_loads(self) -> list[dict]:
        """One entry per group, SGLang's shape (`dp_rank`, `num_reqs` = running + waiting,
        `num_waiting_reqs`, `num_tokens` = KV tokens used, and the scheduler's own keys)."""
        out = []
        for r, reply in enumerate(await self.control_all(m.LoadReq(), "load")):
            ld = json.loads(reply.payload)
            out.append({"dp_rank": r, "num_reqs": ld["num_running_reqs"] + ld["num_waiting_reqs"],
                        "num_tokens": ld["num_used_tokens"], **ld})  # fmt: skip
        return out

    async def health(self) -> bool:
        """True while every actor is up and the scheduler answers."""
        if self.dead is not None or self.closing:
            return False
        try:
            await asyncio.wait_for(self.get_load(), timeout=20.0)
        except (EngineDead, TimeoutError):
            return False
        return True

    # ---- shutdown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the servers on this frontend, fail whatever is still pending (callers get
        EngineDead, nobody hangs), stop threads. Never waits on a loop that cannot run (at
        interpreter exit)."""
        for stop in self.on_close:
            try:
                stop()
            except Exception:
                log.exception("frontend: closing")
        self.on_close.clear()
        if not self.closing and self.lt.usable and not self.lt.on_loop:

            async def fail() -> None:
                self.fail_all(EngineDead("the engine was shut down"))

            try:
                self.lt.run(fail())
            except Exception:
                pass
        self.closing = True
        self.lt.stop()
        self._journal_thread.shutdown(wait=False, cancel_futures=True)
        for t in self.readers:
            t.join(timeout=2)
