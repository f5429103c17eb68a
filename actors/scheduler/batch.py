"""What the scheduler hands the runner for one step: rows of (request, work), incrementally.

A `Row` is one request's work in one step (on the wire it becomes an `ExtendRow` or a decode
column, on the device a `DeviceRow`). The runner mirrors every live request slot (its page
table and committed length), so a row carries only what the runner cannot know yet:

    new slot   : the slot, the pages of its cached prefix, its sampling params   (once)
    every row  : slot, extend tokens (concrete ids, or none for decode: the runner reads
                 `future[slot]`), pages newly appended to the slot's table (usually none)
    batch      : slots released since the previous batch

so a decode step costs a fixed number of bytes per row, whatever the context length.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actors.scheduler.req import Req

_NO_PAGES = np.zeros(0, np.int32)


@dataclasses.dataclass(slots=True)
class Row:
    req: Req
    committed_len: int  # KV tokens written before this step = position of the first new token
    extend_len: int
    token_ids: np.ndarray | None  # int32 [extend_len]; None = decode (runner uses future[slot])
    sample: bool  # this step ends the request's extend (or decodes): its sampled token is kept
    epoch: int  # req.retractions when scheduled: a result for an older epoch is dropped
    new_pages: np.ndarray = dataclasses.field(default_factory=lambda: _NO_PAGES)  # int32 pages appended this step
    prefix_pages: np.ndarray | None = None  # int32 whole table at (re)admission, else None
    drafts: np.ndarray | None = None  # a verify round: int32 [k] drafts (NO_DRAFT pads), else None

    @classmethod
    def extend(cls, req: Req, extend_len: int, *, last_chunk: bool) -> Row:
        """The next `extend_len` tokens of `req` past its committed_len (pages set when reserved)."""
        start = req.committed_len
        return cls(req, start, extend_len, req.fill_ids(start, start + extend_len), last_chunk, req.retractions)

    @classmethod
    def decode(cls, req: Req, new_pages: np.ndarray) -> Row:
        return cls(req, req.committed_len, 1, None, True, req.retractions, new_pages)

    @classmethod
    def verify(cls, req: Req, drafts: np.ndarray, new_pages: np.ndarray) -> Row:
        """A speculative round: the last token (future buffer) and k drafts, k + 1 positions from
        wherever the device's FutureMap says the request is (committed_len is a bound here)."""
        return cls(req, req.committed_len, len(drafts) + 1, None, True, req.retractions, new_pages, drafts=drafts)

    @property
    def slot(self) -> int:
        return self.req.slot

    @property
    def is_decode(self) -> bool:
        return self.token_ids is None

    @property
    def is_verify(self) -> bool:
        return self.drafts is not None


@dataclasses.dataclass(slots=True)
class ScheduledBatch:
    step_id: int
    rows: list[Row]
    released_slots: list[int]
    is_decode: bool

    @property
    def reqs(self) -> list[Req]:
        return [r.req for r in self.rows]

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.rows)


@dataclasses.dataclass(slots=True)
class StepResult:
    """The runner's answer for one batch, rows in the batch's order."""

    step_id: int
    tokens: np.ndarray  # int32 [rows]; a verify batch: its targets [rounds * (k + 1)]
    logprobs: np.ndarray | None = None  # f32, one per token
    top_ids: np.ndarray | None = None  # int32 [tokens, N]
    top_logprobs: np.ndarray | None = None  # f32 [tokens, N]
    accepted: np.ndarray | None = None  # a verify batch: int32 [rounds], drafts accepted per round
