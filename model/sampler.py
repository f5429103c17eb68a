"""Sampling on device: greedy, temperature, top-k, top-p, min-p, per-request seed, logprobs.

Per row (one request), with p = softmax(logits / temperature) sorted in descending order
(ties broken by lower token id first), token at sorted rank r is kept iff all of
    top-k :  r < top_k                       (top_k <= 0 means no limit)
    top-p :  sum(p[:r]) < top_p              (the smallest prefix whose mass reaches top_p)
    min-p :  p[r] >= min_p * p[0]
The token is then drawn from the kept set renormalised, by the Gumbel-max trick with noise from
`fold_in(PRNGKey(seed), position)`: a request's random stream depends only on its seed and the
position of the token being sampled, never on its batch neighbours or the batch size.
temperature == 0 is greedy (argmax of the raw logits, lowest id on ties).

Logprobs are of the raw model distribution (log_softmax of the logits, before temperature and
filtering), like SGLang's default `output_token_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from model.step_inputs import SamplingBatch

Arr = Any  # jax.Array on device; np.ndarray while the host builds it


class SampleOut(NamedTuple):
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] f32 logprob of the chosen token
    top_ids: jax.Array  # [S, N] int32 (N = top_logprobs_num compiled in; may be 0)
    top_logprobs: jax.Array  # [S, N] f32


def keep_mask(logits: jax.Array, sp: SamplingBatch) -> jax.Array:
    """Boolean [S, V] mask of the tokens each row may sample (see the module docstring)."""
    s, v = logits.shape
    t = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
    probs = jax.nn.softmax(logits / t[:, None], axis=-1)
    order = jnp.argsort(-probs, axis=-1, stable=True)  # descending, lower id first on ties
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    rank = jnp.arange(v, dtype=jnp.int32)[None, :]
    k = jnp.where(sp.top_k > 0, sp.top_k, v)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = (rank < k[:, None]) & (mass_before < sp.top_p[:, None]) & (
        sorted_p >= sp.min_p[:, None] * sorted_p[:, :1]
    )
    keep_sorted = keep_sorted.at[:, 0].set(True)  # the most likely token always survives
    rows = jnp.arange(s)[:, None]
    return jnp.zeros((s, v), bool).at[rows, order].set(keep_sorted)


def _gumbel(seed: jax.Array, position: jax.Array, v: int) -> jax.Array:
    def one(sd, pos):
        key = jax.random.fold_in(jax.random.key(sd), pos)
        return jax.random.gumbel(key, (v,), jnp.float32)

    return jax.vmap(one)(seed, position)


def sample(logits: jax.Array, sp: SamplingBatch, top_n: int) -> SampleOut:
    """Sample one token per row of logits [S, V] (f32)."""
    s, v = logits.shape
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        mask = jax.lax.cond(sp.any_filter, lambda: keep_mask(logits, sp), lambda: jnp.ones((s, v), bool))
        t = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
        scores = jnp.where(mask, logits / t[:, None] + _gumbel(sp.seed, sp.position, v), -jnp.inf)
        drawn = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        return jnp.where(sp.temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(sp.any_random, draw, lambda _: greedy, None)
    chosen_lp = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    if top_n > 0:
        top_lp, top_ids = jax.lax.top_k(logprobs_all, top_n)
    else:
        top_lp, top_ids = jnp.zeros((s, 0), jnp.float32), jnp.zeros((s, 0), jnp.int32)
    return SampleOut(tokens, chosen_lp, top_ids.astype(jnp.int32), top_lp)


def sample_rows(
    logits_fn: Callable[[jax.Array], jax.Array],
    hs: jax.Array,
    sp: SamplingBatch,
    top_n: int,
    n_rows: jax.Array,
    group: int | None,
    fixed: int | None = None,
) -> SampleOut:
    """Sample rows of hidden states hs [R, H] (logits_fn: [S, H] -> f32 [S, V]).

    group None: every row at once. Otherwise only the first `n_rows` (a traced count), `group`
    rows per iteration of a runtime-trip-count loop, so the LM head and the sampler cost what
    the real rows need (an extend program has R = max_batch rows, often a handful real);
    rows past the last group read as token 0.

    fixed: rows padded to a multiple of it and sampled `fixed` at a time, so that every row is
    computed by one program shape whatever the step (the deterministic mode)."""
    r = hs.shape[0]
    if fixed is not None:
        pad = -r % fixed
        hs = jnp.pad(hs, ((0, pad), (0, 0)))
        sp = SamplingBatch(*(x if x.ndim == 0 else jnp.pad(x, (0, pad)) for x in sp))
        out = sample_rows(logits_fn, hs, sp, top_n, n_rows, fixed)
        return SampleOut(*(a[:r] for a in out))
    if group is None or r <= group or r % group:
        return sample(logits_fn(hs), sp, top_n)

    def cut(x, lo):
        return x if x.ndim == 0 else jax.lax.dynamic_slice_in_dim(x, lo, group)

    def body(i, outs):
        lo = i * group
        o = sample(logits_fn(cut(hs, lo)), SamplingBatch(*(cut(x, lo) for x in sp)), top_n)
        return SampleOut(*(jax.lax.dynamic_update_slice_in_dim(a, b, lo, 0) for a, b in zip(outs, o, strict=True)))

    init = SampleOut(
        jnp.zeros((r,), jnp.int32), jnp.zeros((r,), jnp.float32),
        jnp.zeros((r, top_n), jnp.int32), jnp.zeros((r, top_n), jnp.float32),
    )  # fmt: skip
    return jax.lax.fori_loop(0, (n_rows + group - 1) // group, body, init)
