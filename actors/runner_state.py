"""The runner's mirror of every live slot, rebuilt from the scheduler's incremental messages.

Per slot the runner keeps what the scheduler stops sending after a request's first step:
its page table (grown by `new_pages`), its committed length (advanced by each step's
extend_len) and its sampling parameters. A step message then only names the slot, the new
tokens (or none for decode: the model reads `future[slot]`) and any new pages, and the mirror
turns it into the `model.batch.Segment`s the executor runs. Messages are applied in order;
a mismatch between the scheduler's committed length and the mirror's is a protocol bug and
fails loudly.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from model.batch import SamplingParams, Segment


@dataclasses.dataclass(slots=True)
class RunnerRow:
    slot: int
    committed_len: int
    extend_len: int
    token_ids: np.ndarray | None  # None: decode, input is future[slot]
    new_pages: np.ndarray
    prefix_pages: np.ndarray | None = None  # set when the slot (re)starts
    sampling: SamplingParams | None = None  # set when the slot (re)starts
    sample: bool = True


@dataclasses.dataclass(slots=True)
class _Slot:
    pages: np.ndarray
    committed: int
    sampling: SamplingParams


class SlotMirrors:
    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.slots: dict[int, _Slot] = {}

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self.slots.pop(s, None)

    def apply(self, rows: list[RunnerRow]) -> list[Segment]:
        segs = []
        for r in rows:
            if r.prefix_pages is not None:
                if r.sampling is None:
                    raise ValueError(f"slot {r.slot}: a starting slot must carry its sampling params")
                self.slots[r.slot] = _Slot(np.asarray(r.prefix_pages, np.int32), r.committed_len, r.sampling)
            s = self.slots.get(r.slot)
            if s is None:
                raise ValueError(f"slot {r.slot} is not live on this runner (message out of order?)")
            if s.committed != r.committed_len:
                raise ValueError(f"slot {r.slot}: scheduler says committed_len={r.committed_len}, runner has {s.committed}")
            if len(r.new_pages):
                s.pages = np.concatenate([s.pages, np.asarray(r.new_pages, np.int32)])
            ids = r.token_ids if r.token_ids is not None else np.array([-(r.slot + 1)], np.int32)
            segs.append(Segment(ids, s.committed, s.pages, s.sampling, future_slot=r.slot if r.sample else -1))
            s.committed += r.extend_len
        return segs
