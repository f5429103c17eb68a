"""Sampler: exact keep-masks on hand-made logits; seeded draws independent of batch neighbours."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model.sampler import keep_mask, sample
from model.step import ExecutorConfig, ModelExecutor
from model.step_inputs import DeviceRow, DeviceSampling, SamplingBatch


def sb(temperature, top_k=-1, top_p=1.0, min_p=0.0, seed=0, position=0) -> SamplingBatch:
    n = len(temperature)

    def col(x, dt):
        return jnp.asarray(np.broadcast_to(np.asarray(x, dt), (n,)))

    t = col(temperature, np.float32)
    k, p, m = col(top_k, np.int32), col(top_p, np.float32), col(min_p, np.float32)
    return SamplingBatch(t, k, p, m, col(seed, np.uint32), col(position, np.int32), jnp.any(t > 0), jnp.bool_(True))


# probs at temperature 1: [0.5, 0.25, 0.125, 0.0625, 0.0625]
LOGITS = np.log(np.array([[0.5, 0.25, 0.125, 0.0625, 0.0625]], np.float32))


def mask(**kw) -> list[bool]:
    return np.asarray(keep_mask(jnp.asarray(LOGITS), sb([1.0], **kw)))[0].tolist()


def test_top_k_mask():
    assert mask(top_k=1) == [True, False, False, False, False]
    assert mask(top_k=3) == [True, True, True, False, False]
    # rank ties (ids 3 and 4 have equal probability) are broken by lower id first
    assert mask(top_k=4) == [True, True, True, True, False]
    assert mask(top_k=-1) == [True] * 5


def test_top_p_mask():
    assert mask(top_p=0.5) == [True, False, False, False, False]  # 0.5 reached by the first
    assert mask(top_p=0.51) == [True, True, False, False, False]
    assert mask(top_p=0.75) == [True, True, False, False, False]
    assert mask(top_p=0.76) == [True, True, True, False, False]
    assert mask(top_p=1.0) == [True] * 5


def test_min_p_mask():
    assert mask(min_p=0.5) == [True, True, False, False, False]  # p >= 0.25
    assert mask(min_p=0.26) == [True, True, False, False, False]  # p >= 0.13
    assert mask(min_p=0.51) == [True, False, False, False, False]  # p >= 0.255
    assert mask(min_p=0.125) == [True, True, True, True, True]  # 0.0625 >= 0.0625


def test_filters_combine():
    assert mask(top_k=3, top_p=0.6) == [True, True, False, False, False]
    assert mask(top_k=2, min_p=0.1) == [True, True, False, False, False]


def test_temperature_changes_the_mass_top_p_sees():
    # at temperature 0.5 the probs become [0.76, 0.19, 0.05, 0.01, 0.01]
    m = np.asarray(keep_mask(jnp.asarray(LOGITS), sb([0.5], top_p=0.9)))[0].tolist()
    assert m == [True, True, False, False, False]


def test_draws_stay_inside_the_mask_and_greedy_is_argmax():
    logits = jnp.asarray(np.repeat(LOGITS, 64, axis=0))
    seeds = np.arange(64)
    out = sample(logits, sb([1.0] * 64, top_k=2, seed=seeds), top_n=2)
    assert set(np.asarray(out.tokens).tolist()) <= {0, 1}
    assert len(set(np.asarray(out.tokens).tolist())) == 2  # both survivors get drawn across seeds
    np.testing.assert_allclose(np.asarray(out.top_logprobs)[0], np.log([0.5, 0.25]), rtol=1e-5)
    assert np.asarray(out.top_ids)[0].tolist() == [0, 1]
    greedy = sample(logits, sb([0.0] * 64, seed=seeds), top_n=0)
    assert np.asarray(greedy.tokens).tolist() == [0] * 64
    np.testing.assert_allclose(np.asarray(greedy.logprobs), np.log(0.5), rtol=1e-5)


def test_same_seed_same_tokens_alone_or_in_a_batch_of_8(tiny_dir):
    cfg = ExecutorConfig(page_size=16, num_pages=128, max_context_len=256, max_batch=8, max_extend_tokens=256, precompile=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 2000, n).astype(np.int32) for n in (9, 30, 4, 17, 25, 8, 12, 40)]
    params = [DeviceSampling(temperature=0.8, top_p=0.95, top_k=50, seed=1000 + i) for i in range(8)]

    def run(indices: list[int]) -> dict[int, list[int]]:
        ex = ModelExecutor(tiny_dir("llama"), cfg)
        pages = {i: np.arange(1 + 8 * i, 9 + 8 * i, dtype=np.int32) for i in indices}
        out, rows = ex.run([DeviceRow(prompts[i], 0, pages[i], params[i]) for i in indices])
        gen = {i: [int(out.tokens[r])] for i, r in zip(indices, rows, strict=True)}
        for _ in range(12):
            segs = [DeviceRow(np.array([gen[i][-1]], np.int32), len(prompts[i]) + len(gen[i]) - 1, pages[i], params[i]) for i in indices]
            out, rows = ex.run(segs)
            for i, r in zip(indices, rows, strict=True):
                gen[i].append(int(out.tokens[r]))
        return gen

    together = run(list(range(8)))
    alone = run([3])
    assert alone[3] == together[3]
    assert len({tuple(v) for v in together.values()}) == 8
    # a different seed really changes the stream (the draw is random, not greedy)
    params[3] = DeviceSampling(temperature=0.8, top_p=0.95, top_k=50, seed=7)
    assert run([3])[3] != alone[3]
