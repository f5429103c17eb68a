"""Python clients of `ringserve serve`'s IPC socket, with the Engine's verbs and signatures.

    from ringserve import Client
    with Client("/run/user/1000/ringserve-abc/engine.sock") as c:
        out = c.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        for chunk in c.generate(["a", "b"], stream=True): print(chunk["index"], chunk["text"])

A trainer on the same host pushes its weights with `update_weights_from_tensor` (through
shared memory the server makes, bucket by bucket: actors/frontend/weight_push.py).

`AsyncClient` multiplexes every call over one connection (calls are told apart by id);
`Client` runs an AsyncClient on a private loop thread for plain code. Errors arrive as the
Engine raises them: `ValueError` with the Engine's text for bad input, `EngineDead` when the
server is down or the connection is lost. Leaving a stream early cancels it on the server
(its requests are aborted); closing the client, or its process dying, cancels every call.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import warnings
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

from ringserve.actors.frontend import protocol as p
from ringserve.actors.frontend.bridge import LoopThread, iterate_in_thread
from ringserve.actors.frontend.errors import EngineDead
from ringserve.actors.frontend.inputs import GenerateArgs
from ringserve.actors.frontend.weight_buckets import (
    BUCKET_BYTES,
    Segment,
    buckets,
    check_bucket_bytes,
    write_next,
)
from ringserve.model.weights.delta import check_mode

CLIENT_MAX_FRAME = 1 << 30  # replies can be large (a batch with top logprobs)
CLOSE_TIMEOUT_S = 5.0  # a sync client's close waits this long for its connection to close
_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "EngineDead": EngineDead}
_open: weakref.WeakSet[Client | AsyncClient] = weakref.WeakSet()  # clients not closed yet


@atexit.register
def _at_exit() -> None:
    """Clients left open at exit (e.g. made at module level): atexit runs before daemon threads
    are stopped, so a Client's loop can still close its connection now; later it cannot."""
    for c in list(_open):
        c._left_open()


def _error(f: p.Failed) -> Exception:
    return _ERRORS.get(f.kind, RuntimeError)(f.message)


class AsyncClient:
    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self._calls: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._lost: Exception | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ---- connection -------------------------------------------------------------------------
    async def connect(self) -> None:
        async with self._lock:
            if self._writer is not None:
                return
            if self._lost is not None:
                raise self._lost
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path, limit=1 << 16)
            except OSError as e:
                raise EngineDead(f"cannot connect to {self.socket_path}: {e}") from None
            self._loop = asyncio.get_running_loop()
            self._closed = False
            _open.add(self)
            self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._reader is not None
        try:
            while True:
                n = p.body_length(await self._reader.readexactly(p.HEADER.size), CLIENT_MAX_FRAME)
                msg = p.server_decoder.decode(await self._reader.readexactly(n))
                if msg.id == 0 and isinstance(msg, p.Failed):
                    raise _error(msg)  # the server could not read our frame and hangs up
                q = self._calls.get(msg.id)
                if q is not None:
                    q.put_nowait(msg)
        except Exception as e:
            lost = e if isinstance(e, ValueError) else EngineDead(f"connection to {self.socket_path} lost ({e!r})")
            self._lost = lost
            for q in self._calls.values():
                q.put_nowait(lost)

    async def close(self) -> None:
        self._closed = True
        _open.discard(self)
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self._lost = self._lost or EngineDead("the client is closed")

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    def _left_open(self) -> None:
        """Found open (garbage collected, or at exit): warn, and close the connection if its loop
        still runs (without waiting: this may be any thread, the loop may never run again)."""
        if self._closed or self._writer is None:
            return
        self._closed = True
        _open.discard(self)
        warnings.warn(f"unclosed AsyncClient({self.socket_path!r})", ResourceWarning, stacklevel=2)
        loop, writer = self._loop, self._writer
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(writer.close)

    def __del__(self) -> None:
        self._left_open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- calls ------------------------------------------------------------------------------
    async def _open(self, make) -> tuple[int, asyncio.Queue]:
        await self.connect()
        if self._lost is not None:
            raise self._lost
        cid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._calls[cid] = q
        try:
            await self._send(make(cid))
        except BaseException:
            self._calls.pop(cid, None)
            raise
        return cid, q

    async def _send(self, msg: Any) -> None:
        assert self._writer is not None
        try:
            self._writer.write(p.frame(msg))
            await self._writer.drain()
        except OSError as e:
            raise EngineDead(f"connection to {self.socket_path} lost ({e!r})") from None

    async def _next(self, q: asyncio.Queue) -> p.ServerMsg:
        msg = await q.get()
        if isinstance(msg, Exception):
            raise msg
        if isinstance(msg, p.Failed):
            raise _error(msg)
        return msg

    async def _call(self, make) -> Any:
        cid, q = await self._open(make)
        try:
            while True:
                msg = await self._next(q)
                if isinstance(msg, p.Done):
                    return msg.value
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._send(p.Cancel(cid))
            raise
        finally:
            self._calls.pop(cid, None)

    async def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                       input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                       top_logprobs_num: int | list[int] = 0, rid: str | list[str] | None = None,
                       stream: bool = False, session_params: dict | list[dict] | None = None,
                       logprob_start_len: int | list[int] = -1, token_ids_logprob: list | None = None,
                       lora_path: str | list[str | None] | None = None,
                       data_parallel_rank: int | list[int | None] | None = None,
                 return_hidden_states: bool | list[bool] = False,
                 return_routed_experts: bool | list[bool] = False, routed_experts_start_len: int | list[int] = 0,
                 cache_salt: str | list[str | None] | None = None) -> Any:  # fmt: skip
        """As `Engine.generate`: a result (or a list), or with stream=True an async iterator of
        chunks (returned once the server accepted the requests)."""
        args = GenerateArgs(text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
                            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, stream=stream,
                            session_params=session_params, logprob_start_len=logprob_start_len,
                            token_ids_logprob=token_ids_logprob, lora_path=lora_path,
                            data_parallel_rank=data_parallel_rank, return_hidden_states=return_hidden_states,
                            return_routed_experts=return_routed_experts, routed_experts_start_len=routed_experts_start_len,
                            cache_salt=cache_salt)  # fmt: skip
        return await self._generate(args)

    async def _generate(self, args: GenerateArgs) -> Any:
        def make(cid: int) -> p.Generate:
            return p.Generate(cid, args)

        if not args.stream:
            return await self._call(make)
        cid, q = await self._open(make)
        try:
            await self._next(q)  # Started (or the call's error, raised here)
        except BaseException:
            self._calls.pop(cid, None)
            raise
        return self._chunks(cid, q)

    async def _chunks(self, cid: int, q: asyncio.Queue) -> AsyncIterator[dict]:
        done = False
        try:
            while True:
                msg = await self._next(q)
                if isinstance(msg, p.Done):
                    done = True
                    return
                assert isinstance(msg, p.Chunk)
                yield msg.value
        finally:
            self._calls.pop(cid, None)
            if not done and self._lost is None:
                with contextlib.suppress(Exception):
                    await self._send(p.Cancel(cid))

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._call(lambda cid: p.Abort(cid, rid, abort_all))

    async def control(self, verb: str, **kwargs: Any) -> Any:
        """Any verb the server knows, by name (the methods below are its common ones)."""
        return await self._call(lambda cid: p.Control(cid, verb, kwargs))

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self.control("pause_generation", mode=mode)

    async def continue_generation(self) -> dict:
        return await self.control("continue_generation")

    async def flush_cache(self) -> dict:
        return await self.control("flush_cache")

    async def get_server_info(self) -> dict:
        return await self.control("get_server_info")

    async def get_model_info(self) -> dict:
        return await self.control("get_model_info")

    async def get_load(self) -> dict:
        return await self.control("get_load")

    async def get_loads(self) -> list[dict]:
        """One entry per data-parallel group (SGLang's /get_load shape)."""
        return await self.control("get_loads")

    async def wait_compiled(self, timeout: float = 900.0) -> dict:
        """Once the server has compiled every step program: its info (it serves before that)."""
        return await self.control("wait_compiled", timeout=timeout)

    async def health(self) -> bool:
        try:
            return bool(await self.control("health"))
        except EngineDead:
            return False

    async def open_session(self, capacity_of_str_len: int = 0, session_id: str | None = None) -> str:
        return await self.control("open_session", capacity_of_str_len=capacity_of_str_len, session_id=session_id)

    async def close_session(self, session_id: str) -> None:
        await self.control("close_session", session_id=session_id)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, **kw: Any) -> dict:
        return await self.control("update_weights_from_disk", model_path=model_path, weight_version=weight_version, **kw)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return await self.control("get_weights_by_name", name=name, truncate_size=truncate_size)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str | None = None) -> dict:  # fmt: skip
        """As `Engine.init_weights_update_group`."""
        return await self.control("init_weights_update_group", master_address=master_address, master_port=master_port,
                                  rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                  backend=backend)  # fmt: skip

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group", **kw: Any) -> dict:
        return await self.control("update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes,
                                  group_name=group_name, **kw)  # fmt: skip

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self.control("destroy_weights_update_group", group_name=group_name)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """As `Engine.load_lora_adapter` (the path is read by the server's runner, on its host)."""
        return await self.control("load_lora_adapter", lora_name=lora_name, lora_path=lora_path, pinned=pinned)

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        return await self.control("unload_lora_adapter", lora_name=lora_name)

    async def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                                         weight_version: str | None = None, bucket_bytes: int = BUCKET_BYTES,
                                         flush_cache: bool = True, abort_all_requests: bool = False,
                                         slots: int = 2, timeout: float = p.PUSH_TIMEOUT_S, mode: str = "replace",
                                         base_weight_version: str | None = None) -> dict:  # fmt: skip
        """HF-named NumPy, JAX or torch arrays from this process (a dict, (name, array) pairs, or
        a generator, read one bucket at a time) into the server's weights through shared memory
        on this host, in buckets of at most `bucket_bytes`; all or nothing, as the Engine's
        (deltas too: `Rows` values, `mode`, `base_weight_version`). The server makes `slots`
        segments; this process fills one while the runner reads another. Returns {"success",
        "message", "weight_version", "bytes"} (a refusal: success False)."""
        check_bucket_bytes(bucket_bytes)
        check_mode(mode)
        it = iter(buckets(named_tensors, bucket_bytes))
        loop = asyncio.get_running_loop()

        def make(cid: int) -> p.PushWeights:
            return p.PushWeights(cid, bucket_bytes, slots, weight_version, flush_cache, abort_all_requests, timeout,
                                 mode, base_weight_version)  # fmt: skip

        cid, q = await self._open(make)
        segments: list[Segment] = []
        ended = False
        try:
            msg = await self._next(q)
            if isinstance(msg, p.PushReady):
                segments = [Segment.open(name) for name in msg.segments]
                free = list(range(len(segments)))
                while True:
                    while not free and not isinstance(msg := await self._next(q), p.Done):
                        assert isinstance(msg, p.PushAck), msg
                        free.append(msg.slot)  # that segment was read
                    if isinstance(msg, p.Done):  # refused half way
                        break
                    slot = free.pop(0)
                    bucket = await loop.run_in_executor(None, write_next, it, segments[slot])
                    if bucket is None:
                        await self._send(p.PushEnd(cid))
                        while not isinstance(msg := await self._next(q), p.Done):
                            pass
                        break
                    await self._send(p.PushBucket(cid, slot, [pc.header() for pc in bucket]))
            assert isinstance(msg, p.Done), msg
            ended = True
            return msg.value
        finally:
            for seg in segments:
                seg.close()
            self._calls.pop(cid, None)
            if not ended and self._lost is None:  # an error here, or cancelled: the server drops the push
                with contextlib.suppress(Exception):
                    await self._send(p.Cancel(cid))

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return await self.control("release_memory_occupation", tags=tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return await self.control("resume_memory_occupation", tags=tags)


class Client:
    """The same verbs for plain (non-async) code; safe to share between threads."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self._lt = LoopThread("ringserve-client")
        self._ac = AsyncClient(socket_path)
        try:
            self._lt.run(self._ac.connect())
        except BaseException:
            self._lt.stop()
            raise
        _open.discard(self._ac)  # the Client answers for its AsyncClient
        _open.add(self)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                 top_logprobs_num: int | list[int] = 0, rid: str | list[str] | None = None,
                 stream: bool = False, session_params: dict | list[dict] | None = None,
                 logprob_start_len: int | list[int] = -1, token_ids_logprob: list | None = None,
                 lora_path: str | list[str | None] | None = None,
                 data_parallel_rank: int | list[int | None] | None = None,
                 return_hidden_states: bool | list[bool] = False,
                 return_routed_experts: bool | list[bool] = False, routed_experts_start_len: int | list[int] = 0,
                 cache_salt: str | list[str | None] | None = None) -> Any:  # fmt: skip
        args = GenerateArgs(text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
                            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, stream=stream,
                            session_params=session_params, logprob_start_len=logprob_start_len,
                            token_ids_logprob=token_ids_logprob, lora_path=lora_path,
                            data_parallel_rank=data_parallel_rank, return_hidden_states=return_hidden_states,
                            return_routed_experts=return_routed_experts, routed_experts_start_len=routed_experts_start_len,
                            cache_salt=cache_salt)  # fmt: skip
        out = self._lt.run(self._ac._generate(args))
        return self._iterate(out) if stream else out

    def _iterate(self, chunks: AsyncIterator[dict]) -> Iterator[dict]:
        return iterate_in_thread(self._lt, lambda: chunks)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._lt.run(self._ac.abort_request(rid, abort_all))

    def control(self, verb: str, **kwargs: Any) -> Any:
        return self._lt.run(self._ac.control(verb, **kwargs))

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._lt.run(self._ac.pause_generation(mode))

    def continue_generation(self) -> dict:
        return self._lt.run(self._ac.continue_generation())

    def flush_cache(self) -> dict:
        return self._lt.run(self._ac.flush_cache())

    def get_server_info(self) -> dict:
        return self._lt.run(self._ac.get_server_info())

    def get_model_info(self) -> dict:
        return self._lt.run(self._ac.get_model_info())

    def get_load(self) -> dict:
        return self._lt.run(self._ac.get_load())

    def get_loads(self) -> list[dict]:
        return self._lt.run(self._ac.get_loads())

    def wait_compiled(self, timeout: float = 900.0) -> dict:
        return self._lt.run(self._ac.wait_compiled(timeout))

    def health(self) -> bool:
        return self._lt.run(self._ac.health())

    def open_session(self, capacity_of_str_len: int = 0, session_id: str | None = None) -> str:
        return self._lt.run(self._ac.open_session(capacity_of_str_len, session_id))

    def close_session(self, session_id: str) -> None:
        self._lt.run(self._ac.close_session(session_id))

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, **kw: Any) -> dict:
        return self._lt.run(self._ac.update_weights_from_disk(model_path, weight_version, **kw))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._lt.run(self._ac.get_weights_by_name(name, truncate_size))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> dict:
        return self._lt.run(self._ac.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                               group_name, backend))  # fmt: skip

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", **kw: Any) -> dict:
        return self._lt.run(self._ac.update_weights_from_distributed(names, dtypes, shapes, group_name, **kw))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._lt.run(self._ac.destroy_weights_update_group(group_name))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        return self._lt.run(self._ac.load_lora_adapter(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._lt.run(self._ac.unload_lora_adapter(lora_name))

    def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                                   weight_version: str | None = None, bucket_bytes: int = BUCKET_BYTES,
                                   **kw: Any) -> dict:  # fmt: skip
        """As `AsyncClient.update_weights_from_tensor`."""
        return self._lt.run(self._ac.update_weights_from_tensor(named_tensors, weight_version, bucket_bytes, **kw))

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._lt.run(self._ac.release_memory_occupation(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._lt.run(self._ac.resume_memory_occupation(tags))

    def close(self) -> None:
        """Close the connection (its calls are cancelled on the server) and the loop thread.
        Never waits on a loop that cannot run (stopped, or the interpreter finalizing)."""
        _open.discard(self)
        lt = self._lt
        if lt.closed:
            return
        self._ac._closed = True
        if lt.usable and not lt.on_loop:
            with contextlib.suppress(Exception):
                lt.run(self._ac.close(), timeout=CLOSE_TIMEOUT_S)
        elif lt.usable:  # dropped on its own loop thread: close there, without waiting
            writer = self._ac._writer
            if writer is not None:
                writer.close()
        lt.stop()

    def _left_open(self) -> None:
        if not self._lt.closed:
            warnings.warn(f"unclosed Client({self.socket_path!r})", ResourceWarning, stacklevel=2)
            self.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._left_open()
