"""The runner's side of an update from tensors, with a fake executor (no device): pieces of
rows reassemble exactly, nothing is built before the last part, every error or abandon drops
the whole update, and a part of another update than the one staged is refused."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import numpy as np
import pytest

from ringserve.actors.frontend.weight_buckets import Segment, buckets
from ringserve.actors.transport.messages import TensorRef
from ringserve.model.runtime.weight_sync import WeightError, WeightSync


class FakeExecutor:
    def __init__(self, tensors: dict[str, np.ndarray]):
        self.host_tensors = tensors
        self.built: list[dict[str, np.ndarray]] = []

    def build_params(self, merged):
        self.built.append(merged)
        return "params"

    def swap_params(self, new, merged):
        self.host_tensors = merged

    def discard_params(self, params):
        self.discarded = params


SERVED = {"emb": np.zeros((50, 8), np.float32), "norm": np.zeros(8, np.float32), "w": np.zeros((4, 3), np.float32)}


@pytest.fixture
def sync():
    return WeightSync(FakeExecutor(dict(SERVED)))


@pytest.fixture
def segment():
    seg = Segment.create(f"/rs-{os.getpid()}-{secrets.token_hex(4)}-push0", 1 << 16)
    yield seg
    seg.close()


def parts(named: dict[str, np.ndarray], bucket_bytes: int, seg: Segment) -> Iterator[list[TensorRef]]:
    """Each bucket's refs, the bucket written into `seg` as its refs are taken (stage each before
    taking the next: they share the segment)."""
    for bucket in buckets(named, bucket_bytes):
        seg.write(bucket)
        yield [TensorRef(pc.name, pc.array.dtype.name, list(pc.array.shape), seg.name, pc.offset, pc.nbytes, pc.start)
               for pc in bucket]  # fmt: skip


def test_pieces_reassemble_and_nothing_is_built_before_the_last_part(sync, segment):
    rng = np.random.default_rng(1)
    new = {"emb": rng.standard_normal((50, 8), dtype=np.float32), "w": rng.standard_normal((4, 3), dtype=np.float32)}
    n = 0
    for i, refs in enumerate(parts(new, 256, segment)):  # 8 rows of emb per bucket: emb in 7 pieces
        assert sync.stage(refs, "u1", first=i == 0, last=False).startswith("staged")
        n += 1
    assert n >= 7 and sync.ex.built == []  # nothing built (nothing reaches the device) yet
    assert sync.stage([], "u1", first=False, last=True) == "updated 2 tensors"
    assert len(sync.ex.built) == 1 and sync.staging is None
    np.testing.assert_array_equal(sync.ex.host_tensors["emb"], new["emb"])
    np.testing.assert_array_equal(sync.ex.host_tensors["w"], new["w"])
    assert sync.ex.host_tensors["norm"] is SERVED["norm"]  # a subset: the rest is kept


def test_an_incomplete_tensor_a_bad_piece_or_an_abandon_drops_the_whole_update(sync, segment):
    new = {"emb": np.ones((50, 8), np.float32)}
    first, second, *_ = parts(new, 256, segment)
    sync.stage(first, "u1", first=True, last=False)
    with pytest.raises(WeightError, match="'emb' is incomplete: 8 of 50 rows arrived"):
        sync.stage([], "u1", first=False, last=True)
    assert sync.staging is None and sync.ex.built == []
    # a later part of a dropped update is refused (it never merges into another update)
    with pytest.raises(WeightError, match="not staged"):
        sync.stage(second, "u1", first=False, last=False)
    # out of order, unknown, misshapen: refused naming the tensor, the update dropped
    sync.stage(first, "u2", first=True, last=False)
    with pytest.raises(WeightError, match=r"'emb': a piece of rows \[0, 8\) after 8 of 50 rows"):
        sync.stage(first, "u2", first=False, last=False)
    assert sync.staging is None
    bad = [TensorRef("nope", "float32", [8], segment.name, 0, 32)]
    with pytest.raises(WeightError, match="'nope' is not a weight"):
        sync.stage(bad, "u3", first=True, last=False)
    bad = [TensorRef("norm", "float32", [9], segment.name, 0, 36)]
    with pytest.raises(WeightError, match=r"'norm' has shape \(9,\), the served model's is \(8,\)"):
        sync.stage(bad, "u3", first=True, last=False)
    whole = [TensorRef("norm", "float32", [8], segment.name, 0, 32)]
    sync.stage(whole, "u4", first=True, last=False)
    with pytest.raises(WeightError, match="'norm' sent twice"):
        sync.stage(whole, "u4", first=False, last=False)
    # abandon: only the named update's parts go
    sync.stage(whole, "u5", first=True, last=False)
    sync.abandon("u4")
    assert sync.staging is not None and sync.staging.update == "u5"
    sync.abandon("u5")
    assert sync.staging is None and sync.ex.built == []


def test_a_segment_that_is_gone_is_a_refusal_not_a_crash(sync):
    ref = TensorRef("norm", "float32", [8], f"/rs-{os.getpid()}-00000000-push7", 0, 32)
    with pytest.raises(WeightError, match="segment .* is gone"):
        sync.stage([ref], "u1", first=True, last=True)
    assert sync.staging is None


def test_a_piece_past_its_segment_is_refused(sync, segment):
    ref = TensorRef("norm", "float32", [8], segment.name, (1 << 16) - 16, 32)
    with pytest.raises(WeightError, match="pass its segment"):
        sync.stage([ref], "u1", first=True, last=True)


class Hosts:
    """`agree` of a runner whose peers answer `others`; records what this one said."""

    def __init__(self, others: bool):
        self.others, self.said = others, []

    def __call__(self, ok: bool) -> bool:
        self.said.append(ok)
        return ok and self.others


def test_an_update_commits_only_if_every_host_agrees(segment):
    new = {"w": np.ones((4, 3), np.float32)}
    # another host failed: refused here too, what was built is freed, the old weights serve
    hosts = Hosts(others=False)
    sync = WeightSync(FakeExecutor(dict(SERVED)), hosts)
    sync.agree = Hosts(others=True)
    n = 0
    for i, refs in enumerate(parts(new, 24, segment)):  # 2 rows of w per part
        sync.stage(refs, "u1", first=i == 0, last=False)
        n += 1
    assert n == 2 and sync.agree.said == [True, True]  # every part agrees (the pusher may reuse its segment)
    sync.agree = hosts
    with pytest.raises(WeightError, match="failed on another host"):
        sync.stage([], "u1", first=False, last=True)
    assert hosts.said == [True] and sync.ex.discarded == "params" and sync.ex.host_tensors["w"] is SERVED["w"]
    # a part that failed on another host: refused here too, the update is dropped
    hosts = Hosts(others=False)
    sync = WeightSync(FakeExecutor(dict(SERVED)), hosts)
    with pytest.raises(WeightError, match="part of the update failed on another host"):
        sync.stage(next(parts(new, 256, segment)), "u0", first=True, last=False)
    assert hosts.said == [True] and sync.staging is None
    # this host fails: it still takes part in the agreement (once), with its own reason
    hosts = Hosts(others=True)
    sync = WeightSync(FakeExecutor(dict(SERVED)), hosts)
    with pytest.raises(WeightError, match="no such directory"):
        sync.load_disk("/nonexistent/ckpt")
    with pytest.raises(WeightError, match="not staged"):
        sync.stage([], "u2", first=False, last=True)
    assert hosts.said == [False, False] and sync.ex.built == []
    # every host ok: committed
    sync = WeightSync(FakeExecutor(dict(SERVED)), Hosts(others=True))
    for i, refs in enumerate(parts(new, 256, segment)):
        sync.stage(refs, "u3", first=i == 0, last=False)
    assert sync.stage([], "u3", first=False, last=True) == "updated 1 tensors"
    np.testing.assert_array_equal(sync.ex.host_tensors["w"], new["w"])


# ---- deltas: Rows, mode "add" (model/weights/delta.py) ------------------------------------------
def sparse_parts(named: dict, bucket_bytes: int, seg: Segment) -> Iterator[list[TensorRef]]:
    """As `parts`, for values that may be Rows (the refs as Push.bucket makes them)."""
    for bucket in buckets(named, bucket_bytes):
        seg.write(bucket)
        yield [TensorRef(h.name, h.dtype, h.shape, seg.name, h.offset, h.nbytes, h.start, h.sparse)
               for h in (pc.header() for pc in bucket)]  # fmt: skip


def push(sync: WeightSync, named: dict, seg: Segment, mode: str = "replace", bucket_bytes: int = 1 << 16) -> str:
    for i, refs in enumerate(sparse_parts(named, bucket_bytes, seg)):
        sync.stage(refs, "u", first=i == 0, last=False, mode=mode)
    return sync.stage([], "u", first=False, last=True, mode=mode)


def test_rows_replace_or_add_only_their_rows_in_any_order_and_across_buckets(segment):
    from ringserve import Rows

    rng = np.random.default_rng(2)
    served = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in SERVED.items()}
    a, b = rng.standard_normal((9, 8), dtype=np.float32), rng.standard_normal((3, 8), dtype=np.float32)
    sync = WeightSync(FakeExecutor(dict(served)))
    # two blocks of emb (the later one first; the first cut over buckets of 2 rows), norm whole
    assert push(sync, [("emb", Rows(40, b)), ("emb", Rows(5, a)), ("norm", np.ones(8, np.float32))], segment,
                bucket_bytes=64) == "updated 2 tensors"  # fmt: skip
    want = served["emb"].copy()
    want[5:14], want[40:43] = a, b
    np.testing.assert_array_equal(sync.ex.host_tensors["emb"], want)
    np.testing.assert_array_equal(sync.ex.host_tensors["norm"], np.ones(8, np.float32))
    assert sync.ex.host_tensors["w"] is served["w"]
    # mode "add": rows and whole tensors are added to the served values
    sync = WeightSync(FakeExecutor(dict(served)))
    assert push(sync, {"emb": [Rows(5, a), Rows(40, b)], "w": np.full((4, 3), 0.5, np.float32)}, segment,
                mode="add") == "updated 2 tensors"  # fmt: skip
    want = served["emb"].copy()
    want[5:14] += a
    want[40:43] += b
    np.testing.assert_array_equal(sync.ex.host_tensors["emb"], want)
    np.testing.assert_array_equal(sync.ex.host_tensors["w"], served["w"] + np.float32(0.5))
    assert sync.ex.host_tensors["norm"] is served["norm"]


def test_add_computes_in_float32_and_keeps_the_served_dtype(segment):
    import ml_dtypes

    from ringserve import Rows

    bf16 = np.dtype(ml_dtypes.bfloat16)
    served = {"emb": np.ones((50, 8), bf16), "norm": np.ones(8, bf16)}
    # just over half of bf16's ulp at 1 (2**-7): the float32 sum rounds up to 1 + 2**-7; the
    # delta cast to bf16 first (2**-8 exactly) would tie and round to even, back to 1
    delta = np.full((2, 8), 2.0**-8 * (1 + 2.0**-10), np.float32)
    sync = WeightSync(FakeExecutor(dict(served)))
    push(sync, {"emb": Rows(10, delta), "norm": np.full(8, 2.0**-8, bf16)}, segment, mode="add")
    got = sync.ex.host_tensors
    assert got["emb"].dtype == bf16 and got["norm"].dtype == bf16
    want = np.ones((50, 8), np.float32)
    want[10:12] = 1 + 2.0**-7
    np.testing.assert_array_equal(got["emb"].astype(np.float32), want)
    np.testing.assert_array_equal(got["norm"].astype(np.float32), np.ones(8))  # a bf16 tie: to even


def test_bad_rows_or_modes_are_refused_naming_the_tensor_and_change_nothing(sync, segment):
    from ringserve import Rows

    cases = [
        ({"emb": [Rows(0, np.ones((5, 8), np.float32)), Rows(4, np.ones((2, 8), np.float32))]},
         r"'emb': rows \[0, 5\) and \[4, 6\) overlap"),
        ({"emb": Rows(48, np.ones((3, 8), np.float32))}, r"'emb': rows \[48, 51\) pass its 50 rows"),
        ({"emb": Rows(0, np.ones((2, 7), np.float32))}, r"'emb': rows of shape \(7,\), the served model's are \(8,\)"),
        ({"nope": Rows(0, np.ones((2, 8), np.float32))}, "'nope' is not a weight"),
    ]  # fmt: skip
    for named, match in cases:
        with pytest.raises(WeightError, match=match):
            push(sync, named, segment)
        assert sync.staging is None and sync.ex.built == [] and sync.ex.host_tensors == SERVED
    with pytest.raises(WeightError, match="'emb' sent both whole and as rows"):
        sync.stage(next(sparse_parts({"emb": Rows(0, np.ones((1, 8), np.float32))}, 1 << 16, segment)), "v",
                   first=True, last=False)  # fmt: skip
        sync.stage(next(sparse_parts({"emb": np.ones((50, 8), np.float32)}, 1 << 16, segment)), "v",
                   first=False, last=False)  # fmt: skip
    with pytest.raises(WeightError, match="mode='add' after parts of mode='replace'"):
        sync.stage(next(sparse_parts({"norm": np.ones(8, np.float32)}, 1 << 16, segment)), "w", first=True, last=False)
        sync.stage([], "w", first=False, last=True, mode="add")
    with pytest.raises(WeightError, match=r"mode='mul': one of \['replace', 'add'\]"):
        push(sync, {"norm": np.ones(8, np.float32)}, segment, mode="mul")
    with pytest.raises(ValueError, match="Rows.start=-1"):
        Rows(-1, np.ones((1, 8)))
    with pytest.raises(ValueError, match="appears twice"):
        list(buckets([("emb", Rows(0, np.ones((1, 8), np.float32))), ("emb", np.ones((50, 8), np.float32))], 1 << 16))
