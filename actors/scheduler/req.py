"""A request as the scheduler sees it: status, tokens, stop conditions.

Lengths (the project's one vocabulary, DESIGN.md; the same names in kvmem/ and model/):

    fill_ids = origin_ids + output_ids
    [ cached (tree prefix) | computed this turn ........ | next extend ..... ]
    0                cached_len                   committed_len        fill_len
                           KV written for [0, committed_len); KV reserved for [0, allocated_len)

- origin_len: prompt tokens; finished_len: output tokens kept at finish.
- extend_len of a step: tokens computed in it (the whole remainder, or one chunk of it).
- A decode step has extend_len 1: its input is the last sampled token, which the runner reads
  from its future buffer (`-(slot + 1)`), so the scheduler never waits for it.

The KV lengths and the request slot have one owner, kvmem's `ReqKV` in `req.kv` (None while
the request holds no KV: waiting, retracted or finished); here they are read-only properties.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import numpy as np

from ringserve.actors.scheduler.grammar import ReqGrammar
from ringserve.actors.scheduler.logprobs import PromptLogprobs
from ringserve.actors.scheduler.lora import LoadedLora
from ringserve.actors.scheduler.spec import SpecState
from ringserve.actors.scheduler.tape import PositionTape
from ringserve.actors.transport.messages import Resume
from ringserve.actors.transport.sampling import SamplingParams, find_stop
from ringserve.kvmem import ReqKV


class ReqStatus(enum.IntEnum):
    WAITING = 0  # queued without KV (new, or retracted: it will be prefilled again)
    RUNNING = 1  # holds KV: its extend is being scheduled in chunks (the scheduler's one
    # `chunked` request) or wholly scheduled (the running batch: it decodes)
    FINISHED = 2


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
    sampling: SamplingParams  # sampling_seed set (the frontend draws one when none is given)
    eos_ids: frozenset[int] = frozenset()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: np.ndarray | None = None  # int32: report these tokens' logprobs at every position
    stream: bool = False  # the caller streams: an output every stream_interval tokens
    session_id: str | None = None  # a streaming session's turn: its slot is kept for the next turn
    arrival: int = 0  # admission order (fcfs tiebreak)

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # the logprobs of the output tokens produced here (a resumed request's earlier ones are its
    # caller's): the last len(output_logprobs) output tokens'
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    output_ids_logprobs: list[list[float]] = dataclasses.field(default_factory=list)  # token_ids_logprob
    prompt_lp: PromptLogprobs | None = None  # prompt logprobs asked (actors/scheduler/logprobs.py)
    kv: ReqKV | None = None  # kvmem's record while the request holds KV
    cached_tokens: int = 0  # cached_len of the first admission (reported to the user)
    finish_reason: FinishReason | None = None
    retractions: int = 0
    sent_len: int = 0  # output tokens sent to the detokenizer so far (only new ones are sent)
    opened: bool = False  # its first output (which opens its detokenizer stream) was built
    first_token_at: float = 0.0  # time.perf_counter() when its first token was processed
    weight_spans: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (version, first output index)
    spec: SpecState | None = None  # speculative decoding's state (actors/scheduler/spec.py), when on
    grammar: ReqGrammar | None = None  # its output constraint's matcher (actors/scheduler/grammar.py)
    resumed: Resume | None = None  # resubmitted after a restart: output_ids began as resumed.output_ids
    lora: LoadedLora | None = None  # its LoRA adapter (actors/scheduler/lora.py); None: the base model
    cache_salt: str | None = None  # its prefix cache namespace's salt (vLLM's; None: the common one)
    # what its steps read back per position (actors/scheduler/tape.py), when asked: the last
    # hidden states (f32 [n, H]) from position 0; the routed experts ([n, M, k]) from
    # routed_experts_start_len
    hidden: PositionTape | None = None
    routed: PositionTape | None = None
    kept: list[np.ndarray] = dataclasses.field(default_factory=list)  # return_top_p_token_ids: each output's set

    def continuing(self, resume: Resume) -> Req:
        """This request (new, from the wire) taking up the output its caller already has, as a
        retracted request does: those tokens are prefilled again and never sent again."""
        assert self.status is ReqStatus.WAITING and not self.output_ids, self.rid
        self.resumed = resume
        self.output_ids = np.frombuffer(resume.output_ids, "<i4").tolist()
        self.sent_len = len(self.output_ids)
        self.cached_tokens = resume.cached_tokens
        self.weight_spans = list(resume.weight_spans)
        return self

    # ---- KV (read from kvmem's record) --------------------------------------------------------
    @property
    def slot(self) -> int:
        """The request slot, -1 while the request holds no KV."""
        return self.kv.slot if self.kv is not None else -1

    @property
    def cached_len(self) -> int:
        return self.kv.cached_len if self.kv is not None else 0

    @property
    def committed_len(self) -> int:
        return self.kv.committed_len if self.kv is not None else 0

    # ---- tokens -----------------------------------------------------------------------------
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
        return self.status is ReqStatus.FINISHED

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

    @property
    def weight_version(self) -> str:
        """The weights that produced the newest output token ("" before the first)."""
        return self.weight_spans[-1][0] if self.weight_spans else ""

    @property
    def return_hidden_states(self) -> bool:
        return self.hidden is not None

    @property
    def return_routed_experts(self) -> bool:
        return self.routed is not None

    def prefix_ids(self) -> np.ndarray:
        """What the prefix cache may grant: every token but the last (one is always computed),
        and none of the prompt positions whose logprobs, hidden states or routed experts are
        still wanted."""
        cap = self.fill_len - 1
        lp_cap = self.prompt_lp.cap() if self.prompt_lp is not None else None
        if lp_cap is not None:
            cap = min(cap, lp_cap)
        for tape in (self.hidden, self.routed):
            if tape is not None:
                cap = min(cap, tape.end)
        return self.fill_ids(0, cap)

    def stop_reason(self, decode_tail: Callable[[list[int]], str]) -> FinishReason | None:
        """Why the request finishes after its newest token (EOS, stop ids, its grammar stopped
        or failed, stop strings, length), or None. `decode_tail(ids) -> str` is called only
        when stop strings are set."""
        last = self.output_ids[-1]
        sp = self.sampling
        early = len(self.output_ids) < sp.min_new_tokens  # (stop ids come only when nothing else may: a grammar)
        if not sp.ignore_eos and last in self.eos_ids:
            return FinishReason("stop", matched=last)
        if last in sp.stop_token_ids:
            return FinishReason("stop", matched=last)
        if self.grammar is not None:
            error = self.grammar.error
            if error is not None:
                return FinishReason("abort", message=error)
            if self.grammar.terminated:  # nothing but EOS can follow
                return FinishReason("stop", matched=last)
        if sp.stop and not early:  # (vLLM's min_tokens: no stop string before them)
            # Every token is checked as it arrives, so a stop string can only newly end inside
            # the last token: decoding a tail that can hold the longest stop string suffices
            # (a character is at most 4 byte-level tokens).
            tail = decode_tail(self.output_ids[-(4 * max(len(x) for x in sp.stop) + 4) :])
            hit = find_stop(tail, sp.stop)
            if hit is not None:
                return FinishReason("stop", matched=hit[1])
        if len(self.output_ids) >= sp.max_new_tokens:
            return FinishReason("length")
        return None
