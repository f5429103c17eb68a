"""What the sampling parameters RL frameworks send cost: the same workload with every row
penalized (repetition, frequency and presence), with min_new_tokens and logit_bias, with the
sampling mask read back (return_top_p_token_ids), against the plain workload, in one sitting.

    python -m ringserve.bench.penalties [--model tiny] [--num-prompts 64] [--max-new 128] [--rounds 3]

Every request decodes exactly `--max-new` tokens (ignore_eos; min_new_tokens = max_new holds
any stop id back), so each case does the same work; the cases run in turn, `--rounds` times
(the prefix cache flushed before each), and the median of each is kept. Cases:

    plain      greedy, nothing else
    penalties  greedy, repetition_penalty 1.1, frequency_penalty 0.3, presence_penalty 0.3
               (the slot's token counts set at its start, read by every sampling step)
    bias+min   greedy, min_new_tokens = max_new (the EOS held back), logit_bias on 8 ids
    seeded     temperature 0.8, top_p 0.9 (the filters), seeded
    seeded+mask  the same, and each token's kept set read back (return_top_p_token_ids)

Reported per case: output tokens/s, wall and forward ms per step; then each case / plain (for
seeded+mask: / seeded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from ringserve.bench.grammar import prompts, totals


def cases(max_new: int, eos: int) -> dict[str, dict[str, Any]]:
    base = {"max_new_tokens": max_new, "ignore_eos": True}
    seeded = {**base, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 1}
    return {
        "plain": {**base, "temperature": 0},
        "penalties": {**base, "temperature": 0, "repetition_penalty": 1.1, "frequency_penalty": 0.3,
                      "presence_penalty": 0.3},
        "bias+min": {**base, "temperature": 0, "ignore_eos": False, "min_new_tokens": max_new,
                     "logit_bias": {str(t): 0.5 for t in range(10, 18)} | {str(eos): 2.0}},
        "seeded": seeded,
        "seeded+mask": {**seeded, "custom_params": {"return_top_p_token_ids": True}},
    }  # fmt: skip


def run(engine: Any, ids: list[list[int]], sp: dict) -> dict[str, float]:
    engine.flush_cache()
    before = totals(engine.get_server_info())
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=sp)
    wall = time.perf_counter() - t0
    d = {k: v - before[k] for k, v in totals(engine.get_server_info()).items()}
    tokens = sum(len(o["output_ids"]) for o in outs)
    steps = max(1, d["steps"])
    return {"tok_s": tokens / wall, "wall_ms_per_step": 1e3 * wall / steps, "forward_ms_per_step": 1e3 * d["forward_s"] / steps,
            "output_tokens": tokens, "steps": d["steps"]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="python -m ringserve.bench.penalties", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or a model directory")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="the engine's dtype (default: its own)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    from ringserve import Engine

    kw: dict[str, Any] = dict(
        max_running_requests=a.num_prompts, context_length=512, disable_radix_cache=True
    )
    if a.dtype:
        kw["dtype"] = a.dtype
    engine = Engine(a.model, **kw)
    try:
        engine.wait_compiled()
        ids = prompts(a.num_prompts, min(len(engine.tokenizer), 4000))
        cs = cases(a.max_new, engine.tokenizer.eos_token_id)
        run(engine, ids[:4], cs["penalties"])  # (every program in, both paths traced)
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in cs}
        for _ in range(a.rounds):
            for name, sp in cs.items():
                runs[name].append(run(engine, ids, sp))
    finally:
        engine.shutdown()
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    ratio = {k: med[k]["tok_s"] / med["seeded" if k == "seeded+mask" else "plain"]["tok_s"] for k in med}
    out = {"model": a.model, "num_prompts": a.num_prompts, "max_new": a.max_new, "rounds": a.rounds, "median": med,
           "throughput_ratio": ratio, "runs": {k: [round(r["tok_s"], 1) for r in v] for k, v in runs.items()}}  # fmt: skip
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{a.model}: {a.num_prompts} requests x {a.max_new} tokens, {a.rounds} rounds (median)")
        for k, m in med.items():
            print(f"  {k:12s} {m['tok_s']:8.0f} tok/s  {m['wall_ms_per_step']:7.2f} ms/step  "
                  f"forward {m['forward_ms_per_step']:7.2f} ms  x{ratio[k]:.3f}  runs {out['runs'][k]}")  # fmt: skip
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
