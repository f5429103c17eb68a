"""Weights while serving (the RL loop): update, read back, release and resume device memory.

The executor keeps the HF-named host tensors it serves (`ex.host_tensors`: memory-mapped for a
safetensors checkpoint). An update builds a whole new state of the Decoder module beside the
old one, with the start-up builder (`ex.build_params`: the same HF-name map, model/weights/state.py,
and each Param's sharding), and swaps only once every tensor arrived and checked out; anything
wrong leaves the old weights serving. The compiled step programs take the state as their first
argument with the same structure, shapes, dtypes and shardings, so nothing recompiles.

A delta (model/weights/delta.py) is applied here, whatever its source: each tensor an update
delivers is a whole array or `Rows` of it (the others kept), replacing the served value or, in
mode "add", added to it; the new host tensors are then built as any update's.

Checks, each an error naming the tensor: an unknown name, a missing one (full updates), a
shape other than the model's, a dtype that is not floating point, rows out of range or
overlapping, and for a checkpoint on disk
an architecture other than the served one (family and every dimension).

An update from tensors arrives in parts (buckets) under one update id: each part's pieces (runs
of rows along dim 0, actors/frontend/weight_buckets.py) are checked against the served model and
copied out of their shared-memory segment into host arrays (`Staging`) as they arrive; nothing
reaches the device until the last part, and then only if every tensor begun is complete. A part
of another update than the one staged, an abandoned update, or any error drops what was staged.

An update from JAX arrays in the engine's own process (a trainer's, `runner_in_process`) is
handed over by id (model/weights/handoff.py, source "local"), checked the same way and built on
the device (`load_local`: model/weights/device_state.py), never through the host or shared memory.

Many hosts (one runner each, model/runtime/distributed.py): an update (its last part) and a resume
commit only if every runner's succeeded. Each runner builds, then `agree(ok)` gathers every
runner's ok at that same point of the message stream; one failure anywhere and every runner
keeps its old weights (what it built is freed) and says why: its own error, or "failed on
another host". Every part of an update from tensors agrees too (each runner staged it, or every
runner drops the update): so runner 0's reply to a part, which is all the pusher waits for
before writing that segment again, comes only once every runner has copied the part out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import ml_dtypes
import numpy as np

from ringserve.model.checkpoints.load import load_checkpoint
from ringserve.model.config import NOT_ARCHITECTURE, ModelConfig
from ringserve.model.weights.delta import MODES, Rows, check_rows, updated
from ringserve.model.weights.handoff import take
from ringserve.model.weights.segments import WeightError, read_segments

if TYPE_CHECKING:
    from ringserve.model.runtime.executor import ModelExecutor

FLOAT_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": np.dtype(ml_dtypes.bfloat16)}  # fmt: skip
def check_same_architecture(serving: ModelConfig, new: ModelConfig, source: str) -> None:
    """ValueError (WeightError) naming each field of the architecture (every ModelConfig field
    but model/config.py NOT_ARCHITECTURE: the family and every dimension) where `new` differs."""
    diffs = [f"{f.name} {getattr(new, f.name)!r} != {getattr(serving, f.name)!r}" for f in dataclasses.fields(serving)
             if f.name not in NOT_ARCHITECTURE and getattr(new, f.name) != getattr(serving, f.name)]  # fmt: skip
    if diffs:
        raise WeightError(f"{source}: another architecture than the served model ({'; '.join(diffs)})")


def _as_rows(a: np.ndarray) -> np.ndarray:
    """A view of `a` as [rows along dim 0, the rest] (a 0-d array is one row)."""
    return a.reshape(a.shape[0] if a.ndim else 1, int(np.prod(a.shape[1:], dtype=np.int64)))


class Staging:
    """One update from tensors as its parts arrive. A whole tensor's rows come in order:
    `rows[name]` of `arrays[name]` are filled, and it must be full by the last part. A sparse
    tensor's pieces (TensorRef.sparse: rows the pusher chose, the others kept) are kept as
    `Rows`, in any order; WeightSync checks they fit and do not overlap."""

    def __init__(self, update: str, served: dict[str, Any], mode: str):
        self.update = update
        self.mode = mode  # every part of the update says the same
        self.served = served  # the served HF tensors (their shapes)
        self.arrays: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}
        self.sparse: dict[str, list[Rows]] = {}

    def add(self, ref: Any, src: Any) -> None:
        """Piece `ref` (a TensorRef) from the buffer `src` (its segment): checked, then copied."""
        name, dt = ref.name, FLOAT_DTYPES.get(ref.dtype)
        if name not in self.served:
            raise WeightError(f"tensor {name!r} is not a weight of the served model")
        want = tuple(np.shape(self.served[name]))
        if dt is None:
            raise WeightError(f"tensor {name!r} has dtype {ref.dtype}; weights must be float32, float16 or bfloat16")
        if ref.offset < 0 or ref.offset + ref.nbytes > len(src):
            raise WeightError(f"tensor {name!r}: {ref.nbytes} bytes at {ref.offset} pass its segment of {len(src)}")
        if (name in self.sparse) != ref.sparse and (name in self.sparse or name in self.arrays):
            raise WeightError(f"tensor {name!r} sent both whole and as rows in one update")
        if ref.sparse:
            self._add_rows(ref, dt, want, src)
            return
        if tuple(ref.shape) != want:
            raise WeightError(f"tensor {name!r} has shape {tuple(ref.shape)}, the served model's is {want}")
        a = self.arrays.get(name)
        if a is None:
            a = self.arrays[name] = np.empty(want, dt)
            self.rows[name] = 0
        elif self.rows[name] == len(_as_rows(a)):
            raise WeightError(f"tensor {name!r} sent twice in one update")
        elif a.dtype != dt:
            raise WeightError(f"tensor {name!r}: a piece of dtype {ref.dtype} after pieces of {a.dtype.name}")
        flat = _as_rows(a)
        row = flat.shape[1] * dt.itemsize
        have = self.rows[name]
        n = ref.nbytes // row if row else len(flat) - have
        if ref.start != have or (row and ref.nbytes % row) or have + n > len(flat):
            raise WeightError(f"tensor {name!r}: a piece of rows [{ref.start}, {ref.start + n}) after {have} of "
                              f"{len(flat)} rows (pieces come in order, whole rows)")  # fmt: skip
        flat[have : have + n] = np.frombuffer(src, dt, n * flat.shape[1], ref.offset).reshape(n, -1)
        self.rows[name] = have + n

    def _add_rows(self, ref: Any, dt: np.dtype, want: tuple[int, ...], src: Any) -> None:
        """A piece of a sparse tensor: its own rows, copied out (range and overlap: WeightSync)."""
        name = ref.name
        if not want or tuple(ref.shape[1:]) != want[1:]:
            raise WeightError(f"tensor {name!r}: rows of shape {tuple(ref.shape[1:])}, the served model's are "
                              f"{want[1:] if want else 'none (0-d: send it whole)'}")  # fmt: skip
        pieces = self.sparse.setdefault(name, [])
        if pieces and pieces[0].array.dtype != dt:
            raise WeightError(f"tensor {name!r}: a piece of dtype {ref.dtype} after pieces of {pieces[0].array.dtype.name}")
        per_row = int(np.prod(want[1:], dtype=np.int64))
        row = per_row * dt.itemsize
        if not row or ref.nbytes % row:
            raise WeightError(f"tensor {name!r}: {ref.nbytes} bytes are not whole rows of {row} bytes")
        n = ref.nbytes // row
        rows = np.frombuffer(src, dt, n * per_row, ref.offset).reshape(n, *want[1:]).copy()
        pieces.append(Rows(ref.start, rows))

    def tensors(self) -> dict[str, np.ndarray | list[Rows]]:
        """The staged tensors: whole ones, each complete (WeightError naming the first that is
        not), and sparse ones as their rows."""
        for name, a in self.arrays.items():
            total = a.shape[0] if a.ndim else 1
            if self.rows[name] != total:
                raise WeightError(f"tensor {name!r} is incomplete: {self.rows[name]} of {total} rows arrived")
        return {**self.arrays, **self.sparse}


class WeightSync:
    """`agree(ok) -> bool`: whether every host's runner got as far (model/runtime/distributed.py all_ok;
    one host: `ok`); an update and a resume commit only if it says so, so every host serves the
    same weights."""

    def __init__(self, ex: ModelExecutor, agree: Callable[[bool], bool] = bool):
        self.ex, self.agree = ex, agree
        self.staging: Staging | None = None  # the update from tensors being received, not applied

    # ---- updates -----------------------------------------------------------------------------
    def load_disk(self, path: str) -> str:
        """Replace every weight with the checkpoint at `path` (a directory or a .gguf)."""
        from pathlib import Path

        def read() -> dict[str, Any]:
            p = Path(path)
            if not p.exists():
                raise WeightError(f"model_path={path!r}: no such directory or file")
            try:
                config, tensors = load_checkpoint(p)
            except ValueError as e:
                raise WeightError(str(e)) from None
            check_same_architecture(self.ex.model_config, config, path)
            return tensors

        n = self._commit(read, full=True)
        return f"loaded {n} tensors from {path}"

    def stage(self, refs: list[Any], update: str, first: bool, last: bool, mode: str = "replace") -> str:
        """One part of update `update` from tensors in shared memory (the first forgets any
        other update staged); the last applies every staged tensor in `mode` (model/weights/delta.py),
        all or nothing. Any error drops the whole update."""
        if first:
            self.staging = Staging(update, self.ex.host_tensors, mode)

        def read() -> dict[str, Any]:
            if self.staging is None or self.staging.update != update:
                raise WeightError(f"part {update!r} of an update that is not staged (abandoned, or its first part was refused)")
            if mode != self.staging.mode:
                raise WeightError(f"part {update!r}: mode={mode!r} after parts of mode={self.staging.mode!r}")
            read_segments(refs, self.staging.add)
            return self.staging.tensors() if last else {}

        if not last:
            err = None
            try:
                read()
            except Exception as e:  # noqa: BLE001 -- every host must reach the agreement
                err = e
            # Every part agrees (on one host: free): the reply to this part (runner 0's) then
            # means every runner has read its segment, so the pusher may write it again, and on
            # many hosts a relay may drop its copy (actors/relay/blobs.py).
            if not self.agree(err is None):
                self.staging = None
                if isinstance(err, WeightError) or err is None:
                    raise err or WeightError("refused: a part of the update failed on another host (its log says why)")
                raise WeightError(f"{type(err).__name__}: {err}") from err
            return f"staged {len(refs)} pieces"
        try:
            return f"updated {self._commit(read, full=False, mode=mode)} tensors"
        finally:
            self.staging = None

    def apply(self, read: Callable[[], dict[str, Any]], mode: str = "replace", on_device: bool = False) -> int:
        """Tensors `read` delivers (HF names; a subset is fine), applied in `mode`, all or
        nothing: every host reads and agrees before any swaps (an update group's broadcast).
        `on_device`: they are JAX arrays on this runner's devices (NCCL's, through DLPack),
        built there as `load_local`'s (a delta other than a whole replace is applied on the host)."""
        return self._commit(read, full=False, mode=mode, build=self._build_on_device if on_device else None)

    def load_local(self, update: str) -> str:
        """Update `update`'s JAX arrays, handed over inside this process (a runner in the
        engine's process: model/weights/handoff.py), all or a subset: the same checks, built on
        the device straight onto the served shardings (`ex.build_params_on_device`), swapped
        only if all of it built and fits. Nothing goes through the host on the way."""
        arrays = take(update)
        return f"updated {self._commit(lambda: arrays, full=False, build=self._build_on_device)} tensors device-to-device"

    def _build_on_device(self, merged: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The new state from `merged`, whose JAX arrays (the update's) stay on the device, and
        the host tensors it serves."""
        arrays = {name: a for name, a in merged.items() if isinstance(a, jax.Array)}
        for a in arrays.values():  # host copies (below) on their way while the state builds
            a.copy_to_host_async()
        new = self.ex.build_params_on_device(merged)
        try:
            host = {name: np.asarray(a) for name, a in arrays.items()}
        except BaseException:
            self.ex.discard_params(new)
            raise
        # `host_tensors` stays the served values' host copy, as after a push: a later subset
        # update merges over it, get_weights_by_name, resume and LoRA read it. The trainer's
        # arrays themselves are not kept: it may donate or delete them once this returns,
        # and holding them (or our own device copy in the HF layout) would keep a second
        # model in device memory. np.asarray: on CPU a view that keeps the trainer's
        # buffer (a donation of it then copies instead; no second host copy), elsewhere
        # one device-to-host copy per tensor, overlapped with the build.
        return new, {**merged, **host}

    def abandon(self, update: str | None = None) -> None:
        """Drop the staged update (`update`'s only, if given)."""
        if self.staging is not None and update in (None, self.staging.update):
            self.staging = None

    def _commit(self, read: Callable[[], dict[str, Any]], full: bool, mode: str = "replace",
                build: Callable[[dict[str, Any]], tuple[Any, dict[str, Any]]] | None = None) -> int:  # fmt: skip
        """Read and check the new tensors (each a whole array or a list of `Rows`, applied in
        `mode`: model/weights/delta.py) and build the new state beside the served one; swap only
        if `agree` says every host did so too (called exactly once, whatever failed: on many
        hosts every runner agrees at this point of the message stream). `build(merged)` -> (new
        state, the host tensors it serves); default: from host arrays (`ex.build_params`)."""
        new, err = None, None
        try:
            tensors = read()
            merged = self._check(tensors, full, mode)
            if build is None:
                new = self.ex.build_params(merged)  # raises before anything changes
            else:
                new, merged = build(merged)
        except Exception as e:  # noqa: BLE001 -- every host must reach the agreement
            err = e
        if not self.agree(err is None):
            if new is not None:
                self.ex.discard_params(new)
            if isinstance(err, WeightError) or err is None:
                raise err or WeightError("refused: the update failed on another host (its log says why)")
            raise WeightError(f"{type(err).__name__}: {err}") from err
        self.ex.swap_params(new, merged)
        return len(tensors)

    def _check(self, tensors: dict[str, Any], full: bool, mode: str) -> dict[str, Any]:
        """The served tensors with `tensors` applied over them in `mode`, once each checks out."""
        if mode not in MODES:
            raise WeightError(f"mode={mode!r}: one of {list(MODES)}")
        current = self.ex.host_tensors
        unknown = sorted(set(tensors) - set(current))
        if unknown:
            raise WeightError(f"tensor {unknown[0]!r} is not a weight of the served model ({len(unknown)} unknown)")
        if full:
            missing = sorted(set(current) - set(tensors))
            if missing:
                raise WeightError(f"the new weights miss tensor {missing[0]!r} ({len(missing)} missing)")
        out = {}
        for name, a in tensors.items():
            want = tuple(np.shape(current[name]))
            if isinstance(a, list):  # rows of it (Rows), the others kept
                a = check_rows(name, want, a)
                dtypes = {np.dtype(r.array.dtype) for r in a}
            elif tuple(np.shape(a)) != want:
                raise WeightError(f"tensor {name!r} has shape {tuple(np.shape(a))}, the served model's is {want}")
            else:
                dtypes = {np.dtype(a.dtype)}
            for dt in dtypes:
                if dt.name not in FLOAT_DTYPES:
                    raise WeightError(f"tensor {name!r} has dtype {dt.name}; weights must be float32, float16 or bfloat16")
            out[name] = updated(current[name], a, mode)
        return {**current, **out}

    # ---- reading back ------------------------------------------------------------------------
    def get(self, name: str, truncate_size: int) -> np.ndarray:
        """The first `truncate_size` rows of a weight as served (its HF layout, the serving
        dtype's values, as float32)."""
        t = self.ex.host_tensors.get(name)
        if t is None:
            raise WeightError(f"no weight named {name!r}")
        serving = FLOAT_DTYPES[self.ex.plan.dtype]
        return np.asarray(t[:truncate_size]).astype(serving).astype(np.float32)

    # ---- device memory -----------------------------------------------------------------------
    def release(self, tags: list[str]) -> str:
        # The memory is the caller's once this returns: no background compile (which may use
        # device memory, e.g. GPU autotuning) may still be running.
        self.ex.wait_compiled()
        if "kv_cache" in tags:
            self.ex.kv_pool.drop()
        if "weights" in tags:
            self.ex.drop_params()
            if self.ex.lora is not None:  # adapters follow the weights (their host copies stay)
                self.ex.lora.release()
        return f"released {', '.join(tags)}"

    def resume(self, tags: list[str]) -> str:
        """Rebuild what `release` dropped; if it fails on any host, every host releases it again."""
        err = None
        try:
            if "weights" in tags and self.ex.params is None:
                self.ex.swap_params(self.ex.build_params(self.ex.host_tensors), self.ex.host_tensors)
            if "weights" in tags and self.ex.lora is not None:
                self.ex.lora.resume()
            if "kv_cache" in tags and self.ex.kv_pool.kv is None:
                self.ex.kv_pool.new()
        except Exception as e:  # noqa: BLE001 -- every host must reach the agreement
            err = e
        if not self.agree(err is None):
            if "kv_cache" in tags and self.ex.kv_pool.kv is not None:
                self.ex.kv_pool.drop()
            if "weights" in tags and self.ex.params is not None:
                self.ex.drop_params()
            raise WeightError(f"resume refused: {err or 'it failed on another host (its log says why)'}")
        return f"resumed {', '.join(tags)}"

