"""Decode-step preparation: one more token of KV per running request, retracting under pressure.

When the pool cannot give every running request its next token, requests are retracted (their
KV freed, back to WAITING) in SGLang's order: fewest output tokens first, then longest prompt,
until the rest fit. `new_token_ratio` (the share of each request's remaining max_new_tokens the
prefill side keeps in reserve) jumps up after a retract and decays by a fixed step per decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ringserve.actors.scheduler.req import Req
from ringserve.actors.server_args import ServerArgs
from ringserve.kvmem import KVCache

CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's decode reservation (as SGLang)


def decode_reserve(req: Req, ratio: float) -> float:
    """KV tokens kept in reserve for `req`'s remaining decode: its remaining max_new_tokens,
    clipped, times the current new_token_ratio. The one estimate prefill admission uses."""
    left = max(0, req.max_new_tokens - len(req.output_ids))
    return min(left, CLIP_MAX_NEW_TOKENS) * ratio


def length_reached_in_flight(req: Req) -> bool:
    """Whether the steps in flight bring `req` to its max_new_tokens: each committed position past
    its prompt is the input of a sampling row (the last prompt token's too), so it will hold
    committed_len - origin_len + 1 tokens once they land. Overlap plans the next step before
    the last one's tokens are in; a decode row for such a request would compute a token that is
    dropped, and a request arriving after it would wait for that step (a 1-token request
    in a cold start: a padded 64-row decode step, ~0.27 s for SmolLM2 f32). A session's turn
    still gets that row: it writes the last token's KV, which the session keeps for its next
    turn (tests/engine/test_sessions.py counts every earlier token as cached)."""
    return req.committed_len - req.origin_len + 1 >= req.max_new_tokens


def decode_steps(args: ServerArgs, reqs: list[Req], others_waiting: bool) -> int:
    """How many decode steps a decode batch of `reqs` runs on the device: decode_steps where
    multi-step decode applies (nothing waits to prefill, at most decode_steps_max_batch
    rows, none constrained by a grammar or a session's turn, each with that many tokens to
    go past the steps in flight and room in its context), else 1."""
    k = args.decode_steps
    if k == 1 or others_waiting or not 0 < len(reqs) <= args.decode_steps_max_batch:
        return 1
    for r in reqs:
        to_go = r.max_new_tokens - (r.committed_len - r.origin_len + 1)  # (length_reached_in_flight)
        if r.grammar is not None or r.session_id is not None or to_go < k or r.committed_len + k > args.context_length:
            return 1
    return k


@dataclasses.dataclass(slots=True)
class NewTokenRatio:
    init: float
    min: float
    decay: float  # per decode step
    value: float = -1.0

    def __post_init__(self) -> None:
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.min, self.value - self.decay)

    def reset(self) -> None:
        self.value = self.init

    def after_retract(self, running: list[Req]) -> None:
        """Reserve what the survivors are likely to still need (SGLang's estimate)."""
        decoded = sum(len(r.output_ids) for r in running)
        total = sum(r.max_new_tokens for r in running) or 1
        self.value = min(1.0, (decoded + 0.1 * total) / total + self.min)


def retract_order(running: list[Req]) -> list[Req]:
    """Victims first: fewest outputs, then longest prompt, then latest arrival."""
    return sorted(running, key=lambda r: (len(r.output_ids), -r.origin_len, -r.arrival))


def prepare_decode(cache: KVCache, running: list[Req], retract: Callable[[Req], None],
                   spare: Callable[[], bool] | None = None, defer_last: bool = False,
                   reclaim: Callable[[], bool] | None = None, need: int = 1) -> dict[int, np.ndarray]:  # fmt: skip
    """Reserve `need` more tokens (1, or a verify round's k + 1) for every running request;
    returns {id(req): pages appended to its table} for the requests that decode this step.

    `cache.reserve` is idempotent, so survivors that got a page before a retraction keep it
    (recorded once) and simply get nothing more on the retry. `retract(req)` frees a victim's
    KV and requeues it (the scheduler's one retract path). Before any request is retracted,
    `reclaim()` may give back memory nobody runs on (a session's kept slot): True, retry.

    When even a single request cannot get its next token, the memory is held by someone who
    is not decoding (the chunked prefill): `spare()` frees it and returns True (then retry);
    with `defer_last` the request just skips this step (a mixed batch, whose chunk is already
    planned). A single request always fits an otherwise empty pool (the engine checks
    max_total_tokens against context_length), so anything else is a bug."""
    victims = retract_order(running)
    keep = list(running)
    grants: dict[int, np.ndarray] = {}
    while True:
        short = None
        for r in keep:
            assert r.kv is not None, f"running request {r.rid} holds no KV"
            pages = cache.reserve(r.kv, need)
            if pages is None:
                short = r
                break
            if len(pages):
                grants[id(r)] = pages
        if short is None:
            return {id(r): grants.get(id(r), _EMPTY) for r in keep}
        if reclaim is not None and reclaim():
            continue
        if len(keep) == 1:
            if spare is not None and spare():
                continue
            if defer_last:
                return {}
            raise RuntimeError(
                f"KV pool too small to decode even one request ({short.rid}, {short.fill_len} tokens)"
            )
        victim = next(v for v in victims if v in keep)
        keep.remove(victim)
        grants.pop(id(victim), None)
        retract(victim)


_EMPTY = np.zeros(0, np.int32)
