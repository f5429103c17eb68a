"""`SchedulerStats`: the scheduler's counters and timings, one record that get_server_info reads
(actors/scheduler/report.py; SGLang's names where SGLang has them). The core counts steps,
tokens, retractions and speculation; the actor adds the time it spends scheduling, waiting and
processing."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class SchedulerStats:
    k: int  # speculative drafts per round (the histogram's last index)
    forward_ct_decode: int = 0  # decode steps (since the last flush_cache, as SGLang)
    forward_ct_prefill: int = 0  # prefill (extend) steps
    tokens_computed: int = 0  # tokens the steps computed (extend spans, decode and verify tokens)
    num_retracted: int = 0  # retractions (memory pressure or pause_generation("retract"))
    spec_accept_histogram: list[int] = dataclasses.field(default_factory=list)  # verify rounds by drafts accepted (0..k)
    spec_dropped_tokens: int = 0  # accepted tokens dropped past a finish inside their run
    weight_updates: int = 0  # weight updates applied (the default weight_version counts them)
    integrity_errors: list[str] = dataclasses.field(default_factory=list)  # KV books violations found at idle
    schedule_s: float = 0.0  # host time planning batches
    process_s: float = 0.0  # host time booking results
    wait_runner_s: float = 0.0  # time blocked on the runner's results
    runner_forward_s: float = 0.0  # device time as the runner saw it
    grammar_steps: int = 0  # steps with constrained rows (their masks filled on the host)
    grammar_mask_s: float = 0.0  # host time filling those masks

    def __post_init__(self) -> None:
        self.spec_accept_histogram = [0] * (self.k + 1)

    @property
    def steps(self) -> int:
        return self.forward_ct_decode + self.forward_ct_prefill

    def as_dict(self) -> dict:
        hist = self.spec_accept_histogram
        steps = self.steps
        return {
            "forward_ct_decode": self.forward_ct_decode,
            "forward_ct_prefill": self.forward_ct_prefill,
            "tokens_computed": self.tokens_computed,
            "num_retracted": self.num_retracted,
            "spec_accept_histogram": list(hist),
            "avg_spec_accept_length": round(sum((a + 1) * n for a, n in enumerate(hist)) / max(1, sum(hist)), 4),
            "spec_dropped_tokens": self.spec_dropped_tokens,
            "weight_updates": self.weight_updates,
            "integrity_errors": list(self.integrity_errors),
            "host_s_per_step": (self.schedule_s + self.process_s) / steps if steps else 0.0,
            "forward_s_per_step": self.runner_forward_s / steps if steps else 0.0,
            "grammar_steps": self.grammar_steps,
            "grammar_mask_s_per_step": self.grammar_mask_s / self.grammar_steps if self.grammar_steps else 0.0,
        }
