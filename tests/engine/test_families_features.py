"""The engine's features on every family issue 66 added (Gemma 2, Gemma 3, Qwen3-MoE, Qwen2-MoE,
Mixtral), through every process: one deterministic engine per family (module-scoped, so one runs
at a time), its tiny seed-0 checkpoint, and a seed-1 checkpoint of the same family as the weights
an update brings. Per family:

- greedy tokens equal HF transformers' (prompts past Gemma's window of 24, chunks of 32);
- a session: two turns, the second extending the first's kept KV (only its new tokens computed),
  equal the same conversation sent whole without a session; closing it frees the KV;
- structured outputs: a JSON schema (greedy and seeded) parses and validates, a regex matches;
- weights from disk, then from tensors: the seed-1 checkpoint's HF greedy tokens, then back to
  seed 0's (HF's tensor names: Gemma's norms are stored as w and scaled by (1 + w) at run
  time; a mixture of experts' per-expert tensors go into its [E, ...] leaves);
- the deterministic mode: a seeded request's tokens and logprob bits are the same alone, among
  other requests, and after a prefix of it was cached under another chunk split;
- (slow, one Gemma and one mixture of experts) a trainer's update group broadcasts the seed-1
  checkpoint (tests/engine/test_update_group.py's `Trainer`).

The `engine` fixture checks the KV books and that every page and slot is back after each test.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests.engine.conftest import SMALL, assert_no_leak, random_prompts
from tests.hf_ref import hf_greedy

FAMILIES = ["gemma2", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral"]
# 8 rows and extends of 128 tokens: the fewest programs to compile (each family compiles its own)
KW = dict(SMALL, max_running_requests=8, max_prefill_tokens=128, page_size=16, chunked_prefill_size=32,
          enable_deterministic_inference=True, constrained_json_disable_any_whitespace=True)  # fmt: skip
MAX_NEW = 10
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": MAX_NEW}
SEEDED = {
    "temperature": 0.9,
    "top_p": 0.95,
    "sampling_seed": 17,
    "ignore_eos": True,
    "max_new_tokens": MAX_NEW,
}
PROMPTS = random_prompts(3, seed=81, lo=20, hi=70)  # past the window of 24, chunked at 32
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}  # fmt: skip
REGEX = r"(yes|no)-[0-9]{2,4}"


@dataclasses.dataclass
class Served:
    family: str
    seed0: Path
    seed1: Path
    engine: object
    want: dict  # HF greedy tokens of PROMPTS: {0: seed 0's, 1: seed 1's}


# each engine compiles for a minute on 2 cores: CI's fast run (RINGSERVE_FAST=1) keeps Gemma 3, CI
# adds Qwen3-MoE, the sweep (RINGSERVE_SWEEP=1) the other three
MARKS = {"gemma3": (), "qwen3_moe": (pytest.mark.slow,)}


@pytest.fixture(scope="module", params=[pytest.param(f, marks=MARKS.get(f, (pytest.mark.sweep,))) for f in FAMILIES])
def served(request, tiny_dir, tmp_path_factory):
    from ringserve import Engine
    from ringserve.model.checkpoints.tiny import make_tiny_model

    family = request.param
    seed0 = tiny_dir(family)
    seed1 = make_tiny_model(tmp_path_factory.mktemp(f"seed1-{family}"), family, seed=1)
    want = {0: hf_greedy(seed0, PROMPTS, MAX_NEW), 1: hf_greedy(seed1, PROMPTS, MAX_NEW)}
    assert want[0] != want[1]
    engine = Engine(str(seed0), **KW)
    yield Served(family, seed0, seed1, engine, want)
    engine.shutdown()


@pytest.fixture
def engine(served):
    yield served.engine
    served.engine.continue_generation()
    assert_no_leak(served.engine)


def greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_greedy_equals_hf(served, engine):
    assert greedy(engine) == served.want[0]


def test_a_sessions_second_turn_extends_the_first_turns_kv(engine):
    first, second = random_prompts(2, seed=82, lo=10, hi=40)
    assert engine.flush_cache()["success"]
    ref1 = engine.generate(input_ids=first, sampling_params=GREEDY)["output_ids"]
    ref2 = engine.generate(input_ids=first + ref1 + second, sampling_params=GREEDY)["output_ids"]
    assert engine.flush_cache()["success"]  # nothing cached but what the session keeps
    sid = engine.open_session(capacity_of_str_len=4096)
    t1 = engine.generate(input_ids=first, sampling_params=GREEDY, session_params={"id": sid})
    t2 = engine.generate(input_ids=second, sampling_params=GREEDY,
                         session_params={"id": sid, "rid": t1["meta_info"]["id"]})  # fmt: skip
    assert [t1["output_ids"], t2["output_ids"]] == [ref1, ref2]
    assert t2["meta_info"]["prompt_tokens"] == len(first) + MAX_NEW + len(second)
    assert t2["meta_info"]["cached_tokens"] == len(first) + MAX_NEW  # the kept KV, not recomputed
    assert engine.get_server_info()["sessions_keeping_kv"] == 1
    engine.close_session(sid)
    assert engine.get_server_info()["sessions_keeping_kv"] == 0


def test_structured_outputs_parse_and_match(engine):
    prompts = random_prompts(4, seed=83, lo=4, hi=40)
    sps = [{"json_schema": json.dumps(SCHEMA), "max_new_tokens": 64, "temperature": 0},
           {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 64, "temperature": 0.8, "sampling_seed": 5},
           {"regex": REGEX, "max_new_tokens": 16, "temperature": 0},
           {"regex": REGEX, "max_new_tokens": 16, "temperature": 0.8, "sampling_seed": 6}]  # fmt: skip
    outs = engine.generate(input_ids=prompts, sampling_params=sps)
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o  # the grammar ended it, not the length
    for o in outs[:2]:
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
    for o in outs[2:]:
        assert re.fullmatch(REGEX, o["text"]), o["text"]


def update_and_back(served, engine, to, back) -> None:
    """`to()` serves seed 1 (HF's tokens for it), `back()` seed 0 again."""
    for update, seed in ((to, 1), (back, 0)):
        r = update()
        assert r["success"], r
        assert engine.flush_cache()["success"]
        assert greedy(engine) == served.want[seed], seed


def test_weights_from_disk(served, engine):
    update_and_back(served, engine, lambda: engine.update_weights_from_disk(str(served.seed1)),
                    lambda: engine.update_weights_from_disk(str(served.seed0)))  # fmt: skip


def test_weights_from_tensors(served, engine):
    from ringserve.model.checkpoints.load import load_checkpoint

    new, old = (load_checkpoint(p)[1] for p in (served.seed1, served.seed0))
    update_and_back(served, engine, lambda: engine.update_weights_from_tensor(dict(new), weight_version="seed1"),
                    lambda: engine.update_weights_from_tensor(list(old.items()), bucket_bytes=1 << 20))  # fmt: skip
    assert engine.get_server_info()["weight_version"] != "seed1"


def test_the_deterministic_mode_gives_the_same_bits_whatever_runs_beside(engine):
    targets = random_prompts(2, seed=84, lo=40, hi=90)  # chunked (> 32 tokens)
    others = random_prompts(5, seed=85, lo=2, hi=70)

    def run(prompts):
        outs = engine.generate(input_ids=prompts, sampling_params=SEEDED, return_logprob=True)
        return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]

    assert engine.flush_cache()["success"]
    alone = [run([t])[0] for t in targets]
    assert run(others[:3] + targets + others[3:])[3:5] == alone
    assert engine.flush_cache()["success"]
    engine.generate(
        input_ids=[t[:21] for t in targets], sampling_params={"max_new_tokens": 1}
    )  # another split
    assert run(targets[::-1])[::-1] == alone


@pytest.mark.slow
def test_a_trainers_update_group_broadcasts_the_other_checkpoint(served, engine):
    """One Gemma and one mixture of experts (a second process each: the trainer)."""
    from tests.engine.test_update_group import Trainer

    if served.family not in ("gemma3", "qwen3_moe"):
        pytest.skip("the update group runs for Gemma 3 and Qwen3-MoE only (a trainer process each)")
    for ck, seed in ((served.seed1, 1), (served.seed0, 0)):
        t = Trainer(2, f"g-{served.family}-{seed}", ck)
        try:
            assert t.join(engine.init_weights_update_group)["success"]
            r = t.send(engine.update_weights_from_distributed)
            assert r["success"], r
        finally:
            engine.destroy_weights_update_group(t.group)
            t.quit()
        assert engine.flush_cache()["success"]
        assert greedy(engine) == served.want[seed], seed
