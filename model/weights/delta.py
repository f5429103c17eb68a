"""Delta weight updates: what a new host tensor is, given the served one and what an update sent.

An update names tensors; each one's value is either a whole tensor or `Rows` (some rows along
dim 0: the others keep their served values), applied in one of two modes:

    mode       whole tensor `new`                   Rows(start, rows)
    replace    new (as sent, cast when built)        served, rows [start, stop) := rows
    add        served + new                          served, rows [start, stop) += rows

"add" computes in float32 and stores the served tensor's dtype (a bf16 checkpoint stays bf16),
so a delta lands on the same bits as a full update whose tensor was computed the same way; the
served state is then built from it (int8 quantized, cast to the serving dtype) as at start-up.
NumPy only: the runner's WeightSync (model/runtime/weight_sync.py) and the supervisor's journal
(actors/frontend/journal.py) both apply it, so a restart rebuilds the same bits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ringserve.model.weights.segments import WeightError

MODES = ("replace", "add")


@dataclasses.dataclass(frozen=True, slots=True)
class Rows:
    """Rows [start, start + len(array)) along dim 0 of a weight (`array`: NumPy, JAX or torch,
    shaped [rows, the weight's other dims]), as a value of `update_weights_from_tensor`'s
    `named_tensors`; the weight's other rows keep their served values (with mode "add": these
    rows are added to the served ones)."""

    start: int
    array: Any

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int | np.integer) or self.start < 0:
            raise ValueError(f"Rows.start={self.start!r} must be an integer >= 0")
        if len(np.shape(self.array)) < 1:
            raise ValueError("Rows.array must have a dim 0 (rows); a 0-d weight is sent whole")

    @property
    def stop(self) -> int:
        return int(self.start) + int(np.shape(self.array)[0])


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r:.40} must be one of {list(MODES)}")
    return mode


def check_rows(name: str, served_shape: tuple[int, ...], rows: list[Rows]) -> list[Rows]:
    """`rows` sorted by start, once each fits the served tensor and no two overlap (WeightError
    naming the tensor and the rows)."""
    if not served_shape:
        raise WeightError(f"tensor {name!r} is 0-d: send it whole, not as rows")
    out = sorted(rows, key=lambda r: r.start)
    for r in out:
        shape = tuple(np.shape(r.array))
        if shape[1:] != served_shape[1:]:
            raise WeightError(f"tensor {name!r}: rows of shape {shape[1:]}, the served model's are {served_shape[1:]}")
        if r.stop > served_shape[0]:
            raise WeightError(f"tensor {name!r}: rows [{r.start}, {r.stop}) pass its {served_shape[0]} rows")
    for a, b in zip(out, out[1:], strict=False):
        if b.start < a.stop:
            raise WeightError(f"tensor {name!r}: rows [{a.start}, {a.stop}) and [{b.start}, {b.stop}) overlap")
    return out


def updated(served: Any, new: Any, mode: str) -> Any:
    """The tensor to serve after the update (`new` checked: shapes, dtypes, rows): a whole array
    replacing the served one is kept as given (a JAX array handed over in-process stays one)."""
    if not isinstance(new, list):
        if mode == "replace":
            return new
        return _add(served, np.asarray(new))
    out = np.array(served, copy=True)  # (a checkpoint's tensor is memory-mapped: never written)
    for r in new:
        rows = np.asarray(r.array)
        out[r.start : r.stop] = rows.astype(out.dtype) if mode == "replace" else _add(out[r.start : r.stop], rows)
    return out


def _add(served: Any, delta: np.ndarray) -> np.ndarray:
    served = np.asarray(served)
    return (served.astype(np.float32) + delta.astype(np.float32)).astype(served.dtype)
