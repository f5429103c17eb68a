"""PNG plots of harness runs (matplotlib, Agg backend: no display needed).

    throughput_vs_rate  output throughput and TTFT / ITL p99 against the request rate, one line
                        per backend configuration (an infinite rate is drawn at the right edge)
    latency_cdfs        empirical CDFs of TTFT, ITL and E2E, one line per run
    step_timeline       a window of the step trace: scheduler phases, runner phases and device
                        steps as horizontal bars on one time axis
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.bench.metrics import RequestRecord


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_vs_rate(runs: list[dict], path: str | Path) -> Path:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(str(r["label"]).split("@")[0], []).append(r)
    finite = [r["request_rate"] for r in runs if math.isfinite(r["request_rate"])]
    inf_x = 2 * max(finite) if finite else 1.0
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["request_rate"])
        xs = [r["request_rate"] if math.isfinite(r["request_rate"]) else inf_x for r in rs]
        ax1.plot(xs, [r.get("output_throughput") or 0 for r in rs], "o-", label=name)
        ax2.plot(xs, [r.get("ttft_ms_p99") or np.nan for r in rs], "o-", label=f"{name} TTFT p99")
        ax2.plot(xs, [r.get("itl_ms_p99") or np.nan for r in rs], "s--", label=f"{name} ITL p99")
    ax1.set(xlabel=f"request rate (req/s; inf drawn at {inf_x:g})", ylabel="output tokens/s", title="throughput")
    ax2.set(xlabel="request rate (req/s)", ylabel="ms", title="latency p99", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def latency_cdfs(records: dict[str, list[RequestRecord]], path: str | Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for label, recs in records.items():
        ok = [r for r in recs if r.ok]
        series = {
            "TTFT": [r.ttft for r in ok],
            "ITL": [x for r in ok for x in r.itls()],
            "E2E": [r.e2e for r in ok],
        }
        for ax, (name, vals) in zip(axes, series.items(), strict=True):
            if not vals:
                continue
            v = np.sort(np.asarray(vals) * 1e3)
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
            ax.set(xlabel=f"{name} (ms)", ylabel="fraction of samples", title=f"{name} CDF", xscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def step_timeline(cols: dict[str, list], path: str | Path, max_steps: int = 60) -> Path:
    """The `max_steps` steps in the middle of the trace (steady state), phases as bars."""
    from ringserve.bench.profile import records

    plt = _plt()
    r = records(cols)
    n = len(r["step_id"])
    lo = max(0, n // 2 - max_steps // 2)
    sl = slice(lo, min(n, lo + max_steps))
    t0 = r["t_sched"][sl][0]
    lanes = [
        ("scheduler", [("schedule", "t_sched", "t_send", "tab:blue"), ("send", "t_send", "t_sent", "tab:cyan"),
                       ("wait runner", "t_wait", "t_got", "lightgray"), ("process", "t_got", "t_done", "tab:purple")]),
        ("runner", [("apply", "r_start", "r_applied", "tab:olive"), ("build+dispatch", "r_applied", "r_dispatched", "tab:orange"),
                    ("wait device", "r_fetch", "dev_ready", "lightgray"), ("d2h", "dev_ready", "r_fetched", "tab:red")]),
        ("device", [("step", "dev_start", "dev_ready", "tab:green")]),
    ]  # fmt: skip
    fig, ax = plt.subplots(figsize=(14, 3.2))
    seen: set[str] = set()
    for y, (_, phases) in enumerate(lanes):
        for name, a, b, color in phases:
            xa, xb = (r[a][sl] - t0) * 1e3, (r[b][sl] - t0) * 1e3
            spans = [(float(x), float(w)) for x, w in zip(xa, xb - xa, strict=True) if w > 0]
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, label=None if name in seen else name)
            seen.add(name)
    ax.set_yticks(range(len(lanes)), [lane for lane, _ in lanes])
    ax.invert_yaxis()
    ax.set(xlabel=f"ms (steps {int(r['step_id'][sl][0])}-{int(r['step_id'][sl][-1])})", title="step timeline")
    ax.legend(fontsize=7, ncol=5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
