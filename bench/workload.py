"""Benchmark workloads: what to send (prompt token ids, output lengths) and when (arrivals).

Every dataset is synthetic and seeded (same arguments, same requests), made of random token ids
(`3 <= id < vocab`, so no special token appears), so a run needs no download and ringserve and
transformers see exactly the same prompts:

    random         input and output lengths uniform in [lo, hi] (the "mixed workload": inputs
                   16-512, outputs 16-256)
    shared-prefix  `groups` long system prompts, each followed by `per_group` distinct questions
                   (SGLang's generated-shared-prefix dataset); requests of a group share the
                   system prompt, so a prefix cache computes it once
    sharegpt       lengths drawn from log-normal fits resembling ShareGPT conversations (input
                   mean ~230 tokens, output mean ~190, long tails; clipped to the given limits).
                   Synthetic: no ShareGPT text is read or downloaded.

Arrivals: `request_rate = inf` sends everything at t = 0 (offline); a finite rate draws
exponential gaps (a Poisson process of that many requests per second), seeded.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

DATASETS = ("random", "shared-prefix", "sharegpt")
FIRST_ID = 3  # ids 0-2 are special tokens (pad / bos / eos) in every model we run


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def random_requests(n: int, vocab: int, seed: int = 0, input_len: tuple[int, int] = (16, 512),
                    output_len: tuple[int, int] = (16, 256)) -> list[Request]:  # fmt: skip
    """Input and output lengths uniform in the closed ranges; random token ids."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_len[0], input_len[1] + 1, n)
    outs = rng.integers(output_len[0], output_len[1] + 1, n)
    return [Request(rng.integers(FIRST_ID, vocab, int(k)).tolist(), int(o)) for k, o in zip(ins, outs, strict=True)]


def shared_prefix_requests(groups: int, per_group: int, vocab: int, seed: int = 0, system_len: int = 1024,
                           question_len: int = 64, output_len: int = 32) -> list[Request]:  # fmt: skip
    """`groups` x `per_group` requests, group-major order: system prompt of the group + question."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        system = rng.integers(FIRST_ID, vocab, system_len).tolist()
        for _ in range(per_group):
            out.append(Request(system + rng.integers(FIRST_ID, vocab, question_len).tolist(), output_len))
    return out


# log-normal (mu, sigma) of token counts: medians ~130 (input) and ~120 (output), means ~230 / ~190
SHAREGPT_INPUT = (math.log(130.0), 1.07)
SHAREGPT_OUTPUT = (math.log(120.0), 0.95)


def sharegpt_like_requests(n: int, vocab: int, seed: int = 0, max_input: int = 1024,
                           max_output: int = 512) -> list[Request]:  # fmt: skip
    rng = np.random.default_rng(seed)
    ins = np.clip(rng.lognormal(*SHAREGPT_INPUT, n).round(), 4, max_input).astype(int)
    outs = np.clip(rng.lognormal(*SHAREGPT_OUTPUT, n).round(), 4, max_output).astype(int)
    return [Request(rng.integers(FIRST_ID, vocab, int(k)).tolist(), int(o)) for k, o in zip(ins, outs, strict=True)]


def arrival_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: all 0 for an infinite rate, else
    the cumulative sums of exponential gaps of mean 1/rate (the first request leaves at 0)."""
    if n == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request_rate={request_rate}: must be > 0 (inf: all at once)")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / request_rate, n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def unique_prompt_tokens(prompts: list[list[int]]) -> int:
    """Distinct prefixes over all prompts = nodes of their token trie: what a perfect prefix
    cache would compute. Sorted order puts each prompt next to the one sharing most with it, so
    the trie holds sum(len) - sum(common prefix with the previous prompt) tokens."""
    ordered = sorted(prompts)
    total = 0
    prev: list[int] = []
    for p in ordered:
        common = 0
        for a, b in zip(prev, p, strict=False):
            if a != b:
                break
            common += 1
        total += len(p) - common
        prev = p
    return total
