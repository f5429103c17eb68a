"""The scheduler's grammar part over the fake runner, with real llguidance matchers on the tiny
model's vocabulary: outputs validate and are identical with overlap on and off, speculation
(drafts trimmed to the grammar) and retraction; EOS only where the grammar allows it; a stopped
matcher finishes its request; a request waiting for its grammar blocks nobody; a failed compile
aborts only its request; flush_cache empties the grammar cache; pause (retract) and abort keep
each matcher with its booked tokens."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.scheduler.grammar import Grammars
from ringserve.actors.scheduler.req import Req
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport.sampling import SamplingParams
from ringserve.kvmem import KVCache
from tests.actors.scheduler.fake_runner import FakeRunner, copying

VOCAB = 2048  # the tiny model's
EOS = 2  # its <|im_end|>
K = 3
SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "ok": {"type": "boolean"}}, "required": ["id", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                      "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2}},
     "required": ["name", "tags"], "additionalProperties": False},
]  # fmt: skip


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from ringserve.model.checkpoints.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir("llama"))


@pytest.fixture(scope="module")
def lltok(tok):
    from llguidance.hf import from_tokenizer

    return from_tokenizer(tok, n_vocab=VOCAB, eos_token=EOS)


def make(lltok, num_pages=512, page=4, overlap=True, model=None, spec=False, **kw):
    if spec:
        kw.update(speculative_algorithm="ngram", speculative_num_draft_tokens=K)
    args = ServerArgs(page_size=page, max_total_tokens=num_pages * page, max_running_requests=8,
                      context_length=min(1024, (num_pages - 2) * page), disable_overlap_schedule=not overlap, **kw)  # fmt: skip
    grammars = Grammars(lambda: lltok, VOCAB, {"whitespace_flexible": False})
    core = SchedulerCore(args, KVCache(num_pages, page, 8), lambda ids: "", grammars)
    return core, FakeRunner(page, VOCAB, model=model)


def req(rid, prompt, max_new=64, **sp) -> Req:
    return Req(rid, np.asarray(prompt, np.int32), SamplingParams(max_new_tokens=max_new, temperature=0, sampling_seed=0, **sp),
               frozenset({EOS}), stream=True)  # fmt: skip


def drive(core: SchedulerCore, runner: FakeRunner, overlap: bool) -> dict[str, list[int]]:
    """The actor's loop: in overlap mode batch N+1 is planned before N is booked, except after a
    batch with masks (booked first); while only grammars compile, wait for them."""
    out: dict[str, list[int]] = {}
    pending: list = []

    def book(batch, result):
        for o in core.process_result(batch, result):
            out.setdefault(o.req.rid, []).extend(o.new_ids)

    for _ in range(20_000):
        for o in core.grammar_failures():
            out.setdefault(o.req.rid, []).extend(o.new_ids)
        if any(b.masked for b, _ in pending):
            while pending:
                book(*pending.pop(0))
        batch = core.get_next_batch()
        if batch is not None:
            pending.append((batch, runner.run(batch)))
        if pending and (not overlap or batch is None or len(pending) > 1):
            book(*pending.pop(0))
        if batch is None and not pending:
            if core.idle:
                return out
            if core.compiling:
                for f in list(core.grammars.cache.values()):
                    f.exception(timeout=10)
    raise AssertionError("did not finish")


def text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != EOS])


def workload(n: int = 12) -> list[Req]:
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(n):
        phrase = rng.integers(3, VOCAB, int(rng.integers(2, 6))).tolist()
        prompt = (phrase * 8)[: int(rng.integers(4, 30))]  # repeats: n-gram drafts have material
        reqs.append(req(f"r{i}", prompt, json_schema=json.dumps(SCHEMAS[i % len(SCHEMAS)])))
    return reqs


def run(lltok, reqs: list[Req], **kw) -> tuple[dict[str, list[int]], SchedulerCore]:
    model = copying(3, VOCAB, every=4)  # copies itself: drafts are proposed, some right, some wrong
    core, runner = make(lltok, model=model, **kw)
    for r in reqs:
        core.add_request(r)
    out = drive(core, runner, overlap=kw.get("overlap", True))
    core.check_idle()
    return out, core


def test_json_outputs_validate_and_are_identical_across_overlap_speculation_and_retract(lltok, tok):
    want, core = run(lltok, workload(), overlap=False)
    assert len(want) == 12
    for i in range(12):
        jsonschema.validate(json.loads(text(tok, want[f"r{i}"])), SCHEMAS[i % len(SCHEMAS)])
    assert core.stats.grammar_steps > 0
    assert run(lltok, workload(), overlap=True)[0] == want
    spec_out, spec_core = run(lltok, workload(), overlap=True, spec=True)
    assert spec_out == want
    hist = spec_core.stats.spec_accept_histogram
    assert sum(hist[1:]) > 0  # drafts the grammar allowed were accepted (the runner checks each one's mask)
    tight_out, tight = run(lltok, workload(), overlap=True, spec=True, num_pages=40, new_token_ratio_init=0.05,
                           new_token_ratio_min=0.01)  # fmt: skip
    assert tight.stats.num_retracted > 0  # retracted requests resume with their matchers where they were
    assert tight_out == want


def test_untrimmed_drafts_would_leave_the_grammar(lltok, monkeypatch):
    """The workload above proposes drafts the grammar refuses: without trimming, a verify round
    would carry them (the fake runner checks every draft against its position's mask)."""
    from ringserve.actors.scheduler.grammar import ReqGrammar

    monkeypatch.setattr(ReqGrammar, "valid_drafts", lambda self, drafts: len(drafts))
    with pytest.raises(AssertionError, match="outside the grammar"):
        run(lltok, workload(), overlap=True, spec=True)


def test_eos_only_where_the_grammar_allows(lltok, tok):
    core, runner = make(lltok, model=lambda ctx, v: EOS)  # the model wants to stop at once
    core.add_request(req("a", [5, 6, 7], regex="[a-c]{2,6}"))
    ids = drive(core, runner, overlap=True)["a"]
    assert ids[-1] == EOS and EOS not in ids[:-1]
    assert re.fullmatch("[a-c]{2,6}", text(tok, ids))
    # EOS came the first moment the grammar allowed it: no shorter output matched
    assert not any(re.fullmatch("[a-c]{2,6}", text(tok, ids[:k])) for k in range(1, len(ids) - 1))
    assert core.by_rid == {}


def test_a_stopped_matcher_finishes_its_request(lltok, tok):
    core, runner = make(lltok)
    core.add_request(req("a", [9, 10, 11], max_new=50, regex="(yes|no)"))
    outs = []
    for _ in range(100):
        b = core.get_next_batch()
        if b is None and core.compiling:
            core.grammars.cache[("regex", "(yes|no)")].result(timeout=10)
            continue
        outs += core.process_result(b, runner.run(b))
        if outs and outs[-1].finished:
            break
    r = outs[-1].req
    assert text(tok, r.output_ids) in ("yes", "no") and EOS not in r.output_ids
    assert r.finish_reason.type == "stop" and r.finish_reason.matched == r.output_ids[-1]


def test_a_request_waiting_for_its_grammar_blocks_nobody(lltok, monkeypatch):
    core, runner = make(lltok)
    gate = threading.Event()
    compile_ = core.grammars._compile
    monkeypatch.setattr(core.grammars, "_compile", lambda key: (gate.wait(10), compile_(key))[1])
    core.add_request(req("slow", [1, 2, 3], json_schema=json.dumps(SCHEMAS[0])))
    core.add_request(req("free", [4, 5, 6], max_new=3))
    b = core.get_next_batch()
    assert [r.req.rid for r in b.rows] == ["free"] and core.compiling and not b.masked
    core.process_result(b, runner.run(b))
    gate.set()
    core.grammars.cache[("json_schema", json.dumps(SCHEMAS[0]))].result(timeout=10)
    b = core.get_next_batch()
    assert sorted(r.req.rid for r in b.rows) == ["slow"] and b.masked  # a prefill batch: free decodes next


def test_a_failed_compile_aborts_only_its_request(lltok, monkeypatch):
    core, runner = make(lltok)
    compile_ = core.grammars._compile

    def fails_once(key):
        if key[1] == "x+":
            raise ValueError("regex does not compile for this model's vocabulary: boom")
        return compile_(key)

    monkeypatch.setattr(core.grammars, "_compile", fails_once)
    core.add_request(req("bad", [1, 2], regex="x+"))
    core.add_request(req("good", [3, 4], max_new=4, regex="[0-9]+"))
    out = drive(core, runner, overlap=True)
    assert set(out) == {"bad", "good"} and out["bad"] == [] and len(out["good"]) == 4 and core.idle
    assert ("regex", "x+") not in core.grammars.cache  # dropped: a later request compiles it again


def test_failed_compile_reason_reaches_the_output(lltok, monkeypatch):
    core, _ = make(lltok)
    monkeypatch.setattr(core.grammars, "_compile", lambda key: (_ for _ in ()).throw(ValueError("ebnf: boom")))
    r = req("bad", [1, 2], ebnf='root ::= "a"')
    core.add_request(r)
    r.grammar.compiled.exception(timeout=10)
    [o] = core.grammar_failures()
    assert o.finished and o.req is r and r.finish_reason.type == "abort" and "boom" in r.finish_reason.message


def test_flush_cache_empties_the_grammar_cache(lltok, tok):
    out, core = run(lltok, workload(3))
    assert len(core.grammars.cache) == 3
    assert core.flush_cache()[0] and len(core.grammars.cache) == 0  # sglang-jax #425
    core.add_request(req("again", [7, 8, 9], json_schema=json.dumps(SCHEMAS[1])))
    again = drive(core, FakeRunner(4, VOCAB), overlap=True)["again"]
    jsonschema.validate(json.loads(text(tok, again)), SCHEMAS[1])


def test_pause_retract_and_abort_keep_matchers_with_their_tokens(lltok):
    want, _ = run(lltok, workload(6))
    core, runner = make(lltok, model=copying(3, VOCAB, every=4))
    reqs = workload(6)
    for r in reqs:
        core.add_request(r)
    out: dict[str, list[int]] = {}
    steps = 0
    while not core.idle:
        if core.compiling:
            for f in list(core.grammars.cache.values()):
                f.exception(timeout=10)
        b = core.get_next_batch()
        if b is not None:
            for o in core.process_result(b, runner.run(b)):
                out.setdefault(o.req.rid, []).extend(o.new_ids)
        steps += 1
        if steps in (5, 9):  # retract everything twice mid-run (RL weight sync)
            core.pause("retract")
            assert all(r.grammar.consumed == len(r.output_ids) for r in reqs if not r.finished)
            core.resume()
        if steps == 7:
            aborted = core.abort("r5")
    assert out == {**want, "r5": out["r5"]} and aborted[0].req.finish_reason.type == "abort"
    assert out["r5"] == want["r5"][: len(out["r5"])] and len(out["r5"]) < len(want["r5"])
