"""Streaming sessions on the frontend: each session's tree of turns, and a turn's full input.

    open_session(capacity_of_str_len, session_id=None) -> session_id
    generate(..., session_params={"id", "rid", "offset", "replace", "drop_previous_output"})
    close_session(session_id)

As SGLang builds a turn (its session_controller): with `rid` naming an earlier finished turn,
the new input is that turn's input + its output (only its input with `drop_previous_output`),
cut to `[:offset]` when an offset is given, then the new tokens; the new turn is that turn's
child. `rid` None without `replace`: the turn starts from nothing (a new root). `replace`: with
`rid`, the named turn's children are dropped (unfinished ones aborted) and the new turn
branches from it; without `rid`, the whole session is cleared first. Appending to a turn that
has not finished, or to an unknown one, is refused.

The scheduler keeps the KV of a session's last finished turn in its slot (kvmem's
SessionSlots), so a turn that extends it computes only its new tokens.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

PARAMS = ("id", "rid", "offset", "replace", "drop_previous_output")


@dataclasses.dataclass(eq=False)
class Turn:
    rid: str
    input_ids: list[int]  # everything the turn's request was given (earlier turns included)
    parent: Turn | None
    output_ids: list[int] | None = None  # set when the turn finishes
    children: list[Turn] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.output_ids is not None


@dataclasses.dataclass(eq=False)
class Session:
    id: str
    capacity_of_str_len: int
    turns: dict[str, Turn] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class Plan:
    """How one request of a generate call joins its session (applied once it is submitted)."""

    session: Session
    parent: Turn | None
    input_ids: list[int]
    replace: bool
    abort: list[str]  # unfinished turns `replace` drops


class Sessions:
    def __init__(self) -> None:
        self.open: dict[str, Session] = {}

    def open_session(self, capacity_of_str_len: int = 0, session_id: str | None = None) -> str:
        if not isinstance(capacity_of_str_len, int) or isinstance(capacity_of_str_len, bool) or capacity_of_str_len < 0:
            raise ValueError(f"capacity_of_str_len={capacity_of_str_len!r} must be an integer >= 0")
        if session_id is not None and not (isinstance(session_id, str) and session_id):
            raise ValueError(f"session_id={session_id!r} must be a non-empty string")
        sid = session_id or uuid.uuid4().hex
        if sid in self.open:
            raise ValueError(f"session {sid!r} is already open")
        self.open[sid] = Session(sid, capacity_of_str_len)
        return sid

    def close_session(self, session_id: str) -> list[str]:
        """Forget the session; returns the rids of its unfinished turns (to abort)."""
        s = self.open.pop(session_id, None)
        if s is None:
            raise ValueError(f"session_id={session_id!r}: no such open session")
        return [t.rid for t in s.turns.values() if not t.finished]

    def plan(self, params: Any, new_ids: list[int], bos: int | None) -> Plan:
        """The turn's full input (validated params), nothing changed yet."""
        if not isinstance(params, dict):
            raise ValueError(f"session_params: expected a dict, got {type(params).__name__}")
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            raise ValueError(f"session_params: unknown key(s) {unknown}; known: {list(PARAMS)}")
        sid = params.get("id")
        s = self.open.get(sid) if isinstance(sid, str) else None
        if s is None:
            raise ValueError(f"session_params: session id {sid!r} does not exist (open_session first)")
        rid, offset = params.get("rid"), params.get("offset")
        replace, drop = bool(params.get("replace") or False), bool(params.get("drop_previous_output") or False)
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"session_params: rid={rid!r} must be a string")
        if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool) or offset < 0):
            raise ValueError(f"session_params: offset={offset!r} must be an integer >= 0")
        abort: list[str] = []
        parent = None
        if rid is None:
            if replace:
                abort = [t.rid for t in s.turns.values() if not t.finished]
        else:
            parent = s.turns.get(rid)
            if parent is None:
                raise ValueError(f"session_params: rid {rid!r} is not a turn of session {sid!r}")
            if replace:
                abort = [t.rid for t in _descendants(parent) if not t.finished]
            if not parent.finished:
                raise ValueError(f"session_params: turn {rid!r} has not finished; a turn can only follow a finished one")
        if parent is None:
            return Plan(s, None, list(new_ids), replace, abort)
        assert parent.output_ids is not None
        ctx = list(parent.input_ids) if drop else parent.input_ids + parent.output_ids
        if offset:
            if offset > len(ctx):
                raise ValueError(f"session_params: offset={offset} is past the {len(ctx)} tokens of turn {rid!r}")
            ctx = ctx[:offset]
        if bos is not None and new_ids and new_ids[0] == bos:
            new_ids = new_ids[1:]  # the new turn continues a sequence: no second BOS
        return Plan(s, parent, ctx + list(new_ids), replace, abort)

    def begin(self, plan: Plan, rid: str, input_ids: list[int]) -> None:
        """The planned turn was submitted as request `rid`."""
        s = plan.session
        if rid in s.turns:
            raise ValueError(f"rid {rid!r} is already a turn of session {s.id!r}")
        if plan.replace and plan.parent is not None:  # the branch below the parent goes
            for t in _descendants(plan.parent):
                s.turns.pop(t.rid, None)
            plan.parent.children.clear()
        elif plan.replace:  # no parent: the whole session starts over
            s.turns.clear()
        turn = Turn(rid, list(input_ids), plan.parent)
        if plan.parent is not None:
            plan.parent.children.append(turn)
        s.turns[rid] = turn

    def finished(self, session_id: str, rid: str, output_ids: list[int]) -> None:
        s = self.open.get(session_id)
        turn = s.turns.get(rid) if s is not None else None
        if turn is not None:
            turn.output_ids = list(output_ids)


def _descendants(t: Turn) -> list[Turn]:
    out, stack = [], list(t.children)
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(c.children)
    return out
