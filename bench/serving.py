"""The serving harness (SGLang's bench_serving and bench_offline_throughput, for ringserve):
`ringserve bench` and `python -m ringserve.bench.serving` take the same flags.

    python -m ringserve.bench.serving --model tiny --num-prompts 64 --backend engine hf      # ours vs transformers
    python -m ringserve.bench.serving --model tiny --request-rate 2 4 8 --max-concurrency 32 --plot
    python -m ringserve.bench.serving --dataset shared-prefix --profile --output-json out/run.json
    python -m ringserve.bench.serving --backend http --url http://127.0.0.1:30000           # a running server

It starts an Engine (every ServerArgs flag applies; `--overlap both` starts two), sends the
workload (bench/workload.py) through each backend (bench/backends.py: engine, client = IPC
socket, http = OpenAI /v1/completions; `hf` = transformers generate on the same checkpoint,
bench/hf_backend.py), streaming, at `--request-rate` (inf: all at once = offline; else Poisson)
under an optional `--max-concurrency`, and prints the metrics of bench/metrics.py per run, then
ringserve/transformers and overlap on/off ratios. Each run starts from an empty prefix cache.

Server-side figures per run (from get_server_info): steps, tokens computed, prefill tokens
computed (from the step trace with --profile, else prompt_tokens - cached_tokens per request)
against the unique prompt tokens of the workload (`prefill_over_unique`; 1.0 is a perfect
prefix cache). `--profile` also writes a Chrome trace per run (bench/profile.py) and prints its
summary; `--plot` writes PNGs (bench/plots.py); both go next to `--output-json` (else into the
current directory).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from ringserve.bench import profile as prof
from ringserve.bench.metrics import RequestRecord, compute_metrics, format_table
from ringserve.bench.workload import (
    DATASETS,
    Request,
    arrival_times,
    random_requests,
    shared_prefix_requests,
    sharegpt_like_requests,
    unique_prompt_tokens,
)  # fmt: skip

RINGSERVE = ("engine", "client", "http")
# ServerArgs fields the harness sets itself (or that mean nothing here)
SKIP_ARGS = ("model_path", "step_trace", "jax_profile_dir", "disable_overlap_schedule", "seed")


def parser(prog: str = "python -m ringserve.bench.serving") -> argparse.ArgumentParser:
    from ringserve.actors.server_args import ServerArgs

    ap = argparse.ArgumentParser(prog=prog, description="ringserve serving benchmark (throughput and latency)")
    a = ap.add_argument
    a("--model", nargs="+", default=["tiny"],
      help="'tiny', 'smollm2', or a model directory; several: the whole benchmark for each in turn")
    a("--backend", nargs="+", default=["engine"], choices=[*RINGSERVE, "hf"],
      help="engine | client (IPC socket) | http (OpenAI API) | hf (transformers on the same checkpoint; "
           "ringserve's engine runs too, for the ratio)")  # fmt: skip
    a("--dataset", default="random", choices=DATASETS)
    a("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=64)
    a("--seed", type=int, default=0)
    a("--input-len", type=int, nargs=2, default=[16, 512], metavar=("LO", "HI"), help="random: prompt lengths")
    a("--output-len", type=int, nargs=2, default=[16, 256], metavar=("LO", "HI"), help="random: output lengths")
    a("--groups", type=int, default=8, help="shared-prefix: system prompts")
    a("--prompts-per-group", type=int, default=8, help="shared-prefix: questions per system prompt")
    a("--system-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    a("--question-len", type=int, default=64, help="shared-prefix: question tokens")
    a("--shared-output-len", type=int, default=32, help="shared-prefix: output tokens")
    a("--sharegpt-max-input", type=int, default=1024)
    a("--sharegpt-max-output", type=int, default=512)
    a("--request-rate", type=float, nargs="+", default=[math.inf], help="requests/s (inf: all at once); several: one run each")
    a("--max-concurrency", type=int, default=None, help="most requests in flight")
    a("--overlap", choices=["on", "off", "both"], default="on", help="overlap scheduling (both: two engines)")
    a("--hf-batch", type=int, default=32, help="transformers' static batch size")
    a("--warmup", type=int, default=2, help="short requests through each backend before measuring")
    a("--profile", action="store_true", help="step timeline per run: Chrome trace + summary")
    a("--profile-steps", type=int, default=65536, help="step records kept by the scheduler")
    a("--jax-profile", default=None, metavar="DIR", help="also a jax.profiler trace of the runner into DIR")
    a("--output-json", default=None, metavar="PATH", help="every metric of every run (a list when several)")
    a("--plot", action="store_true", help="PNG plots next to the JSON: throughput vs rate, latency CDFs, step timeline")
    a("--url", default=None, help="http backend: a running server's URL (no engine is started)")
    a("--socket", default=None, help="client backend: a running server's IPC socket (no engine is started)")
    a("--disable-tqdm", action="store_true")
    ServerArgs.add_cli_args(ap, skip=SKIP_ARGS)
    ap.set_defaults(log_level="warning")
    return ap


def make_requests(a: argparse.Namespace, vocab: int) -> list[Request]:
    if a.dataset == "random":
        return random_requests(a.num_prompts, vocab, a.seed, tuple(a.input_len), tuple(a.output_len))
    if a.dataset == "shared-prefix":
        return shared_prefix_requests(a.groups, a.prompts_per_group, vocab, a.seed, a.system_len, a.question_len,
                                      a.shared_output_len)  # fmt: skip
    return sharegpt_like_requests(a.num_prompts, vocab, a.seed, a.sharegpt_max_input, a.sharegpt_max_output)


@dataclasses.dataclass
class Target:
    """One ringserve server under test: its Engine (None when external) and front doors."""

    engine: Any = None
    servers: Any = None
    socket: str | None = None
    url: str | None = None
    model_name: str = ""
    startup: dict | None = None  # seconds to serving, to every program compiled; programs

    def call(self, verb: str) -> Any:
        """A control verb (get_server_info, flush_cache) through whichever door exists."""
        if self.engine is not None:
            return getattr(self.engine, verb)()
        if self.socket is not None:
            from ringserve import Client

            with Client(self.socket) as c:
                return getattr(c, verb)()
        import httpx

        r = httpx.request("POST" if verb == "flush_cache" else "GET", f"{self.url}/{verb}", timeout=60)
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}

    def flush(self) -> None:
        for _ in range(50):  # refused while requests still hold KV (the last ones are finishing)
            r = self.call("flush_cache")
            if not isinstance(r, dict) or r.get("success", True):
                return
            time.sleep(0.1)


async def _send_all(t: Target, backend: str, reqs: list[Request], arrivals: list[float], conc: int | None,
                    progress: bool, desc: str) -> list[RequestRecord]:  # fmt: skip
    from ringserve.bench import backends as b

    if backend == "engine":
        return await b.drive(b.engine_sender(t.engine), reqs, arrivals, conc, progress, desc)
    if backend == "client":
        from ringserve import AsyncClient

        assert t.socket is not None
        async with AsyncClient(t.socket) as c:
            return await b.drive(b.client_sender(c), reqs, arrivals, conc, progress, desc)
    import httpx

    n = conc or len(reqs)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    assert t.url is not None
    async with httpx.AsyncClient(base_url=t.url, timeout=None, limits=limits) as h:
        return await b.drive(b.http_sender(h, t.model_name), reqs, arrivals, conc, progress, desc)


def run_ringserve(t: Target, backend: str, reqs: list[Request], rate: float, a: argparse.Namespace, label: str,
                  outdir: Path, stem: str) -> tuple[dict, list[RequestRecord]]:  # fmt: skip
    t.flush()
    t.call("get_server_info")  # drains the step records of earlier work
    arrivals = arrival_times(len(reqs), rate, a.seed)
    records = asyncio.run(_send_all(t, backend, reqs, arrivals, a.max_concurrency, not a.disable_tqdm, label))
    info = t.call("get_server_info")
    m = compute_metrics(records)
    unique = unique_prompt_tokens([r.prompt for r in reqs])
    m.update(label=label, backend=backend, request_rate=rate, max_concurrency=a.max_concurrency, unique_prompt_tokens=unique)
    if "cached_prompt_tokens" in m:
        m["prefill_tokens_computed"] = m["total_input_tokens"] - m["cached_prompt_tokens"]  # type: ignore[operator]
    m["retracted"] = info.get("num_retracted")
    trace = info.get("step_trace")
    if trace and trace["step_id"]:
        s = prof.summarize(trace)
        path = outdir / f"{stem}.{label}.trace.json"
        prof.write_chrome_trace(trace, path)
        m.update(prefill_tokens_computed=s["prefill_tokens_computed"], profile=s, trace_file=str(path))
        if a.plot:
            from ringserve.bench.plots import step_timeline

            m["timeline_png"] = str(step_timeline(trace, outdir / f"{stem}.{label}.timeline.png"))
    if m.get("prefill_tokens_computed") is not None and unique:
        m["prefill_over_unique"] = m["prefill_tokens_computed"] / unique  # type: ignore[operator]
    return m, records


def run_transformers(model_dir: str, reqs: list[Request], rates: list[float], a: argparse.Namespace
                     ) -> list[tuple[dict, list[RequestRecord], list[list[int]]]]:  # fmt: skip
    from ringserve.bench.hf_backend import load_model, run_hf

    model = load_model(model_dir)
    out = []
    for rate in rates:
        label = "transformers" + (f"@{rate:g}" if len(rates) > 1 else "")
        records, ids = run_hf(model, reqs, arrival_times(len(reqs), rate, a.seed), a.hf_batch, not a.disable_tqdm)
        m = compute_metrics(records)
        m.update(label=label, backend="hf", request_rate=rate, max_concurrency=a.hf_batch)
        out.append((m, records, ids))
    return out


def ratio_table(ours: list[dict], peers: list[dict], title: str, peer_name: str) -> str:
    """Ours over the peer, run by run: throughput ours/peer, latency peer/ours (> 1: ours better)."""
    keys = [("output throughput", "output_throughput", False), ("total throughput", "total_throughput", False),
            ("TTFT median", "ttft_ms_median", True), ("TTFT p99", "ttft_ms_p99", True),
            ("ITL median", "itl_ms_median", True), ("ITL p99", "itl_ms_p99", True),
            ("E2E median", "e2e_ms_median", True)]  # fmt: skip
    lines = [title, f"{'':22s}" + "".join(f"{o['label'] + ' / ' + p['label']:>36s}" for o, p in zip(ours, peers, strict=True))]
    for name, key, lower_better in keys:
        cells = []
        for o, p in zip(ours, peers, strict=True):
            x, y = o.get(key), p.get(key)
            r = None if not x or not y else (y / x if lower_better else x / y)
            cells.append(f"{'-' if r is None else f'{r:.2f}x':>36s}")
        lines.append(f"{name:22s}" + "".join(cells))
    lines.append(f"(> 1: ringserve better; throughput = ours/{peer_name}, latency = {peer_name}/ours)")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m ringserve.bench.serving") -> int:
    runs = bench(argv, prog)
    return 0 if all(r.get("failed", 0) == 0 for r in runs) else 1


def bench(argv: list[str] | None = None, prog: str = "python -m ringserve.bench.serving") -> list[dict]:
    """Run the benchmark `argv` describes (for each --model); print its tables; every run's metrics."""
    a = parser(prog).parse_args(argv)
    runs: list[dict] = []
    for name in a.model:
        one = argparse.Namespace(**vars(a))
        one.model = name
        if len(a.model) > 1 and a.output_json:  # profiles and plots: one set per model
            out = Path(a.output_json)
            one.output_json = str(out.with_name(f"{out.stem}.{Path(name).name}{out.suffix}"))
        runs += _bench_model(one)
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(runs[0] if len(runs) == 1 else runs, indent=1, default=_json))
        print(f"\nwrote {a.output_json}")
    return runs


def _bench_model(a: argparse.Namespace) -> list[dict]:
    from ringserve.actors.server_options import OPTIONS
    from ringserve.model.checkpoints.resolve import resolve_model
    from ringserve.model.families import read_config

    external = a.url is not None or a.socket is not None
    if "hf" in a.backend and not (set(a.backend) & set(RINGSERVE)):
        a.backend = ["engine", *a.backend]  # the ratio needs ours, measured in the same run
    model_dir, _ = resolve_model(a.model)  # the workload needs its vocabulary, transformers its weights
    vocab = read_config(model_dir).vocab_size
    reqs = make_requests(a, vocab)
    outdir = Path(a.output_json).parent if a.output_json else Path.cwd()
    outdir.mkdir(parents=True, exist_ok=True)
    stem = Path(a.output_json).stem if a.output_json else "ringserve-bench"
    server = {k: v for k, v in vars(a).items() if k in OPTIONS}
    runs: list[dict] = []
    recs: dict[str, list[RequestRecord]] = {}
    ours_ids: list[list[int]] | None = None
    n_in = sum(r.prompt_len for r in reqs)
    print(f"workload: {a.dataset}, {len(reqs)} requests, {n_in} prompt tokens, {sum(r.output_len for r in reqs)} output tokens "
          f"(unique prompt tokens {unique_prompt_tokens([r.prompt for r in reqs])}); model {a.model}", file=sys.stderr)  # fmt: skip
    overlaps = {"on": [True], "off": [False], "both": [True, False]}[a.overlap]
    for overlap in overlaps if not external else [None]:
        t, engine = _start(a, model_dir, server, overlap, external)
        try:
            for backend in [b for b in a.backend if b in RINGSERVE]:
                _warm(t, backend, reqs, a)
                for rate in a.request_rate:
                    label = backend + ("-overlap-off" if overlap is False else "")
                    label += f"@{rate:g}" if len(a.request_rate) > 1 else ""
                    m, records = run_ringserve(t, backend, reqs, rate, a, label, outdir, stem)
                    m.update(model=a.model, dataset=a.dataset, overlap=overlap, startup=t.startup)
                    runs.append(m)
                    recs[label] = records
                    if ours_ids is None and math.isinf(rate) and backend != "http":
                        ours_ids = [r.output_ids or [] for r in records]
        finally:
            if engine is not None:
                if t.servers is not None:
                    t.servers.stop()
                engine.shutdown()
    ours = [r for r in runs if r["overlap"] in (True, None)]
    tables = [format_table(runs, f"ringserve ({a.model}, {a.dataset}, {len(reqs)} requests)")]
    if "hf" in a.backend:
        hf = run_transformers(str(model_dir), reqs, a.request_rate, a)
        for m, records, ids in hf:
            m.update(model=a.model, dataset=a.dataset, overlap=None)
            if ours_ids is not None and math.isinf(m["request_rate"]):
                m["identical_outputs"] = sum(x == y for x, y in zip(ours_ids, ids, strict=True))
            runs.append(m)
            recs[m["label"]] = records
        tables.append(format_table([x[0] for x in hf], "transformers generate (same checkpoint, same requests)"))
        first = [r for r in ours if r["backend"] == ours[0]["backend"]]
        tables.append(ratio_table(first, [x[0] for x in hf], f"ringserve / transformers ({a.model})", "transformers"))
    if a.overlap == "both":
        on = [r for r in runs if r["overlap"] is True]
        off = [r for r in runs if r["overlap"] is False]
        tables.append(ratio_table(on, off, f"overlap on / off ({a.model})", "off"))
    for text in tables:
        print("\n" + text)
    for r in runs:
        if r.get("prefill_over_unique") is not None:
            print(f"\n{r['label']}: prefill tokens computed {r['prefill_tokens_computed']} / unique prompt tokens "
                  f"{r['unique_prompt_tokens']} = {r['prefill_over_unique']:.3f}")  # fmt: skip
        if r.get("profile"):
            print(f"\n{r['label']}: " + prof.format_summary(r["profile"]) + f"\n  trace: {r['trace_file']}")
    if a.plot:
        from ringserve.bench.plots import latency_cdfs, throughput_vs_rate

        print(f"\nplots: {throughput_vs_rate(runs, outdir / f'{stem}.throughput.png')}, "
              f"{latency_cdfs(recs, outdir / f'{stem}.cdf.png')}")  # fmt: skip
    return runs


def _json(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def _start(a: argparse.Namespace, model_dir: Any, server: dict, overlap: bool | None, external: bool) -> tuple[Target, Any]:
    if external:
        t = Target(socket=a.socket, url=a.url)
        if a.url:
            import httpx

            t.model_name = httpx.get(f"{a.url}/v1/models", timeout=30).json()["data"][0]["id"]
        return t, None
    from ringserve import Engine, Servers

    extra = {"step_trace": a.profile_steps} if a.profile else {}
    if a.jax_profile:
        extra["jax_profile_dir"] = a.jax_profile
    print(f"starting the engine (overlap {'on' if overlap else 'off'}) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    engine = Engine(str(model_dir), **server, disable_overlap_schedule=not overlap, **extra)
    ready = time.perf_counter() - t0
    engine.wait_compiled()  # every step program, before anything is timed
    info = engine.runner_info
    startup = {"ready_s": round(ready, 2), "all_compiled_s": round(time.perf_counter() - t0, 2),
               "programs": info.get("programs_total"), "programs_at_ready": info.get("num_programs")}  # fmt: skip
    print(f"engine start-up: serving in {startup['ready_s']} s ({startup['programs_at_ready']} of "
          f"{startup['programs']} step programs compiled), all compiled in {startup['all_compiled_s']} s",
          file=sys.stderr, flush=True)  # fmt: skip
    t = Target(engine=engine, model_name=engine.served_model_name, startup=startup)
    if {"client", "http"} & set(a.backend):
        t.servers = Servers(engine, port=0, http="http" in a.backend).start()
        t.socket, t.url = t.servers.socket_path, t.servers.url
    return t, engine


def _warm(t: Target, backend: str, reqs: list[Request], a: argparse.Namespace) -> None:
    if a.warmup <= 0:
        return
    warm = [Request(r.prompt[:32], 4) for r in reqs[: a.warmup]]
    asyncio.run(_send_all(t, backend, warm, [0.0] * len(warm), None, False, "warmup"))


if __name__ == "__main__":
    raise SystemExit(main())
