"""How long the RL loop's weight sync takes: update_weights_from_disk, update_weights_from_tensor
(every tensor, and one layer's), and a release / resume of device memory, on a served model.

    python -m bench.weights --model smollm2 [--repeat 3]

The engine is paused with retract around each update, as an RL framework does; the numbers are
the wall time of the call as the caller sees it (the runner loads, checks and swaps; nothing
recompiles: the trace count is printed before and after).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np


def _timed(fn) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--max-prefill-tokens", type=int, default=1024)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    args = ap.parse_args(argv)

    from actors import Engine
    from model.checkpoints.weights import load_checkpoint

    with Engine(args.model, context_length=args.context_length, max_total_tokens=args.max_total_tokens,
                max_running_requests=16, max_prefill_tokens=args.max_prefill_tokens) as engine:  # fmt: skip
        path = str(engine.model_dir)
        tensors = {k: np.array(v) for k, v in load_checkpoint(engine.model_dir)[1].items()}
        nbytes = sum(a.nbytes for a in tensors.values())
        layer = {k: v for k, v in tensors.items() if ".layers.0." in k}
        traces = engine.wait_compiled()["runner_trace_count"]
        engine.pause_generation("retract")
        runs: dict[str, list[float]] = {"from_disk": [], "from_tensor_all": [], "from_tensor_one_layer": [],
                                        "release_memory": [], "resume_memory": []}  # fmt: skip
        for _ in range(args.repeat):
            for name, call in (
                ("from_disk", lambda: engine.update_weights_from_disk(path)),
                ("from_tensor_all", lambda: engine.update_weights_from_tensor(tensors)),
                ("from_tensor_one_layer", lambda: engine.update_weights_from_tensor(layer)),
                ("release_memory", lambda: engine.release_memory_occupation()),
                ("resume_memory", lambda: engine.resume_memory_occupation()),
            ):
                dt, r = _timed(call)
                assert r["success"], r
                runs[name].append(dt)
        engine.continue_generation()
        after = engine.get_server_info()["runner_trace_count"]
        out = {name: statistics.median(xs) for name, xs in runs.items()}
    mb = nbytes / 2**20
    print(f"\n{args.model}: {len(tensors)} tensors, {mb:.0f} MiB as loaded; median of {args.repeat}", file=sys.stderr)
    for name, s in out.items():
        extra = f"  ({mb / s:.0f} MiB/s)" if name in ("from_disk", "from_tensor_all") else ""
        print(f"{name:24s} {s * 1e3:9.1f} ms{extra}")
    print(f"step programs traced: {traces} before, {after} after (nothing recompiled: {traces == after})")
    return out


if __name__ == "__main__":
    main()
