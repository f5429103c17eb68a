"""Restarts of `ringserve serve` under load, measured (issue 28's "must show"; not run in CI).

    python -m ringserve.bench.restart [--model DIR] [--requests 64] [--max-new 48] [--output restart.json]

1. `ringserve serve` (deterministic mode) on a tiny model; every request's uninterrupted output
   first (greedy and seeded, half each).
2. For each surface, HTTP (SSE /generate) and then the IPC socket (`Client`): `--requests`
   streaming requests at once, each on its own stream; the scheduler, the runner and the
   detokenizer SIGKILLed in turn while they stream. Every request must complete, each stream
   must never repeat text or take an id back, and every output must equal the uninterrupted
   one. Timed: SIGKILL -> first token streamed again.
3. A crash loop: a server with --max-restarts 4, 16 streams (HTTP and IPC), the runner killed 5
   times in a row: every caller gets the engine's death (EngineDead / an error event), `serve`
   exits 1, and nothing is left behind (no shared-memory segment of it, no socket file).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from ringserve.bench.soak import SHAPES, prompts, sampling

ACTORS = ("scheduler", "runner", "detokenizer")
LOGS = Path(tempfile.mkdtemp(prefix="ringserve-restart-logs-"))  # each server's output, kept


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`ringserve serve` in a subprocess, on a socket in `workdir` and a free port."""

    def __init__(self, model: str, workdir: Path, *flags: str):
        self.sock, self.port = str(workdir / "engine.sock"), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        shapes = [x for k, v in SHAPES.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        cmd = [sys.executable, "-m", "ringserve.actors.cli.main", "serve", "--model", model, "--socket", self.sock,
               "--port", str(self.port), "--enable-deterministic-inference", *shapes, *flags]  # fmt: skip
        self.log = open(LOGS / f"serve-{time.time_ns()}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}: see {self.log.name}"
            assert time.monotonic() < deadline, "serve did not come up"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200 and os.path.exists(self.sock):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def info(self) -> dict:
        r = httpx.get(self.url + "/get_server_info", timeout=300)
        assert r.status_code == 200, (r.status_code, r.text)
        return r.json()

    def shm(self) -> list[str]:
        return [f for f in os.listdir("/dev/shm") if f"rs-{self.proc.pid}-" in f]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        self.log.close()
        return rc


class Streams:
    """`reqs` requests at once, each on its own stream over `surface`; each chunk must extend the
    one before. `last_token_at`: when any stream last got a new id."""

    def __init__(self, server: Server, surface: str, reqs: list[tuple[list[int], dict]]):
        self.final: dict[int, dict] = {}
        self.errors: dict[int, str] = {}
        self.tokens, self.last_token_at = 0, 0.0
        self.lock = threading.Lock()
        target = self._http if surface == "http" else self._ipc
        self.threads = [threading.Thread(target=self._guard, args=(target, server, i, p, sp), daemon=True)
                        for i, (p, sp) in enumerate(reqs)]  # fmt: skip
        for t in self.threads:
            t.start()

    def _guard(self, target, server: Server, i: int, p: list[int], sp: dict) -> None:
        last: dict[str, Any] = {"text": "", "output_ids": []}
        try:
            for chunk in target(server, p, sp):
                assert chunk["text"].startswith(last["text"]), (i, last["text"], chunk["text"])
                assert chunk["output_ids"][: len(last["output_ids"])] == last["output_ids"], i
                with self.lock:
                    if len(chunk["output_ids"]) > len(last["output_ids"]):
                        self.tokens += len(chunk["output_ids"]) - len(last["output_ids"])
                        self.last_token_at = time.monotonic()
                last = chunk
            if last.get("meta_info", {}).get("finish_reason") is None:
                raise RuntimeError("the stream ended before its request finished")
            self.final[i] = last
        except Exception as e:
            self.errors[i] = f"{type(e).__name__}: {e}"

    @staticmethod
    def _http(server: Server, p: list[int], sp: dict):
        with httpx.stream("POST", server.url + "/generate", json={"input_ids": p, "sampling_params": sp, "stream": True},
                          timeout=None) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    yield chunk

    @staticmethod
    def _ipc(server: Server, p: list[int], sp: dict):
        from ringserve import Client

        with Client(server.sock) as c:
            yield from c.generate(input_ids=p, sampling_params=sp, stream=True)

    def wait_tokens(self, more: int, timeout: float = 300) -> None:
        start, deadline = self.tokens, time.monotonic() + timeout
        while self.tokens < start + more:
            assert time.monotonic() < deadline, f"no {more} tokens within {timeout} s; errors {self.errors}"
            time.sleep(0.01)

    def join(self, timeout: float = 600) -> None:
        for t in self.threads:
            t.join(timeout)


def kills(server: Server, surface: str, reqs: list[tuple[list[int], dict]], want: list[list[int]]) -> dict:
    s = Streams(server, surface, reqs)
    times: dict[str, dict] = {}
    for k, actor in enumerate(ACTORS, start=1):
        s.wait_tokens(len(reqs) * 2)  # every stream is under way
        pid = server.info()["actor_pids"][actor]
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        info = server.info()  # (waits while the actors start again)
        while info["restarts"] < k:
            time.sleep(0.01)
            info = server.info()
        first = _first_token_after_restart(s, t_kill, info)
        times[actor] = {"kill_to_first_token_s": round(first - t_kill, 2), **info["last_restart"]}
    s.join()
    wrong = [i for i, w in enumerate(want) if i in s.final and s.final[i]["output_ids"] != w]
    return {"surface": surface, "requests": len(reqs), "completed": len(s.final), "errors": s.errors,
            "wrong": wrong, "restart": times}  # fmt: skip


def _first_token_after_restart(s: Streams, t_kill: float, info: dict) -> float:
    """The first id streamed by the new actors: after the supervisor resubmitted (its
    `last_restart.seconds` after the kill, at most)."""
    t_resubmitted = t_kill + info["last_restart"]["seconds"]
    deadline = time.monotonic() + 300
    while s.last_token_at < t_resubmitted:
        assert time.monotonic() < deadline, "no token after the restart"
        time.sleep(0.002)
    return s.last_token_at


def crash_loop(model: str, workdir: Path, reqs: list[tuple[list[int], dict]]) -> dict:
    server = Server(model, workdir, "--max-restarts", "4", "--restart-window-s", "600")
    long = [(p, {**sp, "max_new_tokens": 150}) for p, sp in reqs]  # (still running at the fifth kill)
    http, ipc = Streams(server, "http", long[:8]), Streams(server, "ipc", long[8:16])
    for k in range(5):
        while True:
            try:
                info = server.info()
                if info["restarts"] >= k:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        os.kill(info["actor_pids"]["runner"], signal.SIGKILL)
    http.join(300)
    ipc.join(300)
    rc = server.proc.wait(300)
    server.log.close()
    return {"http_errors": len(http.errors), "ipc_errors": len(ipc.errors), "completed": len(http.final) + len(ipc.final),
            "example_error": next(iter(ipc.errors.values()), None), "serve_exit_code": rc,
            "all_name_the_crash_loop": all("more than max_restarts=4" in e for e in [*http.errors.values(), *ipc.errors.values()]),
            "shm_left": server.shm(), "socket_left": os.path.exists(server.sock)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.restart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: a tiny random Llama)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--output", default="restart.json")
    a = ap.parse_args(argv)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ringserve-restart-") as d:
        work = Path(d)
        if a.model is None:
            from ringserve.model.checkpoints.tiny import make_tiny_model

            a.model = str(make_tiny_model(work / "tiny", "llama", seed=0))
        ps = prompts(a.requests, seed=28)
        reqs = [(p, sampling("greedy" if i % 2 == 0 else "seeded", i, a.max_new)) for i, p in enumerate(ps)]
        server = Server(a.model, work, "--max-restarts", "10")  # (six kills within a minute)
        from ringserve import Client

        with Client(server.sock) as c:
            want = [o["output_ids"] for o in c.generate(input_ids=[p for p, _ in reqs], sampling_params=[sp for _, sp in reqs])]
        report["kills"] = [kills(server, surface, reqs, want) for surface in ("http", "ipc")]
        info = server.info()
        report["restarts"] = {k: info[k] for k in ("restarts", "restarts_by_actor", "last_restart")}
        report["integrity_errors"] = info["integrity_errors"]
        report["metrics"] = [x for x in httpx.get(server.url + "/metrics").text.splitlines() if "restart" in x and not x.startswith("#")]
        report["serve_exit_code_after_sigterm"] = server.stop()
        report["shm_left_after_sigterm"] = server.shm()
        report["crash_loop"] = crash_loop(a.model, work, reqs)
    Path(a.output).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    ok = all(k["completed"] == k["requests"] and not k["wrong"] and not k["errors"] for k in report["kills"])
    cl = report["crash_loop"]
    ok = ok and cl["serve_exit_code"] == 1 and cl["http_errors"] + cl["ipc_errors"] == 16 and cl["all_name_the_crash_loop"]
    ok = ok and not cl["shm_left"] and not cl["socket_left"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
