"""ringserve against what a user would pick instead on this machine (issue 29): each system is
started alone as an HTTP server on 127.0.0.1, driven by one client with one workload, stopped;
the systems alternate over the rounds, every run is printed, then the ratios to ringserve.

    python -m ringserve.bench.peers [--model smollm2] [--systems ringserve vllm vllm-bf16 llamacpp llamacpp-q4_1]
                          [--rounds 2] [--output-json PATH]
    python -m ringserve.bench.peers --tree before=../before --systems ringserve-bf16@before ringserve-bf16 vllm-bf16

Peers come from tools/install_peers.sh (vLLM for CPU; llama.cpp's own llama-server), which puts
them into $RINGSERVE_CACHE/peers/; one that is absent, or whose model file cannot be made, is
skipped and the report says why (bench/peer_systems.py: the systems, their commands and model
files). The report and every server's log go to --output-json's folder.

One run of one system:

    start ──► ready (first 1-token completion answered) ──► compiled (ringserve: no step program
    pending; the others: = ready) ──► warm-up ──► burst ──► single stream ──► stop (SIGTERM)

    burst          `--burst` requests sent at once (default 64: prompts of 32-512 random tokens,
                   32-256 output tokens), greedy, ignore_eos, streamed through OpenAI's
                   /v1/completions (bench/backends.py): offline output tok/s, TTFT median
    single stream  `--single` other requests (default 8) one at a time: ITL and TTFT medians

Also per run: seconds to ready and to compiled from the start of the process, peak RSS of the
server's process tree over its whole life and peak PSS at the ends of its phases (PSS is costly to
read, so never during a timed phase: bench/proc_tree.py), cores its tree kept busy
during the burst, and the 1-minute load average when the run began (the machine may be shared:
read a figure next to it). Ratios use each system's median over rounds; > 1: ringserve better.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ringserve.bench import peer_systems as ps
from ringserve.bench.metrics import RequestRecord, compute_metrics
from ringserve.bench.proc_tree import TreeSampler, tree_usage
from ringserve.bench.workload import FIRST_ID, Request, random_requests

# the headline figures of a run: (key, label, higher is better (None: no ratio), format)
HEADLINE = (
    ("out_tok_s", "out tok/s", True, "{:.1f}"),
    ("ttft_median_s", "TTFT med (s)", False, "{:.2f}"),
    ("single_itl_ms", "1-stream ITL (ms)", False, "{:.1f}"),
    ("single_ttft_ms", "1-stream TTFT (ms)", False, "{:.0f}"),
    ("ready_s", "ready (s)", False, "{:.1f}"),
    ("compiled_s", "compiled (s)", False, "{:.1f}"),
    ("peak_rss_mb", "peak RSS (MB)", False, "{:.0f}"),
    ("peak_pss_mb", "peak PSS (MB)", False, "{:.0f}"),
    ("cores_busy", "cores busy", None, "{:.2f}"),  # how, not how well
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    burst: list[Request]
    single: list[Request]


def make_workload(vocab: int, seed: int = 0, burst: int = 64, single: int = 8, input_len: tuple[int, int] = (32, 512),
                  output_len: tuple[int, int] = (32, 256)) -> Workload:  # fmt: skip
    """The burst and, from another seed, the single-stream requests (no prompt of one is a
    prefix of the other's, so no prefix cache serves the single stream from the burst)."""
    return Workload(random_requests(burst, vocab, seed, input_len, output_len),
                    random_requests(single, vocab, seed + 1, input_len, output_len))  # fmt: skip


def headline(burst: dict[str, Any], single: dict[str, Any]) -> dict[str, Any]:
    """The HEADLINE figures that come from the two phases' compute_metrics."""
    ttft = burst.get("ttft_ms_median")
    return {"out_tok_s": burst.get("output_throughput"), "ttft_median_s": None if ttft is None else ttft / 1e3,
            "single_itl_ms": single.get("itl_ms_median"), "single_ttft_ms": single.get("ttft_ms_median")}  # fmt: skip


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per system, the median of each headline figure over its runs that completed."""
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["system"] for r in runs):
        ok = [r for r in runs if r["system"] == name and not r.get("error")]
        out[name] = {}
        for key, *_ in HEADLINE:
            vals = [r[key] for r in ok if r.get(key) is not None]
            if vals:
                out[name][key] = statistics.median(vals)
    return out


def ratios(med: dict[str, dict[str, float]], reference: str = "ringserve") -> dict[str, dict[str, float]]:
    """Per other system, ringserve's advantage on each figure both have: reference/peer where
    higher is better, peer/reference where lower is (> 1: the reference is better)."""
    ours = med.get(reference)
    if not ours:
        return {}
    out: dict[str, dict[str, float]] = {}
    for name, theirs in med.items():
        if name == reference:
            continue
        out[name] = {}
        for key, _, higher, _ in HEADLINE:
            a, b = ours.get(key), theirs.get(key)
            if a and b and higher is not None:
                out[name][key] = a / b if higher else b / a
    return out


def format_runs(runs: list[dict[str, Any]]) -> str:
    cols = (
        [("system", 16), ("round", 5)]
        + [(label, max(len(label), 9)) for _, label, _, _ in HEADLINE]
        + [("load1", 5)]
    )
    lines = ["  ".join(f"{c:>{w}s}" for c, w in cols)]
    for r in runs:
        cells = [f"{r['system']:>16s}", f"{r['round']:>5d}"]
        for (key, _, _, fmt), (_, w) in zip(HEADLINE, cols[2:], strict=False):
            v = r.get(key)
            cells.append(f"{'-' if v is None else fmt.format(v):>{w}s}")
        cells.append(f"{r.get('load1', 0):5.2f}")
        line = "  ".join(cells)
        lines.append(line + (f"   error: {r['error'][:200]}" if r.get("error") else ""))
    return "\n".join(lines)


def format_ratios(rat: dict[str, dict[str, float]], reference: str) -> str:
    if not rat:
        return f"(no ratios: they need a completed run of {reference} and of at least one peer)"
    keys = [(k, label) for k, label, higher, _ in HEADLINE if higher is not None]
    lines = [f"{reference} vs each peer, medians over rounds (> 1: {reference} better)",
             f"{'peer':>16s}  " + "  ".join(f"{label:>{max(len(label), 9)}s}" for _, label in keys)]  # fmt: skip
    for name, r in rat.items():
        cells = [f"{'-' if r.get(k) is None else f'{r[k]:.2f}x':>{max(len(label), 9)}s}" for k, label in keys]
        lines.append(f"{name:>16s}  " + "  ".join(cells))
    return "\n".join(lines)


# ---- one run ---------------------------------------------------------------------------------


class ServerFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(path: Path) -> str:
    """The server log's last non-empty line (where a dying server says why)."""
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except FileNotFoundError:
        return ""
    return lines[-1].strip() if lines else ""


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> str:
    """The served model's name once a 1-token completion is answered; ServerFailed if the
    process exits or `timeout` passes first."""
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=30) as h:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerFailed(f"exited with {proc.returncode} before it was ready: {_last_line(log)}")
            try:
                r = h.get("/v1/models")
                if r.status_code == 200:
                    name = r.json()["data"][0]["id"]
                    body = {
                        "model": name,
                        "prompt": [FIRST_ID, FIRST_ID + 1],
                        "max_tokens": 1,
                        "temperature": 0,
                    }
                    if h.post("/v1/completions", json=body).status_code == 200:
                        return name
            except (httpx.TransportError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.05)  # (0.25 s added up to a quarter second to every system's ready)
    raise ServerFailed(f"not ready after {timeout:.0f}s; its log ends: {_last_line(log)}")


def wait_compiled(url: str, timeout: float) -> None:
    """ringserve: until its background compile has no step program pending."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        if info.get("compile_error"):
            raise ServerFailed(f"background compile failed: {info['compile_error']}")
        if not info.get("programs_pending"):
            return
        time.sleep(0.5)
    raise ServerFailed(f"step programs still compiling after {timeout:.0f}s")


async def send_all(url: str, model: str, reqs: list[Request], concurrency: int | None, desc: str,
                   progress: bool) -> list[RequestRecord]:  # fmt: skip
    import httpx

    from ringserve.bench.backends import drive, http_sender

    n = concurrency or len(reqs)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as h:
        inner = http_sender(h, model)

        async def send(req: Request, rec: RequestRecord) -> None:
            await inner(req, rec)
            if rec.output_len == 0 and rec.error is None:  # a server that sends no usage
                rec.output_len = sum(rec.chunk_tokens)

        return await drive(send, reqs, [0.0] * len(reqs), concurrency, progress, desc)


def run_one(s: ps.System, served: Path, wl: Workload, a: argparse.Namespace, layout: ps.Layout, logdir: Path,
            rnd: int) -> dict[str, Any]:  # fmt: skip
    port = free_port()
    lim = ps.Limits(max_len=a.max_len, parallel=a.burst, threads=a.threads)
    cmd = ps.launch(s, served, port, lim, layout, tuple(a.extra.get(s.kind, ())))
    url = f"http://127.0.0.1:{port}"
    log = logdir / f"{s.name}.round{rnd}.log"
    run: dict[str, Any] = {"system": s.name, "kind": s.kind, "precision": s.precision, "round": rnd,
                           "served": str(served), "argv": cmd.argv, "env": cmd.env, "log": str(log),
                           "load1": os.getloadavg()[0]}  # fmt: skip
    print(f"[{s.name} round {rnd}] starting: {' '.join(cmd.argv)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, **cmd.env} | ({"PYTHONPATH": s.tree} if s.tree else {})  # another checkout's modules
    if s.tree:
        run["tree"] = s.tree
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd.argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=s.tree or ps.REPO, start_new_session=True)  # fmt: skip
    sampler = TreeSampler(proc.pid).start()
    try:
        model = wait_ready(proc, url, log, a.ready_timeout)
        run["ready_s"] = time.perf_counter() - t0
        if s.kind == "ringserve":
            wait_compiled(url, a.ready_timeout)
        run["compiled_s"] = time.perf_counter() - t0
        warm = [Request(r.prompt[:16], 4) for r in wl.single[: a.warmup]]
        asyncio.run(send_all(url, model, warm, None, "warm-up", False))
        sampler.sample(pss=True)
        cpu0 = tree_usage(proc.pid, pss=False)["cpu_s"]
        burst = asyncio.run(send_all(url, model, wl.burst, None, f"{s.name} burst", not a.disable_tqdm))
        cpu1 = tree_usage(proc.pid, pss=False)["cpu_s"]
        sampler.sample(pss=True)
        single = asyncio.run(send_all(url, model, wl.single, 1, f"{s.name} single", not a.disable_tqdm))
        sampler.sample(pss=True)
        mb, m1 = compute_metrics(burst), compute_metrics(single)
        run.update(headline(mb, m1), burst=mb, single=m1)
        if mb.get("duration_s"):
            run["cores_busy"] = (cpu1 - cpu0) / mb["duration_s"]
        failed = mb.get("failed", 0) + m1.get("failed", 0)
        if failed:
            errors = [r.error for r in burst + single if r.error][:3]
            run["error"] = f"{failed} requests failed: {errors}"
    except ServerFailed as e:
        run["error"] = str(e)
    finally:
        stop(proc)
        sampler.stop()
        run.update(peak_rss_mb=sampler.peak_rss_mb or None, peak_pss_mb=sampler.peak_pss_mb or None)
    return run


def stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the server's process group (it was started in a session of its own), then
    SIGKILL to whatever of the group is left after `grace` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reaps the leader: a zombie still counts as a member of its group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


# ---- the whole comparison --------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """The processor the figures belong to: machines of one name differ (2 Zen 4 cores with
    AVX512-BF16 one day, 2 Zen 3 cores with AVX2 alone the next), and so does every system's
    speed on them. `vectors`: the widest of avx512_bf16, avx512f, avx2 the CPU lists."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []
    block = info[: info.index("")] if "" in info else info  # the first processor's lines
    first = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in block) if v}
    flags = set(first.get("flags", "").split())
    vectors = next((f for f in ("avx512_bf16", "avx512f", "avx2") if f in flags), "none listed")
    return {"cpus": os.cpu_count(), "cpu": first.get("model name", "unknown"), "vectors": vectors}



def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.peers", description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--model", default="smollm2", help="'smollm2', 'tiny' or an HF-format directory")
    a("--systems", nargs="+", default=list(ps.DEFAULT_SYSTEMS),
      help=f"of {', '.join(ps.SYSTEMS)}; a ringserve one as NAME@TAG runs the checkout --tree TAG=DIR")
    a("--tree", action="append", default=[], metavar="TAG=DIR",
      help="another ringserve checkout (e.g. a git worktree of an earlier commit), for systems NAME@TAG")
    a("--reference", default="ringserve", help="the system the ratios are taken against")
    a("--rounds", type=int, default=2, help="every system runs once per round, in --systems order")
    a("--burst", type=int, default=64, help="requests sent at once (also every server's parallel limit)")
    a("--single", type=int, default=8, help="requests sent one at a time after the burst")
    a("--input-len", type=int, nargs=2, default=[32, 512], metavar=("LO", "HI"))
    a("--output-len", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    a("--max-len", type=int, default=None, help="tokens per request every server is sized for (default: the "
      "longest prompt + output, rounded up to 256)")  # fmt: skip
    a("--threads", type=int, default=os.cpu_count() or 1, help="vLLM / llama.cpp compute threads")
    a("--seed", type=int, default=0)
    a("--warmup", type=int, default=2, help="short requests before the timed phases")
    a(
        "--ready-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to be ready (and compiled)",
    )
    a(
        "--peers-dir",
        default=None,
        help="where tools/install_peers.sh installed the peers (default: $RINGSERVE_CACHE/peers)",
    )
    a(
        "--output-json",
        default=None,
        help="the report (default: <peers dir>/runs/<time>/report.json, logs beside it)",
    )
    for kind in ps.KINDS:
        a(f"--{kind}-args", default="", help=f"extra flags for every {kind} server (one string)")
    a("--disable-tqdm", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parser().parse_args(argv)
    from ringserve.model.checkpoints.resolve import resolve_model
    from ringserve.model.families import read_config

    a.extra = {k: getattr(a, f"{k}_args").split() for k in ps.KINDS}
    a.trees = dict(t.split("=", 1) for t in a.tree)
    for name in a.systems:
        ps.system(name, a.trees)  # ValueError naming an unknown system or tag
    if a.max_len is None:
        a.max_len = 256 * math.ceil((a.input_len[1] + a.output_len[1]) / 256)
    from ringserve.model.paths import cache_dir

    layout = ps.Layout(Path(a.peers_dir) if a.peers_dir else cache_dir("peers"))
    out = (
        Path(a.output_json)
        if a.output_json
        else layout.root / "runs" / time.strftime("%Y%m%d-%H%M%S") / "report.json"
    )
    logdir = out.parent / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    model_dir, _ = resolve_model(a.model)
    if not model_dir.is_dir():
        raise ValueError(
            f"--model {a.model}: an HF-format directory is needed (vLLM serves it; llama.cpp gets a GGUF of it)"
        )
    wl = make_workload(read_config(model_dir).vocab_size, a.seed, a.burst, a.single, tuple(a.input_len),
                       tuple(a.output_len))  # fmt: skip

    skipped: dict[str, str] = {}
    served: dict[str, Path] = {}
    for name in a.systems:
        s = ps.system(name, a.trees)
        reason = ps.missing(s, layout)
        if reason is None:
            try:
                served[name] = ps.served_model(
                    s, model_dir, layout, lambda m: print(m, file=sys.stderr, flush=True)
                )
            except ps.Unavailable as e:
                reason = str(e)
        if reason is not None:
            skipped[name] = reason
            print(f"skipping {name}: {reason}", file=sys.stderr, flush=True)

    n_in, n_out = sum(r.prompt_len for r in wl.burst), sum(r.output_len for r in wl.burst)
    m = machine()
    print(f"machine: {m['cpus']} x {m['cpu']} ({m['vectors']})", file=sys.stderr, flush=True)
    print(f"model {model_dir}; burst {len(wl.burst)} requests ({n_in} prompt, {n_out} output tokens), then "
          f"{len(wl.single)} one at a time; {a.rounds} rounds of {list(served)}", file=sys.stderr, flush=True)  # fmt: skip
    runs: list[dict[str, Any]] = []
    for rnd in range(1, a.rounds + 1):
        for name, path in served.items():
            runs.append(run_one(ps.system(name, a.trees), path, wl, a, layout, logdir, rnd))
            print(format_runs(runs[-1:]).splitlines()[-1], file=sys.stderr, flush=True)

    med = medians(runs)
    rat = ratios(med, a.reference)
    report = {
        "model": str(model_dir), "systems": a.systems, "rounds": a.rounds, "reference": a.reference,
        "workload": {"burst": len(wl.burst), "single": len(wl.single), "input_len": a.input_len,
                     "output_len": a.output_len, "seed": a.seed, "max_len": a.max_len, "threads": a.threads},
        "machine": {**machine(), "loadavg_end": os.getloadavg()},
        "skipped": skipped, "runs": runs, "medians": med, "ratios": rat,
    }  # fmt: skip
    out.write_text(json.dumps(report, indent=1, default=str))
    print("\nevery run:\n" + format_runs(runs))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    print("\n" + format_ratios(rat, a.reference))
    print(f"\nwrote {out} (server logs in {logdir})")
    return report


if __name__ == "__main__":
    rep = main()
    raise SystemExit(1 if any(r.get("error") for r in rep["runs"]) else 0)
