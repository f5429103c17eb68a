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

Deltas (model/weights/delta.py): an update from tensors may name a subset of the weights, send
only some rows of one (`Rows(start, array)`), and with `mode="add"` add each to the served
value; `base_weight_version` (every update) refuses it unless the engine serves that version,
so a delta computed against version v never lands on other weights.
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
from ringserve.model.weights.delta import check_mode
from ringserve.model.weights.handoff import lend

MEMORY_TAGS = ("kv_cache", "weights")
GROUP_NAME = "weight_update_group"  # SGLang's default
GROUP_BACKENDS = ("gloo", "nccl")
GROUP_DTYPES = ("float32", "bfloat16", "float16")


class Frontend(Protocol):
    """What these verbs use of the TokenizerManager."""

    dp_size: int
    args: Any  # its ServerArgs (runner_in_process, nnodes)
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
    async def _exclusive(self, abort_all_requests: bool,
                         base_weight_version: str | None) -> AsyncIterator[dict[str, Any] | None]:  # fmt: skip
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
                check = m.UpdateWeightsReq("check", base_weight_version=base_weight_version)
                r = await self.tm.control(check, "update_weights")
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
                                       flush_cache: bool = True, base_weight_version: str | None = None) -> dict[str, Any]:  # fmt: skip
        """Load a checkpoint of the same architecture (HF directory or .gguf) into the runner(s)."""
        if not isinstance(model_path, str) or not model_path:
            raise ValueError(f"model_path={model_path!r} must be a non-empty string")
        _check_version(weight_version)
        _check_version(base_weight_version, "base_weight_version")
        if load_format not in (None, "auto"):
            raise ValueError(f"load_format={load_format!r}: only 'auto' (safetensors directory or .gguf)")
        async with self._exclusive(abort_all_requests, base_weight_version) as refused:
            if refused is not None:
                return refused
            req = m.UpdateWeightsReq("disk", os.path.abspath(model_path), weight_version,
                                     base_weight_version=base_weight_version)  # fmt: skip
            out = await self._update(req)
            return await self._after(out, flush_cache)

    @contextlib.asynccontextmanager
    async def _push(self, bucket_bytes: int, slots: int, weight_version: str | None, abort_all_requests: bool,
                    timeout: float = p.PUSH_TIMEOUT_S, mode: str = "replace",
                    base_weight_version: str | None = None) -> AsyncIterator[Push]:  # fmt: skip
        """A push under the update lock; its segments go and its staged parts are dropped
        however it ends (weight_push.py). Refused by a group before it starts: `PushRefused`."""
        check_bucket_bytes(bucket_bytes)
        check_push_args(slots, timeout)
        _check_version(weight_version)
        _check_version(base_weight_version, "base_weight_version")
        check_mode(mode)
        async with self._exclusive(abort_all_requests, base_weight_version) as refused:
            if refused is not None:
                raise PushRefused(refused)
            push = Push(self._update, bucket_bytes, slots, mode, base_weight_version)
            try:
                yield push
            finally:
                push.close()

    async def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                                         weight_version: str | None = None, flush_cache: bool = True,
                                         bucket_bytes: int = BUCKET_BYTES, abort_all_requests: bool = False,
                                         mode: str = "replace", base_weight_version: str | None = None,
                                         name_map: Callable[[str], str | None] | None = None) -> dict[str, Any]:  # fmt: skip
        """HF-named NumPy, JAX or torch arrays (a dict, or (name, array) pairs, or a generator of
        them; `name_map`: the given names -> HF names, None to leave one out), all of the
        weights or a subset, a value `Rows(start, array)` for some rows of one (a list of them
        for several blocks), each replacing the served value or, with mode="add", added to it;
        refused unless the engine serves `base_weight_version` (if given). From this process:
        bucket k + 1 is written into one of the push's two segments (off the loop) while the
        runner stages bucket k from the other. JAX arrays replacing weights of a runner in this
        process go device to device instead (actors/frontend/weight_local.py)."""
        check_mode(mode)
        named_tensors = renamed(named_tensors, name_map)
        if self.tm.args.runner_in_process and mode == "replace":
            arrays, named_tensors = device_arrays(named_tensors)
            if arrays is not None:
                return await self._from_device(arrays, weight_version, abort_all_requests, flush_cache,
                                               base_weight_version)  # fmt: skip
        it = iter(buckets(named_tensors, bucket_bytes))
        try:
            return await self._from_tensor(it, bucket_bytes, weight_version, abort_all_requests, flush_cache, mode,
                                           base_weight_version)  # fmt: skip
        except PushRefused as e:
            return e.out

    async def _from_device(self, arrays: dict[str, Any], weight_version: str | None, abort_all_requests: bool,
                           flush_cache: bool, base_weight_version: str | None) -> dict[str, Any]:  # fmt: skip
        """JAX arrays lent to the runner in this process for the update's one control call."""
        _check_version(weight_version)
        _check_version(base_weight_version, "base_weight_version")
        async with self._exclusive(abort_all_requests, base_weight_version) as refused:
            if refused is not None:
                return refused
            update = update_id()
            with lend(update, arrays):
                out = await self._update(m.UpdateWeightsReq("local", weight_version=weight_version, update=update,
                                                            base_weight_version=base_weight_version))  # fmt: skip
            return await self._after(out, flush_cache)

    async def _from_tensor(self, it: Any, bucket_bytes: int, weight_version: str | None, abort_all_requests: bool,
                           flush_cache: bool, mode: str, base_weight_version: str | None) -> dict[str, Any]:  # fmt: skip
        loop = asyncio.get_running_loop()
        async with self._push(bucket_bytes, 2, weight_version, abort_all_requests, mode=mode,
                              base_weight_version=base_weight_version) as push:  # fmt: skip
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
                                  start.timeout, start.mode, start.base_weight_version) as push:  # fmt: skip
                out = await serve_client(push, start, inbox, send)
                return await self._after(out, start.flush_cache) if out["success"] else out
        except PushRefused as e:
            return e.out

    async def push_from_body(self, chunks: AsyncIterator[bytes], max_bucket_bytes: int, weight_version: str | None = None,
                             flush_cache: bool = True, abort_all_requests: bool = False,
                             timeout: float = p.PUSH_TIMEOUT_S, mode: str = "replace",
                             base_weight_version: str | None = None) -> dict[str, Any]:  # fmt: skip
        """`POST /update_weights_from_tensor`: safetensors blobs of at most `max_bucket_bytes`
        of data each, read off the body into one segment."""
        try:
            async with self._push(max_bucket_bytes, 1, weight_version, abort_all_requests, timeout, mode,
                                  base_weight_version) as push:  # fmt: skip
                out = await serve_body(push, BodyReader(chunks, timeout), weight_version)
                return await self._after(out, flush_cache) if out["success"] else out
        except PushRefused as e:
            return e.out

    # ---- SGLang's update groups (actors/runner/weight_group.py) --------------------------------
    def _runners(self) -> int:
        """The engine's runners that hold weights: one per data-parallel group and host."""
        return self.tm.dp_size * self.tm.args.nnodes

    async def init_weights_update_group(self, master_address: str, master_port: int | str, rank_offset: int,
                                        world_size: int, group_name: str = GROUP_NAME, backend: str | None = None,
                                        pp_rank: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Every runner joins the trainer's torch.distributed group at master_address:master_port
        as rank `rank_offset` + its index (data-parallel group x host; `world_size` counts the
        trainer's rank 0 and every engine rank). The trainer's rank 0 joins at the same time (the
        call returns once the group is made). backend None: nccl on GPUs, gloo otherwise."""
        port = _port(master_port)
        if not isinstance(master_address, str) or not master_address:
            raise ValueError(f"master_address={master_address!r} must be a non-empty host name or address")
        _check_int("rank_offset", rank_offset, 1)
        n = self._runners()
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < rank_offset + n:
            raise ValueError(f"world_size={world_size!r} must be at least rank_offset + the engine's {n} runner(s) "
                             f"= {rank_offset + n} (the trainer's rank 0 and every runner)")  # fmt: skip
        _check_group_name(group_name)
        if backend not in (None, *GROUP_BACKENDS):
            raise ValueError(f"backend={backend!r}: choose one of {list(GROUP_BACKENDS)} (None: by platform)")
        if pp_rank not in (None, 0):
            raise ValueError(f"pp_rank={pp_rank!r}: ringserve has no pipeline stages (0 or None)")
        g = m.WeightGroup(group_name, master_address, port, rank_offset, world_size, backend or "")
        async with self._lock:
            r = await self.tm.control(m.UpdateWeightsReq("group_init", group=g), "update_weights")
        return {"success": r.ok, "message": r.message}

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = GROUP_NAME, flush_cache: bool = True,
                                              abort_all_requests: bool = False, weight_version: str | None = None,
                                              load_format: str | None = None, mode: str = "replace",
                                              base_weight_version: str | None = None) -> dict[str, Any]:  # fmt: skip
        """The tensors the trainer's rank 0 broadcasts over `group_name`, in this order (HF names,
        dtype names as torch's without "torch.", shapes): staged, checked and swapped in all or
        nothing as any update; a delta as `update_weights_from_tensor`'s (a subset, mode="add",
        base_weight_version). Refused (busy, another base), the runners still receive them (the
        trainer's broadcast must complete) and drop them."""
        _check_group_name(group_name)
        _check_version(weight_version)
        _check_version(base_weight_version, "base_weight_version")
        check_mode(mode)
        if load_format not in (None, "auto"):
            raise ValueError(f"load_format={load_format!r}: only None (one broadcast per tensor)")
        for field, v in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
            if not isinstance(v, list) or not v:
                raise ValueError(f"{field} must be a non-empty list (one entry per tensor)")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must have one entry per tensor "
                             f"(got {len(names)}, {len(dtypes)}, {len(shapes)})")  # fmt: skip
        for name, dt, shape in zip(names, dtypes, shapes, strict=True):
            if not isinstance(name, str) or not name:
                raise ValueError(f"names: {name!r} must be a non-empty string")
            if not isinstance(dt, str) or dt.removeprefix("torch.") not in GROUP_DTYPES:
                raise ValueError(f"dtypes: tensor {name!r} has dtype {dt!r}; weights are {list(GROUP_DTYPES)}")
            if not isinstance(shape, list | tuple) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0
                                                         for d in shape):  # fmt: skip
                raise ValueError(f"shapes: tensor {name!r} has shape {shape!r}; a list of integers >= 0")
        g = m.WeightGroup(group_name, names=list(names), dtypes=[d.removeprefix("torch.") for d in dtypes],
                          shapes=[list(s) for s in shapes])  # fmt: skip
        async with self._exclusive(abort_all_requests, base_weight_version) as refused:
            if refused is not None:  # a group would not take it: every runner takes part and drops it
                await self.tm.control(m.UpdateWeightsReq("group_drain", group=g), "update_weights")
                return refused
            out = await self._update(m.UpdateWeightsReq("group", weight_version=weight_version, group=g, mode=mode,
                                                        base_weight_version=base_weight_version))  # fmt: skip
            return await self._after(out, flush_cache)

    async def destroy_weights_update_group(self, group_name: str = GROUP_NAME) -> dict[str, Any]:
        _check_group_name(group_name)
        async with self._lock:
            r = await self.tm.control(m.UpdateWeightsReq("group_destroy", group=m.WeightGroup(group_name)),
                                      "update_weights")  # fmt: skip
        return {"success": r.ok, "message": r.message}

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


def _port(v: Any) -> int:
    """A TCP port as SGLang's clients send it (AReaL: a string)."""
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 65535:
        raise ValueError(f"master_port={v!r} must be a port in [1, 65535]")
    return v


def _check_int(field: str, v: Any, least: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ValueError(f"{field}={v!r} must be an integer >= {least}")


def _check_group_name(v: Any) -> None:
    if not isinstance(v, str) or not v:
        raise ValueError(f"group_name={v!r} must be a non-empty string")


def _check_version(v: Any, field: str = "weight_version") -> None:
    if v is not None and not (isinstance(v, str) and v):
        raise ValueError(f"{field}={v!r} must be a non-empty string")


def _tags(tags: Any) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not tags or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"tags={tags!r}: a list of {list(MEMORY_TAGS)} (None: both)")
    return sorted(set(tags))

