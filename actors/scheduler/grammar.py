"""The scheduler's grammar part: a matcher per constrained request (llguidance), compiled off the
loop, and the masks of a batch's sampled positions. The core asks it for three things only:

    grammars.attach(req)        compile req's constraint on the thread pool (cached by its text);
                                req.grammar (`ReqGrammar`) is `ready` once compiled
    grammars.fill(rows, k1)     row.mask for every constrained row that samples
    grammars.flush()            forget the compiled grammars (flush_cache; sglang-jax #425)

and a request's `ReqGrammar` advances with each output token as it is booked (`accept`), trims a
verify round's drafts to what the grammar allows (`valid_drafts`) and says when it has stopped
(`terminated`: only EOS is left) or failed (`error`). A request resubmitted after a restart
(its output so far given back) has its matcher replay that output as soon as it is ready.

The invariant every mask rests on: when a batch is planned, each constrained request's matcher
has consumed exactly its output_ids (`consumed == len(req.output_ids)`). It holds because the
scheduler never plans past a constrained request's step in flight (the actor first books every
in-flight batch with a mask: `ScheduledBatch.masked`), a retracted request keeps its output and
its matcher (it resumes where it was), and an accepted verify run is consumed token by token as
it is booked (a finish inside the run stops both).

Masks (int32 words, bit t % 32 of word t // 32 allows token t; W = ceil(V / 32), V the model's
vocabulary, which may exceed the tokenizer's: those ids are never allowed):

    row.mask[j]   j = 0 .. drafts    the tokens that may follow the output and the row's first j
                                     drafts (a plain row: j = 0 only). The row's drafts are its
                                     valid prefix; masks past it are all ones (never used: the
                                     device accepts no draft after a NO_DRAFT pad)

The vocabulary is mapped once (llguidance's tokenizer from the HF tokenizer, built on the pool at
start-up); each compiled grammar is a template matcher that requests deep-copy (microseconds).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ringserve.kvmem.allocator import cdiv

Key = tuple[str, str]  # (kind, text): SamplingParams.constraint
CACHE_SIZE = 512  # compiled grammars kept (least recently used first out)
PARALLEL_ROWS = 8  # constrained rows from which a step's masks are filled on llguidance's threads


class SampledRow(Protocol):
    """What `fill` reads of a row (actors/scheduler/batch.py `Row`, which imports this module's
    user, the request)."""

    req: Any
    sample: bool
    token_ids: np.ndarray
    drafts: int
    mask: np.ndarray | None


@dataclasses.dataclass(slots=True, eq=False)
class ReqGrammar:
    """One request's matcher. Until its grammar is compiled the request waits (it is not admitted)."""

    key: Key
    compiled: concurrent.futures.Future  # the cached template matcher (an exception: it does not compile)
    matcher: Any = None  # llguidance.LLMatcher, this request's own (a copy of the template) once ready
    consumed: int = 0  # output tokens the matcher has consumed
    replay: list[int] = dataclasses.field(default_factory=list)  # output it starts with (a resumed request)

    @property
    def ready(self) -> bool:
        if self.matcher is None and self.compiled.done() and self.compiled.exception() is None:
            self.matcher = self.compiled.result().deep_copy()
            for t in self.replay:  # (a refused one leaves the matcher in its error state: `error`)
                self.accept(t)
        return self.matcher is not None

    @property
    def error(self) -> str | None:
        """Why the request cannot go on under its grammar (compile failure, a refused token)."""
        if self.compiled.done() and self.compiled.exception() is not None:
            return str(self.compiled.exception())
        if self.matcher is not None and self.matcher.is_error():
            return f"grammar: {self.matcher.get_error()}"
        return None

    @property
    def terminated(self) -> bool:
        """Nothing but EOS can follow: the request finishes (SGLang's FINISH_MATCHED_TOKEN)."""
        return self.matcher is not None and self.matcher.is_stopped()

    def accept(self, token: int) -> None:
        """The request's next output token (a refusal leaves the matcher in its error state)."""
        self.matcher.consume_token(token)
        self.consumed += 1

    def valid_drafts(self, drafts: np.ndarray) -> int:
        """How many leading drafts the grammar allows after the output so far."""
        return int(self.matcher.validate_tokens(drafts.tolist())) if len(drafts) else 0


class Grammars:
    """The scheduler's matcher set. `tokenizer()` builds llguidance's tokenizer (the vocabulary
    map, once); `vocab_size` is the model's (the masks' width); `json_options` llguidance's JSON
    compile defaults (ServerArgs.json_options)."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, json_options: dict[str, Any] | None = None,
                 threads: int = 2):  # fmt: skip
        self.json_options = json_options or {}
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ringserve-grammar")
        self.tokenizer = self.pool.submit(tokenizer)  # mapped off the loop, before the first request
        self.words = cdiv(vocab_size, 32)
        self.cache: collections.OrderedDict[Key, concurrent.futures.Future] = collections.OrderedDict()
        self.compiling = 0  # grammars on the pool now
        self._failed: collections.deque[Key] = collections.deque()  # compiles that failed, not yet taken
        self._lock = threading.Lock()
        self._executor: Any = None  # llguidance.LLExecutor: fills a batch's masks in parallel, GIL released

    def attach(self, req: Any) -> None:
        """Give a constrained request its ReqGrammar; its grammar compiles on the pool unless cached."""
        key = req.sampling.constraint
        fut = self.cache.get(key)
        if fut is None:
            with self._lock:
                self.compiling += 1
            fut = self.cache[key] = self.pool.submit(self._compile, key)
            fut.add_done_callback(functools.partial(self._compiled, key))
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        req.grammar = ReqGrammar(key, fut, replay=list(req.output_ids))

    def _compile(self, key: Key) -> Any:
        import llguidance as llg

        from ringserve.actors.transport.constraint import grammar

        m = llg.LLMatcher(self.tokenizer.result(), grammar(*key, self.json_options), log_level=0)
        if m.is_error():
            raise ValueError(f"{key[0]} does not compile for this model's vocabulary: {m.get_error()}")
        return m

    def _compiled(self, key: Key, fut: concurrent.futures.Future) -> None:  # on the pool's thread
        with self._lock:
            self.compiling -= 1
            if fut.exception() is not None:
                self._failed.append(key)

    def take_failed(self) -> set[Key]:
        """Grammars whose compile failed since the last call (dropped from the cache, so a later
        request with the same text tries again)."""
        failed = set()
        while self._failed:
            key = self._failed.popleft()
            failed.add(key)
            fut = self.cache.get(key)
            if fut is not None and fut.done() and fut.exception() is not None:
                del self.cache[key]
        return failed

    def flush(self) -> None:
        """Forget every compiled grammar (requests keep the matchers they hold)."""
        self.cache.clear()

    def fill(self, rows: Sequence[SampledRow], k1: int) -> int:
        """Set `row.mask` ([k1, W]) for every constrained row that samples; returns how many."""
        todo = [r for r in rows if r.sample and r.req.grammar is not None]
        if not todo:
            return 0
        import llguidance as llg
        import llguidance.numpy as lln

        if self._executor is None:
            self._executor = llg.LLExecutor()
        ll_words = cdiv(self.tokenizer.result().vocab_size, 32)
        bits = np.full((len(todo) * k1, ll_words), -1, np.int32)
        plain, drafted = [], []  # (llguidance refuses an empty draft list)
        for i, row in enumerate(todo):
            g = row.req.grammar
            assert g.ready and g.consumed == len(row.req.output_ids), (
                f"{row.req.rid}: matcher consumed {g.consumed} of {len(row.req.output_ids)} output tokens"
            )
            drafts = row.token_ids[1 : 1 + row.drafts]
            n_valid = int(np.argmax(drafts < 0)) if (drafts < 0).any() else len(drafts)
            if n_valid:
                drafted.append((g.matcher, i * k1, drafts[:n_valid].tolist()))
            else:
                plain.append((g.matcher, i * k1))
        if len(todo) < PARALLEL_ROWS:  # a few rows: here (a pool's hand-off costs more under load)
            for m, i in plain:
                lln.fill_next_token_bitmask(m, bits, i)
            for m, i, drafts in drafted:
                for j, d in enumerate(drafts):
                    lln.fill_next_token_bitmask(m, bits, i + j)
                    m.consume_token(d)
                lln.fill_next_token_bitmask(m, bits, i + len(drafts))
                m.rollback(len(drafts))
        else:
            if plain:
                lln.fill_next_token_bitmask_par(self._executor, plain, bits)
            if drafted:
                lln.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bits)
        if ll_words < self.words:  # ids past the tokenizer's vocabulary are never allowed
            bits = np.concatenate([bits, np.zeros((len(bits), self.words - ll_words), np.int32)], axis=1)
        masks = bits[:, : self.words].reshape(len(todo), k1, self.words)
        for row, m in zip(todo, masks, strict=True):
            row.mask = m
        return len(todo)
