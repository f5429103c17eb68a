"""Multi-turn latency: a streaming session (each turn extends the KV its previous turn kept)
against resending the whole conversation each turn, with the prefix cache on and off.

    python -m ringserve.bench.sessions [--model tiny] [--conversations 8] [--turns 6] [--turn-tokens 64] [--max-new 32]

Every conversation appends `turn-tokens` new tokens per turn and generates `max-new` tokens
(greedy); conversations run concurrently. Reported per mode: the median latency of a turn (call
to finished result), the prompt tokens the engine computed, and whether every mode produced the
same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import numpy as np


async def _conversation(engine, turns: list[list[int]], max_new: int, session: bool) -> tuple[list[float], list[list[int]]]:
    sid = engine.open_session() if session else None
    lat, outs, ctx, prev = [], [], [], None
    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    for t in turns:
        t0 = time.perf_counter()
        if session:
            out = await engine.async_generate(input_ids=t, sampling_params=sp, session_params={"id": sid, "rid": prev})
        else:
            out = await engine.async_generate(input_ids=ctx + t, sampling_params=sp)
        lat.append(time.perf_counter() - t0)
        ctx = ctx + t + out["output_ids"]
        prev = out["meta_info"]["id"]
        outs.append(out["output_ids"])
    if sid is not None:
        engine.close_session(sid)
    return lat, outs


def run_mode(model: str, convs: list[list[list[int]]], max_new: int, session: bool, radix: bool, **shapes) -> dict[str, Any]:
    from ringserve import Engine

    with Engine(model, disable_radix_cache=not radix, **shapes) as engine:
        engine.wait_compiled()
        engine.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 2})  # warm
        before = engine.get_server_info()["tokens_computed"]

        async def all_of_them():
            return await asyncio.gather(*(_conversation(engine, c, max_new, session) for c in convs))

        t0 = time.perf_counter()
        results = asyncio.run(all_of_them())
        wall = time.perf_counter() - t0
        computed = engine.get_server_info()["tokens_computed"] - before
    lat = [x for r in results for x in r[0]]
    return {"turn_ms_median": statistics.median(lat) * 1e3, "turn_ms_p90": float(np.percentile(lat, 90)) * 1e3,
            "tokens_computed": computed, "wall_s": wall, "outputs": [r[1] for r in results]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.sessions", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    convs = [[rng.integers(3, 2000, args.turn_tokens).tolist() for _ in range(args.turns)] for _ in range(args.conversations)]
    ctx = args.turns * (args.turn_tokens + args.max_new) + 64
    shapes = dict(context_length=ctx, max_total_tokens=max(65536, 2 * ctx * args.conversations),
                  max_running_requests=max(16, args.conversations), max_prefill_tokens=2048)  # fmt: skip
    modes = {"session": (True, True), "resend+prefix cache": (False, True), "resend, no cache": (False, False)}
    res = {name: run_mode(args.model, convs, args.max_new, s, r, **shapes) for name, (s, r) in modes.items()}
    same = len({str(r["outputs"]) for r in res.values()}) == 1
    print(f"\n{args.conversations} conversations x {args.turns} turns of {args.turn_tokens} new tokens, "
          f"{args.max_new} generated per turn, model {args.model}", file=sys.stderr)  # fmt: skip
    print(f"{'mode':22s} {'turn median ms':>15s} {'turn p90 ms':>12s} {'tokens computed':>16s} {'wall s':>7s}")
    for name, r in res.items():
        print(f"{name:22s} {r['turn_ms_median']:15.1f} {r['turn_ms_p90']:12.1f} {r['tokens_computed']:16d} {r['wall_s']:7.2f}")
    print(f"identical outputs in every mode: {same}")
    return {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in res.items()} | {"identical": same}


if __name__ == "__main__":
    main()
