"""Grammar masks on device: the packed bits unpack to exactly the allowed tokens; the mask comes
before every sampling path (greedy, top-k / top-p / min-p, seeded draws) and before the logprobs;
an all-ones mask or `any_mask` False changes nothing; the grouped and fixed-tile sampling loops
cut each row's mask with its row; `build_batch` places each row's masks at its samples."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.step_inputs import Buckets, DeviceRow, SamplingBatch, build_batch
from ringserve.model.runtime.sampler import allowed_only, sample, sample_rows

V = 70  # not a multiple of 32: the last word is partly padding


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [S, V] -> int32 [S, ceil(V / 32)]: bit t % 32 of word t // 32 allows token t."""
    s, v = allowed.shape
    padded = np.zeros((s, -(-v // 32) * 32), bool)
    padded[:, :v] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def sb(n, temperature, top_k=-1, top_p=1.0, min_p=0.0, seed=0, mask=None) -> SamplingBatch:
    def col(x, dt):
        return jnp.asarray(np.broadcast_to(np.asarray(x, dt), (n,)))

    t = col(temperature, np.float32)
    return SamplingBatch(t, col(top_k, np.int32), col(top_p, np.float32), col(min_p, np.float32),
                         col(seed, np.uint32), col(7, np.int32), jnp.any(t > 0), jnp.bool_(True),
                         None if mask is None else jnp.asarray(mask), jnp.bool_(mask is not None))  # fmt: skip


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (32, V)).astype(np.float32)
    allowed = rng.random((32, V)) < 0.3
    allowed[:, 0] |= ~allowed.any(axis=1)  # every row allows something
    allowed[0] = logits[0] < np.sort(logits[0])[-3]  # row 0: its three best tokens are forbidden
    allowed[1] = True  # row 1: unconstrained (all ones)
    return logits, allowed


def test_bits_unpack_to_exactly_the_allowed_tokens(case):
    logits, allowed = case
    out = np.asarray(allowed_only(jnp.asarray(logits), jnp.asarray(pack(allowed))))
    assert np.array_equal(np.isneginf(out), ~allowed)
    assert np.array_equal(out[allowed], logits[allowed])


def test_greedy_is_the_argmax_of_the_allowed_tokens(case):
    logits, allowed = case
    out = sample(jnp.asarray(logits), sb(32, 0.0, mask=pack(allowed)), top_n=3)
    want = np.where(allowed, logits, -np.inf).argmax(axis=1)
    assert np.asarray(out.tokens).tolist() == want.tolist()
    assert want[0] != logits[0].argmax() and want[1] == logits[1].argmax()
    # logprobs after masking (as SGLang): of the allowed tokens renormalised
    masked = np.where(allowed, logits, -np.inf)
    lse = np.log(np.exp(masked - masked.max(1, keepdims=True)).sum(1)) + masked.max(1)
    np.testing.assert_allclose(np.asarray(out.logprobs), masked[np.arange(32), want] - lse, rtol=1e-5, atol=1e-5)
    assert set(np.asarray(out.top_ids)[0].tolist()) <= set(np.flatnonzero(allowed[0]).tolist())


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.2}, {"top_k": 5, "top_p": 0.9, "min_p": 0.05}])
def test_seeded_draws_equal_drawing_from_the_masked_logits(case, filters):
    logits, allowed = case
    seeds = np.arange(32) * 7919
    got = sample(jnp.asarray(logits), sb(32, 0.8, seed=seeds, mask=pack(allowed), **filters), top_n=0)
    masked = jnp.asarray(np.where(allowed, logits, -np.inf))
    want = sample(masked, sb(32, 0.8, seed=seeds, **filters), top_n=0)
    assert np.asarray(got.tokens).tolist() == np.asarray(want.tokens).tolist()
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=1e-6)
    assert all(allowed[i, t] for i, t in enumerate(np.asarray(got.tokens).tolist()))


def test_all_ones_or_any_mask_false_change_nothing(case):
    logits, _ = case
    seeds = np.arange(32)
    plain = sample(jnp.asarray(logits), sb(32, 1.0, top_k=10, seed=seeds), top_n=2)
    ones = sample(jnp.asarray(logits), sb(32, 1.0, top_k=10, seed=seeds, mask=pack(np.ones((32, V), bool))), top_n=2)
    off = sb(32, 1.0, top_k=10, seed=seeds, mask=np.zeros((32, 3), np.int32))._replace(any_mask=jnp.bool_(False))
    for out in (ones, sample(jnp.asarray(logits), off, top_n=2)):
        assert np.asarray(out.tokens).tolist() == np.asarray(plain.tokens).tolist()
        np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(plain.logprobs))


def test_a_row_allowing_nothing_is_left_unmasked(case):
    logits, _ = case
    out = sample(jnp.asarray(logits[:2]), sb(2, 0.0, mask=np.zeros((2, 3), np.int32)), top_n=0)
    assert np.asarray(out.tokens).tolist() == logits[:2].argmax(1).tolist()
    assert np.isfinite(np.asarray(out.logprobs)).all()


@pytest.mark.parametrize("group, fixed", [(4, None), (None, 8)])
def test_grouped_and_fixed_sampling_cut_each_rows_mask_with_it(case, group, fixed):
    logits, allowed = case
    sp = sb(32, 0.0, mask=pack(allowed))
    out = sample_rows(lambda h: h, jnp.asarray(logits), sp, 0, jnp.int32(32), group, fixed)
    assert np.asarray(out.tokens).tolist() == np.where(allowed, logits, -np.inf).argmax(axis=1).tolist()


def test_build_batch_places_each_rows_masks_at_its_samples():
    buckets = Buckets.make(4, 64, 16)
    pages = np.arange(1, 5, dtype=np.int32)
    m = np.arange(2 * 3, dtype=np.int32).reshape(2, 3) + 5  # [k1 = 2, W = 3]
    rows = [DeviceRow(np.array([-1, 9], np.int32), 4, pages), DeviceRow(np.array([-2, 8], np.int32), 4, pages, mask=m)]
    hb = build_batch(rows, buckets, 16, 4, 4, verify=2)
    mask = hb.sampling.mask
    assert mask.shape == (hb.shape.rows * 2, 3) and bool(hb.sampling.any_mask)
    assert (mask[:2] == -1).all() and np.array_equal(mask[2:4], m) and (mask[4:] == -1).all()
    plain = build_batch(rows[:1], buckets, 16, 4, 4, verify=2)
    assert plain.sampling.mask is None and not plain.sampling.any_mask
    with pytest.raises(ValueError, match="one per sampled token"):
        build_batch([DeviceRow(np.array([-2, 8], np.int32), 4, pages, mask=m[:1])], buckets, 16, 4, 4, verify=2)
