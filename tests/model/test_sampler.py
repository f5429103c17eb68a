"""Sampler: exact keep-masks on hand-made logits and against a sorting reference (both the\ntop-k candidates path and the bisection path); draws with the right frequencies; seeded draws\nindependent of batch neighbours."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringserve.model.runtime.sampler as sampler_mod
from ringserve.model.compute.step_inputs import DeviceRow, DeviceSampling, SamplingBatch
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from ringserve.model.runtime.sampler import gumbel_noise, keep_mask, sample


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
        out, rows, _ = ex.run([DeviceRow(prompts[i], 0, pages[i], params[i]) for i in indices])
        gen = {i: [int(out.tokens[r])] for i, r in zip(indices, rows, strict=True)}
        for _ in range(12):
            segs = [DeviceRow(np.array([gen[i][-1]], np.int32), len(prompts[i]) + len(gen[i]) - 1, pages[i], params[i]) for i in indices]
            out, rows, _ = ex.run(segs)
            for i, r in zip(indices, rows, strict=True):
                gen[i].append(int(out.tokens[r]))
        return gen

    together = run(list(range(8)))
    alone = run([3])
    assert alone[3] == together[3]
    assert len({tuple(v) for v in together.values()}) == 8
    # a different seed really changes the stream (the draw is random, not greedy); hot enough
    # that the random model's peaked rows do not make two seeds agree by chance
    params[3] = DeviceSampling(temperature=2.0, top_k=50, seed=1003)
    hot = run([3])[3]
    params[3] = DeviceSampling(temperature=2.0, top_k=50, seed=7)
    assert run([3])[3] != hot


def reference_mask(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, float]:
    """The module docstring's definition, by sorting (numpy, float64 sums); also the distance of
    the nearest prefix mass to top_p (a float32 sum may land either side closer than that)."""
    order = np.lexsort((np.arange(len(probs)), -probs))  # descending, lower id first on ties
    sp = probs[order].astype(np.float64)
    rank = np.arange(len(probs))
    before = np.cumsum(sp) - sp
    keep = (rank < (top_k if top_k > 0 else len(probs))) & (sp >= min_p * sp[0])
    if top_p < 1:
        keep &= before < top_p
    keep[0] = True
    out = np.zeros(len(probs), bool)
    out[order] = keep
    return out, float(np.min(np.abs(np.cumsum(sp) - top_p)))


@pytest.mark.parametrize("candidates", [256, 1], ids=["top-k-candidates", "bisection"])
def test_keep_mask_equals_the_sorting_definition(candidates, monkeypatch):
    monkeypatch.setattr(sampler_mod, "CANDIDATES", candidates)
    rng = np.random.default_rng(11)
    v, n = 700, 48
    # coarse logits: many exactly tied probabilities; wide and flat rows: prefixes past 256
    scale = rng.choice([0.3, 2.0, 6.0], n)[:, None]
    logits = np.round(rng.normal(size=(n, v)) * scale * 4) / 4
    temp = rng.choice([0.5, 1.0, 1.7], n).astype(np.float32)
    top_k = rng.choice([-1, 1, 3, 40, 300, 699, 900], n)
    top_p = rng.choice([1.0, 0.3, 0.8, 0.95, 0.999], n)
    min_p = rng.choice([0.0, 0.0, 0.01, 0.2], n)
    got = np.asarray(keep_mask(jnp.asarray(logits, jnp.float32), sb(temp, top_k, top_p, min_p)))
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32) / temp[:, None], axis=-1))
    compared = 0
    for i in range(n):
        want, margin = reference_mask(probs[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
        if top_p[i] < 1 and margin < 1e-5:
            continue  # the prefix mass is at top_p within float32 rounding: either answer is right
        assert got[i].tolist() == want.tolist(), (i, int(got[i].sum()), int(want.sum()))
        compared += 1
    assert compared >= 40
    assert (got.sum(-1) > 256).any() and (got.sum(-1) == 1).any()  # both paths' regimes were hit


def test_tied_tokens_at_the_cut_enter_lowest_ids_first():
    """Rows whose cut falls inside a run of equal probabilities (the branch that ranks the tied
    tokens by id): exactly the lowest ids of the run are kept, whatever else the batch holds."""
    v = 700
    logits = np.zeros((5, v), np.float32)
    logits[1, 500:] = 1.0  # 200 tokens above, 500 tied below
    logits[3, ::7] = 2.0  # 100 above, spread out
    top_k = np.array([3, 250, 1, 150, -1])  # the last row keeps everything (room for every tie)
    got = np.asarray(keep_mask(jnp.asarray(logits), sb([1.0] * 5, top_k, [1.0] * 5, [0.0] * 5)))
    assert got[0].tolist() == [i < 3 for i in range(v)]
    assert got[1].tolist() == [i >= 500 or i < 50 for i in range(v)]
    assert got[2].tolist() == [i == 0 for i in range(v)]
    below = [i for i in range(v) if i % 7][:50]
    assert got[3].tolist() == [i % 7 == 0 or i in below for i in range(v)]
    assert got[4].all()


def test_draws_follow_the_kept_distribution():
    # 4,000 draws (seeds x positions) from [0.5, 0.25, 0.125, 0.0625, 0.0625] and from the same
    # distribution cut by top_k=3 (renormalised): chi-square against the expected counts
    n = 4000
    logits = jnp.asarray(np.repeat(LOGITS, n, axis=0))
    seeds, positions = np.arange(n) // 40, np.arange(n) % 40 * 7
    for top_k, probs in [(-1, [0.5, 0.25, 0.125, 0.0625, 0.0625]), (3, [4 / 7, 2 / 7, 1 / 7, 0, 0])]:
        out = sample(logits, sb([1.0] * n, top_k=top_k, seed=seeds, position=positions), top_n=0)
        counts = np.bincount(np.asarray(out.tokens), minlength=5)
        expected = np.asarray(probs) * n
        live = expected > 0
        assert counts[~live].sum() == 0
        chi2 = (((counts - expected) ** 2)[live] / expected[live]).sum()
        assert chi2 < 20.5, (counts, chi2)  # p = 0.001 at 4 degrees of freedom (and below at 2)


def test_noise_is_uniform_and_uncorrelated_across_positions_seeds_and_tokens():
    v = 4096
    g = np.asarray(gumbel_noise(jnp.asarray([3, 3, 4, 0], jnp.uint32), jnp.asarray([10, 11, 10, 0]), v))
    u = np.exp(-np.exp(-g))  # back to the uniforms
    for row in u:
        hist = np.bincount((row * 16).astype(int), minlength=16)
        assert ((hist - v / 16) ** 2 / (v / 16)).sum() < 45  # chi-square, 15 dof, p ~ 1e-4
    corr = np.corrcoef(u)
    assert np.abs(corr[np.triu_indices(4, 1)]).max() < 0.08  # 5 sigma at n = 4096
    assert abs(np.corrcoef(u[0, :-1], u[0, 1:])[0, 1]) < 0.08  # neighbouring tokens
    again = np.asarray(gumbel_noise(jnp.asarray([3], jnp.uint32), jnp.asarray([10]), v))
    np.testing.assert_array_equal(again[0], g[0])  # a function of (seed, position, token) only


def test_rows_without_filters_do_not_force_the_bisection_path():
    # beside a peaked top-p row, rows with no filter (or min-p only) are settled by the
    # candidates: the batch takes the cheap path; a top-k past the candidates is not
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, 5000)).astype(np.float32) * np.array([[9.0], [1.0], [1.0], [1.0]]))
    probs = jax.nn.softmax(logits, axis=-1)
    k = jnp.asarray([5000, 5000, 5000, 1000])
    top_p = jnp.asarray([0.9, 2.0, 2.0, 2.0])  # keep_mask's encoding: > 1 = off
    min_p = jnp.asarray([0.0, 0.0, 0.05, 0.0])
    c, tau, resolved, _, _ = sampler_mod._from_candidates(probs, k, top_p, min_p)
    assert np.asarray(resolved).tolist() == [True, True, True, False]
    assert int(c[1]) == 5000 and float(tau[1]) == float(probs[1].min())
    assert int(c[0]) <= sampler_mod.CANDIDATES
    mask = np.asarray(keep_mask(logits, sb([1.0] * 4, top_k=[-1, -1, -1, 1000], top_p=[0.9, 1, 1, 1], min_p=[0, 0, 0.05, 0])))
    assert mask[1].all() and mask[3].sum() == 1000 and mask[2].sum() == int((probs[2] >= 0.05 * probs[2].max()).sum())


def test_noise_is_finite_so_a_near_certain_token_always_wins():
    # the hash's extremes map strictly inside (0, 1): a uniform of exactly 1 (a 24-bit mapping
    # rounds 0xFFFFFF + 0.5 up to 2^24) is a Gumbel of +inf that wins whatever its token's mass
    u = np.asarray(sampler_mod._uniform(jnp.asarray([0, 0xFFFFFFFF], jnp.uint32)))
    assert 0 < u[0] and u[1] < 1
    v = 49152
    logits = np.zeros((64, v), np.float32)
    logits[:, 0] = 30.0  # token 0: probability 1 - 4.6e-9
    seeds, positions = np.zeros(64, np.int64), np.arange(64) + 40  # (0, 66) drew +inf before
    out = sample(jnp.asarray(logits), sb([1.0] * 64, seed=seeds, position=positions), top_n=0)
    assert np.asarray(out.tokens).tolist() == [0] * 64
    assert np.isfinite(np.asarray(gumbel_noise(jnp.asarray(seeds, jnp.uint32), jnp.asarray(positions), v))).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_no_sample_reads_are_zeros_and_the_rest_unchanged(temperature):
    """any_logprobs / any_top (traced: one program) gate the log-sum-exp and the top-k: what is
    not read is zeros, what is read has the same bits as computing everything; the tokens
    never change."""
    s, v = 6, 300
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((s, v)).astype(np.float32) * 3)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, v, (s, 2)).astype(np.int32))
    base = sb([temperature] * s, top_k=40, seed=np.arange(s), position=7)._replace(logprob_ids=ids)
    run = jax.jit(lambda lp, top: sample(logits, base._replace(any_logprobs=lp, any_top=top), top_n=4))
    full = [np.asarray(a) for a in run(jnp.bool_(True), jnp.bool_(True))]
    assert np.all(full[1] < 0) and np.all(full[3] < 0) and np.all(full[4] < 0)  # real logprobs
    for lp, top in [(True, False), (False, False), (False, True)]:
        out = [np.asarray(a) for a in run(jnp.bool_(lp), jnp.bool_(top))]
        np.testing.assert_array_equal(out[0], full[0])
        for i in (1, 4):  # the chosen token's and token_ids_logprob's
            np.testing.assert_array_equal(out[i], full[i] if lp or top else np.zeros_like(full[i]))
        for i in (2, 3):  # the top-n ids and logprobs
            np.testing.assert_array_equal(out[i], full[i] if top else np.zeros_like(full[i]))
    # the host sets the flags from the rows: any row that reads them (token_ids_logprob reads
    # the log-sum-exp too)
    from ringserve.model.compute.step_inputs import Buckets, build_batch

    buckets = Buckets.make(max_batch=4, max_extend_tokens=64, extend_block=16)

    def flags(*rows: DeviceRow) -> tuple[bool, bool]:
        smp = build_batch(list(rows), buckets, 16, 4, 4, logprob_ids=2).sampling
        return bool(smp.any_logprobs), bool(smp.any_top)

    pages = np.arange(1, 5, dtype=np.int32)
    none = DeviceRow(np.arange(3, 8, dtype=np.int32), 0, pages, DeviceSampling(logprobs=False, top_logprobs=False))
    assert flags(none, none) == (False, False)
    assert flags(none, DeviceRow(none.token_ids, 0, pages, DeviceSampling(top_logprobs=False))) == (True, False)
    assert flags(none, DeviceRow(none.token_ids, 0, pages, DeviceSampling())) == (True, True)
    assert flags(none, DeviceRow(none.token_ids, 0, pages, none.sampling, logprob_ids=np.array([5], np.int32))) == (True, False)


@pytest.mark.parametrize("v", [49152, 1024, 1000, 300])
def test_first_max_is_the_lowest_index_of_the_max(v):
    """Greedy's argmax (two stages where the vocabulary splits into blocks, one otherwise): the
    lowest index holding the row's max, ties within a block, across blocks, all -inf."""
    x = np.random.default_rng(v).standard_normal((9, v)).astype(np.float32)
    x[1, :] = 1.0
    x[2, 5], x[2, v - 3] = 9, 9
    x[3, 300 % v], x[3, 301 % v] = 9, 9
    x[4, :] = -np.inf
    x[5, v - 1] = 50
    x[6, 0] = 50
    x[7, :] = -np.inf
    x[7, v // 2] = 0.0
    want = [int(np.flatnonzero(r == r.max())[0]) for r in x]
    assert np.asarray(jax.jit(sampler_mod._first_max)(jnp.asarray(x))).tolist() == want
