"""`SamplingParams`: a request's options (SGLang's names), validated once at the front door;
`find_stop`: the stop-string search the scheduler (finish) and the detokenizer (trim) share.

It is the one sampling-parameter type of the code base: a frozen msgspec Struct that travels
as it is from the frontend (Engine, IPC socket, HTTP) through the scheduler's ring into the
scheduler's `Req`. The fields the device needs leave it as `model.step_inputs.DeviceSampling`
(`device()`), which the runner's slot mirror keeps.

`from_dict` is the one place a request's options are checked: every error is a `ValueError`
that names the field, the value and the limit, raised before the request reaches the
scheduler, so a bad request never disturbs the others. On the wire `sampling_seed` is always
set (the frontend draws one for requests that give none).

An output constraint (`json_schema`, `regex`, `ebnf`, `structural_tag`: at most one) travels as
its text; `from_dict` takes a JSON schema or structural tag as a dict too, and `validate`
compiles it once (actors/transport/constraint.py), so one that does not compile is refused here.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable
from typing import Any

import msgspec

from ringserve.actors.transport.constraint import KINDS as CONSTRAINTS
from ringserve.actors.transport.constraint import check as check_constraint
from ringserve.model.compute.step_inputs import BIAS_IDS, DeviceSampling

# Aliases other frameworks send (verl sends max_tokens; OpenAI clients send seed; vLLM's names:
# min_tokens, include_stop_str_in_output).
DEFAULT_MAX_NEW_TOKENS = 128
ALIASES = {"max_tokens": "max_new_tokens", "seed": "sampling_seed", "min_tokens": "min_new_tokens",
           "include_stop_str_in_output": "no_stop_trim"}  # fmt: skip
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 16
MAX_N = 64
MAX_LOGIT_BIAS = BIAS_IDS  # logit_bias entries a request may give (the programs' columns)
# custom_params (SGLang's: a custom logit processor's arguments) ringserve reads; any other key is
# accepted and ignored, as SGLang does without a processor
CUSTOM_PARAMS = ("return_top_p_token_ids",)


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    # penalties (SGLang's and vLLM's semantics: repetition over prompt + output, HF's rule;
    # frequency and presence over the output), each at its neutral value by default
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0  # EOS and stop_token_ids banned until this many tokens came
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's, [-100, 100])
    return_top_p_token_ids: bool = False  # custom_params': each token's kept set (slime's top-p replay)
    # the output constraint, at most one (actors/transport/constraint.py)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(
        cls,
        d: dict[str, Any] | None,
        *,
        vocab_size: int | None = None,
        max_new_tokens_limit: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """`defaults`: the model's sampling defaults (model/checkpoints/generation.py) for the
        parameters `d` leaves out (or gives as None); a default max_new_tokens is capped to fit."""
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params: expected a dict of parameters, got {type(d).__name__}")
        d = dict(d or {})
        for alias, name in ALIASES.items():
            if alias in d:
                if name in d and d[name] != d[alias]:
                    raise ValueError(
                        f"sampling_params: both {alias!r} and {name!r} given with different values"
                    )
                d[name] = d.pop(alias)
        default_max = DEFAULT_MAX_NEW_TOKENS
        for name, value in (defaults or {}).items():
            if name == "max_new_tokens":
                default_max = value
            elif d.get(name) is None:
                d[name] = value
        custom = d.pop("custom_params", None)
        if custom is not None:
            if not isinstance(custom, dict):
                raise ValueError(f"sampling_params: custom_params: expected an object, got {type(custom).__name__}")
            for key in CUSTOM_PARAMS:
                if custom.get(key) is not None:
                    d[key] = custom[key]
        names = set(cls.__struct_fields__)
        unknown = sorted(str(k) for k in set(d) - names)
        if unknown:
            raise ValueError(
                f"sampling_params: unknown parameter(s) {unknown}; known: {sorted(names | set(ALIASES) | {'custom_params'})}"
            )
        for k in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "logit_bias"):
            if k in d and d[k] is None:  # (None: left at its neutral value)
                del d[k]
        if isinstance(d.get("top_k"), float) and d["top_k"].is_integer():  # AReaL sends top_k=1e8: no limit
            d["top_k"] = int(d["top_k"])
        if isinstance(d.get("top_k"), int) and not isinstance(d["top_k"], bool) and vocab_size and d["top_k"] >= vocab_size:
            d["top_k"] = -1  # as large as the vocabulary: no limit
        if d.get("top_k") == 0:  # vLLM's "off"
            d["top_k"] = -1
        if isinstance(d.get("logit_bias"), dict):  # JSON's keys are strings: the token ids
            try:
                d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
            except (TypeError, ValueError):
                raise ValueError(f"sampling_params: logit_bias: keys must be token ids, got {list(d['logit_bias'])[:4]}") from None
        if d.get("max_new_tokens") is None:  # the default is capped to fit; an explicit value must fit
            d["max_new_tokens"] = default_max if max_new_tokens_limit is None else min(default_max, max_new_tokens_limit)
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        for k in ("stop", "stop_token_ids", "sampling_seed", *CONSTRAINTS):
            if k in d and d[k] is None:
                del d[k]
        for k in ("json_schema", "structural_tag"):  # given as an object (a schema also as a bool): its JSON
            if isinstance(d.get(k), dict) or (k == "json_schema" and isinstance(d.get(k), bool)):
                d[k] = json.dumps(d[k])
        try:
            p = msgspec.convert({k: _plain(v) for k, v in d.items()}, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling_params: {_field_error(e)}") from None
        p.validate(vocab_size=vocab_size, max_new_tokens_limit=max_new_tokens_limit)
        return p

    def validate(self, *, vocab_size: int | None = None, max_new_tokens_limit: int | None = None) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"sampling_params: {msg}")

        def finite(x: float) -> bool:
            return math.isfinite(x)

        need(self.max_new_tokens >= 0, f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0")
        if max_new_tokens_limit is not None:
            need(
                self.max_new_tokens <= max_new_tokens_limit,
                f"max_new_tokens={self.max_new_tokens} exceeds the limit {max_new_tokens_limit} (context length minus prompt)",
            )
        need(
            finite(self.temperature) and 0 <= self.temperature <= 1e4,
            f"temperature={self.temperature:g} must be in [0, 1e4] (0 = greedy)",
        )
        need(finite(self.top_p) and 0 < self.top_p <= 1, f"top_p={self.top_p:g} must be in (0, 1]")
        need(
            self.top_k == -1 or 1 <= self.top_k < 2**31,
            f"top_k={self.top_k!r} must be -1 (off) or in [1, 2**31)",
        )
        need(finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p={self.min_p:g} must be in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            need(finite(v) and -2 <= v <= 2, f"{name}={v:g} must be in [-2, 2] (0 = off)")
        need(finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
             f"repetition_penalty={self.repetition_penalty:g} must be in (0, 2] (1 = off)")  # fmt: skip
        need(0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens={self.min_new_tokens!r} must be in [0, max_new_tokens={self.max_new_tokens}]")  # fmt: skip
        if self.logit_bias:
            need(len(self.logit_bias) <= MAX_LOGIT_BIAS,
                 f"logit_bias has {len(self.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}")  # fmt: skip
            for tok, bias in self.logit_bias.items():
                need(tok >= 0 and (vocab_size is None or tok < vocab_size),
                     f"logit_bias token {tok} outside the vocabulary [0, {vocab_size})")  # fmt: skip
                need(finite(bias) and -100 <= bias <= 100, f"logit_bias[{tok}]={bias:g} must be in [-100, 100]")
        if self.return_top_p_token_ids:
            need(self.temperature == 0 or self.top_p < 1 or self.top_k > 0 or self.min_p > 0,
                 "custom_params.return_top_p_token_ids needs top_p < 1, a top_k or a min_p (else the set each token is "
                 "drawn from is the whole vocabulary)")  # fmt: skip
        need(1 <= self.n <= MAX_N, f"n={self.n!r} must be an integer in [1, {MAX_N}]")
        need(all(s for s in self.stop), f"stop={list(self.stop)!r} must be non-empty strings")
        need(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"stop has {len(self.stop)} strings; the limit is {MAX_STOP_STRINGS}",
        )
        need(
            all(t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids={list(self.stop_token_ids)!r} must be integers >= 0",
        )
        need(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"stop_token_ids has {len(self.stop_token_ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}")  # fmt: skip
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            need(not bad, f"stop_token_ids {bad} outside the vocabulary [0, {vocab_size})")
        need(
            self.sampling_seed is None or 0 <= self.sampling_seed < 2**63,
            f"sampling_seed={self.sampling_seed!r} must be an integer in [0, 2**63)",
        )
        given = [k for k in CONSTRAINTS if getattr(self, k) is not None]
        need(len(given) <= 1, f"give at most one of {list(CONSTRAINTS)} (got {given})")
        if given:
            need(bool(getattr(self, given[0])), f"{given[0]} must be a non-empty string")
            try:
                check_constraint(given[0], getattr(self, given[0]))
            except ValueError as e:
                need(False, str(e))

    def with_seed(self, seed: int) -> SamplingParams:
        return msgspec.structs.replace(self, sampling_seed=seed)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, or None (also the compiled grammar's cache key)."""
        for k in CONSTRAINTS:
            text = getattr(self, k)
            if text is not None:
                return k, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (the device then reads the request's token counts)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def held_back(self, eos_ids: Iterable[int]) -> tuple[int, ...]:
        """The stop ids min_new_tokens holds back: the EOS ids (unless ignored) and stop_token_ids."""
        return tuple(sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))))

    def device(self, logprobs: bool = True, top_logprobs: bool = True, origin_len: int = 0,
               eos_ids: Iterable[int] = (), hidden: bool = False, routed: bool = False) -> DeviceSampling:  # fmt: skip
        """The fields the device samples with (the seed must be set), and whether the request
        reads its samples' logprobs and top-n logprobs (the device skips them when no row does),
        its hidden states, its routed experts; `origin_len` (its prompt's) and `eos_ids` place min_new_tokens."""
        assert self.sampling_seed is not None, "the frontend sets every request's seed"
        ban = self.held_back(eos_ids) if self.min_new_tokens else ()
        bias = sorted(self.logit_bias.items()) if self.logit_bias else []
        return DeviceSampling(
            self.temperature, self.top_k, self.top_p, self.min_p, self.sampling_seed, logprobs, top_logprobs,
            self.repetition_penalty, self.frequency_penalty, self.presence_penalty,
            origin_len + self.min_new_tokens if ban else 0, ban, tuple(t for t, _ in bias),
            tuple(float(b) for _, b in bias), self.return_top_p_token_ids, hidden, routed,
        )  # fmt: skip


def _check_neutral(name: str, value: Any, neutral: float, where: str = "") -> None:
    """A parameter ringserve does not implement: None or its neutral value passes, anything
    else is a ValueError naming it (`where`: the prefix that says where it came from)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where}{name}: expected a number, got {type(value).__name__}")
    refuse_unless_default(name, value, neutral, where)


def refuse_unless_default(name: str, value: Any, default: Any, where: str = "") -> None:
    """An option ringserve does not implement: a ValueError naming it unless it is at `default`."""
    if value != default:
        raise ValueError(f"{where}{name}={value!r} is not supported by ringserve (leave it at {default!r})")


def _plain(v: Any) -> Any:
    """NumPy scalars (and other Integral / Real numbers) as Python numbers; lists kept."""
    if isinstance(v, bool | str | int | float) or v is None:
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def _field_error(e: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.top_k`" as "top_k: expected int, got str"."""
    text = str(e)
    msg, _, where = text.partition(" - at `$")
    field = where.rstrip("`").lstrip(".") if where else ""
    msg = msg.replace("`", "")
    msg = msg[:1].lower() + msg[1:]
    return f"{field}: {msg}" if field else msg


def find_stop(text: str, stops: tuple[str, ...], search_from: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string starting at or after `search_from` - max_len + 1
    (so a stop string straddling the previous boundary is found): (index, stop) or None."""
    if not stops:
        return None
    start = max(0, search_from - max(len(s) for s in stops) + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
