"""LoRA adapters on the frontend: load_lora_adapter / unload_lora_adapter (SGLang's verbs and
JSON bodies), and the names a request's `lora_path` may give.

Each is a control message to the scheduler (`LoraReq`), which picks the pool slot and forwards
it to the runner(s) after every batch in flight; the runner reads the PEFT directory from disk
(the same host: only its path travels) and checks it whole before writing the slot, so a bad
adapter is refused with the reason and the adapters loaded before keep serving. No pause is
needed (actors/scheduler/lora.py: slots, unloading an adapter in use, the prefix cache).

The frontend keeps the loaded names (`names`), refreshed from every reply, so a request naming
an unknown adapter is refused before it is sent (ValueError / HTTP 400 naming lora_path); the
scheduler checks again (an unload may pass a request on its way: that request finishes with
an abort naming lora_path).
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport import messages as m


class Frontend(Protocol):
    async def control(self, msg: Any, kind: str) -> m.ControlReply: ...


class LoraAPI:
    def __init__(self, tm: Frontend, args: ServerArgs):
        self.tm = tm
        self.enabled = args.enable_lora
        self.names: set[str] = set(args.lora_adapters) if args.enable_lora else set()

    def check(self, lora_path: Any, where: str = "lora_path") -> str | None:
        """A request's adapter name, checked: None (the base model) or a loaded adapter's name."""
        if lora_path is None:
            return None
        if not isinstance(lora_path, str) or not lora_path:
            raise ValueError(f"{where}={lora_path!r}: the name of a loaded LoRA adapter (or None)")
        if not self.enabled:
            raise ValueError(f"{where}={lora_path!r}: this server serves no LoRA adapters (start it with enable_lora)")
        if lora_path not in self.names:
            raise ValueError(f"{where}={lora_path!r}: no LoRA adapter of that name is loaded (loaded: {sorted(self.names)})")
        return lora_path

    async def _call(self, msg: m.LoraReq) -> dict[str, Any]:
        r = await self.tm.control(msg, "lora")
        loaded = json.loads(r.payload)["loaded_adapters"] if r.payload else {}
        self.names = set(loaded)
        return {"success": r.ok, "error_message": "" if r.ok else r.message, "message": r.message,
                "loaded_adapters": loaded}  # fmt: skip

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """Load the PEFT adapter directory `lora_path` under `lora_name` while serving.
        Returns {"success", "error_message", "message", "loaded_adapters": {name: path}}; a
        refusal (bad adapter, name taken, no free slot) has success False and the reason."""
        _name(lora_name)
        if not isinstance(lora_path, str) or not lora_path:
            raise ValueError(f"lora_path={lora_path!r} must be a non-empty string (a PEFT adapter directory)")
        if not isinstance(pinned, bool):
            raise ValueError(f"pinned={pinned!r} must be a boolean (every loaded adapter keeps its slot)")
        return await self._call(m.LoraReq("load", lora_name, os.path.abspath(lora_path)))

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload adapter `lora_name`; refused (success False) while a request uses it."""
        _name(lora_name)
        return await self._call(m.LoraReq("unload", lora_name))


def _name(lora_name: Any) -> None:
    if not isinstance(lora_name, str) or not lora_name:
        raise ValueError(f"lora_name={lora_name!r} must be a non-empty string")
