"""One weight update's wall time and bytes per second by the path it takes, every path on one
engine in one process, for one table (the paths alternate run by run, so drift in the machine
hits each alike):

    python -m ringserve.bench.weight_updates --model tiny|smollm2-135m|llama-3.2-1b|DIR \
        [--paths disk,host,client,http,group,device,delta1,delta10] [--repeat 3] [--dtype bfloat16]

    disk     update_weights_from_disk of a checkpoint holding the tensors (written once, before)
    host     Engine.update_weights_from_tensor of NumPy arrays: the shared-memory push
             (actors/frontend/weight_push.py), staged on the host, the state built there and placed
    client   the same push from a Client over the IPC socket, in a trainer's process of its own
    http     POST /update_weights_from_tensor, safetensors blobs in the body (another host's
             door), from a process of its own
    group    SGLang's update group: a trainer process (bench/group_trainer.py) broadcasts every
             tensor over gloo to the runner (actors/runner/weight_group.py)
    device   the tensors as JAX arrays on this process's devices (a trainer's, held before the
             clock starts), lent to the runner in this process and built on the device
             (actors/frontend/weight_local.py, model/weights/device_state.py)
    delta1   a delta: `Rows` of 1% of every tensor's rows, mode "add", base_weight_version
    delta10  the same with 10%

The engine runs its runner in this process (`runner_in_process`, as a trainer's does) and is
paused with retract around the updates, as an RL framework does; a time is the call's wall time
as the caller sees it (received, checked, built, swapped; nothing recompiles); bytes are the
tensor data the path moved (a delta's rows only). The tensors are the model's own weights in
`--dtype` (default: as stored), so every update leaves the outputs as they were.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Bench:
    """What the paths share: the engine, its servers, the tensors as a checkpoint on disk, and
    the update group's trainer (started by the first "group" run)."""

    engine: Any
    servers: Any
    checkpoint: Path
    trainer: Any = None
    deltas: dict[float, dict[str, Any]] = field(default_factory=dict)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.stdin.write("quit\n")
            self.trainer.stdin.flush()
            self.trainer.wait(timeout=120)
            self.engine.destroy_weights_update_group("bench")


Update = Callable[[Bench, dict[str, np.ndarray]], tuple[float, dict, int]]


def _nbytes(tensors: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in tensors.values())


def _timed(call: Callable[[], dict]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = call()
    return time.perf_counter() - t0, r


def _disk(b: Bench, tensors: dict[str, np.ndarray]) -> tuple[float, dict, int]:
    return (*_timed(lambda: b.engine.update_weights_from_disk(str(b.checkpoint))), _nbytes(tensors))


def _host(b: Bench, tensors: dict[str, np.ndarray]) -> tuple[float, dict, int]:
    return (*_timed(lambda: b.engine.update_weights_from_tensor(tensors)), _nbytes(tensors))


# The trainer's side of the Client and HTTP doors runs in a process of its own (as a trainer's
# does): in this one it would share the GIL with the server's loop and the runner.
_PUSHER = """
import json, sys, time
from ringserve.model.checkpoints.load import load_checkpoint
door, where, checkpoint = sys.argv[1:4]
tensors = load_checkpoint(checkpoint)[1]  # (memory-mapped; bf16 as ml_dtypes')
if door == "client":
    from ringserve import Client
    with Client(where) as c:
        t0 = time.perf_counter()
        r = c.update_weights_from_tensor(tensors)
else:
    import httpx
    from ringserve.actors.frontend.weight_buckets import safetensors_stream
    t0 = time.perf_counter()
    r = httpx.post(where + "/update_weights_from_tensor", content=safetensors_stream(tensors.items()), timeout=3600,
                   headers={"content-type": "application/octet-stream"}).json()
print(json.dumps({"seconds": time.perf_counter() - t0, "reply": r}))
"""


def _pushed(door: str, where: str, b: Bench, tensors: dict[str, np.ndarray]) -> tuple[float, dict, int]:
    import json

    out = subprocess.run([sys.executable, "-c", _PUSHER, door, where, str(b.checkpoint)],
                         capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["seconds"], r["reply"], _nbytes(tensors)


def _client(b: Bench, tensors: dict[str, np.ndarray]) -> tuple[float, dict, int]:
    return _pushed("client", b.servers.socket_path, b, tensors)


def _http(b: Bench, tensors: dict[str, np.ndarray]) -> tuple[float, dict, int]:
    return _pushed("http", f"http://127.0.0.1:{b.servers.port}", b, tensors)


def _group(b: Bench, tensors: dict[str, np.ndarray]) -> tuple[float, dict, int]:
    import socket

    from ringserve.bench.group_trainer import specs

    if b.trainer is None:  # joined once (not timed): a trainer makes its group at start-up
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        b.trainer = subprocess.Popen([sys.executable, "-m", "ringserve.bench.group_trainer", str(port), "2", "bench",
                                      str(b.checkpoint)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        r = b.engine.init_weights_update_group("127.0.0.1", port, 1, 2, "bench")
        assert r["success"] and b.trainer.stdout.readline().strip() == "joined", r
    names, dtypes, shapes = specs(str(b.checkpoint))
    b.trainer.stdin.write("go\n")
    b.trainer.stdin.flush()
    out = _timed(lambda: b.engine.update_weights_from_distributed(names, dtypes, shapes, "bench"))
    assert b.trainer.stdout.readline().startswith("sent")
    return (*out, _nbytes(tensors))


def _device(b: Bench, tensors: dict[str, np.ndarray]) -> tuple[float, dict, int]:
    import jax

    arrays = jax.block_until_ready({n: jax.device_put(a) for n, a in tensors.items()})  # held before the clock
    return (*_timed(lambda: b.engine.update_weights_from_tensor(arrays)), _nbytes(tensors))


def _delta(fraction: float) -> Update:
    def run(b: Bench, tensors: dict[str, np.ndarray]) -> tuple[float, dict, int]:
        from ringserve import Rows

        rows = b.deltas.get(fraction)
        if rows is None:  # every tensor's first `fraction` of rows (at least one), + 0: outputs unchanged
            rows = b.deltas[fraction] = {n: Rows(0, np.zeros_like(a[: max(1, round(len(a) * fraction))]))
                                         for n, a in tensors.items() if a.ndim}  # fmt: skip
        base = b.engine.get_server_info()["weight_version"]
        out = _timed(lambda: b.engine.update_weights_from_tensor(rows, mode="add", base_weight_version=base))
        return (*out, sum(r.array.nbytes for r in rows.values()))

    return run


PATHS: dict[str, Update] = {"disk": _disk, "host": _host, "client": _client, "http": _http, "group": _group,
                            "device": _device, "delta1": _delta(0.01), "delta10": _delta(0.10)}  # fmt: skip


def run(model: str, paths: list[str], repeat: int, send_dtype: str | None = None,
        **engine_options: Any) -> dict[str, list[tuple[float, int]]]:  # fmt: skip
    """Every path's `repeat` times (the runs in order: a first run compiles what it needs):
    (seconds, bytes) each."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from ringserve import Engine, Servers
    from ringserve.model.checkpoints.load import load_checkpoint

    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise ValueError(f"paths {unknown}: choose from {list(PATHS)}")
    options = dict(runner_in_process=True, context_length=512, max_total_tokens=8192, max_running_requests=8,
                   max_prefill_tokens=512, log_level="warning", precompile=False) | engine_options  # fmt: skip
    with Engine(_model_dir(model), **options) as engine, tempfile.TemporaryDirectory() as tmp:
        tensors = {k: np.array(v) for k, v in load_checkpoint(engine.model_dir)[1].items()}
        if send_dtype is not None:
            want = np.dtype(ml_dtypes.bfloat16) if send_dtype == "bfloat16" else np.dtype(send_dtype)
            tensors = {k: v.astype(want) for k, v in tensors.items()}
        checkpoint = Path(tmp)
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (Path(engine.model_dir) / f).exists():
                (checkpoint / f).write_bytes((Path(engine.model_dir) / f).read_bytes())
        save_file(tensors, str(checkpoint / "model.safetensors"))
        servers = Servers(engine, port=0).start()
        b = Bench(engine, servers, checkpoint)
        traces = engine.wait_compiled()["runner_trace_count"]
        engine.pause_generation("retract")
        runs: dict[str, list[tuple[float, int]]] = {p: [] for p in paths}
        try:
            for _ in range(repeat):
                for p in paths:
                    seconds, r, nbytes = PATHS[p](b, tensors)
                    assert r["success"], (p, r)
                    runs[p].append((seconds, nbytes))
        finally:
            b.close()
            engine.continue_generation()
            servers.stop()
        assert engine.get_server_info()["runner_trace_count"] == traces, "an update recompiled a step program"
        info = engine.runner_info
    mib = _nbytes(tensors) / 2**20
    print(f"\n{model}: {len(tensors)} tensors, {mib:.0f} MiB as sent ({next(iter(tensors.values())).dtype}), served "
          f"{info.get('dtype')} on {len(info.get('devices', []))} {info.get('platform')} device(s); load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", file=sys.stderr)  # fmt: skip
    print("| path | MiB moved | median s | MiB/s | runs (s) |\n|---|---|---|---|---|")
    for p, xs in runs.items():
        med = statistics.median(x for x, _ in xs)
        moved = xs[0][1] / 2**20
        print(f"| {p} | {moved:.1f} | {med:.3f} | {moved / med:.0f} | {' '.join(f'{x:.3f}' for x, _ in xs)} |")
    return runs


def _model_dir(name: str) -> str:
    if name == "tiny":
        from ringserve.model.checkpoints.tiny import tiny_model_path

        return str(tiny_model_path("llama"))
    from ringserve.model.checkpoints.random_shapes import SHAPES, random_model

    if name not in SHAPES:
        return name
    # the random weights of that shape with a tokenizer (the tiny model's: the engine's
    # detokenizer needs one; no text is made here)
    from ringserve.model.checkpoints.tiny import tiny_model_path

    weights, tiny = random_model(name), tiny_model_path("llama")
    served = weights.with_name(weights.name + "-with-tokenizer")
    served.mkdir(exist_ok=True)
    for src in [*weights.iterdir(), *(f for f in tiny.iterdir() if f.name.startswith("tokenizer"))]:
        if not (served / src.name).exists():
            (served / src.name).symlink_to(src)
    return str(served)


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, int]]]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.weight_updates", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2-135m, llama-3.2-1b (random weights) or a directory")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {list(PATHS)}")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="the tensors sent (default: as stored)")
    ap.add_argument("--serve-dtype", default=None, help="the engine's --dtype")
    args = ap.parse_args(argv)
    opts = {"dtype": args.serve_dtype} if args.serve_dtype else {}
    return run(args.model, args.paths.split(","), args.repeat, args.dtype, **opts)


if __name__ == "__main__":
    main()
