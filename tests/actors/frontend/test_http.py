"""HTTP: SGLang's native /generate and control routes, the OpenAI API through the real `openai`
package, Prometheus /metrics; outputs equal the Engine's."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

GREEDY = {"temperature": 0, "ignore_eos": True}


def sse(r: httpx.Response) -> list:
    events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_native_generate_json_is_sglangs(engine, servers):
    sp = {**GREEDY, "max_new_tokens": 6}
    want = engine.generate(input_ids=[11, 12, 13], sampling_params=sp, return_logprob=True, top_logprobs_num=2)
    r = httpx.post(servers.url + "/generate", json={"input_ids": [11, 12, 13], "sampling_params": sp,
                                                    "return_logprob": True, "top_logprobs_num": 2, "rid": "native-1"})  # fmt: skip
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert out["output_ids"] == want["output_ids"] and out["text"] == want["text"]
    meta = out["meta_info"]
    assert meta["id"] == "native-1" and meta["finish_reason"]["type"] == "length"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 6, 0)
    assert meta["e2e_latency"] > 0
    lps = meta["output_token_logprobs"]  # [logprob, token_id, text-or-null] as SGLang's
    assert [e[1] for e in lps] == out["output_ids"] and all(e[2] is None for e in lps)
    assert lps[0][0] == pytest.approx(want["meta_info"]["output_token_logprobs"][0][0], abs=1e-5)
    assert len(meta["output_top_logprobs"]) == 6 and len(meta["output_top_logprobs"][0]) == 2
    # a batch is a list; the text is kept in the triples on request
    r = httpx.post(servers.url + "/generate", json={"text": ["a b c", "d e"], "sampling_params": sp,
                                                    "return_logprob": True, "return_text_in_logprobs": True})  # fmt: skip
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 2 and all(isinstance(e[2], str) for e in outs[0]["meta_info"]["output_token_logprobs"])


def test_native_streaming_chunks_are_cumulative(engine, servers):
    sp = {**GREEDY, "max_new_tokens": 5}
    want = engine.generate(input_ids=[21, 22], sampling_params=sp)
    body = {"input_ids": [21, 22], "sampling_params": sp, "stream": True}
    # one chunk per token, except where the loop read two outputs before writing (they merge; on
    # a busy machine all five can): up to three tries for a stream of two chunks or more
    for _ in range(3):
        with httpx.stream("POST", servers.url + "/generate", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = sse(r)
        if len(chunks) >= 2:
            break
    assert 2 <= len(chunks) <= 5
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(set(lens)) and lens[-1] == 5
    for k, c in enumerate(chunks):
        assert c["output_ids"] == want["output_ids"][: lens[k]]  # cumulative
        assert (c["meta_info"]["finish_reason"] is None) == (k < len(chunks) - 1)
    assert chunks[-1]["text"] == want["text"] and chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    with httpx.stream("POST", servers.url + "/generate", json={"input_ids": [[1, 2], [3, 4]], "sampling_params": sp, "stream": True}) as r:
        chunks = sse(r)
    assert sorted({c["index"] for c in chunks}) == [0, 1]


def test_control_routes(engine, servers):
    url = servers.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate").status_code == 200
    [load] = httpx.get(url + "/get_load").json()  # SGLang's shape: one entry per dp_rank
    assert (load["dp_rank"], load["num_reqs"], load["num_running_reqs"]) == (0, 0, 0) and load["max_total_num_tokens"] > 0
    assert httpx.get(url + "/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 0
    info = httpx.get(url + "/get_server_info").json()
    assert info["server_args"]["page_size"] == 16 and info["integrity_errors"] == []
    assert httpx.get(url + "/get_model_info").json()["is_generation"] is True
    r = httpx.post(url + "/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.post(url + "/continue_generation", json={}).json()["status"] == "ok"
    r = httpx.post(url + "/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
    # a flush refused while a request holds KV is a 400 with the reason; the request is paused in
    # place first (it keeps its KV), so it cannot finish its tokens before the abort arrives (the
    # tiny model's 200 tokens take well under a second: on a loaded machine they once did)
    with httpx.stream("POST", url + "/generate", json={"input_ids": [5, 6], "stream": True,
                                                       "sampling_params": {**GREEDY, "max_new_tokens": 200}}) as s:  # fmt: skip
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
        r = httpx.get(url + "/flush_cache")
        assert r.status_code == 400 and "hold KV" in r.text
        rid = engine.get_server_info()["running_rids"][0]
        assert httpx.post(url + "/abort_request", json={"rid": rid}).status_code == 200
        assert httpx.post(url + "/continue_generation", json={}).json()["status"] == "ok"
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(chunks[-1]["output_ids"]) < 200
    assert httpx.post(url + "/abort_request", json={"rid": "no-such-request"}).status_code == 200  # ignored


def test_metrics(engine, servers):
    engine.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "max_new_tokens": 3})
    text = httpx.get(servers.url + "/metrics").text
    for name in ("ringserve:num_running_reqs", "ringserve:num_queue_reqs", "ringserve:token_usage",
                 "ringserve:prompt_tokens_total", "ringserve:generation_tokens_total",
                 "ringserve:time_to_first_token_seconds_bucket", "ringserve:inter_token_latency_seconds_bucket",
                 "ringserve:e2e_request_latency_seconds_count"):  # fmt: skip
        assert name in text, name
    gen = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("ringserve:generation_tokens_total"))
    assert gen >= 3

    def load_reports(route: str) -> float:  # (a route never served has no line yet)
        line = f'ringserve:load_reports_total{{route="{route}"}}'
        text = httpx.get(servers.url + "/metrics").text
        return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)

    before = load_reports("/get_load"), load_reports("/v1/loads")
    for _ in range(3):
        httpx.get(servers.url + "/get_load")
    httpx.get(servers.url + "/v1/loads")
    assert (load_reports("/get_load"), load_reports("/v1/loads")) == (before[0] + 3, before[1] + 1)


def test_openai_sdk_completions(engine, servers):
    import openai

    c = openai.OpenAI(base_url=servers.url + "/v1", api_key="unused")
    model = c.models.list().data[0].id
    assert model == engine.served_model_name
    want = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
    r = c.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text == want["text"] and r.object == "text_completion"
    assert r.usage.completion_tokens == want["meta_info"]["completion_tokens"]
    assert r.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    text = "".join(ch.choices[0].text for ch in c.completions.create(model=model, prompt="The capital of France is",
                                                                   max_tokens=8, temperature=0, stream=True))  # fmt: skip
    assert text == want["text"]
    r = c.completions.create(model=model, prompt="Once upon", max_tokens=6, temperature=0.8, n=2, seed=5, logprobs=2)
    assert len(r.choices) == 2 and {ch.index for ch in r.choices} == {0, 1}
    assert len(r.choices[0].logprobs.tokens) == 6 and len(r.choices[0].logprobs.top_logprobs[0]) == 2
    again = c.completions.create(model=model, prompt="Once upon", max_tokens=6, temperature=0.8, n=2, seed=5)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # seeded: reproducible
    stop = want["text"][3:6]
    r = c.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.choices[0].text == want["text"][: want["text"].find(stop)]


def test_openai_sdk_chat_completions(engine, servers):
    import openai

    c = openai.OpenAI(base_url=servers.url + "/v1", api_key="unused")
    model = engine.served_model_name
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    want = engine.generate(input_ids=engine.tokenizer.encode(prompt, add_special_tokens=False),
                           sampling_params={"temperature": 0, "max_new_tokens": 10})  # fmt: skip
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want["text"]
    assert len(r.choices[0].logprobs.content) == 10 and len(r.choices[0].logprobs.content[0].top_logprobs) == 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = c.chat.completions.create(model=model, messages=msgs, max_completion_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    parts, finish, usage = [], None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == want["text"] and finish == "length" and usage.completion_tokens == 10
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=1.0, n=2, seed=3)
    assert len(r.choices) == 2


def test_openai_continuous_usage_stats_count_every_chunks_tokens(engine, servers):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, so a
    client can tell how many tokens a chunk holds; without it only the last chunk has usage."""
    body = {"model": engine.served_model_name, "prompt": "a b c", "max_tokens": 9, "temperature": 0, "stream": True,
            "ignore_eos": True, "n": 2, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", servers.url + "/v1/completions", json=body) as r:
        chunks = sse(r)
    usages = [c["usage"] for c in chunks]
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 18 and len({u["prompt_tokens"] for u in usages}) == 1
    texts = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(texts) >= 2 and done[0] >= 1  # (the count includes the chunk it rides on)
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", servers.url + "/v1/completions", json=body) as r:
        chunks = sse(r)
    assert [c.get("usage") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_openai_errors_are_openai_shaped(servers):
    import openai

    c = openai.OpenAI(base_url=servers.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=servers.engine.served_model_name, prompt="hi", max_tokens=4, temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-17", prompt="hi", max_tokens=4)


def test_penalties_and_min_tokens_on_every_route(engine, servers):
    """RL frameworks send SGLang's penalties on every request (verl: repetition_penalty=1.0): at
    the values that change nothing they are served as without them; other values in range are
    applied alike on every route (the same tokens as the Engine's); out of range is a 400 naming
    the field and the range."""
    sp = {**GREEDY, "max_new_tokens": 5}
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0, "min_new_tokens": 0}
    want = engine.generate(input_ids=[11, 12, 13], sampling_params=sp)["output_ids"]
    assert engine.generate(input_ids=[11, 12, 13], sampling_params={**sp, **neutral})["output_ids"] == want
    r = httpx.post(servers.url + "/generate", json={"input_ids": [11, 12, 13], "sampling_params": {**sp, **neutral}})
    assert r.status_code == 200 and r.json()["output_ids"] == want
    r = httpx.post(servers.url + "/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 5, **GREEDY,
                                                          "repetition_penalty": 1.0, "min_tokens": 0})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    # in effect: a strong repetition penalty over a prompt of one repeated token
    hot = {**GREEDY, "max_new_tokens": 8, "ignore_eos": True, "repetition_penalty": 2.0, "frequency_penalty": 1.5}
    pen = engine.generate(input_ids=[11] * 6, sampling_params=hot)["output_ids"]
    plain = engine.generate(input_ids=[11] * 6, sampling_params={**hot, **neutral})["output_ids"]
    assert pen != plain and len(pen) == 8
    r = httpx.post(servers.url + "/generate", json={"input_ids": [11] * 6, "sampling_params": hot})
    assert r.status_code == 200 and r.json()["output_ids"] == pen
    r = httpx.post(servers.url + "/v1/completions", json={"prompt": [11] * 6, "max_tokens": 8, "ignore_eos": True,
                                                          **GREEDY, "repetition_penalty": 2.0,
                                                          "frequency_penalty": 1.5, "logprobs": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    for route, body, field in [
        ("/generate", {"input_ids": [11], "sampling_params": {"repetition_penalty": 2.1}}, "repetition_penalty=2.1 must be in (0, 2]"),
        ("/generate", {"input_ids": [11], "sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}},
         "min_new_tokens=3 must be in [0, max_new_tokens=2]"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens=9 must be in [0, max_tokens=4]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -2.5},
         "frequency_penalty=-2.5 must be in [-2, 2]"),
    ]:  # fmt: skip
        r = httpx.post(servers.url + route, json=body)
        assert r.status_code == 400 and field in r.text, (route, r.text)
    with pytest.raises(ValueError, match=r"presence_penalty=2.5 must be in \[-2, 2\]"):
        engine.generate(input_ids=[11], sampling_params={"presence_penalty": 2.5})


def test_sessions_over_http_and_the_client(engine, servers, client):
    sp = {**GREEDY, "max_new_tokens": 6}
    sid = httpx.post(servers.url + "/open_session", json={"capacity_of_str_len": 1000}).json()
    assert isinstance(sid, str) and sid
    r1 = httpx.post(servers.url + "/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": sp,
                                                     "session_params": {"id": sid}}).json()  # fmt: skip
    r2 = httpx.post(servers.url + "/generate", json={"input_ids": [9, 10], "sampling_params": sp,
                                                     "session_params": {"id": sid, "rid": r1["meta_info"]["id"]}}).json()  # fmt: skip
    want = engine.generate(input_ids=[5, 6, 7, 8] + r1["output_ids"] + [9, 10], sampling_params=sp)
    assert r2["output_ids"] == want["output_ids"] and r2["meta_info"]["cached_tokens"] >= 8
    bad = httpx.post(servers.url + "/generate", json={"input_ids": [1], "session_params": {"id": "nope"}})
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    assert httpx.post(servers.url + "/close_session", json={"session_id": sid}).status_code == 200
    sid2 = client.open_session(session_id="from-the-client")
    out = client.generate(input_ids=[5, 6], sampling_params=sp, session_params={"id": sid2})
    assert out["output_ids"] == engine.generate(input_ids=[5, 6], sampling_params=sp)["output_ids"]
    client.close_session(sid2)


def test_generate_body_builds_the_generate_args():
    """/generate's body decodes into GenerateBody and yields the GenerateArgs every surface
    builds; input_ids win over text (as SGLang); fields served only at their default refuse."""
    import msgspec

    from ringserve.actors.frontend.http_server import GenerateBody
    from ringserve.actors.frontend.inputs import GenerateArgs

    body = b'{"text": "a", "input_ids": [1, 2], "rid": "r", "stream": true, "logprob_start_len": -1}'
    args = msgspec.json.decode(body, type=GenerateBody).args()
    assert type(args) is GenerateArgs and args == GenerateArgs(input_ids=[1, 2], rid="r", stream=True)
    # prompt logprobs are served (issue 27): they pass into GenerateArgs (checked there)
    body = b'{"text": "a", "logprob_start_len": [0], "token_ids_logprob": [3]}'
    args = msgspec.json.decode(body, type=GenerateBody).args()
    assert args == GenerateArgs(text="a", logprob_start_len=[0], token_ids_logprob=[3])
    # LoRA adapters are served (issue 27): lora_path passes into GenerateArgs (checked there)
    args = msgspec.json.decode(b'{"text": "a", "lora_path": ["x", null]}', type=GenerateBody).args()
    assert args == GenerateArgs(text="a", lora_path=["x", None])
    for bad, message in [(b'{"text": "a", "image_data": "x"}', "image_data is not supported by ringserve"),
                         (b'{"text": "a", "custom_logit_processor": "f"}', "custom_logit_processor is not supported")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            msgspec.json.decode(bad, type=GenerateBody).args()


def test_chat_roles_are_openais(engine, servers):
    """system, user, assistant, tool and developer are served (developer is OpenAI's newer name
    for system: the template sees system); a tool message may carry its tool_call_id."""
    sp = {"temperature": 0, "max_tokens": 3}
    url = servers.url + "/v1/chat/completions"

    def ask(messages: list[dict]) -> dict:
        r = httpx.post(url, json={"messages": messages, **sp})
        assert r.status_code == 200, r.text
        return r.json()

    for role in ("system", "user", "assistant", "tool", "developer"):
        ask([{"role": role, "content": "a"}])
    ask([{"role": "user", "content": "a"}, {"role": "tool", "content": "42", "tool_call_id": "call-1"}])
    as_system = ask([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    as_developer = ask([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert as_developer["choices"][0]["message"] == as_system["choices"][0]["message"]
    assert as_developer["usage"] == as_system["usage"]


def test_a_chat_template_that_refuses_the_messages_is_a_400_naming_them():
    import jinja2

    from ringserve.actors.frontend.openai_api import ChatMessage, ChatRequest, chat_args

    def render(messages: list[dict]) -> list[int]:
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    r = ChatRequest(messages=[msgspec.convert({"role": "user", "content": "a"}, type=ChatMessage)] * 2)
    with pytest.raises(ValueError, match="messages: the model's chat template refused them: Conversation roles"):
        chat_args(r, render)
