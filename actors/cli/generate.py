"""`ringserve generate` and `ringserve generate-static`.

`generate` starts the engine (every actor, over shared-memory rings), streams one completion,
prints the others, and optionally times N requests through continuous batching; the README's
first command runs it on the embedded tiny model. `generate-static` runs the same prompts
through the model runtime alone (in-process, static batch, no actors): the runtime's smoke path.
"""

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


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (default, generated offline), 'smollm2', a model directory or a .gguf file",
    )
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable) (default: four built-in prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt at most (default: 32)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy (default: 0.0)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass; 1: off (default: 1.0)")
    ap.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1: off (default: -1)")
    ap.add_argument("--no-chat", action="store_true", help="do not apply the chat template (default: applied)")
    ap.add_argument("--batch", type=int, default=0, help="also time N requests, the prompts repeated (default: 0)")
    return ap


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch < 0:
        raise SystemExit(f"--batch must be >= 0, got {args.batch}")


def chat_prompts(tok, texts: list[str], no_chat: bool) -> list[str]:
    """The prompts as the model's chat template renders a user turn (or as given)."""
    if no_chat or not tok.chat_template:
        return list(texts)
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]


def main(argv: list[str]) -> int:
    from ringserve.actors.server_args import ServerArgs
    from ringserve.actors.server_options import OPTIONS

    ap = _parser("ringserve generate", "generate text through the engine (every actor)")
    ServerArgs.add_cli_args(ap, skip=("model_path",))
    args = ap.parse_args(argv)
    _check(args)
    server = {k: v for k, v in vars(args).items() if k in OPTIONS}

    from ringserve.actors.frontend.engine import Engine

    t0 = time.perf_counter()
    with Engine(args.model, **server) as engine:
        print(f"engine up in {time.perf_counter() - t0:.1f}s: {engine.model_dir}", file=sys.stderr)
        texts = args.prompt or DEFAULT_PROMPTS
        prompts = chat_prompts(engine.tokenizer, texts, args.no_chat)
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
            pending = engine.get_server_info().get("programs_pending", 0)
            if pending:  # (what the silence is: the engine served while these compiled in the background)
                print(f"waiting for the last {pending} of {engine.runner_info.get('programs_total')} step programs "
                      "to compile before timing the batch ...", file=sys.stderr, flush=True)  # fmt: skip
            info = engine.wait_compiled()  # the timed batch runs on every step program
            print(f"all {info['programs_total']} step programs compiled {time.perf_counter() - t0:.1f}s after start",
                  file=sys.stderr)  # fmt: skip
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


def main_static(argv: list[str]) -> int:
    ap = _parser("ringserve generate-static", "generate in-process with the model runtime alone (no actors)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp-size", type=int, default=1)
    args = ap.parse_args(argv)
    _check(args)

    from ringserve.model.checkpoints.resolve import resolve_model
    from ringserve.model.checkpoints.tokenizer import load_tokenizer
    from ringserve.model.compute.step_inputs import DeviceSampling
    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
    from ringserve.model.runtime.generate import generate

    path, tok_dir = resolve_model(args.model)
    t0 = time.perf_counter()
    ex = ModelExecutor(path, ExecutorConfig(dtype=args.dtype, tp_size=args.tp_size, max_batch=64, num_pages=4096,
                                               max_context_len=2048))
    tok = load_tokenizer(tok_dir)
    print(f"loaded {path} ({ex.model_config.family}, {ex.model_config.num_layers} layers) and compiled "
          f"{ex.num_programs} buckets in {time.perf_counter() - t0:.1f}s", file=sys.stderr)  # fmt: skip
    texts = args.prompt or DEFAULT_PROMPTS
    plain = args.no_chat or not tok.chat_template  # a rendered chat template has its own specials
    ids = [tok.encode(p, add_special_tokens=plain) for p in chat_prompts(tok, texts, args.no_chat)]
    sampling = DeviceSampling(args.temperature, args.top_k, args.top_p, 0.0, args.seed)
    eos = set(ex.model_config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())

    def stream(i: int, token: int) -> None:
        if i == 0:
            print(tok.decode([token]), end="", flush=True)

    print(f"### {texts[0]}")
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
