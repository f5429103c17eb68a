"""SGLang's router (the `sglang-router` package, a Rust binary) in front of two `ringserve serve`
processes: registration, /generate and /v1/chat/completions through it equal direct calls,
its load poll of /get_load, and a killed server taken out while the other keeps answering.

    python -m ringserve.bench.router [--router-python PATH] [--requests 64] [--policy cache_aware]

The router is the one tools/install_peers.sh installs into $RINGSERVE_CACHE/peers/router
(sglang-router 0.3.2); `--router-python` points at another interpreter that has it.

Steps: start two servers (tiny model, HTTP only, ports picked free), start the router with
`--worker-urls` of both (health checks every second) and beside it a second router with
`--policy power_of_two` over the same two (each router's Prometheus exporter on a free port: the
default 29000 may be taken by another router here, and the router panics on it), then
1. `--requests` greedy /generate calls and as many /v1/chat/completions through the router, all
   at once, and 16 /generate through the power_of_two one; each equals the same call made
   directly to server 0 (the servers have equal weights);
2. the load poll: sglang-router 0.3.2 polls GET /get_load only for `power_of_two` (its load
   monitor, every 30 s; a `cache_aware` router never calls it) and on its own GET /get_loads.
   Each server counts the calls it served in /metrics (`ringserve:load_reports_total{route=
   "/get_load"}`), sampled every second: the check wants two polls on each server, the router's
   debug log line "Fetched loads from 2 workers" for them and no warning or error about loads;
   then, with one long request paused in place on each server (a load that holds still), the
   router's GET /get_loads must give each server exactly the sum of `num_tokens` our /get_load
   reports (the router records -1 for a reply it cannot parse: a fake worker answering
   `{"load": 3}` got -1, ours the sum);
3. each server's /get_load answers in SGLang's list shape (one entry per dp_rank), and
   /flush_cache through the router reaches every worker;
4. server 1 is killed (SIGKILL); after the router's health check marks it down, 16 more
   requests through the router are all answered.
Prints one JSON report; exits 1 if a check failed.

Runs (sglang-router 0.3.2, policy cache_aware, tiny model, CPU with 2 cores shared):
- before the load-poll check (load average 10.6-13.4): 64 /generate and 64 /v1/chat/completions
  through the router answered in 12.96 s, every one equal to the direct call; /get_load in
  SGLang's list shape; POST /flush_cache through the router 200; after SIGKILL of server 1, 16 of
  16 answered.
- with it (load average 10.3 before, 13.5 after): 64 + 64 through the router in 10.13 s and 16
  through the power_of_two router, all equal to the direct calls; each server's /get_load was
  polled by the power_of_two router at 35.2 s and 64.5 s / 33.8 s and 64.9 s after the routers
  started (its log: 2 fetches from 2 workers, no load warning); with a request paused on each,
  the router's /get_loads read loads 96 and 128, our num_tokens 96 and 128, and its call reached
  each server once; flush 200; after the kill 16 of 16 answered.
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
import threading
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


def start_router(python: str, urls: list[str], policy: str, log_level: str = "info") -> tuple[subprocess.Popen, str, Path]:
    """The router on free ports (its own and its Prometheus exporter's: the default 29000 may be
    taken by another router on this machine, and the router panics on it), its log in /tmp."""
    port = free_port()
    log_path = Path(f"/tmp/ringserve-router-{os.getpid()}-{policy}.log")
    proc = subprocess.Popen(
        [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-port", str(free_port()), "--worker-urls", *urls, "--policy", policy,
         "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", log_level],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}", log_path


def load_reports(url: str) -> int:
    """How many times `url` served GET /get_load (its /metrics counter)."""
    line = 'ringserve:load_reports_total{route="/get_load"}'
    text = httpx.get(url + "/metrics", timeout=30).text
    return int(next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0))


class PollCounter(threading.Thread):
    """Samples each server's count of GET /get_load served (its /metrics counter) every second
    from the router's start: `polled_at_s[i]` holds when (seconds from `started`) each new call
    to server i was seen."""

    def __init__(self, urls: list[str], started: float):
        super().__init__(daemon=True)
        self.urls, self.started = urls, started
        self.last = [load_reports(u) for u in urls]
        self.polled_at_s: list[list[float]] = [[] for _ in urls]
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            for i, u in enumerate(self.urls):
                try:
                    n = load_reports(u)
                except httpx.HTTPError:
                    continue
                self.polled_at_s[i] += [round(time.monotonic() - self.started, 1)] * (n - self.last[i])
                self.last[i] = n


def load_poll(counter: PollCounter, router_url: str, log_path: Path, polls: int = 2, timeout: float = 100) -> dict:
    """The power_of_two router's load monitor reads our /get_load: each server's count of GET
    /get_load served rises `polls` times (the router polls every 30 s), the router logs each fetch
    from both workers and no warning or error about loads, and its own GET /get_loads (which
    polls every worker there and then: one more call each) gives each server the sum of
    `num_tokens` our /get_load reports, while a request on each server is paused in place (a
    load above 0 that holds still; -1 is what the router records for a reply it cannot parse)."""
    urls = counter.urls
    deadline = time.monotonic() + timeout
    while min(len(x) for x in counter.polled_at_s) < polls and time.monotonic() < deadline:
        time.sleep(1)
    counter.halt.set()
    counter.join()
    log = log_path.read_text(errors="replace")
    fetched = [x for x in log.splitlines() if "Fetched loads from 2 workers" in x]
    complaints = [x[-300:] for x in log.splitlines()
                  if ("WARN" in x or "ERROR" in x) and "load" in x.lower() and "tokenizer" not in x.lower()]  # fmt: skip
    # (one "No loads fetched from workers" at the start is its first tick, before the workers registered)
    complaints = [x for x in complaints if "No loads fetched from workers" not in x]
    long = {"input_ids": list(range(3, 60)), "sampling_params": {**GREEDY, "max_new_tokens": 400}}
    with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
        running = [pool.submit(httpx.post, u + "/generate", json=long, timeout=600) for u in urls]
        while not all(httpx.get(u + "/get_load").json()[0]["num_reqs"] for u in urls):
            time.sleep(0.05)
        for u in urls:
            httpx.post(u + "/pause_generation", json={"mode": "in_place"}, timeout=60)
        before = [load_reports(u) for u in urls]
        router_view = httpx.get(router_url + "/get_loads", timeout=30).json()
        after = [load_reports(u) for u in urls]
        ours = [sum(ld["num_tokens"] for ld in httpx.get(u + "/get_load", timeout=30).json()) for u in urls]
        for u in urls:
            httpx.post(u + "/continue_generation", json={}, timeout=60)
        long_ok = [f.result().status_code == 200 for f in running]
    by_url = {w["worker"]: w["load"] for w in router_view.get("workers", [])}
    out = {"polled_at_s": counter.polled_at_s, "router_log_fetches": len(fetched),
           "router_log_load_complaints": complaints, "router_get_loads_while_paused": router_view,
           "our_num_tokens_while_paused": ours,
           "its_get_loads_polled_each_once": [a - b for a, b in zip(after, before, strict=True)]}  # fmt: skip
    out["ok"] = (min(len(x) for x in counter.polled_at_s) >= polls and len(fetched) >= polls and not complaints
                 and [by_url.get(u) for u in urls] == ours and min(ours) > 0 and all(long_ok)
                 and min(out["its_get_loads_polled_each_once"]) >= 1)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.router", description=__doc__.split("\n\n")[0])
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
            cmd = [sys.executable, "-c", "import sys; from ringserve.actors.cli.main import main; sys.exit(main())", "serve",
                   "--model", "tiny", "--port", str(p), "--no-socket", "--page-size", "16",
                   "--max-total-tokens", "16384", "--context-length", "512"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc)
        # the router under test, and one with power_of_two (the policy whose load monitor polls
        # /get_load) over the same two servers, started together
        router, router_url, log_path = start_router(args.router_python, urls, args.policy)
        procs.append(router)
        p2, p2_url, p2_log = start_router(args.router_python, urls, "power_of_two", "debug")
        procs.append(p2)
        counter = PollCounter(urls, time.monotonic())
        counter.start()
        wait_healthy(router_url, router, timeout=120)
        wait_healthy(p2_url, p2, timeout=120)

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
            routed_p2 = list(pool.map(lambda i: gen(p2_url, i), range(16)))
        report["generate_equal"] = routed_g == direct_g
        report["chat_equal"] = routed_c == direct_c
        report["power_of_two_generate_equal"] = routed_p2 == direct_g[:16]
        ok &= routed_g == direct_g and routed_c == direct_c and routed_p2 == direct_g[:16]
        poll = load_poll(counter, p2_url, p2_log)
        report["load_poll"] = poll
        ok &= poll["ok"]
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
