"""Speculative decoding (n-gram drafts) on a repetitive workload: accept length and speedup of
speculation on against off, on the same engine shapes and the same prompts.

    python -m ringserve.bench.spec [--model smollm2] [--num-prompts 16] [--max-new 128] [--draft-tokens 4]

The prompts copy from their own context, as code editing and quoting do: a generated Python
function followed by "the same function with `x` renamed to `value`", and a paragraph followed by
"the text above, word for word". Two load levels: one request at a time (latency: speculation's
case) and every prompt at once (throughput). Greedy; the outputs of the two modes must be equal
token for token (they are checked and reported).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

WORDS = ("alpha beta gamma delta signal buffer window token cache page batch queue worker stream "
         "result value index offset length scale weight").split()  # fmt: skip


def code_prompt(rng: np.random.Generator, i: int) -> str:
    name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{i}"
    lines = [f"def {name}(x, items):", "    total = 0"]
    for _ in range(int(rng.integers(4, 9))):
        a, b = rng.choice(WORDS), int(rng.integers(2, 9))
        lines.append(f"    {a} = x * {b} + len(items)")
        lines.append(f"    total += {a} - x")
    lines.append("    return total + x")
    code = "\n".join(lines)
    return (f"Here is a Python function:\n```python\n{code}\n```\n"
            f"The same function with the argument `x` renamed to `value`:\n```python\n")  # fmt: skip


def text_prompt(rng: np.random.Generator, i: int) -> str:
    sents = [" ".join(rng.choice(WORDS, int(rng.integers(6, 12)))).capitalize() + "." for _ in range(6)]
    para = " ".join(sents)
    return f"Text {i}: {para}\n\nThe text above, word for word:\n{para[:40]}"


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [code_prompt(rng, i) if i % 2 == 0 else text_prompt(rng, i) for i in range(n)]


def run_mode(model: str, texts: list[str], max_new: int, spec: dict, shapes: dict) -> dict[str, Any]:
    from ringserve import Engine

    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    with Engine(model, **shapes, **spec) as engine:
        engine.wait_compiled()
        engine.generate(prompt=texts[:2], sampling_params={"max_new_tokens": 8})  # warm
        engine.flush_cache()
        res: dict[str, Any] = {}
        outs: list[list[int]] = []
        t0 = time.perf_counter()
        for t in texts:  # one at a time
            outs.append(engine.generate(prompt=t, sampling_params=sp)["output_ids"])
        res["batch1_s"] = time.perf_counter() - t0
        engine.flush_cache()
        before = engine.get_server_info()
        t0 = time.perf_counter()
        together = engine.generate(prompt=texts, sampling_params=sp)
        res["batchN_s"] = time.perf_counter() - t0
        info = engine.get_server_info()
    n_out = sum(len(o) for o in outs)
    res.update(batch1_tok_s=n_out / res["batch1_s"], batchN_tok_s=n_out / res["batchN_s"],
               same_at_both_loads=[o["output_ids"] for o in together] == outs, outputs=outs)  # fmt: skip
    if spec:
        hist = np.array(info["spec_accept_histogram"]) - np.array(before["spec_accept_histogram"])
        res["accept_hist_batchN"] = hist.tolist()
        res["avg_accept_length"] = info["avg_spec_accept_length"]  # both loads
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.spec", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="'tiny', 'smollm2' or a model directory")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    a = ap.parse_args(argv)
    from ringserve.model.checkpoints.resolve import resolve_model

    path, _ = resolve_model(a.model)
    texts = prompts(a.num_prompts)
    shapes = dict(context_length=1024, max_running_requests=max(16, a.num_prompts), max_prefill_tokens=2048,
                  max_total_tokens=a.num_prompts * 1024, disable_overlap_schedule=a.disable_overlap_schedule)  # fmt: skip
    off = run_mode(str(path), texts, a.max_new, {}, shapes)
    on = run_mode(str(path), texts, a.max_new, {"speculative_algorithm": "ngram",
                  "speculative_num_draft_tokens": a.draft_tokens}, shapes)  # fmt: skip
    same = on["outputs"] == off["outputs"]
    print(f"\n{a.num_prompts} copy-from-context prompts, {a.max_new} greedy tokens each, model {a.model}, "
          f"k = {a.draft_tokens}, overlap {'off' if a.disable_overlap_schedule else 'on'}", file=sys.stderr)  # fmt: skip
    print(f"{'':14s} {'1 at a time tok/s':>18s} {f'{a.num_prompts} at once tok/s':>18s}")
    for name, r in (("spec off", off), ("spec on", on)):
        print(f"{name:14s} {r['batch1_tok_s']:18.1f} {r['batchN_tok_s']:18.1f}")
    print(
        f"{'speedup':14s} {on['batch1_tok_s'] / off['batch1_tok_s']:17.2f}x {on['batchN_tok_s'] / off['batchN_tok_s']:17.2f}x"
    )
    print(
        f"avg accept length (tokens per verify round): {on['avg_accept_length']}; "
        f"rounds by drafts accepted (all at once): {on['accept_hist_batchN']}"
    )
    print(
        f"identical outputs spec on/off: {same}; batch-1 vs all-at-once: {off['same_at_both_loads'] and on['same_at_both_loads']}"
    )
    strip = ("outputs",)
    return {"off": {k: v for k, v in off.items() if k not in strip}, "on": {k: v for k, v in on.items() if k not in strip},
            "identical": same}  # fmt: skip


if __name__ == "__main__":
    main()
