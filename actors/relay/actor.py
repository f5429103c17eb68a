"""The relay actors: host 0's `run_out` is one more reader of the scheduler's broadcast ring and
writes every message down one TCP stream per other host; host k's `run_in` writes them, in
order, into the ring runner k reads as runner 0 reads its own (actors/relay/core.py has the
wire; actors/relay/blobs.py the bytes of a weight update from tensors, copied into host k's
memory). Either exits non-zero when its peer is gone, which ends its host's actor group: on
host 0 every caller gets EngineDead.
"""

from __future__ import annotations

import json
import selectors

from ringserve.actors.relay.blobs import Received, send_blobs
from ringserve.actors.relay.core import (
    BYE,
    RelayError,
    RelayListener,
    connect,
    recv_frame,
    relay_token,
    send_frame,
)
from ringserve.actors.transport import messages as m
from ringserve.actors.transport.ring import BroadcastRing


def run_out(ctx) -> None:
    """Host 0: ring `inbox` (the runners' broadcast ring, the reader after the local runner's)."""
    args = m.actor_config.decode(ctx.config).args
    listener = RelayListener(args.relay_addr, relay_token(args.dist_token))
    try:
        conns = listener.accept_hosts(set(range(1, args.nnodes)), args.dist_timeout, ctx.stopping)
    finally:
        listener.close()  # later connections are refused by the kernel
    inbox = BroadcastRing.attach(ctx.rings["inbox"], reader=1, spin_us=args.spin_us)
    sel = selectors.DefaultSelector()
    for rank, c in conns.items():
        sel.register(c, selectors.EVENT_READ, rank)
    ctx.ready(json.dumps({"relay": f"{args.relay_addr[0]}:{args.relay_addr[1]}", "hosts": sorted(conns),
                          "refused": listener.refused}).encode())  # fmt: skip
    sent = blob_bytes = 0
    try:
        while not ctx.stopping():
            raw = inbox.recv(timeout=0.05)
            if raw is not None:
                for c in conns.values():
                    blob_bytes += send_blobs(c, raw)  # a weight update's bytes (no-op for other messages)
                    send_frame(c, raw)
                sent += 1
            for key, _ in sel.select(timeout=0):  # a host never sends: readable means it is gone
                raise RelayError(f"host {key.data} closed its relay connection (it died or was stopped)")
    finally:
        if ctx.stopping():  # in order: tell the other hosts to stop too
            for c in conns.values():
                try:
                    send_frame(c, BYE)
                except OSError:
                    pass
        for c in conns.values():
            c.close()
        ctx.log.info("relay: %d messages sent to hosts %s (weight update bytes: %d)", sent, sorted(conns), blob_bytes)


def run_in(ctx) -> None:
    """Host k > 0: ring `outbox` (this host's runner ring, whose one writer this is)."""
    args = m.actor_config.decode(ctx.config).args
    sock = connect(args.relay_addr, relay_token(args.dist_token), args.node_rank, args.dist_timeout, ctx.stopping)
    outbox = BroadcastRing.attach(ctx.rings["outbox"], reader=None, spin_us=args.spin_us)
    ctx.ready(json.dumps({"relay": f"{args.relay_addr[0]}:{args.relay_addr[1]}"}).encode())
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    blobs = Received(ctx.own)  # a weight update's bytes, in this host's segments
    try:
        while not ctx.stopping():
            if not sel.select(timeout=0.5):
                continue
            had = blobs.bytes
            raw = recv_frame(sock, blobs.receive)
            if raw is None:
                raise RelayError("host 0 closed the relay without a goodbye (it died or was killed)")
            if raw == BYE:
                ctx.log.info("relay: host 0 stopped; this host stops too")
                return
            outbox.send(blobs.message(raw), timeout=None)
            if blobs.bytes != had:
                ctx.log.info("relay: a weight update's part, %d bytes, into this host's segments %s",
                             blobs.bytes - had, blobs.held)  # fmt: skip
    finally:
        sock.close()
        blobs.drop()
        ctx.log.info("relay: weight update bytes received: %d", blobs.bytes)
