"""A weight update from tensors on the server side: one `Push`, whichever door it came through.

    Engine.update_weights_from_tensor        writes each bucket into the push's segment itself
    Client.update_weights_from_tensor        a trainer process on this host writes the segments
      (IPC socket: `serve_client`)           (the conversation is drawn in protocol.py)
    POST /update_weights_from_tensor         safetensors blobs read off the body into the segment
      (HTTP: `serve_body`)

The server owns the segments: it makes them (`/rs-<pid>-<random>-push<i>`, mode 0600, of
`bucket_bytes`, no memory until written) and `close` unlinks them however the push ends:
committed, refused, failed, timed out (no frame for `timeout` seconds), cancelled, or the pusher
killed (its socket closes, which cancels the call). Each bucket becomes one part of the update
(`UpdateWeightsReq` under the push's id): its header is checked here (`check_pieces`), then the
scheduler forwards it (refused while requests run unless paused, as every weight update) and the
runner copies its pieces out into host arrays. Nothing reaches the device before `commit`; a push
that ends otherwise has its staged parts dropped (an "abandon" part, sent from `close`).

Every part carries the update's `mode` and `base_weight_version` (a delta: the scheduler refuses
any part made against another version than the one serving, before the runner stages it), and
the commit's reply says how many `bytes` of tensor data the push moved.

Only one update runs at a time (the weights API holds a lock across the push); a part in flight
when the push is cancelled still completes in the runner, or finds its segment gone and is
refused: either way the abandon that follows drops it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from ringserve.actors.frontend import protocol as p
from ringserve.actors.frontend.weight_buckets import (
    MAX_HEADER_BYTES,
    MAX_SLOTS,
    Segment,
    check_pieces,
    parse_blob_header,
)
from ringserve.actors.transport import messages as m

Control = Callable[[m.UpdateWeightsReq], Coroutine[Any, Any, dict[str, Any]]]
MAX_TIMEOUT_S = 3600.0
_background: set[asyncio.Task] = set()  # abandons sent from close(), kept until they finish


def check_push_args(slots: Any, timeout: Any) -> None:
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots={slots!r} must be an integer in [1, {MAX_SLOTS}]")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout={timeout!r} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]")


class Push:
    def __init__(self, control: Control, bucket_bytes: int, slots: int, mode: str = "replace",
                 base_weight_version: str | None = None):  # fmt: skip
        self.control = control
        self.mode, self.base_weight_version = mode, base_weight_version
        self.id = secrets.token_hex(8)
        self.parts = 0  # parts sent to the runner (each staged there)
        self.bytes = 0  # tensor data in the parts sent
        self.committed = False
        self.segments: list[Segment] = []
        base = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-push"
        try:
            for i in range(slots):
                self.segments.append(Segment.create(f"{base}{i}", bucket_bytes))
        except BaseException:
            self.close()
            raise

    async def bucket(self, slot: int, pieces: list[p.TensorPiece]) -> dict[str, Any] | None:
        """Stage the bucket in segment `slot`: None once the runner has it (the segment may be
        written again), or the refusal ({success: False, ...}) that ends the push."""
        if not 0 <= slot < len(self.segments):
            raise ValueError(f"bucket {self.parts}: slot={slot} is not one of the push's {len(self.segments)} segments")
        seg = self.segments[slot]
        check_pieces(pieces, seg.size, f"bucket {self.parts}")
        refs = [m.TensorRef(pc.name, pc.dtype, pc.shape, seg.name, pc.offset, pc.nbytes, pc.start, pc.sparse)
                for pc in pieces]  # fmt: skip
        req = self._part(part=self.parts, parts=0, tensors=refs)
        self.parts += 1
        self.bytes += sum(pc.nbytes for pc in pieces)
        out = await self._send(req)
        return None if out["success"] else out

    async def commit(self, weight_version: str | None) -> dict[str, Any]:
        """The last (empty) part: the runner checks every tensor is complete and swaps. A push
        of no tensors changes nothing ({success: True, message: "no tensors"})."""
        if not self.parts:
            return {"success": True, "message": "no tensors", "bytes": 0}
        out = await self._send(self._part(weight_version=weight_version, part=self.parts, parts=self.parts + 1))
        self.committed = out["success"]  # refused (e.g. busy): close() drops what is staged
        return out | {"bytes": self.bytes}

    def _part(self, **kw: Any) -> m.UpdateWeightsReq:
        return m.UpdateWeightsReq("tensor", update=self.id, mode=self.mode, base_weight_version=self.base_weight_version, **kw)

    async def _send(self, req: m.UpdateWeightsReq) -> dict[str, Any]:
        """One part, shielded: cancelling the push does not cancel the part's reply, which the
        frontend still takes off its reply queue in order."""
        fut = asyncio.ensure_future(self.control(req))
        fut.add_done_callback(_observed)
        return await asyncio.shield(fut)

    def close(self) -> None:
        """Unlink every segment; drop whatever the runner staged (unless committed). Synchronous,
        so a cancelled push still does it all."""
        for seg in self.segments:
            seg.close()
        if self.parts and not self.committed:
            self.committed = True
            task = asyncio.get_running_loop().create_task(self.control(m.UpdateWeightsReq("abandon", update=self.id)))
            _background.add(task)
            task.add_done_callback(_background.discard)
            task.add_done_callback(_observed)


def _observed(fut: asyncio.Future) -> None:
    """A reply nobody awaits any more (a cancelled push, an abandon): its error (the engine went
    down) is the callers' news already, not a "never retrieved" warning."""
    if not fut.cancelled():
        fut.exception()


# ---- the IPC socket: a trainer process on this host ------------------------------------------
async def serve_client(push: Push, start: p.PushWeights, inbox: asyncio.Queue,
                       send: Callable[[Any], Awaitable[None]]) -> dict[str, Any]:  # fmt: skip
    """The server's half of the conversation drawn in protocol.py; returns the update's result
    (or a refusal). `inbox` holds the call's PushBucket / PushEnd frames (an Exception put there
    ends the push with it)."""
    await send(p.PushReady(start.id, [s.name for s in push.segments], push.segments[0].size))
    while True:
        try:
            msg = await asyncio.wait_for(inbox.get(), start.timeout)
        except TimeoutError:
            raise ValueError(f"weight push: no bucket for {start.timeout:g} s (timeout); the update is dropped") from None
        if isinstance(msg, Exception):
            raise msg
        if isinstance(msg, p.PushEnd):
            return await push.commit(start.weight_version)
        refused = await push.bucket(msg.slot, msg.tensors)
        if refused is not None:
            return refused
        await send(p.PushAck(start.id, msg.slot))


# ---- HTTP: safetensors blobs in the body -----------------------------------------------------
class BodyReader:
    """Exact reads over an async iterator of byte chunks (a request body), each wait at most
    `timeout` seconds; the data of a blob goes straight into its segment."""

    def __init__(self, chunks: AsyncIterator[bytes], timeout: float):
        self.chunks = chunks
        self.timeout = timeout
        self.buf = b""
        self.done = False

    async def _more(self) -> bool:
        if self.done:
            return False
        try:
            chunk = await asyncio.wait_for(anext(self.chunks, None), self.timeout)
        except TimeoutError:
            raise ValueError(f"weight push: no data for {self.timeout:g} s (timeout); the update is dropped") from None
        if chunk is None:
            self.done = True
            return False
        self.buf += chunk
        return True

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes (fewer only at the end of the body)."""
        while len(self.buf) < n and await self._more():
            pass
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def read_into(self, dst: memoryview) -> int:
        """Fill `dst`; the bytes read (fewer only at the end of the body)."""
        got = 0
        while got < len(dst):
            if not self.buf and not await self._more():
                break
            k = min(len(self.buf), len(dst) - got)
            dst[got : got + k] = self.buf[:k]
            self.buf = self.buf[k:]
            got += k
        return got


async def serve_body(push: Push, reader: BodyReader, weight_version: str | None) -> dict[str, Any]:
    """Every safetensors blob of the body through the push's one segment, then the commit (an
    empty body commits nothing and changes nothing)."""
    seg = push.segments[0]
    k = 0
    while True:
        head = await reader.read(8)
        if not head:
            break
        where = f"bucket {k}"
        if len(head) < 8:
            raise ValueError(f"{where}: the body ends inside the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{where}: a safetensors header of {n} bytes passes the limit of {MAX_HEADER_BYTES}")
        raw = await reader.read(n)
        if len(raw) < n:
            raise ValueError(f"{where}: the body ends inside the safetensors header")
        pieces, size = parse_blob_header(raw, where, seg.size)
        view = seg.view(size)
        try:
            got = await reader.read_into(view)
        finally:
            view.release()
        if got < size:
            raise ValueError(f"{where}: the body ends after {got} of the blob's {size} data bytes")
        refused = await push.bucket(0, pieces)
        if refused is not None:
            return refused
        k += 1
    return await push.commit(weight_version)
