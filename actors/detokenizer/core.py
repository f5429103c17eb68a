"""The detokenizer's logic, without its process: token ids in, text deltas out, per request
(actors/detokenizer/actor.py owns the ring loop).

Each TokenOut carries only the ids produced since the previous one; nothing is resent. A
request's first TokenOut opens its decoder (its SamplingParams: stop strings, special-token
options; for a request resubmitted after a restart, the output and text its caller already has);
its last closes it.

For a request with stop strings, the last `max(len(stop)) - 1` characters are held back while
it runs (they might be the start of a stop string the scheduler has not seen complete yet);
at finish, the text is cut before the matched stop string unless `no_stop_trim`, and what
remains is flushed. So a streamed stop string never has to be taken back.
"""

from __future__ import annotations

import dataclasses

from ringserve.actors.detokenizer.incremental import Decodes, IncrementalDecoder
from ringserve.actors.transport import messages as m


@dataclasses.dataclass(slots=True)
class DetokState:
    decoder: IncrementalDecoder
    stops: tuple[str, ...]
    no_stop_trim: bool
    emitted: int = 0  # characters of decoder.text already sent

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1


class DetokenizerCore:
    def __init__(self, tokenizer: Decodes):
        self.tok = tokenizer
        self.states: dict[str, DetokState] = {}
        self.dropped: list[str] = []  # rids of outputs for requests never opened (a protocol bug)

    def open(self, rid: str, *, stops: tuple[str, ...] = (), no_stop_trim: bool = False,
             skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
             resume: m.Resume | None = None) -> None:  # fmt: skip
        """A request's decoder. A resumed one (resubmitted after a restart) decodes the output
        its caller already has again and goes on after the `text_len` characters it was sent."""
        dec = IncrementalDecoder(self.tok, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
        st = self.states[rid] = DetokState(dec, stops, no_stop_trim)
        if resume is not None:
            dec.push(m.as_i32(resume.output_ids).tolist())
            st.emitted = resume.text_len

    def push(self, rid: str, new_ids: list[int], finished: bool, matched_stop: str | None = None) -> str:
        """New text of `rid` (after its new ids); closes the request when finished."""
        st = self.states[rid]
        st.decoder.push(new_ids)
        if finished:
            st.decoder.finish()
            text = st.decoder.text
            if matched_stop is not None and not st.no_stop_trim:
                cut = text.find(matched_stop, max(0, st.emitted - len(matched_stop)))
                if cut >= 0:
                    text = text[:cut]
            del self.states[rid]
            out = text[st.emitted :]
            return out
        limit = len(st.decoder.text) - (st.holdback if st.stops else 0)
        if limit <= st.emitted:
            return ""
        out = st.decoder.text[st.emitted : limit]
        st.emitted = limit
        return out

    def convert(self, batch: m.BatchTokenOut) -> m.BatchStrOut:
        """Each TokenOut with its new text (same order); an output for a request never opened is
        dropped (and logged by the caller through `dropped`)."""
        outs, texts = [], []
        for t in batch.outs:
            if t.open is not None:
                sp = t.open
                self.open(t.rid, stops=sp.stop, no_stop_trim=sp.no_stop_trim,
                          skip_special_tokens=sp.skip_special_tokens,
                          spaces_between_special_tokens=sp.spaces_between_special_tokens, resume=t.resume)  # fmt: skip
            if t.rid not in self.states:
                self.dropped.append(t.rid)
                continue
            matched = None
            if t.finished and t.finish_reason and isinstance(t.finish_reason.get("matched"), str):
                matched = t.finish_reason["matched"]
            texts.append(self.push(t.rid, m.as_i32(t.new_ids).tolist(), t.finished, matched))
            t.open = t.resume = None  # the frontend has no use for them
            outs.append(t)
        return m.BatchStrOut(outs, texts)
