"""bench/workload.py: seeded datasets within their ranges, arrivals, unique prompt tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringserve.bench.workload import (
    arrival_times,
    random_requests,
    shared_prefix_requests,
    sharegpt_like_requests,
    unique_prompt_tokens,
)  # fmt: skip


def test_random_is_seeded_and_within_ranges():
    a = random_requests(50, 2000, seed=3, input_len=(16, 40), output_len=(5, 9))
    assert a == random_requests(50, 2000, seed=3, input_len=(16, 40), output_len=(5, 9))
    assert a != random_requests(50, 2000, seed=4, input_len=(16, 40), output_len=(5, 9))
    assert all(16 <= r.prompt_len <= 40 and 5 <= r.output_len <= 9 for r in a)
    lens = [r.prompt_len for r in a]
    assert max(lens) - min(lens) >= 20  # spread over the range, not one value
    ids = [t for r in a for t in r.prompt]
    assert min(ids) >= 3 and max(ids) < 2000  # no pad / bos / eos


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    reqs = shared_prefix_requests(groups=3, per_group=4, vocab=1000, seed=0, system_len=50, question_len=7, output_len=5)
    assert len(reqs) == 12 and all(r.prompt_len == 57 and r.output_len == 5 for r in reqs)
    for g in range(3):
        group = reqs[4 * g : 4 * g + 4]
        assert all(r.prompt[:50] == group[0].prompt[:50] for r in group)
    assert reqs[0].prompt[:50] != reqs[4].prompt[:50]
    # a perfect prefix cache computes each system prompt once and every question
    assert unique_prompt_tokens([r.prompt for r in reqs]) == 3 * 50 + 12 * 7


def test_sharegpt_like_lengths():
    reqs = sharegpt_like_requests(2000, 5000, seed=0, max_input=1024, max_output=512)
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    assert ins.min() >= 4 and ins.max() <= 1024 and outs.min() >= 4 and outs.max() <= 512
    assert 190 < ins.mean() < 260 and 160 < outs.mean() < 215  # ShareGPT-like means, long tails
    assert np.median(ins) < ins.mean() and np.median(outs) < outs.mean()


def test_arrivals():
    assert arrival_times(4, math.inf) == [0.0, 0.0, 0.0, 0.0]
    assert arrival_times(0, 3.0) == []
    t = arrival_times(5000, 10.0, seed=1)
    assert t == arrival_times(5000, 10.0, seed=1) and t[0] == 0.0
    gaps = np.diff(t)
    assert (gaps > 0).all()
    assert 0.095 < gaps.mean() < 0.105  # exponential gaps of mean 1 / rate
    assert 0.9 < gaps.std() / gaps.mean() < 1.1  # an exponential's std equals its mean
    with pytest.raises(ValueError, match="request_rate=0"):
        arrival_times(3, 0)


@pytest.mark.parametrize(
    "prompts, unique",
    [
        ([], 0),
        ([[1, 2, 3]], 3),
        ([[1, 2, 3], [1, 2, 3]], 3),  # the same prompt twice
        ([[1, 2, 3], [1, 2]], 3),  # one a prefix of the other
        ([[1, 2, 3], [1, 2, 4], [1, 5]], 5),  # trie: 1-2-3, 2-4, 1-5
        ([[9, 1], [1, 9], [9, 1, 1]], 5),
    ],
)
def test_unique_prompt_tokens_is_the_trie_size(prompts, unique):
    assert unique_prompt_tokens(prompts) == unique
