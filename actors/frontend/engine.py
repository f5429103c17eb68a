"""`Engine`: the in-process API. Launches the scheduler, runner and detokenizer actors over
shared-memory rings and serves `generate` through the frontend (actors/frontend.py).

    with Engine("tiny", page_size=16) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        for chunk in engine.generate(prompt, stream=True): ...
        engine.pause_generation("retract"); engine.flush_cache(); engine.continue_generation()

`model_path=None` is SmolLM2-135M-Instruct (fetched once into the cache), "tiny" the generated
tiny Llama, else a model directory or a .gguf file. Every other keyword is a ServerArgs field.
Bad input raises ValueError naming the field and the limit before anything is sent, so the
engine keeps serving every other request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

from actors.frontend.inputs import normalize_generate
from actors.frontend.tokenizer_manager import EngineDead, TokenizerManager
from actors.server_args import ServerArgs
from actors.transport import messages as m

log = logging.getLogger("ringserve.engine")

READY_TIMEOUT_S = 900.0  # model load + compiling every bucket, on a slow CPU
PAUSE_MODES = ("abort", "retract", "in_place")


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any):
        from actors.transport.launcher import ActorGroup
        from model.checkpoints.config import ModelConfig
        from model.checkpoints.resolve import resolve_model
        from model.checkpoints.tokenizer import load_tokenizer

        self.args = args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        if args.num_pages - 1 < -(-args.context_length // args.page_size) + 1:
            raise ValueError(f"max_total_tokens={args.max_total_tokens}: the KV pool must hold one request of context_length="
                             f"{args.context_length} plus a page ({(-(-args.context_length // args.page_size) + 2) * args.page_size} tokens)")  # fmt: skip
        self.model_dir, tok_dir = resolve_model(args.model_path)
        self.tokenizer = load_tokenizer(tok_dir)
        mc = ModelConfig.from_dir(self.model_dir) if self.model_dir.is_dir() else None
        eos = set(mc.eos_token_ids if mc else ())
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.vocab_size = mc.vocab_size if mc else len(self.tokenizer)
        cfg = m.encode(m.ActorConfig(args, str(self.model_dir), str(tok_dir), sorted(eos), self.vocab_size))

        self._seeds = random.Random(args.seed)  # seeds of requests that give none
        self.group = group = ActorGroup(
            on_failure=self._on_failure, log_level=getattr(logging, args.log_level.upper())
        )
        self._closed = False
        try:
            cap, spin = args.ring_bytes, args.spin_us
            sched_in = group.ring("sched", cap, spin_us=spin)
            runner_in = group.broadcast_ring("runner", 1, cap, spin_us=spin)
            runner_out = group.ring("result", cap, spin_us=spin)
            detok_in = group.ring("detok", cap, spin_us=spin)
            front_in = group.ring("front", cap, spin_us=spin)
            sched_rings = {
                "inbox": sched_in.name,
                "to_runner": runner_in.name,
                "from_runner": runner_out.name,
                "to_detok": detok_in.name,
            }
            group.spawn("scheduler", "actors.scheduler.loop:run", cfg, sched_rings)
            group.spawn(
                "runner", "actors.runner.runner:run", cfg, {"inbox": runner_in.name, "outbox": runner_out.name}
            )
            group.spawn(
                "detokenizer",
                "actors.detokenizer.actor:run",
                cfg,
                {"inbox": detok_in.name, "outbox": front_in.name},
            )
            self.frontend = TokenizerManager(self.tokenizer, sched_in, front_in)
            group.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def _on_failure(self, name: str, exitcode: int | None, traceback_text: str) -> None:
        err = EngineDead(f"actor {name!r} died (exit code {exitcode}):\n{traceback_text}")
        log.error("%s", err)
        fe = getattr(self, "frontend", None)
        if fe is not None:
            fe.loop.call_soon_threadsafe(fe.fail_all, err)

    # ---- generation -------------------------------------------------------------------------
    def _specs(self, prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num):
        return normalize_generate(
            prompt=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
            encode=self.tokenizer.encode, vocab_size=self.vocab_size, context_length=self.args.context_length,
            max_top_logprobs_num=self.args.max_top_logprobs_num, next_seed=lambda: self._seeds.getrandbits(63),
        )  # fmt: skip

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                             top_logprobs_num: int | list[int] = 0, rid: str | list[str] | None = None,
                             stream: bool = False) -> Any:  # fmt: skip
        """Like `generate`, on the caller's event loop: a result (or list), or with stream=True an
        async iterator of chunks (each with "index" when several requests were given).
        Cancelling the caller's task aborts its requests."""
        specs, batched = self._specs(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num
        )
        fe = self.frontend
        states = await asyncio.wrap_future(fe.submit_threadsafe(self._submit(specs)))
        if stream:
            return self._astream(states, batched)
        try:
            outs = [await asyncio.wrap_future(fe.submit_threadsafe(fe.wait(st))) for st in states]
        except BaseException:
            self._abort_unfinished(states)
            raise
        return outs if batched else outs[0]

    async def _submit(self, specs):
        fe = self.frontend
        states = []
        try:
            for s in specs:
                states.append(await fe.submit(s))
        except BaseException:
            self._abort_unfinished(states)  # all or nothing: do not leave half a batch running
            raise
        return states

    def _abort_unfinished(self, states) -> None:
        for st in states:
            if not st.finished:
                with contextlib.suppress(Exception):  # the engine may be down already
                    self.frontend.abort(st.spec.rid)

    def _pump(self, states, put) -> list:
        """Forward every state's chunks to `put((i, chunk, error))`; (i, None, None) ends one."""
        fe = self.frontend

        async def pump(i, st):
            try:
                async for out in fe.stream(st):
                    put((i, out, None))
                put((i, None, None))
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                put((i, None, e))

        return [fe.submit_threadsafe(pump(i, st)) for i, st in enumerate(states)]

    @staticmethod
    def _route(item: tuple, batched: bool) -> dict | None:
        """A pump's (i, chunk, error): the chunk to yield (with "index" in a batch), None when
        request i has ended; its error is raised."""
        i, out, err = item
        if err is not None:
            raise err
        if out is not None and batched:
            out["index"] = i
        return out

    def _stop_streams(self, pumps: list, states) -> None:
        """The caller stopped early (break, cancel, error): stop generating."""
        for p in pumps:
            p.cancel()
        self._abort_unfinished(states)

    async def _astream(self, states, batched: bool) -> AsyncIterator[dict]:
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        pumps = self._pump(states, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        try:
            left = len(states)
            while left:
                out = self._route(await queue.get(), batched)
                left -= out is None
                if out is not None:
                    yield out
        finally:
            self._stop_streams(pumps, states)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                 top_logprobs_num: int | list[int] = 0, rid: str | list[str] | None = None,
                 stream: bool = False) -> Any:  # fmt: skip
        """Generate for one prompt (a result dict) or many (a list, in order). stream=True returns
        an iterator of chunks with the text and ids so far, the last one finished; leaving the
        iterator early aborts its unfinished requests."""
        specs, batched = self._specs(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num
        )
        fe = self.frontend
        states = fe.run_sync(self._submit(specs))
        if stream:
            return self._stream_sync(states, batched)
        try:
            outs = [fe.run_sync(fe.wait(st)) for st in states]
        except BaseException:  # KeyboardInterrupt while waiting, or the engine died
            self._abort_unfinished(states)
            raise
        return outs if batched else outs[0]

    def _stream_sync(self, states, batched: bool) -> Iterator[dict]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        pumps = self._pump(states, q.put)
        try:
            left = len(states)
            while left:
                out = self._route(q.get(), batched)
                left -= out is None
                if out is not None:
                    yield out
        finally:
            self._stop_streams(pumps, states)

    # ---- control ----------------------------------------------------------------------------
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request (its partial output returns with finish_reason abort), the n
        samples `rid-0 ... rid-(n-1)` of a request made with n > 1, or every request."""
        if abort_all:
            self.frontend.abort(None)
            return
        if not (isinstance(rid, str) and rid):
            raise ValueError(
                f"abort_request: rid={rid!r} must be a non-empty string (or pass abort_all=True)"
            )
        fe = self.frontend
        live = list(fe.states)  # a snapshot; a request finishing meanwhile is a no-op abort
        samples = [
            r
            for r in live
            if r.startswith(rid + "-") and fe.states.get(r) is not None and fe.states[r].spec.sampling.n > 1
        ]
        for r in [rid] + samples:
            fe.abort(r)

    def pause_generation(self, mode: str = "abort") -> dict:
        """Returns when the scheduler is quiet: abort (every request finishes with 'abort'),
        retract (KV freed, requests wait) or in_place (everything kept)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: choose one of {list(PAUSE_MODES)}")
        return self._control(m.PauseReq(mode), "pause")

    def continue_generation(self) -> dict:
        return self._control(m.ContinueReq(), "continue")

    def flush_cache(self) -> dict:
        """Empty the prefix cache and KV pools; refused (success False, with the reason) while a
        request holds KV."""
        return self._control(m.FlushCacheReq(), "flush")

    def _control(self, msg: Any, kind: str) -> dict:
        r = self.frontend.run_sync(self.frontend.control(msg, kind))
        return {"success": r.ok, "message": r.message}

    def get_server_info(self) -> dict:
        info = self.frontend.run_sync(self.frontend.server_info())
        info["model_path"] = str(self.model_dir)
        info["server_args"] = {k: getattr(self.args, k) for k in self.args.__dataclass_fields__}
        return info

    # ---- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        fe = getattr(self, "frontend", None)
        if fe is not None:
            fe.close()
        self.group.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
