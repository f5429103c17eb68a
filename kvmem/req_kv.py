"""`ReqKV`: kvmem's record of one request's KV (or of a session's kept slot).

It is the single owner of a request's KV lengths; the scheduler's `Req` reads them through
properties. Lengths are in tokens (see kvmem/slots.py for the page table's regions):

    0 <= cached_len <= committed_len <= allocated_len
"""

from __future__ import annotations

import dataclasses

from ringserve.kvmem.radix import TreeNode


@dataclasses.dataclass(slots=True, eq=False)
class ReqKV:
    slot: int  # the request slot (its page table in the slot pool)
    node: TreeNode  # the tree node this record locks (the root: none)
    extra_key: str | None = None  # namespace (LoRA / weight version) of its tree entries
    cached_len: int = 0  # prefix granted at admission (tree match or a session's kept slot)
    committed_len: int = 0  # positions whose KV is written (or scheduled to be, in stream order)
    allocated_len: int = 0  # positions reserved; the page table holds ceil(allocated_len / page) pages
    step: int = -1  # the KVCache step of its latest reserve (kvmem/local.py: what a sweep may drop)
    step_len: int = 0  # committed_len when that reserve came

    def check_lengths(self) -> None:
        assert 0 <= self.cached_len <= self.committed_len <= self.allocated_len, (
            f"slot {self.slot}: cached_len={self.cached_len} committed_len={self.committed_len} "
            f"allocated_len={self.allocated_len} out of order"
        )
