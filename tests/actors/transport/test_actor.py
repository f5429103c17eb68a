"""Actor lifecycle: readiness, forwarded logs, polite stop, failures at start-up and later (raise,
os._exit, SIGKILL) taking the whole group down with the traceback and no /dev/shm leftovers,
a child outliving its parent, and `ringserve cleanup`."""

from __future__ import annotations

import glob
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ringserve.actors.transport.cleanup import _pid_alive, cleanup_main
from ringserve.actors.transport.launcher import ActorFailed, ActorGroup
from ringserve.actors.transport.ring import Ring, RingClosed

ROOT = Path(__file__).resolve().parents[3]
HERE = "tests.actors.transport.test_actor"


def _leftovers(group: ActorGroup) -> list[str]:
    return [p for name in group.ring_names for p in glob.glob(f"/dev/shm/*{name.lstrip('/')}*")]


# ---- actors (run in child processes) -----------------------------------------------------
def idle(ctx):
    """Ready with its pid; logs a line; returns when asked to stop."""
    ctx.log.info("hello from %s", ctx.name)
    ctx.ready(str(os.getpid()).encode())
    ctx.wait_stopping()


def owns_a_segment(ctx):
    """Makes a segment it owns (`ctx.own`) and one it owned and gave up; ready with their names."""
    import posix_ipc

    names = [f"/rs-{os.getpid()}-{k}0-owned" for k in "ab"]
    for name in names:
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
        ctx.own(name)
    ctx.own(names[1], False)
    ctx.ready(" ".join(names).encode())
    ctx.wait_stopping()


def fails_at_startup(ctx):
    raise ValueError(f"bad config {ctx.config!r}")


def on_command(ctx):
    """Ready, then obeys one command from ring "in": raise / exit / block."""
    ring = Ring.attach(ctx.rings["in"])
    ctx.ready()
    cmd = ring.recv()
    ctx.log.warning("got %s", cmd)
    if cmd == b"raise":
        raise RuntimeError("crashed while serving")
    if cmd == b"exit":
        os._exit(3)
    ring.recv()  # b"block": wait until the ring is closed (RingClosed during stop: a clean exit)


def ignores_stop(ctx):
    ctx.ready()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(0.05)


# ---- tests -------------------------------------------------------------------------------
def test_ready_info_forwarded_logs_and_polite_stop(caplog):
    caplog.set_level(logging.INFO)
    with ActorGroup() as group:
        group.ring("r", 1024)
        group.spawn("a", f"{HERE}:idle")
        group.spawn("b", f"{HERE}:idle")
        info = group.wait_ready(60)
        assert info == {n: str(group.pid(n)).encode() for n in ("a", "b")}
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 3  # asked nicely, both returned: no SIGTERM after the 5 s grace
    assert {n: group.exitcode(n) for n in ("a", "b")} == {"a": 0, "b": 0}
    assert group.failure is None and _leftovers(group) == []
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ringserve.actor.")]
    assert "[a] hello from a" in lines and "[b] hello from b" in lines


def test_actor_raising_at_startup_fails_wait_ready_with_its_traceback():
    calls = []
    group = ActorGroup(on_failure=lambda *a: calls.append(a))
    ring = group.ring("s", 1024)
    group.spawn("healthy", f"{HERE}:idle")
    group.spawn("broken", f"{HERE}:fails_at_startup", b"cfg-42")
    with pytest.raises(ActorFailed) as e:
        group.wait_ready(60)
    text = str(e.value)
    assert "actor 'broken' failed (exit code 1)" in text
    assert "in fails_at_startup" in text and "ValueError: bad config b'cfg-42'" in text
    assert [(n, c) for n, c, _ in calls] == [("broken", 1)] and "ValueError" in calls[0][2]
    assert group.exitcode("healthy") is not None  # the group went down
    assert glob.glob(f"/dev/shm/*{ring.name.lstrip('/')}*") == []
    group.shutdown()


@pytest.mark.parametrize("how", ["raise", "exit", "sigkill"])
def test_actor_dying_later_brings_the_group_down_within_a_second(how):
    failed: list[tuple[str, int | None, str, float]] = []
    group = ActorGroup(on_failure=lambda n, c, tb: failed.append((n, c, tb, time.monotonic())))
    ring = group.ring("cmd", 1024)
    other = group.ring("other", 1024)
    group.spawn("victim", f"{HERE}:on_command", b"", {"in": ring.name})
    group.spawn("bystander", f"{HERE}:on_command", b"", {"in": other.name})
    group.wait_ready(60)
    t0 = time.monotonic()
    if how == "sigkill":
        os.kill(group.pid("victim") or 0, signal.SIGKILL)
    else:
        ring.send(how.encode())
    assert group.wait_closed(15)
    name, code, tb, at = failed[0]
    assert len(failed) == 1 and name == "victim"
    assert at - t0 < 1.0, at - t0
    if how == "raise":
        assert code == 1
        assert (
            'raise RuntimeError("crashed while serving")' in tb
            and "RuntimeError: crashed while serving" in tb
        )
    elif how == "exit":
        assert code == 3
        assert "died (exit code 3) without sending a traceback" in tb and "[victim] got b'exit'" in tb
    else:
        assert code == -signal.SIGKILL and "died (killed by SIGKILL)" in tb
    assert isinstance(group.failure, ActorFailed) and group.failure.traceback_text == tb
    assert group.exitcode("bystander") == 0  # stopped: RingClosed while stopping is clean
    assert _leftovers(group) == []
    with pytest.raises(RingClosed):  # the parent's own handles see the closure too
        other.send(b"x")
    group.shutdown()


def test_actor_returning_unasked_is_a_failure():
    group = ActorGroup()
    group.spawn("quitter", f"{HERE}:returns")
    with pytest.raises(ActorFailed, match="returned \\(exit code 0\\) before the group asked it to stop"):
        group.wait_ready(60)
    group.shutdown()


def returns(ctx):
    ctx.log.info("nothing to do")


def test_shutdown_escalates_to_sigkill_for_an_actor_that_ignores_stop():
    group = ActorGroup(stop_timeout=0.2)
    group.spawn("stubborn", f"{HERE}:ignores_stop")
    group.wait_ready(60)
    t0 = time.monotonic()
    group.shutdown()
    assert time.monotonic() - t0 < 5
    assert group.exitcode("stubborn") == -signal.SIGKILL
    assert group.failure is None


def test_bad_targets_and_names_are_refused():
    with ActorGroup() as group:
        with pytest.raises(ValueError, match="module:function"):
            group.spawn("x", "no_colon")
        group.spawn("x", f"{HERE}:idle")
        with pytest.raises(ValueError, match="already exists"):
            group.spawn("x", f"{HERE}:idle")
        group.wait_ready(60)


_ORPHAN_PARENT = """
import sys, time
sys.path.insert(0, {root!r})
from ringserve.actors.transport.launcher import ActorGroup
g = ActorGroup()
ring = g.ring("orphan", 1024)
known = g.broadcast_ring("known", 2, 1024)
g.spawn("child", "tests.actors.transport.test_actor:idle", rings={{"inbox": known.name}})
g.spawn("owner", "tests.actors.transport.test_actor:owns_a_segment")
info = g.wait_ready(60)
print(ring.name, int(info["child"]), known.name, info["owner"].decode(), flush=True)
time.sleep(600)
"""


def test_child_exits_when_its_parent_is_killed_and_cleanup_removes_the_segments(capsys):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_ORPHAN_PARENT.format(root=str(ROOT)))],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        assert proc.stdout is not None
        dead_name, child_pid, known_name, owned, given_up = proc.stdout.readline().split()
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while _pid_alive(int(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(int(child_pid)), "the orphaned actor kept running"
    assert glob.glob(f"/dev/shm/*{known_name.lstrip('/')}*") == []  # the child removed the rings it knew
    deadline = time.monotonic() + 5  # and an actor the segments it owned (not one it gave up)
    while os.path.exists(f"/dev/shm{owned}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/dev/shm{owned}") and os.path.exists(f"/dev/shm{given_up}")
    os.unlink(f"/dev/shm{given_up}")
    dead = glob.glob(f"/dev/shm/*{dead_name.lstrip('/')}*")
    assert len(dead) == 3  # SIGKILL left the segment and its two semaphores behind
    with Ring.create("alive", 256) as live:
        live_files = glob.glob(f"/dev/shm/*{live.name.lstrip('/')}*")
        assert cleanup_main(["--dry-run"]) == 0
        assert all(os.path.exists(p) for p in dead)
        assert cleanup_main([]) == 0
        out = capsys.readouterr().out
        assert all(f"would remove {p}" in out and f"removed {p}" in out for p in dead)
        assert not any(os.path.exists(p) for p in dead)
        assert all(os.path.exists(p) for p in live_files) and live.name.lstrip("/") not in out
