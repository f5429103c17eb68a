"""An update from tensors that stays on the device: when the runner is a thread of this process
(`runner_in_process`: a trainer's Engine) and every tensor given is a JAX array, they are lent
to it by update id (model/weights/handoff.py) and the message carries the id alone
(`UpdateWeightsReq("local", update=id)`); the runner checks them and builds the served state on
the device (model/weights/device_state.py). Anything else (NumPy, torch, a runner in another
process) goes through shared memory as ever (actors/frontend/weight_push.py).

`name_map` (either path): the caller's names -> HF names (a trainer's parameter paths), None
for a tensor the engine does not serve (left out).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ringserve.actors.frontend.weight_buckets import MAX_NAME

Named = Mapping[str, Any] | Iterable[tuple[str, Any]]
_ids = itertools.count()


def renamed(named: Named, name_map: Callable[[str], str | None] | None) -> Named:
    """`named` under `name_map`'s names (lazily: a generator stays one); as it is without one."""
    if name_map is None:
        return named
    if not callable(name_map):
        raise ValueError(
            f"name_map={name_map!r}: a callable from the given names to HF names (None: leave out)"
        )
    items = named.items() if isinstance(named, Mapping) else named

    def gen() -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(items):
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise ValueError(f"named_tensors[{i}]: expected a (name, array) pair")
            hf = name_map(item[0])
            if hf is not None:
                yield hf, item[1]

    return gen()


def device_arrays(named: Named) -> tuple[dict[str, Any] | None, Named]:
    """(the tensors by name, if every one is a JAX array; else None, and `named` to push as
    ever: a generator is read no further than its first tensor unless that one is a JAX array)."""
    jax = sys.modules.get("jax")  # (a caller with JAX arrays has imported it; the frontend never does)
    items = iter(named.items() if isinstance(named, Mapping) else named)
    first = next(items, None)
    if jax is None or first is None:
        return None, named if isinstance(named, Mapping) else itertools.chain(
            [] if first is None else [first], items
        )
    rest = itertools.chain([first], items)
    if not _is_jax(first, jax):
        return None, named if isinstance(named, Mapping) else rest
    pairs = list(rest)
    if not all(_is_jax(p, jax) for p in pairs):
        return None, pairs
    out: dict[str, Any] = {}
    for name, a in pairs:
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise ValueError(f"tensor name {name!r:.80}: a non-empty string of at most {MAX_NAME} characters")
        if name in out:
            raise ValueError(f"named_tensors: tensor {name!r} appears twice")
        out[name] = a
    return out, pairs


def _is_jax(item: Any, jax: Any) -> bool:
    return isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[1], jax.Array)


def update_id() -> str:
    """A fresh update id, unique in this process."""
    return f"local-{os.getpid()}-{next(_ids)}"
