"""The supervisor with real processes (issue 28): SIGKILL of the scheduler, the runner and the
detokenizer in turn during 64 streaming requests over the IPC socket and HTTP: every request
completes, its stream never repeats text, greedy and seeded outputs (deterministic mode), their
logprobs and meta equal an uninterrupted run's, restarts are counted; a paused engine, an open
session and weights pushed from tensors come back as they were; a crash loop (the runner killed
5 times in a row) ends in EngineDead for every caller and leaves nothing behind. The parts
without processes: tests/actors/frontend/test_supervisor.py and its neighbours."""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from tests.engine.conftest import SMALL, assert_no_leak, in_background, random_prompts

MAX_NEW = 40
PROMPTS = random_prompts(64, seed=281, lo=4, hi=48)


def sampling(i: int) -> dict:
    """Even requests greedy, odd ones seeded; half of each penalized (a resubmitted request's token
    counts start from its prompt and the output it had)."""
    sp = {"ignore_eos": True, "max_new_tokens": MAX_NEW}
    if i % 4 >= 2:
        sp |= {"repetition_penalty": 1.2, "presence_penalty": 0.4}
    return {**sp, "temperature": 0} if i % 2 == 0 else {**sp, "temperature": 0.9, "top_p": 0.95, "sampling_seed": 1000 + i}


@pytest.fixture(scope="module")
def served(tiny_llama):
    """A deterministic engine (a seeded draw depends on its seed and position only) that restarts
    without limit, with its IPC socket and HTTP."""
    from ringserve import Engine, Servers

    engine = Engine(str(tiny_llama), page_size=16, enable_deterministic_inference=True, max_restarts=100, **SMALL)
    servers = Servers(engine, port=0).start()
    yield engine, servers
    servers.stop()
    engine.shutdown()


def shm_of(names: list[str]) -> list[str]:
    return [p for n in names for p in glob.glob(f"/dev/shm/*{n.lstrip('/')}*")]


class Streams:
    """Half of the requests as one batched stream over the IPC socket, half over HTTP /generate
    (SSE), each in a thread; every chunk is checked to extend the one before (no text repeated,
    no id taken back); `tokens` counts the ids received, with the time of the latest."""

    def __init__(self, servers):
        self.final: dict[int, dict] = {}
        self.tokens = 0
        self.errors: list[BaseException] = []
        self._seen: dict[int, dict] = {}
        self._lock = threading.Lock()
        half = len(PROMPTS) // 2
        self.threads = [threading.Thread(target=self._ipc, args=(servers.socket_path, 0, half)),
                        threading.Thread(target=self._http, args=(servers.url, half, len(PROMPTS)))]  # fmt: skip
        for t in self.threads:
            t.start()

    def _chunk(self, base: int, c: dict) -> None:
        i = base + c["index"]
        with self._lock:
            prev = self._seen.get(i, {"text": "", "output_ids": []})
            assert c["text"].startswith(prev["text"]), (i, prev["text"], c["text"])
            assert c["output_ids"][: len(prev["output_ids"])] == prev["output_ids"], i
            self.tokens += len(c["output_ids"]) - len(prev["output_ids"])
            self._seen[i] = c
            if c["meta_info"]["finish_reason"] is not None:
                self.final[i] = c

    def _ipc(self, path: str, lo: int, hi: int) -> None:
        from ringserve import Client

        try:
            with Client(path) as c:
                for chunk in c.generate(input_ids=PROMPTS[lo:hi], sampling_params=[sampling(i) for i in range(lo, hi)],
                                        return_logprob=True, stream=True):  # fmt: skip
                    self._chunk(lo, chunk)
        except BaseException as e:
            self.errors.append(e)

    def _http(self, url: str, lo: int, hi: int) -> None:
        body = {"input_ids": PROMPTS[lo:hi], "sampling_params": [sampling(i) for i in range(lo, hi)],
                "return_logprob": True, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", url + "/generate", json=body, timeout=None) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        self._chunk(lo, chunk)
        except BaseException as e:
            self.errors.append(e)

    def wait_for_tokens(self, more: int, timeout: float = 120) -> float:
        """Block until `more` ids arrived past the count now; the time the first of them came."""
        start, first, deadline = self.tokens, None, time.monotonic() + timeout
        while self.tokens < start + more:
            assert not self.errors, self.errors
            if first is None and self.tokens > start:
                first = time.monotonic()
            assert time.monotonic() < deadline, f"no tokens for {timeout} s"
            time.sleep(0.002)
        return first if first is not None else time.monotonic()

    def join(self) -> None:
        for t in self.threads:
            t.join(300)
        assert not self.errors, self.errors


def restarts(engine) -> int:
    return sum(engine.frontend.core.metrics.restart_counts.values())


def wait_restarts(engine, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while restarts(engine) < n:
        assert time.monotonic() < deadline, f"no restart {n} within {timeout} s"
        time.sleep(0.005)


@pytest.mark.slow
def test_each_actor_killed_in_turn_during_64_streams_over_ipc_and_http(served):
    engine, servers = served
    want = engine.generate(input_ids=PROMPTS, sampling_params=[sampling(i) for i in range(64)], return_logprob=True)
    streams = Streams(servers)
    times = {}
    for k, actor in enumerate(["scheduler", "runner", "detokenizer"], start=1):
        streams.wait_for_tokens(64 * 3)  # every request streams before each kill
        names = engine.group.ring_names
        t_kill = time.monotonic()
        os.kill(engine.group.pid(actor), signal.SIGKILL)
        while restarts(engine) < k:
            assert time.monotonic() - t_kill < 120, f"no restart after {actor} was killed"
            time.sleep(0.005)
        times[actor] = round(streams.wait_for_tokens(1) - t_kill, 2)  # kill -> first token again
        assert shm_of(names) == []  # the old group's rings and semaphores are gone
    streams.join()
    print(f"\nrestart times (SIGKILL -> first token again, s): {times}")
    assert sorted(streams.final) == list(range(64))
    for i, w in enumerate(want):
        got = streams.final[i]
        assert (got["output_ids"], got["text"]) == (w["output_ids"], w["text"]), f"request {i}"
        meta, wmeta = got["meta_info"], w["meta_info"]
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == [lp for lp, _, _ in wmeta["output_token_logprobs"]]
        for key in ("prompt_tokens", "completion_tokens", "finish_reason", "weight_version"):
            assert meta[key] == wmeta[key], (i, key)
    info = engine.get_server_info()
    assert info["restarts"] == 3 and info["restarts_by_actor"] == {"scheduler": 1, "runner": 1, "detokenizer": 1}
    assert info["last_restart"]["actor"] == "detokenizer" and info["last_restart"]["resubmitted"] > 0
    assert info["actor_pids"] == engine.group.pids and len(info["actor_pids"]) == 3  # the new ones
    assert info["runner"] == engine.runner_info == json.loads(engine.supervisor.ready["runner"])  # the new runner's
    assert engine.runner_info["kv_pool_tokens"] > 0
    metrics = httpx.get(servers.url + "/metrics").text
    assert 'ringserve:actor_restarts_total{actor="runner"} 1.0' in metrics
    assert_no_leak(engine)


def test_pause_session_and_pushed_weights_come_back_after_a_restart(served, tiny_dir, tmp_path):
    from ringserve.model.checkpoints.load import load_checkpoint
    from ringserve.model.checkpoints.tiny import make_tiny_model

    engine, _ = served
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}
    prompts = random_prompts(6, seed=282, lo=4, hi=40)
    other = load_checkpoint(make_tiny_model(tmp_path / "s1", "llama", seed=1))[1]
    pushed = {k: np.array(v) for k, v in other.items() if ".layers.2." in k}
    r = engine.update_weights_from_tensor(pushed, weight_version="pushed")
    assert r["success"] and r["weight_version"] == "pushed"
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    sid = engine.open_session()
    turn1 = engine.generate(input_ids=[9, 10, 11], sampling_params=greedy, session_params={"id": sid})
    turn2_in = [12, 13]
    want2 = engine.generate(input_ids=[9, 10, 11] + turn1["output_ids"] + turn2_in, sampling_params=greedy)
    updates = engine.get_server_info()["weight_updates"]

    t, box = in_background(engine, prompts, 24)
    assert engine.pause_generation("retract")["success"]
    n = restarts(engine)
    os.kill(engine.group.pid("runner"), signal.SIGKILL)
    wait_restarts(engine, n + 1)
    load = engine.get_load()  # the new scheduler's
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, len(prompts))  # still paused
    info = engine.get_server_info()
    assert (info["weight_version"], info["weight_updates"]) == ("pushed", updates)
    assert engine.continue_generation()["success"]
    t.join(120)
    assert [o["output_ids"] for o in box["out"]] == want  # on the pushed weights, as if never stopped
    assert all(o["meta_info"]["weight_version"] == "pushed" for o in box["out"])
    turn2 = engine.generate(input_ids=turn2_in, sampling_params=greedy,
                            session_params={"id": sid, "rid": turn1["meta_info"]["id"]})  # fmt: skip
    assert turn2["output_ids"] == want2["output_ids"]  # the session goes on (its kept KV computed again)
    engine.close_session(sid)
    assert engine.update_weights_from_disk(str(tiny_dir("llama")))["success"]  # back to the shared weights
    assert_no_leak(engine)


@pytest.mark.slow
def test_a_crash_loop_ends_in_engine_dead_for_all_and_leaves_nothing(tiny_llama):
    from ringserve import Client, Engine, EngineDead, Servers

    engine = Engine(str(tiny_llama), page_size=16, max_restarts=4, restart_window_s=600, precompile=False, **SMALL)
    servers = Servers(engine, port=0, http=False).start()
    path = servers.socket_path
    names: list[str] = []
    try:
        t, box = in_background(engine, PROMPTS[:4], 200)
        errors: list[BaseException] = []

        def over_ipc() -> None:
            try:
                with Client(path) as c:
                    for _ in c.generate(input_ids=PROMPTS[4:8], sampling_params={"max_new_tokens": 200}, stream=True):
                        pass
            except BaseException as e:
                errors.append(e)

        ipc = threading.Thread(target=over_ipc)
        ipc.start()
        for k in range(5):
            while restarts(engine) < k:  # the actors are back (and the requests resubmitted)
                time.sleep(0.01)
            names += engine.group.ring_names
            os.kill(engine.group.pid("runner"), signal.SIGKILL)
        t.join(120)
        ipc.join(120)
        assert isinstance(box.get("err"), EngineDead) and "more than max_restarts=4" in str(box["err"])
        assert len(errors) == 1 and "more than max_restarts=4" in str(errors[0])
        with pytest.raises(EngineDead):
            engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
        assert restarts(engine) == 4 and engine.group.wait_closed(30)
        deadline = time.monotonic() + 10
        while engine.supervisor._thread is not None:  # nothing left trying
            assert time.monotonic() < deadline, "the supervisor's thread is still running"
            time.sleep(0.01)
        assert shm_of(names) == []
    finally:
        servers.stop()
        engine.shutdown()
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
