"""A request resubmitted after a restart of the actors (GenerateReq.resume: the output its caller
already has) goes on as if never interrupted. Over the fake runner, at every cut: its new tokens
are exactly the rest of the uninterrupted output, max_new_tokens counts the tokens it had, only
the new tokens (and their logprobs) are sent, its first output carries what the detokenizer needs
to go on, it reports its first run's cached tokens and weight spans; a stop string that spans the
seam finishes it where the uninterrupted run finishes; a grammar's matcher replays the output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringserve.actors.scheduler.actor import to_req
from ringserve.actors.scheduler.output import token_out
from ringserve.actors.transport import messages as m
from ringserve.actors.transport.sampling import SamplingParams
from tests.actors.scheduler import test_grammar as g
from tests.actors.scheduler.fake_runner import reference
from tests.actors.scheduler.test_scheduler import VOCAB, drive, letters, make

PROMPT = [5, 6, 7, 8, 9]


def wire(rid: str, prompt: list[int], max_new: int, resume: m.Resume | None = None, **sp) -> m.GenerateReq:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0, sampling_seed=0, **sp)
    return m.GenerateReq(rid, m.i32(prompt), sampling, return_logprob=True, stream=True, resume=resume)


def outputs(core, runner) -> list:
    """Every ReqOutput, in order (drive's loop, keeping the outputs themselves)."""
    outs = []
    while not core.idle:
        batch = core.get_next_batch()
        assert batch is not None
        outs += core.process_result(batch, runner.run(batch))
    core.check_idle()
    return outs


@pytest.mark.parametrize("overlap", [False, True])
def test_at_every_cut_the_resumed_request_gives_the_rest_of_the_uninterrupted_output(overlap):
    want = reference(PROMPT, 12, VOCAB)
    for cut in range(12):
        core, runner, _ = make(page=4, num_pages=64)
        resume = m.Resume(m.i32(want[:cut]), text_len=2 * cut, cached_tokens=3, weight_spans=[("7", 0)])
        core.add_request(to_req(wire("a", PROMPT, 12, resume), frozenset()))
        if overlap:
            assert drive(core, runner, overlap=True)["a"] == want[cut:]
            continue
        outs = outputs(core, runner)
        assert [t for o in outs for t in o.new_ids] == want[cut:], f"cut {cut}"
        wires = [token_out(o) for o in outs]
        assert wires[0].open is not None and wires[0].resume == resume  # the detokenizer's start
        assert all(w.open is None and w.resume is None for w in wires[1:])
        assert [len(w.logprobs) // 4 for w in wires] == [len(o.new_ids) for o in outs]  # the new tokens' only
        last = wires[-1]
        assert last.finished and last.finish_reason == {"type": "length"}
        assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (5, 12, 3)  # one run's meta
        assert last.weight_version == "0" and last.weight_versions == [("7", 0), ("0", cut)]
        # every output says so, not only the last: a stream its caller leaves early must know too
        assert all(w.weight_versions == [("7", 0), ("0", cut)] for w in wires)


def test_a_stop_string_across_the_seam_finishes_where_the_uninterrupted_run_does():
    want = reference(PROMPT, 10, VOCAB)
    stop = letters(want)[7:10]  # the last letter of token 3 and both of token 4: it straddles them
    for cut in (3, 4):  # the caller had token 3 (the stop's start), or the stop was not begun
        core, runner, _ = make()
        core.add_request(to_req(wire("a", PROMPT, 10, m.Resume(m.i32(want[:cut]), 0), stop=(stop,)), frozenset()))
        outs = outputs(core, runner)
        assert [t for o in outs for t in o.new_ids] == want[cut:5]
        assert outs[-1].req.finish_reason.matched == stop


def test_a_resumed_constrained_request_replays_its_output_into_its_matcher(g_lltok, g_tok):
    schema = g.SCHEMAS[2]
    sp = {"json_schema": json.dumps(schema)}
    want, _ = g.run(g_lltok, [g.req("a", PROMPT, **sp)])
    full = want["a"]
    for cut in (1, len(full) // 2, len(full) - 1):
        core, runner = g.make(g_lltok, model=g.copying(3, g.VOCAB, every=4))
        w = m.GenerateReq("a", m.i32(PROMPT), SamplingParams(max_new_tokens=64, temperature=0, sampling_seed=0, **sp),
                          stream=True, resume=m.Resume(m.i32(full[:cut]), 0))  # fmt: skip
        r = to_req(w, frozenset({g.EOS}))
        core.add_request(r)
        out = g.drive(core, runner, overlap=True)["a"]
        assert full[:cut] + out == full, f"cut {cut}"
        assert r.grammar.consumed == len(full) and json.loads(g.text(g_tok, full))


@pytest.fixture(scope="module")
def g_tok(tiny_dir):
    from ringserve.model.checkpoints.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir("llama"))


@pytest.fixture(scope="module")
def g_lltok(g_tok):
    from llguidance.hf import from_tokenizer

    return from_tokenizer(g_tok, n_vocab=g.VOCAB, eos_token=g.EOS)


def test_the_resumed_request_is_the_one_from_the_wire():
    r = to_req(wire("a", PROMPT, 9, m.Resume(m.i32([11, 12]), 4)), frozenset())
    assert r.output_ids == [11, 12] and r.sent_len == 2 and r.fill_len == 7
    assert np.array_equal(r.fill_ids(0, 7), PROMPT + [11, 12])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_resumed_speculative_request_gives_the_rest_and_counts_its_first_runs_rounds(overlap):
    from tests.actors.scheduler import test_spec as sp
    from tests.actors.scheduler.fake_runner import copying

    model = copying(3, sp.VOCAB, every=4)  # repeats itself: drafts get accepted
    core, runner, _ = sp.make(overlap=overlap, model=model)
    core.add_request(sp.req("a", PROMPT, 24))
    want = sp.drive(core, runner, overlap)["a"]
    for cut in (1, 9, 23):
        core, runner, _ = sp.make(overlap=overlap, model=model)
        w = m.GenerateReq("a", m.i32(PROMPT), SamplingParams(max_new_tokens=24, temperature=0, sampling_seed=0), stream=True,
                          resume=m.Resume(m.i32(want[:cut]), 0, spec_verify_ct=5, spec_accepted=7))  # fmt: skip
        r = to_req(w, frozenset())
        core.add_request(r)
        assert sp.drive(core, runner, overlap)["a"] == want[cut:], f"cut {cut}"
        assert r.spec.verify_ct >= 5 and r.spec.accepted >= 7  # the first run's, then this one's
        if cut == 23:  # one token left, from the prefill: no round of its own
            assert (r.spec.verify_ct, r.spec.accepted) == (5, 7)
