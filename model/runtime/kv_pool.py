"""The KV cache's arrays (the attention backend's) and the FutureMap (token, position per slot
+ sink) on device, one generation at a time: `new` makes them zeroed, `drop` frees them
(release / resume of device memory), every step replaces them with its outputs (donated, so
the update is in place).

On CPU the cache's pages come on first write (model/compute/kernels/cpu_memory.py: XLA's zeros
first-touched SmolLM2 f32's 2.1 GiB before the first request, 6.7 s of a 13 s warm start on this
project's VM), brought in by a thread once the server serves and the pool's first step is done.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import jax
import numpy as np

from ringserve.model.compute.kernels import cpu_memory
from ringserve.model.compute.mesh import place_host_array

log = logging.getLogger(__name__)

# Seconds a new pool waits, once the server serves, for its first step before its pages are
# brought in anyway
FIRST_STEP_WAIT_S = 1.0


class KVPool:
    def __init__(self, avals: tuple[Any, Any], serving: threading.Event):
        self.avals = avals  # (the cache's arrays, the FutureMap's two), abstract: what programs take
        self._serving = serving  # set once the server serves (the executor's lead programs are in)
        self.kv: Any = None
        self.future: Any = None
        self.generation = 0  # new / drop count up: a generation's page-populating thread stops
        self.populating: cpu_memory.Populating | None = None  # the page-populating thread
        self._first_out: jax.Array | None = None  # the generation's first step's tokens

    def stepped(self, tokens: jax.Array) -> None:
        """A step ran on this generation (its sampled tokens): the first lets the pages in."""
        if self._first_out is None:
            self._first_out = tokens

    def new(self) -> None:
        """A zeroed cache and FutureMap; on CPU their pages come in on a thread (`after`)."""
        kv, future = self.avals
        self.kv = tuple(cpu_memory.zeros(a) for a in kv)
        self.future = tuple(place_host_array(np.zeros(f.shape, f.dtype), f.sharding) for f in future)
        generation = self.generation = self.generation + 1
        self._first_out = None
        me = weakref.ref(self)  # the thread must not keep a pool (and its executor) that failed to start

        def stop() -> bool:
            pool = me()
            return pool is None or pool.generation != generation

        serving_since: float | None = None  # when `after` first saw the server serving

        def after() -> bool | None:
            """Once the server serves and the pool's first step is done, or it served
            FIRST_STEP_WAIT_S with none; None once the pool is gone."""
            nonlocal serving_since
            pool = me()
            if pool is None or stop():
                return None
            if not pool._serving.is_set():
                return False
            if pool._first_out is not None:
                try:
                    pool._first_out.block_until_ready()
                except Exception:  # noqa: BLE001 -- a failed (or freed) step: the pages come all the same
                    log.debug("the KV pool's first step did not finish; bringing its pages in", exc_info=True)
                return True
            now = time.monotonic()
            serving_since = now if serving_since is None else serving_since
            return now - serving_since >= FIRST_STEP_WAIT_S

        # once the server serves: beside the lead programs' tracing it was ready ~1.5 s later.
        # Beside the background compile it slows the loads (their executables' mappings wait for
        # its faults on the process's mmap lock: SmolLM2's first background program 5.6 s instead
        # of 0.14), but a step compiles its own program at once (executor `prepare`); after every
        # program (tried) it ran beside the first steps once all were compiled (`ringserve
        # generate`'s tiny-model throughput 4.1-4.3k tok/s against 6.8-7.2k). After the pool's
        # first step: beside it, that step (usually the server's first request) took 0.13-0.79 s
        # instead of 0.10-0.12 (SmolLM2 bf16, a 2-token prompt right after a warm start).
        self.populating = cpu_memory.populate(self.kv, stop=stop, after=after)

    def settled(self) -> bool:
        """Whether no thread is (or will be) bringing this pool's pages in."""
        return self.populating is None or not self.populating.is_alive()

    def drop(self) -> None:
        """Free the cache and FutureMap on the device."""
        self.generation += 1  # a thread still bringing the pages in stops
        for leaf in jax.tree_util.tree_leaves((self.kv, self.future)):
            leaf.delete()
        self.kv, self.future = None, None
