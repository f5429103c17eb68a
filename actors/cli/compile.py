"""`ringserve compile`: every step program a server would compile with these flags, compiled ahead
of time for a TPU topology on a host without one, and what each costs.

    ringserve compile --platform tpu --topology v6e:2x4 --model llama-3-8b [--json PATH] [serve flags]

The model is built from its config.json alone (a model directory, or a named shape:
model/checkpoints/config_shapes.py): no weights, no tokenizer, no device. libtpu gives the
topology's compile-only devices (model/compute/tpu_topology.py; `tools/install_libtpu.sh`
installs it) while JAX stays on CPU. The serve flags make the same ServerArgs, the same
executor options (actors/runner/core.py `executor_config`) and so the same program keys as
`ringserve serve` (model/runtime/aot.py); a pool left unsized (no --max-total-tokens) is sized
as the server sizes it (actors/transport/memory.py) against the chips' HBM.

Programs compile in `--jobs` processes (default: the cores); per program it prints ok or the
compiler's error, compile seconds, memory per chip (arguments, temporaries, peak), collectives
per layer and outside the layers, and an analytic step estimate with its bound
(model/runtime/roofline.py). Exit status 0 when every program compiled, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from typing import Any

from ringserve.model.checkpoints.config_shapes import NAMES
from ringserve.model.checkpoints.footprint import footprint_of


def parser() -> argparse.ArgumentParser:
    from ringserve.actors.server_args import ServerArgs

    ap = argparse.ArgumentParser(prog="ringserve compile",
                                 description="compile a server's step programs ahead of time for a TPU topology")  # fmt: skip
    ap.add_argument("--platform", default="tpu", choices=["tpu"], help="what to compile for (default: tpu)")
    ap.add_argument(
        "--topology", required=True, help="a TPU topology, e.g. v5e:1x1, v5e:2x2, v6e:2x4, v5p:2x2x1"
    )
    ap.add_argument("--model", "--model-path", dest="model_path", default="smollm2",
                    help=f"a model directory (its config.json) or a shape: {', '.join(NAMES)} (default: smollm2)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the report here: a list of program objects")
    ap.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="programs compiled at once (processes)"
    )
    ap.add_argument("--families", default=None,
                    help="only these program families, comma-separated: decode, extend, verify, multistep")  # fmt: skip
    ap.add_argument("--ends", action="store_true", help="only each family's smallest and largest program")
    ap.add_argument("--programs", default=None,
                    help="only these, comma-separated FAMILY:min or FAMILY:max (e.g. decode:max,extend:min)")  # fmt: skip
    ap.add_argument("--estimate-context", type=int, default=None,
                    help="tokens cached per row in the step estimates (default: context_length / 2)")  # fmt: skip
    ServerArgs.add_cli_args(ap, skip=("model_path",))
    return ap


@dataclasses.dataclass(frozen=True)
class Job:
    """What a worker process needs to rebuild the programs (picklable)."""

    config: Any  # the model's ModelConfig
    executor: Any  # ExecutorConfig
    topology: str
    context: int


_worker: dict[str, Any] = {}


def _init(job: Job) -> None:
    """A worker: libtpu, the topology and the abstract executor, once."""
    from ringserve.model.compute.tpu_topology import ensure_libtpu, tpu_topology

    ensure_libtpu()
    from ringserve.model.runtime.aot import AbstractExecutor

    topo = tpu_topology(job.topology)
    _worker.update(job=job, topo=topo, ex=AbstractExecutor(job.config, job.executor, topo.devices))


def _compile(index: int) -> dict[str, Any]:
    from ringserve.model.runtime.aot import compile_program, family_name
    from ringserve.model.runtime.roofline import estimate

    ex, topo, job = _worker["ex"], _worker["topo"], _worker["job"]
    key = ex.order[index]
    shape, top_n = key
    r = compile_program(ex, key)
    return {
        "family": family_name(shape), "tokens": shape.tokens, "rows": shape.rows, "context": shape.context,
        "verify": shape.verify, "top_n": top_n, "ok": r.ok, "error": r.error, "seconds": round(r.seconds, 2),
        "memory": r.memory, "collectives": r.collectives,
        "collectives_per_layer": {k: v["per_layer"] for k, v in r.collectives.items() if v["per_layer"]},
        "collectives_outside_layers": {k: v["outside"] for k, v in r.collectives.items() if v["outside"]},
        "estimate": estimate(ex, shape, topo.chip, job.context, r.collectives if r.ok else None),
    }  # fmt: skip


def select(ex: Any, families: str | None, ends: bool, programs: str | None = None) -> list[int]:
    """Indices into `ex.order` of the programs asked for, in compile order."""
    from ringserve.model.runtime.aot import family_name

    order = ex.order
    known = {family_name(s) for s, _ in order}
    ends_of: dict[str, set[str]] = {}
    for spec in programs.split(",") if programs else ():
        fam, _, end = spec.partition(":")
        if end not in ("min", "max"):
            raise ValueError(f"--programs: {spec!r} must be FAMILY:min or FAMILY:max")
        ends_of.setdefault(fam, set()).add(end)
    want = set(families.split(",")) if families else set(ends_of) or known
    if unknown := (want | set(ends_of)) - {"decode", "extend", "verify", "multistep"}:
        raise ValueError(
            f"--families: {sorted(unknown)} unknown; the families are decode, extend, verify, multistep"
        )
    picked = [i for i, (s, _) in enumerate(order) if family_name(s) in want]
    if ends or ends_of:
        by: dict[str, list[int]] = {}
        for i in picked:
            by.setdefault(family_name(order[i][0]), []).append(i)
        size = lambda i: (order[i][0].tokens, order[i][0].context)  # noqa: E731
        pick = {"min": min, "max": max}
        picked = sorted(
            {pick[e](ix, key=size) for fam, ix in by.items() for e in ends_of.get(fam, ("min", "max"))}
        )
    return picked


def _line(p: dict[str, Any]) -> str:
    gib = 1 << 30
    name = f"{p['family']:<9} T={p['tokens']:<5} R={p['rows']:<4}" + (
        f" ctx={p['context']}" if p["context"] else ""
    )
    if not p["ok"]:
        return f"FAIL {name} {p['seconds']:6.1f} s  {p['error'].splitlines()[0][:200]}"
    m, e = p["memory"], p["estimate"]
    coll = " ".join(f"{k} {v}/layer" for k, v in p["collectives_per_layer"].items()) or "none/layer"
    out = " ".join(f"{k} {v}" for k, v in p["collectives_outside_layers"].items())
    tps = f", {e['tokens_per_s']:,.0f} tok/s" if e["tokens_per_s"] else ""
    return (f"ok   {name} {p['seconds']:6.1f} s  HBM/chip args {m.get('argument', 0) / gib:.2f} GiB temp "
            f"{m.get('temp', 0) / gib:.2f} GiB  {coll}{' (+ ' + out + ' outside)' if out else ''}  "
            f"est {e['step_s'] * 1e3:.2f} ms {e['bound']}-bound{tps}")  # fmt: skip


def main(argv: list[str]) -> int:
    from ringserve.model.compute.tpu_topology import chip_of, ensure_libtpu

    os.environ["JAX_PLATFORMS"] = "cpu"  # compile-only devices: no TPU is initialized (nor looked for)
    args = parser().parse_args(argv)
    chip = chip_of(args.topology)
    ensure_libtpu()
    from ringserve.actors.runner.core import executor_config
    from ringserve.actors.server_args import ServerArgs
    from ringserve.actors.server_options import OPTIONS
    from ringserve.actors.transport.memory import size_pool
    from ringserve.model.checkpoints.config_shapes import model_config
    from ringserve.model.compute.tpu_topology import tpu_topology
    from ringserve.model.runtime.aot import AbstractExecutor

    mc, source = model_config(args.model_path)
    server = ServerArgs(**{k: v for k, v in vars(args).items() if k in OPTIONS and k != "model_path"})
    topo = tpu_topology(args.topology)
    if server.max_total_tokens is None:  # sized as the server sizes it, against the chips' HBM
        need = server.replace(max_total_tokens=server.min_pages * server.page_size)
        ex = AbstractExecutor(mc, executor_config(need), topo.devices)
        fp = footprint_of(mc, ex.num_params())
        pool = size_pool(server, fp, "tpu", chip.hbm_bytes * server.tp_size)
        if pool.kv_bytes_per_token != ex.kv_layout_bytes_per_token():  # the sizing's rules and the arrays' disagree
            raise RuntimeError(f"ringserve compile: the server sizes {ex.plan.attention}'s KV at {pool.kv_bytes_per_token:,} B "
                               f"a token (model/compute/attention/layout.py), its arrays hold "
                               f"{ex.kv_layout_bytes_per_token():,}")  # fmt: skip
        server = server.replace(  # and the sliding layers' own pool where the server would make one
            max_total_tokens=pool.max_total_tokens, mem_fraction_static=pool.mem_fraction_static,
            max_swa_tokens=pool.swa_tokens, swa_window=fp.sliding_window if pool.swa_tokens else server.swa_window,
        )
    server = server.for_platform("tpu")
    job = Job(mc, executor_config(server), args.topology,
              args.estimate_context or server.context_length // 2)  # fmt: skip
    _init(job)
    ex = _worker["ex"]
    picked = select(ex, args.families, args.ends, args.programs)
    swa = f" + the sliding layers' own {server.max_swa_tokens:,}" if server.max_swa_tokens else ""
    print(f"ringserve compile: {mc.family} from {source} ({mc.num_layers} layers) on {args.topology} "
          f"({topo.chips} chips, tp {server.tp_size}), {ex.plan.attention} attention, {ex.plan.layer_loop} layers, "
          f"{server.dtype}; {len(picked)} of {len(ex.order)} programs, {args.jobs} at a time; KV pool "
          f"{server.max_total_tokens:,} tokens{swa} (pages of {server.page_size}); estimates at {job.context} tokens "
          f"cached per row", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    jobs = max(1, min(args.jobs, len(picked)))

    def landed(p: dict[str, Any], index: int) -> None:
        results.append(p | {"index": index})
        print(_line(p), flush=True)

    if jobs == 1:  # here, with the executor already built
        for i in picked:
            landed(_compile(i), i)
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=_init, initargs=(job,)
        ) as pool_:
            futures = {pool_.submit(_compile, i): i for i in picked}
            for fut in concurrent.futures.as_completed(futures):
                landed(fut.result(), futures[fut])
    results.sort(key=lambda p: p["index"])
    ok = sum(p["ok"] for p in results)
    print(
        f"ringserve compile: {ok} of {len(results)} programs compiled in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    if args.json:
        common = {"model": source, "family": mc.family, "topology": args.topology, "chips": topo.chips,
                  "tp_size": server.tp_size, "dtype": server.dtype, "page_size": server.page_size,
                  "max_total_tokens": server.max_total_tokens, "programs_total": len(ex.order)}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump([common | p for p in results], f, indent=1)
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
