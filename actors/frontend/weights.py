"""The RL loop's verbs on the frontend: weight updates, reading a weight back, device memory.

    generate → pause_generation("retract") → update_weights_from_disk / _from_tensor
             → flush_cache → continue_generation

Each is a control message to the scheduler, which refuses it while requests run (unless paused),
forwards it to the runner(s) after every batch in flight, and answers once they did it. Tensor
data never travels through a ring or a pickle: `update_weights_from_tensor` writes HF-named
arrays into shared-memory segments (mode 0600) in chunks of at most `chunk_bytes` (a tensor
larger than that gets a segment of its own), sends their names, dtypes, shapes and offsets, and
unlinks each segment once the runner copied it; the runner swaps after the last chunk, all or
nothing. The new `weight_version` (default: a counter) stamps every later output.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np

from actors.transport import messages as m

CHUNK_BYTES = 512 << 20
MEMORY_TAGS = ("kv_cache", "weights")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


class Frontend(Protocol):
    """What these verbs use of the TokenizerManager."""

    async def control(self, msg: Any, kind: str) -> m.ControlReply: ...
    async def pause_generation(self, mode: str = "abort") -> dict: ...
    async def continue_generation(self) -> dict: ...
    async def flush_cache(self) -> dict: ...
    async def get_server_info(self) -> dict: ...


class WeightsAPI:
    """The weight version has one owner, the scheduler: every update's reply carries the version
    serving after it (refused or not), and get_weight_version asks for it."""

    def __init__(self, tm: Frontend):
        self.tm = tm

    async def _update(self, req: m.UpdateWeightsReq) -> dict[str, Any]:
        r = await self.tm.control(req, "update_weights")
        return {"success": r.ok, "message": r.message, "weight_version": json.loads(r.payload)["weight_version"]}

    async def _before(self, abort_all_requests: bool) -> None:
        if abort_all_requests:  # as SGLang's flag: abort everything, wait until quiet
            await self.tm.pause_generation("abort")
            await self.tm.continue_generation()

    async def _after(self, ok: bool, flush_cache: bool) -> None:
        if ok and flush_cache:  # the cached prefixes came from the old weights (refused if KV is held)
            await self.tm.flush_cache()

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       load_format: str | None = None, abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> dict[str, Any]:  # fmt: skip
        """Load a checkpoint of the same architecture (HF directory or .gguf) into the runner(s)."""
        if not isinstance(model_path, str) or not model_path:
            raise ValueError(f"model_path={model_path!r} must be a non-empty string")
        _check_version(weight_version)
        if load_format not in (None, "auto"):
            raise ValueError(f"load_format={load_format!r}: only 'auto' (safetensors directory or .gguf)")
        await self._before(abort_all_requests)
        out = await self._update(m.UpdateWeightsReq("disk", os.path.abspath(model_path), weight_version))
        await self._after(out["success"], flush_cache)
        return out

    async def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                                         weight_version: str | None = None, flush_cache: bool = True,
                                         chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:  # fmt: skip
        """HF-named NumPy (or JAX) arrays, all of the weights or a subset."""
        _check_version(weight_version)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
        arrays = _arrays(named_tensors)
        chunks = _chunks(arrays, chunk_bytes)
        if not chunks:
            return {"success": True, "message": "no tensors", **await self.get_weight_version()}
        for i, chunk in enumerate(chunks):
            name, size = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-w{i}", sum(a.nbytes for _, a in chunk)
            refs = _write_segment(name, chunk, size)
            try:
                req = m.UpdateWeightsReq("tensor", weight_version=weight_version, part=i, parts=len(chunks), tensors=refs)
                out = await self._update(req)
            finally:
                _unlink(name)
            if not out["success"]:
                break
        await self._after(out["success"], flush_cache)
        return out

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


def _arrays(named: Any) -> list[tuple[str, np.ndarray]]:
    items = list(named.items()) if isinstance(named, Mapping) else list(named)
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"named_tensors[{i}]: expected a (name, array) pair")
        name, a = item
        a = np.ascontiguousarray(np.asarray(a))  # a JAX array comes to the host here
        if a.dtype.name not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {a.dtype.name}; weights must be one of {list(FLOAT_DTYPES)}")
        out.append((name, a))
    if len({n for n, _ in out}) != len(out):
        raise ValueError("named_tensors: a tensor name appears twice")
    return out


def _chunks(arrays: list[tuple[str, np.ndarray]], limit: int) -> list[list[tuple[str, np.ndarray]]]:
    chunks: list[list[tuple[str, np.ndarray]]] = []
    size = 0
    for item in arrays:
        if not chunks or size + item[1].nbytes > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += item[1].nbytes
    return chunks


def _write_segment(name: str, chunk: list[tuple[str, np.ndarray]], size: int) -> list[m.TensorRef]:
    import posix_ipc

    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=max(size, 1))
    try:
        with mmap.mmap(shm.fd, max(size, 1)) as mm:
            refs, off = [], 0
            for tname, a in chunk:
                dst = np.frombuffer(mm, np.uint8, a.nbytes, off)
                dst[:] = a.reshape(-1).view(np.uint8)  # one copy, straight into the segment
                del dst  # release the buffer export before the map closes
                refs.append(m.TensorRef(tname, a.dtype.name, list(a.shape), name, off, a.nbytes))
                off += a.nbytes
    except BaseException:
        _unlink(name)
        raise
    finally:
        shm.close_fd()
    return refs


def _unlink(name: str) -> None:
    import posix_ipc

    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
