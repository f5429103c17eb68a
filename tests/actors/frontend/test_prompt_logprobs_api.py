"""Prompt logprobs on every surface: the Client and /generate give the Engine's fields (SGLang's
names and shapes), streamed too; OpenAI completions with `echo` + `logprobs` put the prompt's
tokens and logprobs first (its first token's logprob null). Bad values are refused naming the
field."""

from __future__ import annotations

import httpx
import pytest

SP = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 3}
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def test_client_and_generate_route_give_the_engines_prompt_logprobs(engine, servers, client):
    kw = dict(return_logprob=True, logprob_start_len=2, top_logprobs_num=2, token_ids_logprob=[5, 6])
    want = engine.generate(input_ids=PROMPT, sampling_params=SP, **kw)
    meta = want["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT[2:] and meta["input_token_logprobs"][0][0] is None
    assert len(meta["input_top_logprobs"]) == 8 and len(meta["input_token_ids_logprobs"]) == 8
    assert [len(r) for r in meta["output_token_ids_logprobs"]] == [2, 2, 2]
    got = client.generate(input_ids=PROMPT, sampling_params=SP, **kw)
    for key in ("input_token_logprobs", "output_token_ids_logprobs"):  # (msgpack gives lists for tuples)
        assert _lists(got["meta_info"][key]) == _lists(meta[key])
    r = httpx.post(servers.url + "/generate", json={"input_ids": PROMPT, "sampling_params": SP, **kw})
    assert r.status_code == 200, r.text
    m = r.json()["meta_info"]
    assert [e[1] for e in m["input_token_logprobs"]] == PROMPT[2:] and all(e[2] is None for e in m["input_token_logprobs"])
    assert [e[0] for e in m["input_token_logprobs"]] == [e[0] for e in meta["input_token_logprobs"]]
    assert m["input_top_logprobs"][0] is None and m["input_top_logprobs"][1] == [[lp, t, None] for lp, t, _ in meta["input_top_logprobs"][1]]
    # streamed: the prompt's logprobs are in every chunk once they came (with the first token)
    chunks = list(engine.generate(input_ids=PROMPT, sampling_params=SP, stream=True, **kw))
    assert chunks[-1]["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
    for bad, words in [(dict(logprob_start_len=10), "logprob_start_len=10 must be -1 or in [0, 10)"),
                       (dict(logprob_start_len="0"), "logprob_start_len"),
                       (dict(token_ids_logprob=[5000]), "token_ids_logprob: token id 5000 is outside the vocabulary"),
                       (dict(token_ids_logprob=list(range(17))), "at most 16 token ids")]:  # fmt: skip
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            engine.generate(input_ids=PROMPT, sampling_params=SP, return_logprob=True, **bad)
        r = httpx.post(servers.url + "/generate", json={"input_ids": PROMPT, "sampling_params": SP, "return_logprob": True, **bad})
        assert r.status_code == 400 and "logprob" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="token_ids_logprob needs return_logprob=True"):
        engine.generate(input_ids=PROMPT, sampling_params=SP, token_ids_logprob=[5])
    sid = engine.open_session()
    try:  # a session turn reuses its earlier turns' KV: no prompt logprobs (the default is fine)
        with pytest.raises(ValueError, match="logprob_start_len: prompt logprobs of a session turn are not supported"):
            engine.generate(input_ids=PROMPT, sampling_params=SP, return_logprob=True, logprob_start_len=0,
                            session_params={"id": sid})  # fmt: skip
        turn = engine.generate(input_ids=PROMPT, sampling_params=SP, return_logprob=True, session_params={"id": sid})
        assert turn["meta_info"]["input_token_logprobs"][0][:2] == (None, PROMPT[-1])
    finally:
        engine.close_session(sid)


def test_openai_completions_echo_puts_the_prompt_and_its_logprobs_first(engine, servers):
    import openai

    want = engine.generate(input_ids=PROMPT, sampling_params=SP, return_logprob=True, logprob_start_len=0,
                           top_logprobs_num=2)  # fmt: skip
    meta = want["meta_info"]
    oc = openai.OpenAI(base_url=servers.url + "/v1", api_key="unused")
    model = oc.models.list().data[0].id
    r = oc.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2,
                              extra_body={"ignore_eos": True})  # fmt: skip
    choice = r.choices[0]
    prompt_text = engine.tokenizer.decode(PROMPT)
    assert choice.text == prompt_text + want["text"]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e[0] for e in meta["input_token_logprobs"][1:]] + [e[0] for e in meta["output_token_logprobs"]]
    assert lp.tokens == [e[2] for e in meta["input_token_logprobs"]] + [e[2] for e in meta["output_token_logprobs"]]
    assert len(lp.top_logprobs) == 13 and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    # echo without logprobs: the text only; streamed: the prompt leads the first chunk
    r = oc.completions.create(model=model, prompt="a b c", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("a b c") and r.choices[0].logprobs is None
    chunks = list(oc.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                        logprobs=1, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == prompt_text + want["text"]
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and len(first.token_logprobs) >= len(PROMPT)


def _lists(x):
    return [_lists(e) for e in x] if isinstance(x, list | tuple) else x
