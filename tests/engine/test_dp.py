"""Two data-parallel groups on this machine (one CPU device each), one engine for the module:
greedy outputs of 128 mixed requests equal one group's under every load-balance method, explicit ranks, control
calls that reach both groups, a weight update all or nothing across them, /get_load per rank,
and each group's KV books intact after every test."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ringserve.actors.frontend.dispatch import Dispatcher
from tests.engine.conftest import SMALL

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "ignore_eos": True}


def no_leak_in_any_group(engine) -> None:
    info = engine.get_server_info()
    assert info["dp_size"] == 2
    for g in info["dp_groups"]:
        assert g["integrity_errors"] == [] and g["running_batch_size"] == g["waiting_queue_size"] == 0
        assert g["req_to_token_pool_used"] == 0 and g["available_kv_tokens"] == g["initial_kv_tokens"]


@pytest.fixture(scope="module")
def dp2(tiny_dir):
    from ringserve import Engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_NUM_CPU_DEVICES", "2")
        e = Engine(str(tiny_dir("llama")), page_size=16, dp_size=2, **SMALL)
    yield e
    e.shutdown()


@pytest.fixture
def engine(dp2):
    yield dp2
    dp2.continue_generation()
    no_leak_in_any_group(dp2)


def mixed_batch(n: int) -> tuple[list[list[int]], list[dict]]:
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(3 + (i * 13) % 90)] for i in range(n)]
    for i in range(0, n, 4):  # a shared prefix among some
        prompts[i] = list(range(40, 80)) + prompts[i][:5]
    params = [{**GREEDY, "max_new_tokens": 2 + (i * 5) % 14} for i in range(n)]
    return prompts, params


def use(engine, method: str) -> Dispatcher:
    """The engine's dispatcher with another method (it goes on counting what was sent: the
    schedulers count what they received since they started)."""
    fe, old = engine.frontend, engine.frontend.dispatcher
    d = Dispatcher(2, method, 16, loads=fe.links.loads.read_all)
    d.sent_reqs, d.sent_tokens = old.sent_reqs, old.sent_tokens
    fe.dispatcher = d
    return d


def sent_since(d: Dispatcher, before: list[int]) -> list[int]:
    return [a - b for a, b in zip(d.sent_reqs, before, strict=True)]


@pytest.fixture(scope="module")
def mixed128(shared_engine):
    """128 mixed requests (prompts of 3-92 tokens, a quarter over one 40-token prefix; 2-15 new
    tokens) and their greedy outputs from one group: the dp 1 reference, computed once."""
    prompts, params = mixed_batch(128)
    want = [o["output_ids"] for o in shared_engine.generate(input_ids=prompts, sampling_params=params)]
    assert len({len(p) for p in prompts}) > 40 and len({len(w) for w in want}) == 14
    return prompts, params, want


@pytest.mark.parametrize("method", ["round_robin", "total_requests", "total_tokens", "cache_aware"])
def test_greedy_outputs_equal_one_group_under_every_method(engine, mixed128, method):
    prompts, params, want = mixed128
    d = use(engine, method)
    before = list(d.sent_reqs)
    got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
    assert min(sent_since(d, before)) >= 16, sent_since(d, before)  # both groups served
    for i in range(0, 8):  # one at a time as well (another dispatch order)
        assert engine.generate(input_ids=prompts[i], sampling_params=params[i])["output_ids"] == want[i]


def test_round_robin_alternates_and_an_explicit_rank_wins(engine):
    d = use(engine, "round_robin")
    before = list(d.sent_reqs)
    ranks = []
    for _ in range(4):
        engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 2})
        ranks.append(max(range(2), key=lambda r: d.sent_reqs[r] - before[r] - ranks.count(r)))
    assert ranks in ([0, 1, 0, 1], [1, 0, 1, 0]) and sent_since(d, before) == [2, 2]
    engine.generate(input_ids=[[5, 6, 7]] * 3, sampling_params={**GREEDY, "max_new_tokens": 2}, data_parallel_rank=1)
    assert sent_since(d, before) == [2, 5]
    with pytest.raises(ValueError, match=r"data_parallel_rank=2: must be an integer in \[0, 2\)"):
        engine.generate(input_ids=[5, 6], data_parallel_rank=2)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        engine.generate(input_ids=[5, 6], data_parallel_rank=-1)


def test_n_samples_stay_in_one_group(engine):
    d = use(engine, "round_robin")
    before = list(d.sent_reqs)
    engine.generate(input_ids=[9, 8, 7], sampling_params={"max_new_tokens": 3, "n": 4, "temperature": 1.0})
    assert sorted(sent_since(d, before)) == [0, 4]


def test_control_calls_reach_every_group(engine):
    use(engine, "round_robin")
    out = engine.pause_generation("in_place")
    assert out == {"success": True, "message": "paused (in_place)"}
    assert [g["paused"] for g in engine.get_server_info()["dp_groups"]] == [True, True]
    # requests sent while paused wait in both groups; continue releases them
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=[[1, 2, 3], [4, 5, 6]], sampling_params={**GREEDY, "max_new_tokens": 3})))  # fmt: skip
    t.start()
    t.join(1.0)
    assert t.is_alive() and [ld["num_waiting_reqs"] for ld in engine.get_loads()] == [1, 1]
    assert engine.continue_generation()["success"]
    t.join(60)
    assert [len(o["output_ids"]) for o in box["out"]] == [3, 3]
    assert engine.flush_cache() == {"success": True, "message": "cache flushed"}
    assert [g["tree_cache_size"] for g in engine.get_server_info()["dp_groups"]] == [0, 0]


def test_a_weight_update_is_all_or_nothing_across_groups(engine, tiny_dir):
    use(engine, "round_robin")
    prompts, params = mixed_batch(8)
    before = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    out = engine.update_weights_from_disk(str(tiny_dir("llama")), weight_version="dp-v2")
    assert out["success"] and out["weight_version"] == "dp-v2", out
    assert [g["weight_version"] for g in engine.get_server_info()["dp_groups"]] == ["dp-v2", "dp-v2"]
    assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)] == before
    # group 1 is busy (a long request runs there, not paused): the update is refused in both
    stream = engine.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "max_new_tokens": 200}, stream=True,
                             data_parallel_rank=1)  # fmt: skip
    next(iter(stream))
    out = engine.update_weights_from_disk(str(tiny_dir("llama")), weight_version="dp-v3")
    assert not out["success"] and out["weight_version"] == "dp-v2", out
    assert "dp_rank 1: update_weights refused" in out["message"], out["message"]
    assert [g["weight_version"] for g in engine.get_server_info()["dp_groups"]] == ["dp-v2", "dp-v2"]
    stream.close()  # aborts it
    engine.pause_generation("abort")


@pytest.fixture(scope="module")
def servers(dp2):
    """HTTP over the dp=2 engine (stopping it refuses new requests: only at the module's end)."""
    from ringserve import Servers

    s = Servers(dp2, ipc=False, port=0).start()
    yield s
    s.stop()


def test_get_load_over_http_has_one_entry_per_rank(engine, servers):
    loads = httpx.get(servers.url + "/get_load").json()
    assert [ld["dp_rank"] for ld in loads] == [0, 1]
    assert all(ld["num_reqs"] == 0 and ld["num_waiting_reqs"] == 0 and ld["num_tokens"] >= 0 for ld in loads)
    v1 = httpx.get(servers.url + "/v1/loads").json()
    assert v1["dp_rank_count"] == 2 and [ld["num_total_tokens"] for ld in v1["loads"]] == [8176, 8176]
    metrics = httpx.get(servers.url + "/metrics").text
    assert 'ringserve:num_running_reqs{dp_rank="1"} 0.0' in metrics
    r = httpx.post(servers.url + "/generate", json={"input_ids": [3, 4], "data_parallel_rank": 5})
    assert r.status_code == 400 and "data_parallel_rank" in r.text
    r = httpx.post(servers.url + "/generate", json={"input_ids": [3, 4], "data_parallel_rank": 1,
                                                     "sampling_params": {**GREEDY, "max_new_tokens": 2}})  # fmt: skip
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    info = httpx.get(servers.url + "/get_server_info").json()
    assert info["dp_size"] == 2 and len(info["dp_groups"]) == 2
    # the body SGLang's router sends (every field it always serializes, and the rank it picked)
    routed = {"input_ids": [3, 4], "sampling_params": {**GREEDY, "max_new_tokens": 2}, "model": None,
              "stream": False, "return_text_in_logprobs": False, "log_metrics": True, "return_hidden_states": False,
              "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
              "data_parallel_rank": 0}  # fmt: skip
    r = httpx.post(servers.url + "/generate", json=routed)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    r = httpx.post(servers.url + "/generate", json={**routed, "background": True})
    assert r.status_code == 400 and "background is not supported" in r.text
    # the chat and completions bodies sglang-router 0.3.2 forwards (captured from it), verbatim
    name = engine.served_model_name
    chat = {"messages": [{"role": "user", "content": "hi"}], "model": name, "logprobs": False,
            "max_completion_tokens": 4, "stream": False, "temperature": 0.0, "no_stop_trim": False, "ignore_eos": False,
            "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
            "stream_reasoning": True, "return_hidden_states": False}  # fmt: skip
    r = httpx.post(servers.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
    completion = {"model": name, "prompt": "hi", "max_tokens": 4, "temperature": 0.0, "stream": False, "echo": False,
                  "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}  # fmt: skip
    r = httpx.post(servers.url + "/v1/completions", json=completion)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
    r = httpx.post(servers.url + "/v1/chat/completions", json={**chat, "continue_final_message": True})
    assert r.status_code == 400 and "continue_final_message" in r.text


def test_too_few_devices_is_refused_clearly(tiny_dir, monkeypatch):
    from ringserve import Engine

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "2")
    with pytest.raises(ValueError, match=r"dp_size=3 x tp_size=1 needs 3 cpu devices; this host offers 2"):
        Engine(str(tiny_dir("llama")), page_size=16, dp_size=3, **SMALL)



def test_weights_pushed_from_tensors_reach_both_groups(engine, tiny_dir, tmp_path):
    import numpy as np

    from ringserve.model.checkpoints.load import load_checkpoint
    from ringserve.model.checkpoints.tiny import make_tiny_model

    use(engine, "round_robin")
    prompt, sp = [3, 14, 15, 92, 65], {**GREEDY, "max_new_tokens": 8}
    old = engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    other = {k: np.array(v) for k, v in load_checkpoint(make_tiny_model(tmp_path / "s1", "llama", seed=1))[1].items()}
    out = engine.update_weights_from_tensor(other, weight_version="dp-t1", bucket_bytes=1 << 20)
    assert out == {"success": True, "message": f"updated {len(other)} tensors", "weight_version": "dp-t1",
                   "bytes": sum(a.nbytes for a in other.values())}
    per_group = [engine.generate(input_ids=prompt, sampling_params=sp, data_parallel_rank=r)["output_ids"] for r in (0, 1)]
    assert per_group[0] == per_group[1] != old
    assert [g["weight_version"] for g in engine.get_server_info()["dp_groups"]] == ["dp-t1", "dp-t1"]
    assert engine.update_weights_from_disk(str(tiny_dir("llama")), weight_version="dp-back")["success"]
    assert [engine.generate(input_ids=prompt, sampling_params=sp, data_parallel_rank=r)["output_ids"]
            for r in (0, 1)] == [old, old]  # fmt: skip


def test_an_update_group_reaches_both_groups(engine, shared_engine, tiny_dir, tmp_path):
    """A trainer's update group (bench/group_trainer.py): each group's runner joins as rank
    rank_offset + its dp rank; one broadcast reaches both; each then serves as a fresh engine
    on that checkpoint."""
    pytest.importorskip("torch")
    from ringserve import Engine
    from ringserve.model.checkpoints.tiny import make_tiny_model
    from tests.engine.test_update_group import Trainer

    use(engine, "round_robin")
    new = make_tiny_model(tmp_path / "s2", "llama", seed=2)
    prompt, sp = [3, 14, 15, 92, 65], {**GREEDY, "max_new_tokens": 8}
    with Engine(str(new), page_size=16, precompile=False, **SMALL) as fresh:
        want = fresh.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    t = Trainer(3, "dp-group", new)
    try:
        r = t.join(engine.init_weights_update_group)
        assert r["success"], r
        assert "as rank 1 of 3" in r["message"] and "as rank 2 of 3" in r["message"], r  # (one line per group)
        r = t.send(lambda **kw: engine.update_weights_from_distributed(**kw, weight_version="dp-g1"))
        assert r["success"], r
        assert [engine.generate(input_ids=prompt, sampling_params=sp, data_parallel_rank=r)["output_ids"]
                for r in (0, 1)] == [want, want]  # fmt: skip
        assert [g["weight_version"] for g in engine.get_server_info()["dp_groups"]] == ["dp-g1", "dp-g1"]
    finally:
        assert engine.destroy_weights_update_group("dp-group")["success"]
        t.quit()
    assert engine.update_weights_from_disk(str(tiny_dir("llama")), weight_version="dp-back")["success"]


def test_a_crash_in_one_group_restarts_every_group_and_loses_no_request(engine, shared_engine):
    import os
    import signal

    use(engine, "total_requests")
    prompts, params = mixed_batch(16)
    params = [{**p, "max_new_tokens": 24} for p in params]
    want = [o["output_ids"] for o in shared_engine.generate(input_ids=prompts, sampling_params=params)]
    n = sum(engine.frontend.core.metrics.restart_counts.values())
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(input_ids=prompts, sampling_params=params)))
    t.start()
    while not any(ld["num_running_reqs"] for ld in engine.get_loads() if ld["dp_rank"] == 1):
        time.sleep(0.01)  # the group whose runner dies is serving
    os.kill(engine.group.pid("runner-1"), signal.SIGKILL)
    t.join(300)
    assert [o["output_ids"] for o in box["out"]] == want  # every request, as if never stopped
    deadline = time.monotonic() + 60  # the supervisor counts the restart as it sees it (its own thread)
    while (info := engine.get_server_info())["restarts"] == n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert info["restarts"] == n + 1 and info["restarts_by_actor"].get("runner-1", 0) >= 1
    assert len(info["actor_pids"]) == 6  # every group's three actors, started again
    assert [engine.generate(input_ids=prompts[0], sampling_params=params[0], data_parallel_rank=r)["output_ids"]
            for r in (0, 1)] == [want[0], want[0]]  # fmt: skip


def test_a_pause_update_flush_continue_cycle_serves_the_new_weights_in_both_groups(engine, shared_engine, tiny_dir,
                                                                                    tmp_path):  # fmt: skip
    from ringserve.model.checkpoints.tiny import make_tiny_model

    use(engine, "cache_aware")
    new = str(make_tiny_model(tmp_path / "s2", "llama", seed=2))
    prompts, params = mixed_batch(16)
    assert shared_engine.update_weights_from_disk(new)["success"]  # the one-group reference on the new weights
    try:
        want = [o["output_ids"] for o in shared_engine.generate(input_ids=prompts, sampling_params=params)]
    finally:
        assert shared_engine.update_weights_from_disk(str(shared_engine.model_dir))["success"]
    box: dict = {}
    long = {**GREEDY, "max_new_tokens": 40}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(input_ids=prompts[:6], sampling_params=long)))
    t.start()
    while not any(ld["num_running_reqs"] for ld in engine.get_loads()):
        time.sleep(0.01)
    assert engine.pause_generation("retract")["success"]
    out = engine.update_weights_from_disk(new, weight_version="dp-s2")
    assert out["success"], out
    assert engine.flush_cache()["success"] and engine.continue_generation()["success"]
    t.join(120)
    assert all(len(o["output_ids"]) == 40 for o in box["out"])  # the retracted ones went on, on the new weights
    got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
    assert engine.update_weights_from_disk(str(tiny_dir("llama")), weight_version="dp-s0")["success"]
