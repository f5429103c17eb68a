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


def reference(prompt: list[int], n: int, vocab: int, eos: int | None = None) -> list[int]:
    ctx = list(prompt)
    out: list[int] = []
    for _ in range(n):
        t = next_token(ctx, vocab)
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
    def __init__(self, page_size: int, vocab: int = 1000):
        self.page = page_size
        self.vocab = vocab
        self.kv: dict[int, int] = {}
        self.slots: dict[int, SlotMirror] = {}
        self.future: dict[int, int] = {}
        self.log: list[list[tuple[int, int]]] = []  # per step: (slot, extend_len) rows

    def loc(self, m: SlotMirror, pos: int) -> int:
        page = m.pages[pos // self.page]
        assert page != 0, "page 0 is the sink and must never hold a request's KV"
        return page * self.page + pos % self.page

    def run(self, batch: ScheduledBatch) -> StepResult:
        for s in batch.released_slots:
            self.slots.pop(s, None)
        toks = np.zeros(len(batch.rows), np.int32)
        self.log.append([(r.slot, r.extend_len) for r in batch.rows])
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
                toks[i] = next_token(ctx, self.vocab)
                self.future[row.slot] = int(toks[i])
        return StepResult(batch.step_id, toks, logprobs=-np.arange(len(toks), dtype=np.float32))
