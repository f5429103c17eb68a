"""The step relay between hosts, without its rings: host 0 listens, every other host connects,
each proves it holds the cluster's token, then host 0 sends the scheduler's step and control
messages down each connection, unchanged and in order (actors/relay/actor.py owns the loops).

    host k                                   host 0 (RelayListener, bound to the address given)
    connect ───────────────────────────────► accept
            ◄───────── MAGIC | nonce (16 B) ─
    MAGIC | u32 k | HMAC-SHA256(token, nonce | u32 k) (32 B) ──►  checked (compare_digest);
            ◄────────────────────── b"OK" ─   wrong: the connection is closed, nothing else
    then, host 0 → host k only:  u32 L | L bytes (one ring message), ...;  L = 0: BYE (host 0
    stops in order); L with bit 31 set: a weight update's bytes, before its message
    (actors/relay/blobs.py). Host k never sends after the handshake: readable from host 0's side means
    EOF or a reset, i.e. host k is gone.

Little-endian throughout. The token never crosses the wire (only a MAC of a fresh nonce), so a
stranger who sees a handshake cannot replay it. No pickle: the payloads are msgspec frames that
only the runner decodes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable

MAGIC = b"RSRELAY1"
U32 = struct.Struct("<I")
NONCE, TAG = 16, 32
BYE = b""
BLOBS = 1 << 31  # a length word with this bit: a weight update's bytes follow (actors/relay/blobs.py)
HANDSHAKE_S = 5.0  # a peer that has not finished its handshake within this is dropped

log = logging.getLogger("ringserve.relay")


class RelayError(ConnectionError):
    """The relay failed: a host is gone, refused, or never came."""


def relay_token(given: str | None) -> str:
    """The cluster's shared secret: the flag, else $RINGSERVE_DIST_TOKEN (the same on every host)."""
    token = given or os.environ.get("RINGSERVE_DIST_TOKEN", "")
    if not token:
        raise ValueError(
            "nnodes > 1 needs the hosts' shared relay secret: --dist-token T or RINGSERVE_DIST_TOKEN=T, the same "
            "on every host (e.g. T=$(python -c 'import secrets; print(secrets.token_hex(16))'))"
        )
    return token


def _tag(token: str, nonce: bytes, rank: int) -> bytes:
    return hmac.new(token.encode(), nonce + U32.pack(rank), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None at EOF before all of them."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(U32.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, on_blobs: Callable[[socket.socket, int], None] | None = None) -> bytes | None:
    """One message (b"" is BYE), or None at EOF (host 0 is gone). A weight update's bytes before
    it (a length word with BLOBS set, actors/relay/blobs.py) go to `on_blobs(sock, header
    length)`, which reads them off the socket."""
    while True:
        head = recv_exact(sock, 4)
        if head is None:
            return None
        (n,) = U32.unpack(head)
        if n & BLOBS:
            if on_blobs is None:
                raise RelayError("a weight update's bytes where only messages were expected")
            on_blobs(sock, n & ~BLOBS)
            continue
        if n == 0:
            return BYE
        return recv_exact(sock, n)


class RelayListener:
    """Host 0's side: a listening socket on exactly `addr` (never every interface unless asked)."""

    def __init__(self, addr: tuple[str, int], token: str):
        host, port = addr
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.token = token
        self.refused = 0  # connections dropped at the handshake

    def accept_hosts(self, ranks: set[int], timeout_s: float, stopping=lambda: False) -> dict[int, socket.socket]:
        """Wait until every host of `ranks` has connected and authenticated; {rank: socket}. A
        connection that fails the handshake (a stranger, a wrong token, a rank already here or
        not expected) is closed and counted in `refused`. RelayError once `timeout_s` pass."""
        got: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0 or stopping():
                for s in got.values():
                    s.close()
                raise RelayError(f"hosts {sorted(ranks - set(got))} did not join the relay within {timeout_s} s")
            self.sock.settimeout(min(left, 0.5))
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            rank = self._handshake(conn, ranks - set(got))
            if rank is None:
                self.refused += 1
                log.warning("relay: refused a connection from %s (bad handshake)", peer)
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            got[rank] = conn
        return got

    def _handshake(self, conn: socket.socket, expected: set[int]) -> int | None:
        try:
            conn.settimeout(HANDSHAKE_S)
            nonce = secrets.token_bytes(NONCE)
            conn.sendall(MAGIC + nonce)
            msg = recv_exact(conn, len(MAGIC) + 4 + TAG)
            if msg is None or msg[: len(MAGIC)] != MAGIC:
                return None
            (rank,) = U32.unpack_from(msg, len(MAGIC))
            if rank not in expected or not hmac.compare_digest(msg[len(MAGIC) + 4 :], _tag(self.token, nonce, rank)):
                return None
            conn.sendall(b"OK")
            return rank
        except OSError:
            return None

    def close(self) -> None:
        self.sock.close()


def connect(addr: tuple[str, int], token: str, rank: int, timeout_s: float, stopping=lambda: False) -> socket.socket:
    """Host `rank`'s side: connect to host 0's relay (retrying until it listens, at most
    `timeout_s`) and authenticate. RelayError if refused or out of time."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline and not stopping():
        try:
            sock = socket.create_connection(addr, timeout=HANDSHAKE_S)
        except OSError as e:  # not listening yet
            last = e
            time.sleep(0.2)
            continue
        try:
            hello = recv_exact(sock, len(MAGIC) + NONCE)
            if hello is None or hello[: len(MAGIC)] != MAGIC:
                raise RelayError(f"{addr} is not a ringserve relay")
            sock.sendall(MAGIC + U32.pack(rank) + _tag(token, hello[len(MAGIC) :], rank))
            if recv_exact(sock, 2) != b"OK":
                raise RelayError(f"host 0's relay at {addr} refused node {rank} (another --dist-token, or a rank "
                                 "already joined)")  # fmt: skip
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise RelayError(f"could not reach host 0's relay at {addr} within {timeout_s} s: {last}")
