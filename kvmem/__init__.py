"""KV memory bookkeeping (host side, NumPy only: never imports JAX or actors).

allocator.py  PageAllocator: whole pages, page 0 the sink, checked free / adopt; cdiv
slots.py      SlotPool (req_to_token page tables: one request slot per live request)
radix.py      RadixCache: page-granular prefix tree, lock refs, LRU eviction
local.py      LocalTables: the sliding layers' own page space (Gemma 2/3), dropped past the window
req_kv.py     ReqKV: one request's KV record, the owner of its lengths
integrity.py  check_integrity: every page free, in the tree, or held by one live page table
cache.py      KVCache: the facade the scheduler calls, with the per-request contract
sessions.py   SessionSlots: a streaming session keeps its trimmed slot between turns (a layer
              over KVCache)

Imports point down this list; there is no cycle.
"""

from ringserve.kvmem.allocator import KVUsageError, PageAllocator, cdiv, token_locations
from ringserve.kvmem.cache import KVCache
from ringserve.kvmem.integrity import IntegrityError, check_integrity
from ringserve.kvmem.radix import InsertResult, MatchResult, RadixCache, TreeNode, common_prefix_len
from ringserve.kvmem.req_kv import ReqKV
from ringserve.kvmem.sessions import KeptSlot, SessionSlots
from ringserve.kvmem.slots import SlotPool

__all__ = [
    "IntegrityError",
    "InsertResult",
    "KVCache",
    "KVUsageError",
    "KeptSlot",
    "MatchResult",
    "PageAllocator",
    "RadixCache",
    "ReqKV",
    "SessionSlots",
    "SlotPool",
    "TreeNode",
    "cdiv",
    "check_integrity",
    "common_prefix_len",
    "token_locations",
]
