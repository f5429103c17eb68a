"""The scheduler's state machine, without processes or I/O (tested with a fake runner).

    add_request / abort / pause / resume / flush_cache   inputs from the frontend
    get_next_batch()                                       seed 004's get_next_batch_to_run
    process_result(batch, result)                          append tokens, finish, stream

`get_next_batch` tries a prefill batch (the chunked request first, then the waiting queue in
policy order, through a PrefillAdder); if none can run it decodes the running batch, retracting
under KV pressure. Requests enter the running batch as soon as their last prefill chunk is
scheduled: their first decode step reads the token that chunk samples from the runner's
future buffer, so in overlap mode batch N+1 is planned before batch N's tokens are back.
Every row remembers the request's retraction epoch; a result for a row whose request has
since finished, been aborted or been retracted is dropped (the overshoot of seed 001).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from actors.scheduler.batch import Row, ScheduledBatch, StepResult
from actors.scheduler.decode import NewTokenRatio, prepare_decode
from actors.scheduler.memory import MemoryBooks
from actors.scheduler.policy import InBatchPrefix, order_waiting
from actors.scheduler.prefill import AddResult, PrefillAdder
from actors.scheduler.req import FinishReason, Req, ReqStatus
from actors.server_args import ServerArgs


@dataclasses.dataclass(slots=True)
class ReqOutput:
    """New tokens of one request since the last output (what the detokenizer receives)."""

    req: Req
    new_ids: list[int]
    finished: bool


class SchedulerCore:
    def __init__(self, args: ServerArgs, books: MemoryBooks, decode_tail: Callable[[list[int]], str]):
        self.args = args
        self.books = books
        self.decode_tail = decode_tail
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # DECODE status, in admission order
        self.chunked: Req | None = None
        self.paused = False
        self.step_id = 0
        self.released_slots: list[int] = []
        self.ratio = NewTokenRatio(args.new_token_ratio_init, args.new_token_ratio_min,
                                   (args.new_token_ratio_init - args.new_token_ratio_min) / max(1, args.new_token_ratio_decay_steps))  # fmt: skip
        self.num_retracted = 0
        self.by_rid: dict[str, Req] = {}
        self._arrivals = 0

    # ---- inputs ---------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        if req.rid in self.by_rid:
            raise ValueError(f"rid {req.rid!r} is already in use by a live request")
        req.arrival = self._arrivals
        self._arrivals += 1
        self.by_rid[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str | None, message: str = "aborted by request") -> list[ReqOutput]:
        """Abort one request (or all when rid is None); returns their final outputs."""
        victims = (
            list(self.by_rid.values())
            if rid is None
            else [r for r in [self.by_rid.get(rid)] if r is not None]
        )
        return [self._finish(r, FinishReason("abort", message=message)) for r in victims]

    def retract_all(self) -> None:
        """pause_generation(mode="retract"): every admitted request gives its KV back."""
        for r in list(self.running) + ([self.chunked] if self.chunked else []):
            self._retract(r)
        self.chunked = None

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache and pools. Refused while any request holds KV; requests
        that wait without KV (e.g. retracted by a pause) do not block it."""
        holding = self.live()
        if holding:
            return (
                False,
                f"{len(holding)} requests hold KV ({len(self.running)} running); flush needs them finished or retracted",
            )
        self.books.flush()
        self.ratio.reset()
        return True, "cache flushed"

    @property
    def idle(self) -> bool:
        return not self.by_rid

    def live(self) -> list[Req]:
        return [r for r in self.by_rid.values() if r.slot >= 0]

    # ---- scheduling -----------------------------------------------------------------------
    def get_next_batch(self) -> ScheduledBatch | None:
        if self.paused:
            return None
        batch = self._prefill_batch()
        if batch is None and self.running:
            batch = self._decode_batch()
        if batch is not None:
            self.step_id += 1
            batch.step_id = self.step_id
            batch.released_slots, self.released_slots = self.released_slots, []
        return batch

    def _reserved_decode(self) -> float:
        left = sum(max(0, r.max_new_tokens - len(r.output_ids)) for r in self.running)
        return left * self.ratio.value

    def _prefill_batch(self) -> ScheduledBatch | None:
        a = self.args
        chunk = None if a.chunked_prefill_size == -1 else a.chunked_prefill_size
        adder = PrefillAdder(self.books, reserved_decode=self._reserved_decode(), max_prefill_tokens=a.max_prefill_tokens,
                             chunk_size=chunk, new_token_ratio=self.ratio.value)  # fmt: skip
        admitted: list[Req] = []
        if self.chunked is not None:
            self.books.cache_unfinished(self.chunked)
            if adder.add(self.chunked) is AddResult.CHUNKED:
                return self._build_prefill(adder, admitted)
        shared = InBatchPrefix(a.schedule_policy == "lpm")
        for req in order_waiting(a.schedule_policy, self.waiting, self.books):
            if (
                len(self.running) + len(adder.planned) >= a.max_running_requests
                or self.books.free_slots() == 0
            ):
                break
            if shared.defer(req, self.books.match_len(req)):
                continue
            if not self.books.admit(req):
                break
            result = adder.add(req)
            if result is AddResult.NO_TOKEN:
                self.books.release(req, None)
                req.slot, req.cached_len, req.committed_len = -1, 0, 0
                break
            admitted.append(req)
            if result is AddResult.CHUNKED:
                break
        if not adder.planned:
            return None
        return self._build_prefill(adder, admitted)

    def _build_prefill(self, adder: PrefillAdder, admitted: list[Req]) -> ScheduledBatch:
        new = {id(r) for r in admitted}
        rows: list[Row] = []
        for p in adder.planned:
            req = p.req
            prefix = self.books.pages(req).copy() if id(req) in new else None
            if id(req) in new and req.retractions == 0:
                req.cached_tokens = req.cached_len
            pages = self.books.alloc(req, p.extend_len)
            assert pages is not None, (
                f"prefill budget admitted {req.rid} but the pool refused {p.extend_len} tokens"
            )
            start = req.committed_len
            rows.append(
                Row(
                    req,
                    start,
                    p.extend_len,
                    req.fill_ids(start, start + p.extend_len),
                    pages,
                    prefix,
                    p.last_chunk,
                    req.retractions,
                )
            )
            req.committed_len += p.extend_len
            if id(req) in new:
                self.waiting.remove(req)
            if p.last_chunk:
                req.status = ReqStatus.DECODE
                self.running.append(req)
                if self.chunked is req:
                    self.chunked = None
            else:
                req.status = ReqStatus.PREFILL
                self.chunked = req
        if self.args.enable_mixed_chunk and self.running:
            planned = {id(p.req) for p in adder.planned}
            decoding = [r for r in self.running if id(r) not in planned]
            if decoding:
                rows += self._decode_rows(decoding)
        return ScheduledBatch(0, rows, [], is_decode=False)

    def _decode_batch(self) -> ScheduledBatch | None:
        rows = self._decode_rows(list(self.running), spare=self._retract_chunked)
        self.ratio.step()
        return ScheduledBatch(0, rows, [], is_decode=True) if rows else None

    def _retract_chunked(self) -> bool:
        """Free the KV of a half-prefilled request so that decoding can go on."""
        if self.chunked is None:
            return False
        self._retract(self.chunked)
        self.chunked = None
        return True

    def _decode_rows(self, reqs: list[Req], spare: Callable[[], bool] | None = None) -> list[Row]:
        grants, retracted = prepare_decode(self.books, reqs, spare, defer_last=spare is None)
        for r in retracted:
            self._requeue_retracted(r)
        if retracted:
            self.ratio.after_retract(self.running)
        rows = []
        for r in reqs:
            if id(r) in grants:
                rows.append(Row(r, r.committed_len, 1, None, grants[id(r)], None, True, r.retractions))
                r.committed_len += 1
        return rows

    # ---- results --------------------------------------------------------------------------
    def process_result(self, batch: ScheduledBatch, result: StepResult) -> list[ReqOutput]:
        assert result.step_id == batch.step_id, f"result of step {result.step_id} for batch {batch.step_id}"
        outs: list[ReqOutput] = []
        for i, row in enumerate(batch.rows):
            req = row.req
            if req.finished or row.epoch != req.retractions or not row.sample:
                continue  # overshoot of a finished/retracted request, or a middle chunk
            if req.status is ReqStatus.DECODE and row.token_ids is not None and not req.output_ids:
                self.books.cache_unfinished(req)  # prompt done: share it with later requests
            if req.max_new_tokens == 0:  # prefill only (e.g. to warm the prefix cache)
                outs.append(self._finish(req, FinishReason("length")))
                continue
            req.output_ids.append(int(result.tokens[i]))
            if req.return_logprob and result.logprobs is not None:
                req.output_logprobs.append(float(result.logprobs[i]))
                if req.top_logprobs_num and result.top_ids is not None and result.top_logprobs is not None:
                    n = req.top_logprobs_num
                    req.output_top_logprobs.append(
                        list(
                            zip(
                                result.top_logprobs[i, :n].tolist(),
                                result.top_ids[i, :n].tolist(),
                                strict=True,
                            )
                        )
                    )
            req.check_finished(self.decode_tail)
            if req.finished:
                outs.append(self._finish(req, req.finish_reason))
            else:
                outs.append(self._output(req, False))
        return outs

    def _output(self, req: Req, finished: bool) -> ReqOutput:
        new = req.output_ids[req.sent_len :]
        req.sent_len = len(req.output_ids)
        return ReqOutput(req, new, finished)

    def _finish(self, req: Req, reason: FinishReason | None) -> ReqOutput:
        req.finish_reason = reason
        if req.slot >= 0:
            # KV is valid for every token but the last sampled one (never fed back), and never
            # past what was scheduled (a batch still in flight writes it before any later batch
            # can read it); overshoot beyond that is freed page-aligned. Aborted requests keep
            # their prefix cached too: an RL partial rollout resubmits prompt + produced.
            keep = min(req.fill_len - 1, req.committed_len)
            self.released_slots.append(req.slot)
            self.books.release(req, keep)
            req.slot = -1
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None
        req.status = ReqStatus.FINISHED
        self.by_rid.pop(req.rid, None)
        return self._output(req, True)

    def _retract(self, req: Req) -> None:
        self.released_slots.append(req.slot)
        self.books.release(req, None)
        if req in self.running:
            self.running.remove(req)
        self._requeue_retracted(req, released=True)

    def _requeue_retracted(self, req: Req, released: bool = False) -> None:
        if not released:
            self.released_slots.append(req.slot)
            if req in self.running:
                self.running.remove(req)
        req.reset_for_retract()
        self.num_retracted += 1
        self.waiting.insert(0, req)

    def check_idle(self) -> None:
        """Called whenever nothing runs: integrity of the KV books, ratio reset."""
        self.ratio.reset()
        self.books.check_integrity(self.live())

    def info(self) -> dict:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "chunked": self.chunked.rid if self.chunked else None,
            "paused": self.paused,
            "available_tokens": self.books.available_tokens(),
            "new_token_ratio": round(self.ratio.value, 4),
            "num_retracted": self.num_retracted,
            "step": self.step_id,
        }


def token_array(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, np.int32)
