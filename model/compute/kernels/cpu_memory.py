"""Large zeroed arrays on CPU without touching their pages first (cpu_memory.cc), and a
background pass that brings those pages in while the server already serves.

The KV pool is most of a CPU server's memory (SmolLM2 f32, 64 requests of 768 tokens:
2.1 GiB). XLA's zeros write all of it before the first request can run, and the first write
of a page is a page fault: on this project's VM (whose host backs guest memory on first use)
7.2 s for 2.1 GiB, against 0.23 s for pages the guest had just freed; that was half of a
warm start. `zeros` gives the same zeros with the pages left to come on first write
(`madvise(MADV_DONTNEED)` over private anonymous memory; the custom call checks the mapping
and writes the zeros itself otherwise), and `populate` then faults them in on a thread, once
the server serves (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+: it never changes what a page
holds, so it may run beside the steps that write the pool), so that the requests do not pay
for the faults inside their steps. At the default CPU priority, from the moment the server
serves: run at the lowest priority after the background compile, it left most pages cold for
a burst sent once everything was compiled, which faulted them in its prefills (SmolLM2 f32,
64 requests: TTFT median 27.7-28.8 s against 25.1 with the pool written at start; 20.8 as
now). The price: requests in its first seconds share the cores with it (a 1-token request
~1 s for ~8 s after ready on this VM, 0.1 s after). The executor holds it back until the pool's
first step is done (or the pool has served a second with none): begun as the server served, it
made that step, usually the server's first request, 0.13-0.79 s instead of 0.10-0.12 (SmolLM2
bf16, a 2-token prompt after a warm start; the pass had begun up to 0.5 s into serving).
Where the kernel does not build (no compiler) or on any other platform, `zeros` is XLA's and
nothing is populated.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ringserve.model.compute.kernels.build import loader

log = logging.getLogger(__name__)

TARGET = "ringserve_lazy_zeros"

reason = loader("cpu_memory", ["-O2"], {TARGET: "RingserveLazyZeros"})
"""None when the custom call runs here; otherwise why not."""

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+)
# Bytes a madvise call populates (`stop` is checked between chunks). The call holds the
# process's mmap lock as a reader while it faults: an allocation's mmap behind a 64 MiB chunk
# waited up to ~0.2 s on this VM, and 1-token requests served meanwhile took 1.6-2.3 s (1 MiB
# chunks: 0.7-0.9 s; none populating: 0.4-0.7 s, the background compile beside them).
CHUNK = 1 << 20


def zeros(aval: jax.ShapeDtypeStruct) -> jax.Array:
    """An array of zeros with `aval`'s shape, dtype and sharding: on CPU through the custom call
    (its pages come on first write), elsewhere XLA's."""
    sharding = aval.sharding
    cpu = jax.devices()[0].platform == "cpu"
    if not cpu or reason() is not None:
        if cpu:
            log.debug("KV pool zeroed by XLA (every page touched now): %s", reason())
        return jax.jit(lambda: jnp.zeros(aval.shape, aval.dtype), out_shardings=sharding)()
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:  # each device its shard
        local = jax.ShapeDtypeStruct(sharding.shard_shape(aval.shape), aval.dtype)
        make = jax.shard_map(lambda: jax.ffi.ffi_call(TARGET, local)(), mesh=sharding.mesh, in_specs=(),
                             out_specs=sharding.spec, check_vma=False)  # fmt: skip
        return jax.jit(make, out_shardings=sharding)()
    return jax.jit(lambda: jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(aval.shape, aval.dtype))(),
                   out_shardings=sharding)()  # fmt: skip


class Populating(threading.Thread):
    """The thread `populate` runs; `began`: time.monotonic() when it asked for the first page."""

    began: float | None = None


def populate(arrays: Sequence[jax.Array], stop: Callable[[], bool],
             after: Callable[[], bool | None] | None = None) -> Populating | None:  # fmt: skip
    """Fault in every page of `arrays` (this process's shards) on a daemon thread, once `after()`
    answers True (asked every 50 ms; None: never); it ends early once `stop()` is true (the
    arrays were freed or replaced), also while it waits (an owner that failed before `after()`
    turned true must not be kept waiting). None where nothing is to be done (not CPU, not Linux)."""
    if jax.devices()[0].platform != "cpu":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    spans = [(s.data.unsafe_buffer_pointer(), s.data.nbytes) for a in arrays for s in a.addressable_shards]

    def run() -> None:
        while after is not None:
            if stop() or (go := after()) is None:
                return
            if go:
                break
            time.sleep(0.05)
        t.began = time.monotonic()
        page, t0 = mmap.PAGESIZE, time.perf_counter()
        for ptr, size in spans:
            lo, hi = -(-ptr // page) * page, (ptr + size) // page * page
            for at in range(lo, hi, CHUNK):
                if stop():
                    return
                if madvise(at, min(CHUNK, hi - at), MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()  # EINVAL: a kernel before 5.14; ENOMEM: freed meanwhile
                    log.debug("KV pages left to their first write: madvise: %s", errno.errorcode.get(err, err))
                    return
        log.debug("KV pool's pages in: %.0f MB in %.2f s", sum(n for _, n in spans) / 1e6, time.perf_counter() - t0)

    t = Populating(target=run, name="ringserve-kv-populate", daemon=True)
    t.start()
    return t
