"""Incremental detokenization: never a broken character, never a resent id; stop strings."""

from __future__ import annotations

import pytest

from ringserve.actors.detokenizer.incremental import IncrementalDecoder
from ringserve.actors.transport.sampling import SamplingParams, find_stop

TEXT = "Héllo wörld — naïve café, 世界 🙂🚀 ok. Ünïcödé ∑∫ done"


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir("llama")))


def test_byte_level_bpe_splits_characters_and_the_decoder_waits(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the text must split a character across ids"
    dec = IncrementalDecoder(tok)
    deltas = [dec.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + dec.finish() == TEXT
    assert "" in deltas  # it did wait at least once
    assert dec.ids == ids  # each id exactly once


def test_chunks_of_ids_give_the_same_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    out = "".join(dec.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + dec.finish()
    assert out == TEXT


def test_finish_flushes_an_incomplete_character(tok):
    ids = tok.encode("a🙂", add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    text = "".join(dec.push([i]) for i in ids[:-1])
    assert text == "a"
    assert dec.finish().endswith("\ufffd")


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert "".join(IncrementalDecoder(tok).push([i]) for i in ids) == "hi"
    keep = IncrementalDecoder(tok, skip_special_tokens=False)
    assert "".join(keep.push([i]) for i in ids) == "<|im_start|>hi<|im_end|>"


def test_find_stop_across_boundaries():
    assert find_stop("hello wor", ("world",), 0) is None
    assert find_stop("hello world", ("world",), 9) == (6, "world")  # straddles the previous end
    assert find_stop("a STOP b END", ("END", "STOP"), 0) == (2, "STOP")
    assert find_stop("abc", (), 0) is None


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens=-1 must be an integer >= 0"),
        ({"temperature": -0.5}, "temperature=-0.5 must be in [0, 1e4]"),
        ({"top_p": 0}, "top_p=0 must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p=1.5 must be in (0, 1]"),
        ({"top_k": -2}, "top_k=-2 must be -1 (off) or in [1, 2**31)"),
        ({"min_p": 2}, "min_p=2 must be in [0, 1]"),
        ({"n": 0}, "n=0 must be an integer in [1, 64]"),
        ({"stop": [""]}, "must be non-empty strings"),
        ({"stop_token_ids": [5, 99999]}, "stop_token_ids [99999] outside the vocabulary [0, 2048)"),
        ({"frequency_penaltyy": 1}, "unknown parameter(s) ['frequency_penaltyy']"),
        ({"frequency_penalty": 2.5}, "frequency_penalty=2.5 must be in [-2, 2] (0 = off)"),
        ({"presence_penalty": -3}, "presence_penalty=-3 must be in [-2, 2] (0 = off)"),
        ({"repetition_penalty": 0}, "repetition_penalty=0 must be in (0, 2] (1 = off)"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty=nan must be in (0, 2] (1 = off)"),
        ({"min_new_tokens": 5, "max_new_tokens": 3}, "min_new_tokens=5 must be in [0, max_new_tokens=3]"),
        ({"min_new_tokens": -1}, "min_new_tokens=-1 must be in [0, max_new_tokens="),
        ({"presence_penalty": "0"}, "presence_penalty: expected float, got str"),
        ({"logit_bias": {"5": 101}}, "logit_bias[5]=101 must be in [-100, 100]"),
        ({"logit_bias": {"x": 1}}, "logit_bias: keys must be token ids"),
        ({"max_tokens": 5, "max_new_tokens": 6}, "both 'max_tokens' and 'max_new_tokens'"),
        ({"max_new_tokens": 2000}, "max_new_tokens=2000 exceeds the limit 1000"),
    ],
)
def test_bad_sampling_params_name_field_and_limit(params, message):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict(params, vocab_size=2048, max_new_tokens_limit=1000)
    assert message in str(e.value)


def test_penalties_at_their_neutral_values_change_nothing():
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0, "min_new_tokens": 0}
    assert SamplingParams.from_dict({"max_new_tokens": 3, **neutral}) == SamplingParams.from_dict({"max_new_tokens": 3})
    assert SamplingParams.from_dict({"repetition_penalty": None}) == SamplingParams.from_dict({})


def test_top_k_off_as_each_framework_says_it():
    # -1 (SGLang), 0 (vLLM), 1e8 (AReaL) and anything at least the vocabulary: no limit
    for off in (-1, 0, 1e8, 2048, 2**40):
        assert SamplingParams.from_dict({"top_k": off}, vocab_size=2048).top_k == -1, off
    assert SamplingParams.from_dict({"top_k": 2047}, vocab_size=2048).top_k == 2047


def test_aliases_and_normalisation():
    p = SamplingParams.from_dict({"max_tokens": 7, "stop": "END", "seed": 3, "temperature": 0})
    assert (p.max_new_tokens, p.stop, p.sampling_seed, p.is_greedy) == (7, ("END",), 3, True)


def test_detokenizer_holds_back_a_possible_stop_prefix_and_trims_it(tok):
    from ringserve.actors.detokenizer.core import DetokenizerCore

    text = "alpha beta STOP gamma"
    ids = tok.encode(text, add_special_tokens=False)
    core = DetokenizerCore(tok)
    core.open("r", stops=("STOP",))
    streamed = ""
    for i, t in enumerate(ids):
        done = tok.decode(ids[: i + 1]).endswith("STOP")
        streamed += core.push("r", [t], finished=done, matched_stop="STOP" if done else None)
        assert "S" not in streamed or streamed.endswith("alpha beta ")  # never a piece of the stop
        if done:
            break
    assert streamed == "alpha beta "
    core.open("k", stops=("STOP",), no_stop_trim=True)
    kept = core.push("k", ids[: i + 1], finished=True, matched_stop="STOP")
    assert kept == "alpha beta STOP"


def test_detokenizer_without_stops_streams_everything(tok):
    from ringserve.actors.detokenizer.core import DetokenizerCore

    ids = tok.encode(TEXT, add_special_tokens=False)
    core = DetokenizerCore(tok)
    core.open("r")
    out = "".join(core.push("r", [t], finished=False) for t in ids[:-1]) + core.push("r", ids[-1:], finished=True)
    assert out == TEXT and "r" not in core.states


@pytest.mark.parametrize("stops", [(), ("wörld —", "🚀 ok")], ids=["plain", "stop-strings"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_a_resumed_request_continues_the_text_exactly_at_every_cut(tok, stops, chunk):
    """The engine restarted after `cut` ids reached the caller (with the text sent so far): a new
    detokenizer opened with them (Resume) goes on so that the caller's text is the uninterrupted
    one, never repeated, whatever the cut (inside a character, inside a held-back stop prefix)."""
    from ringserve.actors.detokenizer.core import DetokenizerCore
    from ringserve.actors.transport import messages as m

    ids = tok.encode(TEXT, add_special_tokens=False)
    matched = next((s for s in stops if s in TEXT), None)
    end = next(i + 1 for i in range(len(ids)) if matched is None or matched in tok.decode(ids[: i + 1])) if stops else len(ids)
    chunks = [ids[i : min(i + chunk, end)] for i in range(0, end, chunk)]

    def run(core: DetokenizerCore, parts: list[list[int]]) -> str:
        out = ""
        for j, p in enumerate(parts):
            last = j == len(parts) - 1
            out += core.push("r", p, finished=last, matched_stop=matched if last else None)
        return out

    whole = DetokenizerCore(tok)
    whole.open("r", stops=stops)
    want = run(whole, chunks)
    assert want == (TEXT[: TEXT.index(matched)] if matched else TEXT)
    for cut in range(len(chunks)):
        first = DetokenizerCore(tok)
        first.open("r", stops=stops)
        sent = "".join(first.push("r", p, finished=False) for p in chunks[:cut])
        delivered = [t for p in chunks[:cut] for t in p]
        again = DetokenizerCore(tok)
        again.open("r", stops=stops, resume=m.Resume(m.i32(delivered), len(sent)))
        assert sent + run(again, chunks[cut:]) == want, f"cut after {cut} chunks"
