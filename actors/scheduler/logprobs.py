"""A request's prompt logprobs (`logprob_start_len >= 0`): which positions its extend rows
compute, what came back, and how much of its prompt the prefix cache may grant.

SGLang's shape, kept: `input_token_logprobs[i]` is the logprob of prompt token `start + i`
given the tokens before it, for i in [0, origin_len - start), entry 0 None. Position p's
hidden state predicts token p + 1, so the positions to compute are

    prompt:     t0 t1 t2 t3 t4 t5 t6 t7          origin_len 8, start 2
    positions:        p2 p3 p4 p5 p6             [start, origin_len - 1): 5 logprobs
    reported:   (None, t2) (lp t3) ... (lp t7)   p7 predicts the first output (its logprob is
                                                 the output's, from the sampler)

They are computed in the extend steps that run anyway (model/compute/step_inputs.py): each extend row
carries the part of [start, origin_len - 1) it covers (`span`), chunked or not. A cached prefix
has no hidden states, so the choice here is to bypass the cache for the positions still
wanted: `cap` bounds what the prefix cache may grant (the first position not yet recorded), and
a request whose logprobs are all in uses the cache as any other. After a retraction the
positions already recorded are not computed again (a row's span starts past them).
"""

from __future__ import annotations

import numpy as np


class PromptLogprobs:
    __slots__ = ("start", "end", "logprobs", "top", "ids", "sent")

    def __init__(self, start: int, origin_len: int):
        assert 0 <= start < origin_len, f"logprob_start_len {start} outside a prompt of {origin_len}"
        self.start = start
        self.end = origin_len - 1  # positions [start, end) are wanted
        self.logprobs: list[float] = []  # of positions start, start + 1, ... (recorded in order)
        self.top: list[list[tuple[float, int]]] = []  # top_logprobs_num (logprob, id) per position
        self.ids: list[list[float]] = []  # token_ids_logprob logprobs per position
        self.sent = False  # handed to the detokenizer (once)

    @property
    def recorded_to(self) -> int:
        """The first position whose logprob has not come back yet."""
        return self.start + len(self.logprobs)

    @property
    def complete(self) -> bool:
        return self.recorded_to >= self.end

    def cap(self) -> int | None:
        """How many leading tokens the prefix cache may grant (None: any)."""
        return None if self.complete else self.recorded_to

    def span(self, committed_len: int, extend_len: int) -> tuple[int, int] | None:
        """(first position, count) of the wanted positions an extend row over tokens
        [committed_len, committed_len + extend_len) computes; None if it covers none."""
        lo = max(committed_len, self.recorded_to)
        hi = min(committed_len + extend_len, self.end)
        return (lo, hi - lo) if hi > lo else None

    def record(self, first: int, logprobs: np.ndarray, top: list[list[tuple[float, int]]] | None,
               ids: np.ndarray | None) -> None:  # fmt: skip
        """One row's results for positions [first, first + len(logprobs)); the part already
        recorded (a row planned before its earlier row's results came back, retracted since) is
        skipped."""
        assert first <= self.recorded_to, f"prompt logprobs of position {first} before {self.recorded_to}"
        skip = self.recorded_to - first
        self.logprobs += logprobs[skip:].tolist()
        if top is not None:
            self.top += top[skip:]
        if ids is not None:
            self.ids += ids[skip:].tolist()
