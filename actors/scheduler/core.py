"""The scheduler's state machine, without processes or I/O (tested with a fake runner).

    add_request / abort / pause / resume / flush_cache       inputs from the frontend
    new_weights / can_release / released / resumed            weights and device memory
    get_next_batch()                                          seed 004's get_next_batch_to_run
    process_result(batch, result)                             append tokens, finish, stream

The core owns every scheduling fact (queues, paused, memory released, weight version, stats);
the actor (actors/scheduler/actor.py) only calls its verbs; actors/scheduler/report.py reports it.

Outputs: a streamed request gets its new tokens every `stream_interval` tokens; any request
gets them all when it finishes (so a non-streamed request costs the detokenizer and the
frontend one message).

`get_next_batch` tries a prefill batch (the chunked request first, then the waiting queue in
policy order, through a PrefillAdder); if none can run it decodes the running batch, retracting
under KV pressure. Requests enter the running batch as soon as their last prefill chunk is
scheduled: their first decode step reads the token that chunk samples from the runner's
FutureMap, so in overlap mode batch N+1 is planned before batch N's tokens are back.
Every row remembers the request's retraction count; a result for a row whose request has
since finished, been aborted or been retracted is dropped (the overshoot of seed 001).

Every row takes one path (actors/scheduler/batch.py): a row of a verify step accepts what the
device accepted (0 for a plain row) and appends accepted + 1 tokens. Speculation's per-request
state is `req.spec` (actors/scheduler/spec.py).

Output constraints are a part (`self.grammars`, actors/scheduler/grammar.py): a constrained
request waits until its grammar is compiled (others are admitted past it), every planned batch
asks it for the masks of its constrained rows, each booked token advances the request's matcher
(`req.grammar`), and a matcher that stopped finishes its request (`Req.stop_reason`). The actor
books every batch with a mask before planning the next (no overlap for constrained requests).

KV memory is kvmem's `KVCache` (`self.cache`); a request's KV record (`req.kv`) is the one owner
of its lengths. A request lets go of its KV in one place (`_release_kv`), finishes in one place
(`_finish`) and is retracted in one place (`_retract`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ringserve.actors.scheduler import booking, decode
from ringserve.actors.scheduler.batch import Row, ScheduledBatch, StepResult
from ringserve.actors.scheduler.booking import ReqOutput, take_output
from ringserve.actors.scheduler.checks import check_request
from ringserve.actors.scheduler.decode import NewTokenRatio, decode_reserve, decode_steps, prepare_decode
from ringserve.actors.scheduler.grammar import Grammars
from ringserve.actors.scheduler.lora import LoraTable, cache_key
from ringserve.actors.scheduler.policy import InBatchPrefix, order_waiting
from ringserve.actors.scheduler.prefill import AddResult, BucketFit, PrefillAdder
from ringserve.actors.scheduler.req import FinishReason, Req, ReqStatus
from ringserve.actors.scheduler.spec import NO_DRAFT, SpecState
from ringserve.actors.scheduler.stats import SchedulerStats
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport.messages import StartWeights
from ringserve.kvmem import KVCache, ReqKV, SessionSlots
from ringserve.model.compute.step_inputs import Buckets

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")


class SchedulerCore:
    def __init__(self, args: ServerArgs, cache: KVCache, decode_tail: Callable[[list[int]], str],
                 grammars: Grammars | None = None):  # fmt: skip
        self.args = args
        self.cache = cache
        self.decode_tail = decode_tail
        self.grammars = grammars  # None: this scheduler refuses constrained requests
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # the running batch (decoding), in admission order
        self.chunked: Req | None = None  # the one request whose extend is scheduled in chunks
        # prefill steps cut where their extend program would be mostly padding (prefill.py)
        self.fit = BucketFit(Buckets.make(args.max_running_requests, args.max_extend_tokens,
                                          args.extend_block).extend_tokens,
                             args.prefill_step_cost) if args.prefill_step_cost else None  # fmt: skip
        self.by_rid: dict[str, Req] = {}
        self.paused = False
        self.memory_released: set[str] = set()  # "kv_cache" / "weights" given back: nothing runs
        self.weight_version = "0"  # stamps outputs; namespaces the prefix cache (extra_key)
        self.step_id = 0
        self.released_slots: list[int] = []
        self.ratio = NewTokenRatio(args.new_token_ratio_init, args.new_token_ratio_min,
                                   (args.new_token_ratio_init - args.new_token_ratio_min) / max(1, args.new_token_ratio_decay_steps))  # fmt: skip
        self.sessions = SessionSlots(cache)  # slots finished session turns keep for their next turn
        self.stats = SchedulerStats(args.speculative_num_draft_tokens)
        self.initial_tokens = cache.available_tokens()
        self._arrivals = 0
        self.loras = LoraTable(args.max_loras_per_batch, args.lora_adapters) if args.enable_lora else None

    # ---- inputs ---------------------------------------------------------------------------
    def add_request(self, req: Req, lora_path: str | None = None) -> None:
        """Queue `req`; `lora_path` names its LoRA adapter (ValueError if none such is loaded)."""
        if req.rid in self.by_rid:
            raise ValueError(f"rid {req.rid!r} is already in use by a live request")
        check_request(self.args, req)
        if lora_path is not None:
            if self.loras is None:
                raise ValueError(f"lora_path={lora_path!r}: this server serves no LoRA adapters (start it with enable_lora)")
            req.lora = self.loras.get(lora_path)
        if req.sampling.constraint is not None:
            if self.grammars is None:
                raise ValueError("this scheduler serves no output constraints (no grammar backend)")
            self.grammars.attach(req)
        req.arrival = self._arrivals
        self._arrivals += 1
        if self.args.speculative:
            req.spec = SpecState(self.args.speculative_num_draft_tokens, self.args.speculative_ngram_max_match)
            if req.resumed is not None:  # resubmitted after a restart: its first run's rounds count
                req.spec.verify_ct, req.spec.accepted = req.resumed.spec_verify_ct, req.resumed.spec_accepted
        self.by_rid[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str | None, message: str = "aborted by request") -> list[ReqOutput]:
        """Abort one request (or all when rid is None); returns their final outputs."""
        victims = list(self.by_rid.values()) if rid is None else [r for r in [self.by_rid.get(rid)] if r is not None]
        return [self._finish(r, FinishReason("abort", message=message)) for r in victims]

    def pause(self, mode: str) -> list[ReqOutput]:
        """pause_generation (the actor finished the batches in flight first): `abort` finishes
        every request (their outputs are returned), `retract` gives every admitted request's KV
        back (they wait), `in_place` keeps everything. Nothing is scheduled until `resume`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: choose one of {list(PAUSE_MODES)}")
        outs = self.abort(None, "aborted by pause_generation") if mode == "abort" else []
        if mode == "retract":
            for r in list(self.running) + ([self.chunked] if self.chunked else []):
                self._retract(r)
        self.paused = True
        return outs

    def resume(self) -> None:
        """continue_generation."""
        self.paused = False

    def next_weight_version(self, given: str | None) -> str:
        """The version a weight update gets: the caller's, or the count of updates so far + 1."""
        return given or str(self.stats.weight_updates + 1)

    def started_with(self, weights: StartWeights) -> None:
        """A restarted engine: the weights it serves carry this version and update count."""
        self.weight_version = weights.version
        self.stats.weight_updates = weights.updates

    def new_weights(self, version: str) -> None:
        """The runner serves other weights now: outputs carry `version`; cached prefixes of
        the old weights never match again (another extra_key) and leave the tree now where
        no request holds them, as does the KV sessions kept."""
        self.stats.weight_updates += 1
        self.weight_version = version
        self.sessions.drop_all()
        self.cache.tree.evict(self.cache.tree.evictable_pages * self.cache.page_size)

    def lora_users(self, name: str) -> int:
        """Requests (waiting or running) that use adapter `name`."""
        return sum(1 for r in self.by_rid.values() if r.lora is not None and r.lora.name == name)

    def close_session(self, session_id: str) -> None:
        """The session's kept KV goes to the prefix cache and its slot is freed."""
        self.sessions.close(session_id)

    def busy(self) -> str | None:
        """Why weights or memory cannot change now (requests run and the engine is not paused)."""
        if self.paused or self.idle:
            return None
        return (f"{len(self.running) + (self.chunked is not None)} requests are running and {len(self.waiting)} waiting; "
                "call pause_generation first (or wait until idle)")  # fmt: skip

    def can_release(self, tags: list[str]) -> str | None:
        """Why release_memory_occupation(tags) is refused now, or None."""
        busy = self.busy()
        if busy is None and "kv_cache" in tags and self.live():
            busy = f"{len(self.live())} requests hold KV; pause_generation('retract') or ('abort') first"
        return busy

    def released(self, tags: list[str]) -> None:
        """The runner gave `tags` back: nothing is scheduled until they are resumed. Releasing
        the KV cache empties the prefix cache (the KV it indexes is gone)."""
        if "kv_cache" in tags:
            self.flush_cache()
        self.memory_released |= set(tags)

    def resumed(self, tags: list[str]) -> None:
        self.memory_released -= set(tags)

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache and pools. Refused while any request holds KV; requests
        that wait without KV (e.g. retracted by a pause) do not block it."""
        holding = self.live()
        if holding:
            return (
                False,
                f"{len(holding)} requests hold KV ({len(self.running)} running); flush needs them finished or retracted",
            )
        self.sessions.drop_all()  # sessions stay open; their next turn starts cold
        self.cache.flush()
        if self.grammars is not None:
            self.grammars.flush()  # (sglang-jax #425: its grammar cache outlived a flush)
        self.ratio.reset()
        self.stats.forward_ct_decode = 0  # as SGLang's flush_cache
        return True, "cache flushed"

    def grammar_failures(self) -> list[ReqOutput]:
        """Finish (abort) the waiting requests whose grammar failed to compile; their outputs."""
        failed = self.grammars.take_failed() if self.grammars is not None else set()
        if not failed:
            return []
        return [self._finish(r, FinishReason("abort", message=r.grammar.error))
                for r in list(self.waiting) if r.grammar is not None and r.grammar.key in failed]  # fmt: skip

    @property
    def compiling(self) -> bool:
        """Some grammar is compiling (a request may become ready without any other event)."""
        return self.grammars is not None and self.grammars.compiling > 0

    @property
    def idle(self) -> bool:
        return not self.by_rid

    @property
    def stalled(self) -> bool:
        """Nothing can be scheduled now: no request, paused, or device memory given back."""
        return self.idle or self.paused or bool(self.memory_released)

    def live(self) -> list[Req]:
        """Requests holding KV."""
        return [r for r in self.by_rid.values() if r.kv is not None]

    # ---- scheduling -----------------------------------------------------------------------
    def get_next_batch(self) -> ScheduledBatch | None:
        if self.paused or self.memory_released:
            return None
        self.cache.begin_step()
        batch = self._prefill_batch()
        if batch is None and self.running:
            batch = self._decode_batch()
        if batch is not None:
            if self.grammars is not None:
                t0 = time.perf_counter()
                if self.grammars.fill(batch.rows, 1 + batch.drafts):
                    self.stats.grammar_steps += 1
                    self.stats.grammar_mask_s += time.perf_counter() - t0
            self.step_id += 1
            batch.step_id = self.step_id
            batch.released_slots, self.released_slots = self.released_slots, []
            if batch.is_decode:
                self.stats.forward_ct_decode += 1
            else:
                self.stats.forward_ct_prefill += 1
            self.stats.tokens_computed += batch.num_tokens
        return batch

    def _cache_key(self, req: Req) -> str:
        """The prefix cache's namespace of `req`: the weight version, its adapter load, its salt."""
        return cache_key(self.weight_version, req.lora, req.cache_salt)

    def _match_len(self, req: Req) -> int:
        return self.cache.match_len(req.prefix_ids(), self._cache_key(req))

    def _admit(self, req: Req) -> ReqKV | None:
        """A slot and a cached prefix: a session's turn reuses the slot its previous turn kept."""
        if req.session_id is not None:
            return self.sessions.start_turn(req.session_id, req.fill_ids(0, req.fill_len), self._cache_key(req))
        return self.cache.admit(req.prefix_ids(), self._cache_key(req))

    def _prefill_batch(self) -> ScheduledBatch | None:
        a = self.args
        chunk = None if a.chunked_prefill_size == -1 else a.chunked_prefill_size
        reserved = sum(decode_reserve(r, self.ratio.value) for r in self.running)
        # mixed: the decode rows ride in this step, so they come off its token budgets (SGLang's
        # mixed_with_decode_tokens); else the step outgrows the extend bucket its budget fits
        mixed = len(self.running) if a.enable_mixed_chunk else 0
        adder = PrefillAdder(self.cache, reserved_decode=reserved, max_prefill_tokens=a.max_prefill_tokens - mixed,
                             chunk_size=None if chunk is None else chunk - mixed,
                             new_token_ratio=self.ratio.value, other_tokens=mixed)  # fmt: skip
        admitted: list[Req] = []
        if self.chunked is not None:
            self._cache_prefix(self.chunked)
            if adder.add(self.chunked) is AddResult.CHUNKED:
                return self._build_prefill(adder, admitted)
        shared = InBatchPrefix(a.schedule_policy == "lpm")
        for req in order_waiting(a.schedule_policy, self.waiting, self._match_len):
            if len(self.running) + len(adder.planned) >= a.max_running_requests:
                break
            if self.cache.num_free_slots == 0 and self.sessions.evict_oldest() is None:
                break  # (a session's kept slot is given back first)
            if req.grammar is not None and not req.grammar.ready:
                continue  # its grammar is still compiling: the others go first
            if shared.defer(req, self._match_len(req)):
                continue
            req.kv = self._admit(req)
            if req.kv is None:
                break
            result = adder.add(req)
            while result is AddResult.NO_TOKEN and self.sessions.evict_oldest() is not None:
                result = adder.add(req)  # kept session KV is the first to make room
            if result is AddResult.NO_TOKEN:
                self._unadmit(req)
                break
            admitted.append(req)
            if result is AddResult.CHUNKED:
                break
        if not adder.planned:
            return None
        return self._build_prefill(adder, admitted)

    def _unadmit(self, req: Req) -> None:
        """Undo `_admit` of a request still waiting (the runner never saw its slot); a session's
        turn keeps again the slot its previous turn kept."""
        assert req.kv is not None
        if req.session_id is not None:
            self.sessions.undo_start(req.session_id, req.kv)
        else:
            self.cache.release(req.kv, None)
        req.kv = None

    def _build_prefill(self, adder: PrefillAdder, admitted: list[Req]) -> ScheduledBatch:
        if self.fit is not None:  # the step as formed, cut where its program would be mostly padding
            for req in adder.fit(self.fit):  # past the cut: back to waiting, as if never admitted
                admitted.remove(req)
                self._unadmit(req)
        new = {id(r) for r in admitted}
        rows: list[Row] = []
        for row in adder.planned:
            req = row.req
            assert req.kv is not None
            if id(req) in new:
                row.prefix_pages = self.cache.pages(req.kv).copy()
                row.prefix_local = self.cache.local_pages(req.kv).copy()
                if req.retractions == 0 and req.resumed is None:  # (a resumed one reports its first run's)
                    req.cached_tokens = req.cached_len
                req.status = ReqStatus.RUNNING
                self.waiting.remove(req)
            pages = self.cache.reserve(req.kv, row.extend_len)
            assert pages is not None, (
                f"prefill budget admitted {req.rid} but the pool refused {row.extend_len} tokens"
            )
            row.new_pages = pages
            row.new_local = self.cache.local_pages(req.kv, len(pages)).copy()
            self.cache.commit(req.kv, row.extend_len)
            rows.append(row)
            if row.sample:  # the last chunk: the request decodes from its next step on
                if req.spec is not None:
                    req.spec.scheduled(None)  # its first token, not known when the first round is drafted
                self.running.append(req)
                if self.chunked is req:
                    self.chunked = None
            else:
                self.chunked = req
        if self.args.enable_mixed_chunk and self.running:
            planned = {id(r.req) for r in adder.planned}
            decoding = [r for r in self.running if id(r) not in planned]
            if decoding:
                rows += self._decode_rows(decoding)
        return ScheduledBatch(0, rows, [], is_decode=False)

    def _decode_batch(self) -> ScheduledBatch | None:
        rows = self._decode_rows(list(self.running), spare=self._retract_chunked, multistep=True)
        self.ratio.step()
        return ScheduledBatch(0, rows, [], is_decode=True, multistep=rows[0].drafts > 0 and not self.args.speculative
                              ) if rows else None  # fmt: skip

    def _retract_chunked(self) -> bool:
        """Free the KV of a half-prefilled request so that decoding can go on."""
        if self.chunked is None:
            return False
        self._retract(self.chunked)
        return True

    def _decode_rows(self, reqs: list[Req], spare: Callable[[], bool] | None = None,
                     multistep: bool = False) -> list[Row]:  # fmt: skip
        """One decode row per request, or with speculation one verify round (1 + k positions,
        booked as an upper bound; the rejected ones are given back with the result), or with
        `multistep` where it applies (`_decode_steps`) decode_steps exact positions."""
        a = self.args
        need = 1 + (a.speculative_num_draft_tokens if a.speculative else 0)
        if need == 1:  # (a verify round books drafts it may give back: no exact count in flight)
            reqs = [r for r in reqs if r.session_id is not None or not decode.length_reached_in_flight(r)]
            others = bool(self.waiting) or self.chunked is not None  # something waits to prefill
            need = decode_steps(a, reqs, others) if multistep else 1
        places = np.full(need - 1, NO_DRAFT, np.int32) if need > 1 and not a.speculative else None
        retracted_before = self.stats.num_retracted
        grants = prepare_decode(self.cache, reqs, self._retract, spare, defer_last=spare is None,
                                reclaim=lambda: self.sessions.evict_oldest() is not None, need=need)  # fmt: skip
        if self.stats.num_retracted > retracted_before:
            self.ratio.after_retract(self.running)
        rows = []
        for r in reqs:
            if id(r) in grants:
                assert r.kv is not None
                valid = r.grammar.valid_drafts if r.grammar is not None else None
                drafts = r.spec.scheduled(r.fill_ids(0, r.fill_len), valid) if r.spec is not None else places
                row = Row.decode(r, grants[id(r)], drafts)
                row.new_local = self.cache.local_pages(r.kv, len(row.new_pages)).copy()
                rows.append(row)
                self.cache.commit(r.kv, need)
        return rows

    # ---- results --------------------------------------------------------------------------
    def process_result(self, batch: ScheduledBatch, result: StepResult) -> list[ReqOutput]:
        """Every row on one path: accepted drafts (0 for a plain row) and one token more."""
        assert result.step_id == batch.step_id, f"result of step {result.step_id} for batch {batch.step_id}"
        outs: list[ReqOutput] = []
        k1 = 1 + batch.drafts
        at = 0  # the next row's first prompt position in the result's input_* columns
        for i, row in enumerate(batch.rows):
            req = row.req
            accepted = int(result.accepted[i]) if result.accepted is not None else 0
            current = row.retractions == req.retractions
            if row.logprob_span is not None:
                if current and not req.finished:
                    booking.record_prompt_logprobs(req, row.logprob_span, at, result)
                at += row.logprob_span[1]
            if current and not req.finished:
                booking.record_tapes(req, row, i, accepted if row.drafts and not batch.multistep else None, result)
            if row.sample and current and req.spec is not None:
                req.spec.resolved(accepted + 1)  # this step is no longer in flight
            if req.finished or not current or not row.sample:
                continue  # overshoot of a finished/retracted request, or a middle chunk
            if not row.reads_future and not req.output_ids:
                self._cache_prefix(req)  # prompt done: share it with later requests
            if req.max_new_tokens == 0:  # prefill only (e.g. to warm the prefix cache)
                outs.append(self._finish(req, FinishReason("length")))
                continue
            if row.drafts and not batch.multistep:
                assert req.kv is not None and req.spec is not None
                self.cache.uncommit(req.kv, row.drafts - accepted)  # the rejected drafts' positions
                req.spec.counted(accepted)
                self.stats.spec_accept_histogram[accepted] += 1
            reason = None
            for j in range(i * k1, i * k1 + accepted + 1):  # a finish inside an accepted run drops the rest
                reason = self._append(req, int(result.tokens[j]), j, result)
                if reason is not None:
                    if not batch.multistep:
                        self.stats.spec_dropped_tokens += i * k1 + accepted - j
                    break
            if reason is not None:
                outs.append(self._finish(req, reason))
            elif req.stream and len(req.output_ids) - req.sent_len >= self.args.stream_interval:
                outs.append(take_output(req, False))
        return outs

    def _append(self, req: Req, token: int, j: int, result: StepResult) -> FinishReason | None:
        """One output token (result index j for its logprobs); why the request finishes now."""
        if not req.output_ids:
            req.first_token_at = time.perf_counter()
        if req.weight_version != self.weight_version:
            req.weight_spans.append((self.weight_version, len(req.output_ids)))
        req.output_ids.append(token)
        if req.grammar is not None:
            req.grammar.accept(token)
        booking.book_token_extras(req, j, result)
        return req.stop_reason(self.decode_tail)

    # ---- the one release, finish and retract paths ---------------------------------------------
    def _cache_prefix(self, req: Req) -> None:
        """Insert the request's written KV into the prefix cache (the row is unchanged)."""
        assert req.kv is not None
        self.cache.cache_unfinished(req.kv, req.fill_ids(0, min(req.committed_len, req.fill_len)))

    def _release_kv(self, req: Req, keep_len: int | None) -> None:
        """The request lets go of its KV: fill_ids[:keep_len] enter the prefix cache (None:
        nothing), every page it still owns is freed, its slot is released to the runner."""
        if req.kv is None:
            return
        self.released_slots.append(req.kv.slot)
        self.cache.release(req.kv, None if keep_len is None else req.fill_ids(0, keep_len))
        req.kv = None

    def _finish(self, req: Req, reason: FinishReason) -> ReqOutput:
        req.finish_reason = reason
        if req.kv is not None and req.session_id is not None and req.session_id not in self.sessions.kept:
            # a session turn: kvmem keeps its slot, trimmed to origin_len + finished_len (seed
            # 001), for the next turn; the runner forgets the row (the next turn restarts it)
            self.released_slots.append(req.kv.slot)
            self.sessions.finish_turn(req.session_id, req.kv, req.origin_ids, req.output_ids, len(req.output_ids))
            req.kv = None
        if req.kv is not None:
            # KV is valid for every token but the last sampled one (never fed back), and never
            # past what was scheduled (a batch still in flight writes it before any later batch
            # can read it); overshoot beyond that is freed page-aligned. Aborted requests keep
            # their prefix cached too: an RL partial rollout resubmits prompt + produced.
            self._release_kv(req, min(req.fill_len - 1, req.committed_len))
        self._unlist(req)
        req.status = ReqStatus.FINISHED
        self.by_rid.pop(req.rid, None)
        return take_output(req, True)

    def _retract(self, req: Req) -> None:
        """Back to the front of the waiting queue without KV; its output so far is kept and
        will be prefilled again. Rows of it still in flight are dropped (retractions)."""
        self._release_kv(req, None)
        self._unlist(req)
        if req.spec is not None:
            req.spec.retracted()
        req.status = ReqStatus.WAITING
        req.retractions += 1
        self.stats.num_retracted += 1
        self.waiting.insert(0, req)

    def _unlist(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None

    def check_idle(self) -> None:
        """Called whenever nothing runs: integrity of the KV books, ratio reset."""
        self.ratio.reset()
        self.sessions.check_integrity([r.kv for r in self.live() if r.kv is not None])
