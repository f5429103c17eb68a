"""A request as the scheduler sees it: status, token lengths, stop conditions.

Lengths (the project's one vocabulary, same as kvmem/):

    fill_ids = origin_ids + output_ids
    [ cached (tree prefix) | computed this turn ........ | next extend ..... ]
    0                cached_len                   committed_len        len(fill_ids)
                           KV written for [0, committed_len); KV reserved for [0, allocated_len)

- origin_len: prompt tokens; finished_len: output tokens kept at finish.
- extend_len of a step: tokens computed in it (the whole remainder, or one chunk of it).
- A decode step has extend_len 1: its input is the last sampled token, which the runner reads
  from its future buffer (`-(slot + 1)`), so the scheduler never waits for it.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from actors.detokenizer.incremental import find_stop
from actors.frontend.sampling_params import SamplingParams


class ReqStatus(enum.IntEnum):
    WAITING = 0  # queued (new, or retracted: its KV was freed and it will be prefilled again)
    PREFILL = 1  # running its extend, possibly over several chunks
    DECODE = 2  # in the running batch, one token per step
    FINISHED = 3


@dataclasses.dataclass(slots=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string
    message: str | None = None  # abort reason

    def to_dict(self) -> dict:
        d: dict = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        return d


@dataclasses.dataclass(slots=True, eq=False)
class Req:
    rid: str
    origin_ids: np.ndarray  # int32 prompt
    sampling: SamplingParams
    seed: int  # sampling seed actually used (request's or the server default)
    eos_ids: frozenset[int] = frozenset()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    arrival: int = 0  # admission order (fcfs tiebreak)

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    slot: int = -1
    cached_len: int = 0  # prefix granted by the radix tree at admission (this turn)
    cached_tokens: int = 0  # cached_len of the first admission (reported to the user)
    committed_len: int = 0  # KV written
    finish_reason: FinishReason | None = None
    retractions: int = 0
    # tokens sent to the detokenizer so far (the scheduler streams only new ones)
    sent_len: int = 0
    kv: object = None  # kvmem's per-request record (owned by the memory books)

    @property
    def origin_len(self) -> int:
        return len(self.origin_ids)

    @property
    def fill_len(self) -> int:
        return self.origin_len + len(self.output_ids)

    @property
    def remaining_extend(self) -> int:
        """Tokens whose KV is not written yet (the whole prompt on admission; 1 while decoding)."""
        return self.fill_len - self.committed_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    def fill_ids(self, start: int, stop: int) -> np.ndarray:
        """Token ids [start, stop) of origin + output, as int32."""
        o = self.origin_len
        if stop <= o:
            return self.origin_ids[start:stop]
        out = np.asarray(self.output_ids, np.int32)
        if start >= o:
            return out[start - o : stop - o]
        return np.concatenate([self.origin_ids[start:], out[: stop - o]])

    def check_finished(self, decode_tail) -> None:
        """Set finish_reason after a new token was appended (EOS, stop ids, length, stop strings).

        `decode_tail(ids) -> str` decodes token ids; called only when stop strings are set."""
        if self.finished:
            return
        last = self.output_ids[-1]
        sp = self.sampling
        if not sp.ignore_eos and last in self.eos_ids:
            self.finish_reason = FinishReason("stop", matched=last)
        elif last in sp.stop_token_ids:
            self.finish_reason = FinishReason("stop", matched=last)
        elif sp.stop:
            # Every token is checked as it arrives, so a stop string can only newly end inside
            # the last token: decoding a tail that can hold the longest stop string suffices
            # (a character is at most 4 byte-level tokens).
            tail = decode_tail(self.output_ids[-(4 * max(len(x) for x in sp.stop) + 4) :])
            hit = find_stop(tail, sp.stop)
            if hit is not None:
                self.finish_reason = FinishReason("stop", matched=hit[1])
        if not self.finished and len(self.output_ids) >= sp.max_new_tokens:
            self.finish_reason = FinishReason("length")

    def reset_for_retract(self) -> None:
        """Back to WAITING: KV is gone; the output so far is kept and will be re-prefilled."""
        self.status = ReqStatus.WAITING
        self.slot = -1
        self.cached_len = 0
        self.committed_len = 0
        self.kv = None
        self.retractions += 1
