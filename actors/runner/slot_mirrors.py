"""The runner's mirror of every live slot, rebuilt from the scheduler's incremental StepMsgs.

Per slot the runner keeps what the scheduler stops sending after a request's first step:
its page table (grown by appended pages), its committed length (advanced by each step's
extend_len) and its sampling parameters. A step message then only names the slot, the new
tokens (none for decode: the model reads `future[slot]`, the token the slot sampled last) and
any new page, and the mirror turns it into the `model.step_inputs.DeviceRow`s the executor runs.

Messages are applied in order: released slots first, then rows. A mismatch between the
scheduler's committed length and the mirror's is a protocol bug and fails loudly.

A verify round (speculative decoding) leaves the slot's length known on the device only (the
FutureMap's position: how many drafts were accepted is decided there). The mirror then marks
it UNKNOWN and takes the scheduler's length at the slot's next extend row (a session's next turn).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actors.transport.messages import StepMsg, VerifyRounds, as_i32
from model.step_inputs import DeviceRow, DeviceSampling

UNKNOWN = -1  # committed_len after a verify round: the device's FutureMap holds it


@dataclasses.dataclass(slots=True)
class _Slot:
    pages: np.ndarray  # int32 page table; append-only while the slot lives
    committed_len: int  # KV tokens written (after the steps applied so far)
    sampling: DeviceSampling


class SlotMirrors:
    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.slots: dict[int, _Slot] = {}

    def _get(self, slot: int, committed: int) -> _Slot:
        s = self.slots.get(slot)
        if s is None:
            raise ValueError(f"slot {slot} is not live on this runner (message out of order?)")
        if s.committed_len == UNKNOWN:
            s.committed_len = committed
        elif s.committed_len != committed:
            raise ValueError(
                f"slot {slot}: scheduler says committed_len={committed}, runner has {s.committed_len}"
            )
        return s

    def apply(self, msg: StepMsg) -> list[DeviceRow]:
        """The step's rows as the device runs them, in result-row order (extend, then decode or
        verify rounds)."""
        for slot in as_i32(msg.released).tolist():
            self.slots.pop(slot, None)
        rows = []
        for r in msg.extend:
            if r.start is not None:
                if not 0 <= r.slot < self.max_slots:
                    raise ValueError(f"slot {r.slot} outside [0, {self.max_slots})")
                self.slots[r.slot] = _Slot(as_i32(r.start.prefix_pages).copy(), r.committed_len, r.start.sampling)
            s = self._get(r.slot, r.committed_len)
            if r.new_pages:
                s.pages = np.concatenate([s.pages, as_i32(r.new_pages)])
            ids = as_i32(r.token_ids)
            rows.append(
                DeviceRow(ids, s.committed_len, s.pages, s.sampling, future_slot=r.slot if r.sample else -1)
            )
            s.committed_len += len(ids)
        if msg.decode_slots:
            for slot, committed, page in zip(as_i32(msg.decode_slots).tolist(), as_i32(msg.decode_committed).tolist(),
                                             as_i32(msg.decode_new_page).tolist(), strict=True):  # fmt: skip
                s = self._get(slot, committed)
                if page >= 0:
                    s.pages = np.append(s.pages, np.int32(page))
                rows.append(
                    DeviceRow(
                        np.array([-(slot + 1)], np.int32), s.committed_len, s.pages, s.sampling, future_slot=slot
                    )
                )
                s.committed_len += 1
        if msg.verify is not None:
            rows += self._verify_rows(msg.verify)
        return rows

    def _verify_rows(self, v: VerifyRounds) -> list[DeviceRow]:
        """Round g: the slot's last token (future) and its k drafts (NO_DRAFT = -1 pads, which
        the device reads as a token it never accepts), at the scheduler's bound on its length."""
        slots, bounds = as_i32(v.slots), as_i32(v.committed)
        drafts = as_i32(v.drafts).reshape(len(slots), -1)
        counts, pages = as_i32(v.page_counts), as_i32(v.pages)
        ends = np.cumsum(counts)
        rows = []
        for g, slot in enumerate(slots.tolist()):
            s = self.slots.get(slot)
            if s is None:
                raise ValueError(f"slot {slot} is not live on this runner (message out of order?)")
            if counts[g]:
                s.pages = np.concatenate([s.pages, pages[ends[g] - counts[g] : ends[g]]])
            ids = np.concatenate([np.array([-(slot + 1)], np.int32), drafts[g]])
            rows.append(DeviceRow(ids, int(bounds[g]), s.pages, s.sampling, future_slot=slot))
            s.committed_len = UNKNOWN
        return rows
