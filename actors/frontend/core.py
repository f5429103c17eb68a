"""The frontend's logic without threads or rings: the request table (`FrontendCore`).

A request's state (`ReqState`) lives here from submit to its finished output. The actor
(actors/frontend/actor.py) adds a state per validated `RequestSpec`, sends `generate_req(spec)`
to the scheduler, and hands every `BatchStrOut` from the detokenizer to `apply`, which appends
each output to its request (outputs of different requests come interleaved, in any order),
finishes it (its session turn too) and wakes its waiters (`ReqState.changed`, and the stream
that listens to it: `ReqState.listener`). `chunks` is a stream's chunks, the latest state of
each request when the caller asks (a caller that lags costs one chunk). `result`
builds the SGLang-shaped dict from a state (streamed chunks carry the text and ids so far):

    {"text": str, "output_ids": [int],
     "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...} | None,
                   "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
                   "output_token_logprobs": [(logprob, token_id, text)]            (if asked)
                   "output_top_logprobs": [[(logprob, token_id, text), ...]]       (if asked)
                   "input_token_logprobs": [(None, id, text), (logprob, id, text), ...]  (from
                       logprob_start_len, default the last prompt token; with top_logprobs_num
                       "input_top_logprobs", with token_ids_logprob "input_token_ids_logprobs"
                       and "output_token_ids_logprobs")}}

plus "weight_version" / "weight_versions" (which weights made which tokens), with
speculative decoding SGLang's spec_* counters, and on the finish what the request asked to
read back: "top_p_token_ids" / "top_p_token_offsets" (custom_params.return_top_p_token_ids:
slime's fields, base64 of int32; token i drew from ids[offsets[i]:offsets[i + 1]]) and
"hidden_states" (return_hidden_states: SGLang's, the prompt positions' as one list, then one
per output token but the last) and "routed_experts" (return_routed_experts: SGLang's, base64
of int32 [positions, MoE layers, top-k], actors/transport/routed.py). Times are the caller's `now` (seconds of
time.perf_counter()), so the table is driven by hand in tests.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from ringserve.actors.frontend.errors import EngineDead
from ringserve.actors.frontend.inputs import RequestSpec
from ringserve.actors.frontend.metrics import FrontendMetrics
from ringserve.actors.frontend.sessions import Sessions
from ringserve.actors.transport import messages as m
from ringserve.actors.transport import routed


@dataclasses.dataclass(slots=True, eq=False)
class ReqState:
    spec: RequestSpec
    created: float
    text: str = ""
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    ids_logprobs: list[list[float]] = dataclasses.field(default_factory=list)  # token_ids_logprob per output
    input_logprobs: list[float] = dataclasses.field(default_factory=list)  # prompt positions start + 1, ...
    input_top: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    input_ids_logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    input_meta: dict[str, list] | None = None  # the prompt's logprob fields, built once (`_input_logprobs`)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    finished: bool = False
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    listener: Callable[[], None] | None = None  # called on each change (a stream of this request)
    error: BaseException | None = None
    last_output: float = 0.0  # when the latest tokens arrived (inter-token latency)
    aborted: bool = False  # an abort was asked (redone on the request resubmitted after a restart)
    weight_spans: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (version, first output index)
    dp_rank: int = 0  # the data-parallel group it was sent to (a resubmission goes there again)

    def notify(self) -> None:
        self.changed.set()
        if self.listener is not None:
            self.listener()


def generate_req(spec: RequestSpec, resume: m.Resume | None = None) -> m.GenerateReq:
    """The scheduler's message for one validated request (`resume`: resubmitted after a restart)."""
    plan = spec.session
    return m.GenerateReq(
        rid=spec.rid, input_ids=m.i32(spec.input_ids), sampling=spec.sampling,
        return_logprob=spec.return_logprob, top_logprobs_num=spec.top_logprobs_num, stream=spec.stream,
        session_id=plan.session.id if plan is not None else None, logprob_start_len=spec.logprob_start_len,
        token_ids_logprob=m.i32(spec.token_ids_logprob) if spec.token_ids_logprob else b"", resume=resume,
        lora_path=spec.lora_path, return_hidden_states=spec.return_hidden_states, cache_salt=spec.cache_salt,
        return_routed_experts=spec.return_routed_experts, routed_experts_start_len=spec.routed_experts_start_len,
    )  # fmt: skip


class FrontendCore:
    """Live requests by rid, the streaming sessions their turns belong to, and the metrics
    their outputs feed. `tokenizer` is only asked to decode single tokens (logprob texts)."""

    def __init__(self, tokenizer: Any, *, num_draft_tokens: int = 0, metrics: FrontendMetrics | None = None):
        self.tok = tokenizer
        self.num_draft_tokens = num_draft_tokens  # speculative_num_draft_tokens (spec_* meta)
        self.states: dict[str, ReqState] = {}
        self.sessions = Sessions()
        self.metrics = metrics or FrontendMetrics()

    # ---- the table --------------------------------------------------------------------------
    def add(self, spec: RequestSpec, now: float) -> ReqState:
        """A new live request (and its session turn, if any). ValueError: the rid is live."""
        if spec.rid in self.states:
            raise ValueError(f"rid {spec.rid!r} is already in use by a live request")
        if spec.session is not None:
            self.sessions.begin(spec.session, spec.rid, spec.input_ids)
        st = ReqState(spec, now, meta={"id": spec.rid, "finish_reason": None})
        self.states[spec.rid] = st
        return st

    def drop(self, rid: str) -> None:
        """Forget a request the scheduler never got (its send failed)."""
        self.states.pop(rid, None)

    def with_samples(self, rid: str) -> list[str]:
        """`rid` and the live samples `rid-0 ... rid-(n-1)` of a request made with n > 1."""
        samples = [r for r, st in self.states.items() if r.startswith(rid + "-") and st.spec.sampling.n > 1]
        return [rid] + samples

    def resubmission(self, st: ReqState) -> m.GenerateReq:
        """The live request `st` again, for actors started anew (actors/frontend/supervisor.py):
        its prompt, sampling and seed as first sent, plus what its caller already has (the
        output ids and text so far, the meta that must read as one run)."""
        if not st.output_ids:
            return generate_req(st.spec)
        meta = st.meta
        resume = m.Resume(m.i32(st.output_ids), len(st.text), meta.get("cached_tokens", 0), list(st.weight_spans),
                          meta.get("spec_verify_ct", 0), meta.get("spec_accept_token_num", 0))  # fmt: skip
        return generate_req(st.spec, resume)

    def fail_all(self, err: BaseException) -> None:
        """Every live request ends with `err` (its waiters raise); the table is emptied."""
        for st in self.states.values():
            st.error = err
            st.notify()
        self.states.clear()

    # ---- outputs ----------------------------------------------------------------------------
    def apply(self, msg: m.BatchStrOut, now: float) -> None:
        """Append each output to its request; a finished one leaves the table. Outputs of a
        request no longer live (aborted and answered, or failed) are ignored."""
        for o, text in zip(msg.outs, msg.texts, strict=True):
            st = self.states.get(o.rid)
            if st is None:
                continue
            self._append(st, o, text, now)
            if o.finished:
                if st.spec.session is not None:
                    self.sessions.finished(st.spec.session.session.id, o.rid, st.output_ids)
                st.finished = True
                st.meta["finish_reason"] = o.finish_reason
                st.meta["e2e_latency"] = now - st.created
                self.metrics.finished(st.meta, now - st.created)
                del self.states[o.rid]
            st.notify()

    def _append(self, st: ReqState, o: m.TokenOut, text: str, now: float) -> None:
        new = m.as_i32(o.new_ids).tolist()
        st.text += text
        if new:
            if not st.output_ids:
                self.metrics.first_token((o.first_token_at or now) - st.created)
            elif st.spec.stream:
                self.metrics.inter_token((now - st.last_output) / len(new), len(new))
            st.last_output = now
        st.output_ids += new
        if o.logprobs:
            st.logprobs += m.as_f32(o.logprobs).tolist()
        if o.top_n:
            st.top += _pairs(o.top_logprobs, o.top_ids, o.top_n)
        if o.more is not None:
            self._append_more(st, o.more)
        st.meta.update(
            prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens, cached_tokens=o.cached_tokens
        )
        if o.weight_version:
            st.meta["weight_version"] = o.weight_version
            if not st.weight_spans or st.weight_spans[-1][0] != o.weight_version:
                st.weight_spans.append((o.weight_version, len(st.output_ids) - len(new)))
        if o.weight_versions:  # the tokens came from several weights: which produced which (exact)
            st.weight_spans = list(o.weight_versions)
            ends = [start for _, start in o.weight_versions[1:]] + [o.completion_tokens]
            st.meta["weight_versions"] = [
                {"version": v, "start": s, "end": e} for (v, s), e in zip(o.weight_versions, ends, strict=True)
            ]
        if o.kept_offsets:  # slime's (its SGLang patch's) fields: base64 of little-endian int32
            st.meta["top_p_token_ids"] = base64.b64encode(o.kept_ids).decode("ascii")
            st.meta["top_p_token_offsets"] = base64.b64encode(o.kept_offsets).decode("ascii")
        if o.hidden_dim:  # SGLang's: the prompt's positions as one list, then each output position's
            h = m.as_f32(o.hidden).reshape(-1, o.hidden_dim)
            st.meta["hidden_states"] = [h[: o.hidden_prompt].tolist(), *h[o.hidden_prompt :].tolist()]
        if o.finished and st.spec.return_routed_experts:  # SGLang's: base64 of int32 [positions, M, k]
            ids = np.frombuffer(o.routed, routed.dtype_of(o.routed_itemsize)) if o.routed_itemsize else np.zeros(0)
            st.meta["routed_experts"] = routed.encode(ids)
        if o.spec_verify_ct:  # SGLang's names (slime reads them)
            k = self.num_draft_tokens
            st.meta.update(spec_verify_ct=o.spec_verify_ct, spec_accept_token_num=o.spec_accepted,
                           spec_draft_token_num=o.spec_verify_ct * k,
                           spec_accept_length=round(o.completion_tokens / o.spec_verify_ct, 4))  # fmt: skip

    @staticmethod
    def _append_more(st: ReqState, more: m.MoreLogprobs) -> None:
        """token_ids_logprob of the new outputs and, once, the prompt's logprobs."""
        k, top_n = more.ids_n, st.spec.top_logprobs_num
        if more.ids_logprobs:
            st.ids_logprobs += m.as_f32(more.ids_logprobs).reshape(-1, k).tolist()
        if more.input_logprobs:
            st.input_logprobs = m.as_f32(more.input_logprobs).tolist()
            if top_n and more.input_top_ids:
                st.input_top = _pairs(more.input_top_logprobs, more.input_top_ids, top_n)
            if more.input_ids_logprobs:
                st.input_ids_logprobs = m.as_f32(more.input_ids_logprobs).reshape(-1, k).tolist()

    # ---- streams ----------------------------------------------------------------------------
    async def chunks(self, states: list[ReqState], batched: bool, incremental: bool = False) -> AsyncIterator[dict]:
        """One stream's chunks: each the `result` of a request that changed since its last chunk
        (with "index" when batched), built when the caller asks for the next one; each request's
        last chunk is finished. EngineDead if a request is lost.

        Outputs are cumulative (SGLang's convention: a chunk holds the text and ids so far), so the
        latest state is all a caller needs: one that keeps up gets a chunk per output (every
        `stream_interval` tokens), one that lags gets the newest state when it asks, and costs one
        chunk however far behind it is, never a queue of snapshots. With `incremental` (SGLang's
        `incremental_streaming_output`) a chunk holds only what is new since its request's last
        chunk: the text, output ids and their logprobs past what was sent."""
        sent: dict[int, tuple[int, int]] = {}  # incremental: (text chars, output ids) sent per request
        news: dict[int, None] = {}  # requests changed since their last chunk, in order of change
        woken = asyncio.Event()

        def listener(i: int) -> Callable[[], None]:
            def changed() -> None:
                news[i] = None
                woken.set()

            return changed

        for i, st in enumerate(states):
            st.listener = listener(i)
            if st.changed.is_set():  # outputs that came before the stream began
                news[i] = None
        try:
            left = len(states)
            while left:
                if not news:
                    woken.clear()
                    await woken.wait()
                    continue
                i = next(iter(news))
                del news[i]
                st = states[i]
                st.changed.clear()
                if st.error is not None:
                    raise EngineDead(f"request {st.spec.rid} lost: the engine is down: {st.error}")
                out = self.result(st)
                if incremental:
                    chars, ids = sent.get(i, (0, 0))
                    sent[i] = (len(out["text"]), len(out["output_ids"]))
                    out["text"], out["output_ids"] = out["text"][chars:], out["output_ids"][ids:]
                    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
                        if key in out["meta_info"]:
                            out["meta_info"][key] = out["meta_info"][key][ids:]
                if batched:
                    out["index"] = i
                left -= st.finished
                yield out
        finally:
            for st in states:
                st.listener = None

    # ---- results ----------------------------------------------------------------------------
    def result(self, st: ReqState) -> dict:
        """The SGLang-shaped result so far (see the module docstring); a fresh dict each call."""
        meta = dict(st.meta)
        if st.spec.return_logprob:
            meta.update(self._logprobs(st))
        return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}

    def _logprobs(self, st: ReqState) -> dict[str, Any]:
        """SGLang's logprob fields: (logprob, token id, text) triples of the output tokens and of
        the prompt from logprob_start_len (its first entry has no logprob: None, as SGLang's);
        top_logprobs_num's and token_ids_logprob's per position likewise."""
        spec = st.spec
        texts = self.token_texts(st.output_ids + [t for row in st.top for _, t in row] + list(spec.token_ids_logprob or ()))

        def triples(lps: list, ids: list[int]) -> list:
            return [(lp, t, texts[t]) for lp, t in zip(lps, ids, strict=True)]

        out: dict[str, Any] = {"output_token_logprobs": triples(st.logprobs[: len(st.output_ids)], st.output_ids)}
        if spec.top_logprobs_num:
            out["output_top_logprobs"] = [triples([lp for lp, _ in row], [t for _, t in row]) for row in st.top]
        if spec.token_ids_logprob:
            out["output_token_ids_logprobs"] = [triples(row, spec.token_ids_logprob) for row in st.ids_logprobs]
        if spec.logprob_start_len >= 0:
            if st.input_meta is None or len(st.input_meta["input_token_logprobs"]) < 1 + len(st.input_logprobs):
                st.input_meta = self._input_logprobs(st)  # built once the prompt's logprobs are in
            out.update({k: list(v) for k, v in st.input_meta.items()})
        return out

    def _input_logprobs(self, st: ReqState) -> dict[str, list]:
        """The prompt's part of `_logprobs` (the logprobs that came so far: all, or none yet)."""
        spec = st.spec
        prompt = spec.input_ids[spec.logprob_start_len :][: 1 + len(st.input_logprobs)]
        ids = spec.token_ids_logprob or []
        texts = self.token_texts(prompt + [t for row in st.input_top for _, t in row] + ids)

        def triples(lps: list, toks: list[int]) -> list:
            return [(lp, t, texts[t]) for lp, t in zip(lps, toks, strict=True)]

        out: dict[str, list] = {"input_token_logprobs": triples([None, *st.input_logprobs][: len(prompt)], prompt)}
        if spec.top_logprobs_num:
            out["input_top_logprobs"] = [None] + [triples([lp for lp, _ in row], [t for _, t in row]) for row in st.input_top]
        if ids:
            out["input_token_ids_logprobs"] = [None] + [triples(row, ids) for row in st.input_ids_logprobs]
        return out

    def token_texts(self, ids: list[int]) -> dict[int, str]:
        return {t: self.tok.decode([t]) for t in set(ids)}


def _pairs(logprobs: bytes, ids: bytes, n: int) -> list[list[tuple[float, int]]]:
    """[rows, n] top logprobs and ids as (logprob, id) rows."""
    lps, tids = m.as_f32(logprobs).reshape(-1, n).tolist(), m.as_i32(ids).reshape(-1, n).tolist()
    return [list(zip(lp, t, strict=True)) for lp, t in zip(lps, tids, strict=True)]
