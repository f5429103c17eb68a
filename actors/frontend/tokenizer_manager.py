"""The frontend (SGLang's TokenizerManager), in the Engine's process: tokenizes, sends requests
to the scheduler, gathers the detokenizer's outputs into SGLang-shaped results and streams.

Threads: one asyncio loop (owned here, in a daemon thread) holds every request's state; a
reader thread blocks on the detokenizer's ring and hands each message to that loop. Sends to
the scheduler's ring (single producer) go through one lock, so any thread may submit.

Output of one request (SGLang's format; streamed chunks carry the text and ids so far):

    {"text": str, "output_ids": [int],
     "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...} | None,
                   "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
                   "output_token_logprobs": [(logprob, token_id, text)]            (if asked)
                   "output_top_logprobs": [[(logprob, token_id, text), ...]]}}     (if asked)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from actors.frontend.inputs import RequestSpec
from actors.transport import messages as m

log = logging.getLogger("ringserve.frontend")


class EngineDead(RuntimeError):
    pass


@dataclasses.dataclass(slots=True, eq=False)
class ReqState:
    spec: RequestSpec
    created: float
    text: str = ""
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    finished: bool = False
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    error: BaseException | None = None


class TokenizerManager:
    def __init__(self, tokenizer, to_scheduler, from_detok):
        self.tok = tokenizer
        self.to_scheduler = to_scheduler
        self.from_detok = from_detok
        self.send_lock = threading.Lock()
        self.states: dict[str, ReqState] = {}
        self.replies: collections.deque[tuple[str, asyncio.Future]] = collections.deque()
        self.dead: BaseException | None = None
        self.closing = False
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(
            target=self.loop.run_forever, name="ringserve-frontend-loop", daemon=True
        )
        self.loop_thread.start()
        self.reader = threading.Thread(target=self._read, name="ringserve-frontend-reader", daemon=True)
        self.reader.start()

    # ---- plumbing ---------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine is down: {self.dead}")
        with self.send_lock:
            self.to_scheduler.send(m.encode(msg))

    def submit_threadsafe(self, coro) -> concurrent.futures.Future:
        """Schedule a coroutine on the frontend loop from any thread."""
        if self.closing or self.dead is not None:
            coro.close()
            raise EngineDead(f"the engine is down: {self.dead or 'shut down'}")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(self, coro) -> Any:
        """Run a coroutine on the frontend loop from a plain thread and wait for it."""
        return self.submit_threadsafe(coro).result()

    def _read(self) -> None:
        while not self.closing:
            try:
                raw = self.from_detok.recv(timeout=0.5)
            except Exception as e:  # the ring is gone: the engine is shutting down or died
                if not self.closing:
                    self.loop.call_soon_threadsafe(self.fail_all, e)
                return
            if raw is not None:
                self.loop.call_soon_threadsafe(self._dispatch, raw)

    def _dispatch(self, raw: bytes) -> None:
        try:
            msg = m.to_frontend.decode(raw)
            if isinstance(msg, m.ControlReply):
                if not self.replies or self.replies[0][0] != msg.kind:
                    raise RuntimeError(
                        f"control reply {msg.kind!r} while waiting for {[k for k, _ in self.replies]}"
                    )
                _, fut = self.replies.popleft()
                if not fut.done():
                    fut.set_result(msg)
                return
            self._outputs(msg)
        except Exception as e:  # a protocol bug: fail loudly rather than leave callers waiting
            log.exception("frontend: bad message from the detokenizer")
            self.fail_all(e)

    def _outputs(self, msg: m.BatchStrOut) -> None:
        for o, text in zip(msg.outs, msg.texts, strict=True):
            st = self.states.get(o.rid)
            if st is None:
                continue
            new = m.as_i32(o.new_ids).tolist()
            st.text += text
            st.output_ids += new
            if o.logprobs:
                st.logprobs += m.as_f32(o.logprobs).tolist()
            if o.top_n:
                ids = m.as_i32(o.top_ids).reshape(-1, o.top_n)
                lps = m.as_f32(o.top_logprobs).reshape(-1, o.top_n)
                st.top += [
                    list(zip(lp.tolist(), i.tolist(), strict=True)) for lp, i in zip(lps, ids, strict=True)
                ]
            st.meta.update(
                prompt_tokens=o.prompt_tokens,
                completion_tokens=o.completion_tokens,
                cached_tokens=o.cached_tokens,
            )
            if o.finished:
                st.finished = True
                st.meta["finish_reason"] = o.finish_reason
                st.meta["e2e_latency"] = time.perf_counter() - st.created
                self.states.pop(o.rid, None)
            st.changed.set()

    def fail_all(self, err: BaseException) -> None:
        """An actor died: every pending request and control call gets the error."""
        self.dead = err
        for st in list(self.states.values()):
            st.error = err
            st.changed.set()
        self.states.clear()
        while self.replies:
            _, fut = self.replies.popleft()
            if not fut.done():
                fut.set_exception(EngineDead(f"the engine is down: {err}"))

    async def _fail_all_async(self, err: BaseException) -> None:
        self.fail_all(err)

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, spec: RequestSpec) -> ReqState:
        if spec.rid in self.states:
            raise ValueError(f"rid {spec.rid!r} is already in use by a live request")
        st = ReqState(spec, time.perf_counter(), meta={"id": spec.rid, "finish_reason": None})
        self.states[spec.rid] = st
        try:
            self.send(m.GenerateReq(
                rid=spec.rid, input_ids=m.i32(spec.input_ids), sampling=spec.sampling,
                return_logprob=spec.return_logprob, top_logprobs_num=spec.top_logprobs_num,
            ))  # fmt: skip
        except BaseException:
            self.states.pop(spec.rid, None)
            raise
        return st

    async def stream(self, st: ReqState) -> AsyncIterator[dict]:
        """Yields the result so far each time new output arrives; the last one is finished."""
        while True:
            await st.changed.wait()
            st.changed.clear()
            if st.error is not None:
                raise EngineDead(f"request {st.spec.rid} lost: the engine is down: {st.error}")
            yield self.result(st)
            if st.finished:
                return

    async def wait(self, st: ReqState) -> dict:
        """The finished result (no intermediate results are built)."""
        while not st.finished:
            await st.changed.wait()
            st.changed.clear()
            if st.error is not None:
                raise EngineDead(f"request {st.spec.rid} lost: the engine is down: {st.error}")
        return self.result(st)

    def result(self, st: ReqState) -> dict:
        meta = dict(st.meta)
        if st.spec.return_logprob:
            texts = self._token_texts(st.output_ids)
            meta["output_token_logprobs"] = [
                (lp, t, texts[t]) for lp, t in zip(st.logprobs, st.output_ids, strict=False)
            ]
            if st.spec.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [(lp, t, self._token_texts([t])[t]) for lp, t in row] for row in st.top
                ]
        return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}

    def _token_texts(self, ids: list[int]) -> dict[int, str]:
        return {t: self.tok.decode([t]) for t in set(ids)}

    async def control(self, msg: Any, kind: str) -> m.ControlReply:
        fut = self.loop.create_future()
        self.replies.append((kind, fut))
        try:
            self.send(msg)
        except BaseException:
            self.replies.remove((kind, fut))
            raise
        return await fut

    async def server_info(self) -> dict:
        reply = await self.control(m.InfoReq(), "info")
        return json.loads(reply.payload)

    def abort(self, rid: str | None) -> None:
        self.send(m.AbortReq(rid))

    def close(self) -> None:
        """Fail whatever is still pending (callers get EngineDead, nobody hangs), stop threads."""
        if self.loop.is_running() and not self.closing:
            fut = asyncio.run_coroutine_threadsafe(
                self._fail_all_async(EngineDead("the engine was shut down")), self.loop
            )
            with contextlib.suppress(Exception):
                fut.result(timeout=2)
        self.closing = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.reader.join(timeout=2)
        self.loop_thread.join(timeout=2)
