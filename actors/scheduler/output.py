"""The scheduler's outgoing wire messages: a batch as an incremental StepMsg, outputs as TokenOuts.

What a StepMsg carries per row (everything else the runner already mirrors, see
actors/runner/slot_mirrors.py):

    starting slot (new or resumed request): SlotStart = cached prefix pages + sampling params
    extend row : slot, committed_len, the new token ids, pages appended this step
    decode row : slot, committed_len, the page appended this step or -1     (12 bytes, columnar)
    verify round (speculative): slot, k drafts, pages appended this step   (columnar)
    every step : slots released since the previous step

Rows keep the batch's order; the scheduler core puts every extend row before the decode rows
(mixed batches), which is the order the runner returns tokens in.
"""

from __future__ import annotations

import numpy as np

from actors.scheduler.batch import Row, ScheduledBatch
from actors.scheduler.core import ReqOutput
from actors.transport.messages import ExtendRow, SlotStart, StepMsg, TokenOut, VerifyRounds, f32, i32


def slot_start(row: Row) -> SlotStart:
    assert row.prefix_pages is not None
    return SlotStart(i32(row.prefix_pages), row.req.sampling.device())


def step_msg(batch: ScheduledBatch) -> StepMsg:
    extend: list[ExtendRow] = []
    dec: list[Row] = []
    for row in batch.rows:
        if row.is_decode:
            dec.append(row)
            continue
        assert not dec, "extend rows must precede decode rows (result order)"
        start = slot_start(row) if row.prefix_pages is not None else None
        assert row.token_ids is not None
        extend.append(ExtendRow(
            slot=row.slot, committed_len=row.committed_len, token_ids=i32(row.token_ids),
            new_pages=i32(row.new_pages) if len(row.new_pages) else b"", sample=row.sample, start=start,
        ))  # fmt: skip
    msg = StepMsg(batch.step_id, i32(batch.released_slots) if batch.released_slots else b"", extend)
    if dec and dec[0].is_verify:
        assert all(r.is_verify and r.drafts is not None for r in dec), "a verify step has only verify rounds"
        msg.verify = VerifyRounds(
            slots=i32([r.slot for r in dec]),
            committed=i32([r.committed_len for r in dec]),
            drafts=i32(np.concatenate([r.drafts for r in dec if r.drafts is not None])),
            page_counts=i32([len(r.new_pages) for r in dec]),
            pages=i32(np.concatenate([r.new_pages for r in dec])),
        )
        return msg
    if dec:
        new_page = np.full(len(dec), -1, np.int32)
        for i, r in enumerate(dec):
            assert len(r.new_pages) <= 1, (
                f"decode row of slot {r.slot} got {len(r.new_pages)} pages for one token"
            )
            if len(r.new_pages):
                new_page[i] = r.new_pages[0]
        msg.decode_slots = i32([r.slot for r in dec])
        msg.decode_committed = i32([r.committed_len for r in dec])
        msg.decode_new_page = i32(new_page)
    return msg


def token_out(o: ReqOutput, first: bool) -> TokenOut:
    req = o.req
    n = len(o.new_ids)
    done = len(req.output_ids)
    out = TokenOut(
        rid=req.rid,
        new_ids=i32(o.new_ids),
        prompt_tokens=req.origin_len,
        completion_tokens=done,
        cached_tokens=req.cached_tokens,
        finished=o.finished,
        finish_reason=req.finish_reason.to_dict() if o.finished and req.finish_reason else None,
        open=req.sampling if first else None,
        first_token_at=req.first_token_at if n and done == n else 0.0,
        weight_version=req.weight_version,
        weight_versions=list(req.weight_spans) if o.finished and len(req.weight_spans) > 1 else [],
        spec_verify_ct=req.spec_verify_ct if o.finished else 0,
        spec_accepted=req.spec_accepted if o.finished else 0,
    )
    if req.return_logprob and n:
        out.logprobs = f32(req.output_logprobs[done - n : done])
        if req.top_logprobs_num:
            tops = req.output_top_logprobs[done - n : done]
            out.top_n = req.top_logprobs_num
            out.top_logprobs = f32([[lp for lp, _ in t] for t in tops])
            out.top_ids = i32([[tid for _, tid in t] for t in tops])
    return out
