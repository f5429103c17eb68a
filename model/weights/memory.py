"""Where the served weights' memory lives on CPU: the host arrays the state is built in (each a
private mapping of its own, `scratch`), their move onto huge pages, and beside the arrays the
programs take the custom calls' packed copies of them (oneDNN's blocked layout,
model/compute/kernels/onednn_matmul.cc; the kernel's bf16 pairs along K,
model/compute/kernels/pairs.h).

    a = scratch(shape, dtype)         a host array of the state, on a 2 MiB boundary
    reserve_pairs(avals)              the packed pairs' memory, faulted in while programs load
    owner = register(params, dot)     the packed copies of a state (None: no step reads one)
    release(box)                      free box[0]'s copies, once (weight updates, the end)
    huge_pages_when(host, after)      `huge_pages`, on a thread, once after()
"""

from __future__ import annotations

import logging
import mmap
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

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


def register(params: Any, dot: Any) -> Owner:
    """Register the weights with the custom calls that read packed copies of them (`dot`: the
    plan's, model/compute/dots.py `Dot`); the tokens to release them by, or None where no step
    multiplies through either."""
    if params is None or not (dot.kernel or dot.onednn):
        return None
    from ringserve.model.compute.kernels import cpu_matmul, onednn

    leaves = jax.tree_util.tree_leaves(params)
    ours = cpu_matmul.register_weights(leaves) if dot.kernel else None
    return onednn.register_weights(leaves) if dot.onednn else None, ours


def release(box: list[Owner]) -> None:
    """Release the weights registered under box[0] (both custom calls' copies), once."""
    if box[0] is not None:
        from ringserve.model.compute.kernels import cpu_matmul, onednn

        onednn.release_weights(box[0][0])
        cpu_matmul.release_weights(box[0][1])
        box[0] = None


def huge_pages_when(host: Any, after: Callable[[], bool | None]) -> None:
    """`huge_pages` on a thread of its own, once `after()` is true (None: give
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


SCRATCH_MIN = 1 << 22  # NumPy asks for huge pages from 4 MiB up


def scratch(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized host array of the state, a private anonymous mapping of its own (4 MiB
    and up; smaller ones are NumPy's) that starts on a 2 MiB boundary. Three things come of
    that, each measured on SmolLM2 (538 MB f32) on this project's VM:
    - NumPy asks for transparent huge pages for its large arrays (`MADV_HUGEPAGE`), and with the
      usual THP defrag setting (`madvise`) the kernel compacts memory inside the first write of
      each 2 MiB: building the state took 0.24-1.4 s, depending on what the last process left
      free, against 0.47 s steadily on these 4 KiB pages. So the build writes 4 KiB pages, and
      `huge_pages` moves the written array onto huge pages afterwards, off the start-up path;
    - the array starts on a page, so on CPU `jax.device_put` keeps it as the device buffer
      instead of copying it (NumPy's own start 16 bytes in): `place` costs nothing, and peak
      RSS while loading is one copy of the weights, not two;
    - it starts on a huge page's boundary, so that all of it but its last partial 2 MiB can be
      on huge pages (the mapping's 2 MiB beyond the array are never touched: no memory).
    The mapping is the buffer's owner: it is unmapped once the array (and any device array
    aliasing it) is gone."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < SCRATCH_MIN:
        return np.empty(shape, dtype)
    buf = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _SCRATCH_MAPS.add(buf)
    return np.frombuffer(buf, dtype, nbytes // dtype.itemsize, _huge_start(buf)).reshape(shape)


def _huge_start(buf: mmap.mmap) -> int:
    """The offset of the mapping's first 2 MiB boundary: where `scratch` puts its array."""
    return -np.frombuffer(buf, np.uint8, 1).ctypes.data % _HUGE


_HUGE = 2 << 20  # a transparent huge page (x86-64, and arm64 with 4 KiB pages)
MADV_COLLAPSE = 25  # linux/mman.h (6.1+); Python 3.11's mmap does not name it
_SCRATCH_MAPS: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # `scratch`'s mappings (huge_pages' to move)


def huge_pages(tree: Any) -> int:
    """Move the written `scratch` arrays of `tree` onto transparent huge pages, in place
    (`madvise(MADV_HUGEPAGE)`, then `MADV_COLLAPSE`, which copies each 2 MiB into a huge page
    and leaves every value as it was; readers, a running step among them, see the same bytes
    throughout). Bytes now on huge pages; 0 where the kernel has no THP or no MADV_COLLAPSE
    (before 6.1: `MADV_HUGEPAGE` alone lets khugepaged do it later) or has no free huge pages.

    Why: a decode step streams every weight once, and on 4 KiB pages that is a TLB miss every
    4 KiB (a nested walk in a VM). SmolLM2's whole decode step at one row, weights on 4 KiB
    against huge pages, alternated 20 times in one process: f32 28.04 -> 24.88 ms (faster in
    19 of 20), bf16 + int8 10.36 -> 9.60 ms (17 of 20); 64 rows f32 221 -> 210 ms (8 of 8). A
    server's single-stream ITL (4 streams of 300 tokens, 3 starts each way, alternating): bf16
    + int8 9.04 / 9.47 / 9.47 -> 8.36 / 8.86 / 8.83 ms, f32 22.67 / 23.26 / 24.83 -> 22.22 /
    23.34 / 23.24. The KV pool on huge pages too: no difference (64 rows, alternated). Alone,
    MADV_COLLAPSE took 0.14 s for 531 MB."""
    done, seen = 0, set[mmap.mmap]()
    for leaf in jax.tree_util.tree_leaves(tree):
        buf = getattr(leaf, "base", None)  # a view's base, ..., NumPy's frombuffer array, its memoryview, the mapping
        while buf is not None and not isinstance(buf, mmap.mmap):
            buf = buf.obj if isinstance(buf, memoryview) else getattr(buf, "base", None)
        if buf is None or buf in seen or buf not in _SCRATCH_MAPS:
            continue
        seen.add(buf)  # a stack's per-layer views share their mapping: once each
        off = _huge_start(buf)
        length = (len(buf) - _HUGE) // _HUGE * _HUGE  # the array's whole 2 MiB (its tail stays)
        if length <= 0:
            continue
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, off, length)
            buf.madvise(MADV_COLLAPSE, off, length)
        except (OSError, ValueError, AttributeError):
            continue  # no THP here, no MADV_COLLAPSE (EINVAL), none free (EAGAIN / ENOMEM): 4 KiB pages
        done += length
    return done
