"""User-facing sampling parameters (SGLang's names), validated at the front door.

`SamplingParams.from_dict` is the one place a request's options are checked: every error is a
`ValueError` that names the field, the value and the limit, and is raised before the request
reaches the scheduler, so a bad request never disturbs the others.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Aliases other frameworks send (verl sends max_tokens; OpenAI clients send seed).
DEFAULT_MAX_NEW_TOKENS = 128
ALIASES = {"max_tokens": "max_new_tokens", "seed": "sampling_seed"}


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
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

    @classmethod
    def from_dict(
        cls,
        d: dict[str, Any] | None,
        *,
        vocab_size: int | None = None,
        max_new_tokens_limit: int | None = None,
    ) -> SamplingParams:
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
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"sampling_params: unknown parameter(s) {unknown}; known: {sorted(names | set(ALIASES))}"
            )
        if d.get("max_new_tokens") is None:  # the default is capped to fit; an explicit value must fit
            d.pop("max_new_tokens", None)
            if max_new_tokens_limit is not None:
                d["max_new_tokens"] = min(DEFAULT_MAX_NEW_TOKENS, max_new_tokens_limit)
        if isinstance(d.get("stop"), str):
            d["stop"] = (d["stop"],)
        for k in ("stop", "stop_token_ids"):
            if d.get(k) is None:
                d.pop(k, None)
            else:
                d[k] = tuple(d[k])
        p = cls(**d)
        p.validate(vocab_size=vocab_size, max_new_tokens_limit=max_new_tokens_limit)
        return p

    def validate(self, *, vocab_size: int | None = None, max_new_tokens_limit: int | None = None) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"sampling_params: {msg}")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

        need(
            is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
            f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0",
        )
        if max_new_tokens_limit is not None:
            need(
                self.max_new_tokens <= max_new_tokens_limit,
                f"max_new_tokens={self.max_new_tokens} exceeds the limit {max_new_tokens_limit} (context length minus prompt)",
            )
        need(
            is_num(self.temperature) and 0 <= self.temperature <= 1e4,
            f"temperature={self.temperature!r} must be in [0, 1e4] (0 = greedy)",
        )
        need(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p={self.top_p!r} must be in (0, 1]")
        need(
            is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k < 2**31),
            f"top_k={self.top_k!r} must be -1 (off) or in [1, 2**31)",
        )
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p={self.min_p!r} must be in [0, 1]")
        need(is_int(self.n) and 1 <= self.n <= 64, f"n={self.n!r} must be an integer in [1, 64]")
        need(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop={list(self.stop)!r} must be non-empty strings",
        )
        need(len(self.stop) <= 16, f"stop has {len(self.stop)} strings; the limit is 16")
        need(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids={list(self.stop_token_ids)!r} must be integers >= 0",
        )
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            need(not bad, f"stop_token_ids {bad} outside the vocabulary [0, {vocab_size})")
        need(
            self.sampling_seed is None or (is_int(self.sampling_seed) and 0 <= self.sampling_seed < 2**63),
            f"sampling_seed={self.sampling_seed!r} must be an integer in [0, 2**63)",
        )
        for k in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            need(isinstance(getattr(self, k), bool), f"{k}={getattr(self, k)!r} must be true or false")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
