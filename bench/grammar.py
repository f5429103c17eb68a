"""Structured outputs: throughput of a workload where half the requests are constrained by a
JSON schema against the same workload unconstrained, and the host's mask time per step against
the step time, in one run.

    python -m ringserve.bench.grammar [--model tiny] [--num-prompts 64] [--max-new 128] [--overlap both]

The same prompts and output lengths in both runs: every request decodes exactly `--max-new`
greedy tokens (ignore_eos), and the schema (a long array of small objects: keys, bounded
strings, integers, enums) cannot end before that, so the constrained requests do the same work
with the mask computed for every one of their tokens. A batch holding constrained rows is
booked before the next one is planned (no overlap for it: actors/scheduler/actor.py), so with
`--overlap both` the unconstrained workload also runs without overlap, which isolates what the
lost overlap costs from what the masks cost.

Reported per run: output tokens/s, steps, wall time per step, the runner's forward time per step
(`forward_s_per_step`), the scheduler's host time per step and the mask time per step with
constrained rows (`grammar_mask_s_per_step`); then constrained / unconstrained throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "kind": {"enum": ["user", "admin", "guest"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "id", "kind", "active"],
        "additionalProperties": False,
    },
    "minItems": 1000,  # never complete within --max-new: every request decodes --max-new tokens
}


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(16, 128, n)]


def totals(info: dict) -> dict[str, float]:
    """The scheduler's cumulative figures from get_server_info's per-step averages (each average
    times the count it was taken over, as reported at that moment)."""
    steps = info["forward_ct_decode"] + info["forward_ct_prefill"]
    return {"steps": steps, "forward_s": info["forward_s_per_step"] * steps, "host_s": info["host_s_per_step"] * steps,
            "grammar_steps": info["grammar_steps"], "mask_s": info["grammar_mask_s_per_step"] * info["grammar_steps"]}  # fmt: skip


def run(engine: Any, ids: list[list[int]], sps: list[dict]) -> dict[str, Any]:
    engine.flush_cache()  # (both runs start from an empty prefix cache)
    before = totals(engine.get_server_info())
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=sps)
    wall = time.perf_counter() - t0
    d = {k: v - before[k] for k, v in totals(engine.get_server_info()).items()}
    tokens = sum(len(o["output_ids"]) for o in outs)
    steps = max(1, d["steps"])
    return {
        "output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": d["steps"],
        "wall_ms_per_step": 1e3 * wall / steps, "forward_ms_per_step": 1e3 * d["forward_s"] / steps,
        "host_ms_per_step": 1e3 * d["host_s"] / steps, "grammar_steps": d["grammar_steps"],
        "mask_ms_per_grammar_step": 1e3 * d["mask_s"] / d["grammar_steps"] if d["grammar_steps"] else 0.0,
        "outputs": [o["output_ids"] for o in outs],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.grammar", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or a model directory")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--constrained-share", type=float, default=0.5, help="share of the requests constrained")
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="both")
    ap.add_argument("--repeat", type=int, default=1, help="alternate the two workloads this many times per engine")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)
    from ringserve import Engine
    from ringserve.model.checkpoints.resolve import resolve_model

    path, _ = resolve_model(a.model)
    n = a.num_prompts
    shapes = dict(context_length=512, max_running_requests=n, max_prefill_tokens=2048, max_total_tokens=n * 512,
                  constrained_json_disable_any_whitespace=True)  # fmt: skip
    plain = {"max_new_tokens": a.max_new, "temperature": 0, "ignore_eos": True}
    every = max(1, round(1 / a.constrained_share)) if a.constrained_share > 0 else 0
    constrained = [{**plain, "json_schema": json.dumps(SCHEMA)} if every and i % every == 0 else plain for i in range(n)]
    results: dict[str, Any] = {}
    for overlap in (["on", "off"] if a.overlap == "both" else [a.overlap]):
        with Engine(str(path), disable_overlap_schedule=overlap == "off", **shapes) as engine:
            engine.wait_compiled()
            ids = prompts(n, engine.vocab_size)
            engine.generate(input_ids=ids[:4], sampling_params=constrained[:4])  # warm: compile + first masks
            for k in range(a.repeat):
                tag = f" #{k + 1}" if a.repeat > 1 else ""
                results[f"overlap {overlap}, unconstrained{tag}"] = run(engine, ids, [plain] * n)
                results[f"overlap {overlap}, {sum('json_schema' in s for s in constrained)}/{n} constrained{tag}"] = run(
                    engine, ids, constrained)  # fmt: skip
    print(f"\n{n} requests x {a.max_new} greedy tokens, model {a.model}", file=sys.stderr)
    cols = ("tok_s", "steps", "wall_ms_per_step", "forward_ms_per_step", "host_ms_per_step", "mask_ms_per_grammar_step")
    print(f"{'run':38s} " + " ".join(f"{c:>16s}" for c in cols))
    for name, r in results.items():
        print(f"{name:38s} " + " ".join(f"{r[c]:16.2f}" for c in cols))
    names = list(results)
    for plain_run, con_run in zip(names[::2], names[1::2], strict=True):  # each constrained run against the run before it
        print(f"{con_run} / {plain_run}: {results[con_run]['tok_s'] / results[plain_run]['tok_s']:.3f}x")
    if len(names) > 2:
        print(f"{names[2]} / {names[0]}: {results[names[2]]['tok_s'] / results[names[0]]['tok_s']:.3f}x")
    out = {k: {m: v for m, v in r.items() if m != "outputs"} for k, r in results.items()}
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
