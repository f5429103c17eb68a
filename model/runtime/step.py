"""The traced step: forward + sample over the paged KV cache, as pure functions of their inputs.

    step(params, kv, future, fb, rs, lb, lora, top_n, verify, multistep)
        -> kv, future, SampleOut, accepted, PositionLogprobs, hidden states, routed experts

`params` is the parameter tree, `kv` the attention backend's cache arrays and `future` the
FutureMap, all three passed in and (kv, future) returned updated: the executor donates them, so
the update is in place (model/runtime/executor.py). `fb` / `rs` / `lb` are one step's padded inputs
(model/compute/step_inputs.py: forward, sampling, and the logprobs asked beyond the samples: prompt
positions and token_ids_logprob); `lora` each row's adapter slot and the adapter pool
(model/weights/lora.py; None when the server serves no adapters: the program is the one without them);
`top_n`, `verify` and `multistep` are static (part of the program's key).

One path for every row (model/compute/step_inputs.py): inputs `-(slot + 1)` read the FutureMap, each row
samples its last k1 = max(1, verify) tokens, and a row accepts its leading drafts (the tokens
after its first sampled one) that equal the targets sampled before them; a plain row has no
drafts, so it accepts 0 and keeps its one sample. The FutureMap then holds, per slot, the token
after the accepted ones (the bonus token) and its position.

A multi-step decode program (`multistep`, k1 = verify steps) takes rows laid out as verify
rounds (FUTURE(slot) and k1 - 1 places) and runs k1 decode steps one after another in one
device loop, each step's samples the next one's inputs: every row yields k1 tokens, as a
verify round that accepted all, so the scheduler books them on one path. The host planned
the rows at their true lengths (nothing in flight is a bound), and no host plan is needed
for the attention (the backends whose `plan` is empty: model/runtime/executor.py checks).

FutureMap: per request slot (+ a sink row for padding) the token it sampled last and that
token's position (= KV tokens valid before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ringserve.model.compute.step_inputs import ForwardBatch, LogprobBatch, RowSampling, SamplingBatch
from ringserve.model.layers.decoder import CausalLM
from ringserve.model.layers.lora import LoraBatch
from ringserve.model.runtime.sampler import position_logprobs, sample_rows
from ringserve.model.runtime.vocab import VocabSplit

StepFn = Callable[..., tuple[Any, Any, Any, jax.Array, Any, jax.Array, jax.Array]]


def make_step(model: CausalLM, sample_group: int | None, fixed_rows: int | None, position_group: int = 64,
              processed: bool = False, hidden: bool = False, routed: bool = False,
              vocab: VocabSplit | None = None) -> StepFn:  # fmt: skip
    """The step function of `model`. Extend programs sample their (few real) rows `sample_group`
    at a time (None: all at once); `fixed_rows` pads the sampler to one tile shape (the
    deterministic mode). Prompt positions' logprobs are computed `position_group` at a time
    (in the deterministic mode always that many, padded: one shape whatever the program).
    `processed`: the samples' logprobs are of the distribution drawn from (model/runtime/sampler.py);
    `hidden`: the programs return their tokens' last hidden states; `vocab`: the logits' columns
    split over the devices as the LM head computes them, never gathered (model/runtime/vocab.py);
    `routed`: the expert ids each token's MoE layers routed it to (the forward's own choice,
    model/layers/decoder.py)."""

    def forward(params, ids, fb: ForwardBatch, kv, lora: LoraBatch | None):
        """h [T, H], kv, and with `routed` the tokens' routed expert ids (int32 [T, M, k];
        else [0, 0, 0])."""
        if routed:
            return model.forward(params, ids, fb, kv, lora, routed=True)
        h, kv = model.forward(params, ids, fb, kv, lora)
        return h, kv, jnp.zeros((0, 0, 0), jnp.int32)

    def step(params, kv, future, fb: ForwardBatch, rs: RowSampling, lb: LogprobBatch, lora: LoraBatch | None,
             top_n: int, verify: int, multistep: bool = False):  # fmt: skip
        """kv and the slots' state (the FutureMap's token and position, the token counts) in,
        updated, out, with the samples ([R * k1], row after row), the drafts each row accepted
        ([R] int32), the logprobs at the wanted prompt positions ([P]) and, with `hidden`, the
        tokens' last hidden states ([T, H]; else [0, 0]) and, with `routed`, their routed
        experts ([T, M, k]; else [0, 0, 0])."""
        k1 = max(1, verify)
        if multistep:
            return multi_step(params, kv, future, fb, rs, lb, lora, top_n, k1)
        tok, pos, counts = future
        ids = jnp.where(fb.input_ids < 0, tok[jnp.maximum(-fb.input_ids - 1, 0)], fb.input_ids)
        if k1 > 1:  # verify rounds were planned at bounds on their slots' lengths
            fb = at_true_positions(model, fb, pos)
        h, kv, experts = forward(params, ids, fb, kv, lora)
        r, n = fb.kv_len.shape[0], fb.num_rows[0]
        drafts = fb.input_ids[fb.sample_idx.reshape(r, k1)[:, 1:]]  # raw ids: NO_DRAFT (-1) never matches
        # each token's seed at its position; a verify round's drafts count before the samples after them
        sp = per_sample(rs, lb.ids, fb.positions[fb.sample_idx] + 1, k1, fb.sample_slot, drafts)
        group = sample_group if fb.input_ids.shape[0] != r else None  # not a decode program
        if group is not None and k1 == 1 and fixed_rows is None:  # an extend program: its producing rows alone
            order, producing = producing_first(fb, n, tok.shape[0] - 1)
            out = sample_rows(lambda x: model.logits(params, x), h[fb.sample_idx[order]], _rows(sp, order), top_n,
                              producing, group, None, counts, processed, vocab)  # fmt: skip
            out = _rows(out, jnp.argsort(order))  # back in row order (the rest: zeros)
        else:
            out = sample_rows(lambda x: model.logits(params, x), h[fb.sample_idx], sp, top_n, n * k1, group,
                              fixed_rows, counts, processed, vocab)  # fmt: skip
        targets = out.tokens.reshape(r, k1)
        match = (drafts >= 0) & (drafts == targets[:, :-1])
        real = jnp.arange(r) < n
        accepted = jnp.where(real, jnp.cumprod(match, axis=1).sum(axis=1), 0).astype(jnp.int32)
        tok = tok.at[fb.sample_slot].set(jnp.take_along_axis(targets, accepted[:, None], axis=1)[:, 0])
        pos = pos.at[fb.sample_slot].set(fb.kv_len - (k1 - 1) + accepted)
        counts = counted(counts, fb.sample_slot, targets, real[:, None] & (jnp.arange(k1)[None, :] <= accepted[:, None]))
        prompt = position_logprobs(lambda x: model.logits(params, x), h, lb, top_n, position_group,
                                   fixed=fixed_rows is not None, vocab=vocab)  # fmt: skip
        hs = h.astype(jnp.float32) if hidden else jnp.zeros((0, 0), jnp.float32)
        return kv, (tok, pos, counts), out, accepted, prompt, hs, experts

    def multi_step(params, kv, future, fb: ForwardBatch, rs: RowSampling, lb: LogprobBatch, lora: LoraBatch | None,
                   top_n: int, k1: int):  # fmt: skip
        """k1 decode steps in a device loop (the module docstring); outputs as `step`'s."""
        tok, pos, counts = future
        r, n = fb.kv_len.shape[0], fb.num_rows[0]
        real = jnp.arange(r) < n
        first = fb.row_start[:-1]  # each row's first place (padding rows: the padding tokens)
        ids = fb.input_ids[first]
        ids = jnp.where(ids < 0, tok[jnp.maximum(-ids - 1, 0)], ids)
        mask = None if rs.mask is None else rs.mask.reshape(r, k1, -1)

        def one(carry, j):
            # the weights ride in the carry through a barrier: XLA:CPU gathers bf16 embedding
            # rows through f32 and would hoist that convert of the whole table out of the loop
            # (SmolLM2 bf16: a 113 MB f32 copy each call, 12.3 -> 19 ms a token)
            params, kv, counts, ids = carry
            params = jax.lax.optimization_barrier(params)
            at = first + j
            dfb = fb._replace(input_ids=ids, positions=fb.positions[at], out_loc=fb.out_loc[at],
                              local_out_loc=None if fb.local_out_loc is None else fb.local_out_loc[at],
                              row_start=jnp.minimum(jnp.arange(r + 1), n).astype(jnp.int32),
                              kv_len=jnp.where(real, fb.kv_len - (k1 - 1) + j, 0), sample_idx=jnp.arange(r, dtype=jnp.int32))  # fmt: skip
            h, kv, experts = forward(params, ids, dfb, kv, lora)
            sp = per_sample(rs._replace(mask=None if mask is None else mask[:, j]), lb.ids, dfb.positions + 1, 1,
                            fb.sample_slot)  # fmt: skip
            o = sample_rows(lambda x: model.logits(params, x), h, sp, top_n, n, None, fixed_rows, counts, processed,
                            vocab)  # fmt: skip
            counts = counted(counts, fb.sample_slot, o.tokens[:, None], real[:, None])
            return (params, kv, counts, o.tokens), (o, h.astype(jnp.float32) if hidden else None,
                                                    experts if routed else None)  # fmt: skip

        (_, kv, counts, last), (outs, hs, experts) = jax.lax.scan(one, (params, kv, counts, ids), jnp.arange(k1))
        # [k1, R, ...] -> row after row: step j's sample of row r at r * k1 + j (as its input token)
        out, hs, experts = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((r * k1,) + a.shape[2:]),
                                        (outs, hs, experts))  # fmt: skip
        tok = tok.at[fb.sample_slot].set(last)
        pos = pos.at[fb.sample_slot].set(fb.kv_len)
        accepted = jnp.where(real, k1 - 1, 0).astype(jnp.int32)
        assert lb.index is None  # (a decode program takes no prompt positions: empty logprobs, h unread)
        prompt = position_logprobs(lambda x: model.logits(params, x), jnp.zeros((0, 1)), lb, top_n, position_group)
        hs = hs if hidden else jnp.zeros((0, 0), jnp.float32)
        return kv, (tok, pos, counts), out, accepted, prompt, hs, experts if routed else jnp.zeros((0, 0, 0), jnp.int32)

    return step


def at_true_positions(model: CausalLM, fb: ForwardBatch, fpos: jax.Array) -> ForwardBatch:
    """A verify program's rows moved to their slots' true lengths (the FutureMap's positions).

    The host planned each round at a bound on the slot's length (its rounds in flight taken as
    all accepted); positions, token locations (local ones too), kv_len and the attention plan move down by the
    difference. The pages the bound covers are a superset of what the true length needs."""
    t, r, ps = fb.input_ids.shape[0], fb.kv_len.shape[0], model.attn.geo.page_size
    n = fb.num_rows[0]
    extend = fb.row_start[1:] - fb.row_start[:-1]
    shift = jnp.where(jnp.arange(r) < n, fb.kv_len - extend - fpos[fb.sample_slot], 0)
    flat = jnp.arange(t)
    tok_row = jnp.clip(jnp.searchsorted(fb.row_start, flat, side="right") - 1, 0, r - 1)
    real_tok = flat < fb.row_start[n]
    positions = fb.positions - jnp.where(real_tok, shift[tok_row], 0)

    def locations(pages: jax.Array, planned: jax.Array) -> jax.Array:
        return jnp.where(real_tok, pages[tok_row, positions // ps] * ps + positions % ps, planned)

    local = None if fb.local_pages is None else locations(fb.local_pages, fb.local_out_loc)
    return fb._replace(
        positions=positions, out_loc=locations(fb.pages, fb.out_loc), kv_len=fb.kv_len - shift,
        attn=model.attn.shift_plan(fb.attn, shift), local_out_loc=local,
    )  # fmt: skip


def producing_first(fb: ForwardBatch, n: jax.Array, sink: int) -> tuple[jax.Array, jax.Array]:
    """The rows in the order an extend program samples them, and how many produce a token: the
    real rows whose sample goes to a slot (a chunked prefill's middle chunk goes to the `sink`:
    its sample is never read) first, each kind in row order. The sampler's loop then runs over
    the producing rows alone (model/runtime/sampler.py `sample_rows`): an extend program has
    max_batch rows, of which a step's prefill uses a few (256 rows of a 49,152 vocabulary:
    top_k(256) over [256, V] alone ~1.8 ms on v5e)."""
    r = fb.kv_len.shape[0]
    producing = (jnp.arange(r) < n) & (fb.sample_slot != sink)
    return jnp.argsort(~producing, stable=True), producing.sum().astype(jnp.int32)


def _rows(tree: Any, order: jax.Array) -> Any:
    """Every per-row array of `tree` (leading axis R) in `order`; scalars and None as they are."""
    return type(tree)(*(x if x is None or jnp.ndim(x) == 0 else x[order] for x in tree))


def per_sample(rs: RowSampling, ids: jax.Array, position: jax.Array, k1: int, slot: jax.Array,
               drafts: jax.Array | None = None) -> SamplingBatch:  # fmt: skip
    """The sampler's input: each row's parameters (and token_ids_logprob `ids` [R, K], token
    counts' `slot` [R]) for each of its k1 sampled tokens (the mask is per sampled token
    already); `drafts` [R, k1 - 1]: a verify round's, each sample's `prior` the ones before it."""

    def each(x: jax.Array) -> jax.Array:
        return x if k1 == 1 or x is None else jnp.repeat(x, k1, axis=0)

    prior = None
    if drafts is not None and k1 > 1:  # sample j of a round: drafts [0, j) before it
        before = jnp.arange(k1 - 1)[None, :] < jnp.arange(k1)[:, None]  # [k1, k1 - 1]
        prior = jnp.where(before[None], drafts[:, None, :], -1).reshape(-1, k1 - 1)
    return SamplingBatch(each(rs.temperature), each(rs.top_k), each(rs.top_p), each(rs.min_p), each(rs.seed),
                         position, rs.any_random, rs.any_filter, rs.mask, rs.any_mask,
                         each(ids) if ids.shape[1] else None, rs.any_logprobs, rs.any_top, each(rs.repetition),
                         each(rs.frequency), each(rs.presence), rs.any_penalty, each(slot), prior,
                         each(rs.min_until), each(rs.ban), each(rs.bias_ids), each(rs.bias), rs.any_adjust,
                         rs.any_kept)  # fmt: skip


def counted(counts: jax.Array, slots: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """The slots' token counts with each valid token counted once more in its row's slot
    (slots [R], tokens and valid [R, n]); padding rows count in the sink slot."""
    v = counts.shape[1]
    return counts.at[slots[:, None], jnp.where(valid, tokens, v)].add(1, mode="drop")


def make_logits(model: CausalLM) -> Callable[..., tuple[Any, jax.Array]]:
    """A diagnostic step: kv in and out, f32 logits of each row's last token (no sampling)."""

    def logits(params, kv, fb: ForwardBatch):
        h, kv = model.forward(params, fb.input_ids, fb, kv)
        return kv, model.logits(params, h[fb.sample_idx])

    return logits
