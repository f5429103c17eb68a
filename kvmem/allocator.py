"""Whole-page KV allocator: a NumPy free stack plus one state byte per page.

A KV location is `page * page_size + offset` (offset < page_size). Page 0 is the sink that
padding tokens write into; it is never handed out. Every other page is in exactly one state:

    FREE  on the free stack (or in the pending list of an open free group)
    HELD  owned by one request's slot (alloc -> HELD; free: HELD -> FREE)
    TREE  owned by the radix tree (adopt: HELD -> TREE; free_tree: TREE -> FREE, eviction only)

A transition from any other state raises `KVUsageError` naming the page (double free, free of a
page never allocated, a request freeing a page the tree owns), before anything is changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

FREE, HELD, TREE, SINK = 0, 1, 2, 3
STATE_NAMES = {FREE: "free", HELD: "held by a request", TREE: "held by the radix tree", SINK: "the sink"}
_WHY = {
    FREE: "it is already free (double free, or never allocated)",
    HELD: "it is held by a request",
    TREE: "it is held by the radix tree (only eviction of its unlocked node frees it)",
    SINK: "page 0 is the sink and never handed out",
}
_EMPTY = np.zeros(0, np.int32)


def cdiv(a: Any, b: Any) -> Any:
    """ceil(a / b) for integers or integer arrays (NumPy or JAX): pages covering a tokens,
    chunks covering a keys, ... The code base's one ceiling division."""
    return -(-a // b)


class KVUsageError(RuntimeError):
    """Bad use of kvmem (double free, unlocking below zero, freeing tree pages, ...)."""


def token_locations(pages: np.ndarray, page_size: int, n_tokens: int) -> np.ndarray:
    """KV locations of the first `n_tokens` positions of a page table."""
    pos = np.arange(n_tokens, dtype=np.int64)
    return pages[pos // page_size].astype(np.int64) * page_size + pos % page_size


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 2 (page 0 is the sink) and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages = num_pages  # including the sink
        self.page_size = page_size
        self.state = np.zeros(num_pages, np.uint8)
        self._stack = np.zeros(num_pages, np.int32)  # free pages; alloc pops from the top
        self._n_free = 0
        self._pending: list[np.ndarray] = []  # frees of an open group, pushed at its end
        self._group_depth = 0
        self.reset()

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages allocatable now (frees of an open group count once the group ends)."""
        return self._n_free

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the sink)."""
        return self.num_pages - 1

    def free_pages(self) -> np.ndarray:
        """Every FREE page: the stack plus the pending frees of an open group."""
        return np.concatenate([self._stack[: self._n_free], *self._pending])

    # ---- transitions ------------------------------------------------------------------------
    def reset(self) -> None:
        """All pages FREE, handed out in ascending order again (only when none is in use)."""
        used = np.flatnonzero(self.state[1:] != FREE) + 1
        if used.size:
            raise KVUsageError(
                f"allocator reset while page {int(used[0])} is {STATE_NAMES[int(self.state[used[0]])]}"
            )
        self.state[:] = FREE
        self.state[0] = SINK
        self._n_free = self.num_pages - 1
        self._stack[: self._n_free] = np.arange(self.num_pages - 1, 0, -1, dtype=np.int32)
        self._pending.clear()

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` pages (FREE -> HELD), or None (nothing changed) when fewer are free."""
        if n > self._n_free:
            return None
        if n <= 0:
            return _EMPTY
        top = self._n_free
        pages = self._stack[top - n : top][::-1].copy()
        self._n_free = top - n
        self.state[pages] = HELD
        return pages

    def free(self, pages: np.ndarray) -> None:
        """Give back a request's pages (HELD -> FREE)."""
        self._release(pages, HELD, "free")

    def free_tree(self, pages: np.ndarray) -> None:
        """Give back pages the radix tree evicted (TREE -> FREE)."""
        self._release(pages, TREE, "free_tree")

    def adopt(self, pages: np.ndarray) -> None:
        """The radix tree takes over a request's pages (HELD -> TREE)."""
        pages = self._checked(pages, HELD, "adopt")
        self.state[pages] = TREE

    @contextlib.contextmanager
    def free_group(self) -> Iterator[None]:
        """Frees inside are checked and marked at once but pushed in one operation at the end."""
        self._group_depth += 1
        try:
            yield
        finally:
            self._group_depth -= 1
            if self._group_depth == 0 and self._pending:
                self._push(np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0])
                self._pending.clear()

    # ---- internals --------------------------------------------------------------------------
    def _release(self, pages: np.ndarray, expect: int, what: str) -> None:
        pages = self._checked(pages, expect, what)
        if pages.size == 0:
            return
        self.state[pages] = FREE
        if self._group_depth:
            self._pending.append(pages)
        else:
            self._push(pages)

    def _push(self, pages: np.ndarray) -> None:
        n = self._n_free
        self._stack[n : n + pages.size] = pages[::-1]  # the next alloc returns them in order
        self._n_free = n + pages.size

    def _checked(self, pages: np.ndarray, expect: int, what: str) -> np.ndarray:
        pages = np.asarray(pages)
        if pages.dtype != np.int32:
            pages = pages.astype(np.int32)
        if pages.size == 0:
            return pages
        ordered = np.sort(pages)  # gives the range and the duplicates in one pass
        if ordered[0] < 0 or ordered[-1] >= self.num_pages:
            bad = next(int(p) for p in pages if not 0 <= p < self.num_pages)
            raise KVUsageError(f"{what} of page {bad}: out of range [1, {self.num_pages})")
        states = self.state[pages]
        if states.tobytes() != bytes((expect,)) * len(states):  # a bytes compare is the fastest check
            i = int((states != expect).argmax())
            p, s = int(pages[i]), int(states[i])
            raise KVUsageError(f"{what} of page {p}: {_WHY[s]}, expected {STATE_NAMES[expect]}")
        if pages.size > 1 and np.count_nonzero(ordered[1:] == ordered[:-1]):
            dup = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
            raise KVUsageError(f"{what} of page {dup}: it appears twice in one call")
        return pages
