"""Speculative decoding (n-gram drafts, verify rounds on the device) through the engine: greedy
and seeded outputs equal non-speculative decoding token for token, with overlap, under KV
pressure (retract), across pause/abort/flush and sessions; and seed 001's case table: a
streaming session whose turns finish exactly on an accepted run or inside one, with the
postcondition on what the session keeps after every turn."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.engine.conftest import (
    SMALL,
    assert_no_leak,
    assert_same_rl_outputs,
    engine_ctx,
    in_background,
    random_prompts,
)

K = 3
SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=K)
GREEDY = {"temperature": 0, "ignore_eos": True}


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts and prompts that repeat a phrase (what n-gram drafts are for)."""
    rng = np.random.default_rng(seed)
    out = random_prompts(n // 2, seed, lo=2, hi=50)
    for _ in range(n - len(out)):
        phrase = rng.integers(3, 2000, int(rng.integers(2, 8))).tolist()
        out.append((phrase * 12)[: int(rng.integers(len(phrase) + 1, 60))])
    return out


@pytest.fixture(scope="module")
def spec_engine(tiny_llama):
    """Speculation on, overlap on, a KV pool small enough that 64 requests retract."""
    from ringserve import Engine

    e = Engine(str(tiny_llama), page_size=16, **{**SMALL, "max_total_tokens": 16 * 24}, **SPEC)
    yield e
    e.shutdown()


@pytest.fixture
def spec(spec_engine):
    yield spec_engine
    spec_engine.continue_generation()
    assert_no_leak(spec_engine)


def test_spec_on_equals_off_on_64_mixed_prompts_greedy_and_seeded(spec, shared_engine):
    prompts = mixed_prompts(64, seed=3)
    lens = np.random.default_rng(4).integers(8, 48, 64).tolist()
    greedy = [{**GREEDY, "max_new_tokens": k} for k in lens]
    want = [o["output_ids"] for o in shared_engine.generate(input_ids=prompts, sampling_params=greedy)]
    before = spec.get_server_info()
    got = spec.generate(input_ids=prompts, sampling_params=greedy)
    assert [o["output_ids"] for o in got] == want
    info = spec.get_server_info()
    assert info["num_retracted"] > before["num_retracted"]  # the small pool made it retract
    assert info["avg_spec_accept_length"] > 1.0 and sum(info["spec_accept_histogram"][1:]) > 0
    m = got[-1]["meta_info"]
    assert m["spec_verify_ct"] > 0 and m["spec_draft_token_num"] == K * m["spec_verify_ct"]
    # seeded sampling: a target is drawn at its own position from the request's seed, so the
    # speculative run samples the very tokens plain decoding does
    seeded = [{"temperature": 0.9, "top_k": 40, "top_p": 0.95, "sampling_seed": 100 + i, "ignore_eos": True,
               "max_new_tokens": 24} for i in range(16)]  # fmt: skip
    want = [o["output_ids"] for o in shared_engine.generate(input_ids=prompts[:16], sampling_params=seeded)]
    assert [o["output_ids"] for o in spec.generate(input_ids=prompts[:16], sampling_params=seeded)] == want
    assert [o["output_ids"] for o in spec.generate(input_ids=prompts[:16], sampling_params=seeded)] == want


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_pause_modes_abort_and_flush_with_speculation(spec, shared_engine, mode):
    prompts = mixed_prompts(8, seed=9)
    want = [
        o["output_ids"]
        for o in shared_engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 40})
    ]
    t, box = in_background(spec, prompts, 40)
    spec.pause_generation(mode=mode)
    if mode != "abort":
        spec.flush_cache()  # refused while requests hold KV; must not break them
    spec.continue_generation()
    t.join(120)
    assert "err" not in box, box.get("err")
    outs = box["out"]
    if mode == "abort":
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
        for o, w in zip(outs, want, strict=True):
            assert o["output_ids"] == w[: len(o["output_ids"])]
    else:
        assert [o["output_ids"] for o in outs] == want
    assert spec.flush_cache()["success"]


def test_sessions_with_speculation_equal_the_concatenated_runs(spec, shared_engine):
    turns = mixed_prompts(5, seed=12)
    sp = {**GREEDY, "max_new_tokens": 13}
    ctx, want = [], []
    for t in turns:
        o = shared_engine.generate(input_ids=ctx + t, sampling_params=sp)["output_ids"]
        want.append(o)
        ctx = ctx + t + o
    sid = spec.open_session()
    prev, got = None, []
    for t in turns:
        o = spec.generate(input_ids=t, sampling_params=sp, session_params={"id": sid, "rid": prev})
        prev = o["meta_info"]["id"]
        got.append(o["output_ids"])
    assert got == want
    spec.close_session(sid)


@pytest.fixture(scope="module")
def constant_model(tmp_path_factory, tiny_llama):
    """The tiny checkpoint with its final norm zeroed: every logit is 0, so greedy always picks
    token 0, and once the context ends "0 0" every n-gram draft is right. A round then yields
    k + 1 tokens, which places each finish exactly on an accepted run or inside one."""
    import shutil

    d = tmp_path_factory.mktemp("constant")
    for f in tiny_llama.iterdir():
        shutil.copy(f, d / f.name)
    w = load_file(str(d / "model.safetensors"))
    w["model.norm.weight"] = np.zeros_like(w["model.norm.weight"])
    save_file(w, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_seed_001_case_table_through_the_engine(constant_model, page, overlap):
    """Turn outputs are 0s, and once the context holds a "0" the drafts continue it, so rounds
    yield k + 1 tokens: with max_new_tokens running through every residue mod k + 1, turns
    finish exactly at the end of an accepted run and inside one (1..k-1 accepted tokens
    dropped). After every turn the session keeps committed_len == origin_len + finished_len (one
    less when the last token's KV was never written), allocated_len <= that, and the next turn's
    cached prefix never goes past it. Outputs equal the non-speculative run (every token 0)."""
    with engine_ctx(constant_model, page_size=page, disable_overlap_schedule=not overlap, **SPEC) as e:
        sid = e.open_session()
        prev, prev_T, dropped, seen = None, 0, 0, set()
        turns = [[5, 6, 7, 8, 9, 10, 11], [21, 22, 23], [31, 32], [41, 42, 43, 44], [51], [61, 62]]
        for i, t in enumerate(turns):
            max_new = 9 + i
            o = e.generate(input_ids=t, sampling_params={**GREEDY, "max_new_tokens": max_new},
                           session_params={"id": sid, "rid": prev})  # fmt: skip
            m = o["meta_info"]
            assert o["output_ids"] == [0] * max_new and m["completion_tokens"] == max_new
            T = m["prompt_tokens"] + m["completion_tokens"]  # origin_len + finished_len
            info = e.get_server_info()
            kept = info["kept_sessions"][sid]
            assert kept["committed_len"] in (T - 1, T), (kept, T)
            assert kept["allocated_len"] <= T and kept["pages"] == -(-kept["allocated_len"] // page), (
                kept,
                T,
            )
            if i:
                assert prev_T - 1 - page <= m["cached_tokens"] <= prev_T  # reused the kept KV, never past it
            assert m["spec_verify_ct"] >= 2 and m["spec_accept_length"] > 1.5
            over = info["spec_dropped_tokens"] - dropped
            assert 0 <= over <= K, over  # a round yields at most k + 1 tokens
            seen.add(over > 0)
            dropped = info["spec_dropped_tokens"]
            assert info["integrity_errors"] == []
            prev, prev_T = m["id"], T
        assert seen == {True, False}, "every turn finished the same way: the table was not covered"
        e.close_session(sid)


def test_penalties_min_new_tokens_bias_and_sampling_masks_equal_non_speculative(spec, shared_engine):
    """A verify round's drafts count as output before the samples after them: the penalties'
    counts, min_new_tokens' positions and the masks are the non-speculative ones."""
    assert_same_rl_outputs(spec, shared_engine, mixed_prompts(6, seed=67), 24)
    assert spec.get_server_info()["avg_spec_accept_length"] > 1.0
