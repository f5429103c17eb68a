"""Where the served weights' memory lives on CPU, beside the arrays the programs take: the custom
calls' packed copies of them (oneDNN's blocked layout, model/compute/kernels/onednn_matmul.cc; the
kernel's bf16 pairs along K, model/compute/kernels/pairs.h) and the host arrays' move onto huge pages.

    reserve_pairs(avals)              the packed pairs' memory, faulted in while programs load
    owner = register(params, dot)     the packed copies of a state (None: no step reads one)
    release(box)                      free box[0]'s copies, once (weight updates, the end)
    huge_pages_when(host, after)      model/weights/state.py `huge_pages`, on a thread, once after()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
from ringserve.model.weights.state import huge_pages

log = logging.getLogger(__name__)

Owner = tuple[int | None, int | None] | None  # (oneDNN's token, the kernel's token), or None


def reserve_pairs(avals: Any) -> None:
    """The memory of the kernel's packed pairs of these weights, faulted in on a thread while
    the programs load, before `register` packs into it (model/compute/kernels/cpu_matmul.py `reserve`):
    packed into fresh pages, SmolLM2 bf16's first step after a warm start took 0.2-0.9 s on
    this project's VM (perf: 92% of it the kernel clearing pages), and a served start's first
    answer came 0.35-0.76 s after its /v1/models did, 0.09-0.19 s after a reserve (6 starts
    each). At start only: a weight update packs after the old copies are freed, and a reserve
    beside them would hold both."""
    from ringserve.model.compute.kernels import cpu_matmul

    cpu_matmul.reserve(jax.tree_util.tree_leaves(avals))


def register(params: Any, dot: str) -> Owner:
    """Register the weights with the custom calls that read packed copies of them (`dot`:
    model/compute/plan.py resolve_dot); the tokens to release them by, or None where no step
    multiplies through either."""
    if params is None or not dot.startswith(("onednn", "kernel")):
        return None
    from ringserve.model.compute.kernels import cpu_matmul, onednn

    leaves = jax.tree_util.tree_leaves(params)
    ours = cpu_matmul.register_weights(leaves) if dot.startswith("kernel") else None
    return onednn.register_weights(leaves) if "onednn" in dot else None, ours


def release(box: list[Owner]) -> None:
    """Release the weights registered under box[0] (both custom calls' copies), once."""
    if box[0] is not None:
        from ringserve.model.compute.kernels import cpu_matmul, onednn

        onednn.release_weights(box[0][0])
        cpu_matmul.release_weights(box[0][1])
        box[0] = None


def huge_pages_when(host: Any, after: Callable[[], bool | None]) -> None:
    """model/weights/state.py `huge_pages` on a thread of its own, once `after()` is true (None: give
    up), beside the steps already running on these weights (it moves no value). It waits for
    every program to be loaded and for the KV pool's pages to be in: started beside the lead
    programs' loading, it made a warm start's executor ~1.7 s slower (SmolLM2 f32: 1.6-2.2 ->
    3.5-4.0 s; the collapse took 1.4-2.3 s there against 0.14 s alone), and started as the
    executor serves, the server's first answer ~0.6 s later (launch to the first answered
    request, 5 starts each, alternating: medians 3.32 -> 3.96 s)."""
    while not (ready := after()):
        if ready is None:
            return
        time.sleep(0.25)
    t0 = time.perf_counter()
    moved = huge_pages(host)
    log.debug("weights on huge pages: %.0f MB in %.2f s", moved / 1e6, time.perf_counter() - t0)
