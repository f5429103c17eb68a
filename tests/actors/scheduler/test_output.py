"""Incremental scheduling on the wire: what one decode step costs in bytes, and that the
runner's mirror rebuilds every segment from those bytes alone."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.runner.slot_mirrors import SlotMirrors
from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.scheduler.output import step_msg
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport import messages as m
from ringserve.kvmem import KVCache
from tests.actors.scheduler.fake_runner import FakeRunner
from tests.actors.scheduler.test_scheduler import req


def mp_uint(x: int) -> int:
    """Bytes msgpack spends on a non-negative int."""
    return 1 if x < 128 else 2 if x < 256 else 3 if x < 65536 else 5


def mp_bin(n: int) -> int:
    return n + (2 if n < 256 else 3 if n < 65536 else 5)


def decode_step_bytes(batch: int, step_id: int) -> int:
    """[tag "step", step_id, released=b"", starts=[], slots, committed, token_counts, tokens,
    page_counts, pages, keep, drafts=0, mask_rows=b"", masks=b"", prompt=None, multistep=False,
    local_pages=b""] (17 items: a 3-byte array header): five int32 columns and one uint8 column of `batch` rows, and the
    pages appended (a context of whole pages: one new page per row); no grammar masks (no row is
    constrained), no prompt positions (one nil byte); nothing depends on the context length."""
    return (3 + (1 + 4) + mp_uint(step_id) + mp_bin(0) + 1 + 5 * mp_bin(4 * batch) + mp_bin(4 * batch)
            + mp_bin(batch) + 1 + 2 * mp_bin(0) + 1 + 1 + mp_bin(0))  # fmt: skip


def first_decode(context: int, batch: int, page: int = 16):
    n_pages = (context + 64) * batch // page + 8
    args = ServerArgs(page_size=page, max_total_tokens=n_pages * page, max_running_requests=batch, context_length=context + 64,
                      chunked_prefill_size=-1, max_prefill_tokens=context * batch + 16)  # fmt: skip
    core = SchedulerCore(args, KVCache(n_pages, page, batch, disable_radix_cache=True), lambda ids: "")
    runner, mirrors = FakeRunner(page), SlotMirrors(batch)
    rng = np.random.default_rng(context)
    for i in range(batch):
        core.add_request(req(f"r{i}", rng.integers(5, 900, context).tolist(), 8))
    while True:
        b = core.get_next_batch()
        wire = m.encode(step_msg(b))
        rows = mirrors.apply(m.to_runner.decode(wire))
        # the mirror alone reproduces what the scheduler planned: positions and page tables
        assert [d.committed_len for d in rows] == [r.committed_len for r in b.rows]
        assert all(np.array_equal(d.pages, core.cache.pages(r.req.kv)) for d, r in zip(rows, b.rows, strict=True))
        if b.is_decode:
            return b, wire
        core.process_result(b, runner.run(b))


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_decode_step_bytes_grow_with_batch_not_context(batch):
    sizes = {}
    for context in (64, 4096):
        b, wire = first_decode(context, batch)
        assert len(b.rows) == batch and all(r.committed_len == context for r in b.rows)
        assert len(wire) == decode_step_bytes(batch, b.step_id), (context, len(wire))
        sizes[context] = len(wire) - mp_uint(b.step_id)
    assert sizes[64] == sizes[4096]


def test_step_msg_is_not_pickle():
    import pickle

    with pytest.raises(m.msgspec.DecodeError):
        m.to_runner.decode(pickle.dumps({"step_id": 1}))


def test_each_slot_tells_the_runner_which_of_its_logprobs_are_read():
    """A request's logprobs reach the device's sampler only as far as its output reads them: none
    without return_logprob, the top-n only with top_logprobs_num (the sampler skips what no
    row of a step reads)."""
    page = 16
    args = ServerArgs(page_size=page, max_total_tokens=64 * page, max_running_requests=4, context_length=256)
    core = SchedulerCore(args, KVCache(64, page, 4, disable_radix_cache=True), lambda ids: "")
    wants = {"none": {}, "chosen": {"return_logprob": True}, "top": {"return_logprob": True, "top_logprobs_num": 3},
             "top-unread": {"top_logprobs_num": 3}}  # fmt: skip
    for rid, kw in wants.items():
        r = req(rid, list(range(5, 25)), 4)
        r.return_logprob, r.top_logprobs_num = kw.get("return_logprob", False), kw.get("top_logprobs_num", 0)
        core.add_request(r)
    b = core.get_next_batch()
    rows = SlotMirrors(4).apply(m.to_runner.decode(m.encode(step_msg(b))))
    got = {r.req.rid: (d.sampling.logprobs, d.sampling.top_logprobs) for d, r in zip(rows, b.rows, strict=True)}
    assert got == {"none": (False, False), "chosen": (True, False), "top": (True, True), "top-unread": (False, False)}
