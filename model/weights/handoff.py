"""Arrays handed over inside one process: a weight update from a trainer whose Engine runs its
runner as a thread of the trainer's process (`runner_in_process`). The frontend lends the
trainer's HF-named JAX arrays under the update's id for as long as the update's control call
runs; the runner, reading `UpdateWeightsReq(source="local", update=id)` off its ring, takes them
by that id (model/runtime/weight_sync.py `WeightSync.load_local`). Nothing is pickled, copied to
the host or written to shared memory on the way: the message carries the id alone.

    frontend (caller's thread / loop)          runner thread
    with lend(id, arrays):  ──UpdateWeightsReq("local", update=id)──►  take(id) -> arrays
        await reply         ◄──────────────── reply ─────────────────  (built, swapped or refused)
    (entry dropped, however the call ended)

The registry holds references only while the call runs, so it never keeps a trainer's arrays
alive past its update. NumPy only (the frontend imports no JAX).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ringserve.model.weights.segments import WeightError

_lent: dict[str, dict[str, Any]] = {}  # update id -> {HF name: array}
_lock = threading.Lock()  # lend / take run on different threads


@contextlib.contextmanager
def lend(update: str, arrays: dict[str, Any]) -> Iterator[None]:
    """`arrays` can be taken under `update` until the block ends (however it ends)."""
    with _lock:
        assert update not in _lent, f"update {update!r} lent twice"
        _lent[update] = arrays
    try:
        yield
    finally:
        with _lock:
            _lent.pop(update, None)


def take(update: str) -> dict[str, Any]:
    """The arrays lent under `update`; WeightError when none are (a runner in another process
    than the engine's, or a call that already ended)."""
    with _lock:
        arrays = _lent.get(update)
    if arrays is None:
        raise WeightError(f"update {update!r}: no arrays handed over in this process (source 'local' needs the "
                          "runner in the engine's process: runner_in_process)")  # fmt: skip
    return arrays


def lent() -> list[str]:
    """The update ids lent now (tests: nothing is left once a call ends)."""
    with _lock:
        return sorted(_lent)
