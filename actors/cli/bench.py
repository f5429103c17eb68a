"""`ringserve bench`: the serving benchmark (bench/serving.py), the same flags as `python -m ringserve.bench.serving`.

    ringserve bench --model tiny --num-prompts 64 --backend engine hf       # ours vs transformers
    ringserve bench --request-rate 2 4 8 --max-concurrency 32 --plot --output-json out/run.json
    ringserve bench --dataset shared-prefix --profile                      # + Chrome trace, summary
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from ringserve.bench.serving import main as bench_main

    return bench_main(argv, prog="ringserve bench")
