"""Many hosts on one machine (issue 24). Every test compares greedy tokens with one process at
tp=1 over the same prompts (chunked prefill on: prompts longer than a chunk).

- In-process (`dist_local_runners`): one engine whose two runners, one CPU device each, form a
  tp=2 jax.distributed program and read the scheduler's broadcast ring directly.
- Two `ringserve serve` commands over loopback (`--nnodes 2 --node-rank 0/1`): the real path,
  host 0's relay to host 1's ring over TCP; a weight update whose checkpoint is missing on host 1
  is refused on both; an update from tensors reaches host 1 through the relay; SIGKILL of host 1's runner, or of host 1 as a whole, ends host 0's callers
  with EngineDead within seconds and leaves no process and no shared memory behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.engine.conftest import SMALL, engine_ctx, in_background, random_prompts

CHUNKED = dict(SMALL, chunked_prefill_size=32)
PROMPTS = random_prompts(6, seed=3, lo=20, hi=70)  # most longer than one chunk of 32
GREEDY = {"temperature": 0, "max_new_tokens": 12}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_port() -> int:
    """A port whose successor (the relay's) is free too."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """Another tiny checkpoint (seed 1): its directory and its tensors (what a trainer pushes)."""
    import numpy as np

    from ringserve.model.checkpoints.load import load_checkpoint
    from ringserve.model.checkpoints.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-seed1"), "llama", seed=1)
    return path, {k: np.array(v) for k, v in load_checkpoint(path)[1].items()}


@pytest.fixture(scope="module")
def reference(tiny_dir, other_weights):
    """One process, tp=1: the greedy tokens of PROMPTS, and of the pause test's prompts; and of
    PROMPTS on the other weights (a fresh engine on that checkpoint)."""
    with engine_ctx(tiny_dir("llama"), **CHUNKED) as e:
        out = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        long = e.generate(input_ids=PROMPTS[:3], sampling_params={"temperature": 0, "ignore_eos": True,
                                                                   "max_new_tokens": 60})  # fmt: skip
    with engine_ctx(other_weights[0], **CHUNKED) as e:
        other = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return [o["output_ids"] for o in out], [o["output_ids"] for o in long], [o["output_ids"] for o in other]


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.sweep)])  # CI's 45 minutes
def test_two_runners_in_one_engine_match_one_process(tiny_dir, reference, other_weights, overlap):
    want, want_long, want_other = reference
    path = tiny_dir("llama")
    with engine_ctx(path, tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{dist_port()}", dist_local_runners=True,
                    disable_overlap_schedule=not overlap, **CHUNKED) as e:  # fmt: skip
        assert e.runner_info["devices"] == ["cpu:0", "cpu:2048"]  # one device of each process
        assert set(e.group.pids) >= {"runner", "runner1"}
        assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == want
        # a pause that retracts everything mid-decode, then continue: the same tokens
        t, box = in_background(e, PROMPTS[:3], 60)
        assert e.pause_generation("retract")["success"]
        assert e.continue_generation()["success"]
        t.join(120)
        assert "err" not in box and [o["output_ids"] for o in box["out"]] == want_long
        # weights: an update from disk commits on both runners; a refused one changes nothing
        r = e.update_weights_from_disk(str(path))
        assert r["success"], r
        r = e.update_weights_from_disk(str(path) + "-missing")
        assert not r["success"] and "no such directory" in r["message"]
        # an update from tensors, in several parts (each part agreed by both runners before the
        # pusher writes its segment again): both serve the new weights, as a fresh tp=1 engine
        r = e.update_weights_from_tensor(other_weights[1], bucket_bytes=1 << 18)
        assert r["success"], r
        assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == want_other
        assert e.update_weights_from_disk(str(path))["success"]
        if overlap and importlib.util.find_spec("torch") is not None:
            # a trainer's update group: each host's runner joins as rank 1 + its node rank, both
            # receive every broadcast and commit together
            from tests.engine.test_update_group import Trainer

            t = Trainer(3, "hosts", other_weights[0])
            try:
                r = t.join(e.init_weights_update_group)
                assert r["success"] and "rank 1 of 3" in r["message"], r
                assert t.send(e.update_weights_from_distributed)["success"]
                assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == want_other
            finally:
                assert e.destroy_weights_update_group("hosts")["success"]
                t.quit()
            assert e.update_weights_from_disk(str(path))["success"]
        assert e.release_memory_occupation()["success"] and e.resume_memory_occupation()["success"]
        assert [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == want


# ---- two `ringserve serve` commands ------------------------------------------------------------
SERVE_FLAGS = ["--tp-size", "2", "--nnodes", "2", "--max-running-requests", "16", "--context-length", "256",
               "--max-prefill-tokens", "256", "--max-total-tokens", "8192", "--chunked-prefill-size", "32",
               "--no-socket", "--dist-heartbeat-s", "10"]  # fmt: skip


class Hosts:
    """Two serve processes: host 0 (HTTP) in `cwd0`, host 1 (/health) in `cwd1`."""

    def __init__(self, model: Path, cwd0: Path, cwd1: Path, token: str = "test-token"):
        self.dist, self.http, self.health = dist_port(), free_port(), free_port()
        env = dict(os.environ, RINGSERVE_DIST_TOKEN=token, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
        env.pop("XLA_FLAGS", None)
        env.pop("JAX_NUM_CPU_DEVICES", None)
        cmd = [sys.executable, "-m", "ringserve.actors.cli.main", "serve", "--model", str(model), *SERVE_FLAGS,
               "--dist-init-addr", f"127.0.0.1:{self.dist}"]  # fmt: skip
        self.logs = [open(cwd / f"host{k}.log", "w+") for k, cwd in enumerate((cwd0, cwd1))]
        self.procs = [
            subprocess.Popen([*cmd, "--node-rank", str(k), "--port", str(port)], cwd=cwd, env=env,
                             stdout=self.logs[k], stderr=subprocess.STDOUT, start_new_session=True)
            for k, (cwd, port) in enumerate(((cwd0, self.http), (cwd1, self.health)))
        ]  # fmt: skip

    def log(self, k: int, tail: int = 4000) -> str:
        self.logs[k].seek(0)
        return self.logs[k].read()[-tail:]

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for k, p in enumerate(self.procs):
                assert p.poll() is None, f"host {k} exited:\n{self.log(k)}"
            if "ready in" in self.log(0) and self.get(self.health, "/health")[0] == 200:
                return
            time.sleep(1)
        raise AssertionError(f"not ready in {timeout} s:\n{self.log(0)}\n{self.log(1)}")

    def get(self, port: int, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError:
            return 0, b""

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def generate(self, prompts, sp) -> list:
        status, out = self.post("/generate", {"input_ids": prompts, "sampling_params": sp})
        assert status == 200, out
        return [o["output_ids"] for o in out]

    def pids(self) -> list[int]:
        """Every process of both hosts (the serve commands and their actors)."""
        out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout.split("\n")
        sids = {p.pid for p in self.procs}
        return [int(ln.split()[0]) for ln in out if ln.strip() and int(ln.split()[1]) in sids]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in self.logs:
            f.close()


def runner_pid(hosts: Hosts, k: int) -> int:
    """The runner actor of host k (its child with the most memory: the model and the programs)."""
    out = subprocess.run(["ps", "-o", "pid=,rss=", "--ppid", str(hosts.procs[k].pid)], capture_output=True,
                         text=True).stdout  # fmt: skip
    return int(max((ln.split() for ln in out.splitlines() if ln.strip()), key=lambda r: int(r[1]))[0])


def pending_generate(hosts: Hosts, n: int) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def go() -> None:
        box["resp"] = hosts.post("/generate", {"input_ids": PROMPTS[:n], "sampling_params": {
            "temperature": 0, "ignore_eos": True, "max_new_tokens": 180}})  # fmt: skip
        box["t"] = time.monotonic()

    t = threading.Thread(target=go)
    t.start()
    time.sleep(1.0)  # decoding by now
    return t, box


def check_gone(hosts: Hosts, dead_at: float, t: threading.Thread, box: dict, codes: list[int]) -> None:
    """The pending call ended with EngineDead within 10 s of `dead_at`; both hosts exited with
    `codes`, none of their processes is left, nor any shared-memory name they created."""
    t.join(30)
    status, body = box["resp"]
    assert status == 503 and "the engine is down" in json.dumps(body), body
    assert box["t"] - dead_at < 10
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (any(p.poll() is None for p in hosts.procs) or hosts.pids()):
        time.sleep(0.2)
    assert [p.poll() for p in hosts.procs] == codes
    assert hosts.pids() == []
    mine = "|".join(str(p.pid) for p in hosts.procs)
    assert [f for f in os.listdir("/dev/shm") if re.match(rf"(sem\.)?rs-({mine})-", f)] == []


@pytest.mark.sweep  # 53 s: out of CI's 45 minutes (host 1 killed whole stays in)
def test_two_serve_commands_relay_refuse_together_and_die_together(tiny_dir, reference, other_weights, tmp_path):
    from ringserve.actors.frontend.weight_buckets import safetensors_stream

    want, _, want_other = reference
    model = tiny_dir("llama")
    (tmp_path / "h0").mkdir()
    (tmp_path / "h1").mkdir()
    shutil.copytree(model, tmp_path / "h0" / "ckpt")  # each runner reads /proc/self/cwd/ckpt: host 0's only
    hosts = Hosts(model, tmp_path / "h0", tmp_path / "h1")
    try:
        hosts.wait_ready()
        assert hosts.generate(PROMPTS, GREEDY) == want
        # a stranger at the relay port: refused (the relay listens only until every host joined)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", hosts.dist + 1), timeout=2)
        # the checkpoint is missing on host 1: refused everywhere, the old weights serve on both
        status, r = hosts.post("/update_weights_from_disk", {"model_path": "/proc/self/cwd/ckpt"})
        assert not r["success"] and "another host" in r["message"], r
        assert hosts.generate(PROMPTS, GREEDY) == want
        status, r = hosts.post("/update_weights_from_disk", {"model_path": str(model)})
        assert r["success"], r
        assert hosts.generate(PROMPTS, GREEDY) == want
        # an update from tensors (HTTP, several buckets through host 0's one segment): host 0's
        # relay sends each part's bytes, host 1 stages them from its own segments; both serve
        # the new weights, as a fresh tp=1 engine on them
        body = b"".join(safetensors_stream(other_weights[1], bucket_bytes=1 << 18))
        req = urllib.request.Request(f"http://127.0.0.1:{hosts.http}/update_weights_from_tensor", body,
                                     {"Content-Type": "application/octet-stream"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=300) as resp:
            r = json.loads(resp.read())
        assert r["success"], r
        assert hosts.generate(PROMPTS, GREEDY) == want_other
        parts = re.findall(r"relay: a weight update's part, (\d+) bytes", hosts.log(1, tail=1 << 30))
        assert len(parts) > 1 and sum(map(int, parts)) >= sum(a.nbytes for a in other_weights[1].values())
        status, r = hosts.post("/update_weights_from_disk", {"model_path": str(model)})
        assert r["success"], r
        # host 1's runner SIGKILLed mid-decode: host 0's callers get EngineDead within seconds
        t, box = pending_generate(hosts, 3)
        os.kill(runner_pid(hosts, 1), signal.SIGKILL)
        check_gone(hosts, time.monotonic(), t, box, [1, 1])
    finally:
        hosts.kill()


@pytest.mark.slow
def test_host_1_killed_whole_ends_host_0(tiny_dir, tmp_path):
    hosts = Hosts(tiny_dir("llama"), tmp_path, tmp_path)
    try:
        hosts.wait_ready()
        t, box = pending_generate(hosts, 3)
        os.kill(hosts.procs[1].pid, signal.SIGKILL)  # the serve command; its actors follow it
        check_gone(hosts, time.monotonic(), t, box, [1, -signal.SIGKILL])
    finally:
        hosts.kill()
