"""What the step relay (actors/relay/) costs per step, host 0 -> host K over loopback TCP:
the bytes of a decode step's message, and the time one message takes through the relay's
framing and a TCP hop (half a round trip: host 0 sends, the other end echoes each frame).

    .venv/bin/python -m bench.relay [--iters 2000]

prints one line per batch size: message bytes, one-way p50 / p99 in microseconds. A step
pays this once between the scheduler's ring and host K's ring; its device time is not in it.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from actors.relay.core import RelayListener, connect, recv_frame, send_frame
from actors.transport import messages as m


def decode_step(rows: int, seed: int = 0) -> bytes:
    """A decode step of `rows` requests as the scheduler sends it (one FUTURE token per row,
    a new page for one row in 16)."""
    rng = np.random.default_rng(seed)
    new_page = (np.arange(rows) % 16 == 0).astype(np.int32)
    step = m.StepMsg(step_id=12345, slots=m.i32(np.arange(rows)), committed=m.i32(rng.integers(1, 4096, rows)),
                     token_counts=m.i32(np.ones(rows)), tokens=m.i32(-(np.arange(rows) + 1)),
                     page_counts=m.i32(new_page), pages=m.i32(rng.integers(1, 1 << 16, int(new_page.sum()))),
                     keep=m.u8(np.ones(rows)))  # fmt: skip
    return m.encode(step)


def one_way_us(payload: bytes, iters: int) -> list[float]:
    """Host 0's end `a` and host 1's `b`, joined through the relay's own handshake on loopback."""
    lst = RelayListener(("127.0.0.1", 0), "bench")
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(lst.accept_hosts({1}, 10.0)))
    t.start()
    b = connect(lst.sock.getsockname(), "bench", 1, 10.0)
    t.join()
    lst.close()
    a = box[1]

    def echo() -> None:
        while (f := recv_frame(b)) is not None:
            send_frame(b, f)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        send_frame(a, payload)
        recv_frame(a)
        out.append((time.perf_counter() - t0) / 2 * 1e6)
    a.close()
    t.join(5)
    b.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args(argv)
    print(f"{'rows':>5} {'bytes':>7} {'p50 us':>8} {'p99 us':>8}")
    for rows in (1, 16, 64, 256):
        msg = decode_step(rows)
        us = sorted(one_way_us(msg, args.iters))
        print(f"{rows:>5} {len(msg):>7} {statistics.median(us):>8.1f} {us[int(len(us) * 0.99)]:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
