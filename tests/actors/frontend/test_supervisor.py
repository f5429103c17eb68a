"""The supervisor's parts without processes: the crash-loop policy, the journal of what a
restarted engine must get back (pause, released memory, weights from disk and from tensors; a
copy that fails refuses restarts), each live request's resubmission (what its caller already
has), `reattach`'s order (the journal's state, every request again, an aborted one aborted again,
then the calls that wait; a weight update in flight fails with the reason), and the Supervisor
itself over fake actor groups: a death restarts and resubmits, a crash loop, failed starts in a
row and weights that cannot come back give up with EngineDead for every caller. The real kills:
tests/engine/test_supervisor.py."""

from __future__ import annotations

import json
import os
import secrets
import threading

import numpy as np
import pytest

from ringserve.actors.frontend.core import FrontendCore
from ringserve.actors.frontend.journal import Journal
from ringserve.actors.frontend.supervisor import RestartPolicy
from ringserve.actors.transport import messages as m
from tests.actors.frontend.test_core import Tok, out, spec


def test_more_than_k_crashes_in_t_seconds_give_up_and_old_ones_are_forgotten():
    p = RestartPolicy(3, 60.0)
    assert [p.crashed(t) for t in (0.0, 10.0, 20.0)] == [None, None, None]
    assert "4 crashes within 60 s (more than max_restarts=3" in (p.crashed(30.0) or "")
    p = RestartPolicy(3, 60.0)
    assert all(p.crashed(t) is None for t in (0.0, 50.0, 100.0, 150.0, 200.0))  # never 4 within 60 s
    assert "supervise=False" in (RestartPolicy(0, 60.0).crashed(0.0) or "")
    assert RestartPolicy(3, 60.0).failed_starts(3) is None
    assert "4 starts of the actors failed in a row" in (RestartPolicy(3, 60.0).failed_starts(4) or "")


def ok(kind: str, version: str | None = None) -> m.ControlReply:
    payload = json.dumps({"weight_version": version}).encode() if version else b""
    return m.ControlReply(kind, True, "", payload)


def segment(tensors: dict[str, np.ndarray]) -> list[m.TensorRef]:
    """The tensors in one new shared-memory segment (0600), as a push leaves them for the runner."""
    import mmap

    import posix_ipc

    name = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-test"
    size = sum(a.nbytes for a in tensors.values())
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    refs, off = [], 0
    with mmap.mmap(shm.fd, size) as mm:
        for k, a in tensors.items():
            mm[off : off + a.nbytes] = a.tobytes()
            refs.append(m.TensorRef(k, a.dtype.name, list(a.shape), name, off, a.nbytes))
            off += a.nbytes
    shm.close_fd()
    return refs


def _unlink(name: str) -> None:
    import posix_ipc

    posix_ipc.unlink_shared_memory(name)


def read_back(refs: list[m.TensorRef]) -> dict[str, np.ndarray]:
    """What a restarted runner reads from the journal's segment."""
    from ringserve.actors.frontend.journal import _read_tensors

    got: dict = {}
    _read_tensors(refs, got)
    return {k: np.frombuffer(bytes(t.data), t.dtype).reshape(t.shape) for k, t in got.items()}


def test_the_journal_keeps_what_the_scheduler_confirmed(tmp_path):
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
        got = read_back(w.tensors)
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


def test_the_journal_brings_the_lora_adapters_back(tmp_path):
    """New actors start with lora_paths' adapters; the journal unloads those unloaded since and
    loads those loaded since (a refusal's reply says what is loaded, too)."""
    import json

    def reply(ok: bool, loaded: dict) -> m.ControlReply:
        return m.ControlReply("lora", ok, "", json.dumps({"loaded_adapters": loaded}).encode())

    j = Journal(str(tmp_path), {"a": "/a", "b": "/b"})
    assert j.restore() == []
    j.confirmed(m.LoraReq("load", "c", "/c"), reply(True, {"a": "/a", "b": "/b", "c": "/c"}))
    j.confirmed(m.LoraReq("unload", "a"), reply(True, {"b": "/b", "c": "/c"}))
    j.confirmed(m.LoraReq("load", "d", "/bad"), reply(False, {"b": "/b", "c": "/c"}))
    j.confirmed(m.PauseReq("in_place"), ok("pause"))
    assert j.restore() == [("lora", m.LoraReq("unload", "a")), ("lora", m.LoraReq("load", "c", "/c")),
                           ("pause", m.PauseReq("in_place"))]  # fmt: skip


def test_a_pushed_update_the_journal_cannot_copy_refuses_restarts_until_a_full_load(tmp_path):
    j = Journal(str(tmp_path))
    refs = segment({"x": np.ones(4, np.float32)})
    _unlink(refs[0].segment)  # gone before the reply was taken (its caller was cancelled)
    j.confirmed(m.UpdateWeightsReq("tensor", tensors=refs), ok("update_weights", "3"))
    assert "version 0) cannot be rebuilt: a weight update from tensors could not be kept" in (j.why_not() or "")
    j.confirmed(m.UpdateWeightsReq("disk", str(tmp_path)), ok("update_weights", "4"))
    assert j.why_not() is None and (j.version, j.tensors) == ("4", {})


def test_the_journal_folds_deltas_into_what_a_restart_serves(tmp_path):
    """A delta (mode "add", Rows of a tensor) is kept as the value it made: over a tensor pushed
    before, or over the checkpoint's own for a name not pushed since; a restart gets whole tensors."""
    from msgspec.structs import replace

    from ringserve.model.checkpoints.load import load_checkpoint
    from ringserve.model.checkpoints.tiny import make_tiny_model

    ck = make_tiny_model(tmp_path / "ck", "llama", seed=0)
    base = {k: np.array(v) for k, v in load_checkpoint(ck)[1].items()}
    E, N = "model.embed_tokens.weight", "model.norm.weight"
    j = Journal(str(ck))
    norm = np.full(256, 2.0, np.float32)
    refs = segment({N: norm})
    try:
        j.confirmed(m.UpdateWeightsReq("tensor", tensors=refs), ok("update_weights", "1"))
    finally:
        _unlink(refs[0].segment)
    rows, d = np.full((2, 256), 0.5, np.float32), np.full(256, 0.25, np.float32)
    refs = segment({E: rows, N: d})
    refs[0] = replace(refs[0], shape=[7, 256], start=5, sparse=True)  # rows [5, 7) of E
    try:
        j.confirmed(m.UpdateWeightsReq("tensor", tensors=refs, mode="add"), ok("update_weights", "2"))
    finally:
        _unlink(refs[0].segment)
    assert j.why_not() is None and (j.version, j.updates) == ("2", 2)
    with j.start_weights() as w:
        got = read_back(w.tensors)
    want = base[E].copy()
    want[5:7] += rows
    np.testing.assert_array_equal(got[E], want)
    np.testing.assert_array_equal(got[N], norm + d)
    # rows replaced over the folded value: the rest stays as folded
    refs = segment({E: np.zeros((1, 256), np.float32)})
    refs[0] = replace(refs[0], shape=[6, 256], start=5, sparse=True)
    try:
        j.confirmed(m.UpdateWeightsReq("tensor", tensors=refs), ok("update_weights", "3"))
    finally:
        _unlink(refs[0].segment)
    with j.start_weights() as w:
        got = read_back(w.tensors)
    want[5] = 0
    np.testing.assert_array_equal(got[E], want)


def test_arrays_handed_over_in_process_refuse_restarts_until_a_full_load(tmp_path):
    """A trainer's JAX arrays lent to a runner in its process (source "local") leave no copy the
    journal could give a restarted runner: it says so instead of serving other weights."""
    j = Journal(str(tmp_path))
    j.confirmed(m.UpdateWeightsReq("local", update="local-1-0"), m.ControlReply("update_weights", False, "refused",
                json.dumps({"weight_version": "0"}).encode()))  # fmt: skip
    assert j.why_not() is None  # refused: nothing changed
    j.confirmed(m.UpdateWeightsReq("local", update="local-1-1"), ok("update_weights", "3"))
    assert "weight version 3 came from JAX arrays handed over in-process" in (j.why_not() or "")
    assert (j.version, j.updates) == ("3", 1)
    j.confirmed(m.UpdateWeightsReq("disk", str(tmp_path)), ok("update_weights", "4"))
    assert j.why_not() is None


def test_a_resubmission_carries_what_the_caller_already_has():
    core = FrontendCore(Tok())
    st = core.add(spec("A", stream=True), now=0.0)
    assert core.resubmission(st).resume is None  # nothing delivered: sent again as it was
    core.apply(m.BatchStrOut([out("A", [7, 8], 2, cached_tokens=2, weight_version="v1")], ["seven"]), now=1.0)
    core.apply(m.BatchStrOut([out("A", [9], 3, cached_tokens=2, weight_version="v2", spec_verify_ct=2, spec_accepted=1)],
                             ["!"]), now=2.0)  # fmt: skip
    g = core.resubmission(st)
    assert (g.rid, m.as_i32(g.input_ids).tolist(), g.sampling, g.stream) == ("A", [1, 2, 3], st.spec.sampling, True)
    assert g.resume == m.Resume(m.i32([7, 8, 9]), len("seven!"), 2, [("v1", 0), ("v2", 2)], 2, 1)


class FakeRing:
    """A ring end: what is sent to the scheduler is kept; recv raises RingClosed once `closed`."""

    def __init__(self, closed: threading.Event | None = None) -> None:
        self.sent: list = []
        self.closed = closed or threading.Event()

    def send(self, raw: bytes) -> None:
        from ringserve.actors.transport.ring import RingClosed

        if self.closed.is_set():
            raise RingClosed("closed")
        self.sent.append(m.to_scheduler.decode(raw))

    def recv(self, timeout: float | None = None) -> None:
        from ringserve.actors.transport.ring import RingClosed

        if self.closed.wait(timeout or 0):
            raise RingClosed("closed")


@pytest.fixture
def tm(tiny_dir):
    from ringserve.actors.frontend.actor import TokenizerManager
    from ringserve.actors.server_args import ServerArgs
    from ringserve.actors.transport.topology import EngineLinks
    from ringserve.model.checkpoints.tokenizer import load_tokenizer

    t = TokenizerManager(load_tokenizer(tiny_dir("llama")), EngineLinks([FakeRing()], [FakeRing()]),
                         args=ServerArgs(max_total_tokens=65536), vocab_size=2048)  # fmt: skip
    yield t
    t.close()


def test_reattach_sends_the_state_then_every_request_then_the_calls_that_wait(tm):
    from ringserve.actors.transport.topology import EngineLinks

    async def scenario():
        a, b = (tm.core.add(spec(r, stream=True), now=0.0) for r in ("A", "B"))
        tm.core.apply(m.BatchStrOut([out("A", [7], 1)], ["x"]), now=1.0)
        b.aborted = True  # its abort was lost with the dead scheduler
        info = tm.loop.create_task(tm.control(m.InfoReq(), "info"))
        update = tm.loop.create_task(tm.control(m.UpdateWeightsReq("disk", "/w"), "update_weights"))
        await asyncio_sleep0()
        new = FakeRing()
        lost = m.ControlReply("update_weights", False, "restarted", b'{"weight_version": "0"}')
        futs, n = await tm.reattach(EngineLinks([new], [FakeRing()]), [("pause", m.PauseReq("in_place"))], lost)
        assert n == 2 and [c.kind for c in tm.replies[0]] == ["pause", "info"]
        assert [type(x).__name__ for x in new.sent] == ["PauseReq", "GenerateReq", "GenerateReq", "AbortReq", "InfoReq"]
        assert new.sent[1].resume is not None and new.sent[2].resume is None and new.sent[3].rid == "B"
        assert (await update).message == "restarted" and not info.done() and len(futs) == 1
        info.cancel()

    tm.lt.run(scenario())


async def asyncio_sleep0() -> None:
    import asyncio

    await asyncio.sleep(0)


def test_a_reply_whose_caller_stopped_waiting_still_reaches_the_journal(tm, tmp_path):
    tm.journal = j = Journal(str(tmp_path))

    async def scenario():
        call = tm.loop.create_task(tm.control(m.PauseReq("retract"), "pause"))
        await asyncio_sleep0()
        call.cancel()
        tm._dispatch(m.encode(ok("pause")))
        await tm.journal_settled()

    tm.lt.run(scenario())
    assert j.paused and not any(tm.replies)


def test_the_journal_works_off_the_event_loop_and_the_caller_waits_for_it(tm, tmp_path):
    """A pushed bucket's copy can take a while: the loop goes on meanwhile, and the caller's
    reply (after which it unlinks its segments) comes only once the journal has its copy."""
    tm.journal = j = Journal(str(tmp_path))
    copying, release = threading.Event(), threading.Event()
    confirmed = j.confirmed

    def slow(msg, reply):
        copying.set()
        assert release.wait(10)
        confirmed(msg, reply)

    j.confirmed = slow

    async def scenario():
        import asyncio

        call = tm.loop.create_task(tm.control(m.PauseReq("retract"), "pause"))
        await asyncio_sleep0()
        tm._dispatch(m.encode(ok("pause")))
        while not copying.is_set():  # the loop runs while the journal works
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        assert not call.done() and not j.paused
        release.set()
        reply = await call
        assert reply.ok and j.paused

    tm.lt.run(scenario(), timeout=20)


class FakeGroup:
    """An actor group: ready at once (or failing to start), `die()` as the launcher's watcher
    reports a death (the group is torn down, its rings closed)."""

    def __init__(self, on_failure, fail_start: bool) -> None:
        from ringserve.actors.transport.launcher import ActorFailed

        self.on_failure, self.failure, self.down = on_failure, None, threading.Event()
        from ringserve.actors.transport.topology import EngineLinks

        self.rings = EngineLinks([FakeRing(self.down)], [FakeRing(self.down)])
        self.start_error = ActorFailed("runner", 1, "Traceback: no device") if fail_start else None
        self.ready_seconds = {"runner": 1.5}

    def wait_ready(self, timeout: float) -> dict:
        if self.start_error is not None:
            self.down.set()
            raise self.start_error
        return {"runner": b"{}"}

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self.down.wait(timeout)

    def shutdown(self) -> None:
        self.down.set()

    def release(self) -> None:
        assert self.down.is_set()
        self.released = True

    def die(self, name: str = "runner") -> None:
        from ringserve.actors.transport.launcher import ActorFailed

        self.failure = ActorFailed(name, -9, "")
        self.down.set()
        self.on_failure(name, -9, "")


def supervised(tm, policy: RestartPolicy, journal: Journal, starts: list[bool] | None = None):
    """A Supervisor over fake groups (`starts`: whether each start after the first fails)."""
    from ringserve.actors.frontend.supervisor import Supervisor

    groups: list[FakeGroup] = []
    plan = iter(starts or [])

    def launch(model_dir, weights, on_failure):
        g = FakeGroup(on_failure, fail_start=bool(groups) and next(plan, False))
        groups.append(g)
        return g, g.rings

    sup = Supervisor(tm, launch, policy, journal, ready_timeout=5)
    sup.start()
    return sup, groups


def test_a_frontend_that_fails_while_the_actors_start_stops_them(bare_tm):
    """Engine makes its frontend (its tokenizer) while the actors start: if that raises, the
    group started is torn down and released, and the error is the caller's."""
    from ringserve.actors.frontend.supervisor import Supervisor

    groups: list[FakeGroup] = []

    def launch(model_dir, weights, on_failure):
        groups.append(FakeGroup(on_failure, fail_start=False))
        return groups[-1], groups[-1].rings

    def broken_tokenizer():
        raise ValueError("tokenizer.json: not a tokenizer")

    sup = Supervisor(None, launch, RestartPolicy(3, 60.0), Journal("/m"), ready_timeout=5)
    with pytest.raises(ValueError, match="not a tokenizer"):
        sup.start(broken_tokenizer)
    assert len(groups) == 1 and groups[0].down.is_set() and groups[0].released
    assert sup.group is None
    sup.start(lambda: bare_tm)  # a later start makes and attaches its frontend
    assert sup.frontend is bare_tm and sup.group is groups[1] and bare_tm.journal is sup.journal
    sup.close()


def wait_for(cond, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def live(tm, *rids: str) -> list:
    async def add():
        return [tm.core.add(spec(r, stream=True), now=0.0) for r in rids]

    return tm.lt.run(add())


@pytest.fixture
def bare_tm(tiny_dir):
    from ringserve.actors.frontend.actor import TokenizerManager
    from ringserve.actors.server_args import ServerArgs
    from ringserve.model.checkpoints.tokenizer import load_tokenizer

    t = TokenizerManager(load_tokenizer(tiny_dir("llama")), args=ServerArgs(max_total_tokens=65536), vocab_size=2048)
    yield t
    t.close()


def test_a_death_restarts_the_group_and_resubmits_every_live_request(bare_tm, tmp_path):
    tm = bare_tm
    sup, groups = supervised(tm, RestartPolicy(3, 60.0), Journal(str(tmp_path)))
    a, b = live(tm, "A", "B")
    tm.lt.run(_apply(tm, m.BatchStrOut([out("A", [7, 8], 2)], ["xy"])))
    groups[0].die("detokenizer")
    wait_for(lambda: tm.core.metrics.restart_counts.get("detokenizer") == 1)
    assert len(groups) == 2 and sup.group is groups[1] and sup._thread is None
    sent = groups[1].rings.to_scheduler[0].sent
    assert [(g.rid, g.resume is not None) for g in sent] == [("A", True), ("B", False)]
    assert m.as_i32(sent[0].resume.output_ids).tolist() == [7, 8] and sent[0].resume.text_len == 2
    assert tm.core.metrics.last_restart["resubmitted"] == 2 and not a.finished and b.error is None
    assert groups[0].released and not hasattr(groups[1], "released")  # the old rings' handles closed
    sup.close()


def test_a_crash_loop_gives_up_with_engine_dead_for_every_caller(bare_tm, tmp_path):
    tm = bare_tm
    sup, groups = supervised(tm, RestartPolicy(2, 60.0), Journal(str(tmp_path)))
    (a,) = live(tm, "A")
    for k in range(3):
        wait_for(lambda k=k: len(groups) == k + 1 and sup.group is groups[k] and sup._thread is None)
        groups[k].die()
    wait_for(lambda: a.error is not None)
    assert "3 crashes within 60 s (more than max_restarts=2" in str(a.error) and tm.dead is not None
    assert len(groups) == 3 and sup._thread is None and all(g.down.is_set() for g in groups)
    sup.close()


def test_failed_starts_in_a_row_give_up_even_when_each_is_alone_in_its_window(bare_tm, tmp_path):
    tm = bare_tm
    sup, groups = supervised(tm, RestartPolicy(2, 1e-9), Journal(str(tmp_path)), starts=[True] * 10)
    (a,) = live(tm, "A")
    groups[0].die()
    wait_for(lambda: a.error is not None)
    assert "3 starts of the actors failed in a row (more than max_restarts=2)" in str(a.error)
    wait_for(lambda: sup._thread is None)  # the caller's error is sent just before the thread ends
    assert "no device" in str(a.error) and len(groups) == 4
    assert all(g.released for g in groups[1:])  # (the first one's: the frontend's reader held it)
    sup.close()


def test_weights_that_cannot_come_back_refuse_the_restart_and_say_why(bare_tm, tmp_path):
    tm = bare_tm
    gone = tmp_path / "ckpt"
    gone.mkdir()
    sup, groups = supervised(tm, RestartPolicy(3, 60.0), Journal(str(gone)))
    (a,) = live(tm, "A")
    gone.rmdir()
    groups[0].die()
    wait_for(lambda: a.error is not None)
    assert f"were loaded from {gone}, which no longer exists" in str(a.error) and len(groups) == 1
    sup.close()


async def _apply(tm, msg) -> None:
    import time

    tm.core.apply(msg, time.perf_counter())


def test_the_journal_assembles_a_tensor_pushed_in_row_pieces(tmp_path):
    """A tensor larger than a bucket arrives as row pieces over several parts: the journal keeps
    it whole (what a restart stages again)."""
    j = Journal(str(tmp_path))
    z = np.arange(12, dtype=np.float32).reshape(4, 3)
    refs = [segment({"z": z[:3]}), segment({"z": z[3:]})]
    refs[1][0].start = 3  # rows 3.. of the whole tensor
    for r in refs:
        r[0].shape = [4, 3]
    try:
        j.confirmed(m.UpdateWeightsReq("tensor", part=0, parts=2, tensors=refs[0]), ok("update_weights"))
        j.confirmed(m.UpdateWeightsReq("tensor", part=1, parts=2, tensors=refs[1]), ok("update_weights", "2"))
    finally:
        for r in refs:
            _unlink(r[0].segment)
    with j.start_weights() as w:
        got = read_back(w.tensors)
    assert list(got) == ["z"] and (got["z"] == z).all()
    j.confirmed(m.UpdateWeightsReq("abandon"), ok("update_weights"))  # a dropped push changes nothing
    assert (j.version, j.updates, list(j.tensors)) == ("2", 1, ["z"])


def test_update_groups_in_the_journal(tmp_path):
    """Joining, leaving or draining a group changes nothing served; an update received over one
    reached the runner only, so a restart says it cannot rebuild it until a full load."""
    j = Journal(str(tmp_path))
    g = m.WeightGroup("g", names=["a"], dtypes=["float32"], shapes=[[2]])
    for source in ("group_init", "group_drain", "group_destroy"):
        j.confirmed(m.UpdateWeightsReq(source, group=g), ok("update_weights", "0"))
    assert (j.version, j.updates, j.why_not()) == ("0", 0, None)
    j.confirmed(m.UpdateWeightsReq("group", group=g), ok("update_weights", "5"))
    assert (j.version, j.updates) == ("5", 1)
    assert "received over update group 'g' reached the runner only" in (j.why_not() or "")
    j.confirmed(m.UpdateWeightsReq("disk", str(tmp_path)), ok("update_weights", "6"))
    assert j.why_not() is None
