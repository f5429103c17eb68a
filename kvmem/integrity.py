"""One check of every kvmem invariant, callable at any time (tests, and whenever idle).

Pages: every page but the sink is exactly one of
    free  (allocator state FREE, on the free stack or pending in a free group, once)
    tree  (state TREE, in exactly one node)
    held  (state HELD, owned by exactly one live page table: a running request or a session's kept slot)
and free + tree + held == capacity. A page table's tree-owned pages are the pages its locked node's
root path holds at the same index. Slots: the live slots are exactly the holders' slots.
Locks: lock_ref(node) == locks held on it directly + the children's lock_refs, and the direct
locks are exactly the holders' nodes plus `locks`. Tree sizes match the counters.

A local page space (kvmem/local.py) is checked alike: every local page but the sink is free, in
exactly one node's `local`, or owned by exactly one live slot's local table; a slot's entries
before its `first` are 0, from it on present, and the ones it shares are its locked path's at
the same index.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from ringserve.kvmem.allocator import FREE, HELD, SINK, STATE_NAMES, TREE, PageAllocator, cdiv
from ringserve.kvmem.local import LocalTables
from ringserve.kvmem.radix import RadixCache, TreeNode
from ringserve.kvmem.req_kv import ReqKV
from ringserve.kvmem.slots import SlotPool


class IntegrityError(AssertionError):
    """A kvmem invariant does not hold; the message names the page, slot or node."""


def _fail(msg: str) -> None:
    raise IntegrityError(msg)


def check_integrity(
    allocator: PageAllocator,
    slots: SlotPool,
    tree: RadixCache,
    holders: Iterable[ReqKV],
    locks: Iterable[TreeNode] = (),
    local: LocalTables | None = None,
) -> None:
    holders = list(holders)
    if local is not None:
        _check_local(local, slots, tree, holders)
    n_pages, state = allocator.num_pages, allocator.state
    if state[0] != SINK or np.count_nonzero(state == SINK) != 1:
        _fail(f"page 0 must be the only sink (state[0]={int(state[0])})")
    free = _check_free(allocator)
    tree_pages, direct = _check_tree(tree, state)
    held = _check_rows(slots, tree, holders, state, direct, list(locks))
    total = len(free) + len(tree_pages) + held
    if total != allocator.capacity:
        _fail(
            f"free {len(free)} + tree {len(tree_pages)} + held {held} = {total} pages, pool has {n_pages - 1}"
        )


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_free(allocator: PageAllocator) -> np.ndarray:
    state = allocator.state
    free = allocator.free_pages()
    counts = np.bincount(free, minlength=allocator.num_pages)
    if (counts > 1).any():
        _fail(f"page {_first(counts > 1)} is on the free list twice")
    wrong = state[free] != FREE
    if wrong.any():
        p = int(free[wrong][0])
        _fail(f"page {p} is on the free list but {STATE_NAMES[int(state[p])]}")
    lost = (state == FREE) & (counts == 0)
    if lost.any():
        _fail(f"page {_first(lost)} is marked free but is not on the free list")
    return free


def _check_tree(tree: RadixCache, state: np.ndarray) -> tuple[np.ndarray, dict[int, tuple[TreeNode, int]]]:
    """Returns the tree's pages and {node id: (node, locks held directly on it)}."""
    page = tree.page_size
    parts = []
    below: Counter[int] = Counter()  # node id -> its children's lock_refs
    evictable = protected = count = 0
    if tree.root.lock_ref or tree.root.pages.size:
        _fail("the root holds pages or locks")
    nodes = list(tree.nodes())
    for node in nodes:
        count += 1
        parent = node.parent
        assert parent is not None
        if not node.alive or len(node.pages) == 0 or len(node.key) != len(node.pages) * page:
            _fail(f"{node}: {len(node.key)} tokens over {len(node.pages)} pages (alive={node.alive})")
        if parent.children.get(tree._child_key(parent, node.key[:page], node.extra_key)) is not node:
            _fail(f"{node} is not its parent's child under its first page")
        if parent is not tree.root and node.extra_key != parent.extra_key:
            _fail(f"{node}: namespace {node.extra_key!r} under a node of namespace {parent.extra_key!r}")
        below[parent.id] += node.lock_ref
        if node.lock_ref:
            protected += len(node.pages)
        else:
            evictable += len(node.pages)
        parts.append(node.pages)
    direct = {n.id: (n, n.lock_ref - below[n.id]) for n in nodes}
    for node, d in direct.values():
        if d < 0:
            _fail(f"{node}: lock_ref {node.lock_ref} below its children's total {below[node.id]}")
    if (count, evictable, protected) != (tree.num_nodes, tree.evictable_pages, tree.protected_pages):
        _fail(f"tree counters (nodes, evictable, protected) = {(tree.num_nodes, tree.evictable_pages, tree.protected_pages)}, "
              f"counted {(count, evictable, protected)}")  # fmt: skip
    pages = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    counts = np.bincount(pages, minlength=len(state))
    if (counts > 1).any():
        p = _first(counts > 1)
        _fail(f"page {p} is held by two tree nodes: {[n for n in tree.nodes() if p in n.pages]}")
    if (state[pages] != TREE).any():
        p = int(pages[state[pages] != TREE][0])
        _fail(
            f"page {p} is in {[n for n in tree.nodes() if p in n.pages][0]} but {STATE_NAMES[int(state[p])]}"
        )
    lost = (state == TREE) & (counts == 0)
    if lost.any():
        _fail(f"page {_first(lost)} is marked as the tree's but no node holds it")
    return pages, direct


def _check_rows(
    slots: SlotPool,
    tree: RadixCache,
    holders: list[ReqKV],
    state: np.ndarray,
    direct: dict[int, tuple[TreeNode, int]],
    locks: list[TreeNode],
) -> int:
    """Checks every holder's page table; returns the number of held pages."""
    page = slots.page_size
    by_slot: dict[int, ReqKV] = {}
    owned_parts = []
    wanted = Counter(n.id for n in locks if n is not tree.root)
    for kv in holders:
        s = kv.slot
        if s in by_slot:
            _fail(f"slot {s} is held by two live records")
        by_slot[s] = kv
        if not 0 <= s < slots.max_slots or not slots.live[s]:
            _fail(f"slot {s} is held by a live record but not allocated in the slot pool")
        try:
            kv.check_lengths()
        except AssertionError as e:
            raise IntegrityError(str(e)) from None
        n = int(slots.n_pages[s])
        if n != cdiv(kv.allocated_len, page):
            _fail(f"slot {s}: {n} pages for allocated_len={kv.allocated_len} (page_size {page})")
        if not kv.node.alive:
            _fail(f"slot {s} locks {kv.node}, which was evicted")
        if kv.node is not tree.root:
            wanted[kv.node.id] += 1
        table, own = slots.pages(s), slots.owned_mask(s)
        if (table == 0).any():
            _fail(f"slot {s}: the sink page 0 is in its page table at index {_first(table == 0)}")
        shared = np.flatnonzero(~own)
        if shared.size:
            path = tree.path_pages(kv.node)
            bad = (
                shared[(shared >= len(path)) | (path[np.minimum(shared, len(path) - 1)] != table[shared])]
                if len(path)
                else shared
            )
            if bad.size:
                i = int(bad[0])
                _fail(f"slot {s}: page {int(table[i])} at table index {i} is marked tree-owned but its locked path "
                      f"({kv.node}) does not hold it there")  # fmt: skip
        owned_parts.append(table[own])
    extra = np.flatnonzero(slots.live & ~np.isin(np.arange(slots.max_slots), list(by_slot)))
    if extra.size:
        _fail(f"slot {int(extra[0])} is allocated but no live request or session holds it")
    free_slots = slots.free_slot_ids()
    if len(set(free_slots)) != len(free_slots) or len(free_slots) + len(by_slot) != slots.max_slots:
        _fail(
            f"slot pool: {len(free_slots)} free ids (unique: {len(set(free_slots))}) + {len(by_slot)} live != {slots.max_slots}"
        )
    owned = np.concatenate(owned_parts) if owned_parts else np.zeros(0, np.int32)
    counts = np.bincount(owned, minlength=len(state))
    if (counts > 1).any():
        p = _first(counts > 1)
        _fail(
            f"page {p} is held by two page tables: slots {[s for s, kv in by_slot.items() if p in slots.pages(s)]}"
        )
    if (state[owned] != HELD).any():
        p = int(owned[state[owned] != HELD][0])
        _fail(
            f"page {p} is owned by slot {[s for s in by_slot if p in slots.pages(s)][0]} but {STATE_NAMES[int(state[p])]}"
        )
    lost = (state == HELD) & (counts == 0)
    if lost.any():
        _fail(f"page {_first(lost)} is allocated but no live request or session holds it (leak)")
    for node, d in direct.values():
        if d != wanted.get(node.id, 0):
            _fail(f"{node}: {d} direct lock(s), but {wanted.get(node.id, 0)} holder(s) lock it")
    missing = set(wanted) - set(direct)
    if missing:
        _fail(f"node {min(missing)} is locked by a holder but not in the tree")
    return len(owned)


def _check_local(local: LocalTables, slots: SlotPool, tree: RadixCache, holders: list[ReqKV]) -> None:
    alloc = local.allocator
    state = alloc.state
    if state[0] != SINK or np.count_nonzero(state == SINK) != 1:
        _fail(f"local page 0 must be the only sink (state[0]={int(state[0])})")
    free = _check_free(alloc)
    parts = []
    for node in tree.nodes():
        held = node.local
        if held is None or len(held) != len(node.pages):
            raise IntegrityError(f"{node}: local pages {held} do not match its {len(node.pages)} pages")
        parts.append(held[held != 0])
    in_tree = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    owned_parts = []
    for kv in holders:
        s, n = kv.slot, int(slots.n_pages[kv.slot])
        first = int(local.first[s])
        table, own = local.table[s, :n], local.owned[s, :n]
        if first > n or (table[:first] != 0).any() or (table[first:] == 0).any() or own[:first].any():
            _fail(f"local table of slot {s}: entries {table.tolist()} with first={first}: dropped ones must be 0, "
                  "the rest present")  # fmt: skip
        if (local.table[s, n:] != 0).any():
            _fail(f"local table of slot {s}: entries past its {n} pages")
        shared = np.flatnonzero(~own[first:]) + first
        if shared.size:
            path = tree._path_local(kv.node)
            if shared[-1] >= len(path) or (path[shared] != table[shared]).any():
                _fail(f"local table of slot {s}: its shared entries {shared.tolist()} are not its locked path's "
                      f"({kv.node})")  # fmt: skip
        owned_parts.append(table[own])
    owned = np.concatenate(owned_parts) if owned_parts else np.zeros(0, np.int32)
    for pages, want, what in ((in_tree, TREE, "the tree"), (owned, HELD, "a slot")):
        counts = np.bincount(pages, minlength=len(state))
        if (counts > 1).any():
            _fail(f"local page {_first(counts > 1)} is held twice by {what}")
        if (state[pages] != want).any():
            p = int(pages[state[pages] != want][0])
            _fail(f"local page {p} is held by {what} but {STATE_NAMES[int(state[p])]}")
        lost = (state == want) & (counts == 0)
        if lost.any():
            _fail(f"local page {_first(lost)} is {STATE_NAMES[want]} but {what} does not hold it (leak)")
    if len(free) + len(in_tree) + len(owned) != alloc.capacity:
        _fail(f"local pages: free {len(free)} + tree {len(in_tree)} + held {len(owned)} != {alloc.capacity}")
