"""The scheduler's outgoing wire messages: a batch as an incremental StepMsg, outputs as TokenOuts.

What a StepMsg carries (everything else the runner already mirrors, see
actors/runner/slot_mirrors.py), one columnar encoding for every row:

    starting slot (new or resumed request): SlotStart = slot, cached prefix pages, sampling,
                LoRA adapter slot
    every row : slot, committed_len, tokens (ids; FUTURE(slot) for the last sample), pages
                appended this step, keep (0: a middle prefill chunk)
    every step: slots released since the previous step; drafts = k for a verify step
    constrained rows only: their row index and grammar masks (1 + drafts per row, V / 8 bytes each)
    prompt logprobs only: the wanted positions of the rows that want some, the token after each

A decode row costs 21 bytes (5 columns of int32 and one of uint8) plus its page when it starts
one. Rows keep the batch's order; the scheduler core puts every extend row before the decode
rows (mixed batches), which is the order the runner returns tokens in.
"""

from __future__ import annotations

import numpy as np

from ringserve.actors.scheduler.batch import Row, ScheduledBatch
from ringserve.actors.scheduler.booking import ReqOutput
from ringserve.actors.scheduler.req import Req
from ringserve.actors.transport.messages import (
    MoreLogprobs,
    PromptPositions,
    SlotStart,
    StepMsg,
    TokenOut,
    f32,
    i32,
    u8,
)
from ringserve.model.compute.step_inputs import DeviceSampling


def _device_sampling(req: Req) -> DeviceSampling:
    """How the device samples `req`, and which of its logprobs are read (`token_out`: none
    without return_logprob; the top-n only with top_logprobs_num), whether its hidden states
    and its routed experts are."""
    return req.sampling.device(req.return_logprob, req.return_logprob and req.top_logprobs_num > 0, req.origin_len,
                               req.eos_ids, req.return_hidden_states, req.return_routed_experts)  # fmt: skip


def _slot_start(r: Row) -> SlotStart:
    """A (re)starting slot: its cached prefix, how it samples, and a penalized request's tokens
    so far (its prompt, then its output: the slot's token counts start from them)."""
    req = r.req
    assert r.prefix_pages is not None
    st = SlotStart(r.slot, i32(r.prefix_pages), _device_sampling(req), _ids(req.token_ids_logprob),
                   req.lora.slot if req.lora is not None else 0)  # fmt: skip
    if len(r.prefix_local):
        st.prefix_local = i32(r.prefix_local)
    if req.sampling.penalized:
        st.counts_ids, st.counts_origin = i32(req.fill_ids(0, req.fill_len)), req.origin_len
    return st


def step_msg(batch: ScheduledBatch) -> StepMsg:
    rows = batch.rows
    k = batch.drafts
    assert all(r.drafts == k for r in rows), "a verify step has only verify rounds"
    starts = [_slot_start(r) for r in rows if r.prefix_pages is not None]
    pages = [r.new_pages for r in rows]
    masks = {i: r.mask for i, r in enumerate(rows) if r.mask is not None}
    return StepMsg(
        batch.step_id,
        released=i32(batch.released_slots) if batch.released_slots else b"",
        starts=starts,
        slots=i32([r.slot for r in rows]),
        committed=i32([r.committed_len for r in rows]),
        token_counts=i32([r.extend_len for r in rows]),
        tokens=i32(np.concatenate([r.token_ids for r in rows])) if rows else b"",
        page_counts=i32([len(p) for p in pages]),
        pages=i32(np.concatenate(pages)) if rows else b"",
        keep=u8([r.sample for r in rows]),
        drafts=k,
        mask_rows=i32(list(masks)) if masks else b"",
        masks=i32(np.stack(list(masks.values()))) if masks else b"",
        prompt=_prompt_positions(rows),
        multistep=batch.multistep,
        local_pages=i32(np.concatenate([r.new_local for r in rows])) if any(len(r.new_local) for r in rows) else b"",
    )


def _prompt_positions(rows: list[Row]) -> PromptPositions | None:
    """The rows' wanted prompt positions (offsets into each row's tokens) and the prompt token
    after each; None when no row wants any."""
    spans = [(i, r, r.logprob_span) for i, r in enumerate(rows) if r.logprob_span is not None]
    if not spans:
        return None
    return PromptPositions(
        rows=i32([i for i, _, _ in spans]),
        starts=i32([first - r.committed_len for _, r, (first, _) in spans]),
        counts=i32([n for _, _, (_, n) in spans]),
        targets=i32(np.concatenate([r.req.fill_ids(first + 1, first + n + 1) for _, r, (first, n) in spans])),
    )


def _ids(ids: np.ndarray | None) -> bytes:
    return i32(ids) if ids is not None and len(ids) else b""


def token_out(o: ReqOutput) -> TokenOut:
    req = o.req
    n = len(o.new_ids)
    done = len(req.output_ids)
    spec = req.spec if o.finished else None
    out = TokenOut(
        rid=req.rid,
        new_ids=i32(o.new_ids),
        prompt_tokens=req.origin_len,
        completion_tokens=done,
        cached_tokens=req.cached_tokens,
        finished=o.finished,
        finish_reason=req.finish_reason.to_dict() if o.finished and req.finish_reason else None,
        open=req.sampling if o.first else None,
        resume=req.resumed if o.first else None,
        first_token_at=req.first_token_at if n and done == n else 0.0,
        weight_version=req.weight_version,
        weight_versions=list(req.weight_spans) if len(req.weight_spans) > 1 else [],  # a stream left early must know too
        spec_verify_ct=spec.verify_ct if spec is not None else 0,
        spec_accepted=spec.accepted if spec is not None else 0,
    )
    if req.return_logprob and n:  # (the newest n: a resumed request's earlier ones are not here)
        out.logprobs = f32(req.output_logprobs[-n:])
        if req.top_logprobs_num:
            tops = req.output_top_logprobs[-n:]
            out.top_n = req.top_logprobs_num
            out.top_logprobs = f32([[lp for lp, _ in t] for t in tops])
            out.top_ids = i32([[tid for _, tid in t] for t in tops])
    out.more = _more(o, n, done)
    if o.finished:
        _read_back(req, out)
    return out


def _read_back(req: Req, out: TokenOut) -> None:
    """On the finish: the set each output token was drawn from (an empty one for the tokens a
    resumed request had before: those were drawn in an earlier run), and the hidden states and
    routed experts of every position but the last, when the request asked."""
    if req.sampling.return_top_p_token_ids:
        sets = [np.zeros(0, np.int32)] * (len(req.output_ids) - len(req.kept)) + req.kept
        out.kept_ids = i32(np.concatenate(sets)) if sets else b""
        out.kept_offsets = i32(np.concatenate([[0], np.cumsum([len(k) for k in sets])]))
    h = req.hidden.values(req.fill_len - 1) if req.hidden is not None else None
    if h is not None:
        out.hidden, out.hidden_dim, out.hidden_prompt = f32(h), h.shape[1], min(req.origin_len, len(h))
    ids = req.routed.values(req.fill_len - 1) if req.routed is not None else None
    if ids is not None:
        out.routed, out.routed_shape, out.routed_itemsize = ids.tobytes(), (ids.shape[1], ids.shape[2]), ids.itemsize


def _more(o: ReqOutput, n: int, done: int) -> MoreLogprobs | None:
    """The request's token_ids_logprob of its `n` new outputs and, once (`o.inputs`), its prompt
    logprobs; None when it asked for neither."""
    req, lp = o.req, o.req.prompt_lp
    k = len(req.token_ids_logprob) if req.token_ids_logprob is not None else 0
    inputs = o.inputs and lp is not None and bool(lp.logprobs)
    if not (req.return_logprob and n and k) and not inputs:
        return None
    more = MoreLogprobs(ids_n=k)
    if req.return_logprob and n and k:
        more.ids_logprobs = f32(req.output_ids_logprobs[done - n : done])
    if inputs:
        assert lp is not None
        more.input_logprobs = f32(lp.logprobs)
        if req.top_logprobs_num:
            more.input_top_logprobs = f32([[x for x, _ in t] for t in lp.top])
            more.input_top_ids = i32([[tid for _, tid in t] for t in lp.top])
        if k:
            more.input_ids_logprobs = f32(lp.ids)
    return more
