"""What each front door costs per request: the in-process Engine, the IPC socket Client and
HTTP (SGLang's /generate), at fixed concurrency, on one engine.

    python -m ringserve.bench.frontends [--model tiny] [--requests 256] [--concurrency 1 64] [--max-new-tokens 1]

Each request generates `max_new_tokens` (default 1: the engine's work is one short prefill, so
the figure is dominated by the path itself). Latency is measured by the caller, from the call to
the finished result; the overhead is the path's median latency minus the Engine's in the same
run. All three paths drive the same engine, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import numpy as np

SHAPES = dict(max_running_requests=64, context_length=256, max_prefill_tokens=512, max_total_tokens=64 * 256 * 2)


async def _drive(call, prompts: list[list[int]], concurrency: int) -> tuple[list[float], float]:
    """(latency of each request, wall seconds of the whole run)."""
    queue = list(range(len(prompts)))
    lat: list[float] = []
    start = time.perf_counter()

    async def worker() -> None:
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            await call(prompts[i])
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, time.perf_counter() - start


def measure(engine, servers, prompts: list[list[int]], concurrency: int, max_new: int) -> dict[str, tuple[list[float], float]]:
    import httpx

    from ringserve import AsyncClient

    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}

    async def run() -> dict[str, tuple[list[float], float]]:
        out: dict[str, tuple[list[float], float]] = {}

        async def via_engine(p):
            return await engine.async_generate(input_ids=p, sampling_params=sp)

        out["engine"] = await _drive(via_engine, prompts, concurrency)
        async with AsyncClient(servers.socket_path) as c:

            async def via_client(p):
                return await c.generate(input_ids=p, sampling_params=sp)

            out["client"] = await _drive(via_client, prompts, concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=servers.url, limits=limits, timeout=120) as h:

            async def via_http(p):
                r = await h.post("/generate", json={"input_ids": p, "sampling_params": sp})
                r.raise_for_status()
                return r.json()

            out["http"] = await _drive(via_http, prompts, concurrency)
        return out

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.frontends", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-new-tokens", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args(argv)

    from ringserve import Engine, Servers

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 2000, args.prompt_len).tolist() for _ in range(args.requests)]
    results: dict[str, Any] = {}
    with Engine(args.model, **SHAPES) as engine, Servers(engine, port=0) as servers:
        engine.wait_compiled()
        engine.generate(input_ids=prompts[:8], sampling_params={"max_new_tokens": 2})  # warm every path once
        measure(engine, servers, prompts[:16], 4, args.max_new_tokens)
        print(f"\n{args.requests} requests of {args.prompt_len} prompt tokens, max_new_tokens={args.max_new_tokens}, "
              f"model {args.model}; median / p90 latency per request, requests/s", file=sys.stderr)  # fmt: skip
        print(f"{'path':8s} {'conc':>5s} {'median ms':>10s} {'p90 ms':>8s} {'req/s':>8s} {'overhead vs engine':>20s}")
        for c in args.concurrency:
            runs = measure(engine, servers, prompts, c, args.max_new_tokens)
            base = statistics.median(runs["engine"][0])
            for path, (xs, wall) in runs.items():
                med, p90 = statistics.median(xs), float(np.percentile(xs, 90))
                rps = len(xs) / wall
                results[f"{path}_c{c}"] = {"median_ms": med * 1e3, "p90_ms": p90 * 1e3, "req_per_s": rps,
                                           "overhead_ms": (med - base) * 1e3}  # fmt: skip
                print(f"{path:8s} {c:5d} {med * 1e3:10.2f} {p90 * 1e3:8.2f} {rps:8.1f} {(med - base) * 1e3:+17.2f} ms")
    return results


if __name__ == "__main__":
    main()
