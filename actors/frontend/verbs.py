"""The verbs the IPC socket and HTTP expose by name, and calling one with checked arguments.

One explicit table (no dispatch by attribute name): a name maps to a coroutine function of the
frontend. Arguments are bound against its signature first, so a wrong or missing argument is a
ValueError naming the verb and the argument, never a TypeError from inside; an argument nested
past MAX_DEPTH (actors/frontend/limits.py) is refused the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from ringserve.actors.frontend.actor import TokenizerManager
from ringserve.actors.frontend.limits import check_depth

Verb = Callable[..., Awaitable[Any]]


def verb_table(tm: TokenizerManager) -> dict[str, Verb]:
    """Every verb the IPC socket serves by name (generate and abort have their own calls)."""
    w = tm.weights
    return {
        "pause_generation": tm.pause_generation,
        "continue_generation": tm.continue_generation,
        "flush_cache": tm.flush_cache,
        "get_server_info": tm.get_server_info,
        "get_model_info": tm.get_model_info,
        "get_load": tm.get_load,
        "get_loads": tm.get_loads,
        "health": tm.health,
        "wait_compiled": tm.wait_compiled,
        "open_session": tm.open_session,
        "close_session": tm.close_session,
        "update_weights_from_disk": w.update_weights_from_disk,
        "init_weights_update_group": w.init_weights_update_group,
        "update_weights_from_distributed": w.update_weights_from_distributed,
        "destroy_weights_update_group": w.destroy_weights_update_group,
        "get_weights_by_name": w.get_weights_by_name,
        "get_weight_version": w.get_weight_version,
        "release_memory_occupation": w.release_memory_occupation,
        "resume_memory_occupation": w.resume_memory_occupation,
        "load_lora_adapter": tm.loras.load_lora_adapter,
        "unload_lora_adapter": tm.loras.unload_lora_adapter,
    }


# The verbs HTTP serves as `/<name>` routes (the others have routes of their own).
HTTP_VERBS = ("update_weights_from_disk", "init_weights_update_group", "update_weights_from_distributed",
              "destroy_weights_update_group", "get_weights_by_name", "get_weight_version",
              "release_memory_occupation", "resume_memory_occupation", "open_session", "close_session",
              "load_lora_adapter", "unload_lora_adapter")  # fmt: skip


async def call_verb(table: dict[str, Verb], name: str, kwargs: dict[str, Any]) -> Any:
    verb = table.get(name)
    if verb is None:
        raise ValueError(f"unknown verb {name!r}; known: {sorted(table)}")
    for key, value in kwargs.items():
        check_depth(value, f"{name}: {key}")
    try:
        inspect.signature(verb).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"{name}: {e}") from None
    return await verb(**kwargs)
