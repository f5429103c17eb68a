"""What one step's result books into its requests, beside the tokens themselves (the core,
actors/scheduler/core.py `process_result`, appends those and decides finishes):

    record_prompt_logprobs   a row's prompt positions' logprobs (input_* columns of the result)
    record_tapes             hidden states and routed experts at a row's positions
    book_token_extras        one output token's logprobs, top logprobs, chosen ids' logprobs and
                             the kept top-p ids (result index j)
    take_output              the request's new tokens since its last output, as a ReqOutput

Each takes a request and a StepResult and nothing of the scheduler's state.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ringserve.actors.scheduler.batch import Row, StepResult
from ringserve.actors.scheduler.req import Req


@dataclasses.dataclass(slots=True)
class ReqOutput:
    """New tokens of one request since the last output (what the detokenizer receives)."""

    req: Req
    new_ids: list[int]
    finished: bool
    first: bool  # the request's first output: it opens its detokenizer stream
    inputs: bool = (
        False  # carries the request's prompt logprobs (once: all of them, or all there are at finish)
    )


def record_prompt_logprobs(req: Req, span: tuple[int, int], at: int, result: StepResult) -> None:
    """A row's prompt positions' logprobs (result entries [at, at + count)) into its request."""
    assert req.prompt_lp is not None and result.input_logprobs is not None
    first, n = span
    top = None
    if req.top_logprobs_num and result.input_top_ids is not None and result.input_top_logprobs is not None:
        k = req.top_logprobs_num
        lps, ids = (
            result.input_top_logprobs[at : at + n, :k].tolist(),
            result.input_top_ids[at : at + n, :k].tolist(),
        )
        top = [list(zip(lp, t, strict=True)) for lp, t in zip(lps, ids, strict=True)]
    ids_lp = None
    if req.token_ids_logprob is not None and result.input_ids_logprobs is not None:
        ids_lp = result.input_ids_logprobs[at : at + n, : len(req.token_ids_logprob)]
    req.prompt_lp.record(first, result.input_logprobs[at : at + n], top, ids_lp)


def record_tapes(req: Req, row: Row, i: int, accepted: int | None, result: StepResult) -> None:
    """Row i's tokens' hidden states and routed experts into its request, when it asked: an
    extend or decode row's at its positions; a verify round's (`accepted` drafts) its input
    token's and the accepted drafts', from its true position (its committed length is a
    bound): its request's last token's (the results come in order: the round's input token
    is booked)."""
    for tape, values, starts in ((req.hidden, result.hidden, result.hidden_starts),
                                 (req.routed, result.routed, result.routed_starts)):  # fmt: skip
        if tape is None or values is None:
            continue
        assert starts is not None
        v = values[starts[i] : starts[i + 1]]
        if accepted is not None:
            tape.record(req.fill_len - 1, v[: accepted + 1])
        else:
            tape.record(row.committed_len, v)


def book_token_extras(req: Req, j: int, result: StepResult) -> None:
    """What the request asked about its output token at result index j: its logprob, top
    logprobs and the chosen ids' logprobs (return_logprob), the ids top-p kept."""
    if req.return_logprob and result.logprobs is not None:
        req.output_logprobs.append(float(result.logprobs[j]))
        if req.top_logprobs_num and result.top_ids is not None and result.top_logprobs is not None:
            n = req.top_logprobs_num
            top = zip(result.top_logprobs[j, :n].tolist(), result.top_ids[j, :n].tolist(), strict=True)
            req.output_top_logprobs.append(list(top))
        if req.token_ids_logprob is not None and result.ids_logprobs is not None:
            req.output_ids_logprobs.append(result.ids_logprobs[j, : len(req.token_ids_logprob)].tolist())
    if req.sampling.return_top_p_token_ids:
        ks = result.kept_starts
        req.kept.append(result.kept_ids[ks[j] : ks[j + 1]] if ks is not None and result.kept_ids is not None
                        else np.zeros(0, np.int32))  # fmt: skip


def take_output(req: Req, finished: bool) -> ReqOutput:
    """The tokens `req` produced since its last output (they count as sent now); its prompt
    logprobs ride once, when all are in or the request finishes."""
    new = req.output_ids[req.sent_len :]
    req.sent_len = len(req.output_ids)
    first, req.opened = not req.opened, True
    lp = req.prompt_lp
    inputs = lp is not None and not lp.sent and (lp.complete or finished)
    if inputs:
        assert lp is not None
        lp.sent = True
    return ReqOutput(req, new, finished, first, inputs)
