"""The state's large host arrays (model/weights/memory.py `scratch`): on pages of their own, so that on
CPU `jax.device_put` keeps them as the device buffers instead of copying them, and moved onto
transparent huge pages once written (`huge_pages`)."""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
import pytest

from ringserve.model.weights.memory import huge_pages, huge_pages_when, scratch


def test_a_large_scratch_array_is_page_aligned_and_placed_without_a_copy():
    a = scratch((3, 1024, 700), np.float32)  # 8.6 MB
    assert a.shape == (3, 1024, 700) and a.dtype == np.float32 and a.flags.writeable
    assert a.ctypes.data % 4096 == 0
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    placed = jax.device_put(a)
    assert jax.devices()[0].platform != "cpu" or placed.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(placed), np.arange(a.size, dtype=np.float32).reshape(a.shape))
    ref = np.asarray(placed).copy()
    del a  # the device array keeps the mapping alive
    np.testing.assert_array_equal(np.asarray(placed), ref)
    placed.delete()


def test_a_small_scratch_array_is_numpys():
    b = scratch((4, 8), np.int8)
    assert b.shape == (4, 8) and b.dtype == np.int8 and b.base is None


def _thp() -> str | None:
    """Why transparent huge pages cannot be asked for here, or None."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "no /sys/kernel/mm/transparent_hugepage (not Linux, or no THP)"
    if "[never]" in mode:
        return "transparent huge pages are off here ([never])"
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return None if (major, minor) >= (6, 1) else "MADV_COLLAPSE needs Linux 6.1"


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and head[0] == "AnonHugePages:":
            return int(head[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_scratch_array_starts_on_a_huge_page():
    a = scratch((5, 1000, 1000), np.float32)  # 20 MB
    assert a.ctypes.data % (2 << 20) == 0


@pytest.mark.skipif(_thp() is not None, reason=str(_thp()))
def test_huge_pages_moves_the_written_arrays_and_keeps_every_value():
    stack = scratch((4, 1024, 1536), np.float32)  # 24 MiB: 12 huge pages
    stack[...] = np.arange(stack.size, dtype=np.float32).reshape(stack.shape)
    emb = scratch((3000, 1000), np.int8)  # 3 MB: below _scratch's 4 MiB, NumPy's own
    emb[...] = 7
    want = stack.copy()
    placed = jax.device_put(stack)
    tree = {"layers": {layer: {"w": stack[layer]} for layer in range(4)}, "emb": emb}  # views, as unrolled
    assert _huge_kb(stack.ctypes.data) == 0  # written on 4 KiB pages
    moved = huge_pages(tree)
    assert moved == 12 * (2 << 20)  # the one mapping (four views of it), once
    assert _huge_kb(stack.ctypes.data) == 12 * 2048
    np.testing.assert_array_equal(stack, want)
    assert (emb == 7).all()
    if jax.devices()[0].platform == "cpu":  # still the device buffer, the same values
        assert placed.unsafe_buffer_pointer() == stack.ctypes.data
    np.testing.assert_array_equal(np.asarray(placed), want)
    placed.delete()


def test_the_executors_thread_waits_and_leaves_an_executor_that_is_gone():
    stack = scratch((2, 1024, 1024), np.float32)
    stack[...] = 1
    answers = iter([False, False, None])  # not serving yet, twice; then the executor is gone
    t = threading.Thread(target=huge_pages_when, args=({"w": stack}, lambda: next(answers)))
    t.start()
    t.join(5)
    assert not t.is_alive() and next(answers, "asked once more") == "asked once more"
    assert _thp() is not None or _huge_kb(stack.ctypes.data) == 0  # never moved
    assert (stack == 1).all()


@pytest.mark.skipif(_thp() is not None, reason=str(_thp()))
def test_the_executors_thread_moves_the_weights_once_it_may():
    stack = scratch((2, 1024, 1024), np.float32)  # 8 MiB: 4 huge pages
    stack[...] = 3
    answers = iter([False, True])
    t = threading.Thread(target=huge_pages_when, args=({"w": stack}, lambda: next(answers)))
    t.start()
    t.join(10)
    assert not t.is_alive() and _huge_kb(stack.ctypes.data) == 4 * 2048
    assert (stack == 3).all()


def test_huge_pages_moves_only_scratch_arrays():
    import mmap

    other = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not `_scratch`'s
    a = np.frombuffer(other, np.float32)
    a[:] = 2
    assert huge_pages({"w": a, "small": np.ones(8, np.float32)}) == 0
    assert _thp() is not None or _huge_kb(a.ctypes.data) == 0
    assert (a == 2).all()
