"""What serving on two hosts costs, host 0 -> host K over loopback: the step relay
(actors/relay/) per step, and serving throughput of two hosts against one, in one run.

    .venv/bin/python -m ringserve.bench.relay [--iters 2000] [--requests 16] [--new 64] [--no-serving]

Relay: one line per batch size: the bytes of a decode step's message, and the time one message
takes through the relay's framing and a TCP hop (half a round trip: host 0 sends, the other end
echoes each frame), p50 / p99 in microseconds. A step pays this once between the scheduler's
ring and host K's ring; its device time is not in it.

Serving: the tiny model (random weights), `--requests` random prompts (32-96 tokens), greedy,
`--new` tokens each (ignore EOS), all submitted at once (after a warm-up call), against one
engine at tp=1 and against two hosts at tp=2: an `Engine(nnodes=2, node_rank=0)` here and a
`ringserve serve --node-rank 1` process, one CPU device each, steps through the relay, the TP
all-reduces over gloo. Output tokens per second of wall time; the two runs' outputs compared.

One run (2 cores shared with other sessions' work; `--iters 1000`; load average 1/5/15 min as
the run printed it):

    rows   bytes   p50 us   p99 us          load 2.03 4.45 6.16
       1      57      9.5     13.3
      16     372      9.7     18.3
      64    1397     10.1     21.7
     256    5478     10.4     26.1
    serving, tiny model, 16 requests x 64 tokens:
      1 host,  tp=1:  1021.4 tokens/s  (1.00 s; load 2.32 4.39 6.11)
      2 hosts, tp=2:   448.8 tokens/s  (2.28 s; load 3.79 4.49 6.05)
      outputs equal: True

The tiny model is far too small to gain from splitting: each step's all-reduces over gloo (two
processes on two shared cores) cost more than the halved matmuls save. The relay's own share of
a step is the ~10 us above.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.actors.relay.core import RelayListener, connect, recv_frame, send_frame
from ringserve.actors.transport import messages as m


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


ENGINE = dict(max_running_requests=16, context_length=256, max_prefill_tokens=256, max_total_tokens=8192,
              dist_timeout=180)  # fmt: skip


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _ports() -> int:
    """A free port whose successor (the relay's) is free too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


def _timed(engine: Any, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": new}
    engine.generate(input_ids=prompts[:2], sampling_params=sp)  # warm
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    return time.perf_counter() - t, [o["output_ids"] for o in outs]


def serving(model: Path, requests: int, new: int) -> dict[str, Any]:
    """Wall seconds and outputs of the workload at tp=1 on one host, then at tp=2 on two."""
    from ringserve import Engine

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(32, 97))] for _ in range(requests)]
    for k in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"):  # one CPU device per runner
        os.environ.pop(k, None)
    out: dict[str, Any] = {"load_before": _load()}
    with Engine(str(model), tp_size=1, **ENGINE) as e:
        out["one_s"], one = _timed(e, prompts, new)
    out["load_one"] = _load()
    port, token = _ports(), "bench-relay"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    root = str(Path(__file__).resolve().parents[1])  # host 1 runs this checkout's ringserve
    env = dict(os.environ, RINGSERVE_DIST_TOKEN=token, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))  # fmt: skip
    with tempfile.TemporaryDirectory() as cwd, open(Path(cwd) / "host1.log", "w+") as log:
        health = _ports()
        host1 = subprocess.Popen([sys.executable, "-m", "ringserve.actors.cli.main", "serve", "--model", str(model),
                                  "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
                                  f"127.0.0.1:{port}", "--port", str(health), "--no-socket", *flags],
                                 cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            with Engine(str(model), tp_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}",
                        dist_token=token, **ENGINE) as e:  # fmt: skip
                out["two_s"], two = _timed(e, prompts, new)
            host1.wait(60)
        except BaseException:
            log.seek(0)
            sys.stderr.write("host 1's log:\n" + log.read()[-4000:])
            raise
        finally:
            if host1.poll() is None:
                host1.kill()
                host1.wait()
    out["load_two"] = _load()
    out["tokens"] = requests * new
    out["equal"] = one == two
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ringserve.bench.relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--no-serving", action="store_true", help="the relay's per-step cost only")
    args = ap.parse_args(argv)
    print(f"load {_load()}")
    print(f"{'rows':>5} {'bytes':>7} {'p50 us':>8} {'p99 us':>8}")
    for rows in (1, 16, 64, 256):
        msg = decode_step(rows)
        us = sorted(one_way_us(msg, args.iters))
        print(f"{rows:>5} {len(msg):>7} {statistics.median(us):>8.1f} {us[int(len(us) * 0.99)]:>8.1f}")
    if args.no_serving:
        return 0
    from ringserve.model.checkpoints.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        r = serving(make_tiny_model(Path(d) / "tiny", "llama", seed=0), args.requests, args.new)
    print(f"serving, tiny model, {args.requests} requests x {args.new} tokens (load before {r['load_before']}):")
    print(f"  1 host,  tp=1: {r['tokens'] / r['one_s']:8.1f} tokens/s  ({r['one_s']:.2f} s; load {r['load_one']})")
    print(f"  2 hosts, tp=2: {r['tokens'] / r['two_s']:8.1f} tokens/s  ({r['two_s']:.2f} s; load {r['load_two']})")
    print(f"  outputs equal: {r['equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
