"""A deterministic fake runner whose outputs can be worked out by hand (JetStream's habit).

It keeps a real paged "KV cache": a dict location -> the token id written there. Sampling
reads the request's context back THROUGH ITS PAGE TABLE, so a wrong page, a wrong prefix
grant, a wrong position or a stale future token changes the output: comparing against
`reference()` (the same function applied to the true token sequence) checks the scheduler's
memory books end to end.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actors.scheduler.batch import ScheduledBatch, StepResult


def next_token(context: list[int], vocab: int) -> int:
    """The fake model: depends on the last 4 tokens and the length (never token 0..3)."""
    tail = context[-4:]
    h = len(context) * 1_000_003
    for i, t in enumerate(tail):
        h = (h * 31 + (i + 7) * t) % 2_147_483_647
    return 4 + h % (vocab - 4)


def copying(period: int, vocab: int, every: int = 0):
    """A fake model that repeats the token `period` back (so n-gram drafts are right), and
    every `every`-th position (0: never) says something else (so some drafts are rejected)."""

    def model(context: list[int], _vocab: int = vocab) -> int:
        if every and len(context) % every == 0:
            return next_token(context, vocab)
        return context[-period] if len(context) >= period else next_token(context, vocab)

    return model


def reference(prompt: list[int], n: int, vocab: int, eos: int | None = None, model=None) -> list[int]:
    model = model or next_token
    ctx = list(prompt)
    out: list[int] = []
    for _ in range(n):
        t = model(ctx, vocab)
        out.append(t)
        ctx.append(t)
        if t == eos:
            break
    return out


@dataclasses.dataclass
class SlotMirror:
    pages: list[int]
    committed: int


class FakeRunner:
    """Also plays a verify round (speculative decoding) as the device does: k + 1 positions from
    the slot's FutureMap position, a target per position, the leading drafts equal to their
    targets accepted, the FutureMap moved past them (see DESIGN.md)."""

    def __init__(self, page_size: int, vocab: int = 1000, model=None):
        self.page = page_size
        self.vocab = vocab
        self.model = model or next_token
        self.kv: dict[int, int] = {}
        self.slots: dict[int, SlotMirror] = {}
        self.future: dict[int, int] = {}
        self.future_pos: dict[int, int] = {}  # positions with valid KV per slot (device-resolved)
        self.log: list[list[tuple[int, int]]] = []  # per step: (slot, extend_len) rows

    def loc(self, m: SlotMirror, pos: int) -> int:
        page = m.pages[pos // self.page]
        assert page != 0, "page 0 is the sink and must never hold a request's KV"
        return page * self.page + pos % self.page

    def run(self, batch: ScheduledBatch) -> StepResult:
        for s in batch.released_slots:
            self.slots.pop(s, None)
        self.log.append([(r.slot, r.extend_len) for r in batch.rows])
        if batch.rows and batch.rows[0].is_verify:
            return self._verify(batch)
        toks = np.zeros(len(batch.rows), np.int32)
        for i, row in enumerate(batch.rows):
            if row.prefix_pages is not None:
                assert row.slot not in self.slots, f"slot {row.slot} reused before its release was sent"
                self.slots[row.slot] = SlotMirror(list(row.prefix_pages), row.committed_len)
            m = self.slots[row.slot]
            assert m.committed == row.committed_len, (row.slot, m.committed, row.committed_len)
            m.pages += [int(p) for p in row.new_pages]
            ids = [int(t) for t in row.token_ids] if row.token_ids is not None else [self.future[row.slot]]
            assert len(ids) == row.extend_len
            for j, t in enumerate(ids):
                self.kv[self.loc(m, m.committed + j)] = t
            m.committed += row.extend_len
            if row.sample:
                ctx = [self.kv[self.loc(m, p)] for p in range(m.committed)]
                toks[i] = self.model(ctx, self.vocab)
                self.future[row.slot] = int(toks[i])
                self.future_pos[row.slot] = m.committed
        return StepResult(batch.step_id, toks, logprobs=-np.arange(len(toks), dtype=np.float32))

    def _verify(self, batch: ScheduledBatch) -> StepResult:
        k = len(batch.rows[0].drafts)
        targets = np.zeros((len(batch.rows), k + 1), np.int32)
        accepted = np.zeros(len(batch.rows), np.int32)
        for g, row in enumerate(batch.rows):
            m = self.slots[row.slot]
            m.pages += [int(p) for p in row.new_pages]
            base = self.future_pos[row.slot]
            inputs = [self.future[row.slot]] + [int(d) for d in row.drafts]
            for j, t in enumerate(inputs):
                self.kv[self.loc(m, base + j)] = t
                ctx = [self.kv[self.loc(m, p)] for p in range(base + j + 1)]
                targets[g, j] = self.model(ctx, self.vocab)
            a = 0
            while a < k and row.drafts[a] == targets[g, a]:
                a += 1
            accepted[g] = a
            self.future[row.slot] = int(targets[g, a])
            self.future_pos[row.slot] = base + a + 1
            m.committed = -1  # known on the device only from now on
        flat = targets.ravel()
        return StepResult(batch.step_id, flat, logprobs=-np.arange(len(flat), dtype=np.float32), accepted=accepted)
