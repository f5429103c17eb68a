"""Weights while serving (the RL loop): update, read back, release and resume device memory.

The executor keeps the HF-named host tensors it serves (`ex.host_tensors`: memory-mapped for a
safetensors checkpoint). An update builds a whole new state of the Decoder module beside the
old one, with the start-up builder (`ex.build_params`: the same HF-name map, model/params.py,
and each Param's sharding), and swaps only once every tensor arrived and checked out; anything
wrong leaves the old weights serving. The compiled step programs take the state as their first
argument with the same structure, shapes, dtypes and shardings, so nothing recompiles.

Checks, each an error naming the tensor: an unknown name, a missing one (full updates), a
shape other than the model's, a dtype that is not floating point, and for a checkpoint on disk
an architecture other than the served one (family and every dimension).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from model.checkpoints.config import ModelConfig
from model.checkpoints.weights import load_checkpoint

if TYPE_CHECKING:
    from model.executor import ModelExecutor

FLOAT_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": np.dtype(ml_dtypes.bfloat16)}  # fmt: skip
ARCH_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "qk_norm", "sliding_window")  # fmt: skip


class WeightError(ValueError):
    pass


def check_same_architecture(serving: ModelConfig, new: ModelConfig, source: str) -> None:
    diffs = [f"{f} {getattr(new, f)!r} != {getattr(serving, f)!r}" for f in ARCH_FIELDS
             if getattr(new, f) != getattr(serving, f)]  # fmt: skip
    if new.rope != serving.rope:
        diffs.append(f"rope {new.rope} != {serving.rope}")
    if diffs:
        raise WeightError(f"{source}: another architecture than the served model ({'; '.join(diffs)})")


class WeightSync:
    def __init__(self, ex: ModelExecutor):
        self.ex = ex
        self.staged: dict[str, np.ndarray] = {}  # parts of an update by tensor, not applied yet

    # ---- updates -----------------------------------------------------------------------------
    def load_disk(self, path: str) -> str:
        """Replace every weight with the checkpoint at `path` (a directory or a .gguf)."""
        from pathlib import Path

        p = Path(path)
        if not p.exists():
            raise WeightError(f"model_path={path!r}: no such directory or file")
        try:
            config, tensors = load_checkpoint(p)
        except ValueError as e:
            raise WeightError(str(e)) from None
        check_same_architecture(self.ex.model_config, config, path)
        n = self._apply(tensors, full=True)
        return f"loaded {n} tensors from {path}"

    def stage(self, tensors: dict[str, np.ndarray], first: bool, last: bool) -> str:
        """One part of an update from tensors (the first forgets any earlier unfinished one);
        the last part applies every staged tensor."""
        if first:
            self.staged.clear()
        elif not self.staged:  # e.g. the engine restarted between two parts: never a partial swap
            raise WeightError("a later part of an update whose first part this runner never got; send the update again")
        dup = sorted(set(tensors) & set(self.staged))
        if dup:
            self.staged.clear()
            raise WeightError(f"tensor {dup[0]!r} sent twice in one update")
        self.staged.update(tensors)
        if not last:
            return f"staged {len(tensors)} tensors"
        staged, self.staged = self.staged, {}
        n = self._apply(staged, full=False)
        return f"updated {n} tensors"

    def abandon(self) -> None:
        self.staged.clear()

    def _apply(self, tensors: dict[str, Any], full: bool) -> int:
        current = self.ex.host_tensors
        unknown = sorted(set(tensors) - set(current))
        if unknown:
            raise WeightError(f"tensor {unknown[0]!r} is not a weight of the served model ({len(unknown)} unknown)")
        if full:
            missing = sorted(set(current) - set(tensors))
            if missing:
                raise WeightError(f"the new weights miss tensor {missing[0]!r} ({len(missing)} missing)")
        for name, a in tensors.items():
            want = tuple(np.shape(current[name]))
            if tuple(np.shape(a)) != want:
                raise WeightError(f"tensor {name!r} has shape {tuple(np.shape(a))}, the served model's is {want}")
            dt = np.dtype(a.dtype)
            if dt.name not in FLOAT_DTYPES:
                raise WeightError(f"tensor {name!r} has dtype {dt.name}; weights must be float32, float16 or bfloat16")
        merged = {**current, **tensors}
        new = self.ex.build_params(merged)  # raises before anything changes
        self.ex.swap_params(new, merged)
        return len(tensors)

    # ---- reading back ------------------------------------------------------------------------
    def get(self, name: str, truncate_size: int) -> np.ndarray:
        """The first `truncate_size` rows of a weight as served (its HF layout, the serving
        dtype's values, as float32)."""
        t = self.ex.host_tensors.get(name)
        if t is None:
            raise WeightError(f"no weight named {name!r}")
        serving = FLOAT_DTYPES[self.ex.cfg.dtype]
        return np.asarray(t[:truncate_size]).astype(serving).astype(np.float32)

    # ---- device memory -----------------------------------------------------------------------
    def release(self, tags: list[str]) -> str:
        # The memory is the caller's once this returns: no background compile (which may use
        # device memory, e.g. GPU autotuning) may still be running.
        self.ex.wait_compiled()
        if "kv_cache" in tags:
            self.ex.drop_kv()
        if "weights" in tags:
            self.ex.drop_params()
        return f"released {', '.join(tags)}"

    def resume(self, tags: list[str]) -> str:
        if "weights" in tags and self.ex.params is None:
            self.ex.swap_params(self.ex.build_params(self.ex.host_tensors), self.ex.host_tensors)
        if "kv_cache" in tags and self.ex.kv is None:
            self.ex.new_kv()
        return f"resumed {', '.join(tags)}"


def tensors_from_segments(refs: list[Any]) -> dict[str, np.ndarray]:
    """Copy HF-named tensors out of the shared-memory segments that `refs` name."""
    import mmap

    import posix_ipc

    maps: dict[str, mmap.mmap] = {}
    out: dict[str, np.ndarray] = {}
    try:
        for r in refs:
            if r.dtype not in FLOAT_DTYPES:
                raise WeightError(f"tensor {r.name!r} has dtype {r.dtype}; weights must be float32, float16 or bfloat16")
            mm = maps.get(r.segment)
            if mm is None:
                shm = posix_ipc.SharedMemory(r.segment)
                mm = mmap.mmap(shm.fd, shm.size)
                shm.close_fd()
                maps[r.segment] = mm
            dt = FLOAT_DTYPES[r.dtype]
            n = int(np.prod(r.shape)) if r.shape else 1
            if n * dt.itemsize != r.nbytes or r.offset + r.nbytes > len(mm):
                raise WeightError(f"tensor {r.name!r}: {r.nbytes} bytes at {r.offset} do not fit its shape or segment")
            out[r.name] = np.frombuffer(mm, dt, n, r.offset).reshape(r.shape).copy()
    finally:
        for mm in maps.values():
            mm.close()
    return out

