"""One actor process: its context, its control channel to the parent, and its entry point.

An actor is a function `target(ctx: ActorContext) -> None` named "module:function", run by
`actor_main` in a process started with the multiprocessing spawn context (see launcher.py), or
by `thread_actor_main` in a thread of the parent's process (the runner with runner_in_process).

Control channel: one duplex pipe per actor carrying msgspec-encoded `Control` structs (never
pickle). Child -> parent: Ready, LogLine, Failed (formatted traceback, sent before a non-zero
exit). Parent -> child: Stop. The child's control thread reads the pipe: Stop sets `stopping()`;
EOF (or a changed parent pid) means the parent died and the child exits at once.
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from ringserve.actors.transport.ring import RingClosed, unlink_name

__all__ = ["ActorContext", "ActorSpec", "Control", "actor_main", "resolve_target", "thread_actor_main", "without_torch"]

_S = {"array_like": True, "omit_defaults": True, "gc": False}


class ActorSpec(msgspec.Struct, **_S):
    """What the parent passes to a new actor process (encoded, so spawn pickles only bytes)."""

    name: str
    target: str  # "module:function"
    config: bytes = b""
    rings: dict[str, str] = {}
    log_level: int = logging.INFO
    parent_pid: int = 0
    env: dict[str, str] = {}  # set before the target is imported (a DP group's devices: devices.py)


class Ready(msgspec.Struct, tag="ready", **_S):
    info: bytes = b""


class LogLine(msgspec.Struct, tag="log", **_S):
    level: int
    logger: str
    message: str
    created: float


class Failed(msgspec.Struct, tag="failed", **_S):
    traceback: str


class Stop(msgspec.Struct, tag="stop", **_S):
    pass


Control = Ready | LogLine | Failed | Stop
encode = msgspec.msgpack.Encoder().encode
decode_control = msgspec.msgpack.Decoder(Control).decode


def resolve_target(target: str) -> Callable[[ActorContext], None]:
    """Import "module:function"; ValueError if the string does not have that shape."""
    module, sep, func = target.partition(":")
    if not sep or not module or not func:
        raise ValueError(f"actor target {target!r} must be 'module:function'")
    fn = getattr(importlib.import_module(module), func)
    if not callable(fn):
        raise ValueError(f"actor target {target!r} is not callable")
    return fn


class ActorContext:
    """What an actor function gets: its name, opaque config bytes, ring names by role, a logger
    whose records reach the parent, readiness reporting and the stop request."""

    def __init__(self, spec: ActorSpec, conn: Connection) -> None:
        self.name = spec.name
        self.config: bytes = spec.config
        self.rings: dict[str, str] = dict(spec.rings)
        self.log = logging.getLogger(f"ringserve.{spec.name}")
        self._conn = conn
        self._send_lock = threading.Lock()  # log records come from any thread
        self._stop = threading.Event()
        self.owned: dict[str, None] = {}  # more shared-memory names to remove if orphaned (`own`)

    def own(self, name: str, add: bool = True) -> None:
        """Name a shared-memory segment this actor made (`add`), or unlinked (not `add`): an
        orphaned actor removes the names it still owns, as it does its rings'."""
        if add:
            self.owned[name] = None
        else:
            self.owned.pop(name, None)

    def ready(self, info: bytes = b"") -> None:
        """Tell the parent this actor has started (wait_ready returns `info` for it)."""
        self._send(Ready(bytes(info)))

    def stopping(self) -> bool:
        """True once the parent asked the group to stop; loops should then return."""
        return self._stop.is_set()

    def wait_stopping(self, timeout: float | None = None) -> bool:
        """Sleep until the parent asks to stop (True) or `timeout` s pass (False)."""
        return self._stop.wait(timeout)

    def _send(self, msg: Ready | LogLine | Failed) -> None:
        data = encode(msg)
        with self._send_lock:
            self._conn.send_bytes(data)


class _ForwardHandler(logging.Handler):
    """Sends every record to the parent as a LogLine (the parent re-emits it with our name)."""

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__()
        self._ctx = ctx

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            self._ctx._send(LogLine(record.levelno, record.name, text, record.created))
        except Exception:  # the parent is gone or the pipe is broken: nothing left to tell
            pass


def _watch_parent(ctx: ActorContext, conn: Connection, parent_pid: int) -> None:
    """Control thread: Stop sets the stop event; EOF or a new parent pid ends the process (and
    removes the names of its rings: their creator, the parent, cannot any more)."""
    while True:
        try:
            if conn.poll(0.5):
                msg = decode_control(conn.recv_bytes())
                if isinstance(msg, Stop):
                    ctx._stop.set()
            elif os.getppid() != parent_pid:
                _orphaned(ctx)
        except (EOFError, OSError):
            _orphaned(ctx)  # the parent died (its end of the pipe closed): do not linger


def _orphaned(ctx: ActorContext) -> None:
    for name in [*ctx.rings.values(), *list(ctx.owned)]:
        unlink_name(name)
    os._exit(70)


def without_torch() -> None:
    """Make torch unimportable in this process unless it is already imported: `find_spec` then
    finds none and `import torch` raises ImportError, so transformers takes its torch-less paths
    (model/checkpoints/tokenizer.py says what that saves). Only for processes ringserve owns (its
    actors, `ringserve serve` / `generate`), before transformers is imported."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]


def actor_main(conn: Connection, spec_bytes: bytes) -> None:
    """Entry point of an actor process (the spawn target). Exits 0 when the actor returns, or
    returns after a stop request (a RingClosed then is part of stopping); otherwise sends the
    formatted traceback to the parent and exits 1."""
    # A session of its own: a signal to the parent's process group (Ctrl-C in a terminal, a
    # harness's killpg) reaches the parent alone, which stops its actors; otherwise each actor
    # died of it too and the supervisor took that for a crash and restarted them mid-shutdown.
    # The parent's death still ends the actor (the pipe's EOF, _watch_parent).
    os.setsid()
    spec = msgspec.msgpack.decode(spec_bytes, type=ActorSpec)
    os.environ.update(spec.env)  # before the target (and JAX, in a runner) is imported
    without_torch()  # no actor needs torch, and transformers would import it
    faulthandler.enable()  # a hard crash still prints a Python stack on stderr
    ctx = ActorContext(spec, conn)
    root = logging.getLogger()
    root.handlers[:] = [_ForwardHandler(ctx)]
    root.setLevel(spec.log_level)
    threading.Thread(
        target=_watch_parent, args=(ctx, conn, spec.parent_pid), name="parent-watch", daemon=True
    ).start()
    code = 0
    try:
        resolve_target(spec.target)(ctx)
    except RingClosed:
        if not ctx.stopping():
            ctx._stop.wait(1.0)  # the Stop message and the ring closure race; Stop comes first
        if not ctx.stopping():
            code = _report(ctx)
    except SystemExit as e:
        if e.code not in (None, 0):
            code = _report(ctx)
    except BaseException:
        code = _report(ctx)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: ring handles may still be in use by threads


def thread_actor_main(conn: Connection, spec_bytes: bytes) -> int:
    """`actor_main` for an actor run as a thread of the parent's own process (the runner with
    `runner_in_process`: on the devices of the process that starts the engine, a trainer's).
    The process is the parent's: no session, environment, torch block or logging of its own,
    and its end is the thread's (returns the exit code), never the process's; the parent's end
    of the pipe closing (the group torn down) is a stop request."""
    spec = msgspec.msgpack.decode(spec_bytes, type=ActorSpec)
    ctx = ActorContext(spec, conn)
    threading.Thread(target=_watch_stop, args=(ctx, conn), name=f"{spec.name}-stop-watch", daemon=True).start()
    code = 0
    try:
        resolve_target(spec.target)(ctx)
    except RingClosed:
        if not ctx.stopping():
            ctx._stop.wait(1.0)
        if not ctx.stopping():
            code = _report(ctx)
    except SystemExit as e:
        if e.code not in (None, 0):
            code = _report(ctx)
    except BaseException:
        code = _report(ctx)
    return code


def _watch_stop(ctx: ActorContext, conn: Connection) -> None:
    """A thread actor's control thread: Stop, or the parent's end closing, sets `stopping()`."""
    while not ctx.stopping():
        try:
            if conn.poll(0.5) and isinstance(decode_control(conn.recv_bytes()), Stop):
                ctx._stop.set()
        except (EOFError, OSError):
            ctx._stop.set()


def _report(ctx: ActorContext) -> int:
    text = traceback.format_exc()
    try:
        ctx._send(Failed(text))
    except Exception:
        sys.stderr.write(f"actor {ctx.name} failed:\n{text}")
    return 1
