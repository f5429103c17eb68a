"""The supervisor's journal (actors/frontend/supervisor.py): what actors started anew must be
given back, kept from the control calls the scheduler confirmed (`TokenizerManager._replied`
tells it each reply, also one whose caller stopped waiting).

    state            recorded from                         given back to new actors as
    pause            PauseReq / ContinueReq ok             PauseReq("in_place") before any request
    memory released  MemoryReq release / resume ok         MemoryReq("release", tags)
    weights          UpdateWeightsReq ok (the last part)   the runner's start (`start_weights`):
                                                           the checkpoint last loaded whole, then
                                                           the tensors pushed over it since
    weight version   the update's reply                    the scheduler's start (version, count)
    LoRA adapters    LoraReq replies (loaded_adapters)     LoraReq unloads / loads (from lora_paths')

Weights handed over in-process (a trainer's JAX arrays, device to device,
actors/frontend/weight_local.py) are not kept: after one, `why_not` says so until a checkpoint
is loaded whole.
Weights pushed from tensors are kept as a host copy of each name's latest value (at most one
model's weights: a full push replaces the previous one), taken while the caller's segment still
exists (before its reply is handed over). A delta (mode "add", or `Rows` of a tensor) is folded
into that copy (or into the checkpoint's tensor, for a name not pushed since) with the runner's
own arithmetic (model/weights/delta.py), so a restart serves the same bits. If a copy cannot be taken, or the checkpoint the
weights were loaded from is gone, the journal says why a restart cannot bring them back
(`why_not`) and the supervisor refuses to restart instead of serving other weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.actors.transport import messages as m
from ringserve.model.weights.segments import read_segments

log = logging.getLogger("ringserve.supervisor")


@dataclasses.dataclass(frozen=True, slots=True)
class Tensor:
    """A pushed tensor's host copy, as it travelled (dtype name, shape, raw bytes)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytearray


class Journal:
    """The pause, the device memory given back, and the weights: the checkpoint last loaded
    whole (`model_dir`: the model at start or the latest update_weights_from_disk), the tensors
    pushed over it since, their version and the count of updates."""

    def __init__(self, model_dir: str, loras: dict[str, str] | None = None):
        """`loras`: the LoRA adapters the actors start with (ServerArgs.lora_paths)."""
        self.start_loras = dict(loras or {})
        self.loras = dict(self.start_loras)  # {name: path} loaded now, as the scheduler last said
        self.paused = False
        self.released: set[str] = set()
        self.model_dir = model_dir
        self.version = "0"
        self.updates = 0
        self.tensors: dict[str, Tensor] = {}
        self.lost: str | None = None  # why the weights serving cannot be rebuilt (a copy failed)
        self._staged: dict[str, Tensor] = {}  # parts of a tensor update not yet confirmed whole
        self._rows: dict[str, list[Any]] = {}  # its sparse pieces (Rows), not yet confirmed

    def confirmed(self, msg: Any, reply: m.ControlReply) -> None:
        """The scheduler answered `msg` with `reply` (refused or not). Never raises: a journal
        that cannot keep something records why instead (`why_not`)."""
        try:
            if isinstance(msg, m.UpdateWeightsReq):
                self._weights(msg, reply)
            elif isinstance(msg, m.LoraReq):  # refused or not, the reply says what is loaded
                self.loras = dict(json.loads(reply.payload)["loaded_adapters"]) if reply.payload else self.loras
            elif not reply.ok:
                return
            elif isinstance(msg, m.PauseReq):
                self.paused = True
            elif isinstance(msg, m.ContinueReq):
                self.paused = False
            elif isinstance(msg, m.MemoryReq):
                if msg.action == "release":
                    self.released |= set(msg.tags)
                else:
                    self.released -= set(msg.tags)
        except Exception as e:
            self._staged.clear()
            self._rows.clear()
            self.lost = f"a weight update from tensors could not be kept for restarts ({e!r})"
            log.exception("supervisor journal: %s", self.lost)

    def _weights(self, msg: m.UpdateWeightsReq, reply: m.ControlReply) -> None:
        if msg.source in ("check", "group_init", "group_destroy", "group_drain"):  # nothing served changed
            return
        if not reply.ok or msg.source == "abandon":  # refused, or a push dropped half way: nothing of it serves
            self._staged.clear()
            self._rows.clear()
            return
        last = msg.part == msg.parts - 1
        if msg.source == "disk":
            self.model_dir, self.tensors, self.lost = msg.model_path, {}, None
            self._staged.clear()
        elif msg.source == "group":  # the runner received them; no copy passed this process
            assert msg.group is not None
            self.lost = (f"the tensors received over update group {msg.group.group_name!r} reached the runner only "
                         "(a restart can rebuild weights from disk or pushed tensors)")  # fmt: skip
        elif msg.source == "local":  # a trainer's JAX arrays, lent to a runner in this process: no copy here
            self.lost = (f"weight version {json.loads(reply.payload)['weight_version']} came from JAX arrays "
                         "handed over in-process (device to device), which are not kept for restarts")  # fmt: skip
        else:
            if msg.part == 0:
                self._staged.clear()
                self._rows.clear()
            # (the caller unlinks or reuses the segments after this reply)
            _read_tensors([r for r in msg.tensors if not r.sparse], self._staged)
            _read_rows([r for r in msg.tensors if r.sparse], self._rows)
            if last:
                if msg.mode == "replace" and not self._rows:
                    self.tensors.update(self._staged)
                else:
                    self._fold(msg.mode)
                self._staged.clear()
                self._rows.clear()
        if last:
            self.version = json.loads(reply.payload)["weight_version"]
            self.updates += 1

    def _fold(self, mode: str) -> None:
        """Apply a confirmed delta to the host copies, as the runner did to its tensors."""
        from ringserve.model.weights.delta import updated

        checkpoint: dict[str, Any] | None = None
        for name in [*self._staged, *self._rows]:
            if name in self.tensors:
                served = _array(self.tensors[name])
            else:
                if checkpoint is None:
                    from ringserve.model.checkpoints.load import load_checkpoint

                    checkpoint = load_checkpoint(Path(self.model_dir))[1]
                served = checkpoint[name]
            new = updated(served, _array(self._staged[name]) if name in self._staged else self._rows[name], mode)
            new = np.ascontiguousarray(new)
            self.tensors[name] = Tensor(new.dtype.name, new.shape, bytearray(new.tobytes()))

    def why_not(self) -> str | None:
        """Why the weights serving cannot be brought back, or None."""
        if self.lost is not None:
            return f"the weights serving (version {self.version}) cannot be rebuilt: {self.lost}"
        if not Path(self.model_dir).exists():
            return (f"the weights serving (version {self.version}) were loaded from {self.model_dir}, which no "
                    "longer exists; restart the engine with weights that do")  # fmt: skip
        return None

    def restore(self) -> list[tuple[str, Any]]:
        """Control messages that bring the journal's state back to a new scheduler, in order:
        the LoRA adapters (new actors start with lora_paths': those unloaded since go, those
        loaded since come, from the same directories), the device memory given back (while
        nothing holds KV), then the pause."""
        msgs: list[tuple[str, Any]] = []
        for name, path in self.start_loras.items():
            if self.loras.get(name) != path:
                msgs.append(("lora", m.LoraReq("unload", name)))
        for name, path in self.loras.items():
            if self.start_loras.get(name) != path:
                msgs.append(("lora", m.LoraReq("load", name, path)))
        if self.released:
            msgs.append(("memory", m.MemoryReq("release", sorted(self.released))))
        if self.paused:  # (nothing runs in the new scheduler yet: the mode does not matter)
            msgs.append(("pause", m.PauseReq("in_place")))
        return msgs

    @contextlib.contextmanager
    def start_weights(self) -> Iterator[m.StartWeights]:
        """The weights new actors start with; the tensors pushed since the last full load are in
        one shared-memory segment (mode 0600) until the actors are ready."""
        if not self.tensors:
            yield m.StartWeights(self.version, self.updates)
            return
        import posix_ipc

        name = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-restore"
        size = sum(len(t.data) for t in self.tensors.values())
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=max(size, 1))
        try:
            refs, off = [], 0
            try:
                with mmap.mmap(shm.fd, max(size, 1)) as mm:
                    for tname, t in self.tensors.items():
                        mm[off : off + len(t.data)] = t.data
                        refs.append(m.TensorRef(tname, t.dtype, list(t.shape), name, off, len(t.data)))
                        off += len(t.data)
            finally:
                shm.close_fd()
            yield m.StartWeights(self.version, self.updates, refs)
        finally:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _array(t: Tensor) -> np.ndarray:
    return np.frombuffer(t.data, _dtype(t.dtype)).reshape(t.shape)


def _read_rows(refs: list[m.TensorRef], into: dict[str, list[Any]]) -> None:
    """Copy sparse pieces (some rows of a tensor, TensorRef.sparse) out as `Rows`."""
    from ringserve.model.weights.delta import Rows

    def take(r: m.TensorRef, mm: Any) -> None:
        dt = _dtype(r.dtype)
        per_row = int(np.prod(r.shape[1:], dtype=np.int64))
        n = r.nbytes // (per_row * dt.itemsize)
        rows = np.frombuffer(mm, dt, n * per_row, r.offset).reshape(n, *r.shape[1:]).copy()
        into.setdefault(r.name, []).append(Rows(r.start, rows))

    read_segments(refs, take)


def _read_tensors(refs: list[m.TensorRef], into: dict[str, Tensor]) -> None:
    """Copy the pieces `refs` name (rows [start, ...) of a tensor of `shape`: a tensor larger than
    a bucket arrives in several) into whole host copies in `into`."""

    def take(r: m.TensorRef, mm: Any) -> None:
        t = into.get(r.name)
        if t is None or t.dtype != r.dtype or t.shape != tuple(r.shape):
            n = _ITEMSIZE.get(r.dtype) or np.dtype(r.dtype).itemsize
            for d in r.shape:
                n *= d
            t = into[r.name] = Tensor(r.dtype, tuple(r.shape), bytearray(n))
        row = len(t.data) // r.shape[0] if r.shape and r.shape[0] else len(t.data)
        t.data[r.start * row : r.start * row + r.nbytes] = mm[r.offset : r.offset + r.nbytes]

    read_segments(refs, take)
