"""The runner's side of the wire without a device: the slot mirrors rebuild every row from the
columnar StepMsg alone (one path for extend, decode and verify rows), refuse a message out of
order, and the runner core returns the real rows' samples row after row."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.runner.core import RunnerCore
from ringserve.actors.runner.slot_mirrors import UNKNOWN, SlotMirrors
from ringserve.actors.transport import messages as m
from ringserve.model.compute.step_inputs import DeviceSampling, ProgramShapes
from ringserve.model.runtime.executor import StepOut
from ringserve.model.runtime.sampler import SampleOut

SP = DeviceSampling(temperature=0.5, top_k=4, seed=9)


def step(step_id: int, rows: list[tuple[int, int, list[int], list[int], bool]], *, starts=(), released=(),
         drafts: int = 0, multistep: bool = False) -> m.StepMsg:  # fmt: skip
    """rows: (slot, committed, tokens, new pages, keep), through a real encode / decode."""
    msg = m.StepMsg(
        step_id, released=m.i32(list(released)), starts=[m.SlotStart(s, m.i32(p), SP) for s, p in starts],
        slots=m.i32([r[0] for r in rows]), committed=m.i32([r[1] for r in rows]),
        token_counts=m.i32([len(r[2]) for r in rows]), tokens=m.i32([t for r in rows for t in r[2]]),
        page_counts=m.i32([len(r[3]) for r in rows]), pages=m.i32([p for r in rows for p in r[3]]),
        keep=m.u8([r[4] for r in rows]), drafts=drafts, multistep=multistep,
    )  # fmt: skip
    decoded = m.to_runner.decode(m.encode(msg))
    assert isinstance(decoded, m.StepMsg)
    return decoded


def test_extend_then_decode_rows_from_the_mirror_alone():
    mirrors = SlotMirrors(4)
    rows = mirrors.apply(step(1, [(2, 16, [5, 6, 7], [9], False), (0, 0, [8], [3], True)],
                              starts=[(2, [4]), (0, [])]))  # fmt: skip
    assert [r.token_ids.tolist() for r in rows] == [[5, 6, 7], [8]]
    assert [r.committed_len for r in rows] == [16, 0]
    assert [r.pages.tolist() for r in rows] == [[4, 9], [3]]
    assert [r.future_slot for r in rows] == [-1, 0]  # a middle chunk's sample goes to the sink
    assert rows[0].sampling == SP
    rows = mirrors.apply(step(2, [(2, 19, [-3], [], True), (0, 1, [-1], [5], True)]))  # decode: FUTURE(slot)
    assert [(r.token_ids.tolist(), r.committed_len, r.pages.tolist(), r.future_slot) for r in rows] == [
        ([-3], 19, [4, 9], 2), ([-1], 1, [3, 5], 0)]  # fmt: skip
    assert mirrors.slots[2].committed_len == 20 and mirrors.slots[0].committed_len == 2


def test_the_sliding_layers_local_tables_are_mirrored_beside_the_page_tables():
    """With a local page space the mirror grows each slot's local table with its page table
    (kvmem/local.py): the entries the scheduler dropped keep their ids here."""
    mirrors = SlotMirrors(4, local_space=True)
    msg = step(1, [(1, 8, [5, 6], [9], True)], starts=[(1, [4])])
    msg.starts[0].prefix_local, msg.local_pages = m.i32([0]), m.i32([7])  # a dropped entry, one new page
    rows = mirrors.apply(m.to_runner.decode(m.encode(msg)))
    assert rows[0].pages.tolist() == [4, 9] and rows[0].local_pages.tolist() == [0, 7]
    msg = step(2, [(1, 10, [-2], [11], True)])
    msg.local_pages = m.i32([3])
    assert mirrors.apply(m.to_runner.decode(m.encode(msg)))[0].local_pages.tolist() == [0, 7, 3]
    with pytest.raises(ValueError, match="0 local pages for 1 pages appended"):
        mirrors.apply(step(3, [(1, 11, [-2], [12], True)]))
    assert SlotMirrors(4).apply(step(1, [(0, 0, [5], [2], True)], starts=[(0, [])]))[0].local_pages is None


def test_a_message_out_of_order_fails_loudly():
    mirrors = SlotMirrors(4)
    mirrors.apply(step(1, [(1, 0, [5, 6], [2], True)], starts=[(1, [])]))
    with pytest.raises(ValueError, match="slot 1: scheduler says committed_len=3, runner has 2"):
        mirrors.apply(step(2, [(1, 3, [-2], [], True)]))
    with pytest.raises(ValueError, match="slot 3 is not live"):
        mirrors.apply(step(3, [(3, 0, [-4], [], True)]))
    with pytest.raises(ValueError, match=r"slot 7 outside \[0, 4\)"):
        mirrors.apply(step(4, [], starts=[(7, [])]))


def test_a_released_slot_restarts_in_the_same_step():
    mirrors = SlotMirrors(2)
    mirrors.apply(step(1, [(1, 0, [5, 6, 7], [2], True)], starts=[(1, [])]))
    rows = mirrors.apply(step(2, [(1, 16, [8], [6], True)], released=[1], starts=[(1, [3])]))
    assert rows[0].pages.tolist() == [3, 6] and rows[0].committed_len == 16


def test_verify_rounds_leave_the_length_to_the_device():
    """A round's committed_len is the scheduler's bound: never checked; the slot's length is
    unknown afterwards and the next plain row (a session's next turn) sets it."""
    mirrors = SlotMirrors(2)
    mirrors.apply(step(1, [(0, 0, [5, 6, 7], [1], True)], starts=[(0, [])]))
    rows = mirrors.apply(step(2, [(0, 3, [-1, 7, -1], [], True)], drafts=2))
    assert rows[0].token_ids.tolist() == [-1, 7, -1] and rows[0].committed_len == 3
    assert mirrors.slots[0].committed_len == UNKNOWN
    rows = mirrors.apply(step(3, [(0, 9, [-1, 8, 9], [4], True)], drafts=2))  # a bound past any check
    assert rows[0].committed_len == 9 and rows[0].pages.tolist() == [1, 4]
    rows = mirrors.apply(step(4, [(0, 7, [11, 12], [], True)]))
    assert mirrors.slots[0].committed_len == 9


def test_multistep_rows_keep_the_length_exact():
    """A multi-step decode's rows start at the slot's exact length and advance it by all their
    steps: the next row's committed_len is checked against that."""
    mirrors = SlotMirrors(2)
    mirrors.apply(step(1, [(0, 0, [5, 6, 7], [1], True)], starts=[(0, [])]))
    rows = mirrors.apply(step(2, [(0, 3, [-1, -1, -1, -1], [], True)], drafts=3, multistep=True))
    assert rows[0].committed_len == 3 and mirrors.slots[0].committed_len == 7
    with pytest.raises(ValueError, match="committed_len=6, runner has 7"):
        mirrors.apply(step(3, [(0, 6, [-1], [], True)]))
    with pytest.raises(ValueError, match="committed_len=9, runner has 7"):
        mirrors.apply(step(3, [(0, 9, [-1, -1, -1, -1], [], True)], drafts=3, multistep=True))


class FakeExecutor:
    """What RunnerCore calls: `run_step(rows, verify)` -> StepOut (the padded step's SampleOut, accepted)."""

    def __init__(self) -> None:
        self.trace_count = 0
        self.num_programs = 1
        self.programs = type("P", (), {"pending": 0, "error": None})()
        self.calls: list[int] = []
        self.cfg = type("C", (), {"shapes": ProgramShapes()})()  # no local page space

    def run_step(self, rows, verify=0, multistep=False):
        k1, padded = max(1, verify), 8
        self.calls.append(-verify if multistep else verify)
        toks = np.arange(padded * k1, dtype=np.int32) + 100
        out = SampleOut(toks, -toks.astype(np.float32), np.zeros((padded * k1, 0), np.int32),
                        np.zeros((padded * k1, 0), np.float32), np.zeros((padded * k1, 0), np.float32),
                        np.zeros((padded * k1, 1), np.int32))  # fmt: skip
        return StepOut(out, np.full(padded, 7, np.int32), None, len(rows) * k1, 0)  # type: ignore[arg-type]


def test_runner_core_returns_the_real_rows_samples_row_after_row():
    core = RunnerCore(FakeExecutor(), max_slots=4, top_n=0)  # type: ignore[arg-type]
    msg = step(1, [(0, 0, [5, 6], [1], True), (1, 0, [7], [2], True)], starts=[(0, []), (1, [])])
    res = core.result(core.dispatch(msg))
    assert m.as_i32(res.tokens).tolist() == [100, 101] and res.accepted == b""
    res = core.result(core.dispatch(step(2, [(0, 2, [-1, 9, 9], [], True), (1, 1, [-2, 3, 4], [], True)], drafts=2)))
    assert m.as_i32(res.tokens).tolist() == list(range(100, 106))  # 2 rounds x 3 samples
    assert m.as_i32(res.accepted).tolist() == [7, 7]
    res = core.result(core.dispatch(step(3, [(0, 5, [-1, -1, -1], [], True)], drafts=2, multistep=True)))
    assert m.as_i32(res.tokens).tolist() == [100, 101, 102] and m.as_i32(res.accepted).tolist() == [7]
    assert core.ex.calls == [0, 3, -3]  # type: ignore[attr-defined]


def test_grammar_masks_reach_only_their_rows():
    """A step's mask columns (rows ascending, [1 + drafts, W] each) become those rows'
    DeviceRow.mask; the other rows sample unmasked."""
    mirrors = SlotMirrors(4)
    mirrors.apply(step(1, [(0, 0, [5, 6], [1], True), (1, 0, [7, 8], [2], True), (3, 0, [9], [3], True)],
                       starts=[(0, []), (1, []), (3, [])]))  # fmt: skip
    masks = np.arange(2 * 2 * 3, dtype=np.int32).reshape(2, 2, 3)  # rows 0 and 2, k1 = 2, W = 3
    msg = step(2, [(0, 2, [-1, 4], [], True), (1, 2, [-2, -1], [], True), (3, 1, [-4, 6], [], True)], drafts=1)
    msg = m.to_runner.decode(m.encode(m.msgspec.structs.replace(msg, mask_rows=m.i32([0, 2]), masks=m.i32(masks))))
    rows = mirrors.apply(msg)
    assert np.array_equal(rows[0].mask, masks[0]) and rows[1].mask is None and np.array_equal(rows[2].mask, masks[1])
    with pytest.raises(ValueError, match="outside the step's 3 rows"):
        mirrors.apply(m.msgspec.structs.replace(msg, step_id=3, mask_rows=m.i32([3]), masks=m.i32(masks[:1])))
