"""Page-granular radix prefix cache over the page allocator.

The tree maps token-id prefixes to the pages holding their KV. Every edge holds whole pages:
`len(node.key) == len(node.pages) * page_size`. The root's children are keyed by
(extra_key, first page's tokens), so different namespaces (LoRA adapters, weight versions)
never share a prefix; deeper children are keyed by their first page's tokens.

Ownership and locks (the contract):
- Pages inside the tree are in allocator state TREE. `insert` adopts only the caller's pages
  past the prefix the tree already holds; for that prefix the caller keeps its own pages (if
  they differ, they stay the caller's to free): a live request's page table is never rewritten.
- `inc_lock_ref(node)` protects `node` and every ancestor; `lock_ref(n)` is the number of
  locks held on `n` or any descendant, so locked nodes are never evicted and a node is never
  locked while its parent is not. Decrementing a lock below zero raises naming the node.
- `evict` frees least recently used unlocked leaves (a parent left childless and unlocked
  becomes a leaf in turn). Sizes are in pages: total == evictable + protected.
- `disable=True`: matches nothing and adopts nothing (every request computes everything).

With a local page space (kvmem/local.py: the sliding layers' own pages) every node also holds
`local`, the local page of each of its pages, 0 where it was dropped (a tombstone). A match ends
only where every page of the last `window` positions before it has its local page (a sliding
layer's KV there cannot be recomputed without the positions before it), so it may be shorter
than the tokens the global pages match. `evict_local` tombstones the least recently used local
pages no live slot reads; evicting a node frees its local pages with its global ones.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterator

import numpy as np

from ringserve.kvmem.allocator import KVUsageError, PageAllocator, cdiv, token_locations

_EMPTY = np.zeros(0, np.int32)
_ids = itertools.count()


class TreeNode:
    __slots__ = ("id", "key", "pages", "parent", "children", "lock_ref", "last_access", "extra_key", "alive", "local")

    def __init__(self, key: np.ndarray, pages: np.ndarray, parent: TreeNode | None, extra_key: str | None,
                 local: np.ndarray | None = None):  # fmt: skip
        self.id = next(_ids)
        self.key = key  # int32 token ids of this edge, len == len(pages) * page_size
        self.pages = pages  # int32 page ids holding those tokens' KV
        self.parent = parent
        self.children: dict[object, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.extra_key = extra_key
        self.alive = True
        self.local = local  # int32 local page of each page, 0 = dropped; None without a local space

    def __repr__(self) -> str:
        head = self.key[:8].tolist()
        return f"node {self.id} (pages {self.pages.tolist()}, tokens {head}{'...' if len(self.key) > 8 else ''}, lock_ref {self.lock_ref})"


@dataclasses.dataclass(slots=True)
class MatchResult:
    pages: np.ndarray  # int32 pages of the matched prefix, in order
    node: TreeNode  # deepest matched node (ends exactly at the match); the root if none
    page_size: int
    local: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY)  # int32 their local pages (0: dropped)

    @property
    def length(self) -> int:
        """Matched tokens (a multiple of page_size)."""
        return len(self.pages) * self.page_size

    def locations(self) -> np.ndarray:
        return token_locations(self.pages, self.page_size, self.length)


@dataclasses.dataclass(slots=True)
class InsertResult:
    adopted_from: int  # pages[adopted_from:] now belong to the tree; the caller keeps the rest
    node: TreeNode  # the node ending exactly at the inserted key (the root for an empty key)
    refilled: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY)  # page indices whose local pages the tree took


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 token arrays."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    return n if a.tobytes() == b.tobytes() else int((a != b).argmax())  # bytes compare: the fast path


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator, disable: bool = False,
                 local: PageAllocator | None = None, window: int = 0):  # fmt: skip
        assert allocator.page_size == page_size, "the tree and the allocator disagree on page_size"
        self.page_size = page_size
        self.allocator = allocator
        self.disable = disable
        self.local = local  # the local page space's allocator (kvmem/local.py); None: none
        self.window = window  # the sliding layers' window (tokens), with a local space
        self.root = TreeNode(_EMPTY, _EMPTY, None, None)
        self.evictable_pages = 0  # pages of nodes with lock_ref == 0
        self.protected_pages = 0  # pages of nodes with lock_ref > 0
        self.num_nodes = 0  # excluding the root
        self._clock = 0
        self._heap: list[tuple[int, int, TreeNode]] = []  # (last_access, id, node); stale entries skipped

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    # ---- lookup -----------------------------------------------------------------------------
    def match_prefix(self, key: np.ndarray, extra_key: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `key`. Splits a node so the returned one ends
        exactly at the match, and marks the path used (LRU). Does not lock."""
        key = np.asarray(key, np.int32)
        if self.disable:
            return MatchResult(_EMPTY, self.root, self.page_size)
        if self.local is not None:
            key = key[: self.prefix_len(key, extra_key)]
        self._clock += 1
        node, parts, _ = self._walk(key, extra_key, split=True, touch=True)
        if not node.children and node.lock_ref == 0 and node is not self.root:
            self._push(node)
        pages = np.concatenate(parts) if parts else _EMPTY
        local = self._path_local(node) if self.local is not None else _EMPTY
        return MatchResult(pages, node, self.page_size, local)

    def prefix_len(self, key: np.ndarray, extra_key: str | None = None) -> int:
        """Tokens `match_prefix` would match now, changing nothing (for scheduling order)."""
        if self.disable:
            return 0
        key = np.asarray(key, np.int32)
        node, _, n = self._walk(key, extra_key, split=False, touch=False)
        if self.local is None or n == 0:
            return n
        local = self._path_local(node)  # the pages of whole matched nodes; a part of the next:
        if len(local) * self.page_size < n:
            child = node.children[self._child_key(node, key[len(local) * self.page_size :][: self.page_size], extra_key)]
            assert child.local is not None
            local = np.concatenate([local, child.local[: n // self.page_size - len(local)]])
        return self._windowed(local) * self.page_size

    def _windowed(self, local: np.ndarray) -> int:
        """The most pages j <= len(local) whose last window's local pages are all there."""
        page = self.page_size
        gone = np.flatnonzero(local == 0)
        if gone.size == 0:
            return len(local)
        j = np.arange(len(local), 0, -1)
        last_gone = np.searchsorted(gone, j) - 1  # the last dropped page before j
        before = np.where(last_gone >= 0, gone[np.maximum(last_gone, 0)], -1)
        ok = before < np.maximum(0, j * page - self.window + 1) // page  # local.first_needed of each j
        return int(j[ok][0]) if ok.any() else 0

    def _path_local(self, node: TreeNode) -> np.ndarray:
        parts = []
        while node is not self.root:
            assert node.local is not None and node.parent is not None
            parts.append(node.local)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else _EMPTY

    def _walk(
        self, key: np.ndarray, extra_key: str | None, split: bool, touch: bool
    ) -> tuple[TreeNode, list[np.ndarray], int]:
        page = self.page_size
        n = len(key) - len(key) % page
        node, pos = self.root, 0
        parts: list[np.ndarray] = []
        while pos < n:
            child = node.children.get(self._child_key(node, key[pos : pos + page], extra_key))
            if child is None:
                break
            m = common_prefix_len(child.key, key[pos:n])
            m -= m % page  # >= page: the first page matched
            if m < len(child.key):
                if not split:
                    return node, parts, pos + m
                child = self._split(child, m)
            if touch:
                child.last_access = self._clock
            parts.append(child.pages)
            node, pos = child, pos + m
        return node, parts, pos

    def path_pages(self, node: TreeNode) -> np.ndarray:
        """Pages from the root down to `node`, in order."""
        parts = []
        while node is not self.root:
            parts.append(node.pages)
            assert node.parent is not None
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else _EMPTY

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root (depth first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- insert -----------------------------------------------------------------------------
    def insert(self, key: np.ndarray, pages: np.ndarray, extra_key: str | None = None,
               local: np.ndarray | None = None, refill: bool = False) -> InsertResult:  # fmt: skip
        """Cache `key` (page-aligned) whose KV lives in `pages` (state HELD, the caller's), and
        with a local space in `local` (the caller's local pages; 0: dropped). `refill`: where the
        tree already holds the prefix but dropped a local page the caller still has (its own),
        the tree takes it (a caller letting go of its slot: nothing may still read it there)."""
        page = self.page_size
        key = np.asarray(key, np.int32)
        if len(key) % page or len(pages) * page != len(key):
            raise ValueError(
                f"insert of {len(key)} tokens with {len(pages)} pages of {page}: not page-aligned"
            )
        if self.disable or len(key) == 0:
            return InsertResult(len(pages), self.root)
        self._clock += 1
        node, _, pos = self._walk(key, extra_key, split=True, touch=True)
        refilled = _EMPTY
        if self.local is not None:
            assert local is not None and len(local) == len(pages), "an insert needs its local pages"
            if refill and pos:
                refilled = self._refill(node, np.asarray(local[: pos // page], np.int32))
        if pos < len(key):
            leaf_local = None if local is None or self.local is None else np.array(local[pos // page :], np.int32)
            leaf = TreeNode(key[pos:].copy(), np.array(pages[pos // page :], np.int32), node, extra_key, leaf_local)
            self.allocator.adopt(leaf.pages)  # raises before attaching unless they are HELD
            if leaf_local is not None:
                assert self.local is not None
                self.local.adopt(leaf_local[leaf_local != 0])
            leaf.last_access = self._clock
            node.children[self._child_key(node, leaf.key[:page], extra_key)] = leaf
            self.evictable_pages += len(leaf.pages)
            self.num_nodes += 1
            node = leaf
        if not node.children and node.lock_ref == 0:
            self._push(node)
        return InsertResult(pos // page, node, refilled)

    def _refill(self, node: TreeNode, local: np.ndarray) -> np.ndarray:
        """The caller's local pages (`local`, one per page of `node`'s path) where the path's
        were dropped; returns their page indices."""
        assert self.local is not None
        path = []
        while node is not self.root:
            assert node.parent is not None
            path.append(node)
            node = node.parent
        taken, at = [], 0
        for n in reversed(path):
            assert n.local is not None
            k = len(n.local)
            gap = (n.local == 0) & (local[at : at + k] != 0)
            if gap.any():
                self.local.adopt(local[at : at + k][gap])  # raises unless they are the caller's (HELD)
                n.local = np.where(gap, local[at : at + k], n.local).astype(np.int32)
                taken.append(np.flatnonzero(gap) + at)
            at += k
        return np.concatenate(taken) if taken else _EMPTY

    def _child_key(self, parent: TreeNode, first_page: np.ndarray, extra_key: str | None) -> object:
        return (extra_key, first_page.tobytes()) if parent is self.root else first_page.tobytes()

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child` after `m` tokens (0 < m < len, page-aligned); returns the upper part."""
        page, parent = self.page_size, child.parent
        assert parent is not None
        local = None if child.local is None else child.local[: m // page]
        upper = TreeNode(child.key[:m], child.pages[: m // page], parent, child.extra_key, local)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        parent.children[self._child_key(parent, child.key[:page], child.extra_key)] = upper
        child.key, child.pages, child.parent = child.key[m:], child.pages[m // page :], upper
        if child.local is not None:
            child.local = child.local[m // page :]
        upper.children[self._child_key(upper, child.key[:page], child.extra_key)] = child
        self.num_nodes += 1
        return upper

    # ---- locks ------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        if not node.alive:
            raise KVUsageError(f"inc_lock_ref of {node}: it was evicted")
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        if node is self.root:
            return
        if not node.alive or node.lock_ref <= 0:
            raise KVUsageError(f"dec_lock_ref of {node}: its lock_ref would go below zero")
        while node is not self.root:
            assert node.lock_ref > 0, f"{node}: an ancestor of a locked node is unlocked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
                if not node.children:
                    self._push(node)
            assert node.parent is not None
            node = node.parent

    # ---- eviction ---------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free least recently used unlocked leaves until `num_tokens` are freed (or nothing
        is left to evict). Returns the tokens freed (whole nodes: may exceed the request)."""
        need = cdiv(num_tokens, self.page_size)
        freed = 0
        with self.allocator.free_group():
            while freed < need and self._heap:
                access, _, node = heapq.heappop(self._heap)
                if not node.alive or node.children or node.lock_ref or access != node.last_access:
                    continue  # stale entry
                freed += len(node.pages)
                self._delete_leaf(node)
        return freed * self.page_size

    def evict_local(self, num_pages: int, protected: np.ndarray) -> int:
        """Drop (tombstone) the local pages of the least recently used nodes, none of
        `protected` (what live slots read), until `num_pages` are freed or none is left.
        Returns the local pages freed."""
        assert self.local is not None
        freed = 0
        with self.local.free_group():
            for node in sorted(self.nodes(), key=lambda n: n.last_access):
                if freed >= num_pages:
                    break
                assert node.local is not None
                drop = (node.local != 0) & ~np.isin(node.local, protected)
                if drop.any():
                    self.local.free_tree(node.local[drop])
                    node.local = np.where(drop, 0, node.local).astype(np.int32)
                    freed += int(drop.sum())
        return freed

    def _delete_leaf(self, node: TreeNode) -> None:
        if node.lock_ref:
            raise KVUsageError(f"free of {node}'s pages: it is locked")
        parent = node.parent
        assert parent is not None and not node.children
        self.allocator.free_tree(node.pages)
        if node.local is not None:
            assert self.local is not None
            self.local.free_tree(node.local[node.local != 0])
        del parent.children[self._child_key(parent, node.key[: self.page_size], node.extra_key)]
        node.alive = False
        self.evictable_pages -= len(node.pages)
        self.num_nodes -= 1
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._push(parent)

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 4 * self.num_nodes + 64:  # drop stale entries
            self._heap = [
                (n.last_access, n.id, n) for n in self.nodes() if not n.children and n.lock_ref == 0
            ]
            heapq.heapify(self._heap)

    def reset(self) -> None:
        """flush_cache: free every page of the tree (raises, changing nothing, if any is locked)."""
        nodes = list(self.nodes())
        locked = [n for n in nodes if n.lock_ref]
        if locked:
            raise KVUsageError(f"reset of the radix cache: {locked[0]} is locked; its pages cannot be freed")
        if nodes:
            self.allocator.free_tree(np.concatenate([n.pages for n in nodes]))
            if self.local is not None:
                local = np.concatenate([n.local for n in nodes if n.local is not None])
                self.local.free_tree(local[local != 0])
        for n in nodes:
            n.alive = False
        self.root.children = {}
        self.evictable_pages = self.protected_pages = self.num_nodes = 0
        self._heap = []
