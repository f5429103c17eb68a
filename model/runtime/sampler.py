"""Sampling on device: greedy, temperature, top-k, top-p, min-p, per-request seed, logprobs.

Per row (one request), with p = softmax(logits / temperature) sorted in descending order
(ties broken by lower token id first), token at sorted rank r is kept iff all of
    top-k :  r < top_k                       (top_k <= 0 means no limit)
    top-p :  sum(p[:r]) < top_p              (the smallest prefix whose mass reaches top_p)
    min-p :  p[r] >= min_p * p[0]
The kept set is therefore a prefix of that order; its length c and the value tau of its last
token decide the mask: every token with p > tau, and the lowest-id tokens with p == tau up to
c. Nothing is sorted (a sort of [32, 49152] takes 0.55 s on XLA CPU): c and tau come from the
`CANDIDATES` largest probabilities (`lax.top_k`) when the prefix fits in them, which is the
common case, and otherwise from one bisection over the probabilities' float bits (non-negative
floats order as their bit patterns; 31 passes over the rows finding top-k's and top-p's values
together), exact as well.

The token is then drawn from the kept set renormalised, by the Gumbel-max trick. The noise is a
counter-based hash of (seed, position, token id) (`gumbel_noise`): a request's random stream
depends only on its seed and the position of the token being sampled, never on its batch
neighbours or the batch size. temperature == 0 is greedy (argmax of the raw logits, lowest id
on ties).

What the logits go through before a token is drawn, in vLLM's order (each step under a
`lax.cond` on whether any row uses it, so a step where none does skips it; no program is added
for any of them):

    grammar mask        a token the row's grammar does not allow gets logit -inf
    min_new_tokens      below the row's `min_until` position its held-back stop ids get -inf
                        (unless nothing else is left: a grammar that allows only EOS wins)
    logit_bias          added to the biased ids' logits
    repetition penalty  every token the prompt or the output holds: logit / p if > 0, else * p
                        (HF's RepetitionPenaltyLogitsProcessor, vLLM's and SGLang's rule)
    frequency, presence logit - f * (its count in the output) - p * (1 if the output holds it)
    temperature, top-k / top-p / min-p, the draw (above)

The penalties read the slot's token counts, kept on device beside the FutureMap
(model/runtime/step.py): one int32 per (slot, token), `PROMPT_BIT` set for a token of the
prompt, the low bits counting it in the output; a verify round's sample also counts the drafts
before it (`prior`). Greedy rows take the argmax of the adjusted logits.

Logprobs (`raw`, the default, vLLM's raw_logprobs) are of the model's distribution after the
grammar mask only: log_softmax of the logits, before the adjustments, temperature and filters,
like SGLang's default `output_token_logprobs`; `processed` (vLLM's processed_logprobs): of the
distribution the token was drawn from, after all of them (the kept set renormalised; a greedy
row's: the adjusted logits at temperature 1). A request's token_ids_logprob (`logprob_ids`, K
per sample) are read from the same logits; prompt positions' logprobs (`position_logprobs`:
the log-softmax of the logits at a prompt position, read at the token that follows it) are
always raw. A step's samples' logprobs are computed only when some sample reads them
(`any_logprobs`; the top-n, `any_top`); otherwise they are zeros. A logprob of -inf (a token
nothing may draw) reads as the float32 minimum, as SGLang clamps it (JSON has no infinity).

The set each token was drawn from (`kept`: the sampling mask slime and SGLang return for
top-p replay, SGLang's `return_top_p_token_ids`) comes back as packed bits, [S, W] int32 in
the grammar mask's layout, when some sample wants it (`any_kept`; else zeros): the kept set
within the finite logits for a drawn row, the chosen token alone for a greedy one.

A grammar's mask is an input of every program ([S, W] int32 packed bits, bit t % 32 of word
t // 32 allows token t), applied under `lax.cond(any_mask)`, so unconstrained steps skip it.

Over a `tp` mesh whose LM head splits the vocabulary (model/runtime/vocab.py `VocabSplit`) every
[S, V] step above runs on each device's columns under `shard_map` (the functions take the
`VocabAxis` they reduce over); what crosses is per-row: maxima, sums, the argmax's and top-k's
merges, the tie counts before a shard. The noise is drawn by global token id, so a seed draws
the same token from the same logits on any split; `kept` comes back split by its words.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ringserve.model.compute.step_inputs import SamplingBatch
from ringserve.model.runtime.vocab import VocabAxis, VocabSplit

Arr = Any  # jax.Array on device; np.ndarray while the host builds it

CANDIDATES = 256  # largest probabilities taken by lax.top_k for the filters' fast path
_ONE_BITS = 0x3F800000  # float32 1.0 as int32: every probability's bits are <= this
PROMPT_BIT = 1 << 30  # a slot's token count: this bit for a token of the prompt, the low bits its output count
COUNT_BITS = PROMPT_BIT - 1
_LOGPROB_FLOOR = float(jnp.finfo(jnp.float32).min)


class SampleOut(NamedTuple):
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] f32 logprob of the chosen token
    top_ids: jax.Array  # [S, N] int32 (N = top_logprobs_num compiled in; may be 0)
    top_logprobs: jax.Array  # [S, N] f32
    ids_logprobs: jax.Array  # [S, K] f32 logprobs of each sample's token_ids_logprob (K may be 0)
    kept: jax.Array  # [S, W] int32 packed bits: the set each token was drawn from (zeros unless any_kept)


class PositionLogprobs(NamedTuple):
    """Logprobs at wanted prompt positions (model/compute/step_inputs.py LogprobBatch), P entries."""

    logprobs: jax.Array  # [P] f32 of the token that follows the position
    top_ids: jax.Array  # [P, N] int32
    top_logprobs: jax.Array  # [P, N] f32
    ids_logprobs: jax.Array  # [P, K] f32 of the row's token_ids_logprob


def _bisect_bits(pred: Callable[[jax.Array], jax.Array], shape: tuple[int, ...]) -> jax.Array:
    """The largest int32 b in [0, bits(1.0)] with pred(b) true, elementwise over `shape` (pred
    maps thresholds of that shape to bools of it), given pred(0) true and pred monotone."""

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jnp.zeros(shape, jnp.int32), jnp.full(shape, _ONE_BITS + 1, jnp.int32)
    return jax.lax.fori_loop(0, 31, body, (lo, hi))[0]


def _from_candidates(probs: jax.Array, k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                     va: VocabAxis | None = None):  # fmt: skip
    """(c, tau, resolved, c_m, tau_m) per row, from the CANDIDATES largest probabilities: the
    prefix length and its last value where `resolved`, and min-p's own (exact) count and value.
    A row is resolved when its prefix ends inside the candidates, or when min-p ends it and
    top-p is known not to end it sooner (top-p off, or reached inside the candidates); a row
    with no filter at all is resolved (c = its whole row) beside filtered ones."""
    va = va or VocabAxis.whole(probs.shape[1])
    v = va.size
    thr = (min_p * va.max(probs))[:, None]
    c_m = jnp.maximum(va.sum(probs >= thr), 1)  # the top token always passes
    tau_m = va.min(jnp.where(probs >= thr, probs, jnp.inf))
    nc = min(CANDIDATES, v)
    cand = va.top_k(probs, nc)[0]  # [S, nc] descending
    upper = jnp.triu(jnp.ones((nc, nc), jnp.float32))  # prefix sums as one product
    cum = jnp.matmul(cand, upper, precision=jax.lax.Precision.HIGHEST)
    reached = cum >= top_p[:, None]  # cum(r) >= top_p: r is the last kept
    # top-p's length: reached inside the candidates, v when off, v + 1 when not known (longer)
    c_p = jnp.where(reached.any(-1), jnp.argmax(reached, axis=-1) + 1, jnp.where(top_p > 1, v, v + 1))
    c = jnp.minimum(jnp.minimum(k, c_p), c_m)
    resolved = (c <= nc) | ((c == c_m) & (c_p <= v))
    tau = jnp.where(c <= nc, jnp.take_along_axis(cand, jnp.minimum(c, nc)[:, None] - 1, axis=-1)[:, 0], tau_m)
    return c, tau, resolved, c_m, tau_m


def _prefix_len_and_value(probs: jax.Array, k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                          va: VocabAxis | None = None):  # fmt: skip
    """(c, tau) per row: length of the kept prefix of the descending order and the value of its
    last token (see the module docstring). c = min(c_k, c_p, c_m), one per filter: min-p is a
    value threshold (a count and a min); top-k and top-p come from the CANDIDATES largest
    probabilities when every row is resolved by them (`_from_candidates`), else from one
    bisection loop over the whole rows that finds the k-th largest value and top-p's value
    together."""
    va = va or VocabAxis.whole(probs.shape[1])
    s, v = probs.shape[0], va.size
    c_fast, tau_fast, resolved, c_m, tau_m = _from_candidates(probs, k, top_p, min_p, va)

    def by_bisection():
        bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

        def pred(b):  # [2, S]: at least k tokens at or above b; their mass at least top_p
            at_or_above = bits[None] >= b[:, :, None]
            return jnp.stack([va.sum(at_or_above[0]) >= k, va.sum(jnp.where(at_or_above[1], probs, 0)) >= top_p])

        tau_k, tau_p = jax.lax.bitcast_convert_type(_bisect_bits(pred, (2, s)), jnp.float32)
        above = probs > tau_p[:, None]
        mass_above = va.sum(jnp.where(above, probs, 0))
        n_above, n_tied = va.sum(above), va.sum(probs == tau_p[:, None])
        # tied tokens enter in id order until the mass reaches top_p
        more = jnp.where(tau_p > 0, jnp.ceil((top_p - mass_above) / jnp.where(tau_p > 0, tau_p, 1)), n_tied)
        c_p = jnp.where(top_p < 1, n_above + jnp.clip(more.astype(jnp.int32), 1, n_tied), v)
        c = jnp.minimum(jnp.minimum(k, c_p), c_m)
        tau = jnp.where(c == k, tau_k, jnp.where(c == c_p, tau_p, tau_m))
        # rows the candidates settle keep their answer: a row's mask never depends on whether a
        # neighbour sent the batch here (the two ways round a sum differently at the boundary)
        return jnp.where(resolved, c_fast, c), jnp.where(resolved, tau_fast, tau)

    return jax.lax.cond(jnp.all(resolved), lambda: (c_fast, tau_fast), by_bisection)


def _temperature(sp: SamplingBatch) -> jax.Array:
    """[S, 1] divisor of the logits: the row's temperature, 1 for greedy rows."""
    return jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]


def keep_mask(logits: jax.Array, sp: SamplingBatch) -> jax.Array:
    """Boolean [S, V] mask of the tokens each row may sample (see the module docstring)."""
    return _keep_mask_scaled(logits / _temperature(sp), sp, VocabAxis.whole(logits.shape[1]))


def _keep_mask_scaled(scaled: jax.Array, sp: SamplingBatch, va: VocabAxis) -> jax.Array:
    """keep_mask of logits already divided by the temperature (this device's columns of them)."""
    v = va.size
    probs = va.softmax(scaled)
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, v), v)
    top_p = jnp.where(sp.top_p < 1, sp.top_p, 2.0)  # 1 = off (a float sum may fall short of 1)
    c, tau = _prefix_len_and_value(probs, k, top_p, sp.min_p, va)
    above = probs > tau[:, None]
    tied = probs == tau[:, None]
    room = c - va.sum(above)  # tied tokens the prefix takes, lowest ids first

    def some_tied():
        # tied tokens before this one (11 ms at [32, 49152]), the shards before this one's included
        tie_rank = jnp.cumsum(tied, axis=-1) - tied + va.before(tied.sum(-1))[:, None]
        return above | (tied & (tie_rank < room[:, None]))

    return jax.lax.cond(jnp.all(room >= va.sum(tied)), lambda: above | tied, some_tied)


def _mix32(x: jax.Array) -> jax.Array:
    """lowbias32 (C. Wellons' hash-prospector): a bijection of uint32 with near-ideal avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seed: jax.Array, position: jax.Array, v: int, first: jax.Array | int = 0) -> jax.Array:
    """Gumbel(0, 1) noise [S, v] of tokens first..first + v - 1: element (row, token) is a hash
    of (seed, position, token), so a device holding a shard of the vocabulary draws its
    tokens' noise as one device holding all of it does.

    A counter-based generator like Philox or threefry, cut to what sampling needs: a per-row
    64-bit key (hashed seed, hashed position; distinct positions of one seed never share a
    key), and three lowbias32 rounds per element with the key mixed in between, to 23-bit
    uniforms in (0, 1). jax.random's threefry took 28 ms for [32, 49152] on XLA CPU and 0.6 s
    to compile; this takes 6 ms and 0.1 s."""
    k0 = _mix32(seed.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))[:, None]
    k1 = _mix32(position.astype(jnp.uint32) ^ jnp.uint32(0x85EBCA6B))[:, None]
    tok = (jnp.arange(v, dtype=jnp.uint32) + jnp.asarray(first).astype(jnp.uint32))[None, :]
    x = _mix32(_mix32(_mix32(tok ^ k0) + k1) ^ k0)
    return -jnp.log(-jnp.log(_uniform(x)))


def _uniform(x: jax.Array) -> jax.Array:
    """uint32 -> float32 uniform in [2^-24, 1 - 2^-24], never 0 or 1 (a Gumbel of +-inf would
    win any draw): 23 bits, centred, so every value is exact in float32."""
    return ((x >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def _first_max(x: jax.Array) -> jax.Array:
    """argmax over the last axis of [S, V] (lowest index on ties), in two stages where V splits
    into blocks of `_MAX_BLOCK`: each block's max, the first block holding the row's max, the
    first index in that block equal to it. XLA CPU reduced the one-stage form (a max, then a min
    of the indices equal to it) through [S, V] temporaries, paged in afresh each step
    (SmolLM2's 64 logits rows: 5.8 ms and 788 page faults a call, against 1.1 ms and none; XLA's
    own argmax 4.3 ms)."""
    s, v = x.shape
    if v % _MAX_BLOCK or v < 4 * _MAX_BLOCK:
        ids = jnp.arange(v, dtype=jnp.int32)
        return jnp.min(jnp.where(x == x.max(-1, keepdims=True), ids, v - 1), axis=-1)
    blocks = x.reshape(s, v // _MAX_BLOCK, _MAX_BLOCK)
    block_max = blocks.max(-1)  # [S, V / B]
    top = block_max.max(-1, keepdims=True)
    first = jnp.argmax(block_max == top, axis=-1).astype(jnp.int32)  # argmax of a bool: its first True
    block = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]  # [S, B]
    return first * _MAX_BLOCK + jnp.argmax(block == top, axis=-1).astype(jnp.int32)


_MAX_BLOCK = 256


def allowed_only(logits: jax.Array, mask: jax.Array, va: VocabAxis | None = None) -> jax.Array:
    """logits [S, V] (`va`: this device's columns of them) with every token a row's mask [S, W]
    does not allow at -inf. A row allowing nothing (never sent: a matcher with nothing left
    finishes its request) is left as it is."""
    s, v = logits.shape
    va = va or VocabAxis.whole(v)
    assert mask.shape[1] * 32 >= va.size, f"mask of {mask.shape[1]} words for a vocabulary of {va.size}"
    mask = va.mask_words(mask)
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32], token w * 32 + b
    allowed = bits.reshape(s, -1)[:, :v].astype(bool)
    allowed = allowed | ~va.any(allowed, keepdims=True)
    return jnp.where(allowed, logits, -jnp.inf)


def pack_bits(mask: jax.Array) -> jax.Array:
    """Boolean [S, V] as [S, ceil(V / 32)] int32, bit t % 32 of word t // 32 for token t (the
    grammar mask's layout)."""
    s, v = mask.shape
    w = -(-v // 32)
    bits = jnp.pad(mask, ((0, 0), (0, w * 32 - v))).reshape(s, w, 32).astype(jnp.uint32)
    words = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)  # distinct bits: an OR
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def adjusted(logits: jax.Array, sp: SamplingBatch, counts: jax.Array | None, va: VocabAxis | None = None) -> jax.Array:
    """The logits after min_new_tokens' held-back stop ids, logit_bias and the penalties (the
    module docstring), each skipped when no sample uses it; `counts`: the slots' token counts
    [slots, V] (None: a program without them, tests); `va`: the columns held here (ids are
    global: each device adjusts those of its own columns)."""
    va = va or VocabAxis.whole(logits.shape[1])
    if sp.ban is not None:
        logits = jax.lax.cond(sp.any_adjust, lambda: _held_back_and_biased(logits, sp, va), lambda: logits)
    if counts is not None and sp.repetition is not None:
        logits = jax.lax.cond(sp.any_penalty, lambda: _penalized(logits, sp, counts, va), lambda: logits)
    return logits


def _held_back_and_biased(logits: jax.Array, sp: SamplingBatch, va: VocabAxis) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    held = (sp.position < sp.min_until)[:, None] & (sp.ban >= 0)
    out = logits.at[rows, va.local_ids(sp.ban, held)].set(-jnp.inf, mode="drop")  # (out of range: dropped)
    out = jnp.where(va.any(out > -jnp.inf, keepdims=True), out, logits)  # nothing left: not held back
    return out.at[rows, va.local_ids(sp.bias_ids, sp.bias_ids >= 0)].add(sp.bias, mode="drop")


def _penalized(logits: jax.Array, sp: SamplingBatch, counts: jax.Array, va: VocabAxis) -> jax.Array:
    s = logits.shape[0]
    c = counts[sp.slot]  # [S, V] (this device's columns)
    if sp.prior is not None:  # a verify round's drafts before the sample count as its output
        c = c.at[jnp.arange(s)[:, None], va.local_ids(sp.prior, sp.prior >= 0)].add(1, mode="drop")
    n = (c & COUNT_BITS).astype(jnp.float32)
    rp = jnp.where(sp.repetition > 0, sp.repetition, 1.0)[:, None]  # (padding rows: 0)
    x = jnp.where(c != 0, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return x - sp.frequency[:, None] * n - sp.presence[:, None] * (n > 0)


def sample(logits: jax.Array, sp: SamplingBatch, top_n: int, counts: jax.Array | None = None,
           processed: bool = False, vocab: VocabSplit | None = None) -> SampleOut:  # fmt: skip
    """Sample one token per row of logits [S, V] (f32), within each row's mask, after the
    adjustments (`counts`: the slots' token counts the penalties read); `processed`: the
    logprobs are of the distribution drawn from (else the model's). `vocab`: the logits' and
    counts' columns split over the devices (model/runtime/vocab.py): each device samples its
    own and only [S] or [S, k] values cross between them; `kept` comes back split likewise."""
    if vocab is None:
        return _sample(logits, sp, top_n, counts, processed, VocabAxis.whole(logits.shape[1]))
    out_specs = (P(), P(), P(), P(), P(), vocab.spec(2))  # SampleOut's fields: kept split by its words
    out = vocab.run(lambda lg, c, sp: tuple(_sample(lg, sp, top_n, c, processed, vocab.axis)), (logits, counts), (sp,),
                    out_specs)  # fmt: skip
    return SampleOut(*out)


def _sample(logits: jax.Array, sp: SamplingBatch, top_n: int, counts: jax.Array | None, processed: bool,
            va: VocabAxis) -> SampleOut:  # fmt: skip
    """`sample` over the columns `va` holds (all of them, or this device's)."""
    s, v = logits.shape
    if sp.mask is not None:
        logits = jax.lax.cond(sp.any_mask, lambda: allowed_only(logits, sp.mask, va), lambda: logits)
    raw, logits = logits, adjusted(logits, sp, counts, va)
    greedy = va.first_max(logits, _first_max)
    w = -(-v // 32)

    def kept_bits(kept: Callable[[], jax.Array]) -> jax.Array:
        return jax.lax.cond(sp.any_kept, lambda: pack_bits(kept()), lambda: jnp.zeros((s, w), jnp.int32))

    def one_hot() -> jax.Array:
        return va.ids() == greedy[:, None]

    def draw(_):
        scaled = logits / _temperature(sp)
        mask = jax.lax.cond(sp.any_filter, lambda: _keep_mask_scaled(scaled, sp, va), lambda: jnp.ones((s, v), bool))
        scores = jnp.where(mask, scaled + gumbel_noise(sp.seed, sp.position, v, va.offset()), -jnp.inf)
        drawn = va.first_max(scores, _first_max)
        random = (sp.temperature > 0)[:, None]
        kept = kept_bits(lambda: jnp.where(random, mask & (scaled > -jnp.inf), one_hot()))
        dist = jnp.where(random, jnp.where(mask, scaled, -jnp.inf), logits) if processed else None
        return jnp.where(sp.temperature > 0, drawn, greedy), kept, dist

    def plain(_):
        return greedy, kept_bits(one_hot), logits if processed else None

    tokens, kept, dist = jax.lax.cond(sp.any_random, draw, plain, None)
    chosen, top_ids, top_lp, ids_lp = _wanted_logprobs(dist if processed else raw, tokens, top_n, sp, va)
    return SampleOut(tokens, chosen, top_ids, top_lp, ids_lp, kept)


def _wanted_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int, sp: SamplingBatch, va: VocabAxis):
    """`_read_logprobs` for the samples whose logprobs are read: with no sample's logprobs
    wanted (`any_logprobs`, `any_top` False) they are zeros, not computed (their log-sum-exp
    and top-k passes over [S, V]: SmolLM2, top_n 5, 64 rows, 13.5 -> 1.4 ms alone; the decode
    step 282.7 -> 270.8 ms in one process, alternating)."""
    s = logits.shape[0]
    k = 0 if sp.logprob_ids is None else sp.logprob_ids.shape[1]
    zeros = (jnp.zeros((s,), jnp.float32), jnp.zeros((s, top_n), jnp.int32), jnp.zeros((s, top_n), jnp.float32),
             jnp.zeros((s, k), jnp.float32))  # fmt: skip
    every = lambda: _read_logprobs(logits, tokens, top_n, sp.logprob_ids, va)  # noqa: E731
    if top_n == 0:
        return jax.lax.cond(sp.any_logprobs, every, lambda: zeros)

    def no_top():
        chosen, _, _, ids_lp = _read_logprobs(logits, tokens, 0, sp.logprob_ids, va)
        return chosen, zeros[1], zeros[2], ids_lp

    which = jnp.where(sp.any_top, 2, jnp.where(sp.any_logprobs, 1, 0))
    return jax.lax.switch(which, [lambda: zeros, no_top, every])


def _read_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int, ids: jax.Array | None, va: VocabAxis):
    """(logprob of `tokens`, top-n ids, top-n logprobs, logprobs of `ids`) of logits rows [S, V]
    (`va`: the columns held here; a split row's log-sum-exp sums the shards' sums).
    Only the entries read are turned into logprobs, each as
    `jax.nn.log_softmax` computes it ((x - max) - log(sum(exp(x - max))): the same bits), so
    no [S, V] array of logprobs is written and read back (SmolLM2, 64 rows: ~2.5 ms a step)."""
    s = logits.shape[0]
    top = va.max(logits, keepdims=True)
    log_sum = jnp.log(va.sum(jnp.exp(logits - top), keepdims=True))

    def logprob(x: jax.Array) -> jax.Array:  # x: entries of each row's logits [S, n]
        return jnp.maximum((x - top) - log_sum, _LOGPROB_FLOOR)  # (-inf: the float32 minimum)

    chosen = logprob(va.take(logits, tokens[:, None]))[:, 0]
    if top_n > 0:
        top_x, top_ids = va.top_k(logits, top_n)
        top_lp = logprob(top_x)
    else:
        top_lp, top_ids = jnp.zeros((s, 0), jnp.float32), jnp.zeros((s, 0), jnp.int32)
    if ids is None:
        ids_lp = jnp.zeros((s, 0), jnp.float32)
    else:
        ids_lp = logprob(va.take(logits, jnp.clip(ids, 0, va.size - 1)))
    return chosen, top_ids.astype(jnp.int32), top_lp, ids_lp


def read_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int, ids: jax.Array | None,
                  vocab: VocabSplit | None = None):  # fmt: skip
    """`_read_logprobs` of logits [S, V], on each device's columns where `vocab` splits them."""
    if vocab is None:
        return _read_logprobs(logits, tokens, top_n, ids, VocabAxis.whole(logits.shape[1]))
    return vocab.run(lambda lg, t, i: _read_logprobs(lg, t, top_n, i, vocab.axis), (logits,), (tokens, ids),
                     (P(), P(), P(), P()))  # fmt: skip


def position_logprobs(logits_fn: Callable[[jax.Array], jax.Array], h: jax.Array, lb: Any, top_n: int,
                      group: int, fixed: bool = False, vocab: VocabSplit | None = None) -> PositionLogprobs:  # fmt: skip
    """Logprobs at the wanted positions of hidden states h [T, H] (`lb`: model/compute/step_inputs.py
    LogprobBatch): `group` positions (at most P, unless `fixed`) per iteration of a loop that
    runs ceil(count / group) times, so a step that wants none computes nothing. `fixed`: always
    `group` (padded), so every position goes through one shape whatever the program and its
    bits do not depend on the others (the deterministic mode, whose LM head is batch-invariant).
    `vocab`: the logits' columns split over the devices (`sample`'s)."""
    k = lb.ids.shape[1]
    if lb.index is None:  # a program that takes no prompt positions
        return PositionLogprobs(jnp.zeros((0,), jnp.float32), jnp.zeros((0, top_n), jnp.int32),
                                jnp.zeros((0, top_n), jnp.float32), jnp.zeros((0, k), jnp.float32))  # fmt: skip
    p = lb.index.shape[0]
    group = group if fixed else min(group, p)
    pad = -p % group
    index, target, row = (jnp.pad(x, (0, pad)) for x in (lb.index, lb.target, lb.row))

    def body(i, outs):
        lo = i * group
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, group)  # noqa: E731
        o = read_logprobs(logits_fn(h[cut(index)]), cut(target), top_n, lb.ids[cut(row)] if k else None, vocab)
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, b, lo, 0) for a, b in zip(outs, o, strict=True))

    n = p + pad
    init = (jnp.zeros((n,), jnp.float32), jnp.zeros((n, top_n), jnp.int32), jnp.zeros((n, top_n), jnp.float32),
            jnp.zeros((n, k), jnp.float32))  # fmt: skip
    # Under a cond, not a bare loop of 0 trips: where P == group the body does not depend on the
    # iteration (its slice starts clamp to 0) and XLA hoists it out of the loop, which would run
    # the LM head over every token of every extend step (measured: SmolLM2, T = 256, 0.74 -> 3.5 s).
    outs = jax.lax.cond(lb.count > 0, lambda: jax.lax.fori_loop(0, (lb.count + group - 1) // group, body, init),
                        lambda: init)  # fmt: skip
    return PositionLogprobs(*(a[:p] for a in outs))


def sample_rows(
    logits_fn: Callable[[jax.Array], jax.Array],
    hs: jax.Array,
    sp: SamplingBatch,
    top_n: int,
    n_rows: jax.Array,
    group: int | None,
    fixed: int | None = None,
    counts: jax.Array | None = None,
    processed: bool = False,
    vocab: VocabSplit | None = None,
) -> SampleOut:
    """Sample rows of hidden states hs [R, H] (logits_fn: [S, H] -> f32 [S, V]; `counts` and
    `processed` as `sample`'s).

    group None: every row at once. Otherwise only the first `n_rows` (a traced count), `group`
    rows per iteration of a runtime-trip-count loop, so the LM head and the sampler cost what
    the real rows need (an extend program has R = max_batch rows, often a handful real);
    rows past the last group read as token 0.

    fixed: rows padded to a multiple of it and sampled `fixed` at a time, so that every row is
    computed by one program shape whatever the step (the deterministic mode).

    vocab: the logits' columns split over the devices (`sample`'s)."""
    r = hs.shape[0]
    if fixed is not None:
        pad = -r % fixed
        hs = jnp.pad(hs, ((0, pad), (0, 0)))
        sp = SamplingBatch(*(_pad_rows(x, pad) for x in sp))
        out = sample_rows(logits_fn, hs, sp, top_n, n_rows, fixed, None, counts, processed, vocab)
        return SampleOut(*(a[:r] for a in out))
    if group is None or r <= group or r % group:
        return sample(logits_fn(hs), sp, top_n, counts, processed, vocab)

    def cut(x, lo):
        return x if x is None or jnp.ndim(x) == 0 else jax.lax.dynamic_slice_in_dim(x, lo, group)

    def body(i, outs):
        lo = i * group
        o = sample(logits_fn(cut(hs, lo)), SamplingBatch(*(cut(x, lo) for x in sp)), top_n, counts, processed, vocab)
        return SampleOut(*(jax.lax.dynamic_update_slice_in_dim(a, b, lo, 0) for a, b in zip(outs, o, strict=True)))

    v = jax.eval_shape(logits_fn, hs[:1]).shape[1]  # (the LM head traced for its shape alone)
    k = 0 if sp.logprob_ids is None else sp.logprob_ids.shape[1]
    init = SampleOut(
        jnp.zeros((r,), jnp.int32), jnp.zeros((r,), jnp.float32), jnp.zeros((r, top_n), jnp.int32),
        jnp.zeros((r, top_n), jnp.float32), jnp.zeros((r, k), jnp.float32), jnp.zeros((r, -(-v // 32)), jnp.int32),
    )  # fmt: skip
    if vocab is not None:  # the kept bits stay split, as each group's come
        init = init._replace(kept=jax.lax.with_sharding_constraint(init.kept, vocab.sharding(2)))
    return jax.lax.fori_loop(0, (n_rows + group - 1) // group, body, init)


def _pad_rows(x: Any, pad: int) -> Any:
    """x with `pad` zero rows more (scalars and None as they are)."""
    if x is None or jnp.ndim(x) == 0:
        return x
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (jnp.ndim(x) - 1))
