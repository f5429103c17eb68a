"""The IPC socket's wire: length-prefixed msgspec frames, one tagged union per direction.

    frame := u32 little-endian N | N bytes of msgpack (N <= the server's frame limit)

A client sends calls, each with an id unique on its connection; the server answers each with
exactly one `Done` (the call's result) or `Failed` (its error: the same exception type and text
the in-process Engine raises). A streamed generate is answered `Started` once its requests are
validated and submitted, then `Chunk`s (each with "index" when the call had several requests),
then `Done`. `Cancel` stops a call (a stream the caller left): the
server aborts what it still runs. Closing the connection cancels every call on it.

The server checks a frame's length before reading its body, and decodes every frame with the
typed decoder of its direction: nothing is pickled, and a frame of another shape is refused.
A generate call carries the caller's `GenerateArgs` (actors/frontend/inputs.py) unchecked; the
frontend validates it exactly as it validates the Engine's.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from actors.frontend.inputs import GenerateArgs

_S = {"omit_defaults": True, "gc": False}
HEADER = struct.Struct("<I")
DEFAULT_MAX_FRAME = 64 << 20  # bytes of one frame's body (a prompt of ~16M tokens)


class FrameTooLarge(ValueError):
    pass


# ---- client -> server ------------------------------------------------------------------------
class Generate(msgspec.Struct, tag="generate", **_S):
    id: int
    args: GenerateArgs  # as the caller gave them (checked by the frontend)


class Abort(msgspec.Struct, tag="abort", **_S):
    id: int
    rid: str | None = None
    abort_all: bool = False


class Control(msgspec.Struct, tag="control", **_S):
    """A verb without generation: pause_generation, continue_generation, flush_cache,
    get_server_info, get_load, health, and the RL / session verbs; `kwargs` are its keyword
    arguments, checked by the frontend like the Engine's."""

    id: int
    verb: str
    kwargs: dict[str, Any] = {}


class Cancel(msgspec.Struct, tag="cancel", **_S):
    id: int  # the call to stop


ClientMsg = Generate | Abort | Control | Cancel


# ---- server -> client ------------------------------------------------------------------------
class Started(msgspec.Struct, tag="started", **_S):
    id: int  # a stream call was validated and submitted; its Chunks follow


class Chunk(msgspec.Struct, tag="chunk", **_S):
    id: int
    value: dict[str, Any]  # one streamed output (with "index" when the call had several)


class Done(msgspec.Struct, tag="done", **_S):
    id: int
    value: Any = None


class Failed(msgspec.Struct, tag="failed", **_S):
    id: int  # 0: the frame could not be read (the server closes the connection)
    kind: str  # ValueError | EngineDead | RuntimeError
    message: str


ServerMsg = Started | Chunk | Done | Failed

_encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(ClientMsg)
server_decoder = msgspec.msgpack.Decoder(ServerMsg)


def frame(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


def body_length(header: bytes, limit: int) -> int:
    (n,) = HEADER.unpack(header)
    if n > limit:
        raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {limit} bytes")
    return n
