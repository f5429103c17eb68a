"""A deterministic fake runner whose outputs can be worked out by hand (JetStream's habit).

It keeps a real paged "KV cache": a dict location -> the token id written there. Sampling
reads the request's context back THROUGH ITS PAGE TABLE, so a wrong page, a wrong prefix
grant, a wrong position or a stale future token changes the output: comparing against
`reference()` (the same function applied to the true token sequence) checks the scheduler's
memory books end to end.

A row that wants prompt logprobs (`Row.logprob_span`) gets `fake_logprob` of each wanted
position: a function of the context read back through the page table and the next prompt
token, so `prompt_reference` checks which positions were computed, and over what KV.

A row with grammar masks samples within them (`within`: the model's token if allowed, else an
allowed one picked by it), and its drafts must each be allowed by the mask before them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ringserve.actors.scheduler.batch import ScheduledBatch, StepResult


def next_token(context: list[int], vocab: int) -> int:
    """The fake model: depends on the last 4 tokens and the length (never token 0..3)."""
    tail = context[-4:]
    h = len(context) * 1_000_003
    for i, t in enumerate(tail):
        h = (h * 31 + (i + 7) * t) % 2_147_483_647
    return 4 + h % (vocab - 4)


def fake_logprob(context: list[int], target: int, vocab: int) -> float:
    """The fake model's "logprob" of `target` after `context` (exact in float32)."""
    return -float((next_token(context, vocab) * 7 + target) % 997) / 8


def prompt_reference(prompt: list[int], start: int, vocab: int) -> list[float]:
    """The prompt logprobs the scheduler should report from `start`: positions [start, len - 1)."""
    return [fake_logprob(prompt[: p + 1], prompt[p + 1], vocab) for p in range(start, len(prompt) - 1)]


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


def within(mask: np.ndarray, t: int) -> int:
    """Token t if the packed mask (bit t % 32 of word t // 32) allows it, else the allowed token
    at t modulo their count."""
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
    return t if t in allowed else int(allowed[t % len(allowed)])


@dataclasses.dataclass
class SlotMirror:
    pages: list[int]
    committed: int  # -1 after a verify round: known on the device only


class FakeRunner:
    """Plays every row as the device does (model/runtime/step.py), one path: FUTURE(slot) inputs read
    the slot's last sample, a row samples its last 1 + drafts positions, a verify round starts
    at the slot's FutureMap position (its committed_len is the scheduler's bound) and accepts its
    leading drafts equal to their targets; the FutureMap moves past what was accepted. A
    multi-step batch's rows run 1 + drafts decode steps from their exact lengths."""

    def __init__(self, page_size: int, vocab: int = 1000, model=None):
        self.page = page_size
        self.vocab = vocab
        self.model = model or next_token
        self.kv: dict[int, int] = {}
        self.slots: dict[int, SlotMirror] = {}
        self.future: dict[int, int] = {}
        self.future_pos: dict[int, int] = {}  # positions with valid KV per slot (device-resolved)
        self.log: list[list[tuple[int, int]]] = []  # per step: (slot, extend_len) rows
        self.spans: list[tuple[str, int, int]] = []  # (rid, first, count) of every prompt span computed

    def loc(self, m: SlotMirror, pos: int) -> int:
        page = m.pages[pos // self.page]
        assert page != 0, "page 0 is the sink and must never hold a request's KV"
        return page * self.page + pos % self.page

    def run(self, batch: ScheduledBatch) -> StepResult:
        for s in batch.released_slots:
            self.slots.pop(s, None)
        self.log.append([(r.slot, r.extend_len) for r in batch.rows])
        k1 = 1 + batch.drafts
        toks = np.zeros((len(batch.rows), k1), np.int32)
        positions: list[float] = []  # prompt positions' logprobs, the rows' spans in order
        accepted = np.zeros(len(batch.rows), np.int32)
        for i, row in enumerate(batch.rows):
            if row.prefix_pages is not None:
                assert row.slot not in self.slots, f"slot {row.slot} reused before its release was sent"
                self.slots[row.slot] = SlotMirror(list(row.prefix_pages), row.committed_len)
            m = self.slots[row.slot]
            m.pages += [int(p) for p in row.new_pages]
            if batch.multistep:  # k1 decode steps from the exact length, each sample the next input
                assert m.committed == row.committed_len, (row.slot, m.committed, row.committed_len)
                t = self.future[row.slot]
                for j in range(k1):
                    self.kv[self.loc(m, row.committed_len + j)] = t
                    t = toks[i, j] = self.model([self.kv[self.loc(m, p)] for p in range(row.committed_len + j + 1)],
                                                self.vocab)  # fmt: skip
                m.committed = row.committed_len + k1
                accepted[i] = k1 - 1
                self.future[row.slot], self.future_pos[row.slot] = t, m.committed
                continue
            if row.drafts:  # a bound: the device starts where the FutureMap says
                base, m.committed = self.future_pos[row.slot], -1
            else:
                assert m.committed in (-1, row.committed_len), (row.slot, m.committed, row.committed_len)
                base = row.committed_len
            ids = [self.future[row.slot] if t < 0 and j == 0 else int(t) for j, t in enumerate(row.token_ids)]
            for j, t in enumerate(ids):
                self.kv[self.loc(m, base + j)] = t
            end = base + len(ids)
            if not row.drafts:
                m.committed = end
            if row.logprob_span is not None:  # prompt positions: context through the page table
                first, n = row.logprob_span
                assert base <= first and first + n <= end, f"span {row.logprob_span} outside the row [{base}, {end})"
                self.spans.append((row.req.rid, first, n))
                for p in range(first, first + n):
                    ctx = [self.kv[self.loc(m, q)] for q in range(p + 1)]
                    positions.append(fake_logprob(ctx, int(row.req.fill_ids(p + 1, p + 2)[0]), self.vocab))
            for j in range(k1):  # the last k1 positions are sampled
                ctx = [self.kv[self.loc(m, p)] for p in range(end - k1 + j + 1)]
                toks[i, j] = self.model(ctx, self.vocab)
                if row.mask is not None:
                    toks[i, j] = within(row.mask[j], int(toks[i, j]))
                    draft = row.token_ids[1 + j] if j < row.drafts else -1
                    assert draft < 0 or within(row.mask[j], int(draft)) == draft, f"draft {draft} outside the grammar"
            a = 0
            while a < row.drafts and row.token_ids[1 + a] == toks[i, a]:
                a += 1
            accepted[i] = a
            if row.sample:
                self.future[row.slot] = int(toks[i, a])
                self.future_pos[row.slot] = end - row.drafts + a
        flat = toks.ravel()
        result = StepResult(batch.step_id, flat, logprobs=-np.arange(len(flat), dtype=np.float32),
                            accepted=accepted if batch.drafts else None)  # fmt: skip
        if positions:
            result.input_logprobs = np.asarray(positions, np.float32)
        return result
