"""The detokenizer's logic, without its process: token ids in, text deltas out, per request.

For a request with stop strings, the last `max(len(stop)) - 1` characters are held back while
it runs (they might be the start of a stop string the scheduler has not seen complete yet);
at finish, the text is cut before the matched stop string unless `no_stop_trim`, and what
remains is flushed. So a streamed stop string never has to be taken back.
"""

from __future__ import annotations

import dataclasses

from actors.detokenizer.incremental import Decodes, IncrementalDecoder


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

    def open(self, rid: str, *, stops: tuple[str, ...] = (), no_stop_trim: bool = False,
             skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:  # fmt: skip
        dec = IncrementalDecoder(self.tok, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
        self.states[rid] = DetokState(dec, stops, no_stop_trim)

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

    def abort(self, rid: str) -> None:
        self.states.pop(rid, None)
