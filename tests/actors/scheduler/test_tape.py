"""The per-position tape (hidden states, routed experts): what a retraction repeats keeps the
first forward's values, positions before `first` are dropped, the prefix cache stops at `end`."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.scheduler.req import Req
from ringserve.actors.scheduler.tape import PositionTape
from ringserve.actors.transport.sampling import SamplingParams


def test_record_keeps_the_first_forwards_values():
    t = PositionTape()
    t.record(0, np.arange(5))  # a prefill of 5 positions
    t.record(5, np.array([50]))  # a decode step
    t.record(0, np.full(7, -1))  # retracted: prefilled again, then one position more
    np.testing.assert_array_equal(t.values(8), [0, 1, 2, 3, 4, 50, -1])
    np.testing.assert_array_equal(t.values(6), [0, 1, 2, 3, 4, 50])
    with pytest.raises(AssertionError, match="only up to 7"):
        t.record(8, np.zeros(1))  # a gap: the prefix cache skipped positions it must not


def test_positions_before_first_are_dropped():
    t = PositionTape(first=3)
    assert t.end == 3 and t.values(10) is None
    t.record(0, np.arange(6))  # a prefill from 0 (nothing cached)
    t.record(6, np.array([60, 70]))
    np.testing.assert_array_equal(t.values(8), [3, 4, 5, 60, 70])
    u = PositionTape(first=3)
    u.record(2, np.arange(2, 5))  # a prefill after a cached prefix of 2
    np.testing.assert_array_equal(u.values(5), [3, 4])


def _req(**kw) -> Req:
    return Req("r", np.arange(10, 30, dtype=np.int32), SamplingParams(max_new_tokens=4, sampling_seed=1), **kw)


def test_the_prefix_cache_stops_where_the_tape_ends():
    assert len(_req().prefix_ids()) == 19  # every token but the last
    assert len(_req(routed=PositionTape(first=12)).prefix_ids()) == 12  # positions 12.. are computed again
    assert len(_req(routed=PositionTape(first=25)).prefix_ids()) == 19
    r = _req(routed=PositionTape(), hidden=PositionTape())
    assert r.return_routed_experts and r.return_hidden_states and len(r.prefix_ids()) == 0
    r.routed.record(0, np.zeros((20, 2, 2), np.uint8))  # its prompt was computed
    r.hidden.record(0, np.zeros((20, 4), np.float32))
    r.output_ids = [5, 6]  # its outputs so far: their positions were recorded but the last's
    r.routed.record(20, np.zeros((1, 2, 2), np.uint8))
    r.hidden.record(20, np.zeros((1, 4), np.float32))
    assert len(r.prefix_ids()) == 21  # a retracted request's recorded positions may come from the cache
