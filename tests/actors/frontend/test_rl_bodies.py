"""Request bodies as RL frameworks send them, over HTTP, answered in the fields they read:
slime's and AReaL's /generate (SGLang's), OpenRLHF's vLLM-flavoured /v1/completions, SkyRL's
/inference/v1/generate and vLLM's control routes (/pause?mode=abort|keep|wait, /resume, /sleep,
/wake_up, /reset_prefix_cache, /tokenize, /detokenize, /abort_requests); SGLang's abort_all."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import pytest

from tests.engine.conftest import in_background

PROMPT = [11, 12, 13, 14, 15]


def _i32(meta: dict, key: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta[key]), "<i4")


def test_slime_generate_body(engine, servers):
    """slime/rollout/sglang_rollout.py's sampling parameters (top_p != 1: the sampling mask asked
    in custom_params), read back as slime/utils/types.py reads them."""
    sp = {"temperature": 1.0, "top_p": 0.7, "top_k": -1, "max_new_tokens": 10, "stop": None, "stop_token_ids": None,
          "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False,
          "custom_params": {"return_top_p_token_ids": True}, "sampling_seed": 5}  # fmt: skip
    r = httpx.post(
        servers.url + "/generate", json={"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    n = meta["completion_tokens"]
    assert n == len(out["output_ids"]) == len(meta["output_token_logprobs"]) and meta["finish_reason"][
        "type"
    ] in ("stop", "length")
    ids, offsets = _i32(meta, "top_p_token_ids"), _i32(meta, "top_p_token_offsets")
    assert offsets[0] == 0 and len(offsets) == n + 1 and offsets[-1] == len(ids)
    for i, t in enumerate(out["output_ids"]):
        assert t in ids[offsets[i] : offsets[i + 1]]
    # slime's abort of everything, and its load poll
    assert httpx.post(servers.url + "/abort_request", json={"abort_all": True}).status_code == 200
    assert httpx.get(servers.url + "/v1/loads", params={"include": "core"}).status_code == 200


def test_areal_generate_body(engine, servers):
    """areal/engine/sglang_remote.py's body: image_data [], top_k 1e8, frequency_penalty from its
    config; the reply's Content-Type exactly application/json, finish_reason.type and
    output_token_logprobs read."""
    body = {"input_ids": PROMPT, "image_data": [], "return_logprob": True, "stream": False,
            "sampling_params": {"top_p": 1.0, "top_k": 100000000.0, "max_new_tokens": 8, "temperature": 0.0,
                                "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
                                "frequency_penalty": 0.5}}  # fmt: skip
    r = httpx.post(servers.url + "/generate", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    meta = r.json()["meta_info"]
    assert (
        meta["finish_reason"]["type"] in ("stop", "length")
        and len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    )
    want = engine.generate(input_ids=PROMPT, sampling_params={**body["sampling_params"], "top_k": -1})
    assert r.json()["output_ids"] == want["output_ids"]


def test_openrlhf_completions_body(engine, servers):
    """vLLM's extras on /v1/completions as OpenRLHF's vLLM sampling parameters name them."""
    body = {"prompt": PROMPT, "max_tokens": 6, "min_tokens": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
            "skip_special_tokens": False, "include_stop_str_in_output": True, "logprobs": 1, "repetition_penalty": 1.1,
            "presence_penalty": 0.2, "frequency_penalty": 0.1, "logit_bias": {"3": -100}}  # fmt: skip
    r = httpx.post(servers.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert len(c["logprobs"]["tokens"]) == 6 and c["finish_reason"] == "length"
    want = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 0, "repetition_penalty": 1.1,
                                                              "presence_penalty": 0.2, "frequency_penalty": 0.1,
                                                              "logit_bias": {"3": -100}})  # fmt: skip
    assert c["text"] == want["text"]
    r = httpx.post(servers.url + "/v1/completions", json={**body, "presence_penalty": 5})
    assert r.status_code == 400 and "presence_penalty" in r.json()["error"]["message"]


def test_skyrl_generate_and_detokenize(engine, servers):
    """skyrl .../remote_inference_client.py: /inference/v1/generate with engine_utils' vLLM
    sampling parameters (min_tokens 1, include_stop_str_in_output), then /detokenize."""
    sp = {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "max_tokens": 7,
          "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 0, "stop": None}  # fmt: skip
    r = httpx.post(servers.url + "/inference/v1/generate", json={"sampling_params": sp, "model": None, "token_ids": PROMPT,
                                                                 "cache_salt": "run-1"})  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    want = engine.generate(
        input_ids=PROMPT, sampling_params={"max_new_tokens": 7, "temperature": 0}, return_logprob=True
    )
    assert (
        choice["token_ids"] == want["output_ids"]
        and choice["finish_reason"] == want["meta_info"]["finish_reason"]["type"]
    )
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    np.testing.assert_allclose(lps, [e[0] for e in want["meta_info"]["output_token_logprobs"]], atol=1e-5)
    assert all(
        e["top_logprobs"] == [] for e in choice["logprobs"]["content"]
    )  # logprobs 0: the sampled token's only
    d = httpx.post(servers.url + "/detokenize", json={"model": None, "tokens": choice["token_ids"]})
    assert d.json()["prompt"] == engine.tokenizer.decode(choice["token_ids"])
    t = httpx.post(
        servers.url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": True}
    ).json()
    assert t["tokens"] == engine.tokenizer.encode("hello world") and t["count"] == len(t["tokens"])
    # prompt logprobs (vLLM's shape: None, then {token id: {logprob, rank, decoded_token}}) and a stream
    r = httpx.post(servers.url + "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}})  # fmt: skip
    pl = r.json()["prompt_logprobs"]
    assert (
        pl[0] is None
        and len(pl) == len(PROMPT)
        and all(str(t) in row for t, row in zip(PROMPT[1:], pl[1:], strict=True))
    )
    with httpx.stream("POST", servers.url + "/inference/v1/generate", json={"token_ids": PROMPT, "stream": True,
                                                                             "sampling_params": sp}) as s:  # fmt: skip
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert (
        events[-1] == "[DONE]"
        and sum((c["choices"][0]["token_ids"] for c in chunks), []) == want["output_ids"]
    )
    r = httpx.post(
        servers.url + "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"best_of": 2}}
    )
    assert r.status_code == 400 and "best_of" in r.text


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_vllm_pause_modes(engine, servers, mode):
    url = servers.url
    want = engine.generate(
        input_ids=[PROMPT], sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": 200}
    )
    t, box = in_background(engine, [PROMPT], 200)
    r = httpx.post(url + "/pause", params={"mode": mode}, timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
    assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
    if mode == "wait":  # the request in flight finished before the pause took
        t.join(timeout=60)
        assert box["out"][0]["output_ids"] == want[0]["output_ids"]
    time.sleep(0.2)
    assert httpx.post(url + "/resume").json() == {"status": "resumed"}
    t.join(timeout=60)
    out = box["out"][0]
    if mode == "abort":
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["output_ids"] == want[0]["output_ids"][: len(out["output_ids"])]
    else:
        assert out["output_ids"] == want[0]["output_ids"]
    assert httpx.get(url + "/is_paused").json() == {"is_paused": False}


def test_vllm_sleep_wake_reset_and_abort_requests(engine, servers):
    url = servers.url
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
    want = engine.generate(input_ids=PROMPT, sampling_params=sp)
    assert httpx.post(url + "/sleep", params={"level": "1"}).status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    assert httpx.post(url + "/wake_up", params={"tags": "weights"}).status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}  # the KV cache still sleeps
    assert httpx.post(url + "/wake_up").status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.post(url + "/resume").status_code == 200
    assert engine.generate(input_ids=PROMPT, sampling_params=sp)["output_ids"] == want["output_ids"]
    assert httpx.post(url + "/reset_prefix_cache").status_code == 200
    t, box = in_background(engine, [PROMPT], 200)
    assert httpx.post(url + "/reset_prefix_cache", json={"reset_running_requests": True}).status_code == 200
    r = httpx.post(url + "/abort_requests", json={})
    assert r.json()["status"] == "aborted"
    t.join(timeout=60)
    assert box["out"][0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert httpx.post(url + "/sleep", params={"level": "3"}).status_code == 400
    assert httpx.post(url + "/pause", params={"mode": "later"}).status_code == 400


def test_special_tokens_and_stop_strings_as_clients_ask(engine, servers):
    """skip_special_tokens false keeps the EOS's text (slime's setting), true drops it; a stop
    string stays in the text with no_stop_trim (vLLM: include_stop_str_in_output), else the text
    ends before it."""
    eos, eos_text = engine.tokenizer.eos_token_id, engine.tokenizer.eos_token
    sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100}}
    kept = httpx.post(servers.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
        **sp, "skip_special_tokens": False, "spaces_between_special_tokens": False}}).json()  # fmt: skip
    assert kept["output_ids"] == [eos] * 3 and kept["text"].count(eos_text) == 3, kept["text"]
    dropped = httpx.post(servers.url + "/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
    assert eos_text not in dropped["text"]
    free = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    stop = free["text"][3:6]
    assert stop.strip(), free["text"]
    for flag, name in ((True, "no_stop_trim"), (True, "include_stop_str_in_output"), (False, "no_stop_trim")):
        out = httpx.post(servers.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": [stop], name: flag}}).json()  # fmt: skip
        assert (stop in out["text"]) == flag and out["meta_info"]["finish_reason"]["matched"] == stop, (name, out)
