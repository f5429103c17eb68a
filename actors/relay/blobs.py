"""A weight update from tensors across hosts: the bytes its references point at go with it.

A runner message of an update from tensors (`RunnerWeights`, source "tensor") names pieces of
shared-memory segments that exist on host 0 only (the push's, actors/frontend/weight_push.py).
Host 0's relay-out sends, before such a message, the bytes it references; host k's relay-in
writes them into segments of its own and rewrites the references, so runner k stages the part
from its own host's memory as runner 0 does from host 0's:

    u32 (BLOBS | H) | H bytes: msgspec Blobs header | the spans' raw bytes, back to back
    u32 L | L bytes: the message itself (as ever)

One span per referenced segment: the bytes [lo, hi) that the message's pieces cover (at most
the segment, i.e. a bucket). A segment that is gone on host 0 (the push ended meanwhile) is sent
as `missing`; host k then points the references at a name that does not exist and runner k
refuses the part as runner 0 does (the agreement refuses it on every host).

Host k's segments (`/rs-<pid>-<hex>-relay<i>`, mode 0600) live until the next weights message
arrives (a later part, the commit, an abandon) or the relay ends. That is late enough: every
part of an update agrees across runners (model/runtime/weight_sync.py), so host 0 sends the next part or
the commit only after runner 0's reply to this one, which comes after every runner staged it.
An abandon may come sooner (a cancelled push); runner k then fails the part, which is dropped.
No pickle: the header is msgspec, the rest raw bytes.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
from collections.abc import Callable

import msgspec

from ringserve.actors.relay.core import BLOBS, U32, RelayError, recv_exact
from ringserve.actors.transport import messages as m

MAX_HEADER = 16 << 20
_WEIGHTS = b"\x92\xa7weights"  # how a RunnerWeights message begins (an array of 2, tag "weights")


class Span(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    segment: str  # host 0's name
    lo: int
    nbytes: int
    missing: bool = False


class Blobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    spans: list[Span]


_decode_blobs = msgspec.msgpack.Decoder(Blobs).decode


def is_weights(raw: bytes) -> bool:
    """Whether a ring message is a RunnerWeights (without decoding it: a step never is)."""
    return raw[: len(_WEIGHTS)] == _WEIGHTS


def tensor_refs(raw: bytes) -> list[m.TensorRef]:
    if not is_weights(raw):
        return []
    msg = m.to_runner.decode(raw)
    return msg.update.tensors if isinstance(msg, m.RunnerWeights) else []


def _spans(refs: list[m.TensorRef]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for r in refs:
        lo, hi = out.get(r.segment, (r.offset, r.offset + r.nbytes))
        out[r.segment] = (min(lo, r.offset), max(hi, r.offset + r.nbytes))
    return out


def send_blobs(sock: socket.socket, raw: bytes) -> int:
    """Host 0: before ring message `raw`, the bytes its tensor references cover (nothing for any
    other message). The bytes sent."""
    refs = tensor_refs(raw)
    if not refs:
        return 0
    import posix_ipc

    spans: list[Span] = []
    maps: list[tuple[mmap.mmap, int, int]] = []
    try:
        for name, (lo, hi) in _spans(refs).items():
            try:
                shm = posix_ipc.SharedMemory(name)
            except posix_ipc.ExistentialError:
                spans.append(Span(name, lo, 0, missing=True))
                continue
            try:
                lo, hi = max(lo, 0), min(hi, shm.size)  # pieces past the segment: runner k refuses them too
                mm = mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ) if hi > lo else None
            finally:
                shm.close_fd()
            spans.append(Span(name, lo, max(hi - lo, 0)))
            if mm is not None:
                maps.append((mm, lo, hi))
        header = msgspec.msgpack.encode(Blobs(spans))
        sock.sendall(U32.pack(BLOBS | len(header)) + header)
        for mm, lo, hi in maps:
            with memoryview(mm) as v:
                sock.sendall(v[lo:hi])
        return sum(s.nbytes for s in spans)
    finally:
        for mm, _, _ in maps:
            mm.close()


class Received:
    """Host k: the segments of the blobs received, until the weights message after them is done
    with (`own(name, True/False)` tells the actor which names to remove if it is orphaned)."""

    def __init__(self, own: Callable[[str, bool], None] = lambda name, add: None):
        self.own = own
        self.prefix = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-relay"
        self.count = 0
        self.pending: dict[str, tuple[str, int]] = {}  # host 0's segment -> (ours, its lo) for the next message
        self.held: list[str] = []  # ours, of the last weights message (its runner may still read them)
        self.bytes = 0

    def receive(self, sock: socket.socket, header_len: int) -> None:
        """The header (its length from the flagged length word) and every span's bytes."""
        import posix_ipc

        if header_len > MAX_HEADER:
            raise RelayError(f"a blobs header of {header_len} bytes (limit {MAX_HEADER})")
        raw = recv_exact(sock, header_len)
        if raw is None:
            raise RelayError("host 0 closed the relay inside a weight update's bytes")
        for span in _decode_blobs(raw).spans:
            name = f"{self.prefix}{self.count}"
            self.count += 1
            if span.missing:
                self.pending[span.segment] = (name, span.lo)  # never created: runner k finds it gone
                continue
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=max(span.nbytes, 1))
            self.own(name, True)
            self.pending[span.segment] = (name, span.lo)
            try:
                with mmap.mmap(shm.fd, shm.size) as mm, memoryview(mm) as v:
                    got = 0
                    while got < span.nbytes:
                        n = sock.recv_into(v[got : span.nbytes])
                        if not n:
                            raise RelayError("host 0 closed the relay inside a weight update's bytes")
                        got += n
            finally:
                shm.close_fd()
            self.bytes += span.nbytes

    def message(self, raw: bytes) -> bytes:
        """Ring message `raw` for this host: a weights message first lets go of the last one's
        segments, then its references point at the segments just received."""
        if not is_weights(raw):
            return raw
        self._unlink(self.held)
        self.held = []
        if not self.pending:
            return raw
        msg = m.to_runner.decode(raw)
        assert isinstance(msg, m.RunnerWeights)
        for r in msg.update.tensors:
            if r.segment not in self.pending:
                raise RelayError(f"a weight update's piece in {r.segment}, whose bytes host 0 did not send")
            name, lo = self.pending[r.segment]
            r.segment, r.offset = name, r.offset - lo
        self.held = [name for name, _ in self.pending.values()]
        self.pending = {}
        return m.encode(msg)

    def drop(self) -> None:
        """Unlink every segment (the relay ends)."""
        self._unlink(self.held + [n for n, _ in self.pending.values()])
        self.held = []
        self.pending = {}

    def _unlink(self, names: list[str]) -> None:
        import posix_ipc

        for name in names:
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass
            self.own(name, False)
