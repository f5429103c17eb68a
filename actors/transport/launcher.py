"""ActorGroup: the parent's side of the actor system (rings, spawn, readiness, watch, teardown).
One engine's rings and actors are made by actors/transport/topology.py (`start_engine`), and
`ringserve cleanup` (actors/transport/cleanup.py) removes segments dead processes left behind.

    parent                                   actor process (spawn)
    ActorGroup.ring()/broadcast_ring() ───── ring names in ActorSpec.rings ──► attach
    ActorGroup.spawn() ── pipe: Stop ───────────────────────────────────────► ctx.stopping()
    watcher thread ◄───── pipe: Ready / LogLine / Failed (msgspec) ─────────── ctx.ready(), ctx.log
                   ◄───── process sentinel (readable when the process ends)

`spawn_thread` runs an actor as a thread of the parent's own process instead (the runner with
runner_in_process: on the devices of the process that starts the engine, a trainer's), watched
the same way through a pipe and a sentinel of its own; teardown asks it to stop, never signals.

One watcher thread owns every process after spawn: it forwards log lines, records readiness,
and reaps exits. An exit the group did not ask for (any code, 0 included) is a failure: the
watcher calls `on_failure(name, exitcode, traceback_text)` once, then tears the group down.
Teardown (failure or shutdown): Stop to every actor, mark every ring closed (blocked
send/recv raise RingClosed), wait `grace` s, SIGTERM, wait 1 s, SIGKILL, reap, unlink every
segment and semaphore. Ring handles stay mapped (a parent thread may still hold one) until
`release()`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from ringserve.actors.transport.actor import (
    ActorSpec,
    Failed,
    LogLine,
    Ready,
    Stop,
    actor_main,
    decode_control,
    encode,
    thread_actor_main,
)
from ringserve.actors.transport.loads import LoadBoard
from ringserve.actors.transport.ring import BroadcastRing, Ring, _RingBase

if TYPE_CHECKING:
    pass

__all__ = ["ActorFailed", "ActorGroup", "OnFailure", "describe_exit"]

log = logging.getLogger("ringserve.launcher")
OnFailure = Callable[[str, int | None, str], None]


class ActorFailed(RuntimeError):
    """An actor failed at start-up or died; the message carries its traceback."""

    def __init__(self, name: str, exitcode: int | None, traceback_text: str) -> None:
        super().__init__(f"actor {name!r} failed ({describe_exit(exitcode)}):\n{traceback_text}")
        self.name, self.exitcode, self.traceback_text = name, exitcode, traceback_text


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a spawn child without re-running the parent's `__main__`.

    The spawn method re-imports the parent's main script in the child so pickled functions
    defined there resolve; actors are named by "module:function" and need none of it. Hiding
    the script lets a user create an Engine at the top level of a script with no
    `if __name__ == "__main__":` guard (which would otherwise start engines recursively)."""
    main = sys.modules.get("__main__")
    saved: dict[str, object] = {
        k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__
    }
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def describe_exit(code: int | None) -> str:
    """'exit code N', 'killed by SIGKILL', or 'still running' (None)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _ThreadProc:
    """What the watcher needs of an actor run as a thread of this process (`spawn_thread`): the
    process's pid, a sentinel that is readable once the thread has ended, `join`, `exitcode`.
    No signal ever reaches it (the pid is this process's): teardown asks it to stop and waits."""

    def __init__(self, name: str, conn: Connection, spec: bytes) -> None:
        self.pid = os.getpid()
        self.exitcode: int | None = None
        self.sentinel, self._done = os.pipe()
        self._thread = threading.Thread(target=self._run, args=(conn, spec), name=f"ringserve-{name}", daemon=True)

    def _run(self, conn: Connection, spec: bytes) -> None:
        code = 1
        try:
            code = thread_actor_main(conn, spec)
        finally:
            self.exitcode = code
            os.close(self._done)  # the sentinel reads EOF

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        os.close(self.sentinel)


@dataclass(eq=False)
class _Actor:
    name: str
    proc: BaseProcess | _ThreadProc
    conn: Connection
    info: bytes | None = None  # set by Ready
    traceback: str = ""  # set by Failed
    exitcode: int | None = None  # set when reaped
    conn_open: bool = True
    logs: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    spawned_at: float = field(default_factory=time.monotonic)
    ready_s: float | None = None  # from spawn to Ready


class ActorGroup:
    """Rings, actor processes and their watcher; a context manager that shuts everything down."""

    def __init__(self, on_failure: OnFailure | None = None, *, log_level: int = logging.INFO,
                 stop_timeout: float = 5.0) -> None:  # fmt: skip
        self.on_failure = on_failure  # called once, from the watcher thread
        self.failure: ActorFailed | None = None
        self._log_level = log_level
        self._stop_timeout = stop_timeout
        self._mp = multiprocessing.get_context("spawn")
        self._actors: dict[str, _Actor] = {}
        self._rings: list[_RingBase | LoadBoard] = []
        self._cond = threading.Condition()
        self._grace: float | None = None  # set: the watcher must tear down with this grace
        self._stopping = False  # exits are expected from now on
        self._closed = threading.Event()  # teardown finished: processes reaped, names unlinked
        self._wake_r, self._wake_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="ringserve-actor-watch", daemon=True)
        self._watcher.start()

    # ---- rings ---------------------------------------------------------------------------
    def ring(self, edge: str, capacity: int = 1 << 22, *, spin_us: int = 50) -> Ring:
        ring = Ring.create(edge, capacity, spin_us=spin_us)
        self._own(ring)
        return ring

    def broadcast_ring(
        self, edge: str, n: int, capacity: int = 1 << 22, *, spin_us: int = 50
    ) -> BroadcastRing:
        ring = BroadcastRing.create(edge, n, capacity, spin_us=spin_us)
        self._own(ring)
        return ring

    def load_board(self, n: int) -> LoadBoard:
        board = LoadBoard.create(n)
        self._own(board)
        return board

    def _own(self, ring: _RingBase | LoadBoard) -> None:
        with self._cond:
            self._rings.append(ring)
            closing = self._stopping
        if closing:  # lost a race with teardown: do not leave the names behind
            ring.mark_closed()
            ring.unlink()
            raise RuntimeError("the actor group is shutting down")

    @property
    def ring_names(self) -> list[str]:
        return [r.name for r in self._rings]

    @property
    def pids(self) -> dict[str, int | None]:
        """{actor name: process id}."""
        return {n: a.proc.pid for n, a in self._actors.items()}

    @property
    def ready_seconds(self) -> dict[str, float | None]:
        """{actor name: seconds from its spawn to its Ready} (None: not ready)."""
        return {n: None if a.ready_s is None else round(a.ready_s, 3) for n, a in self._actors.items()}

    def pid(self, name: str) -> int | None:
        """Process id of actor `name` (None before it started)."""
        return self._actors[name].proc.pid

    def exitcode(self, name: str) -> int | None:
        """Exit code of actor `name` once the watcher reaped it (-N: killed by signal N); else None."""
        return self._actors[name].exitcode

    # ---- actors --------------------------------------------------------------------------
    def spawn(self, name: str, target: str, config: bytes = b"", rings: dict[str, str] | None = None,
              env: dict[str, str] | None = None) -> None:  # fmt: skip
        """Start actor `name` running `target` ("module:function") in a spawned process, with
        `env` added to its environment before the target is imported."""
        if name in self._actors:
            raise ValueError(f"actor {name!r} already exists")
        if target.count(":") != 1:
            raise ValueError(f"actor target {target!r} must be 'module:function'")
        spec = ActorSpec(name, target, bytes(config), dict(rings or {}), self._log_level, os.getpid(), dict(env or {}))
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        proc = self._mp.Process(
            target=actor_main, args=(child_conn, encode(spec)), name=f"ringserve-{name}", daemon=True
        )
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"cannot spawn {name!r}: the actor group is shutting down")
            with _main_module_hidden():
                proc.start()
            self._actors[name] = _Actor(name, proc, parent_conn)
        child_conn.close()
        self._wake()

    def spawn_thread(self, name: str, target: str, config: bytes = b"", rings: dict[str, str] | None = None) -> None:
        """Start actor `name` running `target` in a thread of this process (its devices, its
        environment): the runner with runner_in_process. It is watched as a process is (Ready,
        its end, a failure's traceback), but teardown can only ask it to stop."""
        if name in self._actors:
            raise ValueError(f"actor {name!r} already exists")
        spec = ActorSpec(name, target, bytes(config), dict(rings or {}), self._log_level, os.getpid())
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        proc = _ThreadProc(name, child_conn, encode(spec))
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"cannot start {name!r}: the actor group is shutting down")
            proc.start()
            self._actors[name] = _Actor(name, proc, parent_conn)
        self._wake()

    def wait_ready(self, timeout: float = 60.0) -> dict[str, bytes]:
        """Wait until every spawned actor called ctx.ready(); {name: info}. If one fails first,
        the group is torn down and ActorFailed (with its traceback) is raised; on timeout too."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.failure is None and not self._stopping:
                missing = [n for n, a in self._actors.items() if a.info is None]
                if not missing:
                    return {n: a.info or b"" for n, a in self._actors.items()}
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            failure, stopping = self.failure, self._stopping
        if failure is not None:
            self._closed.wait()
            raise ActorFailed(failure.name, failure.exitcode, failure.traceback_text)
        if stopping:
            raise RuntimeError("the actor group was shut down")
        self.shutdown()
        raise TimeoutError(f"actors {missing} did not report ready within {timeout} s")

    def wait_closed(self, timeout: float | None = None) -> bool:
        """True once teardown finished (every process reaped, every ring name unlinked)."""
        return self._closed.wait(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every actor (Stop, then SIGTERM after `timeout` s, then SIGKILL), reap them and
        unlink every ring. Idempotent; called from the watcher (on_failure) it only requests it."""
        with self._cond:
            if self._grace is None:
                self._grace = self._stop_timeout if timeout is None else timeout
        self._wake()
        if threading.current_thread() is self._watcher:
            return
        self._closed.wait()
        self._watcher.join()

    def release(self) -> None:
        """Close this process's handles of the group's rings (maps and semaphores), once the group
        is torn down and no thread here uses a ring of it any more (a restarted engine's old group:
        actors/frontend/supervisor.py); otherwise they live as long as the group's ring objects."""
        assert self._closed.is_set(), "release() before the group was torn down"
        with self._cond:
            rings = list(self._rings)
        for ring in rings:
            ring.close()

    def __enter__(self) -> ActorGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the watcher thread --------------------------------------------------------------
    def _watch(self) -> None:
        try:
            while True:
                with self._cond:
                    grace = self._grace
                if grace is not None:
                    break
                for a in self._pump(0.5):
                    if self._failed(a):
                        break
            self._teardown(self._grace if self._grace is not None else self._stop_timeout)
        finally:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            with self._cond:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1
            self._closed.set()

    def _wake(self) -> None:
        """Interrupt the watcher's wait (new actor, shutdown request)."""
        with self._cond:
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")

    def _pump(self, timeout: float) -> list[_Actor]:
        """Wait up to `timeout` s for control messages or exits; handle them; return the newly
        reaped actors."""
        with self._cond:
            live = [a for a in self._actors.values() if a.exitcode is None]
        objs: dict[Connection | int, _Actor | None] = {self._wake_r: None}
        for a in live:
            objs[a.proc.sentinel] = a
            if a.conn_open:
                objs[a.conn] = a
        dead: list[_Actor] = []
        for obj in wait(list(objs), timeout):
            actor = objs[obj]  # type: ignore[index]
            if actor is None:
                os.read(self._wake_r, 4096)
            elif obj is actor.conn:
                self._drain(actor)
            elif actor.exitcode is None:
                actor.proc.join()
                self._drain(actor)  # a traceback sent just before the exit is still in the pipe
                actor.exitcode = actor.proc.exitcode
                dead.append(actor)
        return dead

    def _drain(self, a: _Actor) -> None:
        while a.conn_open:
            try:
                if not a.conn.poll(0):
                    return
                msg = decode_control(a.conn.recv_bytes())
            except (EOFError, OSError):
                a.conn_open = False
                return
            if isinstance(msg, Ready):
                with self._cond:
                    a.info = msg.info
                    a.ready_s = time.monotonic() - a.spawned_at
                    self._cond.notify_all()
            elif isinstance(msg, LogLine):
                self._emit(a, msg)
            elif isinstance(msg, Failed):
                a.traceback = msg.traceback

    def _emit(self, a: _Actor, msg: LogLine) -> None:
        line = f"[{a.name}] {msg.message}"
        a.logs.append(line)
        logger = logging.getLogger(f"ringserve.actor.{a.name}")
        if logger.isEnabledFor(msg.level):
            record = logger.makeRecord(logger.name, msg.level, msg.logger, 0, line, (), None)
            record.created = msg.created
            logger.handle(record)

    def _failed(self, a: _Actor) -> bool:
        """An actor exited; if the group did not ask for it, record the failure, tell the
        callback (once) and request teardown. True if this was a failure."""
        with self._cond:
            if self._stopping or self._grace is not None:
                return False
            self._stopping = True
            text = a.traceback or self._no_traceback(a)
            self.failure = ActorFailed(a.name, a.exitcode, text)
            self._grace = self._stop_timeout
            self._cond.notify_all()
        log.error("%s", self.failure)
        if self.on_failure is not None:
            try:
                self.on_failure(a.name, a.exitcode, text)
            except Exception:
                log.exception("on_failure callback raised")
        return True

    @staticmethod
    def _no_traceback(a: _Actor) -> str:
        if a.exitcode == 0:
            text = f"actor {a.name!r} returned (exit code 0) before the group asked it to stop"
        else:
            text = f"actor {a.name!r} died ({describe_exit(a.exitcode)}) without sending a traceback"
        if a.logs:
            text += "\nits last log lines:\n" + "\n".join(a.logs)
        return text

    def _teardown(self, grace: float) -> None:
        with self._cond:
            self._stopping = True
            actors = list(self._actors.values())
            rings = list(self._rings)
        stop = encode(Stop())
        for a in actors:
            if a.exitcode is None and a.conn_open:
                try:
                    a.conn.send_bytes(stop)
                except OSError:
                    pass
        for ring in rings:  # wakes every blocked send/recv, here and in the actors
            ring.mark_closed()
        for sig, wait_s in ((None, grace), (signal.SIGTERM, 1.0), (signal.SIGKILL, 10.0)):
            live = [a for a in actors if a.exitcode is None]
            if not live:
                break
            if sig is not None and all(isinstance(a.proc, _ThreadProc) for a in live):
                log.warning("actor thread(s) %s did not stop within %.1f s; left running", [a.name for a in live], grace)
                break
            for a in live:
                if sig is not None and a.proc.pid is not None and not isinstance(a.proc, _ThreadProc):
                    try:
                        os.kill(a.proc.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait_s
            while any(a.exitcode is None for a in actors) and time.monotonic() < deadline:
                self._pump(min(0.1, max(0.0, deadline - time.monotonic())))
        for a in actors:
            self._drain(a)
            a.conn.close()
            if isinstance(a.proc, _ThreadProc) and a.exitcode is not None:
                a.proc.close()
        for ring in rings:
            ring.unlink()
