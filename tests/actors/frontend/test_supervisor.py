"""The supervisor's parts without processes: the crash-loop policy, the journal of what a
restarted engine must get back (pause, released memory, weights from disk and from tensors),
each live request's resubmission (what its caller already has), and `reattach`'s order: the
journal's state, every request again (an aborted one aborted again), then the calls that wait
(a weight update in flight fails with the reason). The real kills: tests/engine/test_supervisor.py."""

from __future__ import annotations

import json
import os
import secrets
import threading

import numpy as np
import pytest

from actors.frontend.core import FrontendCore
from actors.frontend.supervisor import Journal, RestartPolicy
from actors.transport import messages as m
from tests.actors.frontend.test_core import Tok, out, spec


def test_more_than_k_crashes_in_t_seconds_give_up_and_old_ones_are_forgotten():
    p = RestartPolicy(3, 60.0)
    assert [p.crashed(t) for t in (0.0, 10.0, 20.0)] == [None, None, None]
    assert "4 crashes within 60 s (more than max_restarts=3" in (p.crashed(30.0) or "")
    p = RestartPolicy(3, 60.0)
    assert all(p.crashed(t) is None for t in (0.0, 50.0, 100.0, 150.0, 200.0))  # never 4 within 60 s
    assert "supervise=False" in (RestartPolicy(0, 60.0).crashed(0.0) or "")


def ok(kind: str, version: str | None = None) -> m.ControlReply:
    payload = json.dumps({"weight_version": version}).encode() if version else b""
    return m.ControlReply(kind, True, "", payload)


def segment(tensors: dict[str, np.ndarray]) -> list[m.TensorRef]:
    from actors.frontend.weights import _write_segment

    name = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-test"
    items = list(tensors.items())
    return _write_segment(name, items, sum(a.nbytes for _, a in items))


def test_the_journal_keeps_what_the_scheduler_confirmed(tmp_path):
    from actors.frontend.weights import _unlink
    from model.weight_sync import tensors_from_segments

    j = Journal(str(tmp_path))
    assert j.restore() == [] and j.why_not() is None
    j.confirmed(m.PauseReq("retract"), ok("pause"))
    j.confirmed(m.MemoryReq("release", ["kv_cache", "weights"]), ok("memory"))
    j.confirmed(m.MemoryReq("resume", ["weights"]), ok("memory"))
    j.confirmed(m.ContinueReq(), m.ControlReply("continue", False, "refused"))  # a refusal changes nothing
    assert j.restore() == [("memory", m.MemoryReq("release", ["kv_cache"])), ("pause", m.PauseReq("in_place"))]
    j.confirmed(m.ContinueReq(), ok("continue"))
    assert j.restore() == [("memory", m.MemoryReq("release", ["kv_cache"]))]

    a, b, c = (np.full((2, 3), v, np.float32) for v in (1, 2, 3))
    refs = [segment({"x": a}), segment({"y": b})]
    try:  # a two-part update: only the whole counts, the latest value of each name
        j.confirmed(m.UpdateWeightsReq("tensor", part=0, parts=2, tensors=refs[0]), ok("update_weights"))
        assert j.tensors == {} and j.updates == 0
        j.confirmed(m.UpdateWeightsReq("tensor", part=1, parts=2, tensors=refs[1]), ok("update_weights", "1"))
    finally:
        for r in refs:
            _unlink(r[0].segment)
    refs = [segment({"x": c})]
    try:  # refused: nothing of it is kept
        j.confirmed(m.UpdateWeightsReq("tensor", tensors=refs[0]), m.ControlReply("update_weights", False, "no"))
    finally:
        _unlink(refs[0][0].segment)
    assert (j.version, j.updates, sorted(j.tensors)) == ("1", 1, ["x", "y"])
    with j.start_weights() as w:  # what a restarted runner maps: the tensors as pushed
        assert (w.version, w.updates) == ("1", 1)
        got = tensors_from_segments(w.tensors)
        name = w.tensors[0].segment
    assert got.keys() == {"x", "y"} and (got["x"] == a).all() and (got["y"] == b).all()
    assert not os.path.exists("/dev/shm" + name)  # unlinked once the actors started

    other = tmp_path / "step7"
    other.mkdir()
    j.confirmed(m.UpdateWeightsReq("disk", str(other)), ok("update_weights", "v7"))  # a full load: the base
    assert (j.model_dir, j.tensors, j.version, j.updates) == (str(other), {}, "v7", 2)
    with j.start_weights() as w:
        assert w == m.StartWeights("v7", 2)
    other.rmdir()
    assert f"loaded from {other}, which no longer exists" in (j.why_not() or "")


def test_a_resubmission_carries_what_the_caller_already_has():
    core = FrontendCore(Tok())
    st = core.add(spec("A", stream=True), now=0.0)
    assert core.resubmission(st).resume is None  # nothing delivered: sent again as it was
    core.apply(m.BatchStrOut([out("A", [7, 8], 2, cached_tokens=2, weight_version="v1")], ["seven"]), now=1.0)
    core.apply(m.BatchStrOut([out("A", [9], 3, cached_tokens=2, weight_version="v2")], ["!"]), now=2.0)
    g = core.resubmission(st)
    assert (g.rid, m.as_i32(g.input_ids).tolist(), g.sampling, g.stream) == ("A", [1, 2, 3], st.spec.sampling, True)
    assert g.resume == m.Resume(m.i32([7, 8, 9]), len("seven!"), 2, [("v1", 0), ("v2", 2)])


class FakeRing:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, raw: bytes) -> None:
        self.sent.append(m.to_scheduler.decode(raw))

    def recv(self, timeout: float | None = None) -> None:
        threading.Event().wait(timeout or 0)


@pytest.fixture
def tm(tiny_dir):
    from actors.frontend.actor import TokenizerManager
    from actors.server_args import ServerArgs
    from model.checkpoints.tokenizer import load_tokenizer

    t = TokenizerManager(load_tokenizer(tiny_dir("llama")), FakeRing(), FakeRing(), args=ServerArgs(), vocab_size=2048)
    yield t
    t.close()


def test_reattach_sends_the_state_then_every_request_then_the_calls_that_wait(tm):
    async def scenario():
        a, b = (tm.core.add(spec(r, stream=True), now=0.0) for r in ("A", "B"))
        tm.core.apply(m.BatchStrOut([out("A", [7], 1)], ["x"]), now=1.0)
        b.aborted = True  # its abort was lost with the dead scheduler
        info = tm.loop.create_task(tm.control(m.InfoReq(), "info"))
        update = tm.loop.create_task(tm.control(m.UpdateWeightsReq("disk", "/w"), "update_weights"))
        await asyncio_sleep0()
        new = FakeRing()
        lost = m.ControlReply("update_weights", False, "restarted", b'{"weight_version": "0"}')
        futs, n = await tm.reattach(new, FakeRing(), [("pause", m.PauseReq("in_place"))], lost)
        assert n == 2 and [c.kind for c in tm.replies] == ["pause", "info"]
        assert [type(x).__name__ for x in new.sent] == ["PauseReq", "GenerateReq", "GenerateReq", "AbortReq", "InfoReq"]
        assert new.sent[1].resume is not None and new.sent[2].resume is None and new.sent[3].rid == "B"
        assert (await update).message == "restarted" and not info.done() and len(futs) == 1
        info.cancel()

    tm.lt.run(scenario())


async def asyncio_sleep0() -> None:
    import asyncio

    await asyncio.sleep(0)
