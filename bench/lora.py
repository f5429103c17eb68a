"""What LoRA adapters cost a step: a batch mixing several adapters (and rows with none) against
the same batch on an executor that serves no adapters, on the model runtime (no processes).

    python -m ringserve.bench.lora [--model tiny|smollm2] [--rank 16] [--adapters 4] [--repeat 20] [--gather]

Three executors' worth of cases over the same rows (random ids, greedy):

    off      enable_lora off: the programs have no adapter inputs at all
    none     LoRA on (a pool of `--adapters` slots of rank `--rank` on all 7 projections),
             every row without an adapter (slot 0: the product is computed, with zeros)
    mixed    LoRA on, rows round-robin over the adapters and none (1 in adapters + 1 rows: none)

for a decode step of 64 rows at context 128 and an extend step of 1024 tokens over 8 rows, each the median of `--repeat` timed runs after two warm ones, the
three cases interleaved run by run (so other work on the machine weighs on each alike);
reported as tokens per second and the ratio to `off`. SmolLM2 is its shapes with random weights
(model/checkpoints/random_shapes.py), adapters random of the full rank.

One run each (CPU, 2 cores shared with other work: 1-minute load average 12.1 at the end of the
tiny run, 7.2 at the end of SmolLM2's, 7-15 during; defaults, SmolLM2 with --repeat 10):

    model    step          off tok/s   none   mixed   none/off  mixed/off   load (end; during)
    tiny     decode b64       2552     2300    2424     0.90       0.95      12.1 (10-15)
    tiny     extend 1024      4467     2512    2536     0.56       0.57      12.1 (10-15)
    SmolLM2  decode b64        110       96      98     0.88       0.89       7.2 (7-15)
    SmolLM2  extend 1024       250      215     211     0.86       0.84       7.2 (7-15)

  The pool holds 5 slots (4 adapters + none) of rank 16 on every projection: 5.5 MiB (tiny),
  93 MiB (SmolLM2, f32). The dense product costs every slot's rank (5 x 16 = 80 columns) per
  projection whatever the row's adapter, so it weighs most on a model this narrow (tiny: hidden
  256, where 80 columns are a third of a projection; SmolLM2: hidden 576, 12-16%); rows without
  an adapter cost the same as rows with one (one program for every mix).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PAGE, CTX = 16, 128


def _model(name: str) -> Path:
    if name == "tiny":
        from ringserve.model.checkpoints.tiny import tiny_model_path

        return tiny_model_path("llama")
    from ringserve.model.checkpoints.random_shapes import random_model

    return random_model("smollm2-135m")


def run(model: str, rank: int, adapters: int, repeat: int, gather: bool = False) -> list[dict[str, Any]]:
    import os

    from ringserve.model.checkpoints.peft import TARGET_MODULES, read_adapter
    from ringserve.model.checkpoints.tiny_lora import make_tiny_lora
    from ringserve.model.compute.step_inputs import DeviceRow
    from ringserve.model.families import read_config
    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

    base = _model(model)
    mc = read_config(base)
    per = CTX // PAGE + 1
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64 * per + 1024 // PAGE + 16, max_context_len=1024, max_batch=64,
                         max_extend_tokens=1024, precompile=False)  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = min(mc.vocab_size, 2000)
    contexts = [rng.integers(3, vocab, CTX).astype(np.int32) for _ in range(64)]
    ext_pages = np.arange(1 + 64 * per, 1 + 64 * per + 1024 // PAGE + 8, dtype=np.int32)
    ext_ids = [rng.integers(3, vocab, 128).astype(np.int32) for _ in range(8)]
    rows_out: list[dict[str, Any]] = []

    def prepared(ex: ModelExecutor, slots: list[int]) -> dict[str, list[Any]]:
        """The decode rows (their contexts' KV written) and the extend rows of one case."""
        dec = []
        for i in range(64):
            pages = np.arange(1 + i * per, 1 + (i + 1) * per, dtype=np.int32)
            ex.run([DeviceRow(contexts[i], 0, pages, lora_slot=slots[i])])
            dec.append(DeviceRow(np.array([5], np.int32), CTX, pages, lora_slot=slots[i]))
        # 8 rows of 128 tokens, each in its own run of pages (the KV written is never read back)
        ext = [DeviceRow(ids, 0, ext_pages[i * 8 : (i + 1) * 8], lora_slot=slots[i]) for i, ids in enumerate(ext_ids)]
        return {"decode b64": dec, "extend 1024": ext}

    plain = ModelExecutor(base, cfg)
    with tempfile.TemporaryDirectory() as d:
        ex = ModelExecutor(base, dataclasses.replace(cfg, lora_slots=adapters + 1, lora_rank=rank,
                                                     lora_targets=TARGET_MODULES, lora_gather=gather))  # fmt: skip
        assert ex.lora is not None
        for s in range(1, adapters + 1):
            ex.lora.write(s, read_adapter(make_tiny_lora(Path(d) / f"a{s}", base, rank=rank, seed=s), mc, rank, TARGET_MODULES))
        pool_mb = ex.lora.nbytes() / 2**20
    cases = {"off": (plain, prepared(plain, [0] * 64)), "none": (ex, prepared(ex, [0] * 64)),
             "mixed": (ex, prepared(ex, [i % (adapters + 1) for i in range(64)]))}  # fmt: skip
    tok_s: dict[str, dict[str, float]] = {}
    for step, n_tokens in (("decode b64", 64), ("extend 1024", 1024)):
        for e, rows in cases.values():  # compile, warm
            for _ in range(2):
                e.run(rows[step])[0].tokens.block_until_ready()
        times: dict[str, list[float]] = {c: [] for c in cases}
        for _ in range(repeat):  # the cases interleaved: load from other work hits each alike
            for c, (e, rows) in cases.items():
                t0 = time.perf_counter()
                e.run(rows[step])[0].tokens.block_until_ready()
                times[c].append(time.perf_counter() - t0)
        tok_s[step] = {c: n_tokens / statistics.median(v) for c, v in times.items()}
    off = {step: v["off"] for step, v in tok_s.items()}
    none = {step: v["none"] for step, v in tok_s.items()}
    mixed = {step: v["mixed"] for step, v in tok_s.items()}
    for step in off:
        rows_out.append({"model": model, "step": step, "off_tok_s": off[step], "none_tok_s": none[step],
                         "mixed_tok_s": mixed[step], "none_over_off": none[step] / off[step],
                         "mixed_over_off": mixed[step] / off[step], "pool_MiB": round(pool_mb, 1),
                         "load_avg": os.getloadavg()[0]})  # fmt: skip
        print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.lora", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--gather", action="store_true", help="the product's gather form (model/weights/lora.py)")
    a = ap.parse_args(argv)
    rows = run(a.model, a.rank, a.adapters, a.repeat, a.gather)
    print(f"\nLoRA vs no adapters ({a.model}, rank {a.rank}, {a.adapters} adapters on all 7 projections), tokens/s:")
    print(f"{'step':12s} {'off':>10s} {'none':>10s} {'mixed':>10s} {'none/off':>9s} {'mixed/off':>9s} {'load':>5s}")
    for r in rows:
        print(f"{r['step']:12s} {r['off_tok_s']:10.0f} {r['none_tok_s']:10.0f} {r['mixed_tok_s']:10.0f} "
              f"{r['none_over_off']:9.2f} {r['mixed_over_off']:9.2f} {r['load_avg']:5.1f}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
