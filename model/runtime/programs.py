"""The compiled step programs of one executor: which exist, in what order they compile, and the
smallest compiled one that holds a step.

A program is keyed by `(StepShape, top_n)`: the padded step shape (model/compute/step_inputs.py buckets,
times the attention backend's context buckets) and the top-logprobs count compiled into it.
Every key is compiled ahead of time (`compile_all`), so serving never traces: the executor only
calls compiled executables, and `trace_count` (counted by the executor) stays constant.

Background compiling (the server's default): `compile_all(background=True)` returns once the
covering set is compiled (the largest program of each family holds any step of that family,
padded) and compiles the rest on a thread; until it is done `smallest_context` picks the
smallest compiled program that holds a step.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ringserve.model.compute.step_inputs import (
    BAN_IDS,
    BIAS_IDS,
    Buckets,
    ForwardBatch,
    LogprobBatch,
    RowSampling,
    StepShape,
)

log = logging.getLogger(__name__)

Key = tuple[StepShape, int]  # (shape, top_n)


def enable_compilation_cache(path: str | Path | None = None) -> Path:
    """Persist XLA executables on disk (process-wide), keyed by XLA on program and backend:
    the second start-up with the same shapes loads its buckets instead of compiling them."""
    from ringserve.model.paths import cache_dir

    p = Path(path) if path is not None else cache_dir("xla")
    p.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(p))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return p


def step_avals(shape: StepShape, plan_avals: dict[str, Any], max_pages: int, sharding: Any,
               mask_words: int, logprob_ids: int = 0,
               positions: int = 0, local: bool = False) -> tuple[ForwardBatch, RowSampling, LogprobBatch, Any]:  # fmt: skip
    """The abstract inputs of a step program of `shape` (what `build_batch` makes, on device);
    every program takes a grammar mask of `mask_words` (ceil(V / 32)) words per sample and
    `logprob_ids` (K) token_ids_logprob per row; an extend program also takes `positions` (P,
    `Buckets.positions`) prompt positions to read logprobs at; with `local` (a local page space)
    the sliding layers' page tables and token locations. The last: each row's LoRA adapter
    slot ([R] int32; used only when the executor serves adapters)."""

    def spec(shp: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shp, dtype, sharding=sharding)

    t, r, k1 = shape.tokens, shape.rows, max(1, shape.verify)
    i32, f32 = jnp.int32, jnp.float32
    fwd = ForwardBatch(
        input_ids=spec((t,), i32), positions=spec((t,), i32), out_loc=spec((t,), i32),
        row_start=spec((r + 1,), i32), kv_len=spec((r,), i32), pages=spec((r, max_pages), i32),
        num_rows=spec((1,), i32), sample_idx=spec((r * k1,), i32), sample_slot=spec((r,), i32),
        attn={k: spec(a.shape, a.dtype) for k, a in plan_avals.items()},
        local_pages=spec((r, max_pages), i32) if local else None, local_out_loc=spec((t,), i32) if local else None,
    )  # fmt: skip
    smp = RowSampling(
        temperature=spec((r,), f32), top_k=spec((r,), i32), top_p=spec((r,), f32), min_p=spec((r,), f32),
        seed=spec((r,), jnp.uint32), any_random=spec((), jnp.bool_), any_filter=spec((), jnp.bool_),
        mask=spec((r * k1, mask_words), i32), any_mask=spec((), jnp.bool_), any_logprobs=spec((), jnp.bool_),
        any_top=spec((), jnp.bool_), repetition=spec((r,), f32), frequency=spec((r,), f32), presence=spec((r,), f32),
        any_penalty=spec((), jnp.bool_), min_until=spec((r,), i32), ban=spec((r, BAN_IDS), i32),
        bias_ids=spec((r, BIAS_IDS), i32), bias=spec((r, BIAS_IDS), f32), any_adjust=spec((), jnp.bool_),
        any_kept=spec((), jnp.bool_),
    )  # fmt: skip
    lb = LogprobBatch(spec((r, logprob_ids), i32))
    if positions:
        lb = lb._replace(index=spec((positions,), i32), target=spec((positions,), i32), row=spec((positions,), i32),
                         count=spec((), i32))  # fmt: skip
    return fwd, smp, lb, spec((r,), i32)


def program_keys(buckets: Buckets, contexts: Sequence[int], verify: int, top_n: int) -> list[Key]:
    """Every (shape, top_n) there is to compile."""
    return [(s._replace(context=c), top_n) for s in buckets.shapes(verify) for c in contexts]


def compile_order(buckets: Buckets, contexts: Sequence[int], verify: int, top_n: int,
                  small_leads: bool = False, steps: int = 0, steps_rows: int = 0) -> tuple[list[Key], int]:  # fmt: skip
    """Every program key in the order to compile them, and how many lead (compiled before the
    engine serves).

    Programs of one family (decode, extend, verify, multi-step decode: `steps` > 1, up to
    `steps_rows` rows) are ordered by size (tokens, then context); the largest of a family
    serves any step of it (padded), so each family's largest leads. With `small_leads` (CPU,
    where padding costs what real rows and tokens do) the smallest decode program (at the
    longest context), extend program (at the shortest) and multi-step program (one request's)
    lead instead of the largest, and the largest of each are the first to compile after them:
    a request's first step is a prefill, and a short prompt padded to the largest program is
    seconds (SmolLM2, a 2-token prompt in the 3072-token program: 3.9 s; the largest
    one's load is a third of a warm start, its compile the most of a cold one); one request's
    decode steps padded to the largest batch are 64-row steps (SmolLM2 f32, 2 cores: ~240 ms a
    token against 23; a 32-token request took 8.3 s after a cold start's ready, 1.6 s now). A
    step no compiled program holds has its own compiled at once instead
    (`ProgramSet.compile_now`): a prefill longer than the smallest program's, a decode batch of
    more rows than the smallest program's before the largest one is in. On an accelerator the
    padding costs little and a program's compile much (TPU: tens of seconds). After them each
    family's smallest, then the families take turns, each adding the program in the middle of
    its widest run of missing ones, so padding shrinks fastest (decode 2..64: 64, 2, 32, 16,
    48, ...)."""
    orders: list[list[Key]] = []
    smallest: list[Key] = []
    for family in buckets.families(verify, steps, steps_rows):
        keys = [(s._replace(context=c), top_n) for s in family for c in contexts]  # ascending
        orders.append([keys[i] for i in widest_gap_first(len(keys))])
        # the fewest rows at the longest context (any one request's decode), the fewest tokens
        # at the shortest (a short prompt's prefill)
        smallest.append(keys[len(contexts) - 1] if not smallest else keys[0])
    lead, first = [o[0] for o in orders], []
    if small_leads:  # families: decode, extend, (verify), (multi-step decode: its smallest, one stream's)
        for f in [f for f in range(len(orders)) if f < 2 or orders[f][0][0].multistep]:
            if smallest[f] != lead[f]:
                first.append(lead[f])  # the family's largest: first after the leads
                lead[f] = smallest[f]
    lead = list(dict.fromkeys(lead))
    rest = [o[i] for i in range(1, max(map(len, orders))) for o in orders if i < len(o)]
    return list(dict.fromkeys(lead + first + rest)), len(lead)


BACKGROUND_NICE = 19


def _yield_cpu() -> None:
    """Give the calling thread (and the threads it starts) the lowest CPU priority: the
    background compile then runs on what serving leaves. At the default priority it took a
    core from every step: the matmul kernels deal each call's work to a helper thread and wait
    for its items, so a helper the scheduler parks behind the compile stalls the whole call
    (SmolLM2 f32 on 2 cores, warm start, 8-token requests while the cache loads: 3.1-3.5 s
    each against 0.7 s once it is done). Linux niceness is per thread; elsewhere a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: compile at full priority
        log.debug("background compile keeps its priority: %s", e)


def widest_gap_first(n: int) -> list[int]:
    """0..n-1: the last, the first, then each time the middle of the widest run not yet taken."""
    order, runs = [n - 1, 0][: n], [(1, n - 2)] if n > 2 else []
    while runs:
        runs.sort(key=lambda r: r[1] - r[0])
        lo, hi = runs.pop()
        mid = (lo + hi + 1) // 2
        order.append(mid)
        runs += [r for r in ((lo, mid - 1), (mid + 1, hi)) if r[0] <= r[1]]
    return order


class ProgramSet:
    """Compiled executables by key. `compile_one(key)` lowers and compiles one (the executor's
    jitted step over that key's abstract inputs); `order` / `lead` come from `compile_order`."""

    def __init__(self, compile_one: Callable[[Key], Any], order: list[Key], lead: int, contexts: Sequence[int]):
        self._compile_one = compile_one
        self.order, self.lead, self.contexts = order, lead, contexts
        self.compiled: dict[Key, Any] = {}
        self.pending = 0  # programs still compiling in the background
        self._more = threading.Condition()  # notified as each background program is compiled
        self.compile_s = 0.0  # seconds every program took to compile (set once all are)
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._queue: collections.deque[Key] = collections.deque()  # the background compile's, in order
        self._done: Callable[[], None] | None = None  # compile_all's `done`, called once

    def get(self, key: Key) -> Any:
        """The compiled program of `key` (compiled now if it never was)."""
        prog = self.compiled.get(key)
        if prog is None:
            prog = self.compiled[key] = self._compile_one(key)
        return prog

    def compile_all(self, background: bool = False, then: Callable[[], None] | None = None,
                    done: Callable[[], None] | None = None) -> float:  # fmt: skip
        """AOT-compile every program (progress bar); returns seconds spent. One after another:
        XLA CPU's compile already keeps the cores busy (2 cores, tiny model: 15 programs took
        34.5 s on one thread and on two).

        `background`: return once the covering set is compiled (every step can run, padded to
        a larger program) and compile the rest on a thread (`pending` counts them down).
        `then`: called once the covering set is compiled, before the rest start (the executor
        finishes its weights there: a build beside the background compile's tracing waited for
        the GIL behind a thread at the lowest priority, 10 s on 2 cores). `done`: called once no
        more programs will come (all compiled, or the background compile failed)."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        now = self.order[: self.lead] if background else self.order
        for key in tqdm(now, desc="compiling buckets", unit="bucket"):
            self.get(key)
        if then is not None:
            then()
        rest = self.order[len(now) :]
        if not rest:
            self.compile_s = time.perf_counter() - t0
            if done is not None:
                done()
            return self.compile_s
        self.pending, self._done = len(rest), done
        self._queue.extend(rest)

        def compile_rest() -> None:
            _yield_cpu()
            try:
                while True:
                    with self._more:
                        if not self._queue:
                            break
                        key = self._queue.popleft()
                    try:
                        self.get(key)
                    finally:
                        self._landed()
                self.compile_s = time.perf_counter() - t0
                log.info("compiled the other %d step programs in the background (%.1f s in all)", len(rest), self.compile_s)
            except Exception as e:  # noqa: BLE001 -- serving goes on with the programs it has
                with self._more:
                    self.error = f"{type(e).__name__}: {e}"
                    self._more.notify_all()
                self._finish()
                log.exception("background compile failed; serving with %d programs", len(self.compiled))

        self._thread = threading.Thread(target=compile_rest, name="ringserve-compile", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def stop(self) -> None:
        """Compile no more in the background (the program compiling now finishes first): an
        executor whose process goes on after it (runner_in_process)."""
        with self._more:
            dropped = len(self._queue)
            self._queue.clear()
            self.pending -= dropped
            self._more.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._finish()

    def compile_now(self, key: Key) -> bool:
        """Compile `key` on the calling thread (at its priority) if the background compile has not
        come to it yet: a step waits for it. True if it did. Waiting for the background's order
        instead, SmolLM2's first 30-token prompt after a warm start ran in the 3072-token
        program that compiles first (3.9 s of padding) at the lowest priority."""
        with self._more:
            try:
                self._queue.remove(key)
            except ValueError:
                return False  # compiled, compiling, or never to be
        try:
            self.get(key)
        finally:
            self._landed()
        return True

    def _landed(self) -> None:
        """One program less to come (compiled, or its compile failed); the last calls `done`."""
        with self._more:
            self.pending -= 1
            self._more.notify_all()
            last = self.pending == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        with self._more:
            done, self._done = self._done, None
        if done is not None:
            done()

    def wait_for_more(self, seen: int) -> bool:
        """Block until more than `seen` programs are compiled (the background compile added
        one); False when no more will come (all compiled, or the compile failed)."""
        with self._more:
            self._more.wait_for(lambda: len(self.compiled) > seen or not self.pending or self.error)
            return len(self.compiled) > seen

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background compile is over (and any program compiled on demand);
        True once every program is compiled."""
        with self._more:
            self._more.wait_for(lambda: not self.pending or self.error is not None, timeout)
            return self.pending == 0

    def smallest_context(self, shape: StepShape, top_n: int, need: int, compiled: bool = True) -> int | None:
        """The shortest context bucket >= need (compiled for `shape`: the default), or None."""
        for c in self.contexts:
            if c >= need and (not compiled or (shape._replace(context=c), top_n) in self.compiled):
                return c
        return None

    def status(self) -> dict[str, Any]:
        return {
            "programs_compiled": len(self.compiled),
            "programs_total": len(self.order),
            "programs_pending": self.pending,
            "compile_s": round(self.compile_s, 2),
            "compile_error": self.error,
        }
