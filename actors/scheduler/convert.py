"""Scheduler rows -> runner rows (the in-memory form of the step message)."""

from __future__ import annotations

from actors.runner_state import RunnerRow
from actors.scheduler.batch import Row
from actors.scheduler.req import Req
from model.batch import SamplingParams as DeviceSampling


def device_sampling(req: Req) -> DeviceSampling:
    sp = req.sampling
    return DeviceSampling(float(sp.temperature), int(sp.top_k), float(sp.top_p), float(sp.min_p), int(req.seed))


def runner_row(row: Row) -> RunnerRow:
    starting = row.prefix_pages is not None
    return RunnerRow(
        slot=row.slot,
        committed_len=row.committed_len,
        extend_len=row.extend_len,
        token_ids=row.token_ids,
        new_pages=row.new_pages,
        prefix_pages=row.prefix_pages,
        sampling=device_sampling(row.req) if starting else None,
        sample=row.sample,
    )
