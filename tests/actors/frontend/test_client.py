"""The Python client over the IPC socket: the Engine's verbs and outputs, streaming, 200
concurrent streaming clients, a client killed mid-stream, control verbs, errors."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.engine.conftest import random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True}


def test_generate_equals_the_engine_and_streaming_equals_non_streaming(engine, client):
    prompts = random_prompts(3, seed=11, lo=4, hi=30)
    sp = {**GREEDY, "max_new_tokens": 12}
    want = engine.generate(input_ids=prompts, sampling_params=sp)
    got = client.generate(input_ids=prompts, sampling_params=sp)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    last: dict[int, dict] = {}
    for chunk in client.generate(input_ids=prompts, sampling_params=sp, stream=True):
        i = chunk["index"]
        assert len(chunk["output_ids"]) >= len(last.get(i, {}).get("output_ids", []))  # cumulative
        last[i] = chunk
    assert [last[i]["output_ids"] for i in range(3)] == [w["output_ids"] for w in want]
    assert [last[i]["text"] for i in range(3)] == [w["text"] for w in want]
    assert all(last[i]["meta_info"]["finish_reason"] == {"type": "length"} for i in range(3))
    one = client.generate("Hello there", {**GREEDY, "max_new_tokens": 5}, return_logprob=True, top_logprobs_num=2)
    ref = engine.generate("Hello there", {**GREEDY, "max_new_tokens": 5}, return_logprob=True, top_logprobs_num=2)
    assert one["output_ids"] == ref["output_ids"]
    assert [t[1:] for t in one["meta_info"]["output_token_logprobs"]] == [
        list(t[1:]) for t in ref["meta_info"]["output_token_logprobs"]
    ]
    assert len(one["meta_info"]["output_top_logprobs"][0]) == 2


def test_200_concurrent_streaming_clients_each_get_the_engine_greedy_output(engine, servers):
    from ringserve import AsyncClient

    prompts = random_prompts(200, seed=12, lo=2, hi=24)
    sp = {**GREEDY, "max_new_tokens": 6}
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]

    async def one(p: list[int]) -> list[int]:
        async with AsyncClient(servers.socket_path) as c:
            last = None
            async for chunk in await c.generate(input_ids=p, sampling_params=sp, stream=True):
                last = chunk
            assert last is not None and last["meta_info"]["finish_reason"] == {"type": "length"}
            return last["output_ids"]

    async def all_of_them() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(all_of_them()) == want
    deadline = time.monotonic() + 5
    while servers.ipc.num_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servers.ipc.num_connections == 0


def test_errors_arrive_as_the_engine_raises_them(engine, client):
    for bad, words in [
        (dict(prompt="hi", sampling_params={"top_p": 1.5}), ["top_p=1.5", "(0, 1]"]),
        (dict(prompt="hi", sampling_params={"stop": 5}), ["sampling_params", "stop"]),
        (dict(input_ids=[5, 10**6]), ["input_ids", "vocabulary"]),
        (dict(prompt="hi", top_logprobs_num=99), ["top_logprobs_num", "5"]),
        (dict(input_ids=list(range(3, 300))), ["297 tokens", "context length 256"]),
    ]:
        with pytest.raises(ValueError) as mine:
            client.generate(**bad)
        with pytest.raises(ValueError) as theirs:
            engine.generate(**bad)
        assert str(mine.value) == str(theirs.value)
        for w in words:
            assert w in str(mine.value)
    with pytest.raises(ValueError, match="bad_mode"):
        client.pause_generation("bad_mode")
    with pytest.raises(ValueError, match="unknown verb 'make_coffee'"):
        client.control("make_coffee")
    with pytest.raises(ValueError, match="unexpected keyword argument 'colour'"):
        client.control("flush_cache", colour="blue")
    with pytest.raises(ValueError):  # a stream's bad input is raised at the call, not at first chunk
        client.generate(prompt="hi", sampling_params={"n": 0}, stream=True)
    assert client.generate(input_ids=[7, 8], sampling_params={**GREEDY, "max_new_tokens": 2})["output_ids"]


def test_control_verbs_behave_as_through_the_engine(engine, client):
    prompts = random_prompts(2, seed=13, lo=5, hi=20)
    sp = {**GREEDY, "max_new_tokens": 40}
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    assert client.health() is True
    stream = client.generate(input_ids=prompts, sampling_params=sp, stream=True)
    next(stream)
    assert client.pause_generation("retract")["success"]
    load = client.get_load()
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 2
    refused = engine.flush_cache()  # retracted requests hold no KV: flush is allowed
    assert refused["success"], refused
    assert client.continue_generation()["success"]
    last = {}
    for chunk in stream:
        last[chunk["index"]] = chunk["output_ids"]
    assert [last[0], last[1]] == want  # exactly the uninterrupted tokens
    # abort one request of a running batch; the other finishes untouched
    stream = client.generate(input_ids=prompts, sampling_params=sp, rid=["keep", "drop"], stream=True)
    next(stream)
    client.abort_request("drop")
    out = {}
    for chunk in stream:
        out[chunk["meta_info"]["id"]] = chunk
    assert out["drop"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert want[1][: len(out["drop"]["output_ids"])] == out["drop"]["output_ids"]
    assert out["keep"]["output_ids"] == want[0]
    info = client.get_server_info()
    assert info["integrity_errors"] == [] and info["model_path"]
    assert client.flush_cache()["success"]
    done = client.wait_compiled(timeout=600)
    assert done["programs_pending"] == 0 and done["programs_compiled"] == done["programs_total"] > 0
    with pytest.raises(ValueError, match="timeout"):
        client.wait_compiled(timeout=-1)


def test_leaving_a_stream_aborts_its_requests(engine, client):
    it = client.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 200}, stream=True)
    next(it)
    it.close()
    deadline = time.monotonic() + 10
    while engine.get_load()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.get_load()["num_running_reqs"] == 0


def test_a_client_process_killed_mid_stream_leaves_nothing_running(engine, servers):
    script = textwrap.dedent(f"""
        import sys
        from ringserve import Client
        c = Client({servers.socket_path!r})
        for i, chunk in enumerate(c.generate(input_ids=[[5, 6, 7], [9, 10]], stream=True,
                                             sampling_params={{"max_new_tokens": 220, "temperature": 0, "ignore_eos": True}})):
            if i == 3:
                print("streaming", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "streaming"
    assert engine.get_load()["num_running_reqs"] == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while engine.get_load()["num_running_reqs"] + engine.get_load()["num_waiting_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    load = engine.get_load()
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    # the engine fixture's leak check: integrity, every page and slot back
