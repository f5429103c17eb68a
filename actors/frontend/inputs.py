"""The generate call (`GenerateArgs`) and its validation (the frontend's front door).

Every surface builds one `GenerateArgs` and hands it to the frontend: `Engine.generate` and
the clients from their keyword arguments, the IPC socket as it decodes a `Generate` frame
(protocol.py), HTTP `/generate` from its body (http_server.py) and the OpenAI routes from
theirs (openai_api.py). The fields are SGLang's GenerateReqInput names (the Engine's `prompt`
is `text` here).

`normalize_generate` turns one (text or input_ids, one or many; sampling_params a dict or one
per prompt; n > 1 samples per prompt; a streaming session's turn behind its earlier turns) into
a flat list of `RequestSpec`s, each validated: a bad one raises ValueError naming the field,
the value and the limit, before anything is sent, so the engine keeps serving every other
request. Prompts are parsed here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import numbers
import reprlib
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from ringserve.actors.frontend.limits import check_depth
from ringserve.actors.frontend.sessions import Plan, Sessions
from ringserve.actors.transport.sampling import SamplingParams
from ringserve.kvmem.allocator import cdiv


class GenerateArgs(msgspec.Struct, omit_defaults=True):
    """One generate call as the caller gave it (SGLang's GenerateReqInput, the fields ringserve
    serves). Nothing is checked on construction: `normalize_generate` checks it once, so every
    surface gets the same errors. A list in `text` / `input_ids` is a batch; the per-prompt
    fields then take one value for all or a list with one per prompt."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # one prompt (ints) or many (lists of ints)
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    stream: bool = False
    session_params: dict[str, Any] | list[dict[str, Any]] | None = None
    logprob_start_len: int | list[int] | None = -1  # prompt logprobs from this position (-1: the last token)
    token_ids_logprob: list[Any] | None = None  # token ids (or one list per prompt) whose logprobs to report
    lora_path: str | list[str | None] | None = None  # a loaded LoRA adapter's name (or one per prompt); None: base
    data_parallel_rank: int | list[int | None] | None = None  # the group to run in (dp_size > 1; None: dispatched)
    return_hidden_states: bool | list[bool] = False  # the last layer's states (needs enable_return_hidden_states)
    # SGLang's routing replay (needs enable_return_routed_experts): meta_info["routed_experts"],
    # the expert ids of positions [routed_experts_start_len, prompt + output - 1) (actors/transport/routed.py)
    return_routed_experts: bool | list[bool] = False
    routed_experts_start_len: int | list[int] = 0
    cache_salt: str | list[str | None] | None = None  # vLLM's: the prefix cache is shared only among equal salts


MAX_CACHE_SALT = 256  # characters of a cache_salt


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What a generate call is checked against: the model's vocabulary and the server's limits."""

    vocab_size: int
    context_length: int
    max_top_logprobs_num: int
    bytes_per_token: int | None = None  # most text bytes one token stands for, if certain (limits.py)
    max_token_ids_logprob: int = 16
    dp_size: int = 1  # data-parallel groups (a data_parallel_rank is checked against it)
    hidden_states: bool = False  # requests may ask for return_hidden_states (enable_return_hidden_states)
    routed_experts: bool = False  # requests may ask for return_routed_experts (enable_return_routed_experts)

    def check_text(self, where: str, text: str) -> None:
        """ValueError if `text` certainly cannot fit the context, before it is tokenized: it is
        at least ceil(bytes / bytes_per_token) tokens."""
        if self.bytes_per_token is None or len(text) < self.context_length:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        least = cdiv(size, self.bytes_per_token)
        if least >= self.context_length:
            raise ValueError(
                f"{where}: a text of {size:,} bytes is at least {least:,} tokens, which does not fit the context "
                f"length {self.context_length} (the tokenizer's tokens are at most {self.bytes_per_token} bytes)"
            )


@dataclasses.dataclass(slots=True)
class RequestSpec:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams  # sampling_seed set: the request's, or one drawn for it
    return_logprob: bool
    top_logprobs_num: int
    index: int  # position in the caller's batch (prompt index * n + sample index)
    stream: bool = False  # the caller streams: outputs every stream_interval tokens
    session: Plan | None = None  # a streaming session's turn
    logprob_start_len: int = -1  # >= 0: prompt logprobs from that position (only with return_logprob)
    token_ids_logprob: list[int] | None = None  # report these tokens' logprobs at every position
    lora_path: str | None = None  # the LoRA adapter's name (None: the base model)
    data_parallel_rank: int | None = None  # the caller's group for it (None: the dispatcher picks)
    sample_of: str | None = None  # one of n > 1 samples of this request id (they share one group)
    return_hidden_states: bool = False  # the last layer's states at its positions are read back
    return_routed_experts: bool = False  # its positions' routed experts are read back
    routed_experts_start_len: int = 0  # from this position
    cache_salt: str | None = None  # its prefix cache namespace's salt (None: the common one)

    @property
    def seed(self) -> int:
        assert self.sampling.sampling_seed is not None
        return self.sampling.sampling_seed


def _routed_experts(args: GenerateArgs, n: int, limits: Limits, session: bool) -> tuple[list[bool], list[int]]:
    """return_routed_experts and routed_experts_start_len, one per prompt, checked."""
    routed = _per_prompt(args.return_routed_experts, n)
    if len(routed) != n or not all(isinstance(r, bool) for r in routed):
        raise ValueError(f"return_routed_experts: a boolean, or one per prompt ({n})")
    starts = _per_prompt(args.routed_experts_start_len, n)
    if len(starts) != n or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in starts):
        raise ValueError(f"routed_experts_start_len: a position >= 0, or one per prompt ({n})")
    if any(routed) and not limits.routed_experts:
        raise ValueError("return_routed_experts: this server returns none (start it with enable_return_routed_experts)")
    if any(routed) and session:
        raise ValueError("return_routed_experts: not with session_params (a turn's earlier turns' KV is reused)")
    return routed, starts


def _per_prompt(value: Any, n: int) -> list:
    """One value per prompt: a list as given, anything else repeated."""
    return value if isinstance(value, list) else [value] * n


def _prompts(args: GenerateArgs, encode: Callable[[str], list[int]], limits: Limits) -> tuple[list[Any], bool]:
    """(each prompt's token ids as given, batched): batched=False for a single prompt. A text
    that cannot fit is refused before any text is tokenized."""
    text, input_ids = args.text, args.input_ids
    if (text is None) == (input_ids is None):
        raise ValueError("generate: give exactly one of 'prompt' or 'input_ids'")
    if text is not None:
        batched = isinstance(text, list)
        texts = text if isinstance(text, list) else [text]
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"prompt[{i}]: expected a string, got {type(t).__name__}")
            limits.check_text(f"prompt[{i}]" if batched else "prompt", t)
        return [encode(t) for t in texts], batched
    assert input_ids is not None
    batched = bool(input_ids) and isinstance(input_ids[0], list)
    return (input_ids if batched else [input_ids]), batched


def _token_ids(where: str, ids: list[Any], limits: Limits) -> list[int]:
    if not ids:
        raise ValueError(f"{where}: the prompt is empty (it needs at least one token)")
    if len(ids) >= limits.context_length:  # before looking at each id: a long prompt is refused at once
        raise ValueError(
            f"{where}: prompt of {len(ids)} tokens does not fit the context length {limits.context_length} (it needs room for one output token)"
        )
    out: list[int] = []
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{where}: token id {_short(t)} at position {j} is not an integer")
        if not 0 <= int(t) < limits.vocab_size:
            raise ValueError(
                f"{where}: token id {t!r} at position {j} is outside the vocabulary [0, {limits.vocab_size})"
            )
        out.append(int(t))
    return out


def _logprob_start(s: Any, n: int, return_logprob: bool) -> int:
    """The checked logprob_start_len of a prompt of n tokens: as SGLang, read only with
    return_logprob (else -1), and -1 (or None) means the last prompt token (n - 1: its entry
    has no logprob, so nothing is computed)."""
    if s is None:
        s = -1
    if isinstance(s, bool) or not isinstance(s, int):
        raise ValueError(f"logprob_start_len={_short(s)} must be an integer (-1: output logprobs only)")
    if not return_logprob:
        return -1
    if not -1 <= s < n:
        raise ValueError(f"logprob_start_len={s} must be -1 or in [0, {n}) (the prompt has {n} tokens)")
    return n - 1 if s == -1 else s


def _token_ids_logprob(value: Any, n_prompts: int, return_logprob: list, limits: Limits) -> list[list[int] | None]:
    """token_ids_logprob per prompt: one list of ids for every prompt, or a list per prompt."""
    if value is None:
        return [None] * n_prompts
    if not isinstance(value, list):
        raise ValueError(f"token_ids_logprob={_short(value)}: a list of token ids (or one list per prompt)")
    per = value if value and isinstance(value[0], list) else [value] * n_prompts
    if len(per) != n_prompts:
        raise ValueError(f"token_ids_logprob: {len(per)} lists given for {n_prompts} prompts")
    out: list[list[int] | None] = []
    for i, ids in enumerate(per):
        if ids is None or ids == []:
            out.append(None)
            continue
        if not return_logprob[i]:
            raise ValueError("token_ids_logprob needs return_logprob=True")
        if not isinstance(ids, list) or len(ids) > limits.max_token_ids_logprob:
            raise ValueError(f"token_ids_logprob: at most {limits.max_token_ids_logprob} token ids per prompt "
                             "(server max_token_ids_logprob)")  # fmt: skip
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= int(t) < limits.vocab_size:
                raise ValueError(f"token_ids_logprob: token id {_short(t)} is outside the vocabulary [0, {limits.vocab_size})")
        out.append([int(t) for t in ids])
    return out


def _short(value: Any) -> str:
    """repr, bounded in depth and length (a caller's value may nest arbitrarily deep)."""
    return reprlib.repr(value)


def _dp_ranks(given: Any, n_prompts: int, dp_size: int) -> list[int | None]:
    """One data_parallel_rank (or None) per prompt, each in [0, dp_size)."""
    ranks = _per_prompt(given, n_prompts)
    if len(ranks) != n_prompts:
        raise ValueError(f"data_parallel_rank: {len(ranks)} given for {n_prompts} prompts")
    for r in ranks:
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < dp_size):
            raise ValueError(f"data_parallel_rank={_short(r)}: must be an integer in [0, {dp_size}) "
                             f"(the server's dp_size is {dp_size}) or null")  # fmt: skip
    return ranks


def normalize_generate(
    args: GenerateArgs,
    limits: Limits,
    *,
    encode: Callable[[str], list[int]],
    next_seed: Callable[[], int],
    sessions: Sessions | None = None,
    bos_token_id: int | None = None,
    check_lora: Callable[[Any, str], str | None] | None = None,
    sampling_defaults: dict[str, Any] | None = None,
) -> tuple[list[RequestSpec], bool]:
    """Returns (specs, batched): batched=False when a single prompt was given (one result).
    With `session_params`, each prompt's tokens are put behind its session's earlier turns
    (`sessions.plan`, nothing changed yet) and its spec carries that plan. `check_lora(name,
    where)`: a prompt's lora_path checked (actors/frontend/lora.py); None: no adapters served.
    `sampling_defaults`: the model's, for the sampling parameters a prompt leaves out."""
    check_depth(args.sampling_params, "sampling_params")
    check_depth(args.session_params, "session_params")
    raw, batched = _prompts(args, encode, limits)
    n_prompts = len(raw)
    if n_prompts == 0:
        raise ValueError("generate: empty batch (no prompts)")
    session_params = None
    if args.session_params is not None:
        if sessions is None:
            raise ValueError("session_params: this frontend serves no sessions")
        session_params = _per_prompt(args.session_params, n_prompts)
        if len(session_params) != n_prompts:
            raise ValueError(f"session_params: {len(session_params)} given for {n_prompts} prompts")
    sp_list = _per_prompt(args.sampling_params, n_prompts)
    if len(sp_list) != n_prompts:
        raise ValueError(f"sampling_params: {len(sp_list)} given for {n_prompts} prompts")
    rids = args.rid if isinstance(args.rid, list) else ([args.rid] if args.rid is not None else [None] * n_prompts)
    if len(rids) != n_prompts:
        raise ValueError(f"rid: {len(rids)} given for {n_prompts} prompts")
    for i, r in enumerate(rids):
        if r is not None and not (isinstance(r, str) and r):
            raise ValueError(f"rid[{i}]={_short(r)}: a request id must be a non-empty string")
    lp = _per_prompt(args.return_logprob, n_prompts)
    tl = _per_prompt(args.top_logprobs_num, n_prompts)
    if len(lp) != n_prompts or len(tl) != n_prompts:
        raise ValueError(
            f"return_logprob / top_logprobs_num: {len(lp)} / {len(tl)} given for {n_prompts} prompts"
        )
    starts = _per_prompt(args.logprob_start_len, n_prompts)
    if len(starts) != n_prompts:
        raise ValueError(f"logprob_start_len: {len(starts)} given for {n_prompts} prompts")
    ids_lp = _token_ids_logprob(args.token_ids_logprob, n_prompts, lp, limits)
    loras = _per_prompt(args.lora_path, n_prompts)
    if len(loras) != n_prompts:
        raise ValueError(f"lora_path: {len(loras)} given for {n_prompts} prompts")
    for i, name in enumerate(loras):
        where = f"lora_path[{i}]" if isinstance(args.lora_path, list) else "lora_path"
        if check_lora is not None:
            loras[i] = check_lora(name, where)
        elif name is not None:
            raise ValueError(f"{where}={_short(name)}: this server serves no LoRA adapters (start it with enable_lora)")
    dp_ranks = _dp_ranks(args.data_parallel_rank, n_prompts, limits.dp_size)
    hidden = _per_prompt(args.return_hidden_states, n_prompts)
    if len(hidden) != n_prompts or not all(isinstance(h, bool) for h in hidden):
        raise ValueError(f"return_hidden_states: a boolean, or one per prompt ({n_prompts})")
    if any(hidden) and not limits.hidden_states:
        raise ValueError("return_hidden_states: this server returns none (start it with enable_return_hidden_states)")
    if any(hidden) and session_params is not None:
        raise ValueError("return_hidden_states: not with session_params (a turn's earlier turns' KV is reused)")
    routed, routed_starts = _routed_experts(args, n_prompts, limits, session_params is not None)
    salts = _per_prompt(args.cache_salt, n_prompts)
    if len(salts) != n_prompts:
        raise ValueError(f"cache_salt: {len(salts)} given for {n_prompts} prompts")
    for s in salts:
        if s is not None and not (isinstance(s, str) and 0 < len(s) <= MAX_CACHE_SALT):
            raise ValueError(f"cache_salt={_short(s)}: a non-empty string of at most {MAX_CACHE_SALT} characters")
    specs: list[RequestSpec] = []
    for i, given in enumerate(raw):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(given, list | tuple):
            raise ValueError(f"{where}: the prompt is empty (it needs at least one token)")
        plan = None
        if session_params is not None:  # a session turn's input holds its earlier turns
            assert sessions is not None
            plan = sessions.plan(session_params[i], list(given), bos_token_id)
            given = plan.input_ids
        ids = _token_ids(where, given, limits)
        sp = SamplingParams.from_dict(sp_list[i], vocab_size=limits.vocab_size, defaults=sampling_defaults,
                                      max_new_tokens_limit=limits.context_length - len(ids))  # fmt: skip
        if not isinstance(tl[i], int) or not 0 <= tl[i] <= limits.max_top_logprobs_num:
            raise ValueError(
                f"top_logprobs_num={_short(tl[i])} must be in [0, {limits.max_top_logprobs_num}] (server max_top_logprobs_num)"
            )
        if plan is not None and sp.n > 1:
            raise ValueError("session_params: n > 1 samples cannot share one session turn")
        start = _logprob_start(starts[i], len(ids), bool(lp[i]))
        if not routed_starts[i] <= len(ids):
            where = "routed_experts_start_len" + (f"[{i}]" if isinstance(args.routed_experts_start_len, list) else "")
            raise ValueError(f"{where}={routed_starts[i]}: past the prompt's {len(ids)} tokens")
        if plan is not None and 0 <= start < len(ids) - 1:
            raise ValueError("logprob_start_len: prompt logprobs of a session turn are not supported "
                             "(its earlier turns' KV is reused)")  # fmt: skip
        base_rid = rids[i] or uuid.uuid4().hex
        # no seed given: a fresh one per prompt, so equal prompts sample differently (GRPO groups)
        base_seed = sp.sampling_seed if sp.sampling_seed is not None else next_seed()
        for k in range(sp.n):
            specs.append(RequestSpec(
                rid=base_rid if sp.n == 1 else f"{base_rid}-{k}",
                input_ids=list(ids), sampling=sp.with_seed((base_seed + k) % (2**63)),
                return_logprob=bool(lp[i]), top_logprobs_num=int(tl[i]), index=len(specs),
                stream=args.stream, session=plan, logprob_start_len=start, token_ids_logprob=ids_lp[i],
                lora_path=loras[i],
                data_parallel_rank=dp_ranks[i], sample_of=base_rid if sp.n > 1 else None,
                return_hidden_states=hidden[i], return_routed_experts=routed[i],
                routed_experts_start_len=routed_starts[i], cache_salt=salts[i],
            ))  # fmt: skip
    if len({s.rid for s in specs}) != len(specs):
        raise ValueError("rid: duplicate request ids in one call")
    return specs, batched or len(specs) > 1
