"""What the scheduler reports, built from the core's state and its stats, each key once (SGLang's
names where SGLang has them): `server_info` (the scheduler's part of get_server_info) and `load`
(get_load / v1/loads: what a router or a monitor polls)."""

from __future__ import annotations

from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.transport.loads import GroupLoad


def server_info(core: SchedulerCore) -> dict:
    """The core's scheduling facts and its stats."""
    c, a = core.cache, core.args
    return {
        "running_batch_size": len(core.running),
        "waiting_queue_size": len(core.waiting),
        "running_rids": [r.rid for r in core.running],
        "waiting_rids": [r.rid for r in core.waiting],
        "chunked_req": core.chunked.rid if core.chunked else None,
        "retracted_waiting": sum(1 for r in core.waiting if r.retractions > 0),
        "paused": core.paused,
        "memory_released": sorted(core.memory_released),
        "weight_version": core.weight_version,
        "loaded_lora_adapters": core.loras.loaded() if core.loras is not None else {},
        "available_kv_tokens": c.available_tokens(),
        "initial_kv_tokens": core.initial_tokens,
        "tree_cache_size": c.tree.total_pages * a.page_size,
        # the sliding layers' own pool (kvmem/local.py; 0: none)
        "swa_pool_tokens": 0 if c.local is None else c.local.allocator.capacity * a.page_size,
        "swa_available_tokens": c.local_available_tokens(),
        "swa_sweeps": c.local_sweeps,  # times it ran short and swept every slot's window
        "swa_tombstoned_pages": c.local_tombstoned,  # the tree's local pages dropped for room
        "req_to_token_pool_used": a.max_running_requests - c.num_free_slots,
        "new_token_ratio": round(core.ratio.value, 4),
        "sessions_keeping_kv": len(core.sessions.kept),
        "grammar_cache_size": len(core.grammars.cache) if core.grammars is not None else 0,
        "kept_sessions": {  # what each session keeps between turns (seed 001's postcondition)
            sid: {"committed_len": k.kv.committed_len, "allocated_len": k.kv.allocated_len,
                  "pages": int(c.slots.n_pages[k.kv.slot])}
            for sid, k in core.sessions.kept.items()
        },  # fmt: skip
        **core.stats.as_dict(),
    }


def load(core: SchedulerCore) -> dict:
    """What a router or a monitor polls (SGLang's /get_load and /v1/loads core fields)."""
    total = (core.args.num_pages - 1) * core.args.page_size
    used = total - core.cache.available_tokens()  # evictable prefix-cache pages count as free
    return {
        "num_running_reqs": len(core.running) + (core.chunked is not None),
        "num_waiting_reqs": len(core.waiting),
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": round(used / total, 6),
    }


def group_load(core: SchedulerCore, received: int, received_tokens: int) -> GroupLoad:
    """The load a data-parallel group publishes on the load board (actors/transport/loads.py):
    `load`'s counts, plus the prompt tokens its waiting requests still have to compute."""
    total = (core.args.num_pages - 1) * core.args.page_size
    pending = sum(r.remaining_extend for r in core.waiting)
    if core.chunked is not None:
        pending += core.chunked.remaining_extend
    return GroupLoad(len(core.running) + (core.chunked is not None), len(core.waiting),
                     total - core.cache.available_tokens(), total, pending, received, received_tokens)
