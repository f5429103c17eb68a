"""SGLang's router (the `sglang-router` package, a Rust binary) in front of two `ringserve serve`
processes: registration, /generate and /v1/chat/completions through it equal direct calls,
its load poll of /get_load, and a killed server taken out while the other keeps answering.

    python -m bench.router [--router-python PATH] [--requests 64] [--policy cache_aware]

The router is the one tools/install_peers.sh installs into $RINGSERVE_CACHE/peers/router
(sglang-router 0.3.2); `--router-python` points at another interpreter that has it.

Steps: start two servers (tiny model, HTTP only, ports picked free), start the router with
`--worker-urls` of both (health checks every second), then
1. `--requests` greedy /generate calls and as many /v1/chat/completions through the router, all
   at once; each equals the same call made directly to server 0 (the servers have equal weights);
2. each server's /get_load answers in the shape the router's load poll parses (one entry per
   dp_rank), and /flush_cache through the router reaches every worker;
3. server 1 is killed (SIGKILL); after the router's health check marks it down, 16 more
   requests through the router are all answered.
Prints one JSON report; exits 1 if a check failed.

One run (sglang-router 0.3.2, policy cache_aware, tiny model, CPU with 2 cores shared; load
average 10.6-13.4): 64 /generate and 64 /v1/chat/completions through the router answered in
12.96 s, every one equal to the direct call; /get_load answered in SGLang's list shape; POST
/flush_cache through the router 200; after SIGKILL of server 1, 16 of 16 requests answered.
Not observed: the router's load poll itself (its log does not show the calls it makes to
workers); what it parses is checked by replaying its request bodies in tests/engine/test_dp.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy within {timeout} s")


def body(r: httpx.Response) -> object:
    try:
        return r.json()
    except ValueError:
        return f"{r.status_code} {r.text[:300]}"


def default_router_python() -> str:
    cache = Path(os.environ.get("RINGSERVE_CACHE", Path.home() / ".cache" / "ringserve"))
    return str(cache / "peers" / "router" / "bin" / "python")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--router-python", default=default_router_python())
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--policy", default="cache_aware")
    args = ap.parse_args(argv)
    if not Path(args.router_python).exists():
        print(f"no router: {args.router_python} does not exist (tools/install_peers.sh installs it)")
        return 2
    procs: list[subprocess.Popen] = []
    report: dict = {"load_before": os.getloadavg()}
    ok = True
    try:
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for p in ports:
            cmd = [sys.executable, "-c", "import sys; from actors.cli.main import main; sys.exit(main())", "serve",
                   "--model", "tiny", "--port", str(p), "--no-socket", "--page-size", "16",
                   "--max-total-tokens", "16384", "--context-length", "512"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc)
        rport = free_port()
        router_url = f"http://127.0.0.1:{rport}"
        log_path = Path(f"/tmp/ringserve-router-{os.getpid()}.log")
        router = subprocess.Popen(
            [args.router_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(rport),
             "--worker-urls", *urls, "--policy", args.policy, "--health-check-interval-secs", "1",
             "--health-failure-threshold", "1"],
            stdout=log_path.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(router)
        wait_healthy(router_url, router, timeout=120)

        model = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        prompts = [f"request {i}: the quick brown fox number {i % 7}" for i in range(args.requests)]

        def gen(url: str, i: int) -> list[int]:
            r = httpx.post(url + "/generate", json={"text": prompts[i], "sampling_params": GREEDY}, timeout=300)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: /generate answered {r.status_code}: {r.text[:500]}")
            return r.json()["output_ids"]

        def chat(url: str, i: int) -> str:
            body = {"model": model, "messages": [{"role": "user", "content": prompts[i]}], "temperature": 0,
                    "max_tokens": 12}  # fmt: skip
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: /v1/chat/completions answered {r.status_code}: {r.text[:500]}")
            return r.json()["choices"][0]["message"]["content"]

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            t = time.perf_counter()
            routed_g = list(pool.map(lambda i: gen(router_url, i), range(args.requests)))
            routed_c = list(pool.map(lambda i: chat(router_url, i), range(args.requests)))
            report["routed_s"] = round(time.perf_counter() - t, 2)
            direct_g = list(pool.map(lambda i: gen(urls[0], i), range(args.requests)))
            direct_c = list(pool.map(lambda i: chat(urls[0], i), range(args.requests)))
        report["generate_equal"] = routed_g == direct_g
        report["chat_equal"] = routed_c == direct_c
        ok &= routed_g == direct_g and routed_c == direct_c
        loads = [httpx.get(u + "/get_load").json() for u in urls]
        report["get_load"] = loads
        flushed = httpx.post(router_url + "/flush_cache", timeout=60)
        report["flush_cache_through_router"] = flushed.status_code
        ok &= flushed.status_code == 200 and all(isinstance(ld, list) and ld[0]["dp_rank"] == 0 for ld in loads)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        time.sleep(4)  # a few health checks
        after = []
        for i in range(16):
            try:
                after.append(gen(router_url, i) == direct_g[i])
            except (httpx.HTTPError, RuntimeError) as e:
                after.append(repr(e))
        report["after_kill"] = after
        ok &= all(x is True for x in after)
        report["router_workers_after"] = body(httpx.get(router_url + "/workers"))
        report["router_log_tail"] = log_path.read_text()[-1500:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    report["load_after"] = os.getloadavg()
    report["ok"] = ok
    print(json.dumps(report, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
