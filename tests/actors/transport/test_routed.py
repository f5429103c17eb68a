"""Routed experts on the wire: the narrow ids between the actors, SGLang's base64 int32 to the user."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
import pytest

from ringserve.actors.transport import messages as m
from ringserve.actors.transport import routed


def test_the_narrowest_integer_that_holds_every_expert():
    assert routed.wire_dtype(8) == np.uint8 and routed.wire_dtype(256) == np.uint8
    assert routed.wire_dtype(257) == np.int16 and routed.wire_dtype(1 << 15).itemsize == 2
    for n in (0, (1 << 15) + 1):
        with pytest.raises(ValueError, match="num_experts"):
            routed.wire_dtype(n)
    assert routed.dtype_of(1) == np.uint8 and routed.dtype_of(2) == np.dtype("<i2")


def test_meta_info_is_what_slime_decodes():
    """slime's decode: np.frombuffer(b64decode(s), np.int32).reshape(len(tokens) - 1, layers, topk)."""
    ids = np.random.default_rng(0).integers(0, 128, (7, 3, 2)).astype(np.uint8)
    text = routed.encode(ids)
    slime = np.frombuffer(base64.b64decode(text.encode("ascii")), dtype=np.int32).reshape(7, 3, 2)
    np.testing.assert_array_equal(slime, ids)
    np.testing.assert_array_equal(routed.decode(text, 3, 2), ids)
    assert len(base64.b64decode(text)) == 7 * 3 * 2 * 4 and routed.encode(np.zeros(0)) == ""


def test_messages_carry_them_narrow():
    ids = np.arange(5 * 2 * 4, dtype=np.int64).reshape(5, 2, 4) % 300
    wire = routed.wire_dtype(300)
    res = m.StepResultMsg(1, m.i32([7]), routed_rows=m.i32([5]), routed=ids.astype(wire).tobytes(),
                          routed_shape=(2, 4), routed_itemsize=wire.itemsize)  # fmt: skip
    back = m.from_runner.decode(m.encode(res))
    assert isinstance(back, m.StepResultMsg)
    assert len(back.routed) == ids.size * 2 and tuple(back.routed_shape) == (2, 4)
    got = np.frombuffer(back.routed, routed.dtype_of(back.routed_itemsize)).reshape(-1, *back.routed_shape)
    np.testing.assert_array_equal(got, ids)
    out = m.TokenOut("r", m.i32([1]), 3, 1, routed=ids[:3].astype(wire).tobytes(), routed_shape=(2, 4),
                     routed_itemsize=wire.itemsize)  # fmt: skip
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=m.TokenOut)
    np.testing.assert_array_equal(np.frombuffer(again.routed, routed.dtype_of(again.routed_itemsize)), ids[:3].ravel())
