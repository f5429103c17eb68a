"""ringserve's processes and public surface.

    from actors import Engine            # in-process engine (spawns the actor processes)
    from actors import Client, AsyncClient   # clients of `ringserve serve`'s IPC socket

Layout (one folder per process or subsystem):

    transport/    shared-memory rings, actor processes, the launcher, every wire message,
                  SamplingParams
    frontend/     Engine and the clients; the frontend actor (actor.py: TokenizerManager, its
                  loop and reader threads) around its request table (core.py); GenerateArgs and
                  its validation (inputs.py); the IPC socket and HTTP servers
    scheduler/    the scheduler actor: batches, KV books, overlap
    runner/       the runner actor: the model on device, slot mirrors
    detokenizer/  the detokenizer actor: incremental text, stop strings
    cli/          the `ringserve` command

Names are imported lazily, so `ringserve cleanup` never pays for JAX or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.frontend.client import AsyncClient, Client
    from actors.frontend.engine import Engine
    from actors.frontend.errors import EngineDead
    from actors.frontend.server import Servers
    from actors.server_args import ServerArgs

__all__ = ["AsyncClient", "Client", "Engine", "EngineDead", "ServerArgs", "Servers"]

_WHERE = {
    "AsyncClient": "actors.frontend.client",
    "Client": "actors.frontend.client",
    "Engine": "actors.frontend.engine",
    "EngineDead": "actors.frontend.errors",
    "Servers": "actors.frontend.server",
    "ServerArgs": "actors.server_args",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(where), name)
