"""The runner's mirror of every live slot, rebuilt from the scheduler's incremental StepMsgs.

Per slot the runner keeps what the scheduler stops sending after a request's first step:
its page table (grown by appended pages), its committed length (advanced by each row's tokens),
its sampling parameters and its LoRA adapter's pool slot (and, where the sliding layers have their
own pages, its local page table: kvmem/local.py; the entries the scheduler dropped keep their ids). A step message then only names the slot, the row's tokens (a
decode row: FUTURE(slot), the token the slot sampled last, read on device) and any new pages,
and the mirror turns every row, whatever its kind, into a `model.step_inputs.DeviceRow` the
executor runs.

Messages are applied in order: released slots first, then started slots, then rows. A mismatch
between the scheduler's committed length and the mirror's is a protocol bug and fails loudly.

A row a grammar constrains also gets its masks (one per sampled position) from the message's
mask columns; every other row samples unmasked. A row that wants prompt logprobs gets its span
and targets from the lp columns; a slot keeps its request's token_ids_logprob.

A verify round (speculative decoding) leaves the slot's length known on the device only (the
FutureMap's position: how many drafts were accepted is decided there); its committed length is
the scheduler's bound. The mirror then marks the slot UNKNOWN and takes the scheduler's length
at the slot's next plain row (a session's next turn). A multi-step decode's rows are exact: each
advances the slot by its 1 + drafts tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ringserve.actors.transport.messages import StepMsg, as_i32, as_u8
from ringserve.model.compute.step_inputs import DeviceRow, DeviceSampling

UNKNOWN = -1  # committed_len after a verify round: the device's FutureMap holds it


@dataclasses.dataclass(slots=True)
class _Slot:
    pages: np.ndarray  # int32 page table; append-only while the slot lives
    local: np.ndarray | None  # int32 local page table (kvmem/local.py), the same length; None: no local space
    committed_len: int  # KV tokens written (after the steps applied so far)
    sampling: DeviceSampling
    logprob_ids: np.ndarray | None = None  # int32 token_ids_logprob
    lora_slot: int = 0  # the request's LoRA adapter slot (0: none)


class SlotMirrors:
    def __init__(self, max_slots: int, local_space: bool = False):
        self.max_slots = max_slots
        self.local_space = local_space  # the sliding layers have their own pages (kvmem/local.py)
        self.slots: dict[int, _Slot] = {}

    def apply(self, msg: StepMsg) -> list[DeviceRow]:
        """The step's rows as the device runs them, in result order."""
        for slot in as_i32(msg.released).tolist():
            self.slots.pop(slot, None)
        for st in msg.starts:
            if not 0 <= st.slot < self.max_slots:
                raise ValueError(f"slot {st.slot} outside [0, {self.max_slots})")
            ids = as_i32(st.logprob_ids).copy() if st.logprob_ids else None
            local = as_i32(st.prefix_local).copy() if self.local_space else None
            self.slots[st.slot] = _Slot(as_i32(st.prefix_pages).copy(), local, UNKNOWN, st.sampling, ids, st.lora_slot)
        slots, committed = as_i32(msg.slots), as_i32(msg.committed)
        counts, tokens = as_i32(msg.token_counts), as_i32(msg.tokens)
        page_counts, pages = as_i32(msg.page_counts), as_i32(msg.pages)
        local = as_i32(msg.local_pages)
        if self.local_space and len(local) != len(pages):
            raise ValueError(f"{len(local)} local pages for {len(pages)} pages appended")
        keep = as_u8(msg.keep)
        t_end, p_end = np.cumsum(counts).tolist(), np.cumsum(page_counts).tolist()
        masks = self._masks(msg, len(slots))
        spans = self._spans(msg, len(slots))
        rows = []
        for r, slot in enumerate(slots.tolist()):
            s = self.slots.get(slot)
            if s is None:
                raise ValueError(f"slot {slot} is not live on this runner (message out of order?)")
            c = int(committed[r])
            if msg.drafts and not msg.multistep:  # a bound; the device knows the true length from now on
                s.committed_len = UNKNOWN
            elif s.committed_len == UNKNOWN:
                s.committed_len = c
            elif s.committed_len != c:
                raise ValueError(f"slot {slot}: scheduler says committed_len={c}, runner has {s.committed_len}")
            if page_counts[r]:
                s.pages = np.concatenate([s.pages, pages[p_end[r] - page_counts[r] : p_end[r]]])
                if s.local is not None:
                    s.local = np.concatenate([s.local, local[p_end[r] - page_counts[r] : p_end[r]]])
            ids = tokens[t_end[r] - counts[r] : t_end[r]]
            lp_start, lp_targets = spans.get(r, (0, None))
            rows.append(DeviceRow(ids, c, s.pages, s.sampling, future_slot=slot if keep[r] else -1, mask=masks.get(r),
                                  logprob_start=lp_start, logprob_targets=lp_targets, logprob_ids=s.logprob_ids,
                                  lora_slot=s.lora_slot, local_pages=s.local))  # fmt: skip
            if s.committed_len != UNKNOWN:
                s.committed_len += len(ids)
        return rows

    @staticmethod
    def _spans(msg: StepMsg, n_rows: int) -> dict[int, tuple[int, np.ndarray]]:
        """row -> (first of its tokens, targets) of its wanted prompt logprobs (views into the
        message)."""
        pp = msg.prompt
        if pp is None:
            return {}
        rows, starts, counts, targets = as_i32(pp.rows), as_i32(pp.starts), as_i32(pp.counts), as_i32(pp.targets)
        if not len(rows) or len(starts) != len(rows) or len(counts) != len(rows) or int(counts.sum()) != len(targets):
            raise ValueError("prompt logprob columns disagree in length")
        if rows.min() < 0 or rows.max() >= n_rows:
            raise ValueError(f"prompt logprob rows {rows.tolist()} outside the step's {n_rows} rows")
        ends = np.cumsum(counts).tolist()
        return {int(r): (int(starts[i]), targets[ends[i] - counts[i] : ends[i]]) for i, r in enumerate(rows.tolist())}

    @staticmethod
    def _masks(msg: StepMsg, n_rows: int) -> dict[int, np.ndarray]:
        """row -> its [1 + drafts, W] grammar masks (views into the message)."""
        rows = as_i32(msg.mask_rows)
        if not len(rows):
            return {}
        if rows.min() < 0 or rows.max() >= n_rows:
            raise ValueError(f"mask rows {rows.tolist()} outside the step's {n_rows} rows")
        bits = as_i32(msg.masks)
        k1 = 1 + msg.drafts
        if len(bits) % (len(rows) * k1):
            raise ValueError(f"{len(bits)} mask words do not split into {len(rows)} rows of {k1} masks")
        return dict(zip(rows.tolist(), bits.reshape(len(rows), k1, -1), strict=True))
