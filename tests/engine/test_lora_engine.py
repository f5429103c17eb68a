"""LoRA adapters through the whole engine (one engine for the module): greedy outputs equal
transformers + PEFT for three adapters and none in one batch; the prefix cache keyed by
adapter; load / unload while 64 requests run (a bad adapter refused, an adapter in use refused,
nothing recompiled); bad lora_path refused up front; adapters follow the weights' memory tag."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.engine.conftest import SMALL, assert_no_leak, random_prompts
from tests.hf_ref import hf_lora_greedy

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}
RANK = 8


@pytest.fixture(scope="module")
def base(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    from ringserve.model.checkpoints.tiny_lora import make_tiny_lora

    d = tmp_path_factory.mktemp("engine-loras")
    return {
        "a": make_tiny_lora(d / "a", base, rank=8, seed=11),
        "b": make_tiny_lora(d / "b", base, rank=4, seed=12, target_modules=("q_proj", "v_proj", "down_proj")),
        "c": make_tiny_lora(d / "c", base, rank=2, seed=13, alpha=6),
        "d": make_tiny_lora(d / "d", base, rank=8, seed=14),
        "too_big": make_tiny_lora(d / "too_big", base, rank=16, seed=15),
    }


@pytest.fixture(scope="module")
def engine(base, adapters):
    from ringserve import Engine

    # prompts past 32 tokens are prefilled in chunks: an adapter's rows across chunks
    e = Engine(str(base), page_size=16, enable_lora=True, max_lora_rank=RANK, max_loras_per_batch=3,
               lora_paths=[f"a={adapters['a']}"], **{**SMALL, "chunked_prefill_size": 32})  # fmt: skip
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def servers(engine):
    """The IPC socket and HTTP on the module's engine (stopping them ends its serving: module teardown)."""
    from ringserve import Servers

    s = Servers(engine, port=0).start()
    yield s
    s.stop()


@pytest.fixture
def lora_engine(engine):
    yield engine
    assert_no_leak(engine)


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_mixed_batch_equals_peft(lora_engine, base, adapters):
    e = lora_engine
    assert e.load_lora_adapter("b", str(adapters["b"]))["success"]
    r = e.load_lora_adapter("c", str(adapters["c"]))
    assert r["success"] and r["loaded_adapters"] == {n: str(adapters[n]) for n in "abc"}, r
    prompts = random_prompts(8, seed=5, lo=5, hi=80)
    assert max(map(len, prompts)) > 32
    names = ["a", "b", "c", None, "c", None, "b", "a"]
    got = _ids(e.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names))
    for name in ("a", "b", "c", None):
        mine = [i for i, n in enumerate(names) if n == name]
        want = hf_lora_greedy(base, adapters[name] if name else None, [prompts[i] for i in mine], 8)
        assert [got[i] for i in mine] == want, name
    alone = _ids(e.generate(input_ids=prompts[:1], sampling_params=GREEDY, lora_path="a"))
    assert alone == got[:1]
    assert e.unload_lora_adapter("c")["success"] and e.unload_lora_adapter("b")["success"]


def test_radix_cache_keyed_by_adapter(lora_engine, base, adapters):
    """One prompt under a, then b, then none, then a again: each output is its adapter's, and
    only the repeat under a reuses the cached prefix."""
    e = lora_engine
    assert e.load_lora_adapter("b", str(adapters["b"]))["success"]
    prompt = random_prompts(1, seed=9, lo=60, hi=61)[0]
    outs = [e.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=n) for n in ("a", "b", None, "a")]
    for o, n in zip(outs, ("a", "b", None, "a"), strict=True):
        assert [o["output_ids"]] == hf_lora_greedy(base, adapters[n] if n else None, [prompt], 8), n
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[:3] == [0, 0, 0] and cached[3] == 48, cached  # 3 whole pages of 16 under a
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) == 3, "the adapters changed nothing"
    assert e.unload_lora_adapter("b")["success"]


def test_load_unload_while_64_requests_run(lora_engine, adapters):
    e = lora_engine
    prompts = random_prompts(64, seed=21, lo=5, hi=40)
    names = [("a", None)[i % 2] for i in range(64)]
    sp = {**GREEDY, "max_new_tokens": 96}  # long enough to outlast the loads below, however fast the steps
    quiet = _ids(e.generate(input_ids=prompts, sampling_params=sp, lora_path=names))
    traces = e.wait_compiled()["runner_trace_count"]  # the background compile done: nothing traces from here
    box: dict = {}

    def go() -> None:
        try:
            box["out"] = _ids(e.generate(input_ids=prompts, sampling_params=sp, lora_path=names))
        except BaseException as err:  # surfaced below
            box["err"] = err

    t = threading.Thread(target=go)
    t.start()
    try:
        deadline = time.monotonic() + 120
        while e.get_server_info()["running_batch_size"] == 0:
            assert "err" not in box and time.monotonic() < deadline, box.get("err", "the requests never ran")
            time.sleep(0.01)
        r = e.load_lora_adapter("d", str(adapters["d"]))
        assert r["success"], r
        bad = e.load_lora_adapter("big", str(adapters["too_big"]))
        assert not bad["success"] and f"exceeds the server's max_lora_rank={RANK}" in bad["error_message"], bad
        assert not e.load_lora_adapter("d", str(adapters["c"]))["success"]  # the name is taken
        busy = e.unload_lora_adapter("a")
        assert not busy["success"] and "is used by" in busy["error_message"], busy
        full = e.load_lora_adapter("e", str(adapters["c"]))
        assert full["success"], full  # slot 3 of 3
        more = e.load_lora_adapter("f", str(adapters["c"]))
        assert not more["success"] and "all 3 LoRA slots are taken" in more["error_message"], more
        assert e.unload_lora_adapter("d")["success"] and e.unload_lora_adapter("e")["success"]
        assert e.get_server_info()["running_batch_size"] > 0, "the requests ended before the loads: nothing was tested"
    finally:
        t.join(300)
    assert "err" not in box, box.get("err")
    assert box["out"] == quiet
    info = e.get_server_info()
    assert info["runner_trace_count"] == traces and info["loaded_lora_adapters"] == {"a": str(adapters["a"])}


def test_bad_lora_path_refused(lora_engine, shared_engine):
    e = lora_engine
    with pytest.raises(ValueError, match=r"lora_path='nope': no LoRA adapter of that name is loaded \(loaded: \['a'\]\)"):
        e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="nope")
    with pytest.raises(ValueError, match=r"lora_path\[1\]='nope'"):
        e.generate(input_ids=[[1, 2], [3, 4]], sampling_params=GREEDY, lora_path=["a", "nope"])
    with pytest.raises(ValueError, match="lora_path: 3 given for 2 prompts"):
        e.generate(input_ids=[[1, 2], [3, 4]], sampling_params=GREEDY, lora_path=["a", None, None])
    with pytest.raises(ValueError, match="this server serves no LoRA adapters"):
        shared_engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="a")
    r = e.unload_lora_adapter("nope")
    assert not r["success"] and "lora_name='nope'" in r["error_message"]
    with pytest.raises(ValueError, match="lora_name=''"):
        e.load_lora_adapter("", "/x")
    missing = e.load_lora_adapter("x", "/nonexistent/adapter")
    assert not missing["success"] and "no such directory" in missing["error_message"]


def test_adapters_follow_the_weights_memory_tag(lora_engine):
    e = lora_engine
    prompts = random_prompts(2, seed=31, lo=5, hi=20)
    before = _ids(e.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=["a", None]))
    assert e.release_memory_occupation(["weights"])["success"]
    assert e.resume_memory_occupation(["weights"])["success"]
    assert _ids(e.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=["a", None])) == before
    assert json.loads(json.dumps(e.get_server_info()["loaded_lora_adapters"])) == {"a": e.args.lora_adapters["a"]}


def test_http_and_client(lora_engine, servers, adapters):
    """SGLang's routes and bodies: POST /load_lora_adapter {lora_name, lora_path}, /generate
    with lora_path (an unknown one: 400 naming it), /unload_lora_adapter; the IPC Client's verbs."""
    import httpx

    from ringserve import Client

    e = lora_engine
    url = servers.url
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "h", "lora_path": str(adapters["c"])})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": str(adapters["a"]), "h": str(adapters["c"])}
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY, "lora_path": "h"}
    via_http = httpx.post(url + "/generate", json=body).json()["output_ids"]
    assert via_http == e.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, lora_path="h")["output_ids"]
    r = httpx.post(url + "/generate", json={**body, "lora_path": "nope"})
    assert r.status_code == 400 and "lora_path='nope'" in r.text
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["too_big"])})
    assert r.status_code == 400 and "max_lora_rank" in r.json()["error_message"]
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "h"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": str(adapters["a"])}
    with Client(servers.socket_path) as c:
        assert c.load_lora_adapter("k", str(adapters["b"]))["success"]
        out = c.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, lora_path="k")["output_ids"]
        assert out == e.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, lora_path="k")["output_ids"]
        assert c.unload_lora_adapter("k")["success"]
        with pytest.raises(ValueError, match="lora_path='k'"):
            c.generate(input_ids=[5, 6], sampling_params=GREEDY, lora_path="k")


@pytest.mark.slow
def test_overlap_off_gives_the_same_tokens(lora_engine, base, adapters):
    """Temperature-0 outputs of a mix of adapters are the same with the overlap schedule off
    (an engine of the same shapes: its programs come from the XLA cache)."""
    from ringserve import Engine

    prompts = random_prompts(6, seed=41, lo=5, hi=70)
    names = ["a", None, "b", "a", "b", None]
    assert lora_engine.load_lora_adapter("b", str(adapters["b"]))["success"]
    try:
        want = _ids(lora_engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names))
    finally:
        assert lora_engine.unload_lora_adapter("b")["success"]
    with Engine(str(base), page_size=16, enable_lora=True, max_lora_rank=RANK, max_loras_per_batch=3,
                lora_paths=[f"a={adapters['a']}", f"b={adapters['b']}"], disable_overlap_schedule=True,
                **{**SMALL, "chunked_prefill_size": 32}) as normal:  # fmt: skip
        assert _ids(normal.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)) == want
        assert_no_leak(normal)
