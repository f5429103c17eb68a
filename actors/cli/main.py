"""The `ringserve` command line.

Subcommands are thin: each parses its own flags and calls into the package that owns the work.
Imports are lazy so `ringserve cleanup` never pays for importing JAX. A user's mistake (a
ValueError: a model that is not there, a port in use, options that clash) ends a command with its
one-line message and exit status 2; `--log-level debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(argv: list[str]) -> int:
    from ringserve.model.checkpoints.tiny import main

    return main(argv)


def _fetch_model(argv: list[str]) -> int:
    from ringserve.model.checkpoints.fetch import main

    return main(argv)


def _models(argv: list[str]) -> int:
    from ringserve.actors.cli.models import main

    return main(argv)


def _cleanup(argv: list[str]) -> int:
    from ringserve.actors.transport.cleanup import cleanup_main

    return cleanup_main(argv)


def _owned_process() -> None:
    """This process is ringserve's alone (serve, generate): it need not import torch."""
    from ringserve.actors.transport.actor import without_torch

    without_torch()


def _generate(argv: list[str]) -> int:
    _owned_process()
    from ringserve.actors.cli.generate import main

    return main(argv)


def _generate_static(argv: list[str]) -> int:
    _owned_process()
    from ringserve.actors.cli.generate import main_static

    return main_static(argv)


def _serve(argv: list[str]) -> int:
    _owned_process()
    from ringserve.actors.cli.serve import main

    return main(argv)


def _compile(argv: list[str]) -> int:
    from ringserve.actors.cli.compile import main

    return main(argv)


def _launch_plan(argv: list[str]) -> int:
    from ringserve.actors.cli.launch_plan import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from ringserve.actors.cli.bench import main

    return main(argv)


COMMANDS = {
    "serve": (_serve, "serve a model over the IPC socket and HTTP (OpenAI + SGLang APIs) until SIGINT/SIGTERM"),
    "bench": (_bench, "benchmark serving: throughput, TTFT/TPOT/ITL/E2E, vs transformers, step profile (bench/serving.py)"),
    "compile": (_compile, "compile a server's step programs ahead of time for a TPU topology, with their costs"),
    "generate": (_generate, "generate text through the engine (every actor) and report throughput"),
    "generate-static": (_generate_static, "generate in-process with the model runtime alone (static batch, no actors)"),
    "make-tiny-model": (_make_tiny_model, "write a tiny random-weight HF-format model directory"),
    "fetch-model": (_fetch_model, "build a local HF-format copy of a known model (e.g. smollm2)"),
    "launch-plan": (_launch_plan, "dp x tp, page size and buckets for a model on one TPU host (tools/launch_tpu.sh)"),
    "models": (_models, "list the model families served, by HF architecture, with what each supports"),
    "cleanup": (_cleanup, "remove shared-memory segments left behind by dead ringserve processes"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ringserve", description="ringserve LLM serving engine")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    try:
        return COMMANDS[args.command][0](argv[1:])
    except ValueError as e:  # a user's mistake (a model not found, a port in use, options that clash)
        if _debug(argv):
            raise
        print(f"ringserve {args.command}: {e}", file=sys.stderr)  # one line
        return 2


def _debug(argv: list[str]) -> bool:
    """--log-level debug given (the traceback of a refusal then goes with it)."""
    return any(a == "--log-level=debug" or (a == "--log-level" and argv[i + 1:i + 2] == ["debug"])
               for i, a in enumerate(argv))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
