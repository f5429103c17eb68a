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
A frame nested too deep for the decoder is answered `Failed` with its call's id (`peek` reads
the id and the field from the frame's head) and the connection goes on: the frame was read
whole, so the stream is still in step.
A generate call carries the caller's `GenerateArgs` (actors/frontend/inputs.py) unchecked; the
frontend validates it exactly as it validates the Engine's.

A weight push (`Client.update_weights_from_tensor`, actors/frontend/weight_push.py) is one call
that talks both ways; the tensor bytes never travel on the socket, only their headers:

    client                                        server
    PushWeights(id, bucket_bytes, slots, ...) ──►  makes `slots` segments (0600) of bucket_bytes
                                              ◄──  PushReady(id, segment names)
    (writes bucket 0 into segment 0)
    PushBucket(id, slot 0, pieces)            ──►  checks the headers; the runner copies them out
    (writes bucket 1 into segment 1)                of the segment (nothing reaches the device)
    PushBucket(id, slot 1, pieces)            ──►
                                              ◄──  PushAck(id, slot 0): segment 0 is free again
    ...
    PushEnd(id)                               ──►  the runner swaps, all or nothing
                                              ◄──  Done(id, {success, message, weight_version})

A refusal ends the call early with `Done(id, {success: False, ...})`; an error with `Failed`;
`Cancel`, a closed connection (the pusher killed) or `timeout` seconds without a frame end it
too. However it ends, the server unlinks its segments and the runner drops what it staged.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from ringserve.actors.frontend.inputs import GenerateArgs

_S = {"omit_defaults": True, "gc": False}
HEADER = struct.Struct("<I")
DEFAULT_MAX_FRAME = 64 << 20  # bytes of one frame's body (a prompt of ~16M tokens)
PUSH_TIMEOUT_S = 300.0  # default seconds a weight push's server waits for the pusher's next frame


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


class TensorPiece(msgspec.Struct, array_like=True, **_S):
    """Rows [start, start + nbytes / row bytes) along dim 0 of the HF-named tensor `name` (of the
    whole `shape`), at `offset` in a push's segment (actors/frontend/weight_buckets.py); `sparse`
    as TensorRef's (some rows of the tensor, `shape[0]` the end of those sent)."""

    name: str
    dtype: str  # float32 | float16 | bfloat16
    shape: list[int]  # the whole tensor's
    offset: int
    nbytes: int
    start: int = 0  # first row
    sparse: bool = False


class PushWeights(msgspec.Struct, tag="push_weights", **_S):
    """Starts a weight push (see the module docstring); checked like the Engine's arguments."""

    id: int
    bucket_bytes: int
    slots: int = 2  # segments the client fills in turn (2: it writes one while the runner reads the other)
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    timeout: float = PUSH_TIMEOUT_S  # seconds the server waits for the next frame before it gives up
    mode: str = "replace"  # "add": each tensor is a difference to add to the served one
    base_weight_version: str | None = None  # refused unless the engine serves this version


class PushBucket(msgspec.Struct, tag="push_bucket", **_S):
    id: int
    slot: int  # the segment the client wrote (free again once acknowledged)
    tensors: list[TensorPiece]


class PushEnd(msgspec.Struct, tag="push_end", **_S):
    id: int  # every bucket was sent: apply the update


ClientMsg = Generate | Abort | Control | Cancel | PushWeights | PushBucket | PushEnd


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


class PushReady(msgspec.Struct, tag="push_ready", **_S):
    id: int
    segments: list[str]  # posix shared-memory names (mode 0600), one per slot
    size: int  # bytes of each


class PushAck(msgspec.Struct, tag="push_ack", **_S):
    id: int
    slot: int  # its bucket is staged: the client may write this segment again


ServerMsg = Started | Chunk | Done | Failed | PushReady | PushAck

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


# ---- a frame the decoder gave up on ----------------------------------------------------------
_INT = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_STR = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}
_CONTAINER = {*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF}  # fixmap, fixarray, array16/32, map16/32


def peek(body: bytes) -> tuple[int, str] | None:
    """(call id, the first top-level field holding a list or map) of a client frame, read by hand
    from its head without descending into any value; None if the head is not a call's map."""
    try:
        t, i = body[0], 1
        if 0x80 <= t <= 0x8F:
            n = t & 0x0F
        elif t in (0xDE, 0xDF):
            size = 2 if t == 0xDE else 4
            n, i = int.from_bytes(body[1 : 1 + size], "big"), 1 + size
        else:
            return None
        cid, field = None, "frame"
        for _ in range(n):
            key, i = _scalar(body, i)
            if body[i] in _CONTAINER:
                field = str(key)
                break
            value, i = _scalar(body, i)
            if key == "id":
                cid = value
    except (IndexError, ValueError, struct.error):
        return None
    return (cid, field) if isinstance(cid, int) and not isinstance(cid, bool) else None


def _scalar(b: bytes, i: int) -> tuple[Any, int]:
    """The msgpack int, str, nil or bool at b[i] and the index after it (ValueError otherwise)."""
    t = b[i]
    if t <= 0x7F or t >= 0xE0:  # positive / negative fixint
        return (t if t <= 0x7F else t - 0x100), i + 1
    if 0xA0 <= t <= 0xBF or t in _STR:
        if t in _STR:
            head = struct.calcsize(_STR[t])
            (n,), i = struct.unpack_from(_STR[t], b, i + 1), i + 1 + head
        else:
            n, i = t & 0x1F, i + 1
        return b[i : i + n].decode(), i + n
    if t in _INT:
        return struct.unpack_from(_INT[t], b, i + 1)[0], i + 1 + struct.calcsize(_INT[t])
    if t in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[t], i + 1
    raise ValueError(f"msgpack type 0x{t:02x} in a frame's head")
