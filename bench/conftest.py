"""Benchmark helpers: a per-run table of medians so each file can print ours/peer ratios."""

from __future__ import annotations

import pytest

RESULTS: dict[tuple[str, ...], float] = {}  # key -> median seconds per call
TOKENS: dict[tuple[str, ...], int] = {}  # key -> tokens per call


@pytest.fixture
def record(benchmark):
    """record(key, tokens_per_call): after `benchmark` ran, store its median and return tokens/s."""

    def rec(key: tuple[str, ...], tokens: int) -> float | None:
        stats = getattr(benchmark, "stats", None)
        if not stats:  # --benchmark-disable: ran once as a smoke test, nothing measured
            return None
        median = stats.stats.median
        RESULTS[key] = median
        TOKENS[key] = tokens
        benchmark.extra_info["tokens_per_s"] = tokens / median
        return tokens / median

    return rec


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("ringserve vs peers (median of this run)")
    tr.write_line("ours/transformers = tokens/s ratio (> 1: ringserve is faster)")
    for key, ours in sorted(RESULTS.items()):
        if key[-1] != "ringserve":
            continue
        peer_key = key[:-1] + ("transformers",)
        n = TOKENS[key]
        line = f"{' / '.join(key[:-1]):32s} ringserve {ours * 1e3:8.2f} ms {n / ours:8.0f} tok/s"
        if peer_key in RESULTS:
            peer = RESULTS[peer_key]
            line += f"   transformers {peer * 1e3:8.2f} ms {TOKENS[peer_key] / peer:8.0f} tok/s   ours/transformers {peer / ours:5.2f}x"
        tr.write_line(line)
