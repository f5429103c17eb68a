"""The traced step: forward + sample over the paged KV cache, as pure functions of their inputs.

    step(params, kv, future, fb, sp, top_n, verify) -> kv, future, SampleOut, accepted

`params` is the parameter tree, `kv` the attention backend's cache arrays and `future` the
FutureMap, all three passed in and (kv, future) returned updated: the executor donates them, so
the update is in place (model/executor.py). `fb` / `sp` are one step's padded inputs
(model/step_inputs.py); `top_n` and `verify` are static (part of the program's key).

FutureMap: per request slot (+ a sink row for padding) the token it sampled last and that
token's position (= KV tokens valid before it). An input id `-(slot + 1)` reads `future[slot]`
on device, which is what lets the scheduler plan one batch ahead (overlap).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from model.llama import CausalLM
from model.sampler import sample_rows
from model.step_inputs import ForwardBatch, SamplingBatch

StepFn = Callable[..., tuple[Any, Any, Any, jax.Array]]


def make_step(model: CausalLM, sample_group: int | None, fixed_rows: int | None) -> StepFn:
    """The step function of `model`. Extend programs sample their (few real) rows `sample_group`
    at a time (None: all at once); `fixed_rows` pads the sampler to one tile shape (the
    deterministic mode)."""

    def step(params, kv, future, fb: ForwardBatch, sp: SamplingBatch, top_n: int, verify: int):
        """kv and the FutureMap (token, position per slot) in, updated, out, with the samples
        and, for a verify step, the drafts each round accepted ([R] int32)."""
        tok, pos = future
        ids = jnp.where(fb.input_ids < 0, tok[jnp.maximum(-fb.input_ids - 1, 0)], fb.input_ids)
        if verify:
            return _verify(model, sample_group, fixed_rows, params, kv, (tok, pos), fb, sp, top_n, verify, ids)
        h, kv = model.forward(params, ids, fb, kv)
        group = sample_group if fb.input_ids.shape[0] != fb.kv_len.shape[0] else None  # not decode
        out = sample_rows(lambda x: model.logits(params, x), h[fb.sample_idx], sp, top_n,
                          fb.num_rows[0], group, fixed_rows)  # fmt: skip
        tok = tok.at[fb.sample_slot].set(out.tokens)
        pos = pos.at[fb.sample_slot].set(fb.kv_len)
        return kv, (tok, pos), out, jnp.zeros(fb.kv_len.shape, jnp.int32)

    return step


def _verify(model: CausalLM, sample_group, fixed_rows, params, kv, future, fb: ForwardBatch, sp: SamplingBatch,
            top_n: int, k1: int, ids):  # fmt: skip
    """A verify step: rounds of k1 = k + 1 tokens (the slot's future token, k drafts).

    The host planned each round at a bound on the slot's length (its rounds in flight taken
    as all accepted); the true length is the FutureMap's position. Positions, token
    locations, kv_len and the attention plan move down by the difference, every token is
    sampled (per-request seeds at the token's own position: the same draws as plain
    decoding), and a round accepts its leading drafts equal to their targets; the target
    after them is the bonus token. The FutureMap moves past what was accepted."""
    tok, fpos = future
    t, r, ps = fb.input_ids.shape[0], fb.kv_len.shape[0], model.attn.geo.page_size
    n = fb.num_rows[0]
    real_row = jnp.arange(r) < n
    base = fpos[fb.sample_slot]  # [R] true length before each round
    bound = fb.kv_len - (fb.row_start[1:] - fb.row_start[:-1])
    shift = jnp.where(real_row, bound - base, 0)
    flat = jnp.arange(t)
    tok_row = jnp.clip(jnp.searchsorted(fb.row_start, flat, side="right") - 1, 0, r - 1)
    real_tok = flat < fb.row_start[n]
    positions = fb.positions - jnp.where(real_tok, shift[tok_row], 0)
    loc = fb.pages[tok_row, positions // ps] * ps + positions % ps
    fb = fb._replace(
        positions=positions, out_loc=jnp.where(real_tok, loc, fb.out_loc), kv_len=fb.kv_len - shift,
        attn=model.attn.shift_plan(fb.attn, shift),
    )  # fmt: skip
    h, kv = model.forward(params, ids, fb, kv)
    per_tok = SamplingBatch(
        sp.temperature[tok_row], sp.top_k[tok_row], sp.top_p[tok_row], sp.min_p[tok_row], sp.seed[tok_row],
        positions + 1, sp.any_random, sp.any_filter,
    )  # fmt: skip
    out = sample_rows(lambda x: model.logits(params, x), h, per_tok, top_n, fb.row_start[n], sample_group,
                      fixed_rows)  # fmt: skip
    idx = jnp.minimum(fb.row_start[:r, None] + jnp.arange(k1)[None, :], t - 1)  # [R, k1]
    targets = out.tokens[idx]
    drafts = fb.input_ids[idx[:, 1:]]  # raw: NO_DRAFT (-1) pads never match
    match = (drafts >= 0) & (drafts == targets[:, :-1])
    accepted = jnp.where(real_row, jnp.cumprod(match, axis=1).sum(axis=1), 0).astype(jnp.int32)
    bonus = jnp.take_along_axis(targets, accepted[:, None], axis=1)[:, 0]
    tok = tok.at[fb.sample_slot].set(bonus)
    fpos = fpos.at[fb.sample_slot].set(base + accepted + 1)
    return kv, (tok, fpos), out, accepted


def make_logits(model: CausalLM) -> Callable[..., tuple[Any, jax.Array]]:
    """A diagnostic step: kv in and out, f32 logits of each row's last token (no sampling)."""

    def logits(params, kv, fb: ForwardBatch):
        h, kv = model.forward(params, fb.input_ids, fb, kv)
        return kv, model.logits(params, h[fb.sample_idx])

    return logits
