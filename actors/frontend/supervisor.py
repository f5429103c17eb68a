"""The supervisor: one engine's actors, started again when one of them dies (issue 28).

    Engine ──owns──► Supervisor ──launch(model_dir, weights, on_failure)──► ActorGroup
                      │                                 (scheduler, runner, detokenizer)
                      │ ◄── on_failure(name, exitcode, traceback): the group's watcher thread
                      ├── RestartPolicy   more than max_restarts crashes in restart_window_s,
                      │                   or more than max_restarts failed starts in a row:
                      │                   give up (every caller gets EngineDead, as unsupervised)
                      ├── Journal         what new actors must be given back, from the control
                      │                   calls the scheduler confirmed (actors/frontend/journal.py)
                      └── frontend.reattach(rings, journal.restore(), lost_update)

A restart, step by step (on the supervisor's thread; the frontend keeps serving meanwhile):

1. The dead actor's group tears itself down (the launcher: Stop, SIGTERM, SIGKILL, every ring
   and semaphore unlinked). What the frontend sends meanwhile is dropped; its request table
   and the control calls waiting for replies are the record. The old reader thread ends once
   its ring is closed: every output it read is applied before step 4.
2. The policy counts the crash; past its limit, or when the weights cannot be brought back
   (`Journal.why_not`), the engine gives up: `fail_all(EngineDead(why))`.
3. `launch` starts the actors again with the weights the engine serves (`Journal.start_weights`:
   the checkpoint last loaded whole, the tensors pushed over it since, their version and count);
   compiled programs come from the XLA cache. An actor that fails to start (or a start that
   times out) is one more crash.
4. `TokenizerManager.reattach` gives the new scheduler the journal's state (device memory given
   back, the pause), every live request again as prompt + what its caller already has
   (`FrontendCore.resubmission`: same rid, sampling and seed; the scheduler takes those tokens as
   the request's output so far, the detokenizer goes on after the text already sent), then the
   control calls still waiting (a weight update in flight fails: the caller retries it).

What a restart keeps and what it cannot:
- Requests: every one finishes as an uninterrupted run would (greedy exactly; seeded exactly in
  deterministic mode: a token's draw depends on its seed and position only), its stream never
  repeats text, its meta reads as one run. n > 1 samples are requests of their own. An abort
  asked before or during the restart is asked again of the resubmitted request.
- Paused: the new engine is paused too; requests paused in place wait as if retracted.
- Sessions stay open and their turns resubmit (the choice: a session is the frontend's, its
  turns' inputs are whole); the KV a finished turn kept is gone, so the next turn computes its
  whole input once, as after flush_cache.
- Weights: the version serving and every update since start, from disk or from tensors (the
  journal keeps a host copy of each tensor pushed since the last full load: at most one model's
  weights). A checkpoint directory that no longer exists, or pushed tensors that could not be
  kept, refuse the restart, saying why: never other weights than the ones serving.
- The prefix cache starts empty; a non-streamed request had no tokens delivered and is computed
  again from its prompt.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ringserve.actors.frontend.errors import EngineDead
from ringserve.actors.frontend.journal import Journal
from ringserve.actors.transport import messages as m
from ringserve.actors.transport.launcher import ActorFailed, ActorGroup, OnFailure, describe_exit
from ringserve.actors.transport.topology import EngineLinks

log = logging.getLogger("ringserve.supervisor")

Launch = Callable[[str, m.StartWeights, OnFailure], tuple[ActorGroup, EngineLinks]]
RESTORE_REPLY_TIMEOUT_S = 60.0
_LIVE: weakref.WeakSet[Supervisor] = weakref.WeakSet()


@atexit.register
def _exiting() -> None:
    """At interpreter exit multiprocessing terminates the actors (daemons) of engines never shut
    down: that is no crash to restart from (this hook runs before multiprocessing's)."""
    for s in list(_LIVE):
        s.exiting()


class RestartPolicy:
    """When to stop restarting: more than `max_restarts` crashes within `window_s` seconds
    (`crashed`), or more than `max_restarts` failed starts in a row (the supervisor counts those:
    a start slower than the window must not spin forever). 0: never restart."""

    def __init__(self, max_restarts: int, window_s: float):
        self.max_restarts, self.window_s = max_restarts, window_s
        self.times: collections.deque[float] = collections.deque()

    def crashed(self, now: float) -> str | None:
        """Count a crash at `now` (time.monotonic()); why not to restart, or None."""
        if self.max_restarts == 0:
            return "the supervisor is off (supervise=False, or nnodes > 1: the orchestrator restarts every host)"
        self.times.append(now)
        while self.times and self.times[0] < now - self.window_s:
            self.times.popleft()
        if len(self.times) > self.max_restarts:
            return (f"{len(self.times)} crashes within {self.window_s:g} s (more than max_restarts="
                    f"{self.max_restarts} in restart_window_s={self.window_s:g}): a crash loop")  # fmt: skip
        return None

    def failed_starts(self, n: int) -> str | None:
        """Why not to try again after `n` failed starts in a row, or None."""
        if n > self.max_restarts:
            return f"{n} starts of the actors failed in a row (more than max_restarts={self.max_restarts})"
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Crash:
    name: str  # the actor that died ("start-up": a start that timed out)
    exitcode: int | None
    traceback: str
    at: float  # time.monotonic() when the supervisor heard of it

    def __str__(self) -> str:
        return f"actor {self.name!r} died ({describe_exit(self.exitcode)}):\n{self.traceback}"


class Supervisor:
    """Owns the engine's actor group (`group`) and starts it again when an actor dies; the
    Engine asks it for three things: `start()` (the first start; its errors raise), the current
    `group`, and `close()`. A policy of 0 restarts never restarts (supervise=False): the first
    crash fails every caller, as an engine without a supervisor does.

    Threads: failures arrive on the group's watcher thread (`_failed`), restarts run on one
    supervisor thread at a time (`_restarts`), the frontend's state changes on its loop
    (`reattach`, `fail_all`); `_lock` guards what they share."""

    def __init__(self, frontend: Any, launch: Launch, policy: RestartPolicy, journal: Journal,
                 ready_timeout: float):  # fmt: skip
        self.frontend = frontend
        self.launch = launch
        self.policy = policy
        self.journal = journal
        self.ready_timeout = ready_timeout
        self.group: ActorGroup | None = None
        self.ready: dict[str, bytes] = {}  # the actors' ready infos (the runner's: devices, programs)
        self.gave_up: str | None = None  # why the engine was given up (it is dead)
        self._gen = 0  # the adopted group's generation; a failure of another one is not ours
        self._gens = itertools.count(1)
        self._taken = 0  # the generation whose failure was taken last
        self._crashes: collections.deque[Crash] = collections.deque()
        self._thread: threading.Thread | None = None
        self._launching: ActorGroup | None = None
        self._closed = False
        self._exiting = False
        self._lock = threading.Lock()
        if frontend is not None:
            self._take(frontend)
        _LIVE.add(self)

    def _take(self, frontend: Any) -> None:
        self.frontend = frontend
        if self.policy.max_restarts:
            frontend.journal = self.journal

    # ---- the engine's verbs ------------------------------------------------------------------
    def start(self, make_frontend: Callable[[], Any] | None = None) -> dict[str, bytes]:
        """Start the actors the first time (ActorFailed / TimeoutError raise: nothing is left).
        `make_frontend()`, if given, makes the frontend (None at construction) while they start:
        the engine's tokenizer then loads beside their start-up instead of before it."""
        gen = next(self._gens)
        group, links, ready = self._start(gen, make_frontend)
        self.frontend.attach(links)
        self._adopt(gen, group, ready)
        return ready

    def close(self) -> None:
        """Stop the actors (and a restart under way); idempotent."""
        with self._lock:
            self._closed = True
            groups = [g for g in (self._launching, self.group) if g is not None]
            thread = self._thread
        for g in groups:
            g.shutdown()
        if thread is not None and thread is not threading.current_thread():
            thread.join(RESTORE_REPLY_TIMEOUT_S)

    def pids(self) -> dict[str, int | None]:
        """The process ids of the actors serving now (get_server_info's `actor_pids`)."""
        group = self.group
        return group.pids if group is not None else {}

    def exiting(self) -> None:
        """No more restarts (the interpreter exits; what dies now fails its callers)."""
        with self._lock:
            self._exiting = True

    # ---- starting a group --------------------------------------------------------------------
    def _start(self, gen: int, make_frontend: Callable[[], Any] | None = None) -> tuple[ActorGroup, EngineLinks, dict[str, bytes]]:
        with self.journal.start_weights() as weights:
            group, links = self.launch(self.journal.model_dir, weights, functools.partial(self._failed, gen))
            with self._lock:
                closed = self._closed
                self._launching = None if closed else group
            if closed:
                group.shutdown()
                raise EngineDead("the engine was shut down")
            try:
                if make_frontend is not None:
                    try:
                        self._take(make_frontend())
                    except BaseException:
                        group.shutdown()  # the actors run: nothing else would stop them
                        raise
                ready = group.wait_ready(self.ready_timeout)
            except BaseException:
                if group.wait_closed(0):  # (torn down: nobody here holds its rings)
                    group.release()
                raise
            finally:
                with self._lock:
                    self._launching = None
        return group, links, ready

    def _adopt(self, gen: int, group: ActorGroup, ready: dict[str, bytes]) -> bool:
        """The started group is the engine's now (False: shut down meanwhile, and so is it)."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._gen, self.group, self.ready = gen, group, ready
        if closed:
            group.shutdown()
            return False
        f = group.failure  # died between ready and now: its on_failure was not ours yet
        if f is not None:
            self._failed(gen, f.name, f.exitcode, f.traceback_text)
        return True

    # ---- failures (a watcher thread) -----------------------------------------------------------
    def _failed(self, gen: int, name: str, exitcode: int | None, traceback_text: str) -> None:
        crash = Crash(name, exitcode, traceback_text, time.monotonic())
        with self._lock:
            if gen != self._gen or gen == self._taken or self._closed or self.gave_up is not None:
                return  # a group still starting (its wait_ready raises), shutting down, or given up
            self._taken = gen
            why = "the interpreter is exiting" if self._exiting else self.policy.crashed(crash.at)
            if why is None:
                self._crashes.append(crash)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._restarts, name="ringserve-supervisor", daemon=True)
                    self._thread.start()
        if why is not None:
            self._give_up(crash, why)
            return
        log.warning("%s\nrestarting the actors (%d of %d restarts allowed within %g s)", crash,
                    len(self.policy.times), self.policy.max_restarts, self.policy.window_s)  # fmt: skip

    def _give_up(self, crash: Crash, why: str) -> None:
        """Every caller gets EngineDead (once); the dead group has torn itself down."""
        with self._lock:
            if self.gave_up is not None:
                return
            self.gave_up = why
        supervised = self.policy.max_restarts > 0
        err = EngineDead(f"{crash}\nnot restarted: {why}" if supervised else str(crash))
        log.error("%s", err)
        fe = self.frontend
        with contextlib.suppress(RuntimeError):  # the loop is closed: the engine was shut down
            fe.loop.call_soon_threadsafe(fe.fail_all, err)

    # ---- restarts (the supervisor's thread) ----------------------------------------------------
    def _restarts(self) -> None:
        while True:
            with self._lock:
                if not self._crashes or self._closed or self.gave_up is not None:
                    self._thread = None
                    return
                crash = self._crashes.popleft()
            try:
                self._restart(crash)
            except Exception as e:  # a bug here must not leave callers waiting forever
                log.exception("supervisor: the restart failed")
                self._give_up(crash, f"the restart failed: {e!r}")

    def _restart(self, crash: Crash) -> None:
        old, readers = self.group, list(self.frontend.readers)
        assert old is not None
        old.wait_closed()
        for reader in readers:
            reader.join()  # every output it read is on the loop before reattach
        try:
            self.frontend.lt.run(self.frontend.journal_settled())  # every reply it read is in the journal
        except Exception:
            if self._closed or self.frontend.closing:  # the frontend closed meanwhile
                return
            raise
        t_down = time.monotonic()
        last, failed = crash, 0
        while True:
            why = self.journal.why_not() or self.policy.failed_starts(failed)
            if why is not None:
                self._give_up(last, why)
                return
            gen = next(self._gens)
            try:
                group, links, ready = self._start(gen)
                t_ready = time.monotonic()
                break
            except ActorFailed as e:  # one more crash, at start-up
                last = Crash(e.name, e.exitcode, e.traceback_text, time.monotonic())
            except TimeoutError as e:  # (the group is shut down)
                last = Crash("start-up", None, str(e), time.monotonic())
            except (EngineDead, RuntimeError):
                if self._closed:  # shut down meanwhile
                    return
                raise
            failed += 1
            log.warning("%s\n(while restarting after %r died)", last, crash.name)
            with self._lock:
                why = self.policy.crashed(last.at)
            if why is not None:
                self._give_up(last, why)
                return
        if not self._adopt(gen, group, ready):
            return
        fe = self.frontend
        lost = m.ControlReply("update_weights", False,
                              f"update_weights: the engine restarted while this update was in flight (actor "
                              f"{crash.name!r} died); the weights serving are version {self.journal.version}; "
                              "send the update again", json.dumps({"weight_version": self.journal.version}).encode())  # fmt: skip
        try:
            futs, resubmitted = fe.lt.run(fe.reattach(links, self.journal.restore(), lost),
                                          timeout=RESTORE_REPLY_TIMEOUT_S)  # fmt: skip
        except Exception:
            if self._closed or fe.closing:  # the frontend closed meanwhile
                return
            raise
        old.release()  # the frontend sends to the new rings now, and the old reader has ended
        for fut in futs:
            fut.add_done_callback(_log_refused)
        seconds = time.monotonic() - crash.at
        phases = {"stopped_s": round(t_down - crash.at, 3), "started_s": round(t_ready - t_down, 3),
                  "ready_s": group.ready_seconds}  # fmt: skip
        fe.core.metrics.restarted(crash.name, crash.exitcode, seconds, resubmitted, phases)
        log.warning("supervisor: actors started again %.1f s after %r died (the old ones stopped in %.1f s, the new "
                    "ones ready %.1f s later); %d requests resubmitted", seconds, crash.name, phases["stopped_s"],
                    phases["started_s"], resubmitted)  # fmt: skip


def _log_refused(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is None and not fut.result().ok:
        log.error("supervisor: restoring the engine's state was refused: %s", fut.result().message)
