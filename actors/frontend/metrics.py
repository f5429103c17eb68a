"""Prometheus metrics of one engine (served at HTTP `/metrics`), SGLang's set under `ringserve:`.

The frontend records request counters and latency histograms as outputs arrive, the supervisor
each restart of the actors; the load gauges (running, waiting, KV usage) are read from every
group's scheduler when `/metrics` is scraped, labelled `dp_rank`; the HTTP server counts the load
reports it serves by route (`load_reports_total`: how often a router polls `/get_load`). Each engine
has its own registry, so several engines in one process never mix their series.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
               0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)  # fmt: skip
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)


class FrontendMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "ringserve:"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of submitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Output tokens returned", registry=r)
        self.cached_tokens = Counter(p + "cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.requests = Counter(p + "num_requests", "Requests submitted", registry=r)
        self.aborted = Counter(p + "num_aborted_requests", "Requests that finished with abort", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Inter-token latency (streamed requests)",
                             buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        g = ["dp_rank"]  # the load gauges are per data-parallel group (SGLang's label)
        self.running = Gauge(p + "num_running_reqs", "Requests in the running batch", g, registry=r)
        self.waiting = Gauge(p + "num_queue_reqs", "Requests in the waiting queue", g, registry=r)
        self.used_tokens = Gauge(p + "num_used_tokens", "KV tokens held by requests and the prefix cache", g, registry=r)
        self.total_tokens = Gauge(p + "max_total_num_tokens", "KV pool capacity in tokens", g, registry=r)
        self.token_usage = Gauge(p + "token_usage", "Share of the KV pool in use", g, registry=r)
        self.restarts = Counter(p + "actor_restarts", "Times the actors were started again, by the actor that died",
                                ["actor"], registry=r)  # fmt: skip
        self.restart_seconds = Gauge(p + "last_restart_seconds", "From an actor's death to its requests resubmitted",
                                     registry=r)  # fmt: skip
        self.load_reports = Counter(p + "load_reports", "Load reports served over HTTP (a router's load poll), by route",
                                    ["route"], registry=r)  # fmt: skip
        self.restart_counts: dict[str, int] = {}  # (what get_server_info reports; the counter's labels)
        self.last_restart: dict[str, Any] | None = None

    # ---- recorded by the frontend -----------------------------------------------------------
    def submitted(self, prompt_tokens: int) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(max(0.0, seconds))

    def inter_token(self, seconds: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(seconds)

    def finished(self, meta: dict[str, Any], seconds: float) -> None:
        self.generation_tokens.inc(meta.get("completion_tokens", 0))
        self.cached_tokens.inc(meta.get("cached_tokens", 0))
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort":
            self.aborted.inc()
        self.e2e.observe(seconds)

    def load_report(self, route: str) -> None:
        self.load_reports.labels(route=route).inc()

    def restarted(self, actor: str, exitcode: int | None, seconds: float, resubmitted: int,
                  phases: dict[str, Any] | None = None) -> None:  # fmt: skip
        """The supervisor started the actors again after `actor` died (actors/frontend/supervisor.py):
        `seconds` from the death to every request resubmitted (`phases`: how long the old
        actors took to stop, the new ones to be ready, and each of them from its spawn)."""
        self.restarts.labels(actor=actor).inc()
        self.restart_seconds.set(seconds)
        self.restart_counts[actor] = self.restart_counts.get(actor, 0) + 1
        self.last_restart = {"actor": actor, "exitcode": exitcode, "seconds": round(seconds, 3),
                             "resubmitted": resubmitted, **(phases or {})}  # fmt: skip

    def restart_info(self) -> dict[str, Any]:
        """get_server_info's keys: restarts (total), restarts_by_actor, last_restart."""
        return {"restarts": sum(self.restart_counts.values()), "restarts_by_actor": dict(self.restart_counts),
                "last_restart": self.last_restart}  # fmt: skip

    # ---- at scrape time ---------------------------------------------------------------------
    def exposition(self, loads: list[dict[str, Any]]) -> bytes:
        """The text exposition, with the load gauges set from each group's `load` (get_loads)."""
        for ld in loads:
            rank = str(ld["dp_rank"])
            self.running.labels(dp_rank=rank).set(ld["num_running_reqs"])
            self.waiting.labels(dp_rank=rank).set(ld["num_waiting_reqs"])
            self.used_tokens.labels(dp_rank=rank).set(ld["num_used_tokens"])
            self.total_tokens.labels(dp_rank=rank).set(ld["max_total_num_tokens"])
            self.token_usage.labels(dp_rank=rank).set(ld["token_usage"])
        return generate_latest(self.registry)
