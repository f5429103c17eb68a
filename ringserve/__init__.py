"""ringserve: an LLM serving engine on JAX/Flax (continuous batching, radix prefix cache, paged
KV, chunked prefill, overlap scheduling, interruptible sampling for RL) as a multi-process actor
system over shared-memory rings.

    from ringserve import Engine               # in-process engine (spawns the actor processes)
    from ringserve import Client, AsyncClient  # clients of `ringserve serve`'s IPC socket
    from ringserve import Servers              # the IPC socket and HTTP servers around an Engine
    from ringserve import Rows                 # some rows of a weight, in a (delta) weight update

The one importable top-level name. Its parts install beneath it from the repository's folders
(pyproject.toml maps them): `ringserve.actors` (actors/: the processes and every wire type),
`ringserve.kvmem` (kvmem/: KV bookkeeping, NumPy only), `ringserve.model` (model/: the JAX model
runtime), `ringserve.bench` (bench/: the benchmark harness behind `ringserve bench`) and
`ringserve.integrations` (integrations/: ringserve inside other frameworks' code, each module
importing its framework: `ringserve.integrations.tunix.RingserveRollout`).

Names are imported lazily, so `ringserve cleanup` never pays for JAX or transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

# In a checkout (not an install) the parts are this folder's siblings: a process started with
# PYTHONPATH=<a checkout> (`bench.peers --tree`, a host run from another checkout) imports them
# from that checkout, not from wherever ringserve is installed.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "actors" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))

if TYPE_CHECKING:
    from ringserve.actors.frontend.client import AsyncClient, Client
    from ringserve.actors.frontend.engine import Engine
    from ringserve.actors.frontend.errors import EngineDead
    from ringserve.actors.frontend.server import Servers
    from ringserve.actors.server_args import ServerArgs
    from ringserve.model.weights.delta import Rows

__all__ = ["AsyncClient", "Client", "Engine", "EngineDead", "Rows", "ServerArgs", "Servers", "__version__"]
__version__ = "0.1.0"

_WHERE = {
    "AsyncClient": "ringserve.actors.frontend.client",
    "Client": "ringserve.actors.frontend.client",
    "Engine": "ringserve.actors.frontend.engine",
    "EngineDead": "ringserve.actors.frontend.errors",
    "Rows": "ringserve.model.weights.delta",
    "Servers": "ringserve.actors.frontend.server",
    "ServerArgs": "ringserve.actors.server_args",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ringserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(where), name)
