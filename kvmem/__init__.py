"""KV memory bookkeeping (host side, NumPy only: never imports JAX or actors).

allocator.py  PageAllocator: whole pages, page 0 the sink, checked free / adopt
slots.py      SlotPool (req_to_token rows) and ReqKV, one request's record
radix.py      RadixCache: page-granular prefix tree, lock refs, LRU eviction
sessions.py   SessionSlots: a streaming session keeps its trimmed slot between turns
cache.py      KVCache: the four together, with the per-request contract
integrity.py  check_integrity: every page free, in the tree, or held by one live row
"""

from kvmem.allocator import KVUsageError, PageAllocator, token_locations
from kvmem.cache import KVCache
from kvmem.integrity import IntegrityError, check_integrity
from kvmem.radix import InsertResult, MatchResult, RadixCache, TreeNode
from kvmem.sessions import KeptSlot, SessionSlots
from kvmem.slots import ReqKV, SlotPool

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
    "check_integrity",
    "token_locations",
]
