"""What prompt logprobs cost: a scoring request (`logprob_start_len=0`) against the same request
without them, through the engine, and the step programs' share of it.

    python -m ringserve.bench.prompt_logprobs [--model tiny] [--lens 256 1024] [--batch 8] [--repeat 5]

Engine part, per prompt length L (random ids, unchunked, the prefix cache flushed before every
request so each computes its whole prompt; greedy, one output token, as an RL scorer asks):

    plain          no logprobs
    output         return_logprob (the default logprob_start_len -1: nothing more computed)
    prompt         logprob_start_len=0: the logprob of every prompt token
    prompt+top5    and top_logprobs_num=5 at every position
    prompt+ids16   and token_ids_logprob of 16 ids at every position

each timed `--repeat` times (cases interleaved, the median kept) for one request and for a
batch of `--batch` requests at once; reported as ms and as the ratio to `plain`.

Step part (the executor, no processes): one extend step of L tokens with no position wanted
against every position wanted, and a decode step of 1, 8 and 64 rows with no row asking for
token_ids_logprob against every row asking (the same programs: nothing is compiled for them).

One run each (CPU, 2 cores shared; load average 2.9-6.2 during the tiny run, 5.2-6.2 during
SmolLM2's; defaults, SmolLM2 with --batch 4 --repeat 3), ratio to plain:

    model    prompt  requests  output  prompt  +top5  +ids16   extend step  decode b1/b8/b64 (ids16)
    tiny       256      1       0.94   1.25    1.47   1.50       1.16        1.00 / 1.05 / 1.00
    tiny      1024      8       1.01   1.13    1.30   1.18       1.11
    SmolLM2    256      1       0.98   1.32    1.32   1.34       1.29        0.92 / 1.26 / 0.98
    SmolLM2   1024      4       1.00   1.23    1.31   1.26       1.28

The prompt's logprobs cost the LM head and a log-softmax over the vocabulary at every position
(SmolLM2: 49,152 x 576 per token, a quarter of a prefill step on CPU); a request that asks for
none pays nothing measurable, decode steps included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "output": {"return_logprob": True},
    "prompt": {"return_logprob": True, "logprob_start_len": 0},
    "prompt+top5": {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5},
    "prompt+ids16": {"return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": list(range(3, 19))},
}
SP = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


def engine_part(model: str, lens: list[int], batch: int, repeat: int, vocab: int) -> list[dict[str, Any]]:
    from ringserve import Engine

    top = max(lens)
    shapes = dict(context_length=-(-(top + 64) // 256) * 256, max_prefill_tokens=top * batch, chunked_prefill_size=-1,
                  max_running_requests=max(batch, 8), max_total_tokens=(top + 64) * batch * 2 + 4096)  # fmt: skip
    rng = np.random.default_rng(0)
    rows = []
    with Engine(model, **shapes) as engine:
        engine.wait_compiled()
        for n in lens:
            prompts = [rng.integers(3, vocab, n).tolist() for _ in range(batch)]
            for kw in CASES.values():  # warm: every program these requests use
                engine.generate(input_ids=prompts, sampling_params=SP, **kw)
            for label, ids in (("1 request", prompts[0]), (f"{batch} requests", prompts)):
                times: dict[str, list[float]] = {name: [] for name in CASES}
                for _ in range(repeat):
                    for name, kw in CASES.items():
                        assert engine.flush_cache()["success"]
                        t = time.perf_counter()
                        engine.generate(input_ids=ids, sampling_params=SP, **kw)
                        times[name].append(time.perf_counter() - t)
                med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
                rows.append({"prompt_len": n, "requests": label, **{f"{k}_ms": v for k, v in med.items()},
                             **{f"{k}_over_plain": v / med["plain"] for k, v in med.items() if k != "plain"}})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def step_part(model_dir: str, lens: list[int], repeat: int) -> list[dict[str, Any]]:
    from ringserve.model.compute.step_inputs import DeviceRow
    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

    page, ctx = 16, 128
    top = max(lens)
    cfg = ExecutorConfig(page_size=page, num_pages=64 * (ctx // page + 1) + top // page + 40, max_context_len=max(1024, top),
                         max_batch=64, max_extend_tokens=max(top, ctx), precompile=False, top_logprobs_num=5,
                         token_ids_logprob_num=16)  # fmt: skip
    ex = ModelExecutor(model_dir, cfg)
    rng = np.random.default_rng(1)
    ids16 = np.arange(3, 19, dtype=np.int32)

    def timed(rows: list[DeviceRow]) -> float:
        for _ in range(2):  # compile, warm
            ex.run_step(rows).out.tokens.block_until_ready()
        t = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            so = ex.run_step(rows)
            so.out.tokens.block_until_ready()
            np.asarray(so.prompt.logprobs)
            t.append(time.perf_counter() - t0)
        return statistics.median(t) * 1e3

    out = []
    base = 1 + 64 * (ctx // page + 1)
    for n in lens:
        p = rng.integers(3, 1000, n).astype(np.int32)
        pages = np.arange(base, base + -(-n // page), dtype=np.int32)
        plain = timed([DeviceRow(p, 0, pages)])
        wanted = timed([DeviceRow(p, 0, pages, logprob_targets=p[1:], logprob_ids=ids16)])
        out.append({"step": f"extend {n} tokens", "plain_ms": plain, "logprobs_ms": wanted, "ratio": wanted / plain})
        print(json.dumps(out[-1]), flush=True)
    per = ctx // page + 1
    for b in (1, 8, 64):
        rows = []
        for i in range(b):
            pages = np.arange(1 + i * per, 1 + (i + 1) * per, dtype=np.int32)
            ex.run([DeviceRow(rng.integers(3, 1000, ctx).astype(np.int32), 0, pages)])
            rows.append(DeviceRow(np.array([5], np.int32), ctx, pages))
        plain = timed(rows)
        asking = timed([DeviceRow(r.token_ids, r.committed_len, r.pages, logprob_ids=ids16) for r in rows])
        out.append({"step": f"decode b{b} ctx{ctx}", "plain_ms": plain, "logprobs_ms": asking, "ratio": asking / plain})
        print(json.dumps(out[-1]), flush=True)
    return out


def format_rows(engine_rows: list[dict[str, Any]], step_rows: list[dict[str, Any]]) -> str:
    lines = [f"{'prompt':>7s} {'requests':>12s} " + " ".join(f"{k:>14s}" for k in CASES)]
    for r in engine_rows:
        cells = [f"{r['plain_ms']:11.1f} ms"] + [f"{r[k + '_ms']:7.1f} {r[k + '_over_plain']:5.2f}x" for k in CASES if k != "plain"]
        lines.append(f"{r['prompt_len']:7d} {r['requests']:>12s} " + " ".join(f"{c:>14s}" for c in cells))
    lines.append("")
    lines.append(f"{'step':22s} {'plain':>10s} {'logprobs':>10s} {'ratio':>7s}")
    for r in step_rows:
        lines.append(f"{r['step']:22s} {r['plain_ms']:8.2f}ms {r['logprobs_ms']:8.2f}ms {r['ratio']:6.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.prompt_logprobs", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--lens", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-steps", action="store_true", help="the engine part only")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)
    from ringserve.model.checkpoints.resolve import resolve_model
    from ringserve.model.families import read_config

    path, _ = resolve_model(a.model)
    vocab = read_config(path).vocab_size
    engine_rows = engine_part(str(path), a.lens, a.batch, a.repeat, vocab)
    step_rows = [] if a.skip_steps else step_part(str(path), a.lens, a.repeat * 4)
    print(f"\nprompt logprobs vs plain ({a.model}), median of {a.repeat}; ms and ratio to plain:")
    print(format_rows(engine_rows, step_rows))
    result = {"engine": engine_rows, "steps": step_rows}
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
