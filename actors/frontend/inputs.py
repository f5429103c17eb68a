"""Normalising and validating `generate` inputs (the frontend's front door).

`normalize_generate` turns SGLang-style arguments (prompt or input_ids, one or many;
sampling_params a dict or one per prompt; n > 1 samples per prompt) into a flat list of
`RequestSpec`s, each validated: a bad one raises ValueError naming the field, the value and
the limit, before anything is sent, so the engine keeps serving every other request.
"""

from __future__ import annotations

import dataclasses
import numbers
import uuid
from collections.abc import Callable
from typing import Any

from actors.transport.sampling import SamplingParams


@dataclasses.dataclass(slots=True)
class RequestSpec:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams  # sampling_seed set: the request's, or one drawn for it
    return_logprob: bool
    top_logprobs_num: int
    index: int  # position in the caller's batch (prompt index * n + sample index)
    stream: bool = False  # the caller streams: outputs every stream_interval tokens
    session: Any = None  # a streaming session's turn (actors.frontend.sessions.Plan)

    @property
    def seed(self) -> int:
        assert self.sampling.sampling_seed is not None
        return self.sampling.sampling_seed


def _as_list(x: Any) -> tuple[list, bool]:
    return (x, True) if isinstance(x, list) else ([x], False)


def normalize_generate(
    *,
    prompt: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict | list[dict] | None,
    rid: str | list[str] | None,
    return_logprob: bool | list[bool],
    top_logprobs_num: int | list[int],
    encode: Callable[[str], list[int]],
    vocab_size: int,
    context_length: int,
    max_top_logprobs_num: int,
    next_seed: Callable[[], int],
) -> tuple[list[RequestSpec], bool]:
    """Returns (specs, batched): batched=False when a single prompt was given (one result)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("generate: give exactly one of 'prompt' or 'input_ids'")
    if prompt is not None:
        texts, batched = _as_list(prompt)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"prompt[{i}]: expected a string, got {type(t).__name__}")
        ids_list = [encode(t) for t in texts]
    else:
        assert input_ids is not None
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        ids_list = input_ids if batched else [input_ids]  # type: ignore[list-item, assignment]
    n_prompts = len(ids_list)
    if n_prompts == 0:
        raise ValueError("generate: empty batch (no prompts)")
    sp_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n_prompts
    if len(sp_list) != n_prompts:
        raise ValueError(f"sampling_params: {len(sp_list)} given for {n_prompts} prompts")
    rids = rid if isinstance(rid, list) else ([rid] if rid is not None else [None] * n_prompts)
    if len(rids) != n_prompts:
        raise ValueError(f"rid: {len(rids)} given for {n_prompts} prompts")
    for i, r in enumerate(rids):
        if r is not None and not (isinstance(r, str) and r):
            raise ValueError(f"rid[{i}]={r!r}: a request id must be a non-empty string")
    lp = return_logprob if isinstance(return_logprob, list) else [return_logprob] * n_prompts
    tl = top_logprobs_num if isinstance(top_logprobs_num, list) else [top_logprobs_num] * n_prompts
    if len(lp) != n_prompts or len(tl) != n_prompts:
        raise ValueError(
            f"return_logprob / top_logprobs_num: {len(lp)} / {len(tl)} given for {n_prompts} prompts"
        )
    specs: list[RequestSpec] = []
    for i, ids in enumerate(ids_list):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(ids, list | tuple) or not ids:
            raise ValueError(f"{where}: the prompt is empty (it needs at least one token)")
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(f"{where}: token id {t!r} at position {j} is not an integer")
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"{where}: token id {t!r} at position {j} is outside the vocabulary [0, {vocab_size})"
                )
        ids = [int(t) for t in ids]
        if len(ids) >= context_length:
            raise ValueError(
                f"{where}: prompt of {len(ids)} tokens does not fit the context length {context_length} (it needs room for one output token)"
            )
        sp = SamplingParams.from_dict(
            sp_list[i], vocab_size=vocab_size, max_new_tokens_limit=context_length - len(ids)
        )
        if not isinstance(tl[i], int) or not 0 <= tl[i] <= max_top_logprobs_num:
            raise ValueError(
                f"top_logprobs_num={tl[i]!r} must be in [0, {max_top_logprobs_num}] (server max_top_logprobs_num)"
            )
        base_rid = rids[i] or uuid.uuid4().hex
        # no seed given: a fresh one per prompt, so equal prompts sample differently (GRPO groups)
        base_seed = sp.sampling_seed if sp.sampling_seed is not None else next_seed()
        for k in range(sp.n):
            specs.append(RequestSpec(
                rid=base_rid if sp.n == 1 else f"{base_rid}-{k}",
                input_ids=list(ids), sampling=sp.with_seed((base_seed + k) % (2**63)),
                return_logprob=bool(lp[i]), top_logprobs_num=int(tl[i]), index=len(specs),
            ))  # fmt: skip
    if len({s.rid for s in specs}) != len(specs):
        raise ValueError("rid: duplicate request ids in one call")
    return specs, batched or len(specs) > 1
