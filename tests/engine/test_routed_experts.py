"""Routing replay (`return_routed_experts`, SGLang's): every returned position's expert ids are
the top-k of HF's router (`output_router_logits=True`, softmax then top-k per MoE layer) over
the same tokens, on a tiny Qwen3-MoE: prompts from routed_experts_start_len and every generated
token but the last, with overlap on (chunked prefill of 16, n-gram speculation) and off
(multi-step decode), a cached prompt computed again, a retraction mid-decode, and over HTTP
/generate."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ringserve.actors.transport import routed
from ringserve.actors.transport.routed import decode
from tests.engine.conftest import SMALL, assert_no_leak, random_prompts

LAYERS, TOPK = 4, 2  # the tiny Qwen3-MoE's (model/families/qwen3_moe.py `Tiny`)
GREEDY = {"temperature": 0, "ignore_eos": True}
SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=3)


@pytest.fixture(scope="module")
def tiny_moe(tiny_dir):
    return tiny_dir("qwen3_moe")


@pytest.fixture(scope="module")
def overlap(tiny_moe):
    """Overlap on, prefill in chunks of 16, n-gram speculation."""
    from ringserve import Engine

    e = Engine(str(tiny_moe), page_size=16, chunked_prefill_size=16, enable_return_routed_experts=True,
               **SMALL, **SPEC)  # fmt: skip
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def plain(tiny_moe):
    """Overlap off, no speculation, prompts whole, multi-step decode (4 steps a program)."""
    from ringserve import Engine

    e = Engine(str(tiny_moe), page_size=16, disable_overlap_schedule=True, enable_return_routed_experts=True,
               decode_steps=4, decode_steps_max_batch=4, **SMALL)  # fmt: skip
    yield e
    e.shutdown()


@pytest.fixture(params=["overlap", "plain"])
def engine(request):
    e = request.getfixturevalue(request.param)
    yield e
    e.continue_generation()
    assert_no_leak(e)


def hf_routes(path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF's routing of every position of `tokens`: the top-k expert ids [T, L, k] (the router's
    softmax, largest first) and the gap between the k-th and the (k+1)-th probability [T, L]."""
    import torch

    from tests.hf_ref import hf_model

    with torch.no_grad():
        out = hf_model(str(path))(torch.tensor([tokens]), output_router_logits=True)
    probs = np.stack([torch.softmax(r.float(), -1).numpy() for r in out.router_logits], axis=1)  # [T, L, E]
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranked = np.take_along_axis(probs, order, axis=-1)
    return order[..., :TOPK], ranked[..., TOPK - 1] - ranked[..., TOPK]


def assert_routes(path, prompt: list[int], out: dict, start: int = 0) -> None:
    """`out`'s routed experts are HF's top-k at positions [start, prompt + output - 1). A position
    where HF's k-th and (k+1)-th experts are within f32 noise (1e-5) is compared as sets less the
    tied ones: two computations in f32 may order those either way."""
    tokens = prompt + out["output_ids"]
    got = decode(out["meta_info"]["routed_experts"], LAYERS, TOPK)
    assert got.shape == (len(tokens) - 1 - start, LAYERS, TOPK)
    want, gap = hf_routes(path, tokens[:-1])
    want, gap = want[start:], gap[start:]
    clear = gap > 1e-5
    np.testing.assert_array_equal(got[clear], want[clear])
    assert (got[~clear][:, : TOPK - 1] == want[~clear][:, : TOPK - 1]).all()


def mixed_prompts() -> list[list[int]]:
    """Random prompts (some longer than a chunk) and one that repeats a phrase (n-gram drafts)."""
    phrase = [11, 12, 13, 14, 15]
    return random_prompts(4, seed=91, lo=3, hi=60) + [(phrase * 10)[:37]]


def test_routed_experts_are_hfs_top_k_at_every_position(engine, tiny_moe):
    prompts = mixed_prompts()
    starts = [0, 2, 0, 1, 5]
    sps = [{**GREEDY, "max_new_tokens": n} for n in (9, 4, 12, 1, 16)]
    outs = engine.generate(input_ids=prompts, sampling_params=sps, return_routed_experts=[True] * 4 + [True],
                           routed_experts_start_len=starts)  # fmt: skip
    for p, o, s in zip(prompts, outs, starts, strict=True):
        assert_routes(tiny_moe, p, o, s)
    if "spec_verify_ct" in outs[0]["meta_info"]:  # speculation: verify rounds accepted drafts
        assert sum(o["meta_info"].get("spec_accept_token_num", 0) for o in outs) > 0
    # a request that does not ask gets none, and the same tokens
    again = engine.generate(input_ids=prompts[0], sampling_params=sps[0])
    assert "routed_experts" not in again["meta_info"] and again["output_ids"] == outs[0]["output_ids"]


def test_a_cached_prompt_is_computed_again(engine, tiny_moe):
    p = random_prompts(1, seed=92, lo=40, hi=41)[0]
    sp = {**GREEDY, "max_new_tokens": 5}
    first = engine.generate(input_ids=p, sampling_params=sp)  # the prompt is in the prefix cache now
    assert first["meta_info"]["cached_tokens"] == 0
    out = engine.generate(input_ids=p, sampling_params=sp, return_routed_experts=True, routed_experts_start_len=20)
    assert out["output_ids"] == first["output_ids"]
    assert out["meta_info"]["cached_tokens"] == 16  # the prefix before position 20, in whole pages
    assert_routes(tiny_moe, p, out, 20)


def test_retracted_requests_return_the_routing_their_tokens_came_from(engine, tiny_moe):
    prompts = random_prompts(3, seed=93, lo=10, hi=40)
    sp = {**GREEDY, "max_new_tokens": 60}
    box: dict = {}
    info = engine.get_server_info()
    base, retracted = info["forward_ct_decode"], info["num_retracted"]

    def go():
        box["out"] = engine.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True)

    t = threading.Thread(target=go)
    t.start()
    while engine.get_server_info()["forward_ct_decode"] < base + 5 and t.is_alive():
        pass
    assert engine.pause_generation("retract")["success"]
    engine.continue_generation()
    t.join(120)
    info = engine.get_server_info()
    assert info["num_retracted"] - retracted == len(prompts)  # each was, mid-decode
    if "spec_verify_ct" not in box["out"][0]["meta_info"]:  # multi-step decode: 4 tokens a batch
        assert info["forward_ct_decode"] - base < 30
    for p, o in zip(prompts, box["out"], strict=True):
        assert len(o["output_ids"]) == 60
        assert_routes(tiny_moe, p, o)


def test_the_server_flag_and_the_start_are_checked(overlap, shared_engine):
    p = [5, 6, 7]
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        shared_engine.generate(input_ids=p, sampling_params=GREEDY, return_routed_experts=True)
    with pytest.raises(ValueError, match="routed_experts_start_len=4: past the prompt's 3 tokens"):
        overlap.generate(input_ids=p, sampling_params=GREEDY, return_routed_experts=True, routed_experts_start_len=4)


def test_a_dense_model_is_refused(tiny_dir):
    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

    with pytest.raises(ValueError, match="enable_return_routed_experts: llama has no mixture-of-experts layers"):
        ModelExecutor(tiny_dir("llama"), ExecutorConfig(routed_experts=True, precompile=False))


def test_over_http_generate_and_the_client(overlap, tiny_moe):
    """SGLang's body and meta_info over HTTP: base64 of int32, what slime decodes; the same from
    the Client (last: Servers stops the module's engine)."""
    import base64

    import httpx

    from ringserve import Client, Servers

    p = random_prompts(1, seed=94, lo=20, hi=21)[0]
    body = {"input_ids": p, "sampling_params": {**GREEDY, "max_new_tokens": 6}, "return_routed_experts": True,
            "return_logprob": True}  # fmt: skip
    with Servers(overlap, port=0) as servers:
        r = httpx.post(servers.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        meta = out["meta_info"]
        slime = np.frombuffer(base64.b64decode(meta["routed_experts"].encode("ascii")), dtype=np.int32)
        assert slime.size == (len(p) + len(out["output_ids"]) - 1) * LAYERS * TOPK
        assert_routes(tiny_moe, p, out)
        bad = httpx.post(servers.url + "/generate", json={**body, "routed_experts_start_len": 99}, timeout=60)
        assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
        with Client(servers.socket_path) as c:
            got = c.generate(input_ids=p, sampling_params=body["sampling_params"], return_routed_experts=True,
                             routed_experts_start_len=3)  # fmt: skip
        assert got["output_ids"] == out["output_ids"]
        assert got["meta_info"]["routed_experts"] == routed.encode(decode(meta["routed_experts"], LAYERS, TOPK)[3:])
