"""What the scheduler hands the runner for one step: rows of (request, work), incrementally.

One row model: a `Row` is one request's work in one step, whatever its kind (on the wire one
columnar StepMsg row, on the device a `DeviceRow`):

    extend row    the next span of the request's known tokens (a prompt, or a chunk of it)
    decode row    one token, FUTURE(slot): the token the request sampled last, which the
                  runner reads from its FutureMap on device (the scheduler never waits for it)
    verify round  FUTURE(slot) + k drafts (speculative decoding): every position sampled, the
                  leading drafts equal to their targets accepted on device

The runner mirrors every live request slot (its page table and committed length), so a row
carries only what the runner cannot know yet:

    new slot   : the slot, the pages of its cached prefix, its sampling params   (once)
    every row  : slot, committed_len, tokens, pages newly appended to the slot's table
    constrained: the grammar's masks of its sampled positions (actors/scheduler/grammar.py)
    prompt logprobs: the positions of the row whose logprobs are wanted (actors/scheduler/logprobs.py)
    batch      : slots released since the previous batch

so a decode step costs a fixed number of bytes per row, whatever the context length.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ringserve.actors.scheduler.req import Req

_NO_PAGES = np.zeros(0, np.int32)


def future(slot: int) -> int:
    """The input id that reads `slot`'s last sampled token from the runner's FutureMap."""
    return -(slot + 1)


@dataclasses.dataclass(slots=True)
class Row:
    req: Req
    committed_len: int  # KV tokens written before this step = position of the first new token
    # (a verify round: the scheduler's bound, its rounds in flight counted as all accepted)
    token_ids: np.ndarray  # int32 [extend_len]; FUTURE(slot) first in decode rows and verify rounds
    sample: bool  # this step ends the request's extend (or decodes): its sampled token is kept
    retractions: int  # req.retractions when scheduled: a result for an older one is dropped
    new_pages: np.ndarray = dataclasses.field(default_factory=lambda: _NO_PAGES)  # int32 pages appended this step
    prefix_pages: np.ndarray | None = None  # int32 whole table at (re)admission, else None
    new_local: np.ndarray = dataclasses.field(default_factory=lambda: _NO_PAGES)  # int32 local pages appended (kvmem/local.py)
    prefix_local: np.ndarray = dataclasses.field(default_factory=lambda: _NO_PAGES)  # int32 local table at (re)admission
    drafts: int = 0  # a verify round: the k tokens after FUTURE(slot) are drafts (NO_DRAFT pads)
    mask: np.ndarray | None = None  # a grammar's [1 + drafts, W] int32 allowed tokens per sampled position
    logprob_span: tuple[int, int] | None = None  # (first position, count) of prompt logprobs this row computes

    @classmethod
    def extend(cls, req: Req, extend_len: int, *, last_chunk: bool) -> Row:
        """The next `extend_len` tokens of `req` past its committed_len (pages set when reserved),
        and the prompt positions among them whose logprobs the request wants."""
        start = req.committed_len
        span = req.prompt_lp.span(start, extend_len) if req.prompt_lp is not None else None
        return cls(req, start, req.fill_ids(start, start + extend_len), last_chunk, req.retractions, logprob_span=span)

    @classmethod
    def decode(cls, req: Req, new_pages: np.ndarray, drafts: np.ndarray | None = None) -> Row:
        """The request's next token, read from the FutureMap; with `drafts` (int32 [k]) a verify
        round of k + 1 positions from wherever the device's FutureMap says the request is (a
        multi-step decode: k NO_DRAFT places, k + 1 steps from the request's exact length)."""
        k = 0 if drafts is None else len(drafts)
        ids = np.empty(1 + k, np.int32)
        ids[0] = future(req.slot)
        ids[1:] = drafts if drafts is not None else ()
        return cls(req, req.committed_len, ids, True, req.retractions, new_pages, drafts=k)

    @property
    def slot(self) -> int:
        return self.req.slot

    @property
    def extend_len(self) -> int:
        return len(self.token_ids)

    @property
    def reads_future(self) -> bool:
        """A decode row or verify round (its first token is the request's last sample)."""
        return bool(self.token_ids[0] < 0)


@dataclasses.dataclass(slots=True)
class ScheduledBatch:
    step_id: int
    rows: list[Row]
    released_slots: list[int]
    is_decode: bool
    multistep: bool = False  # the rows' 1 + drafts places are decode steps run one after another

    @property
    def reqs(self) -> list[Req]:
        return [r.req for r in self.rows]

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.rows)

    @property
    def drafts(self) -> int:
        """k when the batch's rows are verify rounds of 1 + k tokens (a verify step), else 0."""
        return self.rows[0].drafts if self.rows else 0

    @property
    def masked(self) -> bool:
        """Some row's samples are constrained by a grammar."""
        return any(r.mask is not None for r in self.rows)


@dataclasses.dataclass(slots=True)
class StepResult:
    """The runner's answer for one batch, rows in the batch's order."""

    step_id: int
    tokens: np.ndarray  # int32 [rows * (1 + drafts)], row after row
    logprobs: np.ndarray | None = None  # f32, one per token
    top_ids: np.ndarray | None = None  # int32 [tokens, N]
    top_logprobs: np.ndarray | None = None  # f32 [tokens, N]
    accepted: np.ndarray | None = None  # a verify batch: int32 [rows], drafts accepted per round
    ids_logprobs: np.ndarray | None = None  # f32 [tokens, K] token_ids_logprob
    input_logprobs: np.ndarray | None = None  # f32 [P] prompt positions, the batch's spans in row order
    input_top_ids: np.ndarray | None = None  # int32 [P, N]
    input_top_logprobs: np.ndarray | None = None  # f32 [P, N]
    input_ids_logprobs: np.ndarray | None = None  # f32 [P, K]
    kept_starts: np.ndarray | None = None  # int32 [tokens + 1]: sample j drew from kept_ids[ks[j] : ks[j + 1]]
    kept_ids: np.ndarray | None = None  # int32 (return_top_p_token_ids)
    hidden_starts: np.ndarray | None = None  # int32 [rows + 1]: row r's tokens' states hidden[hs[r] : hs[r + 1]]
    hidden: np.ndarray | None = None  # f32 [n, H] (return_hidden_states; rows that did not ask: none)
    routed_starts: np.ndarray | None = None  # int32 [rows + 1]: row r's tokens' ids routed[rs[r] : rs[r + 1]]
    routed: np.ndarray | None = None  # uint8 / int16 [n, M, k] (return_routed_experts; likewise)
