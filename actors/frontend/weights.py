"""The RL loop's verbs on the frontend: weight updates, reading a weight back, device memory.

    generate → pause_generation("retract") → update_weights_from_disk / _from_tensor
             → flush_cache → continue_generation

Each is a control message to the scheduler, which refuses it while requests run (unless paused),
forwards it to the runner(s) after every batch in flight, and answers once they did it. Tensor
data never travels through a ring, a socket or a pickle: an update from tensors is a `Push`
(actors/frontend/weight_push.py) through shared-memory segments the server owns, in buckets of
at most `bucket_bytes` (actors/frontend/weight_buckets.py), from this process
(`update_weights_from_tensor`), a trainer's process on this host (`serve_client`, the Client's
call) or another host (`serve_body`, HTTP); the runner stages every bucket and swaps after the
last, all or nothing. One update runs at a time. The new `weight_version` (default: a counter)
stamps every later output.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, Protocol

from ringserve.actors.frontend import protocol as p
from ringserve.actors.frontend.weight_buckets import BUCKET_BYTES, buckets, check_bucket_bytes, write_next
from ringserve.actors.frontend.weight_local import device_arrays, renamed, update_id
from ringserve.actors.frontend.weight_push import BodyReader, Push, check_push_args, serve_body, serve_client
from ringserve.actors.transport import messages as m
from ringserve.model.weights.handoff import lend

MEMORY_TAGS = ("kv_cache", "weights")


class Frontend(Protocol):
    """What these verbs use of the TokenizerManager."""

    dp_size: int
    args: Any  # its ServerArgs (runner_in_process)
    held: asyncio.Event | None

    async def control(self, msg: Any, kind: str) -> m.ControlReply: ...
    async def pause_generation(self, mode: str = "abort") -> dict: ...
    async def continue_generation(self) -> dict: ...
    async def flush_cache(self) -> dict: ...
    async def get_server_info(self) -> dict: ...


class PushRefused(Exception):
    """A data-parallel group would not take the update: `out` is the refusal to return."""

    def __init__(self, out: dict[str, Any]):
        super().__init__(out["message"])
        self.out = out


class WeightsAPI:
    """The weight version has one owner, the scheduler: every update's reply carries the version
    serving after it (refused or not), and get_weight_version asks for it."""

    def __init__(self, tm: Frontend):
        self.tm = tm
        self._lock = asyncio.Lock()  # one update at a time (a push spans many control messages)

    async def _update(self, req: m.UpdateWeightsReq) -> dict[str, Any]:
        r = await self.tm.control(req, "update_weights")
        return {"success": r.ok, "message": r.message, "weight_version": json.loads(r.payload)["weight_version"]}

    async def _before(self, abort_all_requests: bool) -> None:
        if abort_all_requests:  # as SGLang's flag: abort everything, wait until quiet
            await self.tm.pause_generation("abort")
            await self.tm.continue_generation()

    @contextlib.asynccontextmanager
    async def _exclusive(self, abort_all_requests: bool) -> AsyncIterator[dict[str, Any] | None]:
        """One update at a time. With several data-parallel groups it is all or nothing across
        them: new requests wait at the front door (`tm.held`) while every group is asked first
        whether it would take an update now (the scheduler's busy check, source "check"); if one
        would not, nothing is sent and the refusal (each group's reason) is yielded. Since no
        request can reach a group meanwhile, a group that said yes still does when the update
        comes (what remains is a runner's own failure: a file or device error in one group)."""
        async with self._lock:
            await self._before(abort_all_requests)
            if self.tm.dp_size == 1:
                yield None
                return
            self.tm.held = held = asyncio.Event()
            try:
                r = await self.tm.control(m.UpdateWeightsReq("check"), "update_weights")
                yield None if r.ok else {"success": False, "message": r.message,
                                         "weight_version": json.loads(r.payload)["weight_version"]}  # fmt: skip
            finally:
                self.tm.held = None
                held.set()

    async def _after(self, out: dict[str, Any], flush_cache: bool) -> dict[str, Any]:
        if "weight_version" not in out:  # no tensors: nothing was sent, nothing changed
            return out | await self.get_weight_version()
        if out["success"] and flush_cache:  # the cached prefixes came from the old weights (refused if KV is held)
            await self.tm.flush_cache()
        return out

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       load_format: str | None = None, abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> dict[str, Any]:  # fmt: skip
        """Load a checkpoint of the same architecture (HF directory or .gguf) into the runner(s)."""
        if not isinstance(model_path, str) or not model_path:
            raise ValueError(f"model_path={model_path!r} must be a non-empty string")
        _check_version(weight_version)
        if load_format not in (None, "auto"):
            raise ValueError(f"load_format={load_format!r}: only 'auto' (safetensors directory or .gguf)")
        async with self._exclusive(abort_all_requests) as refused:
            if refused is not None:
                return refused
            out = await self._update(m.UpdateWeightsReq("disk", os.path.abspath(model_path), weight_version))
            return await self._after(out, flush_cache)

    @contextlib.asynccontextmanager
    async def _push(self, bucket_bytes: int, slots: int, weight_version: str | None, abort_all_requests: bool,
                    timeout: float = p.PUSH_TIMEOUT_S) -> AsyncIterator[Push]:  # fmt: skip
        """A push under the update lock; its segments go and its staged parts are dropped
        however it ends (weight_push.py). Refused by a group before it starts: `PushRefused`."""
        check_bucket_bytes(bucket_bytes)
        check_push_args(slots, timeout)
        _check_version(weight_version)
        async with self._exclusive(abort_all_requests) as refused:
            if refused is not None:
                raise PushRefused(refused)
            push = Push(self._update, bucket_bytes, slots)
            try:
                yield push
            finally:
                push.close()

    async def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                                         weight_version: str | None = None, flush_cache: bool = True,
                                         bucket_bytes: int = BUCKET_BYTES, abort_all_requests: bool = False,
                                         name_map: Callable[[str], str | None] | None = None) -> dict[str, Any]:  # fmt: skip
        """HF-named NumPy, JAX or torch arrays (a dict, or (name, array) pairs, or a generator of
        them; `name_map`: the given names -> HF names, None to leave one out), all of the
        weights or a subset, from this process: bucket k + 1 is written into one of the push's
        two segments (off the loop) while the runner stages bucket k from the other. JAX arrays
        for a runner in this process go device to device instead (actors/frontend/weight_local.py)."""
        named_tensors = renamed(named_tensors, name_map)
        if self.tm.args.runner_in_process:
            arrays, named_tensors = device_arrays(named_tensors)
            if arrays is not None:
                return await self._from_device(arrays, weight_version, abort_all_requests, flush_cache)
        it = iter(buckets(named_tensors, bucket_bytes))
        try:
            return await self._from_tensor(it, bucket_bytes, weight_version, abort_all_requests, flush_cache)
        except PushRefused as e:
            return e.out

    async def _from_device(self, arrays: dict[str, Any], weight_version: str | None, abort_all_requests: bool,
                           flush_cache: bool) -> dict[str, Any]:  # fmt: skip
        """JAX arrays lent to the runner in this process for the update's one control call."""
        _check_version(weight_version)
        async with self._exclusive(abort_all_requests) as refused:
            if refused is not None:
                return refused
            update = update_id()
            with lend(update, arrays):
                out = await self._update(m.UpdateWeightsReq("local", weight_version=weight_version, update=update))
            return await self._after(out, flush_cache)

    async def _from_tensor(self, it: Any, bucket_bytes: int, weight_version: str | None, abort_all_requests: bool,
                           flush_cache: bool) -> dict[str, Any]:  # fmt: skip
        loop = asyncio.get_running_loop()
        async with self._push(bucket_bytes, 2, weight_version, abort_all_requests) as push:
            staging: asyncio.Task | None = None  # bucket k - 1, in the other segment
            try:
                for k in itertools.count():
                    bucket = await loop.run_in_executor(None, write_next, it, push.segments[k % 2])
                    if staging is not None:
                        refused, staging = await staging, None
                        if refused is not None:
                            return refused
                    if bucket is None:
                        break
                    staging = asyncio.ensure_future(push.bucket(k % 2, [pc.header() for pc in bucket]))
            finally:
                if staging is not None:
                    staging.cancel()  # (its part's reply is still taken in order: Push._send)
            out = await push.commit(weight_version)
            return await self._after(out, flush_cache)

    async def push_from_client(self, start: p.PushWeights, inbox: asyncio.Queue,
                               send: Callable[[Any], Any]) -> dict[str, Any]:  # fmt: skip
        """`Client.update_weights_from_tensor` from another process (the IPC socket's call)."""
        try:
            async with self._push(start.bucket_bytes, start.slots, start.weight_version, start.abort_all_requests,
                                  start.timeout) as push:  # fmt: skip
                out = await serve_client(push, start, inbox, send)
                return await self._after(out, start.flush_cache) if out["success"] else out
        except PushRefused as e:
            return e.out

    async def push_from_body(self, chunks: AsyncIterator[bytes], max_bucket_bytes: int, weight_version: str | None = None,
                             flush_cache: bool = True, abort_all_requests: bool = False,
                             timeout: float = p.PUSH_TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
        """`POST /update_weights_from_tensor`: safetensors blobs of at most `max_bucket_bytes`
        of data each, read off the body into one segment."""
        try:
            async with self._push(max_bucket_bytes, 1, weight_version, abort_all_requests, timeout) as push:
                out = await serve_body(push, BodyReader(chunks, timeout), weight_version)
                return await self._after(out, flush_cache) if out["success"] else out
        except PushRefused as e:
            return e.out

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of a weight as the runner serves it (as SGLang's)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty string")
        if not isinstance(truncate_size, int) or truncate_size < 1:
            raise ValueError(f"truncate_size={truncate_size!r} must be an integer >= 1")
        r = await self.tm.control(m.GetWeightsReq(name, truncate_size), "get_weights")
        if not r.ok:
            raise ValueError(r.message)
        return m.as_f32(r.payload).reshape(r.shape).tolist()

    async def get_weight_version(self) -> dict[str, str]:
        return {"weight_version": (await self.tm.get_server_info())["weight_version"]}

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free the KV cache (and the weights, with those tags) on the device, e.g. while a trainer
        shares it; generation waits until `resume_memory_occupation`. Refused while requests
        hold KV."""
        r = await self.tm.control(m.MemoryReq("release", _tags(tags)), "memory")
        return {"success": r.ok, "message": r.message}

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        r = await self.tm.control(m.MemoryReq("resume", _tags(tags)), "memory")
        return {"success": r.ok, "message": r.message}


def _check_version(v: Any) -> None:
    if v is not None and not (isinstance(v, str) and v):
        raise ValueError(f"weight_version={v!r} must be a non-empty string")


def _tags(tags: Any) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not tags or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"tags={tags!r}: a list of {list(MEMORY_TAGS)} (None: both)")
    return sorted(set(tags))

