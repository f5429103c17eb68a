"""The relay's wire (actors/relay/core.py) over loopback: only a host holding the token joins, a
stranger or a wrong token is dropped without disturbing the hosts that joined, messages arrive
whole and in order, BYE and EOF are told apart, and host 0 sees a host's socket close."""

from __future__ import annotations

import hashlib
import hmac
import selectors
import socket
import threading

import pytest

from ringserve.actors.relay.core import (
    BYE,
    MAGIC,
    U32,
    RelayError,
    RelayListener,
    connect,
    recv_exact,
    recv_frame,
    relay_token,
    send_frame,
)


def listener(token: str = "t0ken") -> RelayListener:
    return RelayListener(("127.0.0.1", 0), token)


def accept_in_thread(lst: RelayListener, ranks: set[int], timeout_s: float = 10.0) -> dict:
    box: dict = {}

    def run() -> None:
        try:
            box["conns"] = lst.accept_hosts(ranks, timeout_s)
        except Exception as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=run)
    t.start()
    box["thread"] = t
    return box


def closed_by_peer(s: socket.socket) -> bool:
    """The peer closed without answering (an EOF, or a reset when our bytes were left unread)."""
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True


def test_hosts_join_and_frames_arrive_in_order_then_bye():
    lst = listener()
    addr = lst.sock.getsockname()
    box = accept_in_thread(lst, {1, 2})
    c1 = connect(addr, "t0ken", 1, 5.0)
    c2 = connect(addr, "t0ken", 2, 5.0)
    box["thread"].join(10)
    lst.close()
    conns = box["conns"]
    assert sorted(conns) == [1, 2] and lst.refused == 0
    msgs = [b"a", bytes(range(256)) * 300, b"\x00" * 5]
    for msg in msgs:
        for c in conns.values():
            send_frame(c, msg)
    for c in conns.values():
        send_frame(c, BYE)
    for c in (c1, c2):
        assert [recv_frame(c) for _ in range(4)] == [*msgs, BYE]
    conns[1].close()
    assert recv_frame(c1) is None  # EOF, not BYE: host 0 is gone
    for c in (c1, c2, conns[2]):
        c.close()


def test_a_stranger_and_a_wrong_token_are_dropped_and_the_host_still_joins():
    lst = listener()
    addr = lst.sock.getsockname()
    box = accept_in_thread(lst, {1})
    with socket.create_connection(addr) as s:  # a stranger: speaks something else
        assert recv_exact(s, len(MAGIC) + 16)[: len(MAGIC)] == MAGIC
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64)
        assert closed_by_peer(s)  # closed without an answer
    with pytest.raises(RelayError, match="refused node 1"):
        connect(addr, "wrong", 1, 5.0)
    with socket.create_connection(addr) as s:  # a replayed handshake of another nonce
        s.recv(len(MAGIC) + 16)
        tag = hmac.new(b"t0ken", b"\x00" * 16 + U32.pack(1), hashlib.sha256).digest()
        s.sendall(MAGIC + U32.pack(1) + tag)
        assert closed_by_peer(s)
    good = connect(addr, "t0ken", 1, 5.0)
    box["thread"].join(10)
    lst.close()
    assert sorted(box["conns"]) == [1] and lst.refused == 3
    with pytest.raises(OSError):  # the listener is closed once every host joined
        socket.create_connection(addr, timeout=2)
    good.close()
    box["conns"][1].close()


def test_an_unexpected_rank_is_refused_and_missing_hosts_time_out():
    lst = listener()
    addr = lst.sock.getsockname()
    box = accept_in_thread(lst, {1}, timeout_s=2.0)
    with pytest.raises(RelayError, match="refused node 3"):
        connect(addr, "t0ken", 3, 5.0)
    box["thread"].join(10)
    lst.close()
    assert isinstance(box["err"], RelayError) and "[1] did not join" in str(box["err"])


def test_host_0_sees_a_host_go_away():
    lst = listener()
    addr = lst.sock.getsockname()
    box = accept_in_thread(lst, {1})
    c1 = connect(addr, "t0ken", 1, 5.0)
    box["thread"].join(10)
    lst.close()
    conn = box["conns"][1]
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ)
    assert sel.select(timeout=0.1) == []  # a live host never sends
    c1.close()
    assert len(sel.select(timeout=5)) == 1 and conn.recv(1) == b""
    conn.close()


def test_the_token_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("RINGSERVE_DIST_TOKEN", raising=False)
    with pytest.raises(ValueError, match="--dist-token"):
        relay_token(None)
    assert relay_token("a") == "a"
    monkeypatch.setenv("RINGSERVE_DIST_TOKEN", "b")
    assert relay_token(None) == "b" and relay_token("a") == "a"
