"""`ringserve generate`: generate in-process through the model runtime (no actors).

A static batch: every prompt is prefilled in extend steps no larger than the biggest bucket,
then all are decoded together until each hits EOS or `--max-new-tokens`. Pages are handed out
linearly (no prefix cache): this is the runtime's own smoke path and the quickstart until the
engine (actors/) serves the same job with continuous batching.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from model.batch import SamplingParams, Segment
from model.step import ExecutorConfig, ModelExecutor

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about shared memory.",
    "Explain paged attention in one sentence.",
    "List three prime numbers.",
]


def resolve_model_path(model: str | None) -> Path:
    """`tiny` (or None): the generated tiny Llama; `smollm2`: the fetched SmolLM2; else a path."""
    if model in (None, "tiny"):
        from model.tiny import tiny_model_path

        return tiny_model_path("llama")
    if model == "smollm2":
        from model.fetch import fetch_model

        return fetch_model("smollm2")
    return Path(model)


def generate(
    ex: ModelExecutor,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_ids: set[int],
    on_token=None,
) -> list[list[int]]:
    cfg = ex.cfg
    page = cfg.page_size
    next_page = 1
    tables = []
    for p in prompts:
        need = -(-(len(p) + max_new_tokens) // page)
        if len(p) + max_new_tokens > cfg.max_context_len:
            raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds max_context_len={cfg.max_context_len}")
        if next_page + need > cfg.num_pages:
            raise ValueError(f"batch needs more than the {cfg.num_pages - 1} KV pages available; pass fewer prompts")
        tables.append(np.arange(next_page, next_page + need, dtype=np.int32))
        next_page += need
    params = [SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed + i) for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    # Prefill: one request per extend step, chunked to the largest extend bucket.
    chunk = ex.buckets.extend_tokens[-1]
    for i, p in enumerate(prompts):
        for start in range(0, len(p), chunk):
            piece = np.asarray(p[start : start + chunk], np.int32)
            res, rows = ex.run([Segment(piece, start, tables[i], params[i])])
        tok = int(np.asarray(res.tokens)[rows[0]])
        out[i].append(tok)
        if on_token:
            on_token(i, tok)
    live = [i for i in range(len(prompts)) if out[i][-1] not in eos_ids and max_new_tokens > 1]
    while live:
        for lo in range(0, len(live), cfg.max_batch):
            group = live[lo : lo + cfg.max_batch]
            segs = [Segment(np.array([out[i][-1]], np.int32), len(prompts[i]) + len(out[i]) - 1, tables[i], params[i]) for i in group]
            res, rows = ex.run(segs)
            toks = np.asarray(res.tokens)
            for i, r in zip(group, rows, strict=True):
                out[i].append(int(toks[r]))
                if on_token:
                    on_token(i, int(toks[r]))
        live = [i for i in live if out[i][-1] not in eos_ids and len(out[i]) < max_new_tokens]
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ringserve generate", description="generate text in-process with the model runtime")
    ap.add_argument("--model", default="tiny", help="'tiny' (default, generated offline), 'smollm2', a model directory or a .gguf file")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four built-in prompts")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    ap.add_argument("--batch", type=int, default=0, help="also time a batch of N copies of the prompts (throughput)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp-size", type=int, default=1)
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")

    from transformers import AutoTokenizer

    path = resolve_model_path(args.model)
    t0 = time.perf_counter()
    ex = ModelExecutor(path, ExecutorConfig(dtype=args.dtype, tp_size=args.tp_size, max_batch=64, num_pages=4096, max_context_len=2048))
    if path.is_dir():
        tok = AutoTokenizer.from_pretrained(str(path))
    else:
        from model.gguf import gguf_tokenizer_dir

        tok = AutoTokenizer.from_pretrained(str(gguf_tokenizer_dir(path)))
    print(f"loaded {path} ({ex.model_config.family}, {ex.model_config.num_layers} layers) and compiled "
          f"{ex.num_programs} buckets in {time.perf_counter() - t0:.1f}s", file=sys.stderr)  # fmt: skip
    texts = args.prompt or DEFAULT_PROMPTS
    if args.no_chat or not tok.chat_template:
        ids = [tok.encode(t) for t in texts]
    else:
        chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False) for t in texts]
        ids = [tok.encode(c, add_special_tokens=False) for c in chats]
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, 0.0, args.seed)
    eos = set(ex.model_config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())

    def stream(i: int, token: int) -> None:
        if i == 0:
            print(tok.decode([token]), end="", flush=True)

    print(f"### {texts[0]}\n", end="")
    outs = generate(ex, ids, args.max_new_tokens, sampling, eos, on_token=stream)
    print()
    for text, o in list(zip(texts, outs, strict=True))[1:]:
        print(f"### {text}\n{tok.decode(o, skip_special_tokens=True)}")
    if args.batch:
        batch = [ids[i % len(ids)] for i in range(args.batch)]
        generate(ex, batch[: min(len(batch), 2)], 2, sampling, set())  # warm the exact buckets
        t = time.perf_counter()
        outs = generate(ex, batch, args.max_new_tokens, sampling, set())
        dt = time.perf_counter() - t
        n = sum(len(o) for o in outs)
        print(f"throughput: {len(batch)} requests, {n} output tokens in {dt:.2f}s = {n / dt:.0f} tok/s", file=sys.stderr)
    return 0
