"""Clients that do not read: a connection that floods calls and never reads the replies is held to
a bounded number of calls in flight (the server stops reading it), and a stream whose reader
lags costs the server one snapshot, not one per output (issue 28, failures 6 and 7)."""

from __future__ import annotations

import gc
import json
import socket
import struct
import time

from ringserve.actors.frontend import protocol as p

MAX_CALLS = 1024  # actors/frontend/ipc_server.py MAX_CALLS_PER_CONNECTION
GREEDY = {"temperature": 0, "ignore_eos": True}


def _connect(servers) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(servers.socket_path)
    return s


def _flood(s: socket.socket, frames: bytes, seconds: float) -> int:
    """Send as much of `frames` as the server takes within `seconds`; the bytes sent."""
    s.setblocking(False)
    sent, deadline = 0, time.monotonic() + seconds
    while sent < len(frames) and time.monotonic() < deadline:
        try:
            sent += s.send(frames[sent : sent + 65536])
        except BlockingIOError:
            time.sleep(0.01)
    s.setblocking(True)
    return sent


def _in_flight(servers) -> int:
    return max((len(c.calls) for c in list(servers.ipc._conns)), default=0)


def test_a_connection_that_never_reads_its_replies_is_held_to_a_bounded_number_of_calls(engine, servers):
    frame = p.frame(p.Control(1, "get_server_info"))
    frames = b"".join(p.frame(p.Control(i, "get_server_info")) for i in range(1, 40_001))
    s = _connect(servers)
    try:
        sent = _flood(s, frames, seconds=4.0)
        peak = _in_flight(servers)
        for _ in range(20):  # the calls it did read finish (their replies wait); no new ones start
            time.sleep(0.05)
            peak = max(peak, _in_flight(servers))
        assert peak <= MAX_CALLS, f"{peak} calls in flight on one connection"
        assert sent < len(frames) // 2, f"the server read {sent // len(frame)} calls whose replies nobody reads"
    finally:
        s.close()
    deadline = time.monotonic() + 10
    while servers.ipc.num_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servers.ipc.num_connections == 0


def test_a_flooding_client_that_reads_later_gets_every_reply(engine, servers):
    n = 20_000
    frames = b"".join(p.frame(p.Control(i, "get_weight_version")) for i in range(1, n + 1))
    s = _connect(servers)
    try:
        sent = _flood(s, frames, seconds=1.0)
        assert _in_flight(servers) <= MAX_CALLS
        s.settimeout(30)
        got: set[int] = set()
        buf = b""

        def drain() -> None:
            nonlocal buf
            buf += s.recv(1 << 20)
            while len(buf) >= 4 and len(buf) >= 4 + (k := struct.unpack("<I", buf[:4])[0]):
                msg = p.server_decoder.decode(buf[4 : 4 + k])
                buf = buf[4 + k :]
                assert isinstance(msg, p.Done) and "weight_version" in msg.value, msg
                got.add(msg.id)

        s.setblocking(True)
        rest = memoryview(frames)[sent:]
        while rest:  # reading lets the server read again
            s.setblocking(False)
            try:
                k = s.send(rest[:65536])
                rest = rest[k:]
            except BlockingIOError:
                pass
            s.setblocking(True)
            s.settimeout(0.05)
            try:
                drain()
            except TimeoutError:
                pass
        s.settimeout(30)
        while len(got) < n:
            drain()
        assert got == set(range(1, n + 1))
    finally:
        s.close()


# ---- a stream whose reader lags --------------------------------------------------------------
def _live_snapshots(rids: set[str]) -> int:
    """Result dicts (chunks built for a caller) of these requests still alive in this process."""
    gc.collect()
    return sum(
        1 for o in gc.get_objects()
        if type(o) is dict and "meta_info" in o and isinstance(o["meta_info"], dict) and o["meta_info"].get("id") in rids
    )  # fmt: skip


def _finished(engine, rids: set[str], timeout: float = 60) -> None:
    """Once the requests were submitted and have all finished (their outputs all made)."""
    deadline = time.monotonic() + timeout
    while not rids <= set(engine.frontend.core.states):
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)
    while rids & set(engine.frontend.core.states) or engine.get_load()["num_running_reqs"]:
        assert time.monotonic() < deadline, "the requests never finished"
        time.sleep(0.05)


BIG = {"sampling_params": {**GREEDY, "max_new_tokens": 240}, "return_logprob": True, "top_logprobs_num": 5}


def test_a_stalled_http_stream_holds_one_snapshot_not_one_per_output(engine, servers):
    rids = {f"stall-http-{i}" for i in range(8)}
    body = json.dumps({"input_ids": [[5 + i, 6, 7] for i in range(8)], "rid": sorted(rids), "stream": True,
                       "return_text_in_logprobs": True, **BIG}).encode()  # fmt: skip
    host, port = servers.url.removeprefix("http://").split(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    try:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
        _finished(engine, rids)  # every output made while the reader reads nothing
        live = _live_snapshots(rids)
        assert live <= 2, f"{live} snapshots of one stalled stream held in memory"
    finally:
        s.close()


def test_a_stalled_socket_stream_holds_one_snapshot_not_one_per_output(engine, servers):
    from ringserve.actors.frontend.inputs import GenerateArgs

    rids = [f"stall-ipc-{i}" for i in range(4)]
    args = GenerateArgs(input_ids=[[5 + i, 6, 7] for i in range(4)], rid=rids, stream=True, **BIG)
    s = _connect(servers)
    try:
        s.sendall(p.frame(p.Generate(1, args)))
        _finished(engine, set(rids))
        live = _live_snapshots(set(rids))
        assert live <= 2, f"{live} snapshots of one stalled stream held in memory"
    finally:
        s.close()
# A caller that keeps up gets a chunk per output, and one that lags one chunk of the newest state:
# tests/actors/frontend/test_core.py, exactly, over hand-made outputs.
