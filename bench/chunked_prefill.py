"""Chunked prefill vs decode stalls: a 4,096-token prompt arrives while 32 requests decode.

    python -m ringserve.bench.chunked_prefill [--model tiny] [--configs off 512 512-mixed 128-mixed 32-mixed]

Per configuration one engine: `off` = chunked_prefill_size -1 (the long prompt is one prefill
step), `512` = chunks of 512 (SGLang's scheduling: the chunks run back to back, decoding waits),
`N-mixed` = chunks of N with enable_mixed_chunk (each chunk step also decodes the running
batch). The 32 decoders (64-token prompts, `--decode-len` tokens, streamed, EOS ignored) start
together; when each has streamed `--start-after` tokens the long prompt (16 output tokens) is
sent. Reported per configuration, from the decoders' client-side ITLs (bench/metrics.py):

    itl_median_ms       median of the decoder ITLs outside the long prompt's prefill window (its
                        send to its first token): steady decoding, what the ratios divide by
    itl_p99_ms          p99 of every decoder ITL of the run, and its ratio to that median
    window_p99_ms       p99 (and max) of the decoder ITLs that overlap the window: the stall a
                        user sees; ratio to the steady median (the goal: within 3x when chunked)
    long_ttft_ms        the long request's time to first token (what chunking costs it)

The decoders stream long enough (`--decode-len`) to outlast the window of the smallest chunk.
On CPU a chunk's attention over a 4k context is costly: the small chunks (`32-mixed`) are the
ones that keep decoding smooth there; on an accelerator 512 is the usual size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np

from ringserve.bench.backends import engine_sender
from ringserve.bench.metrics import RequestRecord
from ringserve.bench.workload import random_requests

CONFIGS = {"off": (-1, False), "512": (512, False), "512-mixed": (512, True), "256-mixed": (256, True),
           "128-mixed": (128, True), "64-mixed": (64, True), "32-mixed": (32, True)}


def server_args(long_len: int, n_decode: int, decode_len: int, chunk: int, mixed: bool) -> dict[str, Any]:
    context = -(-(long_len + 64) // 256) * 256
    return dict(
        context_length=context,
        max_running_requests=n_decode + 8,
        max_total_tokens=context + n_decode * (64 + decode_len + 64) + 4096,
        max_prefill_tokens=long_len,  # unchunked, the whole prompt is one prefill batch
        chunked_prefill_size=chunk,
        enable_mixed_chunk=mixed,
    )


async def interfere(engine: Any, decoders: list, long_req: Any, start_after: int) -> tuple[list[RequestRecord], RequestRecord]:
    send = engine_sender(engine)
    recs = [RequestRecord(prompt_len=r.prompt_len) for r in decoders]
    long_rec = RequestRecord(prompt_len=long_req.prompt_len)
    tasks = [asyncio.create_task(send(r, rec)) for r, rec in zip(decoders, recs, strict=True)]
    while not all(sum(r.chunk_tokens) >= start_after for r in recs):
        await asyncio.sleep(0.005)
    await send(long_req, long_rec)
    await asyncio.gather(*tasks)
    return recs, long_rec


def itl_spans(rec: RequestRecord) -> list[tuple[float, float, float]]:
    """(start, end, itl) per token interval after the first chunk."""
    out = []
    for i in range(1, len(rec.chunk_times)):
        a, b, k = rec.chunk_times[i - 1], rec.chunk_times[i], rec.chunk_tokens[i]
        out += [(a, b, (b - a) / k)] * k
    return out


def analyse(recs: list[RequestRecord], long_rec: RequestRecord) -> dict[str, float]:
    """Decoder ITLs split by the long prompt's prefill window (its send to its first token):
    the ratios are to the median ITL outside it (steady decoding). A small chunk stretches the
    window over most of the run, so the median of every ITL would drift up and flatter them."""
    spans = [s for r in recs for s in itl_spans(r)]
    w0, w1 = long_rec.sent, long_rec.chunk_times[0]
    inside = np.array([s[1] > w0 and s[0] < w1 for s in spans], bool)
    itl = np.array([s[2] for s in spans]) * 1e3
    steady, window = itl[~inside], itl[inside]

    def stat(fn, x: np.ndarray) -> float:
        return float(fn(x)) if len(x) else float("nan")

    med, p99, wp99 = stat(np.median, steady), float(np.percentile(itl, 99)), stat(lambda x: np.percentile(x, 99), window)
    return {
        "itl_median_ms": med, "steady_samples": int(len(steady)), "itl_p99_ms": p99, "itl_p99_over_median": p99 / med,
        "window_samples": int(len(window)), "window_median_ms": stat(np.median, window),
        "window_p99_ms": wp99, "window_max_ms": stat(np.max, window),
        "window_p99_over_median": wp99 / med, "long_ttft_ms": long_rec.ttft * 1e3, "long_prefill_window_ms": (w1 - w0) * 1e3,
    }  # fmt: skip


def run_config(model_dir: str, name: str, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from ringserve import Engine

    chunk, mixed = CONFIGS[name]
    decoders = random_requests(a.num_decode, vocab, 1, (64, 64), (a.decode_len, a.decode_len))
    long_req = random_requests(1, vocab, 2, (a.long_len, a.long_len), (16, 16))[0]
    with Engine(model_dir, **server_args(a.long_len, a.num_decode, a.decode_len, chunk, mixed)) as engine:
        engine.wait_compiled()
        engine.generate(input_ids=[long_req.prompt[:512], decoders[0].prompt], sampling_params={"max_new_tokens": 4})
        engine.flush_cache()
        t = time.perf_counter()
        recs, long_rec = asyncio.run(interfere(engine, decoders, long_req, a.start_after))
        wall = time.perf_counter() - t
    assert all(r.error is None and r.output_len == a.decode_len for r in recs) and long_rec.output_len == 16
    return {"config": name, "chunked_prefill_size": chunk, "enable_mixed_chunk": mixed, "wall_s": wall, **analyse(recs, long_rec)}


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = f"{'config':12s} {'steady ITL':>11s} {'ITL p99':>9s} {'p99/med':>8s} {'window p99':>11s} {'window max':>11s} {'win p99/med':>12s} {'long TTFT':>10s}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['config']:12s} {r['itl_median_ms']:9.1f}ms {r['itl_p99_ms']:7.1f}ms {r['itl_p99_over_median']:7.2f}x "
                     f"{r['window_p99_ms']:9.1f}ms {r['window_max_ms']:9.1f}ms {r['window_p99_over_median']:11.2f}x {r['long_ttft_ms']:8.0f}ms")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.chunked_prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--configs", nargs="+", default=["off", "512", "512-mixed", "128-mixed", "32-mixed"], choices=list(CONFIGS))
    ap.add_argument("--num-decode", type=int, default=32)
    ap.add_argument("--decode-len", type=int, default=256)
    ap.add_argument("--start-after", type=int, default=32)
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)
    from ringserve.model.checkpoints.resolve import resolve_model
    from ringserve.model.families import read_config

    path, _ = resolve_model(a.model)
    vocab = read_config(path).vocab_size
    rows = []
    for name in a.configs:
        rows.append(run_config(str(path), name, a, vocab))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{a.long_len}-token prompt arriving while {a.num_decode} requests decode ({a.model}); decoder ITLs:")
    print(format_rows(rows))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
