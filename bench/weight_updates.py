"""One weight update's wall time by the path it takes, every path on one engine in one process,
for one table (the paths alternate run by run, so drift in the machine hits each alike):

    python -m ringserve.bench.weight_updates --model tiny|smollm2|DIR [--paths device,host] [--repeat 3]

    device   the tensors as JAX arrays on this process's devices (a trainer's, held before the
             clock starts), lent to the runner in this process and built on the device
             (actors/frontend/weight_local.py, model/weights/device_state.py)
    host     the same tensors as NumPy arrays: the shared-memory push (actors/frontend/weight_push.py),
             staged on the host, the state built there and placed

The engine runs its runner in this process (`runner_in_process`, as a trainer's does) and is
paused with retract around the updates, as an RL framework does; a time is the call's wall time
as the caller sees it (built, checked, swapped; nothing recompiles). A path is one function of
(engine, HF-named host tensors) -> (seconds, reply) in `PATHS`: add disk, another process's
push, HTTP and update groups there for one table of every path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

Update = Callable[[Any, dict[str, np.ndarray]], tuple[float, dict]]


def _device(engine: Any, tensors: dict[str, np.ndarray]) -> tuple[float, dict]:
    import jax

    arrays = jax.block_until_ready(
        {n: jax.device_put(a) for n, a in tensors.items()}
    )  # held before the clock
    t0 = time.perf_counter()
    r = engine.update_weights_from_tensor(arrays)
    return time.perf_counter() - t0, r


def _host(engine: Any, tensors: dict[str, np.ndarray]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = engine.update_weights_from_tensor(tensors)
    return time.perf_counter() - t0, r


PATHS: dict[str, Update] = {"device": _device, "host": _host}


def update_seconds(engine: Any, path: str, tensors: dict[str, np.ndarray]) -> float:
    """One update of `tensors` through `path` (a name in PATHS): its wall time; AssertionError
    if the engine refused it."""
    if path not in PATHS:
        raise ValueError(f"path={path!r}: one of {sorted(PATHS)}")
    seconds, r = PATHS[path](engine, tensors)
    assert r["success"], r
    return seconds


def run(model: str, paths: list[str], repeat: int, **engine_options: Any) -> dict[str, list[float]]:
    """Every path's `repeat` times (the runs in order: a first run compiles what it needs)."""
    from ringserve import Engine
    from ringserve.model.checkpoints.load import load_checkpoint

    options = dict(runner_in_process=True, context_length=512, max_total_tokens=8192, max_running_requests=8,
                   max_prefill_tokens=512, log_level="warning") | engine_options  # fmt: skip
    with Engine(model, **options) as engine:
        tensors = {k: np.array(v) for k, v in load_checkpoint(engine.model_dir)[1].items()}
        traces = engine.wait_compiled()["runner_trace_count"]
        engine.pause_generation("retract")
        runs: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(repeat):
            for p in paths:
                runs[p].append(update_seconds(engine, p, tensors))
        engine.continue_generation()
        assert engine.get_server_info()["runner_trace_count"] == traces, "an update recompiled a step program"
        info = engine.runner_info
    mib = sum(a.nbytes for a in tensors.values()) / 2**20
    print(f"\n{model}: {len(tensors)} tensors, {mib:.0f} MiB as loaded, served {info.get('dtype')} on "
          f"{len(info.get('devices', []))} {info.get('platform')} device(s); load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs", file=sys.stderr)  # fmt: skip
    for p, xs in runs.items():
        print(
            f"{p:8s} median {statistics.median(xs) * 1e3:8.1f} ms   runs "
            + " ".join(f"{x * 1e3:.1f}" for x in xs)
        )
    return runs


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(
        prog="python -m ringserve.bench.weight_updates", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {sorted(PATHS)}")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    return run(args.model, args.paths.split(","), args.repeat)


if __name__ == "__main__":
    main()
