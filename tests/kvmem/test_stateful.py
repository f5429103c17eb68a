"""Random sequences of every kvmem operation, checked after each step.

The machine keeps a shadow KV store (location -> the token whose KV was written there), so
beyond the integrity check it verifies the data end to end: every live row holds the KV of
its own tokens, every tree node's pages hold its key, a prefix match or a session's next turn
is granted only KV written for exactly those tokens, and live rows are append-only.

Some examples run with a local page space (the sliding layers' own pages, kvmem/local.py) of a
small window, shadowed alike: a live row's local pages hold its own tokens over its window, a
match or a session's next turn is granted a window whose local KV holds exactly those tokens,
and the local row as the runner mirrors it only grows (dropped entries keep their stale ids).

RINGSERVE_KVMEM_STEPS sets the number of steps (default 2,000; e.g. 100000 for a long run).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ringserve.kvmem import KVCache, KVUsageError, ReqKV, SessionSlots, TreeNode, token_locations
from ringserve.kvmem.local import first_needed

STEPS = int(os.environ.get("RINGSERVE_KVMEM_STEPS", "2000"))
STEPS_PER_EXAMPLE = 60
BASES = [
    [],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 5, 6, 9, 9, 9],
    [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9],
    [5, 5, 5, 5, 5],
]
SESSIONS = ["s0", "s1"]
counted = [0]

prompts = st.builds(
    lambda b, s: b + s, st.sampled_from(BASES), st.lists(st.integers(0, 3), min_size=1, max_size=10)
)
index = st.integers(0, 1_000)


@dataclasses.dataclass
class Live:
    kv: ReqKV
    tokens: list[int]  # origin + outputs; KV written for tokens[:kv.committed_len]
    origin_len: int
    row: list[int]  # the row as the runner mirrors it: only ever appended to
    session: str | None = None
    resumed: bool = False  # a session turn started from the slot its session kept
    ran: bool = False  # reserved, computed or cached anything since its admission
    local_row: list[int] = dataclasses.field(default_factory=list)  # its local row, mirrored alike


class KVMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(4, 40),
        max_slots=st.integers(1, 5),
        disable=st.sampled_from([False] * 5 + [True]),
        window=st.sampled_from([0, 0, 1, 3, 6]),
        local_short=st.integers(0, 3),
    )
    def setup(self, page, num_pages, max_slots, disable, window, local_short):
        local_pages = max(2, num_pages - local_short) if window else 0
        self.c = KVCache(num_pages, page, max_slots, disable_radix_cache=disable, local_pages=local_pages,
                         window=window, slack=2)  # fmt: skip
        self.s = SessionSlots(self.c)
        self.page = page
        self.window = window
        self.store = np.full(num_pages * page, -1, np.int64)
        self.local_store = np.full(max(local_pages, 1) * page, -1, np.int64)
        self.reqs: list[Live] = []
        self.locks: list[TreeNode] = []
        self.turns: dict[str, tuple[list[int], list[int]]] = {}  # kept session: (T tokens, overshoot)
        self.initial = self.c.available_tokens()
        self.steps = -1  # the invariant also runs right after setup

    # ---- helpers ----------------------------------------------------------------------------
    def pick(self, i: int) -> Live:
        return self.reqs[i % len(self.reqs)]

    def write(self, r: Live, start: int, tokens: list[int]) -> None:
        pos = np.arange(start, start + len(tokens))
        assert self.c.slots.owned_mask(r.kv.slot)[pos // self.page].all(), (
            "writing into a page the request does not own"
        )
        self.store[token_locations(self.c.slots.pages(r.kv.slot), self.page, start + len(tokens))[start:]] = (
            tokens
        )
        if self.window:
            local = self.c.local_pages(r.kv)
            assert self.c.local.owned[r.kv.slot, pos // self.page].all(), "writing into a local page not its own"
            self.local_store[token_locations(local, self.page, start + len(tokens))[start:]] = tokens

    def read_window(self, kv: ReqKV, n: int) -> list[int]:
        """The tokens the local KV of the window before position n holds."""
        lo = first_needed(n, self.window, self.page) * self.page
        return self.local_store[token_locations(self.c.local_pages(kv), self.page, n)[lo:]].tolist()

    def read(self, slot: int, n: int) -> list[int]:
        return self.store[token_locations(self.c.slots.pages(slot), self.page, n)].tolist()

    def admit(self, tokens: list[int], ns: str | None, session: str | None) -> Live | None:
        ids = np.asarray(tokens, np.int32)
        if session is not None:
            kept = self.s.kept.get(session)
            kv = self.s.start_turn(session, ids)
            if kept is not None:  # never more than the kept KV, itself at most origin + finished_len
                target = len(self.turns.pop(session)[0])
                assert kv is kept.kv and kv.cached_len <= len(kept.token_ids) <= target
        else:
            want = self.c.match_len(ids[:-1], ns)
            kv = self.c.admit(ids[:-1], ns)
            assert kv is None or kv.cached_len == want
        if kv is None:
            assert self.c.slots.num_free == 0
            return None
        assert self.read(kv.slot, kv.cached_len) == tokens[: kv.cached_len], "granted KV of other tokens"
        if self.window:
            lo = first_needed(kv.cached_len, self.window, self.page) * self.page
            assert self.read_window(kv, kv.cached_len) == tokens[lo : kv.cached_len], "granted local KV of other tokens"
        r = Live(kv, list(tokens), len(tokens), self.c.slots.pages(kv.slot).tolist(), session,
                 resumed=session is not None and kept is not None,
                 local_row=self.c.local_pages(kv).tolist())  # fmt: skip
        self.reqs.append(r)
        return r

    # ---- requests ---------------------------------------------------------------------------
    @rule(tokens=prompts, ns=st.sampled_from([None, None, "v2"]))
    def add_request(self, tokens, ns):
        self.admit(tokens, ns, None)

    @rule(
        sid=st.sampled_from(SESSIONS),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        stale=st.booleans(),
        base=prompts,
    )
    def session_turn(self, sid, suffix, stale, base):
        if any(r.session == sid for r in self.reqs):
            return
        if sid in self.turns:  # next turn: the kept T tokens, then new ones (maybe the overshoot's)
            kept_tokens, overshoot = self.turns[sid]
            tokens = kept_tokens + (overshoot if stale and overshoot else suffix)
        else:
            tokens = base
        self.admit(tokens, None, sid)

    @precondition(lambda self: self.reqs)
    @rule(
        i=index,
        n=st.integers(1, 12),
        lookahead=st.integers(0, 3),
        accepted=st.integers(0, 3),
        drafts=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    )
    def compute(self, i, n, lookahead, accepted, drafts):
        """Extend by n (a chunk, or the rest); reaching the end samples: `accepted` drafts
        (KV written, within the lookahead reserved) plus a bonus token (no KV yet)."""
        r = self.pick(i)
        kv = r.kv
        remaining = len(r.tokens) - kv.committed_len
        n = min(n, remaining)
        last = n == remaining
        extra = lookahead if last else 0
        free, evictable = self.c.allocator.num_free, self.c.tree.evictable_pages
        pages = self.c.reserve(kv, n + extra)
        need = -(-(kv.committed_len + n + extra) // self.page) - len(r.row)
        if pages is None:
            short_local = self.window and self.c.local.allocator.num_free < need
            assert (need > free + evictable or short_local) and kv.allocated_len <= kv.committed_len + n + extra
            return
        r.ran = True
        assert len(pages) == max(0, need)
        r.row += pages.tolist()
        r.local_row += self.c.local_pages(kv, len(pages)).tolist()
        written = r.tokens[kv.committed_len : kv.committed_len + n] + (
            drafts[: min(accepted, extra)] if last else []
        )
        self.write(r, kv.committed_len, written)
        self.c.commit(kv, len(written))
        if last:
            r.tokens += drafts[: min(accepted, extra)] + [drafts[-1]]
            assert kv.committed_len == len(r.tokens) - 1  # the bonus token has no KV yet

    @precondition(lambda self: self.reqs)
    @rule(i=index, accepted=st.integers(0, 2), drafts=st.lists(st.integers(0, 3), min_size=4, max_size=4))
    def decode(self, i, accepted, drafts):
        """The rest of the extend (usually one token) with a lookahead of 2."""
        self.compute(i, 1000, 2, accepted, drafts)

    @precondition(lambda self: self.reqs)
    @rule(i=index, n=st.integers(1, 5))
    def reserve_ahead(self, i, n):
        """Overlap's extra round: KV reserved past the end, never committed."""
        r = self.pick(i)
        pages = self.c.reserve(r.kv, n)
        if pages is not None:
            r.row += pages.tolist()
            r.local_row += self.c.local_pages(r.kv, len(pages)).tolist()
            r.ran = True

    @precondition(lambda self: self.reqs)
    @rule(i=index)
    def cache_unfinished(self, i):
        r = self.pick(i)
        self.c.cache_unfinished(r.kv, np.asarray(r.tokens[: r.kv.committed_len], np.int32))
        r.ran = True

    @precondition(lambda self: self.reqs)
    @rule(i=index, overshoot=st.integers(0, 3))
    def finish(self, i, overshoot):
        r = self.pick(i)
        kv = r.kv
        self.reqs.remove(r)
        if r.session is None:
            keep = max(0, min(kv.committed_len, len(r.tokens) - 1 - overshoot))
            self.c.release(kv, np.asarray(r.tokens[:keep], np.int32))
            return
        output = r.tokens[r.origin_len :]
        finished = max(0, len(output) - overshoot)
        target = r.origin_len + finished
        self.s.finish_turn(
            r.session, kv, np.asarray(r.tokens[: r.origin_len], np.int32), output, finished
        )
        assert (
            kv.committed_len <= target and kv.allocated_len <= target and len(output) == finished
        )  # seed 001
        assert self.c.slots.n_pages[kv.slot] == -(-kv.allocated_len // self.page)
        self.turns[r.session] = (r.tokens[:target], r.tokens[target:])

    @precondition(lambda self: any(r.session for r in self.reqs))
    @rule(i=index, overshoot=st.integers(0, 3), extra_round=st.integers(0, 4), cache_first=st.booleans())
    def finish_session_turn(self, i, overshoot, extra_round, cache_first):
        """A session turn decodes once more (maybe caching its KV, overshoot included, in the
        tree), maybe reserves an extra round, then finishes."""
        turns = [j for j, r in enumerate(self.reqs) if r.session]
        j = turns[i % len(turns)]
        self.decode(j, overshoot, [i % 4, 1, 2, 3])
        if cache_first:
            self.cache_unfinished(j)
        if extra_round:
            self.reserve_ahead(j, extra_round)
        self.finish(j, overshoot)

    @precondition(lambda self: self.reqs)
    @rule(i=index)
    def abort(self, i):
        r = self.pick(i)
        self.reqs.remove(r)
        self.c.release(r.kv, None)

    @precondition(lambda self: any(r.session and not r.ran for r in self.reqs))
    @rule(i=index)
    def undo_session_turn(self, i):
        """The scheduler takes a session turn's admission back before it runs (a refused
        admission, a prefill step cut before it): the kept slot it resumed is kept again."""
        waiting = [r for r in self.reqs if r.session and not r.ran]
        r = waiting[i % len(waiting)]
        assert r.session is not None
        self.reqs.remove(r)
        self.s.undo_start(r.session, r.kv)
        if r.resumed:
            kept = self.s.kept[r.session]
            assert kept.kv is r.kv and kept.token_ids.tolist() == r.tokens[: r.kv.committed_len]
            self.turns[r.session] = (r.tokens[: r.kv.committed_len], [])
        else:
            assert r.session not in self.s.kept

    @precondition(lambda self: self.reqs)
    @rule(i=index)
    def retract(self, i):
        """KV freed; the request comes back with everything it has so far as its prompt."""
        r = self.pick(i)
        if r.session is not None:
            return
        self.reqs.remove(r)
        self.c.release(r.kv, None)
        again = self.admit(r.tokens, r.kv.extra_key, None)
        assert again is not None and again.kv.slot == r.kv.slot  # the slot it just gave back

    @rule()
    def begin_step(self):
        """The scheduler plans its next step (a local sweep may then drop what earlier ones read)."""
        self.c.begin_step()

    @rule(sid=st.sampled_from(SESSIONS))
    def close_session(self, sid):
        if sid in self.s.kept:
            self.s.close(sid)
            del self.turns[sid]

    # ---- the tree directly ------------------------------------------------------------------
    @rule(n=st.integers(1, 40))
    def evict(self, n):
        free, evictable = self.c.allocator.num_free, self.c.tree.evictable_pages
        got = self.c.tree.evict(n)
        assert got % self.page == 0 and (got >= n or self.c.tree.evictable_pages == 0)
        assert self.c.allocator.num_free - free == evictable - self.c.tree.evictable_pages == got // self.page

    @rule(tokens=prompts, ns=st.sampled_from([None, "v2"]))
    def insert(self, tokens, ns):
        n = len(tokens) // self.page
        pages = self.c.allocator.alloc(n)
        if pages is None:
            return
        self.store[token_locations(pages, self.page, n * self.page)] = tokens[: n * self.page]
        local = np.zeros(n, np.int32) if self.window else None  # no local KV: every page a tombstone
        res = self.c.tree.insert(np.asarray(tokens[: n * self.page], np.int32), pages, ns, local)
        self.c.allocator.free(pages[: res.adopted_from])

    @rule(tokens=prompts, ns=st.sampled_from([None, "v2"]))
    def lock(self, tokens, ns):
        m = self.c.tree.match_prefix(np.asarray(tokens, np.int32), ns)
        assert self.store[m.locations()].tolist() == tokens[: m.length]
        if self.window and m.length:
            lo = first_needed(m.length, self.window, self.page) * self.page
            assert self.local_store[token_locations(m.local, self.page, m.length)[lo:]].tolist() == tokens[lo : m.length]
        self.c.tree.inc_lock_ref(m.node)
        self.locks.append(m.node)

    @precondition(lambda self: self.locks)
    @rule(i=index)
    def unlock(self, i):
        self.c.tree.dec_lock_ref(self.locks.pop(i % len(self.locks)))

    @rule(coin=st.integers(0, 3))
    def flush(self, coin):
        if coin:
            return
        if self.reqs or self.s.kept:
            try:
                self.c.flush()
            except KVUsageError as e:
                assert "is live" in str(e)
            else:
                raise AssertionError("flush with live slots must refuse")
            return
        if self.locks and any(n is not self.c.tree.root for n in self.locks):
            pages = self.c.tree.total_pages
            try:
                self.c.flush()
            except KVUsageError as e:
                assert "is locked" in str(e) and self.c.tree.total_pages == pages
            else:
                raise AssertionError("flush with a locked node must refuse")
            return
        self.c.flush()
        assert self.c.tree.total_pages == 0 and self.c.available_tokens() == self.initial

    # ---- after every step -------------------------------------------------------------------
    @invariant()
    def books_are_consistent(self):
        self.steps += 1
        counted[0] += self.steps > 0
        c = self.c
        self.s.check_integrity([r.kv for r in self.reqs], self.locks)
        assert c.available_tokens() == (c.allocator.num_free + c.tree.evictable_pages) * self.page
        for r in self.reqs:
            assert c.slots.pages(r.kv.slot).tolist() == r.row, "a live row was rewritten"
            assert self.read(r.kv.slot, r.kv.committed_len) == r.tokens[: r.kv.committed_len]
            if self.window:
                local, first = c.local_pages(r.kv), int(c.local.first[r.kv.slot])
                assert local[first:].tolist() == r.local_row[first:], "a live local row was rewritten"
                lo = first_needed(r.kv.committed_len, self.window, self.page) * self.page
                assert self.read_window(r.kv, r.kv.committed_len) == r.tokens[lo : r.kv.committed_len]
        for kept in self.s.kept.values():
            assert self.read(kept.kv.slot, kept.kv.committed_len) == kept.token_ids.tolist()
            if self.window:
                lo = first_needed(kept.kv.committed_len, self.window, self.page) * self.page
                assert self.read_window(kept.kv, kept.kv.committed_len) == kept.token_ids[lo:].tolist()
        for node in c.tree.nodes():
            assert (
                self.store[token_locations(node.pages, self.page, len(node.key))].tolist()
                == node.key.tolist()
            )


def test_kvmem_random_operations():
    """Runs examples of up to STEPS_PER_EXAMPLE steps until STEPS steps have been checked."""
    counted[0] = 0
    while counted[0] < STEPS:
        left = STEPS - counted[0]
        cfg = settings(
            max_examples=max(1, left // STEPS_PER_EXAMPLE),
            stateful_step_count=STEPS_PER_EXAMPLE,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        run_state_machine_as_test(KVMachine, settings=cfg)
    assert counted[0] >= STEPS
    print(f"kvmem state machine: {counted[0]} steps checked")
