"""Scheduler + StepMsg wire encoding + slot mirrors + the real JAX executor, in one process
(no rings): greedy tokens equal HF transformers' under chunking, page sizes, retract and overlap."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.runner.slot_mirrors import SlotMirrors
from ringserve.actors.scheduler.batch import StepResult
from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.scheduler.output import step_msg
from ringserve.actors.scheduler.req import Req
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport import messages as m
from ringserve.actors.transport.sampling import SamplingParams
from ringserve.kvmem import KVCache
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.hf_ref import hf_greedy


def run_engine(path, prompts, max_new, *, page, chunk, num_pages, overlap, max_running=8):
    args = ServerArgs(page_size=page, max_total_tokens=num_pages * page, max_running_requests=max_running,
                      context_length=min(256, (num_pages - 2) * page),  # the longest request the pool holds
                      chunked_prefill_size=chunk, max_prefill_tokens=256, disable_overlap_schedule=not overlap)  # fmt: skip
    ex = ModelExecutor(path, ExecutorConfig(page_size=page, num_pages=num_pages, max_context_len=256, max_batch=max_running,
                                            max_extend_tokens=args.max_prefill_tokens + 16 * max_running, precompile=False))  # fmt: skip
    core = SchedulerCore(args, KVCache(num_pages, page, max_running, disable_radix_cache=True), lambda ids: "")
    mirrors = SlotMirrors(max_running)
    for i, p in enumerate(prompts):
        core.add_request(
            Req(f"r{i}", np.asarray(p, np.int32), SamplingParams(max_new_tokens=max_new, temperature=0, sampling_seed=0))
        )
    pending = None
    out: dict[str, list[int]] = {}

    def process(batch, res):
        toks = np.asarray(res.tokens)[res_rows[batch.step_id]]
        for o in core.process_result(batch, StepResult(batch.step_id, toks)):
            out.setdefault(o.req.rid, []).extend(o.new_ids)

    res_rows: dict[int, list[int]] = {}
    while True:
        batch = core.get_next_batch()
        res = None
        if batch is not None:
            wire = m.to_runner.decode(m.encode(step_msg(batch)))  # the real wire round trip
            res, rows, _ = ex.run(mirrors.apply(wire))
            res_rows[batch.step_id] = rows
        if overlap:
            if pending:
                process(*pending)
            pending = (batch, res) if batch is not None else None
        elif batch is not None:
            process(batch, res)
        if batch is None and pending is None:
            if core.idle:
                break
            core.check_idle()
    return [out[f"r{i}"] for i in range(len(prompts))], core


PROMPTS_SEED = 11


@pytest.fixture(scope="module")
def case(tiny_dir):
    rng = np.random.default_rng(PROMPTS_SEED)
    prompts = [rng.integers(3, 2000, int(n)).tolist() for n in rng.integers(1, 60, 10)]
    path = tiny_dir("llama")
    return path, prompts, hf_greedy(path, prompts, 16)


@pytest.mark.parametrize(
    "page, chunk, num_pages, overlap",
    [(16, -1, 128, False), (16, 16, 128, True), (1, 4, 2048, False), (1, 4, 2048, True), (4, 16, 60, True)],
)
def test_greedy_equals_hf(case, page, chunk, num_pages, overlap):
    path, prompts, ref = case
    got, core = run_engine(path, prompts, 16, page=page, chunk=chunk, num_pages=num_pages, overlap=overlap)
    assert got == ref
    if num_pages == 60:
        assert core.stats.num_retracted > 0
