"""The state's large host arrays (model/params.py `_scratch`): on pages of their own, so that on
CPU `jax.device_put` keeps them as the device buffers instead of copying them."""

from __future__ import annotations

import jax
import numpy as np

from model.params import _scratch


def test_a_large_scratch_array_is_page_aligned_and_placed_without_a_copy():
    a = _scratch((3, 1024, 700), np.float32)  # 8.6 MB
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
    b = _scratch((4, 8), np.int8)
    assert b.shape == (4, 8) and b.dtype == np.int8 and b.base is None
