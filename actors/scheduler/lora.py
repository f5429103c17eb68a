"""The scheduler's adapter table: which LoRA adapters are loaded, in which pool slot, and the
prefix-cache namespace of each (a part the core asks; the runner holds the weights).

Slots: the runner's pool has `max_loras_per_batch` adapter slots (plus slot 0, no adapter), and
an adapter holds its slot from load to unload, so every adapter loaded can be in every batch:
a batch never mixes more than max_loras_per_batch adapters because no more are loaded. A load
past that is refused (unload one first); there is no eviction to host memory and back (SGLang's
`max_loaded_loras` > `max_loras_per_batch`), so a request never waits for a slot.

Unloading an adapter that a request (waiting or running) uses is refused with their count (the
caller retries after they finish), so a slot is never cleared or rewritten under a request.

Prefix cache: a prefix computed under adapter X holds X's keys and values (every targeted k/v
projection differs), so the radix tree is namespaced per adapter load: `cache_key` is the
weight version plus the load's serial number (`uid`). A name loaded again (same or other path)
gets a new uid, so nothing cached under its earlier load matches.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class LoadedLora:
    name: str
    path: str
    slot: int  # 1 .. max_loras_per_batch in the runner's pool
    uid: int  # serial number of the load (namespaces the prefix cache)


class LoraTable:
    def __init__(self, slots: int, adapters: dict[str, str] | None = None):
        """`slots`: max_loras_per_batch; `adapters`: the start-up ones (name -> path), put in
        slots 1, 2, ... in order, as the runner loads them (actors/runner/core.py start_loras)."""
        self.slots = slots
        self.by_name: dict[str, LoadedLora] = {}
        self._loads = 0
        for slot, (name, path) in enumerate((adapters or {}).items(), start=1):
            self.add(name, path, slot)

    def get(self, name: str) -> LoadedLora:
        """The loaded adapter `name`; ValueError naming lora_path otherwise."""
        a = self.by_name.get(name)
        if a is None:
            raise ValueError(f"lora_path={name!r}: no LoRA adapter of that name is loaded (loaded: {sorted(self.by_name)})")
        return a

    def free_slot(self, name: str) -> int:
        """The slot a load of `name` would take; ValueError if the name is taken or no slot is free."""
        if name in self.by_name:
            raise ValueError(f"lora_name={name!r} is already loaded (from {self.by_name[name].path!r}); unload it first")
        used = {a.slot for a in self.by_name.values()}
        free = [s for s in range(1, self.slots + 1) if s not in used]
        if not free:
            raise ValueError(f"all {self.slots} LoRA slots are taken (max_loras_per_batch={self.slots}); "
                             "unload an adapter first")  # fmt: skip
        return free[0]

    def add(self, name: str, path: str, slot: int) -> LoadedLora:
        self._loads += 1
        a = self.by_name[name] = LoadedLora(name, path, slot, self._loads)
        return a

    def remove(self, name: str) -> LoadedLora:
        return self.by_name.pop(name)

    def loaded(self) -> dict[str, str]:
        """{name: path} of every loaded adapter (SGLang's loaded_adapters)."""
        return {a.name: a.path for a in self.by_name.values()}


def cache_key(weight_version: str, lora: LoadedLora | None, salt: str | None = None) -> str:
    """The prefix cache's namespace of a request: the weights, the adapter load if any, and the
    request's cache_salt if any (vLLM's: prefixes are shared only among equal salts)."""
    key = weight_version if lora is None else f"{weight_version}\x1flora:{lora.uid}"
    return key if salt is None else f"{key}\x1fsalt:{salt}"
