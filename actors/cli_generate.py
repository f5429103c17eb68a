"""`ringserve generate`: start the engine (every actor, over shared-memory rings), stream one
completion, print the others, and optionally time a batch of N requests through continuous
batching. The README's first command runs this on the embedded tiny model."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about shared memory.",
    "Explain paged attention in one sentence.",
    "List three prime numbers.",
]


def main(argv: list[str]) -> int:
    from actors.server_args import ServerArgs

    ap = argparse.ArgumentParser(prog="ringserve generate", description="generate text through the engine")
    ap.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (default, generated offline), 'smollm2', a model directory or a .gguf file",
    )
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four built-in prompts")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    ap.add_argument(
        "--batch", type=int, default=0, help="also time N requests (the prompts repeated) through the engine"
    )
    ServerArgs.add_cli_args(ap)
    args = ap.parse_args(argv)
    server = {
        k: v for k, v in vars(args).items() if k in ServerArgs.__dataclass_fields__ and k != "model_path"
    }
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")

    from actors.engine import Engine

    t0 = time.perf_counter()
    with Engine(args.model, **server) as engine:
        print(f"engine up in {time.perf_counter() - t0:.1f}s: {engine.model_dir}", file=sys.stderr)
        tok = engine.tokenizer
        texts = args.prompt or DEFAULT_PROMPTS
        if args.no_chat or not tok.chat_template:
            prompts = texts
        else:
            prompts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
                )
                for t in texts
            ]
        sp = {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
        }
        print(f"### {texts[0]}")
        shown = 0
        for chunk in engine.generate(prompts[0], sp, stream=True):
            print(chunk["text"][shown:], end="", flush=True)
            shown = len(chunk["text"])
        print()
        if len(prompts) > 1:
            for text, out in zip(texts[1:], engine.generate(prompts[1:], sp), strict=True):
                print(f"### {text}\n{out['text']}")
        if args.batch:
            batch = [prompts[i % len(prompts)] for i in range(args.batch)]
            t = time.perf_counter()
            outs = engine.generate(
                batch, [{**sp, "ignore_eos": True, "sampling_seed": i} for i in range(len(batch))]
            )
            dt = time.perf_counter() - t
            n = sum(o["meta_info"]["completion_tokens"] for o in outs)
            info = engine.get_server_info()
            print(f"throughput: {len(batch)} requests, {n} output tokens in {dt:.2f}s = {n / dt:.0f} tok/s "
                  f"(host {info['host_s_per_step'] * 1e3:.2f} ms / runner {info['forward_s_per_step'] * 1e3:.2f} ms per step)",
                  file=sys.stderr)  # fmt: skip
    return 0
