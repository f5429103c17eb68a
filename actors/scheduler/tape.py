"""Per-position values a request reads back from its steps: its tokens' last hidden states
(return_hidden_states), their routed experts (return_routed_experts).

    positions   [ not kept ... | recorded .................... | not computed yet ]
                0            first                            end
                             chunks, in order, each [n, ...]

A step computes the positions [committed_len, committed_len + extend_len) of a row, which may
begin before `end`: a prefill again after a retraction (or a restart's resumption) repeats the
positions already recorded, and those keep the values the first forward used (the ones that
sampled the tokens after them). The prefix cache must not skip past `end`: `Req.prefix_ids`
caps what it grants there, so the positions from `first` on are computed in this request.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(slots=True)
class PositionTape:
    first: int = 0  # the first position kept
    end: int = -1  # positions [first, end) are recorded (-1: `first`, set at construction)
    chunks: list[np.ndarray] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.first

    def record(self, at: int, values: np.ndarray) -> None:
        """The values of positions [at, at + len(values)): those past `end` are kept."""
        skip = self.end - at
        assert skip >= 0, f"values from position {at}, but only up to {self.end} are recorded"
        if skip < len(values):
            self.chunks.append(values[skip:])
            self.end += len(values) - skip

    def values(self, stop: int) -> np.ndarray | None:
        """Positions [first, stop) stacked (None when nothing is recorded)."""
        if not self.chunks:
            return None
        return np.concatenate(self.chunks)[: max(0, stop - self.first)]
