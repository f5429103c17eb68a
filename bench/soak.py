"""Soak: mixed traffic for a long time against one supervised engine, with random cancels,
pauses, flushes, weight updates and periodic SIGKILLs of a random actor; after every event the
outputs so far are checked exact, the KV books intact, and memory and file descriptors sampled.
Not run in CI (issue 28).

    python -m ringserve.bench.soak [--minutes 30] [--kill-every 40] [--workers 12] [--output soak.json]

The engine runs in this process (the frontend, with its IPC socket and HTTP) and is driven over
all three surfaces at once: in-process Engine calls, the IPC Client and HTTP /generate, each a
mix of greedy and seeded requests (deterministic mode: a seeded draw depends on its seed and
position only), streamed or not; some are cancelled (a stream left early, an abort by rid).

Exactness. Three weight sets take turns: A (the checkpoint it started from, from disk), B (another
checkpoint pushed whole from tensors: after a restart the supervisor brings it back from its
journal) and C (a third, from disk). Every prompt's output under each set is computed first. An
output made under one set must equal that set's (a cancelled or aborted one: a prefix of it); one
whose tokens span an update (a pause in `retract` mode let it resume on the new weights) is checked
at the end, span by span: each span must be what its set continues the prompt + the tokens before
it with (the continuation rule; every update pauses in retract or abort mode, never in place, so
no KV of older weights is reused).

Events, one every few seconds: pause (abort / retract / in_place) and continue; flush (pause
retract, flush_cache, then the KV pool must be whole); a weight update (A, B or C); a burst of
aborts; a SIGKILL of the scheduler, runner or detokenizer (sometimes while paused, which the new
actors must still be), timed from the kill to the restart and to the first token after it.

The report (JSON): event counts, requests by surface and outcome, lost (an error, or never
finished) and wrong outputs with examples, restart times, and RSS / open fds / shared-memory
segments of this process and of the actors, at the start (after warm-up), over time and at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ACTORS = ("scheduler", "runner", "detokenizer")
SHAPES = dict(page_size=16, max_running_requests=16, context_length=256, max_prefill_tokens=256,
              max_total_tokens=16 * 512)  # fmt: skip
REQUEST_TIMEOUT_S = 300.0


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 2000, int(k)).tolist() for k in rng.integers(4, 64, n)]


def sampling(kind: str, i: int, max_new: int) -> dict:
    sp: dict[str, Any] = {"ignore_eos": True, "max_new_tokens": max_new}
    return {**sp, "temperature": 0} if kind == "greedy" else {**sp, "temperature": 0.9, "top_p": 0.95, "sampling_seed": 1000 + i}


def proc_stats(pid: int) -> dict[str, int]:
    """RSS (KiB) and open fds of a process (zeros if it is gone)."""
    try:
        rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
        return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, StopIteration):
        return {"rss_kib": 0, "fds": 0}


class Soak:
    def __init__(self, a: argparse.Namespace, workdir: Path):
        from ringserve import Engine, Servers
        from ringserve.model.checkpoints.load import load_checkpoint
        from ringserve.model.checkpoints.tiny import make_tiny_model

        self.a, self.rng = a, random.Random(a.seed)
        self.dirs = {s: str(make_tiny_model(workdir / s, "llama", seed=k)) for k, s in enumerate("ABC")}
        self.pushed = {k: np.array(v) for k, v in load_checkpoint(Path(self.dirs["B"]))[1].items()}
        self.engine = Engine(self.dirs["A"], enable_deterministic_inference=True, max_restarts=a.max_restarts,
                             restart_window_s=60.0, **SHAPES)  # fmt: skip
        self.servers = Servers(self.engine, port=0).start()
        self.socket, self.url = self.servers.socket_path, self.servers.url
        self.prompts = prompts(a.prompts, a.seed)
        self.version_set = {"0": "A"}  # weight_version -> weight set
        self.lock = threading.Lock()
        self.done: list[dict] = []  # finished requests not yet checked
        self.deferred: list[dict] = []  # outputs spanning weight sets, checked at the end
        self.counts: collections.Counter = collections.Counter()
        self.events: collections.Counter = collections.Counter()
        self.wrong: list[dict] = []
        self.lost: list[dict] = []
        self.inflight: dict[str, float] = {}  # rid -> start time
        self.tokens, self.last_token_at = 0, 0.0
        self.restarts: list[dict] = []
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.refs = self.references()

    # ---- references -----------------------------------------------------------------------
    def load(self, s: str, version: str) -> None:
        """Serve weight set `s` as `version` (the engine must be paused or idle)."""
        e = self.engine
        if s == "B":
            r = e.update_weights_from_tensor(self.pushed, weight_version=version)
        else:
            r = e.update_weights_from_disk(self.dirs[s], weight_version=version)
        assert r["success"], r
        self.version_set[version] = s

    def references(self) -> dict[str, dict[str, list[list[int]]]]:
        """Every prompt's output (greedy and seeded) under each weight set."""
        refs: dict[str, dict[str, list[list[int]]]] = {}
        n = len(self.prompts)
        for s in "BCA":  # (ends on A, the set it starts serving)
            self.load(s, f"ref-{s}")
            refs[s] = {kind: [o["output_ids"] for o in self.engine.generate(
                input_ids=self.prompts, sampling_params=[sampling(kind, i, self.a.max_new) for i in range(n)])]
                for kind in ("greedy", "seeded")}  # fmt: skip
        return refs

    # ---- traffic ----------------------------------------------------------------------------
    def worker(self, w: int) -> None:
        from ringserve import Client

        rng = random.Random(self.a.seed * 1000 + w)
        client = Client(self.socket)
        import httpx

        http = httpx.Client(timeout=REQUEST_TIMEOUT_S)
        k = 0
        try:
            while not self.stop.is_set():
                k += 1
                surface = rng.choice(["engine", "ipc", "http"])
                i, kind = rng.randrange(len(self.prompts)), rng.choice(["greedy", "seeded"])
                stream = rng.random() < 0.7
                cancel = rng.random() < self.a.cancel_rate
                rid = f"w{w}-{k}"
                rec = {"rid": rid, "surface": surface, "i": i, "kind": kind, "stream": stream, "cancel": cancel}
                with self.lock:
                    self.inflight[rid] = time.monotonic()
                try:
                    out = self.one(surface, client, http, rid, i, kind, stream, cancel, rng)
                    rec.update(ids=out["output_ids"], meta=out["meta_info"])
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                with self.lock:
                    self.inflight.pop(rid, None)
                    self.done.append(rec)
        finally:
            client.close()
            http.close()

    def one(self, surface: str, client, http, rid: str, i: int, kind: str, stream: bool, cancel: bool,
            rng: random.Random) -> dict:  # fmt: skip
        """One request; a cancelled one returns the last state its caller saw."""
        body = {"input_ids": self.prompts[i], "sampling_params": sampling(kind, i, self.a.max_new), "rid": rid}
        leave_after = rng.randint(1, 6) if cancel and stream else None
        if cancel and not stream:  # an abort by rid, from another thread, a little later
            threading.Timer(rng.uniform(0.05, 1.5), self._abort, args=(rid,)).start()
        if not stream:
            if surface == "engine":
                return self.engine.generate(**body)
            if surface == "ipc":
                return client.generate(**body)
            r = http.post(self.url + "/generate", json=body)
            r.raise_for_status()
            return r.json()
        last: dict | None = None
        n = 0
        if surface == "http":
            with http.stream("POST", self.url + "/generate", json={**body, "stream": True}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"])
                        last, n = self._chunk(last, chunk), n + 1
                        if leave_after is not None and n >= leave_after:
                            break
        else:
            it = (self.engine if surface == "engine" else client).generate(**body, stream=True)
            try:
                for chunk in it:
                    last, n = self._chunk(last, chunk), n + 1
                    if leave_after is not None and n >= leave_after:
                        break
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
        if last is None:
            raise RuntimeError("the stream ended without a chunk")
        return last

    def _chunk(self, last: dict | None, chunk: dict) -> dict:
        """A stream's next chunk must extend the one before (no text repeated, no id taken back)."""
        if last is not None:
            assert chunk["text"].startswith(last["text"]) and chunk["output_ids"][: len(last["output_ids"])] == last["output_ids"], (last, chunk)  # fmt: skip
        new = len(chunk["output_ids"]) - (len(last["output_ids"]) if last else 0)
        if new:
            with self.lock:
                self.tokens += new
                self.last_token_at = time.monotonic()
        return chunk

    def _abort(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:  # the engine is shutting down
            pass

    # ---- checks -----------------------------------------------------------------------------
    def check_done(self) -> None:
        """Check every request finished since the last check."""
        with self.lock:
            batch, self.done = self.done, []
        for rec in batch:
            reason = (rec["meta"]["finish_reason"] or {"type": "left"})["type"] if "meta" in rec else "error"
            self.counts[f"{rec['surface']}:{reason}"] += 1  # left: a stream its caller left early
            if "error" in rec:
                self.lost.append(rec)
                continue
            ids, meta = rec["ids"], rec["meta"]
            complete = reason == "length"
            if reason not in ("length", "abort") and not (reason == "left" and rec["cancel"]):
                self.wrong.append({**rec, "why": f"finish reason {reason}"})
                continue
            if complete and len(ids) != self.a.max_new:
                self.wrong.append({**rec, "why": f"{len(ids)} tokens"})
                continue
            spans = meta.get("weight_versions") or ([{"version": meta["weight_version"], "start": 0, "end": len(ids)}] if ids else [])
            sets = [self.version_set[s["version"]] for s in spans]
            if len(set(sets)) > 1:
                self.deferred.append({**rec, "spans": [{**s, "set": x} for s, x in zip(spans, sets, strict=True)]})
                self.counts["deferred"] += 1
                continue
            want = self.refs[sets[0]][rec["kind"]][rec["i"]] if sets else []
            if ids != want[: len(ids)]:
                self.wrong.append({**rec, "want": want, "why": "differs from the reference"})
            self.counts["checked"] += 1

    def check_deferred(self) -> None:
        """Outputs spanning weight sets: each span is what its set continues the tokens before it with."""
        by_set: dict[str, list[tuple[dict, dict]]] = collections.defaultdict(list)
        for rec in self.deferred:
            for s in rec["spans"]:
                if s["end"] > s["start"]:
                    by_set[s["set"]].append((rec, s))
        for k, (sset, items) in enumerate(sorted(by_set.items())):
            self.load(sset, f"verify-{k}-{sset}")
            outs = self.engine.generate(
                input_ids=[self.prompts[r["i"]] + r["ids"][: s["start"]] for r, s in items],
                sampling_params=[{**sampling(r["kind"], r["i"], self.a.max_new), "max_new_tokens": s["end"] - s["start"]}
                                 for r, s in items])  # fmt: skip
            for (rec, s), o in zip(items, outs, strict=True):
                if o["output_ids"] != rec["ids"][s["start"] : s["end"]]:
                    self.wrong.append({**rec, "why": f"span {s} differs: {o['output_ids']}"})
                self.counts["deferred_spans_checked"] += 1

    def check_engine(self, quiet: bool = False) -> dict:
        """The KV books after an event (`quiet`: paused in retract mode and flushed, so nothing
        may hold KV: the pool must be whole)."""
        info = self.engine.get_server_info()
        assert info["integrity_errors"] == [], info["integrity_errors"]
        if quiet:
            assert info["req_to_token_pool_used"] == 0 and info["running_batch_size"] == 0, info
            assert info["available_kv_tokens"] == info["initial_kv_tokens"], info
        return info

    def sample(self, label: str) -> dict:
        g = self.engine.group
        actors = {n: proc_stats(g.pid(n) or 0) for n in ACTORS}
        pid = os.getpid()
        s = {"t": round(time.monotonic() - self.t0, 1), "event": label, **proc_stats(pid),
             "actors_rss_kib": sum(a["rss_kib"] for a in actors.values()),
             "actors_fds": sum(a["fds"] for a in actors.values()),
             "shm": len([f for f in os.listdir("/dev/shm") if f"rs-{pid}-" in f]),
             "shm_maps": sum(1 for line in open("/proc/self/maps") if "/dev/shm/" in line),  # (handles of rings)
             "threads": threading.active_count(), "inflight": len(self.inflight)}  # fmt: skip
        self.samples.append(s)
        return s

    # ---- events -----------------------------------------------------------------------------
    def pause(self) -> None:
        mode = self.rng.choice(["abort", "retract", "in_place"])
        assert self.engine.pause_generation(mode)["success"]
        time.sleep(self.rng.uniform(0.1, 1.0))
        assert self.engine.continue_generation()["success"]
        self.events[f"pause_{mode}"] += 1

    def flush(self) -> None:
        assert self.engine.pause_generation("retract")["success"]
        r = self.engine.flush_cache()
        assert r["success"], r
        self.check_engine(quiet=True)
        assert self.engine.continue_generation()["success"]
        self.events["flush"] += 1

    def update(self, s: str | None = None) -> None:
        s = s or self.rng.choice([x for x in "ABC" if x != self.version_set[self.current_version()]])
        assert self.engine.pause_generation(self.rng.choice(["abort", "retract"]))["success"]
        self.load(s, f"v{sum(self.events[k] for k in self.events if k.startswith('update')) + 1}-{s}")
        assert self.engine.continue_generation()["success"]
        self.events[f"update_{s}"] += 1

    def current_version(self) -> str:
        return self.engine.get_server_info()["weight_version"]

    def aborts(self) -> None:
        with self.lock:
            rids = list(self.inflight)
        for rid in self.rng.sample(rids, min(len(rids), self.rng.randint(1, 4))):
            self._abort(rid)
        self.events["abort_burst"] += 1

    def kill(self) -> None:
        e = self.engine
        actor = self.rng.choice(ACTORS)
        if self.version_set[self.current_version()] != "B" and self.rng.random() < 0.3:
            self.update("B")  # a restart must bring back weights pushed from tensors
        paused = self.rng.random() < 0.25
        if paused:
            assert e.pause_generation("retract")["success"]
        n = e.get_server_info()["restarts"]
        version = self.current_version()
        t_kill = time.monotonic()
        os.kill(e.group.pid(actor), signal.SIGKILL)
        while sum(e.frontend.core.metrics.restart_counts.values()) <= n:
            assert e.frontend.dead is None, f"the engine died: {e.frontend.dead}"
            assert time.monotonic() - t_kill < 300, f"no restart 300 s after {actor} was killed"
            time.sleep(0.01)
        t_up = time.monotonic()
        info = e.get_server_info()
        assert info["weight_version"] == version, (info["weight_version"], version)  # the weights came back
        assert info["paused"] == paused, info["paused"]
        if paused:
            assert e.continue_generation()["success"]
        first = None
        while time.monotonic() - t_up < 60:
            with self.lock:
                if self.last_token_at > t_up:
                    first = self.last_token_at
                    break
            time.sleep(0.005)
        self.restarts.append({"actor": actor, "paused": paused, "weights": self.version_set[version],
                              "kill_to_restarted_s": round(t_up - t_kill, 2),
                              "kill_to_first_token_s": round(first - t_kill, 2) if first else None,
                              "resubmitted": info["last_restart"]["resubmitted"]})  # fmt: skip
        self.events[f"kill_{actor}"] += 1

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.a
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.worker, args=(w,), daemon=True) for w in range(a.workers)]
        for t in threads:
            t.start()
        time.sleep(5)  # warm: every surface has traffic
        start = self.sample("start")
        end_at = self.t0 + a.minutes * 60
        next_kill = time.monotonic() + self.rng.uniform(0.5, 1.0) * a.kill_every
        failures: list[str] = []
        while time.monotonic() < end_at:
            time.sleep(self.rng.uniform(1.0, 4.0))
            if time.monotonic() >= next_kill:
                event = self.kill
                next_kill = time.monotonic() + self.rng.uniform(0.75, 1.25) * a.kill_every
            else:
                event = self.rng.choice([self.pause, self.pause, self.flush, self.update, self.aborts])
            try:
                event()
                self.check_engine()
            except AssertionError as err:
                failures.append(f"{event.__name__}: {err}"[:2000])
                print(f"soak: {event.__name__} FAILED: {err}", file=sys.stderr, flush=True)
            self.check_done()
            s = self.sample(event.__name__)
            print(f"soak: t={s['t']:7.1f}s {event.__name__:7s} checked={self.counts['checked']} "
                  f"wrong={len(self.wrong)} lost={len(self.lost)} rss={s['rss_kib'] // 1024}MiB fds={s['fds']} "
                  f"actors={s['actors_rss_kib'] // 1024}MiB/{s['actors_fds']}fds shm={s['shm']} maps={s['shm_maps']}", flush=True)  # fmt: skip
        self.stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S)
        stuck = [t.name for t in threads if t.is_alive()]
        with self.lock:
            for rid, since in self.inflight.items():
                self.lost.append({"rid": rid, "error": f"never finished ({time.monotonic() - since:.0f} s)"})
        self.check_done()
        end = self.sample("end")
        info = self.check_engine()
        self.check_deferred()
        assert self.engine.pause_generation("retract")["success"] and self.engine.flush_cache()["success"]
        quiet = self.check_engine(quiet=True)
        self.engine.continue_generation()
        pid = os.getpid()
        self.servers.stop()
        self.engine.shutdown()
        left = [f for f in os.listdir("/dev/shm") if f"rs-{pid}-" in f]
        return {
            "minutes": a.minutes, "args": vars(a), "events": dict(self.events),
            "requests": dict(self.counts), "lost": len(self.lost), "wrong": len(self.wrong),
            "lost_examples": self.lost[:5], "wrong_examples": self.wrong[:5], "event_failures": failures,
            "stuck_workers": stuck, "restarts": self.restarts,
            "restart_s": _stats([r["kill_to_restarted_s"] for r in self.restarts]),
            "kill_to_first_token_s": _stats([r["kill_to_first_token_s"] for r in self.restarts if r["kill_to_first_token_s"]]),
            "server_info_restarts": info["restarts"], "tokens_streamed": self.tokens,
            "start": start, "end": end, "samples": self.samples,
            "kv_at_end": {k: quiet[k] for k in ("available_kv_tokens", "initial_kv_tokens", "req_to_token_pool_used")},
            "left_behind": {"shm": left, "socket": os.path.exists(self.socket)},
        }  # fmt: skip


def _stats(xs: list[float]) -> dict:
    return {"n": len(xs), "median": float(np.median(xs)), "max": max(xs)} if xs else {"n": 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kill-every", type=float, default=40.0, help="seconds between SIGKILLs (jittered +-25%%)")
    ap.add_argument("--workers", type=int, default=12, help="concurrent callers (each one request at a time)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--cancel-rate", type=float, default=0.15)
    ap.add_argument("--max-restarts", type=int, default=10, help="the engine's max_restarts (per 60 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="soak.json")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ringserve-soak-") as d:
        soak = Soak(a, Path(d))
        report = soak.run()
    Path(a.output).write_text(json.dumps(report, indent=1, default=str))
    s, e = report["start"], report["end"]
    print(f"soak: {report['minutes']} min, events {report['events']}, requests {sum(v for k, v in report['requests'].items() if ':' in k)}, "
          f"lost {report['lost']}, wrong {report['wrong']}, restarts {report['restart_s']}; "
          f"RSS {s['rss_kib'] // 1024} -> {e['rss_kib'] // 1024} MiB, fds {s['fds']} -> {e['fds']}, "
          f"left behind {report['left_behind']}; report: {a.output}")  # fmt: skip
    ok = not (report["lost"] or report["wrong"] or report["event_failures"] or report["stuck_workers"]
              or report["left_behind"]["shm"] or report["left_behind"]["socket"])  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
