"""How long the RL loop's weight sync takes: update_weights_from_disk, update_weights_from_tensor
(every tensor, and one layer's) in the Engine's process, the same tensors pushed from another
process (a trainer on this host: `Client.update_weights_from_tensor` through shared memory) and
over HTTP (safetensors blobs, as from another host), and a release / resume of device memory.

    python -m ringserve.bench.weights --model smollm2 [--repeat 1] [--bucket-mb 64]

The engine is paused with retract around each update, as an RL framework does; the numbers are
the wall time of the call as the caller sees it (the runner loads, checks and swaps; nothing
recompiles: the trace count is printed before and after). The pusher process holds the tensors
in memory before its clock starts, as a trainer does. MiB/s is the tensors' bytes over that time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np

FULL = ("from_disk", "from_tensor_all", "from_tensor_other_process", "from_tensor_http")  # every tensor
ALL = (*FULL, "from_tensor_one_layer", "release_memory", "resume_memory")


def _timed(fn) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


_PUSHER = """
import json, sys, time
import httpx
from safetensors.numpy import load_file
from ringserve import Client
from ringserve.actors.frontend.weight_buckets import safetensors_stream

socket_path, url, checkpoint, bucket = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tensors = load_file(checkpoint)  # in memory before the clock starts, as a trainer's
with Client(socket_path) as c:
    print("ready", flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        if line.strip() == "client":
            r = c.update_weights_from_tensor(tensors, bucket_bytes=bucket)
        else:
            r = httpx.post(url + "/update_weights_from_tensor", content=safetensors_stream(tensors, bucket),
                           headers={"content-type": "application/octet-stream"}, timeout=600).json()
        print(json.dumps({"seconds": time.perf_counter() - t0, **r}), flush=True)
"""


class Pusher:
    """A second process holding a checkpoint's tensors; each `push(kind)` times one update from
    it ("client": the IPC socket + shared memory; "http": safetensors blobs over HTTP)."""

    def __init__(self, socket_path: str, url: str, checkpoint: str, bucket_bytes: int):
        import json

        self.json = json
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_PUSHER), socket_path, url, checkpoint,
                                      str(bucket_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def push(self, kind: str) -> tuple[float, dict]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(kind + "\n")
        self.proc.stdin.flush()
        r = self.json.loads(self.proc.stdout.readline())
        return r.pop("seconds"), r

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.weights", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--max-prefill-tokens", type=int, default=1024)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--bucket-mb", type=int, default=64, help="bucket size of every update from tensors (MiB)")
    args = ap.parse_args(argv)
    bucket = args.bucket_mb << 20

    from ringserve import Engine, Servers
    from ringserve.model.checkpoints.load import load_checkpoint

    with Engine(args.model, context_length=args.context_length, max_total_tokens=args.max_total_tokens,
                max_running_requests=16, max_prefill_tokens=args.max_prefill_tokens) as engine, \
            Servers(engine, host="127.0.0.1", port=0) as servers:  # fmt: skip
        path = str(engine.model_dir)
        assert servers.socket_path is not None and servers.url is not None
        pusher = Pusher(servers.socket_path, servers.url, str(engine.model_dir / "model.safetensors"), bucket)
        tensors = {k: np.array(v) for k, v in load_checkpoint(engine.model_dir)[1].items()}
        nbytes = sum(a.nbytes for a in tensors.values())
        layer = {k: v for k, v in tensors.items() if ".layers.0." in k}
        traces = engine.wait_compiled()["runner_trace_count"]
        engine.pause_generation("retract")
        runs: dict[str, list[float]] = {name: [] for name in ALL}
        try:
            for _ in range(args.repeat):
                for name, call in (
                    ("from_disk", lambda: _timed(lambda: engine.update_weights_from_disk(path))),
                    ("from_tensor_all", lambda: _timed(lambda: engine.update_weights_from_tensor(tensors, bucket_bytes=bucket))),
                    ("from_tensor_other_process", lambda: pusher.push("client")),
                    ("from_tensor_http", lambda: pusher.push("http")),
                    ("from_tensor_one_layer", lambda: _timed(lambda: engine.update_weights_from_tensor(layer))),
                    ("release_memory", lambda: _timed(lambda: engine.release_memory_occupation())),
                    ("resume_memory", lambda: _timed(lambda: engine.resume_memory_occupation())),
                ):  # fmt: skip
                    dt, r = call()
                    assert r["success"], r
                    runs[name].append(dt)
        finally:
            pusher.close()
        engine.continue_generation()
        after = engine.get_server_info()["runner_trace_count"]
        out = {name: statistics.median(xs) for name, xs in runs.items()}
    mb = nbytes / 2**20
    print(f"\n{args.model}: {len(tensors)} tensors, {mb:.0f} MiB as loaded; {args.bucket_mb} MiB buckets; "
          f"median of {args.repeat}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", file=sys.stderr)  # fmt: skip
    for name, s in out.items():
        extra = f"  ({mb / s:.0f} MiB/s)" if name in FULL else ""
        print(f"{name:26s} {s * 1e3:9.1f} ms{extra}")
    print(f"step programs traced: {traces} before, {after} after (nothing recompiled: {traces == after})")
    return out


if __name__ == "__main__":
    main()
